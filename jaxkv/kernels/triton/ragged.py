"""GPU ragged paged attention: launch descriptions and glue of the Triton kernels.

Same contract as ``jaxkv.kernels.attention.ragged`` (whose dispatch calls
``ragged_attention`` here with ``launcher=launch.triton_call``; the CPU tests pass
``interpret.interpret_call``): ``T`` flat queries from ``R`` rows, each row over its
own live list of slot ids into the pool, causal within the step, padding tokens
zero. A call is two launches and a little jnp:

1. **Query tiles** (``kernels.ragged_query_tiles``) for the rows with two or more
   queries. The tile list (``jaxkv.kernels._ragged_tiles.query_tiles``, heaviest
   tiles first) is computed in jnp from the step's metadata; grid ``(NT, Hkv)``
   with ``NT = ceil(T / Q) + min(R, T // 2)`` tiles, so only ``T`` and ``R`` reach
   the shape. Program ``(t, h)`` folds the ``G`` query heads of KV head ``h`` into
   the tile's ``M`` dot rows (``Q = M // G`` queries), walks its row's list in key
   blocks up to its last query's length (a run-time bound: lengths are data),
   gathers K/V rows by slot id, runs the online softmax in float32, masks only the
   diagonal blocks, and writes its queries' outputs in place in the flat
   ``[T, Hq, D]`` output. Unused tiles write nothing.
2. **Decode rows** (``q_len == 1``) through the split-K decode kernel
   ``kernels.decode_float_tokens`` (``jaxkv.kernels.triton.decode``): each row's query
   gathered into ``[R, Hq, D]``, the ``G`` heads padded to 16 dot rows (not to a
   tile of ``M``), long rows cut into splits so that a step with few rows still
   fills the GPU, splits merged by log-sum-exp (``_splitk.merge``). Other rows
   read 0 entries: their splits are empty and merge to zero.
3. The result: the tiles' output at tiled rows' tokens, the decode output at
   decode tokens, zero elsewhere (one ``where`` and one scatter of ``R`` rows).

Production launch parameters (``_ragged_tiles.gpu_tile``; ``aot`` compiles them for
sm_80 and sm_90, and the tests require zero register spills): bf16/fp16 tiles of
128 dot rows over 64-entry key blocks (head dim <= 128), float32 tiles of 64 rows
over 32 entries (float32 dots are IEEE on FMA units and hold twice the
registers); 8 warps from head dim 128, 4 below; 2 pipeline stages. Head dims are
padded to a power of two ``DP``. Dots run in the query dtype promoted with the pool
dtype (bf16 tensor cores on bf16 models, IEEE fp32 on fp32 ones) with fp32
accumulation; softmax state is fp32; scores are scaled by ``1/sqrt(D)`` after the
dot.

Invariants: every token of a tiled row is written by exactly one program per KV
head (tiles partition each tiled row); rows own disjoint token ranges; entries at
or past a tile's last visible entry are never loaded (masked loads), so a list's
tail past ``kv_len`` may hold any slot id and the pool any value there.

Cost model (``jaxkv.kernels.cost.ragged``): flops ``4 * D`` per (query head, entry
it sees) plus ~5 for the softmax; the tiles execute ``M`` rows per tile over
whole key blocks (the diagonal's masked half and padded rows included). Bytes: a
tile reads its row's visible entries ``2 * Hkv * D * itemsize`` each, so a row of
``n`` queries in ``ceil(n / Q)`` tiles reads its list that many times (L2 serves
most re-reads of a prefill chunk's list), plus queries, outputs and ``4`` bytes
per id; decode rows as ``jaxkv.kernels.triton.decode``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxkv.kernels import _ragged_tiles as tiles_mod
from jaxkv.kernels._splitk import Partials, merge
from jaxkv.kernels.triton import decode, kernels
from jaxkv.kernels.triton.decode import next_pow2, token_block
from jaxkv.kernels.triton.launch import Launch, Launcher, abstract

NUM_STAGES = 2


def tile_launch(q_THD, k_SKD, live_RN) -> Launch:
    """Launch of ``kernels.ragged_query_tiles`` for a step of ``q_THD``'s tokens over
    ``live_RN``'s rows (``q_THD`` already in the dot dtype)."""
    T, Hq, D = q_THD.shape
    K = k_SKD.shape[1]
    G = Hq // K
    R, N = live_RN.shape
    tile = tiles_mod.gpu_tile(G, D, jnp.dtype(q_THD.dtype).itemsize)
    NT = tiles_mod.num_tiles(T, R, tile.queries)
    i32 = jnp.int32
    return Launch(
        kernels.ragged_query_tiles,
        grid=(NT, K),
        inputs=(jax.ShapeDtypeStruct((NT * tiles_mod.TILE_FIELDS,), i32), jax.ShapeDtypeStruct((R, N), i32))
        + abstract(q_THD, k_SKD, k_SKD),
        outputs=(jax.ShapeDtypeStruct((T, Hq, D), q_THD.dtype),),
        constexprs=(
            ("N", N),
            ("K", K),
            ("G", G),
            ("D", D),
            ("DP", next_pow2(D)),
            ("M", tile.rows),
            ("BLOCK", tile.block),
            ("SCALE", 1.0 / math.sqrt(D)),
        ),  # fmt: skip
        num_warps=tile.warps,
        num_stages=NUM_STAGES,
    )


def decode_launch(q_THD, k_SKD, live_RN) -> Launch:
    """Launch of ``kernels.decode_float_tokens`` for the step's decode rows: one query
    per row, ``[R, Hq, D]``, over ``live_RN``; the same launch
    ``jaxkv.kernels.triton.decode`` makes for ``R`` requests."""
    q_RHD = jax.ShapeDtypeStruct((live_RN.shape[0],) + q_THD.shape[1:], q_THD.dtype)
    return decode.decode_launch(kernels.decode_float_tokens, q_RHD, (k_SKD, k_SKD), live_RN, block=token_block(q_THD.dtype))


def tile_queries(q_THD, k_SKD) -> int:
    """Queries per tile (``Q``) of the launch for these shapes."""
    T, Hq, D = q_THD.shape
    return tiles_mod.gpu_tile(Hq // k_SKD.shape[1], D, jnp.dtype(q_THD.dtype).itemsize).queries


def ragged_attention(q_THD, k_SKD, v_SKD, live_RN, kv_len_R, q_start_R, q_len_R, *, launcher: Launcher):
    """``jaxkv.kernels.attention.ragged`` on a float pool with the Triton kernels
    (module docstring): ``[T, Hq, D]`` in ``q_THD.dtype``, zero at padding tokens."""
    T = q_THD.shape[0]
    q = q_THD.astype(jnp.promote_types(q_THD.dtype, k_SKD.dtype))
    live = live_RN.astype(jnp.int32)
    kv_len, q_start, q_len = (a.astype(jnp.int32) for a in (kv_len_R, q_start_R, q_len_R))
    tiles = tiles_mod.query_tiles(T, kv_len, q_start, q_len, tile_queries(q, k_SKD), heaviest_first=True)
    (tiled_out,) = launcher(tile_launch(q, k_SKD, live), tiles.packed(), live, q, k_SKD, v_SKD)
    tiled_T = tiles_mod.token_owner(T, q_start, q_len) >= 0
    out = jnp.where(tiled_T[:, None, None], tiled_out, 0).astype(q_THD.dtype)
    q_R = jnp.take(q, jnp.clip(q_start, 0, T - 1), axis=0)
    part = launcher(decode_launch(q, k_SKD, live), tiles_mod.decode_lengths(kv_len, q_len), live, q_R, k_SKD, v_SKD)
    decoded = merge([Partials(*part)], q_THD.dtype)
    return out.at[jnp.where(q_len == 1, q_start, T)].set(decoded, mode="drop")
