"""Device KV state: the pool and the per-request tables, as one pytree.

Shape letters: L layers, S pool slots, Hkv KV heads (K in einsums), D head dim,
R request rows (the batch dimension of the cache), P positions per row, J live
lists per row (1: one list for every layer; L: one per layer).

``PagedKVCache`` holds everything a jit'd step reads or writes, so a whole cache
update is one pure function ``cache -> cache`` (the pool is donated):

Attributes:
  k, v: ``[L, S, Hkv, D]`` the pool. Keys are stored **post-RoPE**.
  slot_map: ``[R, P]`` int32, position -> slot. Unwritten or evicted positions
    hold the sentinel slot 0.
  live_idx: ``[J, R, P]`` int32, the slots attention reads, in position order,
    padded with the sentinel; only the first ``live_len`` entries count. Layer
    ``i`` reads list ``min(i, J - 1)`` (``layer_list``): with ``J == 1`` every layer
    reads one list (a keep set for the whole model), with ``J == L`` each layer
    its own (per-layer keep sets; ``Engine(layer_lists=True)`` makes J = L, and
    ``RequestState.layer_lists`` is what each list holds). A slot stays allocated
    while any list holds it.
  live_len: ``[J, R]`` int32, length of each live-index list.
  seq_len: ``[R]`` int32, next position to write (tokens seen, holes included).

``float_pool_dtype`` is the dtype an engine stores a float pool in (the model's,
except bfloat16 on XLA:CPU: see there).

``RowTables`` is the same four tables for a sub-batch of rows (``take_rows``);
jit'd steps that serve only some rows (the scheduler's batches) work on it and
write it back with ``put_rows``, so idle rows cost nothing.

Invariants: slot 0 (the sentinel) is never listed in ``live_idx[j, r, :live_len]``;
``live_len <= seq_len <= P``; padding writes go to the sentinel and are never read;
a step's new tokens are appended to every list of their row.
The host (``jaxkv.engine``) owns the allocator and decides which slots a request
gets; jit'd functions only apply those decisions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class PagedKVCache:
    k: jax.Array
    v: jax.Array
    slot_map: jax.Array
    live_idx: jax.Array
    live_len: jax.Array
    seq_len: jax.Array

    @classmethod
    def create(cls, *, num_layers, num_slots, num_kv_heads, head_dim, rows, positions, dtype, lists: int = 1):
        pool_shape = (num_layers, num_slots, num_kv_heads, head_dim)
        return cls(k=jnp.zeros(pool_shape, dtype), v=jnp.zeros(pool_shape, dtype), **empty_tables(rows, positions, lists))

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    @property
    def rows(self) -> int:
        return self.slot_map.shape[0]

    @property
    def positions(self) -> int:
        return self.slot_map.shape[1]

    @property
    def kv(self):
        """What a decode step reads and writes: ``(k, v)`` (a quantized cache's is
        its ``DualPool``, ``jaxkv.cache.quantized``)."""
        return self.k, self.v

    def with_kv(self, kv) -> "PagedKVCache":
        k, v = kv
        return self.replace(k=k, v=v)


def empty_tables(rows: int, positions: int, lists: int = 1) -> dict:
    """The four tables of an empty cache (``lists``: J, live lists per row)."""
    if lists < 1:
        raise ValueError(f"a row needs at least one live list, got {lists}")
    z = lambda *shape: jax.device_put(np.zeros(shape, np.int32))  # noqa: E731  (a transfer: jnp.asarray of a host array compiles a program per shape)
    return dict(slot_map=z(rows, positions), live_idx=z(lists, rows, positions), live_len=z(lists, rows), seq_len=z(rows))


@struct.dataclass
class RowTables:
    """The tables of a sub-batch of B rows (fields as in ``PagedKVCache``, with B
    in place of R): ``slot_map [B, P]``, ``live_idx [J, B, P]``, ``live_len [J, B]``,
    ``seq_len [B]``."""

    slot_map: jax.Array
    live_idx: jax.Array
    live_len: jax.Array
    seq_len: jax.Array

    @property
    def positions(self) -> int:
        return self.slot_map.shape[1]

    def layer_list(self, i):
        """The live list layer ``i`` (static or traced) reads: ``(live_idx [B, P],
        live_len [B])``; with one list per row, that list whatever ``i``."""
        if self.live_idx.shape[0] == 1:
            return self.live_idx[0], self.live_len[0]
        j = jnp.minimum(i, self.live_idx.shape[0] - 1)
        return self.live_idx[j], self.live_len[j]


def take_rows(cache: PagedKVCache, rows_B: jax.Array) -> RowTables:
    """The tables of rows ``rows_B``; an index ``>= R`` (padding) reads row ``R-1``."""
    rows = jnp.minimum(rows_B, cache.rows - 1)
    return RowTables(cache.slot_map[rows], cache.live_idx[:, rows], cache.live_len[:, rows], cache.seq_len[rows])


def put_rows(cache: PagedKVCache, rows_B: jax.Array, tables: RowTables) -> PagedKVCache:
    """Write a sub-batch's tables back; entries whose row index is ``>= R`` (padding)
    are dropped."""
    return cache.replace(
        slot_map=cache.slot_map.at[rows_B].set(tables.slot_map, mode="drop"),
        live_idx=cache.live_idx.at[:, rows_B].set(tables.live_idx, mode="drop"),
        live_len=cache.live_len.at[:, rows_B].set(tables.live_len, mode="drop"),
        seq_len=cache.seq_len.at[rows_B].set(tables.seq_len, mode="drop"),
    )


def append_tokens(cache, slots_RT: jax.Array, count_R: jax.Array):
    """Record that each row wrote ``count_R`` new tokens at ``slots_RT[:, :count]``.

    ``cache`` is a ``PagedKVCache`` or a ``RowTables``. Positions ``seq_len ..
    seq_len + count`` map to those slots and the slots are appended to every
    live-index list of the row. Entries of ``slots_RT`` past ``count_R`` are
    ignored. This is the only place the tables grow.
    """
    R, T = slots_RT.shape
    J = cache.live_idx.shape[0]
    t = jnp.arange(T)[None, :]
    real = t < count_R[:, None]
    rows = jnp.arange(R)[:, None]
    pos = jnp.where(real, cache.seq_len[:, None] + t, cache.positions)  # out of range -> dropped
    live_pos = jnp.where(real[None], cache.live_len[:, :, None] + t[None], cache.positions)  # [J, R, T]
    lists = jnp.arange(J)[:, None, None]
    slot_map = cache.slot_map.at[rows, pos].set(slots_RT, mode="drop")
    live_idx = cache.live_idx.at[lists, rows[None], live_pos].set(jnp.broadcast_to(slots_RT[None], live_pos.shape), mode="drop")
    return cache.replace(slot_map=slot_map, live_idx=live_idx, live_len=cache.live_len + count_R[None], seq_len=cache.seq_len + count_R)


def float_pool_dtype(model_dtype, platform: str):
    """The dtype of a float KV pool (or of a quantized pool's float region) for a model
    of ``model_dtype`` on ``platform``.

    The model's dtype, except bfloat16 on XLA:CPU, which is stored as float32. A
    bfloat16 model's K/V leave its projections in bfloat16, so float32 holds the same
    values exactly and attention reads what a bfloat16 pool would give it; the cost is
    twice the pool's memory. The reason is XLA:CPU's bfloat16 scatter: it converts the
    whole ``[L, S, Hkv, D]`` pool to float32 and back around every write, so a
    one-row-per-layer write into SmolLM2's pool at 40,000 slots took 2.8 s against
    0.1 ms in float32 (float16 scatters run as fast as float32;
    ``eval/profile/bf16_scatter.py``), and
    ``jaxkv serve --dtype bfloat16`` could not finish a 256-token reply in 8 minutes.
    """
    dtype = jnp.dtype(model_dtype)
    return jnp.dtype(jnp.float32) if platform == "cpu" and dtype == jnp.bfloat16 else dtype
