"""Helpers shared by the kernel tests (Pallas and Triton) and ``eval/bench/kernels.py``.

* ``rel_err``: max-abs error relative to the reference's max-abs value.
* ``attention_f64``: float64 numpy decode attention over explicit K/V rows, an
  oracle independent of ``jaxkv.attention``.
* ``live_lists``: random live-index lists (random slot order, never slot 0,
  padding entries pointing at real slots so reading them would change results).
* ``decode_problem``: a float pool, queries and live lists for a mixed batch.
* ``decode_codes_np`` / ``mixed_quantized_problem`` / ``quantized_attention_f64``:
  INT2/INT4 pools from random data and a float64 oracle that decodes the packed
  bytes with numpy, from the layout documented in ``jaxkv.kernels.quant`` (not with
  jaxkv's own dequantizers).
* ``masked_float_problem``: the optional parts of the engine's dual pool (INT2
  pages with per-request token masks, a float part) and their float64 oracle.
* ``request_errors``: the worst request's ``rel_err`` against per-request oracles.
* ``rope_delta_problem`` / ``int4_write_problem``: inputs of the RoPE delta
  rotation and of the INT4 quantizing write, from random data.
* ``int4_fit_np``: per-token INT4 codes and parameters in numpy float32 (IEEE
  division, float16 steps by ``nextafter``), the oracle both quantizers must equal.
* ``LLAMA3_ROPE``: Llama-3 RoPE scaling, the hardest frequencies the rotation kernels see.
* ``TOL`` / ``tolerance``: the error each kernel test allows per query dtype.
* ``ragged_problem`` / ``ragged_f64``: a ragged step (rows mixing prefill chunks
  and decode tokens, absent rows, shuffled flat order, padding tokens, lists of
  scattered slots with garbage past ``kv_len``) and its float64 oracle, one
  ``attention_f64`` per flat token over the entries its query sees.

``eval/device/check.py`` runs these same problems and bounds on a GPU, at
production shapes, so the CPU tests and the device check test one thing.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxkv.config import RopeConfig

LLAMA3_ROPE = RopeConfig(
    theta=500000, rope_type="llama3", factor=8, low_freq_factor=1, high_freq_factor=4,
    original_max_position_embeddings=8192,
)  # fmt: skip


TOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 2e-2}  # by query dtype


def tolerance(dtype) -> float:
    """The kernel tests' error bound for queries of ``dtype`` (``TOL``)."""
    return TOL[jnp.dtype(dtype)]


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


def attention_f64(q_HD, k_NKD, v_NKD) -> np.ndarray:
    """softmax(q k^T / sqrt(D)) v for one request, GQA, in float64: ``[Hq, D]``."""
    q = np.asarray(q_HD, np.float64)
    k, v = np.asarray(k_NKD, np.float64), np.asarray(v_NKD, np.float64)
    Hq, D = q.shape
    K = k.shape[1]
    qg = q.reshape(K, Hq // K, D)
    s = np.einsum("kgd,nkd->kgn", qg, k) / np.sqrt(D)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("kgn,nkd->kgd", p, v).reshape(Hq, D)


def request_errors(out_BHD, wants) -> float:
    """Worst ``rel_err`` of ``out[b]`` against ``wants[b]`` (requests whose oracle is ``None`` skipped)."""
    return max(rel_err(np.asarray(out_BHD[b], np.float32), want) for b, want in enumerate(wants) if want is not None)


def live_lists(rng: np.random.Generator, lengths, width: int, num_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """``(live_idx [B, width] int32, live_len [B] int32)`` of random distinct slots >= 1."""
    idx = np.stack([rng.permutation(num_slots - 1)[:width] + 1 for _ in lengths]).astype(np.int32)
    return idx, np.asarray(lengths, np.int32)


def decode_problem(seed, K, G, D, dtype, lengths):
    """``(q [B, K*G, D], k_pool, v_pool [S, K, D], live_idx, live_len)`` in ``dtype``; one request per length."""
    rng = np.random.default_rng(seed)
    S = max(lengths) + 64
    idx, lens = live_lists(rng, lengths, max(max(lengths), 1), S)
    k = rng.standard_normal((S, K, D)).astype(np.float32)
    v = rng.standard_normal((S, K, D)).astype(np.float32)
    q = rng.standard_normal((len(lengths), K * G, D)).astype(np.float32)
    cast = lambda a: jnp.asarray(a).astype(dtype)
    return cast(q), cast(k), cast(v), jnp.asarray(idx), jnp.asarray(lens)


def decode_f64(q_BHD, k_pool_SKD, v_pool_SKD, live_idx_BN, live_len_B) -> list[np.ndarray]:
    """``attention_f64`` of every request with at least one entry (``None`` for empty ones)."""
    f32 = lambda a: np.asarray(a, np.float32)
    k, v, idx = f32(k_pool_SKD), f32(v_pool_SKD), np.asarray(live_idx_BN)
    return [attention_f64(f32(q_BHD[b]), k[idx[b, :n]], v[idx[b, :n]]) if n else None for b, n in enumerate(np.asarray(live_len_B))]


def decode_codes_np(data, bits):
    """Codes from packed bytes, written from ``jaxkv.kernels.quant``'s documented layout."""
    data = np.asarray(data).astype(np.int64)
    per, R = 8 // bits, data.shape[-1]
    out = np.zeros(data.shape[:-1] + (R * per,), np.int64)
    for i in range(per):
        out[..., i * R : (i + 1) * R] = (data >> (bits * i)) & ((1 << bits) - 1)
    return out


def mixed_quantized_problem(seed, K, G, D, pages, tokens, qdtype, page_bits=2):
    """Pools from random data; request b reads ``pages[b]`` pages (INT2, or
    ``page_bits``) then ``tokens[b]`` INT4 slots.

    Returns the positional arguments of ``quantized_decode_attention``.
    """
    from jaxkv.kernels.quant import quantize_int2_pool, quantize_int4_pool

    rng = np.random.default_rng(seed)
    P2, S4 = max(pages) + 8, max(tokens) + 40
    kv = lambda n: rng.standard_normal((n, K, D)).astype(np.float32)
    pool2, pool4 = quantize_int2_pool(kv(P2 * 32), kv(P2 * 32), page_bits), quantize_int4_pool(kv(S4), kv(S4))
    page_ids, num_pages = live_lists(rng, pages, max(max(pages), 1), P2 + 1)
    page_ids -= 1  # pages have no sentinel
    slot_ids, num_slots = live_lists(rng, tokens, max(max(tokens), 1), S4)
    q = jnp.asarray(rng.standard_normal((len(pages), K * G, D)), qdtype)
    return q, pool2, jnp.asarray(page_ids), jnp.asarray(num_pages), pool4, jnp.asarray(slot_ids), jnp.asarray(num_slots)


def quantized_attention_f64(q, pool2, page_ids, num_pages, pool4, slot_ids, num_slots) -> np.ndarray:
    """float64 attention over entries dequantized by ``decode_codes_np``: ``[B, Hq, D]``."""
    D = q.shape[-1]

    def rows(p, bits):
        codes = decode_codes_np(p.data, bits).reshape(p.data.shape[:-1] + (D // 32, 32))
        return (np.asarray(p.zero, np.float64)[..., None] + codes * np.asarray(p.scale, np.float64)[..., None]).reshape(
            p.data.shape[:-1] + (D,)
        )

    k4, v4 = rows(pool4.k, 4), rows(pool4.v, 4)
    k2 = (
        np.asarray(pool2.k.zero, np.float64)[:, :, None]
        + decode_codes_np(pool2.k.data, pool2.k.bits) * np.asarray(pool2.k.scale, np.float64)[:, :, None]
    )
    v2 = rows(pool2.v, pool2.v.bits)
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


def masked_float_problem(seed, K=2, G=2, D=64, page_bits=2):
    """``(args, kwargs, want)`` of ``quantized_decode_attention`` for two requests
    with masked INT2 pages (a partly kept page, a page keeping one token, a page
    kept whole) and a float part; ``want[b]`` is the float64 attention over the
    kept INT2 tokens, the INT4 tokens and the float tokens of request ``b``."""
    from jaxkv.kernels.quant import dequantize_int2_keys, dequantize_rows, quantize_int2_pool, quantize_int4_pool

    rng = np.random.default_rng(seed)
    kv = lambda n: rng.standard_normal((n, K, D)).astype(np.float32)
    pool2, pool4 = quantize_int2_pool(kv(6 * 32), kv(6 * 32), page_bits), quantize_int4_pool(kv(50), kv(50))
    fk, fv = kv(40), kv(40)
    pages, npg = np.array([[1, 3, 0], [2, 5, 4]], np.int32), np.array([2, 3], np.int32)
    mask = np.array([[0xFFFF0000, 0x1, 0], [0xFFFFFFFF, 0x80000000, 0x00F0]], np.uint32)
    i4, n4 = np.array([[3, 7, 9, 0], [1, 2, 0, 0]], np.int32), np.array([3, 2], np.int32)
    fi, nf = np.array([[5, 6], [7, 0]], np.int32), np.array([2, 1], np.int32)
    q = jnp.asarray(rng.standard_normal((2, K * G, D)), jnp.float32)
    args = (q, pool2, jnp.asarray(pages), jnp.asarray(npg), pool4, jnp.asarray(i4), jnp.asarray(n4))
    kw = dict(
        int2_mask_BP=jnp.asarray(mask),
        float_pool=(jnp.asarray(fk), jnp.asarray(fv)),
        float_idx_BN=jnp.asarray(fi),
        float_len_B=jnp.asarray(nf),
    )
    tok = lambda a: np.asarray(a, np.float64).transpose(0, 2, 1, 3).reshape(-1, K, D)
    k2, v2 = tok(dequantize_int2_keys(pool2.k)), tok(dequantize_rows(pool2.v))
    k4, v4 = np.asarray(dequantize_rows(pool4.k), np.float64), np.asarray(dequantize_rows(pool4.v), np.float64)
    want = []
    for b in range(2):
        t2 = [p * 32 + t for p, m in zip(pages[b, : npg[b]], mask[b]) for t in range(32) if (int(m) >> t) & 1]
        k = np.concatenate([k2[t2], k4[i4[b, : n4[b]]], fk[fi[b, : nf[b]]]])
        v = np.concatenate([v2[t2], v4[i4[b, : n4[b]]], fv[fi[b, : nf[b]]]])
        want.append(attention_f64(np.asarray(q[b], np.float64), k, v))
    return args, kw, want


def rope_delta_problem(seed, shape_LSKD, dtype, moved: int, max_delta: int = 5000):
    """``(pool [L, S, Hkv, D], slots [moved] distinct, delta [moved] in [-max_delta, max_delta))``."""
    rng = np.random.default_rng(seed)
    pool = jnp.asarray(rng.standard_normal(shape_LSKD), dtype)
    slots = jnp.asarray(rng.permutation(shape_LSKD[1])[:moved], jnp.int32)
    delta = jnp.asarray(rng.integers(-max_delta, max_delta, moved), jnp.int32)
    return pool, slots, delta


def int4_write_problem(seed, T, K, D, S, dtype):
    """``(rows, slots [T], x [T, K, D])``: an INT4 ``PackedRows`` of ``S`` slots, ``T``
    distinct slots >= 1, and new rows of varied scale and offset per (row, head), the
    first group of row 0 head 0 constant (its scale must come out 0)."""
    from jaxkv.kernels.quant import quantize_int4

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, K, D)) * rng.uniform(0.01, 8, (T, K, 1)) + rng.uniform(-5, 5, (T, K, 1))
    x[0, 0, :32] = 1.25
    rows = quantize_int4(jnp.asarray(rng.standard_normal((S, K, D)), jnp.float32))
    slots = jnp.asarray(rng.permutation(S - 1)[:T] + 1, jnp.int32)
    return rows, slots, jnp.asarray(x, dtype)


def int4_fit_np(x_TKD) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(codes uint8 [T, K, D], scale f16 [T, K, D/32], zero f16 [T, K, D/32])`` of
    ``jaxkv.kernels.quant``'s per-token INT4 rule, computed in numpy float32: zero is the
    group minimum rounded down to float16, scale ``(max - zero) * float32(1/15)`` rounded
    up, codes ``round_half_even((x - zero) / scale)`` with an IEEE division. Bit for bit
    what ``quantize_rows(x, 4)`` and the Triton write kernel must produce."""
    x = np.asarray(jnp.asarray(x_TKD, jnp.float32))
    T, K, D = x.shape
    g = x.reshape(T, K, D // 32, 32)

    def f16(v, up):
        h = v.astype(np.float16)
        wrong = (h.astype(np.float32) < v) if up else (h.astype(np.float32) > v)
        return np.where(wrong, np.nextafter(h, np.float16(np.inf if up else -np.inf)), h)

    zero = f16(g.min(-1), up=False)
    scale = f16((g.max(-1) - zero.astype(np.float32)) * np.float32(1.0 / 15), up=True)
    s32 = scale.astype(np.float32)
    ratio = (g - zero.astype(np.float32)[..., None]) / np.where(s32 > 0, s32, np.float32(1))[..., None]
    codes = np.where(s32[..., None] > 0, np.clip(np.round(ratio), 0, 15), 0).astype(np.uint8)
    return codes.reshape(T, K, D), scale, zero


def ragged_problem(seed, K, G, D, dtype, rows, *, pad: int = 0, width: int | None = None, shuffle_rows: bool = True):
    """A ragged step (``jaxkv.kernels.attention.ragged``'s arguments) from random data.

    ``rows``: ``(q_len, kv_len)`` per row (``q_len 0``: the row is not in the step;
    ``q_len 1``: a decode row). Flat tokens: the rows' chunks in a random order
    (``shuffle_rows``), then ``pad`` padding tokens. Lists: ``width`` entries
    (default: the longest ``kv_len`` rounded up to 8, plus 8) of distinct random
    slots >= 1 (no two rows share a slot, so no list is contiguous or sorted), the
    entries past ``kv_len`` random slots in ``[0, S)`` (read only for masked
    columns: they must not change the result).

    Returns ``(q [T, K*G, D], k, v [S, K, D], live [R, width], kv_len, q_start, q_len)``.
    """
    rng = np.random.default_rng(seed)
    q_len = np.asarray([r[0] for r in rows], np.int32)
    kv_len = np.asarray([r[1] for r in rows], np.int32)
    assert (q_len <= kv_len).all(), "a row's queries are in its list"
    width = width or -(-max(int(kv_len.max()), 1) // 8) * 8 + 8
    S = int(kv_len.sum()) + 64
    slots = rng.permutation(S - 1) + 1
    live = rng.integers(0, S, (len(rows), width)).astype(np.int32)  # garbage past kv_len
    used = 0
    for r, n in enumerate(kv_len):
        live[r, :n] = slots[used : used + n]
        used += n
    order = rng.permutation(len(rows)) if shuffle_rows else np.arange(len(rows))
    q_start = np.zeros(len(rows), np.int32)
    at = 0
    for r in order:
        q_start[r] = at if q_len[r] else rng.integers(0, max(at, 1))  # an absent row's start is anything
        at += q_len[r]
    T = at + pad
    k = rng.standard_normal((S, K, D)).astype(np.float32)
    v = rng.standard_normal((S, K, D)).astype(np.float32)
    q = rng.standard_normal((T, K * G, D)).astype(np.float32)
    cast = lambda a: jnp.asarray(a).astype(dtype)
    ints = lambda a: jnp.asarray(a, jnp.int32)
    return cast(q), cast(k), cast(v), ints(live), ints(kv_len), ints(q_start), ints(q_len)


def ragged_f64(q_THD, k_SKD, v_SKD, live_RN, kv_len_R, q_start_R, q_len_R) -> np.ndarray:
    """float64 ragged attention, ``[T, Hq, D]``: query ``j`` of row ``r`` over the
    entries ``[0, kv_len - q_len + j + 1)`` of its list, zero at padding tokens."""
    f32 = lambda a: np.asarray(jnp.asarray(a, jnp.float32))
    q, k, v, live = f32(q_THD), f32(k_SKD), f32(v_SKD), np.asarray(live_RN)
    out = np.zeros(q.shape, np.float64)
    for r, (n, start, length) in enumerate(zip(np.asarray(kv_len_R), np.asarray(q_start_R), np.asarray(q_len_R))):
        for j in range(int(length)):
            seen = live[r, : int(n - length + j + 1)]
            out[start + j] = attention_f64(q[start + j], k[seen], v[seen])
    return out
