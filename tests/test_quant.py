"""TriAxialKV formats: round-trip bounds (every element within half a quantization
step of its group), the documented packing layout, and the quantized decode Pallas
kernel (TPU interpreter) vs its reference and a float64 oracle.

Attention-output error is not asserted on i.i.d. random data here: it is measured
per format on K/V captured from the embedded model by ``train/calibrate_triaxial.py``
(``attention_error`` in ``jaxkv/assets/embedded-agent/triaxial.json``)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.kernels import (
    dequantize_int2_keys,
    dequantize_rows,
    quantize_int2_keys,
    quantize_int2_values,
    quantize_int4,
    quantized_decode_attention,
)
from jaxkv.kernels.testing import (
    decode_codes_np,
    int4_fit_np,
    int4_write_problem,
    masked_float_problem,
    mixed_quantized_problem,
    quantized_attention_f64,
    rel_err,
)


def _awkward(rng, shape):
    """Gaussian rows with per-group scales and offsets, a constant group and an offset group."""
    x = rng.standard_normal(shape) * rng.uniform(0.01, 8, shape[:-1] + (1,)) + rng.uniform(-5, 5, shape[:-1] + (1,))
    x = x.reshape(-1, shape[-1])
    x[0, :32] = 1.2345  # constant group
    x[1, :] = 100.0 + 1e-3 * rng.standard_normal(shape[-1])  # tiny range far from zero
    return x.reshape(shape).astype(np.float32)


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
    want = (
        np.asarray(p.zero, np.float64)[..., None]
        + decode_codes_np(p.data, bits).reshape(96, 2, 4, 32) * np.asarray(p.scale, np.float64)[..., None]
    )
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
    want = np.asarray(p.zero, np.float64)[:, :, None] + decode_codes_np(p.data, 2) * np.asarray(p.scale, np.float64)[:, :, None]
    np.testing.assert_allclose(deq, want, rtol=1e-6, atol=1e-6)


def test_int4_codes_equal_the_float32_oracle_on_ties():
    """Codes, scales and zeros bit for bit as ``int4_fit_np`` (IEEE division), ties included.

    This problem holds two groups whose ratio is exactly k + 0.5: XLA's rewrite of a
    division by a broadcast scale into a product with its reciprocal rounded both to the
    other code, and the Triton write kernel (an IEEE division) then disagreed with the
    reference (found by the device check on an H200)."""
    _, _, x = int4_write_problem(4, 512, 8, 128, 1024, jnp.bfloat16)
    codes, scale, zero = int4_fit_np(x)
    ties = np.isclose(np.modf(np.asarray(_ratios(x, scale, zero)))[0], 0.5, rtol=0, atol=0)
    assert ties.sum() >= 2  # the premise: the problem has exact ties
    got = quantize_int4(x)
    assert np.array_equal(np.asarray(got.scale), scale) and np.array_equal(np.asarray(got.zero), zero)
    assert np.array_equal(decode_codes_np(np.asarray(got.data), 4), codes)


def _ratios(x, scale, zero):
    g = np.asarray(jnp.asarray(x, jnp.float32)).reshape(*x.shape[:-1], -1, 32)
    s = scale.astype(np.float32)
    return (g - zero.astype(np.float32)[..., None]) / np.where(s > 0, s, np.float32(1))[..., None]


def test_four_bit_key_pages_roundtrip_and_layout():
    """KIVI-4's pages: the INT2 page format with 4-bit codes (``D/2`` bytes a row)."""
    rng = np.random.default_rng(1)
    k = _awkward(rng, (64, 2, 64))  # 2 pages
    p = quantize_int2_keys(k, 4)
    assert p.bits == 4 and p.data.shape == (2, 2, 32, 32) and p.scale.shape == (2, 2, 64)
    deq = np.asarray(dequantize_int2_keys(p), np.float64)
    x_pages = k.reshape(2, 32, 2, 64).transpose(0, 2, 1, 3)
    assert (np.abs(deq - x_pages) <= _bound(p.scale, p.zero, 15)[:, :, None, :]).all()
    want = np.asarray(p.zero, np.float64)[:, :, None] + decode_codes_np(p.data, 4) * np.asarray(p.scale, np.float64)[:, :, None]
    np.testing.assert_allclose(deq, want, rtol=1e-6, atol=1e-6)
    two = np.asarray(dequantize_int2_keys(quantize_int2_keys(k)), np.float64)
    assert np.abs(deq - x_pages).mean() < np.abs(two - x_pages).mean() / 3  # 15 steps instead of 3


@pytest.mark.parametrize("masked", [False, True])
def test_four_bit_pages_decode_matches_reference_and_f64(masked):
    """Decode attention over KIVI-4's pages: kernel (interpret) = reference = float64
    oracle, with and without per-page token masks and the float part."""
    if masked:
        args, kw, want = masked_float_problem(11, page_bits=4)
    else:
        pages, tokens = (0, 3, 5), (33, 1, 70)  # 70 > one 64-token block
        args, kw = mixed_quantized_problem(9, 2, 2, 64, pages, tokens, jnp.float32, page_bits=4), {}
        want = quantized_attention_f64(*args)
    assert args[1].bits == 4
    ref = quantized_decode_attention(*args, **kw, backend="reference")
    out = quantized_decode_attention(*args, **kw, backend="interpret")
    for b, w in enumerate(want):
        assert rel_err(out[b], w) <= 1e-5 and rel_err(ref[b], w) <= 1e-5, b


def test_quantize_rejects_bad_shapes():
    with pytest.raises(ValueError, match="head_dim divisible by 32, got 48"):
        quantize_int4(np.zeros((4, 2, 48), np.float32))
    with pytest.raises(ValueError, match=r"token count divisible by 32, got shape \(40, 2, 64\)"):
        quantize_int2_keys(np.zeros((40, 2, 64), np.float32))


@pytest.mark.parametrize("D,G,qdtype,tol", [(128, 2, jnp.float32, 1e-5), (64, 8, jnp.bfloat16, 2e-2)])
def test_quantized_kernel_matches_reference_and_f64(D, G, qdtype, tol):
    # (INT2 pages, INT4 tokens): INT4 only, one token, page boundaries, long mixed (5 pages
    # over 3 of the 4 page splits; 70 tokens: two 64-token blocks). Interpret
    # mode simulates a DMA per listed entry of every request, so the longest sets the cost.
    pages, tokens = (0, 3, 1, 5, 0), (33, 1, 32, 70, 31)
    args = mixed_quantized_problem(D + G, 2, G, D, pages, tokens, qdtype)
    out = quantized_decode_attention(*args, backend="interpret")
    assert out.dtype == qdtype and np.isfinite(np.asarray(out, np.float32)).all()
    ref = quantized_decode_attention(*args, backend="reference")
    assert rel_err(out, ref) <= tol
    want = quantized_attention_f64(*args)
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
    args, kw, want = masked_float_problem(7)
    ref = quantized_decode_attention(*args, **kw, backend="reference")
    out = quantized_decode_attention(*args, **kw, backend="interpret")
    for b, w in enumerate(want):
        assert rel_err(out[b], w) <= 1e-5 and rel_err(ref[b], w) <= 1e-5


def test_quantized_bad_inputs():
    q, pool2, pages, npg, pool4, slots, n = mixed_quantized_problem(6, 2, 2, 64, (1, 2), (3, 4), jnp.float32)
    with pytest.raises(TypeError, match="int4_pool must be an Int4Pool, got Int2Pool"):
        quantized_decode_attention(q, pool2, pages, npg, pool2, slots, n)
    with pytest.raises(ValueError, match=r"live_idx must be \[B=2, N\], got shape \(2,\)"):
        quantized_decode_attention(q, pool2, pages[:, 0], npg, pool4, slots, n)
    with pytest.raises(ValueError, match=r"q head_dim 32 .* != INT4 pool head_dim 64"):
        quantized_decode_attention(q[..., :32], pool2, pages, npg, pool4, slots, n)
