"""The engine's KV pool interface, and the float pool behind it.

``jaxkv.engine.Engine`` holds one pool object (``engine.pool``) and calls only the
methods below; the float pool (``FloatKV``, here) and the quantized pool
(``jaxkv.cache.quantized_host.QuantizedKV``) implement them, so the engine has no
branch on the pool's kind and a new format is one module. ``make_pool`` is the one
place that picks the kind.

The interface (every method that changes device state takes the engine and sets
``engine.cache`` itself, or returns the new cache for the engine to set; the host
checks run first, so a failing call changes nothing):

* ``mode``: ``None`` (full precision) or a ``kv_quant`` mode; ``allocator``: the
  slot allocator (``SlotAllocator`` interface); ``uses_window``: whether the CPU
  decode may gather a per-chunk window of the rows' K/V (``engine.gather_window``).
* device steps, hashable so they are static arguments of the engine's jit'd steps
  (``layer_io``: one layer's ``write`` / ``read`` in float, for the spliced prefill):
  ``prefill_op(model, batch, tables, positions, kv, kv_args, n_read, features)
  -> (logits, kv, aux)`` (one chunk: attention over the live entries plus the
  chunk, the chunk written at its slots), ``import_op`` (the same signature, the
  chunk's K/V given in ``kv_args`` and written as a prefill would write them, no
  forward: ``Engine.start_prefill(kv_source=...)``) and ``decode_op(model, tokens_B,
  positions_B, kv, kv_args, tables, write_slots_B, n_read, features, *, attend,
  window) -> (logits, kv, aux)`` (one step: the token written, then read);
* host plans: ``plan_prefill(engine, row, kv_bits, n, chunk) -> (plan, slots)``,
  ``prefill_args(jobs, B, C)`` and ``decode_args(states, new_slots, B, steps)`` (the
  steps' ``kv_args``), ``settle(engine, rows)`` (after every write: the KIVI modes' aging),
  ``requantize(engine, row, positions, bits)`` (tokens written another way moved
  to the precision ``kv_bits`` choose);
* reads: ``gather_keys(cache, live)`` (float post-RoPE keys, what scorers read),
  ``gather_rows(cache, slots)`` (host copies, what the RepairKV tier shelves),
  ``host_keys(rows)`` (float keys of such copies), ``gather_float(cache, slots)``
  (float K and V of rows, what a reused segment stores), ``composition(state)``,
  ``page_table(state)``;
* moves: ``fresh_slots(engine, row, positions)`` and ``compact(cache, plan, rope)``
  (a compact layout), ``restore(engine, row, k, v)`` (promotion, bit-identical).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import pallas
from jaxkv.buckets import bucket
from jaxkv.cache.allocator import SENTINEL_SLOT, SlotAllocator
from jaxkv.cache.host_tier import stage
from jaxkv.cache.state import PagedKVCache
from jaxkv.errors import JaxKVError


def make_pool(kv_quant, num_slots: int, *, head_dim: int, float_dtype, backend=None):
    """The pool of an engine: ``FloatKV`` for ``kv_quant`` None / ``"none"``, else a
    ``QuantizedKV`` of that mode (``ConfigError`` for an unknown mode)."""
    from jaxkv.cache.quantized_host import QuantizedKV, check_mode

    mode = check_mode(kv_quant)
    if mode is None:
        return FloatKV(num_slots)
    return QuantizedKV.sized(mode, num_slots, head_dim=head_dim, float_dtype=float_dtype, backend=backend)


# ============================================================================ device steps
@dataclasses.dataclass(frozen=True)
class FloatPrefill:
    """One prefill chunk over the float pool: the model's own ``prefill`` (attention
    over the live entries plus the chunk; the chunk's K/V scattered at its slots)."""

    def __call__(self, model, batch, tables, positions, kv, kv_args, n_read, features):
        k, v = kv
        logits, k, v, aux = model.prefill(
            batch.tokens_BT, positions, k, v, tables.live_idx[:, :n_read], tables.live_len,
            batch.chunk_len_B, batch.slots_BT, features=features, q_row_idx_BR=batch.q_idx_BX, logits_idx_BY=batch.logit_idx_BY,
        )
        return logits, (k, v), aux


@dataclasses.dataclass(frozen=True)
class FloatImport:
    """One chunk of an *imported* prefill over the float pool: K/V computed
    elsewhere (``kv_args``: ``(pool_args, k [L, B, T, K, D], v)``, post-RoPE at the
    chunk's positions) written at the chunk's slots, with no forward. The logits it
    returns are placeholders ``[B, Y, 1]``: an import job carries its own
    (``jaxkv.engine.KVSource``)."""

    def __call__(self, model, batch, tables, positions, kv, kv_args, n_read, features):
        _, k_LBTKD, v_LBTKD = kv_args
        k, v = kv
        L, B, T, K, D = k_LBTKD.shape
        slots = batch.slots_BT.reshape(-1)  # padding: the sentinel slot 0, never read
        k = k.at[:, slots].set(k_LBTKD.reshape(L, B * T, K, D).astype(k.dtype))
        v = v.at[:, slots].set(v_LBTKD.reshape(L, B * T, K, D).astype(v.dtype))
        return jnp.zeros((B, batch.logit_idx_BY.shape[1], 1), jnp.float32), (k, v), {}


@dataclasses.dataclass(frozen=True)
class FloatDecodeStep:
    """One decode step over the float pool: the model's own ``decode`` with the
    engine's attention function (a kernel backend, sharded on a mesh) and, on the
    CPU reference path, the chunk's gathered window."""

    def __call__(self, model, tokens_B, positions_B, kv, kv_args, tables, write_slots_B, n_read, features, *, attend, window):
        logits, k, v, aux = model.decode(
            tokens_B, positions_B, *kv, tables.live_idx[:, :n_read], tables.live_len, write_slots_B,
            features=features, decode_attention=attend, window=window,
        )
        return logits, (k, v), aux


@dataclasses.dataclass(frozen=True)
class FloatLayerIO:
    """One layer's write and read of the float pool (``jaxkv.splice.splice_step``)."""

    def write(self, kv, i, k_XKD, v_XKD, slots_X):
        k, v = kv
        return k.at[i, slots_X].set(k_XKD.astype(k.dtype)), v.at[i, slots_X].set(v_XKD.astype(v.dtype))

    def read(self, kv, i, slots_N):
        k, v = kv
        return k[i, slots_N], v[i, slots_N]


@jax.jit
def _gather_keys(k_LSKD, slots_N):
    return k_LSKD[:, slots_N].astype(jnp.float32)


@jax.jit
def _gather_kv(k_LSKD, v_LSKD, slots_N):
    return k_LSKD[:, slots_N].astype(jnp.float32), v_LSKD[:, slots_N].astype(jnp.float32)


@functools.partial(jax.jit, donate_argnames=("cache",))
def _copy_rows(cache: PagedKVCache, src_M, dst_M):
    return cache.replace(k=cache.k.at[:, dst_M].set(cache.k[:, src_M]), v=cache.v.at[:, dst_M].set(cache.v[:, src_M]))


@functools.partial(jax.jit, donate_argnames=("cache",))
def _write_rows(cache: PagedKVCache, slots_M, k_LMKD, v_LMKD):
    """Write K/V rows as given (post-RoPE at their original positions: no rotation)."""
    return cache.replace(
        k=cache.k.at[:, slots_M].set(k_LMKD.astype(cache.k.dtype)),
        v=cache.v.at[:, slots_M].set(v_LMKD.astype(cache.v.dtype)),
    )


# ============================================================================ the float pool
class FloatKV:
    """The full-precision pool (``PagedKVCache``): one slot space, K/V stored in the
    pool dtype (``jaxkv.cache.state.float_pool_dtype``), every slot alike.

    Attributes: ``allocator`` (``SlotAllocator`` over ``num_slots``, the sentinel
    included); ``mode`` None; ``prefill_op`` / ``decode_op`` the steps above.
    """

    mode = None
    uses_window = True
    prefill_op = FloatPrefill()
    import_op = FloatImport()
    decode_op = FloatDecodeStep()
    layer_io = FloatLayerIO()

    def __init__(self, num_slots: int):
        self.allocator = SlotAllocator(num_slots)

    def check_mesh(self, mesh) -> None:
        """Any mesh jaxkv accepts (the pool is split by KV head)."""

    def cache_factory(self, cfg, *, rows: int, positions: int, dtype):
        """A zero-argument function making the empty cache (jit'd onto a mesh by the engine)."""
        return functools.partial(
            PagedKVCache.create, num_layers=cfg.num_layers, num_slots=self.allocator.num_slots,
            num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rows=rows, positions=positions, dtype=dtype,
        )

    # -- writes --------------------------------------------------------------------
    def plan_prefill(self, engine, row: int, kv_bits, n: int, chunk: int):
        if kv_bits is not None:
            raise JaxKVError("kv_bits needs a quantized pool (Engine(kv_quant=...))")
        return None, engine.allocate(n, row)

    def prefill_args(self, jobs, B: int, C: int):
        return None

    def decode_args(self, states, new_slots, B: int, steps: int):
        return None

    def settle(self, engine, rows) -> None:
        """Nothing ages in a float pool."""

    def requantize(self, engine, row: int, positions, bits) -> None:
        if bits is not None:
            raise JaxKVError("kv_bits needs a quantized pool (Engine(kv_quant=...))")

    # -- reads ---------------------------------------------------------------------
    def gather_keys(self, cache, live) -> jax.Array:
        return _gather_keys(cache.k, np.asarray(live, np.int32))

    def gather_rows(self, cache, slots) -> tuple[np.ndarray, np.ndarray]:
        idx = np.asarray(slots, np.int32)
        return np.asarray(cache.k[:, idx]), np.asarray(cache.v[:, idx])

    def gather_float(self, cache, slots) -> tuple[np.ndarray, np.ndarray]:
        """float32 K and V at ``slots``, gathered at a bucketed width (one compile
        per bucket; padding reads the sentinel)."""
        slots = np.asarray(slots, np.int64)
        M = slots.size
        pad = np.concatenate([slots, np.full(bucket(M, minimum=8) - M, SENTINEL_SLOT)]).astype(np.int32)
        k, v = _gather_kv(cache.k, cache.v, jnp.asarray(pad))
        return np.asarray(k)[:, :M], np.asarray(v)[:, :M]

    def host_keys(self, k_LMKD) -> np.ndarray:
        return k_LMKD

    def composition(self, state) -> dict:
        return {2: 0, 4: 0, 16: len(state.live)}

    def page_table(self, state):
        raise JaxKVError("page tables belong to a quantized pool (Engine(kv_quant=...))")

    # -- moving rows ---------------------------------------------------------------
    def fresh_slots(self, engine, row: int, positions) -> np.ndarray:
        return engine.allocate(len(positions), row)

    def compact(self, cache, plan, rope):
        """Copy a compact plan's kept rows to their fresh slots, keys rotated by ``plan.delta``."""
        dst = jnp.asarray(plan.copy_dst, jnp.int32)
        cache = _copy_rows(cache, jnp.asarray(plan.copy_src, jnp.int32), dst)
        return cache.replace(k=pallas.rope_delta(cache.k, dst, jnp.asarray(plan.delta, jnp.int32), rope))

    def restore(self, engine, row: int, k_LMKD, v_LMKD) -> np.ndarray:
        """Shelved rows back into fresh slots, unchanged; returns the slots."""
        k_LMKD, v_LMKD = np.asarray(k_LMKD), np.asarray(v_LMKD)
        fresh = engine.allocate(k_LMKD.shape[1], row)
        if engine.mesh is None:  # pinned host memory is per device; on a mesh, jit sends each device its part
            k_LMKD, v_LMKD = stage(k_LMKD), stage(v_LMKD)
        engine.cache = _write_rows(engine.cache, jnp.asarray(fresh, jnp.int32), k_LMKD, v_LMKD)
        return fresh

