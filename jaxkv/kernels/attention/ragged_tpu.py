"""TPU ragged paged attention: the Pallas kernel (Mosaic on TPU, interpret mode anywhere).

Same contract as ``jaxkv.kernels.attention.ragged`` (backends ``"tpu"`` and
``"interpret"``): ``T`` flat queries from ``R`` rows, each row over its own live
list of slot ids into the pool ``[S, Hkv, D]``, causal within the step, zero at
padding tokens. A call is two Pallas kernels and some jnp around them:

1. **Query tiles** (``_tile_kernel``) for rows with two or more queries. The tile
   list (``jaxkv.kernels._ragged_tiles.query_tiles``: ``Q`` queries of one row per
   tile, ``NT = ceil(T / Q) + min(R, T // 2)`` tiles, unused ones empty) and the
   tiles' queries are gathered in jnp, laid out ``[NT, Hkv, Q*G, D]``: the ``G``
   query heads of a KV head are folded into the tile's ``M = Q*G`` dot rows (row
   ``i`` is query ``i // G``, about 128 rows: the MXU's height), so each key block
   is read once for all of them. Grid ``(NT,)``; program ``t`` walks its row's
   list in blocks of ``E = 128`` entries up to its last query's length (a loop
   bound read from SMEM at run time: lengths are data, not shapes). Per block it
   copies the entry ids into SMEM, starts one DMA per (entry, K/V) that gathers
   the slot's rows of every head into VMEM ``[Hkv, E, D]``, waits once per
   operand (as ``jaxkv.kernels._splitk``), then runs one online-softmax step per
   KV head: scores ``[M, E]`` in float32, the causal mask only on the blocks of
   the tile's diagonal, running max and sum lane-dense ``[M, 128]`` in VMEM
   scratch (as ``jax.experimental.pallas.ops.tpu.flash_attention``), the
   accumulator ``[Hkv, M, D]`` float32 in VMEM. The program writes its whole
   output block ``[Hkv, M, D]``; the wrapper reads back the queries each tiled
   row owns. Unused tiles (the list's tail) all map to one spare output block and
   one query block, so they cost a grid step each but no HBM traffic.
2. **Decode rows** (``q_len == 1``): the split-K skeleton of ``_splitk`` with the
   float reader of ``jaxkv.kernels.attention.decode`` on the rows' single queries
   (``[R, Hq, D]``, other rows reading 0 entries), merged by log-sum-exp.
3. The result: tile outputs at tiled rows' tokens, decode outputs at decode
   tokens, zero elsewhere.

Invariants:

* Entries a tile cannot see are never attended: ids past the tile's last visible
  entry are replaced by 0 (the sentinel slot, which the engine keeps finite) and
  their scores masked; so a list's tail past ``kv_len`` may hold any in-range id.
* Dots run in the query dtype promoted with the pool dtype, accumulated in
  float32; probabilities are cast to the value dtype for ``p @ v`` (bf16 on bf16
  pools, as flash attention does); scores are scaled by ``1/sqrt(D)`` after the dot.
* Every output block is written, unused tiles included (interpret mode fills
  outputs with NaN before the kernel runs, so a missed block would show).

TPU layout: the last two dims of every VMEM block are the array's own (``M`` and
``D``) or ``(E, D)``; ``E`` equals the 128 lanes, so a block's scores and the
lane-dense running max share one shape. Head dims below 128 take the first
``D`` lanes of the running sums, 256 two copies; others are not supported.

Cost model: a tile's key blocks cost ``E`` DMAs of ``Hkv * D * itemsize`` bytes
per operand; a row of ``n`` queries reads its visible entries ``ceil(n / Q)``
times. Flops: ``4 * D`` per (query head, entry seen) plus the softmax; executed:
``M`` rows per tile over whole ``E``-entry blocks. The query gather and the output
read-back move ``T * Hq * D`` elements each (``jaxkv.kernels.cost.ragged``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxkv.kernels import _ragged_tiles as tiles_mod
from jaxkv.kernels import _splitk
from jaxkv.kernels._options import pallas_options

MASKED = _splitk.MASKED
LANES = _splitk.LANES


def _lanes(x_M128, D: int):
    """Lane-dense ``[M, 128]`` statistics as ``[M, D]`` (D 128, a divisor of 128, or a multiple)."""
    if D == LANES:
        return x_M128
    if D < LANES:
        return x_M128[:, :D]
    return jnp.tile(x_M128, (1, D // LANES))


def _tile_kernel(tiles_ref, live_hbm, pos_ref, q_ref, k_hbm, v_hbm, o_ref, ids_smem, sems, kbuf, vbuf, m_ref, l_ref,
                 acc_ref, *, scale: float):  # fmt: skip
    t = pl.program_id(0)
    K, M, D = q_ref.shape
    E = kbuf.shape[2]
    row = tiles_ref[tiles_mod.TILE_FIELDS * t]
    count = tiles_ref[tiles_mod.TILE_FIELDS * t + 2]
    before = tiles_ref[tiles_mod.TILE_FIELDS * t + 3]
    hi = before + count  # entries the tile reads: [0, hi)
    whole = (before + 1) // E  # blocks every query of the tile sees whole
    blocks = (hi + E - 1) // E
    m_ref[...] = jnp.full(m_ref.shape, MASKED, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def fetch(b, slot):
        """Start gathering block ``b``'s K/V rows (all heads) into buffer ``slot``."""
        first = b * E
        pltpu.sync_copy(live_hbm.at[row, pl.ds(first, E)], ids_smem.at[slot])

        def start_row(j, carry):
            entry = jnp.where(first + j < hi, ids_smem[slot, j], 0)
            for r, (src, buf) in enumerate(((k_hbm, kbuf), (v_hbm, vbuf))):
                pltpu.make_async_copy(src.at[entry], buf.at[slot, :, j], sems.at[slot, r]).start()
            return carry

        jax.lax.fori_loop(0, E, start_row, 0)

    def wait(slot):
        for r, buf in enumerate((kbuf, vbuf)):  # one wait per operand covers the bytes of all its rows
            pltpu.make_async_copy(buf.at[slot], buf.at[slot], sems.at[slot, r]).wait()

    @pl.when(blocks > 0)
    def _():
        fetch(0, 0)

    def block(b, carry, causal: bool):
        slot = b % 2

        @pl.when(b + 1 < blocks)
        def _():  # the other buffer was consumed by block b - 1: refill it while this block computes
            fetch(b + 1, 1 - slot)

        wait(slot)
        if causal:  # row i (query pos_ref[i] of the tile) sees entries below before + 1 + its query
            col = b * E + jax.lax.broadcasted_iota(jnp.int32, (M, E), 1)
            visible = col < before + 1 + jnp.minimum(pos_ref[...], count - 1)
        for k in range(K):
            q = q_ref[k]
            s = _splitk.dot_nt(q, kbuf[slot, k].astype(q.dtype)) * scale  # [M, E] float32
            if causal:
                s = jnp.where(visible, s, MASKED)
            m_prev, l_prev = m_ref[k], l_ref[k]  # [M, 128], every lane equal
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            alpha = jnp.exp(m_prev - m_next)
            p = jnp.exp(s - m_next)
            l_ref[k] = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
            m_ref[k] = m_next
            v = vbuf[slot, k]
            acc_ref[k] = acc_ref[k] * _lanes(alpha, D) + _splitk.dot_nn(p.astype(v.dtype), v)
        return carry

    jax.lax.fori_loop(0, whole, functools.partial(block, causal=False), 0)
    jax.lax.fori_loop(whole, blocks, functools.partial(block, causal=True), 0)
    for k in range(K):
        l = _lanes(l_ref[k], D)
        o_ref[k] = (acc_ref[k] / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)


def tile_attention(q_THD, k_SKD, v_SKD, live_RN, tiles: tiles_mod.Tiles, Q: int, *, interpret: bool):
    """The query tiles' outputs, ``[NT * Q, Hq, D]`` in ``q_THD.dtype``: query ``i``
    of tile ``t`` at ``t * Q + i`` (queries past a tile's ``count`` hold values no
    one reads)."""
    T, Hq, D = q_THD.shape
    K = k_SKD.shape[1]
    G = Hq // K
    M = Q * G
    E = tiles_mod.TPU_KEY_BLOCK
    if D % LANES and LANES % D:
        raise ValueError(f"the Pallas ragged kernel needs head_dim dividing or a multiple of {LANES}, got {D}")
    NT = tiles.row.shape[0]
    tok = jnp.clip(tiles.start[:, None] + jnp.arange(Q, dtype=jnp.int32)[None, :], 0, T - 1)  # [NT, Q]
    q = jnp.take(q_THD, tok, axis=0).reshape(NT, Q, K, G, D).transpose(0, 2, 1, 3, 4).reshape(NT, K, M, D)
    N = live_RN.shape[1]
    live = jnp.pad(live_RN.astype(jnp.int32), ((0, 0), (0, -N % E)))
    pos = jnp.broadcast_to((jnp.arange(M, dtype=jnp.int32) // G)[:, None], (M, LANES))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    used = lambda t, tiles: tiles[tiles_mod.TILE_FIELDS * t + 2] > 0
    # unused tiles (last in the list) share one spare output block and the first query block:
    # consecutive grid steps on one block neither fetch nor write back again
    q_spec = pl.BlockSpec((None, K, M, D), lambda t, tiles: (jnp.where(used(t, tiles), t, 0), 0, 0, 0))
    out_spec = pl.BlockSpec((None, K, M, D), lambda t, tiles: (jnp.where(used(t, tiles), t, NT), 0, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(NT,),
        in_specs=[hbm, pl.BlockSpec((M, LANES), lambda t, tiles: (0, 0)), q_spec, hbm, hbm],
        out_specs=out_spec,
        scratch_shapes=[
            pltpu.SMEM((2, E), jnp.int32),
            pltpu.SemaphoreType.DMA((2, 2)),
            pltpu.VMEM((2, K, E, D), k_SKD.dtype),
            pltpu.VMEM((2, K, E, D), v_SKD.dtype),
            pltpu.VMEM((K, M, LANES), jnp.float32),
            pltpu.VMEM((K, M, LANES), jnp.float32),
            pltpu.VMEM((K, M, D), jnp.float32),
        ],
    )
    out = pl.pallas_call(
        functools.partial(_tile_kernel, scale=1.0 / math.sqrt(D)),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((NT + 1, K, M, D), q_THD.dtype),
        name="ragged_query_tiles",
        **pallas_options(interpret, parallel_axes=1),
    )(tiles.packed(), live, pos, q, k_SKD, v_SKD)
    return out[:NT].reshape(NT, K, Q, G, D).transpose(0, 2, 1, 3, 4).reshape(NT * Q, Hq, D)


def ragged_attention(q_THD, k_SKD, v_SKD, live_RN, kv_len_R, q_start_R, q_len_R, *, interpret: bool):
    """``jaxkv.kernels.attention.ragged`` with the Pallas kernels (module docstring):
    ``[T, Hq, D]`` in ``q_THD.dtype``, zero at padding tokens."""
    from jaxkv.kernels.attention.decode import FloatTokens

    T, Hq, D = q_THD.shape
    K = k_SKD.shape[1]
    q = q_THD.astype(jnp.promote_types(q_THD.dtype, k_SKD.dtype))
    kv_len, q_start, q_len = (a.astype(jnp.int32) for a in (kv_len_R, q_start_R, q_len_R))
    Q = tiles_mod.tpu_tile(Hq // K).queries
    tiles = tiles_mod.query_tiles(T, kv_len, q_start, q_len, Q)
    tiled = tile_attention(q, k_SKD, v_SKD, live_RN, tiles, Q, interpret=interpret)
    # flat token -> its place among the tiles' queries (tiles are in row order)
    owner = tiles_mod.token_owner(T, q_start, q_len)
    r = jnp.maximum(owner, 0)
    n_R = jnp.where(q_len >= tiles_mod.MIN_TILED, (q_len + Q - 1) // Q, 0)
    first_tile = jnp.cumsum(n_R) - n_R
    j = jnp.arange(T, dtype=jnp.int32) - q_start[r]
    at = (first_tile[r] + j // Q) * Q + j % Q
    out = jnp.where((owner >= 0)[:, None, None], jnp.take(tiled, jnp.clip(at, 0, tiled.shape[0] - 1), axis=0), 0)
    out = out.astype(q_THD.dtype)
    q_R = jnp.take(q, jnp.clip(q_start, 0, T - 1), axis=0)
    part = _splitk.split_k(q_R, FloatTokens(D), (k_SKD, v_SKD), live_RN, tiles_mod.decode_lengths(kv_len, q_len),
                           interpret=interpret)  # fmt: skip
    decoded = _splitk.merge([part], q_THD.dtype)
    return out.at[jnp.where(q_len == 1, q_start, T)].set(decoded, mode="drop")
