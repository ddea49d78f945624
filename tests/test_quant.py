"""TriAxialKV formats: round-trip bounds (every element within half a quantization
step of its group), the documented packing layout, and the quantized decode kernel
(interpret) vs its reference and a float64 oracle.

Attention-output error is not asserted on i.i.d. random data here: it is measured
per format on K/V captured from the embedded model by ``train/calibrate_triaxial.py``
(``attention_error`` in ``jaxkv/assets/embedded-agent/triaxial.json``)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.pallas import (
    dequantize_int2_keys,
    dequantize_rows,
    quantize_int2_keys,
    quantize_int2_pool,
    quantize_int2_values,
    quantize_int4,
    quantize_int4_pool,
    quantized_decode_attention,
)
from jaxkv.pallas.testing import attention_f64, live_lists, rel_err


def _awkward(rng, shape):
    """Gaussian rows with per-group scales and offsets, a constant group and an offset group."""
    x = rng.standard_normal(shape) * rng.uniform(0.01, 8, shape[:-1] + (1,)) + rng.uniform(-5, 5, shape[:-1] + (1,))
    x = x.reshape(-1, shape[-1])
    x[0, :32] = 1.2345  # constant group
    x[1, :] = 100.0 + 1e-3 * rng.standard_normal(shape[-1])  # tiny range far from zero
    return x.reshape(shape).astype(np.float32)


def _decode_np(data, bits):
    """Codes from packed bytes, written from the module docstring's layout."""
    data = np.asarray(data).astype(np.int64)
    per, R = 8 // bits, data.shape[-1]
    out = np.zeros(data.shape[:-1] + (R * per,), np.int64)
    for i in range(per):
        out[..., i * R : (i + 1) * R] = (data >> (bits * i)) & ((1 << bits) - 1)
    return out


def _bound(scale, zero, top):
    s, z = np.asarray(scale, np.float64), np.asarray(zero, np.float64)
    return s / 2 + 2.0**-20 * (np.abs(z) + top * s)


@pytest.mark.parametrize("bits", [4, 2])
def test_per_token_roundtrip_and_layout(bits):
    rng = np.random.default_rng(bits)
    x = _awkward(rng, (96, 2, 128))
    p = quantize_int4(x) if bits == 4 else quantize_int2_values(x)
    assert p.data.dtype == np.uint8 and p.data.shape == (96, 2, 128 * bits // 8)
    assert p.scale.dtype == np.float16 and p.scale.shape == (96, 2, 4) == p.zero.shape
    err = np.abs(np.asarray(dequantize_rows(p), np.float64) - x).reshape(96, 2, 4, 32)
    assert (err <= _bound(p.scale, p.zero, 2**bits - 1)[..., None]).all()
    want = np.asarray(p.zero, np.float64)[..., None] + _decode_np(p.data, bits).reshape(96, 2, 4, 32) * np.asarray(
        p.scale, np.float64
    )[..., None]
    np.testing.assert_allclose(np.asarray(dequantize_rows(p)).reshape(96, 2, 4, 32), want, rtol=1e-6, atol=1e-6)


def test_int2_keys_per_channel_roundtrip_and_layout():
    rng = np.random.default_rng(0)
    k = _awkward(rng, (96, 2, 64))  # 3 pages
    p = quantize_int2_keys(k)
    assert p.data.dtype == np.uint8 and p.data.shape == (3, 2, 32, 16)
    assert p.scale.dtype == np.float16 and p.scale.shape == (3, 2, 64) == p.zero.shape
    deq = np.asarray(dequantize_int2_keys(p), np.float64)  # [P, K, 32, D]
    x_pages = k.reshape(3, 32, 2, 64).transpose(0, 2, 1, 3)
    assert (np.abs(deq - x_pages) <= _bound(p.scale, p.zero, 3)[:, :, None, :]).all()
    want = np.asarray(p.zero, np.float64)[:, :, None] + _decode_np(p.data, 2) * np.asarray(p.scale, np.float64)[:, :, None]
    np.testing.assert_allclose(deq, want, rtol=1e-6, atol=1e-6)


def test_quantize_rejects_bad_shapes():
    with pytest.raises(ValueError, match="head_dim divisible by 32, got 48"):
        quantize_int4(np.zeros((4, 2, 48), np.float32))
    with pytest.raises(ValueError, match=r"token count divisible by 32, got shape \(40, 2, 64\)"):
        quantize_int2_keys(np.zeros((40, 2, 64), np.float32))


def _mixed_problem(seed, K, G, D, pages, tokens, qdtype):
    """Pools from random data; request b reads pages[b] INT2 pages then tokens[b] INT4 slots."""
    rng = np.random.default_rng(seed)
    P2, S4 = max(pages) + 8, max(tokens) + 40
    kv = lambda n: rng.standard_normal((n, K, D)).astype(np.float32)
    pool2, pool4 = quantize_int2_pool(kv(P2 * 32), kv(P2 * 32)), quantize_int4_pool(kv(S4), kv(S4))
    page_ids, num_pages = live_lists(rng, pages, max(pages), P2 + 1)
    page_ids -= 1  # pages have no sentinel
    slot_ids, num_slots = live_lists(rng, tokens, max(tokens), S4)
    q = jnp.asarray(rng.standard_normal((len(pages), K * G, D)), qdtype)
    return q, pool2, jnp.asarray(page_ids), jnp.asarray(num_pages), pool4, jnp.asarray(slot_ids), jnp.asarray(num_slots)


def _oracle(q, pool2, page_ids, num_pages, pool4, slot_ids, num_slots):
    """float64 attention over entries dequantized by the numpy layout decoder."""
    D = q.shape[-1]

    def rows(p, bits):
        codes = _decode_np(p.data, bits).reshape(p.data.shape[:-1] + (D // 32, 32))
        return (np.asarray(p.zero, np.float64)[..., None] + codes * np.asarray(p.scale, np.float64)[..., None]).reshape(
            p.data.shape[:-1] + (D,)
        )

    k4, v4 = rows(pool4.k, 4), rows(pool4.v, 4)
    k2 = np.asarray(pool2.k.zero, np.float64)[:, :, None] + _decode_np(pool2.k.data, 2) * np.asarray(
        pool2.k.scale, np.float64
    )[:, :, None]
    v2 = rows(pool2.v, 2)
    tok = lambda a: a.transpose(0, 2, 1, 3).reshape(-1, a.shape[1], D)  # [P,K,32,D] -> [32P,K,D]
    k2, v2 = tok(k2), tok(v2)
    outs = []
    for b in range(q.shape[0]):
        pg = np.asarray(page_ids)[b, : int(num_pages[b])]
        t2 = (pg[:, None] * 32 + np.arange(32)).reshape(-1)
        t4 = np.asarray(slot_ids)[b, : int(num_slots[b])]
        k = np.concatenate([k2[t2], k4[t4]])
        v = np.concatenate([v2[t2], v4[t4]])
        outs.append(attention_f64(np.asarray(q[b], np.float64), k, v))
    return np.stack(outs)


@pytest.mark.parametrize("D,G,qdtype,tol", [(128, 2, jnp.float32, 1e-5), (64, 8, jnp.bfloat16, 2e-2)])
def test_quantized_kernel_matches_reference_and_f64(D, G, qdtype, tol):
    # (INT2 pages, INT4 tokens): INT4 only, one token, page boundaries, long mixed.
    pages, tokens = (0, 3, 1, 40, 0), (33, 1, 32, 1000, 31)
    args = _mixed_problem(D + G, 2, G, D, pages, tokens, qdtype)
    out = quantized_decode_attention(*args, backend="interpret")
    assert out.dtype == qdtype and np.isfinite(np.asarray(out, np.float32)).all()
    ref = quantized_decode_attention(*args, backend="reference")
    assert rel_err(out, ref) <= tol
    want = _oracle(*args)
    for b in range(len(pages)):
        assert rel_err(np.asarray(out[b], np.float32), want[b]) <= tol, b
    # Without an INT2 pool the INT2 part is skipped; requests 0 and 4 had no pages anyway.
    q, _, _, _, pool4, slots, n = args
    out4 = quantized_decode_attention(q, None, None, None, pool4, slots, n, backend="interpret")
    assert rel_err(out4, quantized_decode_attention(q, None, None, None, pool4, slots, n)) <= tol
    assert rel_err(out4[0::4], out[0::4]) <= tol


def test_masked_int2_pages_and_float_part_match_f64():
    """Per-page token masks (rows a request evicted) and the full-precision part
    (KIVI's residual): kernel (interpret) = reference = float64 oracle."""
    rng = np.random.default_rng(7)
    K, G, D = 2, 2, 64
    kv = lambda n: rng.standard_normal((n, K, D)).astype(np.float32)
    pool2, pool4 = quantize_int2_pool(kv(6 * 32), kv(6 * 32)), quantize_int4_pool(kv(50), kv(50))
    fk, fv = kv(40), kv(40)
    pages = np.array([[1, 3, 0], [2, 5, 4]], np.int32)
    npg = np.array([2, 3], np.int32)
    mask = np.array([[0xFFFF0000, 0x1, 0], [0xFFFFFFFF, 0x80000000, 0x00F0]], np.uint32)
    i4, n4 = np.array([[3, 7, 9, 0], [1, 2, 0, 0]], np.int32), np.array([3, 2], np.int32)
    fi, nf = np.array([[5, 6], [7, 0]], np.int32), np.array([2, 1], np.int32)
    q = jnp.asarray(rng.standard_normal((2, K * G, D)), jnp.float32)
    args = (q, pool2, jnp.asarray(pages), jnp.asarray(npg), pool4, jnp.asarray(i4), jnp.asarray(n4))
    kw = dict(int2_mask_BP=jnp.asarray(mask), float_pool=(jnp.asarray(fk), jnp.asarray(fv)),
              float_idx_BN=jnp.asarray(fi), float_len_B=jnp.asarray(nf))
    ref = quantized_decode_attention(*args, **kw, backend="reference")
    out = quantized_decode_attention(*args, **kw, backend="interpret")
    tok = lambda a: np.asarray(a, np.float64).transpose(0, 2, 1, 3).reshape(-1, K, D)
    k2, v2 = tok(dequantize_int2_keys(pool2.k)), tok(dequantize_rows(pool2.v))
    k4, v4 = np.asarray(dequantize_rows(pool4.k), np.float64), np.asarray(dequantize_rows(pool4.v), np.float64)
    for b in range(2):
        t2 = [p * 32 + t for p, m in zip(pages[b, : npg[b]], mask[b]) for t in range(32) if (int(m) >> t) & 1]
        k = np.concatenate([k2[t2], k4[i4[b, : n4[b]]], fk[fi[b, : nf[b]]]])
        v = np.concatenate([v2[t2], v4[i4[b, : n4[b]]], fv[fi[b, : nf[b]]]])
        want = attention_f64(np.asarray(q[b], np.float64), k, v)
        assert rel_err(out[b], want) <= 1e-5 and rel_err(ref[b], want) <= 1e-5


def test_quantized_bad_inputs():
    q, pool2, pages, npg, pool4, slots, n = _mixed_problem(6, 2, 2, 64, (1, 2), (3, 4), jnp.float32)
    with pytest.raises(TypeError, match="int4_pool must be an Int4Pool, got Int2Pool"):
        quantized_decode_attention(q, pool2, pages, npg, pool2, slots, n)
    with pytest.raises(ValueError, match=r"live_idx must be \[B=2, N\], got shape \(2,\)"):
        quantized_decode_attention(q, pool2, pages[:, 0], npg, pool4, slots, n)
    with pytest.raises(ValueError, match=r"q head_dim 32 .* != INT4 pool head_dim 64"):
        quantized_decode_attention(q[..., :32], pool2, pages, npg, pool4, slots, n)
