"""The engine's KV pool interface, and the float pool behind it.

``jaxkv.engine.kv_manager.KVManager`` holds one pool object (``manager.pool``) and calls only the
methods below; the float pool (``FloatKV``, here) and the quantized pool
(``jaxkv.cache.quantized_host.QuantizedKV``) implement them, so the engine has no
branch on the pool's kind and a new format is one module. ``make_pool`` is the one
place that picks the kind.

The interface. Methods that write take the cache and return the new one (the
caller, ``jaxkv.engine.kv_manager.KVManager``, is the one writer); methods that
allocate take the manager as ``room`` (its ``allocate(n, kind=)`` and ``reclaim``:
one allocation path, radix-cached slots reclaimed first). The host checks run
first, so a failing call changes nothing:

* ``mode``: ``None`` (full precision) or a ``kv_quant`` mode; ``allocator``: the
  slot allocator (``SlotAllocator`` interface); ``whole_chunks``: a prefill's
  pieces must be whole planned chunks;
* ``layers``: the device side, hashable so it is a static argument of the
  engine's programs (``jaxkv.forward``): one layer's write and its float rows
  (``FloatLayers`` documents the methods); attention over the pool is a backend's
  (``jaxkv.backends``);
* host plans: ``plan_prefill(room, kv_bits, n, chunk) -> (plan, slots)``,
  ``step_plan(pieces, starts, T)`` (a step's write plan for ``layers.write``: None
  for the float pool; a quantized pool's INT2 page plan over the flat batch),
  ``decode_plan(states, new_slots, B, steps)`` (a decode call's reading plan: None,
  or a quantized pool's ``DecodeParts``);
* moves that return ``None`` (nothing moved) or ``(cache, slots_P, released)``, the
  row's new slot map and the slots to release: ``settle(cache, room, state)``
  (after every write: the KIVI modes' aging), ``requantize(cache, room, state,
  positions, bits)``;
* reads: ``gather_keys(cache, live)`` (float post-RoPE keys, what scorers read),
  ``gather_rows(cache, slots)`` (host copies, what the RepairKV tier shelves),
  ``host_keys(rows)`` (float keys of such copies), ``gather_float(cache, slots)``
  (float K and V of rows, what a reused segment stores), ``composition(state)``,
  ``page_table(state)``;
* moves of rows: ``fresh_slots(room, state, positions)`` and ``compact(cache,
  plan, rope)`` (a compact layout), ``restore(cache, room, k, v, staged=) ->
  (cache, slots)`` (promotion, bit-identical).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import kernels
from jaxkv.buckets import bucket
from jaxkv.cache.allocator import SENTINEL_SLOT, SlotAllocator
from jaxkv.cache.host_tier import stage
from jaxkv.cache.state import PagedKVCache
from jaxkv.errors import JaxKVError


def make_pool(kv_quant, num_slots: int, *, head_dim: int, float_dtype, rotate: bool = False):
    """The pool of an engine: ``FloatKV`` for ``kv_quant`` None / ``"none"``, else a
    ``QuantizedKV`` of that mode (``ConfigError`` for an unknown mode). ``rotate``:
    a quantized pool stores K and V rotated (``jaxkv.cache.rotation``); a float
    pool has nothing to rotate for (``ConfigError``)."""
    from jaxkv.cache.quantized_host import QuantizedKV, check_mode

    mode = check_mode(kv_quant)
    if mode is None:
        _check_rotate(rotate)
        return FloatKV(num_slots)
    return QuantizedKV.sized(mode, num_slots, head_dim=head_dim, float_dtype=float_dtype, rotate=bool(rotate))


def _check_rotate(rotate) -> None:
    from jaxkv.errors import ConfigError

    if rotate:
        raise ConfigError("kv_rotate is an option of a quantized pool (kv_quant); the float pool stores K/V as computed")


def kv_bytes(cache) -> int:
    """Device bytes of a cache's KV pool: every leaf of ``cache.kv`` (float rows, or
    packed codes with their scales and zero points), the tables not included
    (``slot_map`` / ``live_idx``: int32 per row and position, whatever the pool)."""
    return int(sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(cache.kv)))


def pool_for_bytes(kv_quant, memory_bytes: int, cfg, *, float_dtype, page_share=None, rotate: bool = False):
    """The largest pool of kind ``kv_quant`` whose KV (``kv_bytes``) fits in
    ``memory_bytes``: how an engine is sized by memory instead of slots.

    * float pool: ``memory_bytes // (2 L K D itemsize)`` slots, the sentinel included;
    * quantized pools: ``page_share`` of the tokens the budget holds go to INT2
      pages (kivi4: 4-bit pages), the rest to the token region (INT4; KIVI: float),
      so that ``kv_bytes`` of the pool is at most ``memory_bytes``; the bytes left
      over go to the token region. ``int4`` keeps only the reserved page (share 0);
      the triaxial modes default to 0 (every token fits the INT4 region, and an
      INT2 plan short of pages is written INT4), so a session whose allocation
      writes INT2 wants its INT2 share here; the KIVI modes need a share (their
      float residual is 128-159 tokens a request, the rest are pages).

    Admission counts the token region only (``DualAllocator.capacity``): a turn
    reserves its new tokens there, pages are extra room.
    ``ConfigError`` if the budget cannot hold one token of each region."""
    from jaxkv.cache.quantized import Geometry
    from jaxkv.cache.quantized_host import KIVI_PAGE_BITS, QuantizedKV, check_mode
    from jaxkv.errors import ConfigError
    from jaxkv.kernels.quant import PAGE

    mode = check_mode(kv_quant)
    M = int(memory_bytes)

    def nbytes(pool) -> int:  # a pool's KV bytes, from shapes only (nothing allocated)
        return kv_bytes(jax.eval_shape(pool.cache_factory(cfg, rows=1, positions=1, dtype=float_dtype)))

    if mode is None:
        _check_rotate(rotate)
        per_slot = nbytes(FloatKV(2)) // 2
        if M // per_slot < 2:
            raise ConfigError(f"kv_memory_bytes={M} holds no token of a float pool ({per_slot} bytes per slot)")
        return FloatKV(M // per_slot)
    kivi = mode in KIVI_PAGE_BITS
    if page_share is None:
        if kivi:
            raise ConfigError(f"kv_quant={mode!r} sized by memory needs kv_page_share (the share of tokens in pages)")
        page_share = 0.0
    share = 0.0 if mode == "int4" else float(page_share)
    if not 0.0 <= share < 1.0:
        raise ConfigError(f"kv_page_share must be in [0, 1), got {page_share!r}")
    quant = lambda geo: QuantizedKV(mode, geo, head_dim=cfg.head_dim, float_dtype=float_dtype, rotate=bool(rotate))  # noqa: E731
    base = nbytes(quant(Geometry(1, 1, 0)))  # each region's bytes are linear in its count
    page = nbytes(quant(Geometry(2, 1, 0))) - base
    int4 = nbytes(quant(Geometry(1, 2, 0))) - base
    token = nbytes(quant(Geometry(1, 1, 1))) - base if kivi else int4  # the token region's bytes per token
    fixed = base - (0 if kivi else int4)  # the reserved page (and a KIVI pool's one INT4 row)
    tokens = (M - fixed) / (page * share / PAGE + token * (1 - share))
    pages = 1 + int(share * tokens // PAGE)
    n = (M - fixed - page * (pages - 1)) // token
    if n < 1:
        raise ConfigError(f"kv_memory_bytes={M} holds no token of a {mode} pool ({token} bytes per token)")
    return quant(Geometry(pages, 1, int(n)) if kivi else Geometry(pages, int(n), 0))


# ============================================================================ device layers
@dataclasses.dataclass(frozen=True)
class FloatLayers:
    """One layer's writes and reads of the float pool ``(k, v)`` ``[L, S, K, D]``
    (hashable: a static argument of the engine's programs, ``jaxkv.forward``).

    * ``write(kv, i, k_TKD, v_TKD, slots_T, plan)``: rows stored at their slots in
      the pool dtype (``plan``: the quantized pools' page plan; None here);
    * ``read(kv, i, slots_N)``: float rows at slots (the spliced prefill);
    * ``read_pool(kv, i)``: the layer ``[S, K, D]`` (the kernels and the reference);
    * ``rotation``, ``to_stored(i, x)`` / ``from_stored(i, x)``: the frame the pool
      stores rows in (a rotated quantized pool's, ``QuantLayers``); the float pool
      stores the model's frame (None, identities).
    """

    rotation = None

    def to_stored(self, layer, x_KD):
        return x_KD

    def from_stored(self, layer, x_KD):
        return x_KD

    def write(self, kv, i, k_TKD, v_TKD, slots_T, plan=None):
        k, v = kv
        return k.at[i, slots_T].set(k_TKD.astype(k.dtype)), v.at[i, slots_T].set(v_TKD.astype(v.dtype))

    def read(self, kv, i, slots_N):
        k, v = kv
        return k.at[i, slots_N].get(mode="clip"), v.at[i, slots_N].get(mode="clip")

    def read_pool(self, kv, i):
        k, v = kv
        return k[i], v[i]


@functools.partial(jax.jit, static_argnames=("layers",), donate_argnames=("cache",))
def import_rows(cache, slots_T, k_LTKD, v_LTKD, plan=None, *, layers):
    """Store K/V computed elsewhere at ``slots_T`` in every layer, as a step would
    store them (an *imported* prefill, ``jaxkv.engine.KVSource``): no forward; a
    rotated pool's rows are rotated into its frame first, as a step's are."""
    kv = cache.kv
    for i in range(k_LTKD.shape[0]):
        kv = layers.write(kv, i, layers.to_stored(i, k_LTKD[i]), layers.to_stored(i, v_LTKD[i]), slots_T, plan)
    return cache.with_kv(kv)


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
        k=cache.k.at[:, slots_M].set(k_LMKD.astype(cache.k.dtype)), v=cache.v.at[:, slots_M].set(v_LMKD.astype(cache.v.dtype))
    )


# ============================================================================ the float pool
class FloatKV:
    """The full-precision pool (``PagedKVCache``): one slot space, K/V stored in the
    pool dtype (``jaxkv.cache.state.float_pool_dtype``), every slot alike.

    Attributes: ``allocator`` (``SlotAllocator`` over ``num_slots``, the sentinel
    included); ``mode`` None; ``layers`` (``FloatLayers``).
    """

    mode = None
    whole_chunks = False  # any piece of a prefill is written alike
    layers = FloatLayers()

    def __init__(self, num_slots: int):
        self.allocator = SlotAllocator(num_slots)

    def check_mesh(self, mesh) -> None:
        """Any mesh jaxkv accepts (the pool is split by KV head)."""

    def cache_factory(self, cfg, *, rows: int, positions: int, dtype, lists: int = 1):
        """A zero-argument function making the empty cache (jit'd onto a mesh by the
        engine); ``lists``: live lists per row (J)."""
        return functools.partial(
            PagedKVCache.create,
            num_layers=cfg.num_layers,
            num_slots=self.allocator.num_slots,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            rows=rows,
            positions=positions,
            dtype=dtype,
            lists=lists,
        )

    # -- writes --------------------------------------------------------------------
    def plan_prefill(self, room, kv_bits, n: int, chunk: int):
        if kv_bits is not None:
            raise JaxKVError("kv_bits needs a quantized pool (Engine(kv_quant=...))")
        return None, room.allocate(n)

    def step_plan(self, pieces, starts, T: int):
        """No write plan: every float slot is written alike."""
        return None

    def decode_plan(self, states, new_slots, B: int, steps: int):
        return None

    def settle(self, cache, room, state):
        """Nothing ages in a float pool."""
        return None

    def requantize(self, cache, room, state, positions, bits):
        if bits is not None:
            raise JaxKVError("kv_bits needs a quantized pool (Engine(kv_quant=...))")
        return None

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
        k, v = _gather_kv(cache.k, cache.v, pad)
        return np.asarray(k)[:, :M], np.asarray(v)[:, :M]

    def host_keys(self, k_LMKD) -> np.ndarray:
        return k_LMKD

    def composition(self, state) -> dict:
        return {2: 0, 4: 0, 16: len(state.live)}

    def page_table(self, state):
        raise JaxKVError("page tables belong to a quantized pool (Engine(kv_quant=...))")

    # -- moving rows ---------------------------------------------------------------
    def fresh_slots(self, room, state, positions) -> np.ndarray:
        return room.allocate(len(positions))

    def compact(self, cache, plan, rope):
        """Copy a compact plan's kept rows to their fresh slots, keys rotated by ``plan.delta``."""
        dst = np.asarray(plan.copy_dst, np.int32)
        cache = _copy_rows(cache, np.asarray(plan.copy_src, np.int32), dst)
        return cache.replace(k=kernels.rope_delta(cache.k, dst, np.asarray(plan.delta, np.int32), rope))

    def restore(self, cache, room, k_LMKD, v_LMKD, *, staged: bool = True):
        """Shelved rows back into fresh slots, unchanged: ``(cache, slots)``.
        ``staged``: copy them through pinned host memory first (one device; on a
        mesh, jit sends each device its part)."""
        k_LMKD, v_LMKD = np.asarray(k_LMKD), np.asarray(v_LMKD)
        fresh = room.allocate(k_LMKD.shape[1])
        if staged:
            k_LMKD, v_LMKD = stage(k_LMKD), stage(v_LMKD)
        return _write_rows(cache, np.asarray(fresh, np.int32), k_LMKD, v_LMKD), fresh
