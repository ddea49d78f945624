"""The KV manager: the one writer of the engine's cache state.

It owns the device cache (``PagedKVCache`` or a quantized pool's cache: the pool
and every row's tables), the pool object (``jaxkv.cache.pools``) and its slot
allocator, and the host record of every open row (``RequestState``). Everything
that changes them is a method here: allocation (one path, ``allocate``, which
reclaims radix-cached slots first when the pool is short), the row tables
(open, close, truncate, per-layer sets), eviction and promotion (a
``LayoutPlan``, restored rows), moves between precisions, and the runner's steps,
which hand their new cache in through ``commit``. Data flows one way: the manager
calls the pool, and the pool returns new caches and slots; nothing else assigns
the cache.

Reads (keys of a row, host copies of rows, a row's composition) go through the
pool too, so nothing above branches on the pool's kind.

Invariants:
  * the host record of each row (``RequestState``) equals the device tables after
    every call (tests check ``slot_map``/``live_idx`` against it);
  * each row holds exactly one allocator reference per non-sentinel slot it maps;
  * host checks (slots, context length, holes) run before any device call, so a
    failing call leaves cache and allocator untouched;
  * ``writes`` counts every write of the cache but a truncation (a truncated list
    is a prefix of what it was): what the decode window kept by the runner is
    checked against;
  * not thread-safe: one thread (the scheduler's) drives it.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.cache.allocator import SENTINEL_SLOT
from jaxkv.cache.pools import import_rows, make_pool, pool_for_bytes
from jaxkv.cache.request import RequestState, promotion_tables
from jaxkv.cache.state import PagedKVCache, float_pool_dtype
from jaxkv.errors import ConfigError, ContextLengthError, JaxKVError, OutOfSlotsError
from jaxkv.forward import cache_sharding


@functools.partial(jax.jit, donate_argnames=("cache",))
def _install_row(cache: PagedKVCache, row, slot_map_P, live_idx_JP, live_len_J, seq_len):
    """Row ``row``'s tables from the host record (``live_idx_JP``: each of its J live lists)."""
    return cache.replace(
        slot_map=cache.slot_map.at[row].set(slot_map_P),
        live_idx=cache.live_idx.at[:, row].set(live_idx_JP),
        live_len=cache.live_len.at[:, row].set(live_len_J),
        seq_len=cache.seq_len.at[row].set(seq_len),
    )


@jax.jit
def _layer_keys(keys_LUKD, idx_LN, valid_LN):
    """Each layer's own entries of a union key gather: ``[L, N, Hkv, D]`` with
    layer ``l``'s entry ``n`` = ``keys_LUKD[l, idx_LN[l, n]]`` where ``valid_LN``,
    zero elsewhere (padding)."""
    keys = jnp.take_along_axis(keys_LUKD, idx_LN[:, :, None, None], axis=1)
    return jnp.where(valid_LN[:, :, None, None], keys, 0.0)


@dataclasses.dataclass(frozen=True)
class KVCheckpoint:
    """What ``KVManager.checkpoint`` saved: the device pool and tables (or the tables
    alone, a tuple, with ``kv=False``), each row's ``RequestState`` (None: free),
    the allocator's state and, with ``kv=False``, the slots it pins."""

    cache: object
    rows: list
    allocator_state: dict
    held: np.ndarray | None = None  # kv=False: the slots held at the checkpoint, pinned until a rollback


class KVManager:
    """The cache state of up to ``rows`` requests (module docstring).

    Args:
      pool: the pool object (``FloatKV`` / ``QuantizedKV``).
      cache: the empty device cache it made. cfg: the model's ``ModelConfig``
        (layers, heads; its rotary settings rotate a compact layout's kept keys).
      max_positions: positions per row (P). lists: live lists per row (J).
      mesh: the model's mesh, or None.
      reclaim: optional ``reclaim(n_slots) -> freed`` called when fewer than the
        needed slots are free (the radix cache's LRU eviction); only if it cannot
        free enough does an allocation raise ``OutOfSlotsError``.
    """

    def __init__(self, pool, cache, cfg, *, rows: int, max_positions: int, lists: int, mesh=None, reclaim: Callable | None = None):
        self.pool = pool
        self._cache = cache
        self.cfg = cfg
        self.allocator = pool.allocator
        self.row_state: list[RequestState | None] = [None] * rows
        self.max_positions = int(max_positions)
        self.lists = int(lists)
        self.num_layers = cfg.num_layers
        self.rope = cfg.rope
        self.mesh = mesh
        self.reclaim = reclaim
        self.writes = 0

    @classmethod
    def create(
        cls,
        model,
        *,
        rows: int,
        max_positions: int,
        num_slots: int | None = None,
        kv_quant=None,
        kv_memory_bytes: int | None = None,
        kv_page_share: float | None = None,
        layer_lists: bool = False,
        kv_rotate: bool = False,
        reclaim: Callable | None = None,
    ) -> KVManager:
        """A manager of a new pool for ``model`` (``jaxkv.Engine``'s arguments of the
        same names): the pool sized by slots (default ``rows x max_positions + 1``) or
        by memory (``pool_for_bytes``), its cache made on the model's mesh, split by
        KV head, where the model has one."""
        cfg, mesh = model.config, model.mesh
        platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
        dtype = float_pool_dtype(model.dtype, platform)  # float pool, or a quantized pool's float region
        if kv_memory_bytes is not None:
            if num_slots is not None:
                raise ConfigError("give num_slots or kv_memory_bytes, not both")
            pool = pool_for_bytes(kv_quant, kv_memory_bytes, cfg, float_dtype=dtype, page_share=kv_page_share, rotate=kv_rotate)
        else:
            pool = make_pool(kv_quant, num_slots or rows * max_positions + 1, head_dim=cfg.head_dim, float_dtype=dtype, rotate=kv_rotate)
        pool.check_mesh(mesh)
        lists = cfg.num_layers if layer_lists else 1
        make = pool.cache_factory(cfg, rows=rows, positions=max_positions, dtype=dtype, lists=lists)
        cache = make() if mesh is None else jax.jit(make, out_shardings=cache_sharding(jax.eval_shape(make), mesh))()
        return cls(pool, cache, cfg, rows=rows, max_positions=max_positions, lists=lists, mesh=mesh, reclaim=reclaim)

    # -- the cache -------------------------------------------------------------------
    @property
    def cache(self):
        """The device state: the pool and every row's tables (read-only here; every
        write goes through a method of this class)."""
        return self._cache

    def commit(self, cache, *, truncation: bool = False) -> None:
        """The one assignment of the cache: ``cache`` replaces it. Every write but a
        truncation counts in ``writes``."""
        self._cache = cache
        if not truncation:
            self.writes += 1

    def close(self) -> None:
        """Free the device arrays now; idempotent. Nothing can be opened afterwards."""
        self.commit(None)

    @property
    def closed(self) -> bool:
        return self._cache is None

    def check_open(self) -> None:
        if self._cache is None:
            raise JaxKVError("the engine is closed (its KV pool was freed)")

    # -- allocation: the one path ------------------------------------------------------
    def make_room(self, n: int) -> None:
        """Reclaim radix-cached slots until ``n`` are free, if a reclaimer is set and
        fewer are (it may free fewer: the caller's allocation then raises)."""
        short = int(n) - self.allocator.num_free
        if short > 0 and self.reclaim is not None:
            self.reclaim(short)

    def reserve(self, n: int) -> None:
        """``make_room(n)``, then ``OutOfSlotsError`` unless ``n`` slots are free:
        a check before work that allocates in several calls starts (nothing taken)."""
        self.make_room(n)
        if n > self.allocator.num_free:
            raise OutOfSlotsError(f"the work needs {n} KV slots, {self.allocator.num_free} free")

    def allocate(self, n: int, row: int | None = None, kind: int | None = None) -> np.ndarray:
        """``n`` fresh slots, reclaiming cached ones first when the pool is short;
        counted against ``row``'s request when given. ``OutOfSlotsError`` (nothing
        allocated) if they cannot be had. ``kind``: a quantized pool's region."""
        self.make_room(n)
        slots = self.allocator.allocate(n) if kind is None else self.allocator.allocate(n, kind)
        if row is not None:
            self.row(row).allocated += int(n)
        return slots

    def release(self, slots) -> np.ndarray:
        """Drop one reference per listed slot; returns the slots that became free."""
        return self.allocator.release(slots)

    def abandon_prefill(self, job) -> np.ndarray:
        """Release the slots of a prefill job's unwritten tokens (cancelled or failed
        half-way); returns the slots freed."""
        rest = job.slots[job.done :]
        job.done, job.slots = job.tokens.size, job.slots[: job.done]
        return self.release(rest)

    # -- rows ------------------------------------------------------------------------
    @property
    def rows(self) -> int:
        return len(self.row_state)

    @property
    def free_rows(self) -> int:
        return sum(state is None for state in self.row_state)

    def row(self, row: int) -> RequestState:
        """The open row's host record (``JaxKVError`` if it is not open)."""
        if not 0 <= row < len(self.row_state) or self.row_state[row] is None:
            raise JaxKVError(f"cache row {row} is not open")
        return self.row_state[row]

    def open_row(self, prefix_slots: Sequence[int] = (), prefix_tokens: Sequence[int] | None = None) -> int:
        """Take a free row; install ``prefix_slots`` (may contain sentinel holes)
        and, when known, the tokens at those positions."""
        self.check_open()
        try:
            row = self.row_state.index(None)
        except ValueError:
            raise JaxKVError(f"all {len(self.row_state)} cache rows are in use") from None
        prefix = np.asarray(prefix_slots, dtype=np.int64).reshape(-1)
        if prefix.size > self.max_positions:
            raise ContextLengthError(f"prefix of {prefix.size} tokens exceeds {self.max_positions} positions")
        state = RequestState(prefix.tolist(), prefix_tokens)  # validates before any change
        self.allocator.ref(state.owned())
        self.row_state[row] = state
        self.push_row(row)
        return row

    def close_row(self, row: int) -> np.ndarray:
        """Release the row's references; returns slots that became free."""
        freed = self.release(self.row(row).owned())
        self.row_state[row] = None
        return freed

    def push_row(self, row: int, *, truncation: bool = False) -> None:
        """Write the row's device tables from its host record."""
        state = self.row_state[row]
        P, J = self.max_positions, self.lists
        slot_map = np.zeros(P, np.int32)
        slot_map[: state.seq_len] = state.slots
        live, lengths = np.zeros((J, P), np.int32), np.zeros(J, np.int32)
        for j, slots in enumerate(state.layer_lists(J)):
            live[j, : len(slots)], lengths[j] = slots, len(slots)
        self.commit(_install_row(self._cache, row, slot_map, live, lengths, state.seq_len), truncation=truncation)

    def start(self, job, chunk: int):
        """Start a job: a ``PrefillJob``'s slots are allocated now (through the pool's
        write plan: a quantized pool's INT2 pages per ``chunk``), counted against its
        row, with the buffers its outputs fill; a ``DecodeJob``'s positions are
        checked (its slots are taken per call). ``OutOfSlotsError``,
        ``ContextLengthError`` or ``JaxKVError`` before any change. Returns the job."""
        from jaxkv.engine.jobs import DecodeJob

        state = self.check_room(job.row, job.n_steps if isinstance(job, DecodeJob) else job.tokens.size)
        if isinstance(job, DecodeJob):
            job.started = True
            return job
        if job.kv_source is not None:
            self._check_import(job)
        job.kv_plan, job.slots = self.pool.plan_prefill(self, job.kv_bits, job.tokens.size, chunk)
        state.allocated += int(job.tokens.size)
        cfg = self.cfg
        if job.attn_mass:
            job.mass = np.zeros(state.seq_len + job.tokens.size, np.float32)
        if job.q_idx_X is not None:
            job.q_rows = np.zeros((cfg.num_layers, job.q_idx_X.size, cfg.num_heads, cfg.head_dim), np.float32)
        return job

    def _check_import(self, job) -> None:
        """An imported prefill's K/V have the row's shapes, and nothing a forward
        computes is asked of it."""
        cfg, src, n = self.cfg, job.kv_source, job.tokens.size
        want = (cfg.num_layers, n, cfg.num_kv_heads, cfg.head_dim)
        if tuple(np.shape(src.k)) != want or tuple(np.shape(src.v)) != want:
            raise JaxKVError(
                f"an imported prefill of {n} tokens needs K and V of shape {want}, got {np.shape(src.k)} and {np.shape(src.v)}"
            )
        if job.logits == "all" or job.q_idx_X is not None or job.attn_mass:
            raise JaxKVError("an imported prefill runs no forward: it has no logits but its last ones, no query rows, no attention mass")
        if self.mesh is not None:
            raise JaxKVError("an imported prefill runs on one device (no mesh)")

    def append(self, row: int, tokens, slots) -> None:
        """Record tokens a step wrote into the row (host only: the step's program
        already appended them to the device tables)."""
        self.row(row).append(tokens, slots)

    def check_room(self, row: int, n: int) -> RequestState:
        """``ContextLengthError`` unless ``n`` more positions fit the row."""
        state = self.row(row)
        if state.seq_len + n > self.max_positions:
            raise ContextLengthError(f"row {row}: {state.seq_len} cached + {n} new tokens exceed {self.max_positions} positions")
        return state

    def set_layer_live(self, row: int, mask_LP) -> None:
        """Per-layer keep sets of a row's positions (bool ``[L, seq_len]``; None: one
        set for the model): layer ``l`` reads position ``p`` iff ``mask[l, p]``
        (``RequestState.set_layer_live``). Needs a live list per layer (``ConfigError``)."""
        state = self.row(row)
        if mask_LP is not None and self.lists == 1:
            raise ConfigError("per-layer keep sets need an engine with a live list per layer (Engine(layer_lists=True))")
        state.set_layer_live(mask_LP)
        self.push_row(row)

    def truncate_row(self, row: int, length: int) -> np.ndarray:
        """Forget positions ``>= length`` of a row; returns the slots that became free."""
        state = self.row(row)
        if not 0 <= length <= state.seq_len:
            raise JaxKVError(f"cannot truncate row {row} of {state.seq_len} positions to {length}")
        freed = self.release(state.truncate(length))
        self.push_row(row, truncation=True)
        return freed

    def set_row_tables(self, row: int, slots: Sequence[int], live: Sequence[int]) -> None:
        """Replace a row's host and device tables for the same positions."""
        self.row(row).set_tables(slots, live)
        self.push_row(row)

    # -- reads -----------------------------------------------------------------------
    def live_positions(self, row: int) -> np.ndarray:
        """Positions of the row's live entries (in live-list order = position order)."""
        return self.row(row).live_positions()

    def composition(self, row: int) -> dict:
        """Live tokens of the row per precision ``{2: n, 4: n, 16: n}`` (a float pool: all 16)."""
        return self.pool.composition(self.row(row))

    def page_table(self, row: int):
        """A quantized pool's page table of the row (``PageTable``), as decode reads it."""
        return self.pool.page_table(self.row(row))

    def gather_keys(self, row: int, n: int | None = None) -> jax.Array:
        """Post-RoPE keys of the row's live positions ``[L, N, Hkv, D]``, padded
        with the sentinel's row up to ``n`` entries when given."""
        live = np.asarray(self.row(row).live, np.int32)
        if n is not None:
            live = np.concatenate([live, np.full(n - live.size, SENTINEL_SLOT, np.int32)])
        return self.pool.gather_keys(self._cache, live)

    def gather_layer_keys(self, row: int, n: int | None = None) -> tuple[jax.Array, list[np.ndarray]]:
        """Each layer's own live keys: ``(keys [L, N, Hkv, D], positions)`` where
        layer ``l``'s entries are the keys of ``positions[l]`` (its live list, in
        position order), padded up to ``n`` entries (zeros with per-layer sets).
        Without per-layer sets every layer holds the row's live keys."""
        state = self.row(row)
        union = state.live_positions()
        keys = self.gather_keys(row, n)
        if state.layer_live is None:
            return keys, [union] * self.num_layers
        per_layer = [np.flatnonzero(m) for m in state.layer_live]
        N = keys.shape[1]
        idx = np.zeros((self.num_layers, N), np.int32)
        valid = np.zeros((self.num_layers, N), bool)
        for l, pos in enumerate(per_layer):
            idx[l, : pos.size], valid[l, : pos.size] = np.searchsorted(union, pos), True
        return _layer_keys(keys, idx, valid), per_layer

    def gather_rows(self, slots) -> tuple[np.ndarray, np.ndarray]:
        """Host copies of the K and V rows at ``slots`` (a quantized pool's packed blobs)."""
        return self.pool.gather_rows(self._cache, slots)

    def gather_float(self, slots) -> tuple[np.ndarray, np.ndarray]:
        """float32 host copies of the K and V rows at ``slots`` ``[L, M, Hkv, D]``."""
        return self.pool.gather_float(self._cache, slots)

    # -- eviction, promotion, precision ------------------------------------------------
    def apply_layout(self, row: int, plan, *, keep_evicted: bool = False):
        """Apply a ``jaxkv.policies.layouts.LayoutPlan`` to a row (pool + tables).
        With ``keep_evicted``, returns host copies ``(k_LMKD, v_LMKD)`` of the evicted
        rows, read before they are released (what the RepairKV host tier shelves).
        A renumbering plan (compact) re-indexes the row's ``RequestState``."""
        state = self.row(row)
        if plan.layer_keep is not None and self.lists == 1:
            raise ConfigError("per-layer keep sets need an engine with a live list per layer (Engine(layer_lists=True))")
        evicted = self.gather_rows(plan.evicted_slots) if keep_evicted else None
        if plan.copy_src.size:  # kept rows to fresh slots, keys rotated (a quantized pool re-encodes)
            self.commit(self.pool.compact(self._cache, plan, self.rope))
        if plan.renumbered:
            state.reindex(plan.kept_positions, plan.slots, plan.live)
        else:
            state.set_tables(plan.slots, plan.live)
        if plan.layer_keep is not None:
            state.set_layer_live(plan.layer_keep)
        self.push_row(row)
        self.release(plan.released)
        return evicted

    def fresh_slots(self, row: int, positions) -> np.ndarray:
        """Fresh slots to copy a row's ``positions`` into (a compact layout), counted
        against the row; a quantized pool keeps each token's precision class."""
        state = self.row(row)
        slots = self.pool.fresh_slots(self, state, positions)
        state.allocated += len(slots)
        return slots

    def restore_rows(self, row: int, positions_M, k_LMKD, v_LMKD) -> np.ndarray:
        """RepairKV's apply step: evicted rows back into ``row`` at their original
        positions, bit-identical, in fresh slots (returned). ``RepairError``
        (nothing changed) when a position is not a hole of the row."""
        pos = np.asarray(positions_M, np.int64)
        if pos.size == 0:
            return np.zeros(0, np.int64)
        state = self.row(row)
        promotion_tables(state.slots, pos, np.ones(pos.size, np.int64))  # validate first
        cache, fresh = self.pool.restore(self._cache, self, k_LMKD, v_LMKD, staged=self.mesh is None)
        self.commit(cache)
        state.allocated += len(fresh)
        slots, live = promotion_tables(state.slots, pos, fresh)
        self.set_row_tables(row, slots, live)
        return fresh

    def requantize(self, row: int, positions, bits) -> None:
        """Move the row's tokens at ``positions`` to the precision ``bits`` (2 or 4
        per token) choose, as a prefill with these ``kv_bits`` would have written
        them (for tokens first written another way, such as a spliced prefill's)."""
        self._moved(row, self.pool.requantize(self._cache, self, self.row(row), positions, bits))

    def settle(self, rows) -> None:
        """After a write: the pool's aging (KIVI's residual into pages) per row."""
        for row in rows:
            self._moved(row, self.pool.settle(self._cache, self, self.row(row)))

    def _moved(self, row: int, moved) -> None:
        """Apply a pool move: ``None`` (nothing moved) or ``(cache, slots_P, released)``."""
        if moved is None:
            return
        cache, slots, released = moved
        self.commit(cache)
        self.set_row_tables(row, slots.tolist(), slots[slots != SENTINEL_SLOT].tolist())
        self.release(released)

    def import_rows(self, row: int, tokens, slots, k_LTKD, v_LTKD, plan, T: int) -> None:
        """Store K/V computed elsewhere at ``slots`` (an imported prefill's chunk, padded
        to ``T`` tokens) as a step stores them, and record the tokens in the row."""
        n = len(slots)
        padded = np.zeros(T, np.int32)
        padded[:n] = slots
        self.commit(import_rows(self._cache, padded, k_LTKD, v_LTKD, plan, layers=self.pool.layers))
        self.row(row).append(tokens, slots)
        self.push_row(row)

    # -- branches (evaluations) ----------------------------------------------------------
    def checkpoint(self, *, kv: bool = True) -> KVCheckpoint:
        """Everything a later ``rollback`` needs to undo what happens meanwhile: a copy
        of the device tables and, with ``kv``, of the pool (later steps donate the
        live ones), and of the host bookkeeping. Evaluations branch with it: try one
        decision on an open row, measure, roll back, try the next.

        ``kv=False`` skips the pool's copy. Every slot held at the checkpoint then
        keeps one more reference until the rollback, so a slot an eviction frees
        meanwhile is not handed out again and new tokens land in slots that were
        free: the KV of every slot held at the checkpoint is untouched by prefill,
        decode and dead-slot or compact evictions on the float pool. A quantized
        pool (its pages settle and requantize in place), a segment-reuse rewrite or
        a repair that writes back needs ``kv=True``."""
        rows, allocator_state = copy.deepcopy(self.row_state), copy.deepcopy(self.allocator.__dict__)
        c = self._cache
        if kv:
            return KVCheckpoint(jax.tree.map(jnp.copy, c), rows, allocator_state)
        tables = tuple(jnp.copy(t) for t in (c.slot_map, c.live_idx, c.live_len, c.seq_len))
        held = np.flatnonzero(self.allocator.refcounts() > 0)
        self.allocator.ref(held)
        return KVCheckpoint(tables, rows, allocator_state, held)

    def rollback(self, checkpoint: KVCheckpoint) -> None:
        """Return to ``checkpoint`` (it stays valid). Host objects are restored in
        place, so references to an open row's ``RequestState`` or to the allocator
        keep pointing at the live ones."""
        if checkpoint.held is not None:  # tables only: the pool stays as it is
            slot_map, live_idx, live_len, seq_len = (jnp.copy(t) for t in checkpoint.cache)
            self.commit(self._cache.replace(slot_map=slot_map, live_idx=live_idx, live_len=live_len, seq_len=seq_len))
        else:
            self.commit(jax.tree.map(jnp.copy, checkpoint.cache))
        self.allocator.__dict__.update(copy.deepcopy(checkpoint.allocator_state))
        if checkpoint.held is not None:
            self.allocator.ref(checkpoint.held)  # pinned again for the next branch
        for row, saved in enumerate(checkpoint.rows):
            if saved is None or self.row_state[row] is None:
                self.row_state[row] = copy.deepcopy(saved)
            else:
                self.row_state[row].__dict__.update(copy.deepcopy(saved.__dict__))

    def discard(self, checkpoint: KVCheckpoint) -> None:
        """Done with ``checkpoint``: drop the references a ``kv=False`` checkpoint holds."""
        if checkpoint.held is not None:
            self.release(checkpoint.held)


__all__ = ["KVCheckpoint", "KVManager", "OutOfSlotsError"]
