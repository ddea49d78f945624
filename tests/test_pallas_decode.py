"""Decode attention kernel (interpret mode) vs the jnp reference and a float64 oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from jaxkv.attention import decode_attention_reference
from jaxkv.pallas import decode_attention, resolve_backend
from jaxkv.pallas.testing import attention_f64, live_lists, rel_err

LENGTHS = (1, 31, 32, 33, 1000, 4097)  # short and long requests in one batch
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def _problem(seed, K, G, D, dtype, lengths=LENGTHS):
    rng = np.random.default_rng(seed)
    S = max(lengths) + 64
    idx, lens = live_lists(rng, lengths, max(lengths), S)
    k = rng.standard_normal((S, K, D)).astype(np.float32)
    v = rng.standard_normal((S, K, D)).astype(np.float32)
    q = rng.standard_normal((len(lengths), K * G, D)).astype(np.float32)
    cast = lambda a: jnp.asarray(a).astype(dtype)
    return cast(q), cast(k), cast(v), jnp.asarray(idx), jnp.asarray(lens)


def test_interpret_mode_poisons_outputs():
    """The premise of every kernel test: an unwritten output block reads back NaN."""
    out = pl.pallas_call(lambda o_ref: None, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32), interpret=True)()
    assert np.isnan(np.asarray(out)).all()


@pytest.mark.parametrize(
    "D,G,dtype", [(64, 1, jnp.float32), (128, 2, jnp.bfloat16), (64, 4, jnp.bfloat16), (128, 8, jnp.float32)]
)
def test_kernel_matches_reference_and_f64(D, G, dtype):
    K = 2
    q, k, v, idx, lens = _problem(D * 10 + G, K, G, D, dtype)
    out = decode_attention(q, k, v, idx, lens, backend="interpret")
    assert out.dtype == dtype and out.shape == q.shape
    assert np.isfinite(np.asarray(out, np.float32)).all()
    ref = decode_attention_reference(q, k, v, idx, lens)
    assert rel_err(out, ref) <= TOL[dtype]
    f32 = lambda a: np.asarray(a, np.float32)
    for b, n in enumerate(np.asarray(lens)):
        rows = np.asarray(idx)[b, :n]
        want = attention_f64(f32(q[b]), f32(k)[rows], f32(v)[rows])
        assert rel_err(f32(out[b]), want) <= TOL[dtype], (b, n)


def test_padding_entries_and_order_are_ignored():
    """Shuffling the live list and rewriting its padding changes nothing."""
    q, k, v, idx, lens = _problem(7, 2, 4, 64, jnp.float32, lengths=(40, 300))
    out = decode_attention(q, k, v, idx, lens, backend="interpret")
    rng = np.random.default_rng(1)
    idx2 = np.asarray(idx).copy()
    for b, n in enumerate(np.asarray(lens)):
        idx2[b, :n] = rng.permutation(idx2[b, :n])
        idx2[b, n:] = rng.integers(0, k.shape[0], idx2.shape[1] - n)
    out2 = decode_attention(q, k, v, jnp.asarray(idx2), lens, backend="interpret")
    assert rel_err(out2, out) <= 1e-5


def test_cpu_default_is_the_reference():
    assert resolve_backend(None) == "reference"
    q, k, v, idx, lens = _problem(3, 2, 2, 64, jnp.float32, lengths=(5, 9))
    np.testing.assert_array_equal(
        decode_attention(q, k, v, idx, lens), decode_attention_reference(q, k, v, idx, lens)
    )


def test_bad_inputs_raise_typed_errors():
    q, k, v, idx, lens = _problem(4, 2, 2, 64, jnp.float32, lengths=(5, 9))
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        decode_attention(q, k, v, idx, lens, backend="cuda")
    with pytest.raises(ValueError, match=r"q head_dim 32 .* != pool head_dim 64"):
        decode_attention(q[..., :32], k, v, idx, lens)
    with pytest.raises(ValueError, match=r"not a multiple of pool KV heads 2"):
        decode_attention(q[:, :3], k, v, idx, lens)
    with pytest.raises(ValueError, match=r"k_pool and v_pool must both be \[S, Hkv, D\]"):
        decode_attention(q, k, v[:, :1], idx, lens)
    with pytest.raises(ValueError, match=r"live_idx must be \[B=2, N\], got shape \(3, 9\)"):
        decode_attention(q, k, v, jnp.zeros((3, 9), jnp.int32), lens)
    with pytest.raises(ValueError, match=r"live_len must be \[B=2\]"):
        decode_attention(q, k, v, idx, lens[:1])
    with pytest.raises(TypeError, match="live_idx must be an integer array, got float32"):
        decode_attention(q, k, v, idx.astype(jnp.float32), lens)
    with pytest.raises(TypeError, match="k_pool must be floating"):
        decode_attention(q, k.astype(jnp.int32), v, idx, lens)
