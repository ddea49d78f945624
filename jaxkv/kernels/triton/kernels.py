"""The Triton kernels of the GPU backend (all ``@triton.jit`` code lives here).

Every kernel takes array pointers (inputs, then outputs, in the order
``jax_triton.triton_call`` passes them) followed by ``tl.constexpr`` parameters
only; shapes are constexprs, so a launch is fully described by its ``Launch``
(``jaxkv.kernels.triton.launch``). Every operation here is one the Triton interpreter
implements for the dtypes used (bfloat16 only loaded, stored, converted to and from
float32, and fed to ``tl.dot``), so the CPU tests run this exact source.

Decode kernels (split-K, grid ``(B, Hkv, P)``): program ``(b, h, s)`` loads the
``G`` query rows of KV head ``h`` as one ``[GP, DP]`` tile (``GP >= 16`` rows for
``tl.dot``, padded rows are zero and never stored), walks entries
``[s*SPLIT, (s+1)*SPLIT)`` of request ``b`` in blocks, gathers K/V rows by slot id
(pointer gathers; rows past ``len`` are masked loads that read nothing) and runs
the online softmax of ``_online_softmax``. It stores the partials of
``jaxkv.kernels._splitk.Partials`` (``acc [B, P, Hq, D]``, ``m``, ``l``), which the
shared log-sum-exp ``merge`` combines. Dots run in the query dtype (bf16 tensor
cores on bf16 models, IEEE fp32 on fp32 ones) with fp32 accumulation; softmax
state is fp32.

* ``decode_float_tokens``: float K/V pools ``[S, Hkv, D]``.
* ``decode_int4_tokens``: INT4 per-token K and V (``jaxkv.kernels.quant`` layout),
  dequantized to a tile in registers: code of channel ``c`` is bit-plane
  ``c // R`` of byte ``c % R`` (``R = D * bits / 8``), group ``c // 32``.
* ``decode_int2_pages``: INT2 pages (per-channel keys, per-token values), two
  pages of 32 tokens per step.
* ``ragged_query_tiles`` (grid ``(tiles, Hkv)``, not split-K): the query tiles of a
  ragged step (``jaxkv.kernels.triton.ragged``). Program ``(t, h)`` reads its tile's
  ``(row, start, count, before)`` and loads ``M`` dot rows: row ``i`` is query
  ``i // G`` of the tile at query head ``h*G + i % G``, so the ``G`` heads of KV
  head ``h`` share each key block. It walks entries ``[0, before + count)`` of its
  row's list in blocks: the blocks every query sees whole (``[0, before + 1)``)
  with unmasked loads and no mask, the rest with the causal mask (row ``i`` sees
  entries below ``before + i // G + 1``) and loads masked at the tile's last
  entry; then writes its real queries' outputs straight into the flat ``[T, Hq,
  D]`` output. Its decode rows run ``decode_float_tokens``.
* ``rope_delta_rows``: rotate the rows at a list of slots by position deltas, in
  place (the pool is aliased to the output).
* ``quantize_int4_rows``: quantize float rows to INT4 per token and write them at
  a list of slots of an ``Int4Pool`` buffer triple, in place; bit-identical to
  ``jaxkv.kernels.quant.quantize_rows`` (directed float16 rounding of scale and
  zero, the range times the float32 reciprocal of 15, IEEE division
  ``(x - zero) / scale``, round-half-even codes).
"""

from __future__ import annotations

import triton
import triton.language as tl

MASKED: tl.constexpr = tl.constexpr(-1e30)
GROUP: tl.constexpr = tl.constexpr(32)
PAGE: tl.constexpr = tl.constexpr(32)


# --------------------------------------------------------------------------- shared pieces


@triton.jit
def _split_bounds(len_ptr, b, s, SPLIT: tl.constexpr):
    """Entries ``[start, stop)`` of split ``s`` of request ``b``."""
    start = s * SPLIT
    return start, tl.minimum(start + SPLIT, tl.load(len_ptr + b))


@triton.jit
def _load_group_queries(q_ptr, b, h, HQ: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr):
    """The ``G`` query rows of KV head ``h`` as a zero-padded ``[GP, DP]`` tile."""
    g = tl.arange(0, GP)
    d = tl.arange(0, DP)
    rows = b * HQ + h * G + g
    return tl.load(q_ptr + rows[:, None] * D + d[None, :], mask=(g < G)[:, None] & (d < D)[None, :], other=0.0)


@triton.jit
def _online_softmax(m, l, scores):
    """One online-softmax step: ``(m_new, l_new, alpha, p)`` for ``scores [GP, T]`` (scaled, masked)."""
    m_new = tl.maximum(m, tl.max(scores, 1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(scores - m_new[:, None])
    return m_new, alpha * l + tl.sum(p, 1), alpha, p


@triton.jit
def _attend_block(q, keys, values, valid, m, l, acc, SCALE: tl.constexpr):
    """Scores of one block of entries, the softmax step, and the value update."""
    scores = tl.dot(q, tl.trans(keys.to(q.dtype)), input_precision="ieee") * SCALE
    scores = tl.where(valid[None, :], scores, MASKED)
    m, l, alpha, p = _online_softmax(m, l, scores)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), values.to(q.dtype), input_precision="ieee")
    return m, l, acc


@triton.jit
def _store_partials(
    acc_ptr,
    m_ptr,
    l_ptr,
    acc,
    m,
    l,
    b,
    h,
    s,
    P: tl.constexpr,
    HQ: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
):
    """Write the split's ``acc``, ``m``, ``l`` rows (only the ``G`` real query rows)."""
    g = tl.arange(0, GP)
    d = tl.arange(0, DP)
    rows = (b * P + s) * HQ + h * G + g
    real = g < G
    tl.store(acc_ptr + rows[:, None] * D + d[None, :], acc, mask=real[:, None] & (d < D)[None, :])
    tl.store(m_ptr + rows, m, mask=real)
    tl.store(l_ptr + rows, l, mask=real)


@triton.jit
def _load_queries_3d(q_ptr, b, h, HQ: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                     A: tl.constexpr, W: tl.constexpr):  # fmt: skip
    """The query rows of head ``h`` as ``[A, GP, W]``: element ``[a, g, w]`` is ``q[g, a*W + w]``."""
    a = tl.arange(0, A)[:, None, None]
    g = tl.arange(0, GP)[None, :, None]
    w = tl.arange(0, W)[None, None, :]
    return tl.load(q_ptr + (b * HQ + h * G + g) * D + a * W + w, mask=g < G, other=0.0)


@triton.jit
def _planes(data, BITS: tl.constexpr):
    """Codes ``[8/BITS, T, R]`` of packed rows ``data [T, R]``: plane ``i`` is channels ``[i*R, (i+1)*R)``.

    float32 (exact): codes reach bfloat16 through float32, a conversion the Triton
    interpreter implements (it mangles int -> bfloat16), at no cost on the GPU.
    """
    shifts = tl.arange(0, 8 // BITS) * BITS
    return ((data.to(tl.int32)[None, :, :] >> shifts[:, None, None]) & ((1 << BITS) - 1)).to(tl.float32)


@triton.jit
def _group_codes(data, T: tl.constexpr, R: tl.constexpr, BITS: tl.constexpr, NG: tl.constexpr):
    """Codes ``[NG, T, 32]`` of packed rows ``data [T, R]``, one slab per 32-channel group."""
    planes = _planes(data, BITS)
    PL: tl.constexpr = 8 // BITS
    if R >= GROUP:  # a plane holds R/32 whole groups
        slabs = tl.permute(tl.reshape(planes, (PL, T, R // GROUP, GROUP)), (0, 2, 1, 3))
    else:  # a group spans 32/R planes
        slabs = tl.permute(tl.reshape(planes, (NG, GROUP // R, T, R)), (0, 2, 1, 3))
    return tl.reshape(slabs, (NG, T, GROUP))


@triton.jit
def _group_params(ptr, rows, valid, NG: tl.constexpr):
    """Per-token group parameters (scale or zero) as float32 ``[NG, T]``; invalid rows read 0."""
    g = tl.arange(0, NG)
    return tl.load(ptr + rows[None, :] * NG + g[:, None], mask=valid[None, :], other=0.0).to(tl.float32)


@triton.jit
def _grouped_scores(q_g, codes_g, scale_gT, zero_gT):
    """``q . k`` ``[GP, T]`` for per-token groups without dequantizing: codes are exact in
    the dot dtype, ``q . k = sum_g scale_g (q_g . codes_g) + zero_g sum(q_g)``."""
    dots = tl.dot(q_g, tl.permute(codes_g.to(q_g.dtype), (0, 2, 1)), input_precision="ieee")  # [NG, GP, T]
    q_sum = tl.sum(q_g.to(tl.float32), 2)  # [NG, GP]
    return tl.sum(dots * scale_gT[:, None, :] + q_sum[:, :, None] * zero_gT[:, None, :], 0)


@triton.jit
def _grouped_values(p, codes_g, scale_gT, zero_gT, dtype: tl.constexpr):
    """``p @ v`` as ``[NG, GP, 32]`` for per-token groups. Values are dequantized per group in
    float32 and cast to the dot dtype, as if read from a float pool of that dtype (folding
    the zero out of the dot would cancel badly in bfloat16: ``v = zero + code * scale``
    with ``|zero|`` often larger than ``|v|``)."""
    values = zero_gT[:, :, None] + codes_g * scale_gT[:, :, None]  # [NG, T, 32]
    probs = tl.broadcast_to(p[None, :, :], (codes_g.shape[0], p.shape[0], p.shape[1]))
    return tl.dot(probs.to(dtype), values.to(dtype), input_precision="ieee")


@triton.jit
def _grouped_init(NG: tl.constexpr, GP: tl.constexpr):
    """Empty softmax state ``(m, l, acc [NG, GP, 32])`` of the grouped (quantized) kernels."""
    return tl.full([GP], MASKED, tl.float32), tl.zeros([GP], tl.float32), tl.zeros([NG, GP, GROUP], tl.float32)


@triton.jit
def _grouped_update(p_scores, m, l, acc, valid, SCALE: tl.constexpr):
    """Mask, softmax step and rescale for the grouped kernels: ``(m, l, alpha, p, acc * alpha)``."""
    scores = tl.where(valid[None, :], p_scores * SCALE, MASKED)
    m, l, alpha, p = _online_softmax(m, l, scores)
    return m, l, p, acc * alpha[None, :, None]


@triton.jit
def _store_grouped(acc_ptr, m_ptr, l_ptr, acc, m, l, b, h, s, P: tl.constexpr, HQ: tl.constexpr, G: tl.constexpr,
                   GP: tl.constexpr, D: tl.constexpr):  # fmt: skip
    """``_store_partials`` of an accumulator laid out ``[NG, GP, 32]``."""
    flat = tl.reshape(tl.permute(acc, (1, 0, 2)), (GP, D))
    _store_partials(acc_ptr, m_ptr, l_ptr, flat, m, l, b, h, s, P, HQ, G, GP, D, D)


# --------------------------------------------------------------------------- decode kernels


@triton.jit
def decode_float_tokens(len_ptr, idx_ptr, q_ptr, k_ptr, v_ptr, acc_ptr, m_ptr, l_ptr,
                        N: tl.constexpr, K: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                        DP: tl.constexpr, P: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                        SCALE: tl.constexpr):  # fmt: skip
    b, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q = _load_group_queries(q_ptr, b, h, K * G, G, GP, D, DP)
    start, stop = _split_bounds(len_ptr, b, s, SPLIT)
    d = tl.arange(0, DP)
    m = tl.full([GP], MASKED, tl.float32)
    l = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)
    for first in range(start, stop, BLOCK):
        t = first + tl.arange(0, BLOCK)
        valid = t < stop
        ids = tl.load(idx_ptr + b * N + t, mask=valid, other=0).to(tl.int64)
        offs = (ids * K + h)[:, None] * D + d[None, :]
        mask = valid[:, None] & (d < D)[None, :]
        keys = tl.load(k_ptr + offs, mask=mask, other=0.0)
        values = tl.load(v_ptr + offs, mask=mask, other=0.0)
        m, l, acc = _attend_block(q, keys, values, valid, m, l, acc, SCALE)
    _store_partials(acc_ptr, m_ptr, l_ptr, acc, m, l, b, h, s, P, K * G, G, GP, D, DP)


@triton.jit
def decode_int4_tokens(len_ptr, idx_ptr, q_ptr, kd_ptr, ks_ptr, kz_ptr, vd_ptr, vs_ptr, vz_ptr, acc_ptr, m_ptr, l_ptr,
                       N: tl.constexpr, K: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                       DP: tl.constexpr, P: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                       SCALE: tl.constexpr):  # fmt: skip
    b, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NG: tl.constexpr = D // GROUP
    R: tl.constexpr = D // 2
    q_g = _load_queries_3d(q_ptr, b, h, K * G, G, GP, D, NG, GROUP)  # [NG, GP, 32]
    start, stop = _split_bounds(len_ptr, b, s, SPLIT)
    j = tl.arange(0, R)
    m, l, acc = _grouped_init(NG, GP)
    for first in range(start, stop, BLOCK):
        t = first + tl.arange(0, BLOCK)
        valid = t < stop
        rows = tl.load(idx_ptr + b * N + t, mask=valid, other=0).to(tl.int64) * K + h
        packed = rows[:, None] * R + j[None, :]
        codes = _group_codes(tl.load(kd_ptr + packed, mask=valid[:, None], other=0), BLOCK, R, 4, NG)
        raw = _grouped_scores(q_g, codes, _group_params(ks_ptr, rows, valid, NG), _group_params(kz_ptr, rows, valid, NG))
        m, l, p, acc = _grouped_update(raw, m, l, acc, valid, SCALE)
        codes = _group_codes(tl.load(vd_ptr + packed, mask=valid[:, None], other=0), BLOCK, R, 4, NG)
        acc += _grouped_values(p, codes, _group_params(vs_ptr, rows, valid, NG), _group_params(vz_ptr, rows, valid, NG), q_g.dtype)
    _store_grouped(acc_ptr, m_ptr, l_ptr, acc, m, l, b, h, s, P, K * G, G, GP, D)


@triton.jit
def decode_int2_pages(len_ptr, idx_ptr, q_ptr, kd_ptr, ks_ptr, kz_ptr, vd_ptr, vs_ptr, vz_ptr, acc_ptr, m_ptr, l_ptr,
                      N: tl.constexpr, K: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                      DP: tl.constexpr, P: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                      SCALE: tl.constexpr):  # fmt: skip
    """One page (32 tokens) per step (``BLOCK == 1``): per-channel key scales differ per page."""
    b, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NG: tl.constexpr = D // GROUP
    R: tl.constexpr = D // 4
    PL: tl.constexpr = 4
    q_g = _load_queries_3d(q_ptr, b, h, K * G, G, GP, D, NG, GROUP)  # [NG, GP, 32] for values' sake
    q_pl = _load_queries_3d(q_ptr, b, h, K * G, G, GP, D, PL, R).to(tl.float32)  # [4, GP, R] by bit-plane
    start, stop = _split_bounds(len_ptr, b, s, SPLIT)
    t = tl.arange(0, PAGE)
    channel = tl.arange(0, PL)[:, None] * R + tl.arange(0, R)[None, :]  # [4, R]
    packed = t[:, None] * R + tl.arange(0, R)[None, :]  # [32, R] within a (page, head)
    valid = t < PAGE  # every token of a listed page is real
    m, l, acc = _grouped_init(NG, GP)
    for entry in range(start, stop):
        head = tl.load(idx_ptr + b * N + entry).to(tl.int64) * K + h  # (page, head)
        # keys, per channel: q . k = sum_c (q_c scale_c) code_c + q . zero
        planes = _planes(tl.load(kd_ptr + head * (PAGE * R) + packed), 2)  # [4, 32, R]
        scale = tl.load(ks_ptr + head * D + channel).to(tl.float32)
        zero = tl.load(kz_ptr + head * D + channel).to(tl.float32)
        q_scaled = (q_pl * scale[:, None, :]).to(q_g.dtype)
        dots = tl.dot(q_scaled, tl.permute(planes.to(q_g.dtype), (0, 2, 1)), input_precision="ieee")  # [4, GP, 32]
        q_zero = tl.sum(tl.sum(q_pl * zero[:, None, :], 2), 0)  # [GP]
        raw = tl.sum(dots, 0) + q_zero[:, None]
        m, l, p, acc = _grouped_update(raw, m, l, acc, valid, SCALE)
        # values, per token groups
        rows = head * PAGE + t
        codes = _group_codes(tl.load(vd_ptr + head * (PAGE * R) + packed), PAGE, R, 2, NG)
        acc += _grouped_values(p, codes, _group_params(vs_ptr, rows, valid, NG), _group_params(vz_ptr, rows, valid, NG), q_g.dtype)
    _store_grouped(acc_ptr, m_ptr, l_ptr, acc, m, l, b, h, s, P, K * G, G, GP, D)


# --------------------------------------------------------------------------- ragged query tiles


@triton.jit
def _tile_keys(live_ptr, k_ptr, v_ptr, row, first, hi, h, N: tl.constexpr, K: tl.constexpr, D: tl.constexpr,
               DP: tl.constexpr, BLOCK: tl.constexpr, TAIL: tl.constexpr):  # fmt: skip
    """Entries ``[first, first + BLOCK)`` of row ``row``'s list: their indices and the
    ``[BLOCK, DP]`` key and value rows of KV head ``h``, gathered by slot id. A
    ``TAIL`` block may run past ``hi`` (the tile's last entry): those ids are not
    read and their rows load as zeros, so no slot outside the tile's list is read."""
    e = first + tl.arange(0, BLOCK)
    d = tl.arange(0, DP)
    if TAIL:
        inside = e < hi
        ids = tl.load(live_ptr + row * N + e, mask=inside, other=0).to(tl.int64)
        mask = inside[:, None] & (d < D)[None, :]
    else:
        ids = tl.load(live_ptr + row * N + e).to(tl.int64)
        mask = (d < D)[None, :]
    offs = (ids * K + h)[:, None] * D + d[None, :]
    if TAIL or DP != D:
        return e, tl.load(k_ptr + offs, mask=mask, other=0.0), tl.load(v_ptr + offs, mask=mask, other=0.0)
    return e, tl.load(k_ptr + offs), tl.load(v_ptr + offs)


@triton.jit
def _tile_step(q, keys, values, e, sees, m, l, acc, SCALE: tl.constexpr, CAUSAL: tl.constexpr):
    """One key block of a query tile: scores ``[M, BLOCK]`` (masked causally on the
    diagonal: row ``i`` sees entries below ``sees[i]``), the softmax step, the value update."""
    scores = tl.dot(q, tl.trans(keys.to(q.dtype)), input_precision="ieee") * SCALE
    if CAUSAL:
        scores = tl.where(e[None, :] < sees[:, None], scores, MASKED)
    m, l, alpha, p = _online_softmax(m, l, scores)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), values.to(q.dtype), input_precision="ieee")
    return m, l, acc


@triton.jit
def ragged_query_tiles(tile_ptr, live_ptr, q_ptr, k_ptr, v_ptr, out_ptr,
                       N: tl.constexpr, K: tl.constexpr, G: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                       M: tl.constexpr, BLOCK: tl.constexpr, SCALE: tl.constexpr):  # fmt: skip
    """Program ``(t, h)``: query tile ``t`` (``jaxkv.kernels._ragged_tiles``), KV head ``h``.

    Dot row ``i`` is query ``i // G`` of the tile, query head ``h*G + i % G``: the
    ``G`` heads sharing KV head ``h`` ride in one ``[M, DP]`` tile, so each key block
    is read once for all of them. The blocks every query sees whole run unmasked;
    the rest (the tile's diagonal) masked. Rows of no query (past ``count * G``) are
    zero queries and are never stored; an unused tile (``count`` 0) reads nothing
    and stores nothing.
    """
    t, h = tl.program_id(0), tl.program_id(1)
    row = tl.load(tile_ptr + 4 * t)
    start = tl.load(tile_ptr + 4 * t + 1)
    count = tl.load(tile_ptr + 4 * t + 2)
    before = tl.load(tile_ptr + 4 * t + 3)
    i = tl.arange(0, M)
    j = i // G  # the row's query within the tile
    d = tl.arange(0, DP)
    real = j < count
    rows = (start + j) * (K * G) + h * G + i % G
    io_mask = real[:, None] & (d < D)[None, :]
    q = tl.load(q_ptr + rows[:, None] * D + d[None, :], mask=io_mask, other=0.0)
    sees = before + tl.minimum(j, count - 1) + 1  # rows of no query see what the last query sees
    hi = before + count  # entries the tile reads: [0, hi)
    whole = (before + 1) // BLOCK * BLOCK  # entries [0, whole) every query sees
    m = tl.full([M], MASKED, tl.float32)
    l = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, DP], tl.float32)
    for first in range(0, whole, BLOCK):
        e, keys, values = _tile_keys(live_ptr, k_ptr, v_ptr, row, first, hi, h, N, K, D, DP, BLOCK, False)
        m, l, acc = _tile_step(q, keys, values, e, sees, m, l, acc, SCALE, False)
    for first in range(whole, hi, BLOCK):
        e, keys, values = _tile_keys(live_ptr, k_ptr, v_ptr, row, first, hi, h, N, K, D, DP, BLOCK, True)
        m, l, acc = _tile_step(q, keys, values, e, sees, m, l, acc, SCALE, True)
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty), mask=io_mask)


# --------------------------------------------------------------------------- RoPE delta


@triton.jit
def rope_delta_rows(slots_ptr, delta_ptr, inv_freq_ptr, pool_in_ptr, pool_ptr,
                    M: tl.constexpr, S: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, HALF: tl.constexpr,
                    HP: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    layer, blk = tl.program_id(0), tl.program_id(1)
    i = blk * BLOCK + tl.arange(0, BLOCK)
    ok = i < M
    slot = tl.load(slots_ptr + i, mask=ok, other=0).to(tl.int64)
    delta = tl.load(delta_ptr + i, mask=ok, other=0).to(tl.float32)
    j = tl.arange(0, HP)
    inv_freq = tl.load(inv_freq_ptr + j, mask=j < HALF, other=0.0)
    angles = delta[:, None] * inv_freq[None, :]  # [BLOCK, HP], exactly as jaxkv.rope computes them
    cos = tl.cos(angles)[:, None, :]
    sin = tl.sin(angles)[:, None, :]
    k = tl.arange(0, KP)
    row = (layer * S + slot)[:, None] * K + k[None, :]  # [BLOCK, KP]
    offs = row[:, :, None] * (2 * HALF) + j[None, None, :]
    mask = ok[:, None, None] & (k < K)[None, :, None] & (j < HALF)[None, None, :]
    x1 = tl.load(pool_ptr + offs, mask=mask, other=0.0)
    x2 = tl.load(pool_ptr + offs + HALF, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(pool_ptr + offs, (a * cos - b * sin).to(x1.dtype), mask=mask)
    tl.store(pool_ptr + offs + HALF, (b * cos + a * sin).to(x1.dtype), mask=mask)


# --------------------------------------------------------------------------- INT4 quantizing write


@triton.jit
def _f16_directed(x, UP: tl.constexpr):
    """float32 -> float16 rounded toward +inf (``UP``) or -inf, as ``quant._round_f16``."""
    h = x.to(tl.float16)
    back = h.to(tl.float32)
    wrong = (back < x) if UP else (back > x)
    bits = h.to(tl.int16, bitcast=True)
    is_zero = back == 0.0
    if UP:
        stepped = tl.where(is_zero, 1, tl.where(back > 0.0, bits + 1, bits - 1))
    else:
        stepped = tl.where(is_zero, -32767, tl.where(back > 0.0, bits - 1, bits + 1))  # -32767 is 0x8001
    return tl.where(wrong, stepped.to(tl.int16), bits).to(tl.float16, bitcast=True)


@triton.jit
def _round_half_even(x):
    """``jnp.round`` of non-negative float32 ``x`` (exact: ``x - floor(x)`` is exact below 2**23)."""
    r = tl.floor(x)
    frac = x - r
    up = (frac > 0.5) | ((frac == 0.5) & ((r - 2.0 * tl.floor(r * 0.5)) == 1.0))
    return tl.where(up, r + 1.0, r)


@triton.jit
def _quantize_plane(x, BLOCK: tl.constexpr, R: tl.constexpr):
    """INT4 codes ``[BLOCK, R]`` (int32) and float16 ``(scale, zero)`` ``[BLOCK, R/32]`` of one plane."""
    grouped = tl.reshape(x, (BLOCK, R // GROUP, GROUP))
    zero = _f16_directed(tl.min(grouped, 2), False)
    zero32 = zero.to(tl.float32)
    scale = _f16_directed((tl.max(grouped, 2) - zero32) * (1.0 / 15.0), True)  # as quant._fit
    scale32 = scale.to(tl.float32)
    ratio = tl.math.div_rn(grouped - zero32[:, :, None], tl.where(scale32 > 0, scale32, 1.0)[:, :, None])
    codes = tl.minimum(tl.maximum(_round_half_even(ratio), 0.0), 15.0)
    codes = tl.where(scale32[:, :, None] > 0, codes, 0.0).to(tl.int32)
    return tl.reshape(codes, (BLOCK, R)), scale, zero


@triton.jit
def quantize_int4_rows(x_ptr, slots_ptr, data_in_ptr, scale_in_ptr, zero_in_ptr, data_ptr, scale_ptr, zero_ptr,
                       T: tl.constexpr, K: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    blk, h = tl.program_id(0), tl.program_id(1)
    R: tl.constexpr = D // 2  # bytes per row; plane 0 = channels [0, R), plane 1 = [R, D)
    NG: tl.constexpr = R // GROUP  # groups per plane
    t = blk * BLOCK + tl.arange(0, BLOCK)
    ok = t < T
    slot = tl.load(slots_ptr + t, mask=ok, other=0).to(tl.int64)
    j = tl.arange(0, R)
    src = (t.to(tl.int64) * K + h)[:, None] * D + j[None, :]
    lo, lo_scale, lo_zero = _quantize_plane(tl.load(x_ptr + src, mask=ok[:, None], other=0.0).to(tl.float32), BLOCK, R)
    hi, hi_scale, hi_zero = _quantize_plane(tl.load(x_ptr + src + R, mask=ok[:, None], other=0.0).to(tl.float32), BLOCK, R)
    row = slot * K + h
    tl.store(data_ptr + row[:, None] * R + j[None, :], (lo | (hi << 4)).to(tl.uint8), mask=ok[:, None])
    g = tl.arange(0, NG)
    groups = row[:, None] * (2 * NG) + g[None, :]
    tl.store(scale_ptr + groups, lo_scale, mask=ok[:, None])
    tl.store(zero_ptr + groups, lo_zero, mask=ok[:, None])
    tl.store(scale_ptr + groups + NG, hi_scale, mask=ok[:, None])
    tl.store(zero_ptr + groups + NG, hi_zero, mask=ok[:, None])
