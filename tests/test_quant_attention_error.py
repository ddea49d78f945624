"""The format round trips behind ``eval/quality/quant_attention_error.py`` (issue #26, item 3):
4-bit key pages, KIVI's full-precision window and the page-completion rule, and an
error of zero when nothing is quantized."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from eval.quality import quant_attention_error as qae
from jaxkv.errors import ConfigError
from jaxkv.kernels.quant import dequantize_int2_keys, key_pages_round_trip, quantize_int2_keys


def _keys(T, K=2, D=32, seed=0, outlier=0.0):
    x = np.random.default_rng(seed).standard_normal((T, K, D)).astype(np.float32)
    x[..., 3] *= 1.0 + outlier  # one loud channel, as in SmolLM2's keys
    return jnp.asarray(x)


def test_key_pages_round_trip_is_the_int2_pool_format_at_2_bits_and_finer_at_4():
    k = _keys(96)
    pages = dequantize_int2_keys(quantize_int2_keys(k))  # [P, K, 32, D]
    assert np.array_equal(np.asarray(key_pages_round_trip(k, 2)), np.asarray(pages.transpose(0, 2, 1, 3).reshape(k.shape)))
    err = {b: float(jnp.linalg.norm(key_pages_round_trip(k, b) - k) / jnp.linalg.norm(k)) for b in (2, 3, 4)}
    assert 0 < err[4] < err[3] < err[2] and err[4] < err[2] / 3  # INT3 pages (issue 74) between INT2's and INT4's
    with pytest.raises(ConfigError, match="bits must be one of"):
        key_pages_round_trip(k, 5)


def test_per_channel_pages_beat_per_token_groups_on_an_outlier_channel():
    k = _keys(256, outlier=12.0)
    stats = qae.key_statistics(k[None], 256)
    assert stats["outlier_ratio"][0] > 5
    assert stats["key_err_channel2"][0] < stats["key_err_token2"][0]


@pytest.mark.parametrize("T", [100, 300])
def test_formats_quantize_what_they_say(T):
    k, v = _keys(T + 28, seed=1)[None], _keys(T + 28, seed=2)[None]  # padded past T, as captures are
    same = lambda a, b: np.all(np.asarray(a) == np.asarray(b), axis=(0, 2, 3))  # noqa: E731  per token
    for fmt in ("int4", "int2_token", "int2_pages"):
        k_hat, v_hat = qae.round_trip(fmt, k, v, T)
        assert k_hat.shape == k.shape and not same(k_hat, k)[:T].any(), fmt
    for fmt in ("kivi2", "kivi4"):
        k_hat, v_hat = qae.round_trip(fmt, k, v, T)
        exact = same(k_hat, k) & same(v_hat, v)
        paged = max(T - qae.KIVI_WINDOW, 0) // 32 * 32
        assert not exact[:paged].any() and exact[paged:].all(), fmt  # the window stays full precision
        assert qae.KIVI_WINDOW <= T - paged < qae.KIVI_WINDOW + 32 or paged == 0
    if paged:
        err = {f: float(jnp.linalg.norm(qae.round_trip(f, k, v, T)[0][:, :paged] - k[:, :paged])) for f in ("kivi2", "kivi4")}
        assert 0 < err["kivi4"] < err["kivi2"]


def test_attention_error_is_zero_without_quantization_and_positive_with():
    rng = np.random.default_rng(3)
    L, T, K, G, D = 2, 64, 2, 2, 32
    q = jnp.asarray(rng.standard_normal((L, T, K * G, D)).astype(np.float32))
    k, v = (jnp.asarray(rng.standard_normal((L, T, K, D)).astype(np.float32)) for _ in range(2))
    from jaxkv.attention import causal_attention

    o = jnp.stack([causal_attention(q[i][None], k[i][None], v[i][None])[0] for i in range(L)])
    ok = jnp.asarray(np.arange(T) < 50)
    rel, last = qae.attention_error(q, k, v, o, ok)
    assert np.allclose(rel, 0, atol=1e-6) and np.allclose(last, 0, atol=1e-6)
    k4, v4 = qae.round_trip("int4", k, v, 50)
    rel, last = qae.attention_error(q, k4, v4, o, ok)
    assert (np.asarray(rel) > 1e-3).all() and (np.asarray(last) > 1e-4).all()
