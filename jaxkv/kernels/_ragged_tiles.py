"""Query tiles of a ragged step: the work list the GPU and TPU ragged kernels share.

A ragged step (``jaxkv.kernels.attention.ragged``) is ``T`` flat query tokens from
``R`` rows; row ``r`` owns tokens ``[q_start_R[r], q_start_R[r] + q_len_R[r])`` and
its query ``j`` sees its live-list entries ``[0, kv_len_R[r] - q_len_R[r] + j + 1)``.
The kernels split the work in two:

* **Tiled rows** (``q_len >= 2``: prefill chunks, and any row with several new
  tokens) are cut into *query tiles* of at most ``Q`` consecutive queries of one
  row. ``query_tiles`` computes the list in jnp from the step's metadata: tile
  ``t`` is ``(row, start, count, before)``, its queries are the flat tokens
  ``[start, start + count)`` and its query ``i`` sees entries
  ``[0, before + i + 1)``. The list has a static length, ``num_tiles(T, R, Q) =
  ceil(T / Q) + min(R, T // 2)``: a tiled row of ``n`` queries needs
  ``ceil(n / Q) < n / Q + 1`` tiles, the tiled rows hold at most ``T`` queries,
  and there are at most ``T // 2`` of them. Tiles past the step's need are
  *unused*: ``count = 0`` and every other field 0, so a kernel that runs one
  reads no entry and stores nothing.
* **Decode rows** (``q_len == 1``) take the split-K decode kernels
  (``jaxkv.kernels._splitk``): one query's ``G`` heads is a 16-row dot on a GPU,
  not a tile of ``Q`` queries, and a long row is cut into splits so that a step
  with few rows still fills the device. ``decode_lengths`` gives those kernels
  their per-row lengths (0 for every other row: its splits are empty and merge to
  zero).

``token_owner`` maps flat tokens back to the tiled row that owns them (-1 for
decode and padding tokens), in ``O(T + R)``.

Invariants (the engine's, checked by the tests, not at run time): rows own
disjoint token ranges inside ``[0, T)``, and ``q_len <= kv_len <= N``.

Tile shapes per backend live here too (``gpu_tile``, ``tpu_tile``), so the cost
model (``jaxkv.kernels.cost``) and the launch code read one table without
importing triton.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax.numpy as jnp

TILE_FIELDS = 4  # (row, start, count, before) per tile, int32
MIN_TILED = 2  # rows with at least this many queries are tiled; q_len 1 rows are decode rows


class Tiles(NamedTuple):
    """The query tiles of one step (``[NT]`` int32 each; unused tiles all zero).

    Attributes:
      row: the tile's row.
      start: flat index of its first query.
      count: its queries (``<= Q``; 0: unused).
      before: entries its first query sees before its own; query ``i`` of the tile
        sees entries ``[0, before + i + 1)``.
    """

    row: jnp.ndarray
    start: jnp.ndarray
    count: jnp.ndarray
    before: jnp.ndarray

    def packed(self) -> jnp.ndarray:
        """``[NT * 4]`` int32, ``(row, start, count, before)`` per tile: the kernels' input."""
        return jnp.stack([self.row, self.start, self.count, self.before], axis=1).reshape(-1).astype(jnp.int32)


def num_tiles(T: int, R: int, Q: int) -> int:
    """Static length of the tile list of a step of ``T`` tokens and ``R`` rows."""
    return max(1, math.ceil(T / Q) + min(R, T // MIN_TILED))


def query_tiles(T: int, kv_len_R, q_start_R, q_len_R, Q: int, *, heaviest_first: bool = False) -> Tiles:
    """The tiles of every tiled row, row by row (``heaviest_first``: sorted by the
    entries they read, most first, so that a GPU starts its longest programs first;
    unused tiles last either way)."""
    R = q_len_R.shape[0]
    NT = num_tiles(T, R, Q)
    q_len = q_len_R.astype(jnp.int32)
    n_R = jnp.where(q_len >= MIN_TILED, (q_len + Q - 1) // Q, 0)
    ends = jnp.cumsum(n_R)
    t = jnp.arange(NT, dtype=jnp.int32)
    r = jnp.minimum(jnp.searchsorted(ends, t, side="right"), R - 1).astype(jnp.int32)
    k = t - (ends[r] - n_R[r])  # the tile's index within its row
    used = t < ends[-1]
    zero = jnp.zeros_like(t)
    tiles = Tiles(
        row=jnp.where(used, r, zero),
        start=jnp.where(used, q_start_R.astype(jnp.int32)[r] + k * Q, zero),
        count=jnp.where(used, jnp.minimum(Q, q_len[r] - k * Q), zero),
        before=jnp.where(used, kv_len_R.astype(jnp.int32)[r] - q_len[r] + k * Q, zero),
    )
    if heaviest_first:
        order = jnp.argsort(-(tiles.before + tiles.count), stable=True)
        tiles = Tiles(*(a[order] for a in tiles))
    return tiles


def decode_lengths(kv_len_R, q_len_R) -> jnp.ndarray:
    """``[R]`` entries each row's single query reads: ``kv_len`` for decode rows, else 0."""
    return jnp.where(q_len_R == 1, kv_len_R, 0).astype(jnp.int32)


def token_owner(T: int, q_start_R, q_len_R, rows_R=None) -> jnp.ndarray:
    """``[T]`` int32: the row owning each flat token among ``rows_R`` (a ``[R]`` bool
    mask; default: tiled rows), -1 where none does. Rows' ranges must be disjoint."""
    R = q_len_R.shape[0]
    if rows_R is None:
        rows_R = q_len_R >= MIN_TILED
    rows_R = rows_R & (q_len_R > 0)
    start = jnp.where(rows_R, q_start_R, T).astype(jnp.int32)
    end = jnp.where(rows_R, q_start_R + q_len_R, T).astype(jnp.int32)
    tag = jnp.arange(1, R + 1, dtype=jnp.int32)
    marks = jnp.zeros(T + 1, jnp.int32).at[start].add(tag).at[end].add(-tag)
    return jnp.cumsum(marks[:T]) - 1


# --------------------------------------------------------------------------- tile shapes


class TileShape(NamedTuple):
    """One backend's tile for a head shape.

    Attributes:
      rows: dot rows per tile (``M``): ``queries * G`` query-head rows, padded up.
      queries: queries per tile (``Q``).
      block: list entries per key block.
      warps: GPU warps per program (0 on TPU).
    """

    rows: int
    queries: int
    block: int
    warps: int = 0


def gpu_tile(group: int, head_dim: int, itemsize: int) -> TileShape:
    """The Triton tile (``jaxkv.kernels.triton.ragged``), 8 warps everywhere:

    * 16-bit dots (tensor cores), head dim <= 128: 128 dot rows over key blocks of
      64 entries (FlashAttention-2's forward tile);
    * 16-bit, head dim 256: 64 rows over 32 entries;
    * float32 (IEEE dots on the FMA units): 32 rows over 16 entries. Larger float32
      tiles spill registers on sm_90 (64 x 32: ~1.4 KB per thread).

    Every shape here compiles for sm_80 and sm_90 without register spills
    (``python -m jaxkv.kernels.triton.aot``). ``queries = rows // group``: a tile of a
    GQA group that does not divide ``rows`` leaves ``rows % group`` rows idle.
    """
    if itemsize <= 2:
        rows, block = (128, 64) if head_dim <= 128 else (64, 32)
    else:
        rows, block = 32, 16
    if group > rows:
        raise ValueError(f"GQA group {group} larger than a {rows}-row tile")
    return TileShape(rows, rows // group, block, 8)


TPU_KEY_BLOCK = 128  # entries per key block on TPU: one lane-width of scores


def tpu_tile(group: int) -> TileShape:
    """The Pallas tile (``jaxkv.kernels.attention.ragged_tpu``): at most 128 dot rows (the MXU
    height) and at least one step, in a multiple of 16 (a bf16 vreg's sublanes),
    over 128-entry key blocks (one lane-width of scores): ``Q`` the largest multiple
    of ``16 / gcd(G, 16)`` with ``Q * G <= 128``."""
    step = 16 // math.gcd(group, 16)
    queries = max(step, (128 // group) // step * step)
    return TileShape(queries * group, queries, TPU_KEY_BLOCK)


__all__ = [
    "MIN_TILED",
    "TILE_FIELDS",
    "TPU_KEY_BLOCK",
    "TileShape",
    "Tiles",
    "decode_lengths",
    "gpu_tile",
    "num_tiles",
    "query_tiles",
    "token_owner",
    "tpu_tile",
]
