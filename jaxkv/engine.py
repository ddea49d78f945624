"""The engine: the only writer of device state, and the jit'd steps it runs.

An ``Engine`` owns one paged KV pool (``PagedKVCache``: pool + per-row tables),
its slot allocator, and the host record of every open row (``RequestState``).
Everything that changes the pool or the tables is an ``Engine`` method; the turn
pipeline, the retention and repair stages and the scheduler decide, the engine
applies. Read top to bottom, a request goes:

1. ``open_row(prefix_slots, prefix_tokens)``: take a cache row; a reused prefix (from
   the radix cache) is installed as its first positions. Sentinel entries are
   holes: neither re-prefilled nor read.
2. ``start_prefill(row, tokens, ...) -> PrefillJob``: slots are allocated on the
   host (before any change), then ``step_prefill(jobs)`` advances every job by one
   chunk in batched jit'd ``prefill_step`` calls over just those rows (one per
   chunk width and power-of-two group, so no row is padding).
   ``prefill(rows, token_lists)`` runs jobs to completion. A job given a
   ``KVSource`` (K/V computed elsewhere) *imports* them: the pool stores them as
   its prefill would, and no forward runs.
3. ``apply_layout(row, plan, keep_evicted=)``: a compression event's decision (a
   ``LayoutPlan``); with ``keep_evicted`` the evicted rows' K/V come back as host
   arrays first (shelving them in the RepairKV host tier).
4. ``restore_rows(row, positions, k, v)``: RepairKV promotion, rows written back
   bit-identical at their original positions.
5. ``start_decode(row, first_token, n, ...) -> DecodeJob``, then
   ``step_decode(jobs, steps)``: one batched jit'd ``decode_loop`` over the jobs'
   rows (a ``lax.while_loop``; each row stops at a stop token or its own limit).
   ``decode(rows, first_tokens, n)`` runs jobs to completion.
6. ``truncate_row`` (drop a probe generation), ``close_row`` (drop references).

The pool is one object behind one interface (``jaxkv.cache.pools``):
``self.pool`` is ``FloatKV`` (full precision) or ``QuantizedKV`` (``Engine(kv_quant=...)``:
INT2 pages, INT4 and float slots, TriAxialKV). The engine's jit'd steps call its
device ops (``prefill_op``, ``decode_op``) and its methods call the pool's host
plans, so nothing here branches on the pool's kind: a quantized prefill writes
each token at the precision its ``kv_bits`` say, decode reads page tables,
eviction and promotion move packed rows, all inside the pool's module.

The scheduler (``jaxkv.serving.scheduler``) calls the job methods for many rows at
once; a single request (``generate``, tests) calls the run-to-completion methods,
which are the same jobs.

Invariants:
  * the host mirror of each row (``RequestState``) equals the device tables after
    every call (tests check ``slot_map``/``live_idx`` against it);
  * each row holds exactly one allocator reference per non-sentinel slot it maps;
  * host checks (slots, context length) run before any device call, so a failing
    call leaves cache and allocator untouched;
  * jit'd steps see only the rows they serve (``take_rows``/``put_rows``), padded
    to a bucket; lengths that reach shapes are bucketed (``jaxkv.buckets``), and
    decode reads ``live_idx[:, :n_read]``, so attention cost follows the live
    tokens, not the positions;
  * the engine is not thread-safe: one thread (the scheduler's) drives it;
  * with a model placed on a mesh (``jaxkv.models.sharding``), the pool is split by
    KV head and stays so, donated, through every step, and a step's rows are split
    over ``dp``; the host side is the same.

``generate`` and ``score_logits`` are the public one-shot entry points.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv import buckets, compiles
from jaxkv.buckets import bucket
from jaxkv.cache.allocator import SENTINEL_SLOT
from jaxkv.cache.pools import import_rows, make_pool, pool_for_bytes
from jaxkv.cache.request import RequestState, promotion_tables
from jaxkv.cache.state import PagedKVCache, float_pool_dtype
from jaxkv.errors import ConfigError, ContextLengthError, JaxKVError, OutOfSlotsError
from jaxkv.models.loading import Model
from jaxkv.pallas.ragged_attention import ragged_backend
from jaxkv.sampling import RowSamplers, make_sampler, sample
from jaxkv.step import NO_FEATURES, DecodeBatch, Features, StepBatch, cache_sharding, layer_copies, run_decode, run_step

PREFILL_CHUNK = 512  # tokens per prefill step; chosen by eval/bench/prefill.py (README)
FIRST_TOKEN_KEY = 1 << 30  # the first reply token is drawn with fold_in(key, this)


# ============================================================================ small jit'd helpers
@functools.partial(jax.jit, static_argnames=("graphdef",))
def _dense_logits(graphdef, params, tokens_BT):
    return nnx.merge(graphdef, params)(tokens_BT)


@functools.partial(jax.jit, donate_argnames=("cache",))
def _install_row(cache: PagedKVCache, row, slot_map_P, live_idx_JP, live_len_J, seq_len):
    """Row ``row``'s tables from the host mirror (``live_idx_JP``: each of its J
    live lists)."""
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


def _list_mass(mass_JN, positions_J, seq_len: int, n_new: int) -> np.ndarray:
    """Attention mass per position ``[seq_len + n_new]`` of one step row from the
    mass of each of its live lists' entries (``mass_JN``: list ``j``'s entries are
    the positions ``positions_J[j]``, then the step's ``n_new`` tokens)."""
    out = np.zeros(seq_len + n_new, np.float32)
    new = seq_len + np.arange(n_new)
    for m_N, pos in zip(mass_JN, positions_J):
        np.add.at(out, np.concatenate([pos, new]), m_N[: pos.size + n_new])
    return out


# ============================================================================ jobs
@dataclasses.dataclass(frozen=True)
class KVSource:
    """A prompt's K/V computed elsewhere, for an *imported* prefill
    (``Engine.start_prefill(kv_source=...)``): the pool stores these rows exactly as
    a prefill stores the K/V it computes, and no forward runs.

    What it is for: branching one full-precision prefill into pools of other
    formats (``eval.quality.real_model``'s quantized cells). A chunked prefill on a
    quantized pool attends to the *dequantized* earlier chunks; an imported one
    holds the K/V of a full-precision forward, which is what a quantized prefill
    of the whole prompt in one chunk stores (the papers' protocol: KIVI,
    transformers' quantized cache).

    Attributes:
      k, v: ``[L, n, K, D]`` float post-RoPE keys and values of the ``n`` tokens,
        at the positions the tokens will take in the row.
      last_logits: ``[V]`` the next-token logits after the last token (what the
        prefill returns).
    """

    k: np.ndarray
    v: np.ndarray
    last_logits: np.ndarray


@dataclasses.dataclass
class PrefillJob:
    """One row's prefill, advanced chunk by chunk (``Engine.step_prefill``).

    Attributes:
      row: the cache row. tokens: ids to append ``[n]``; slots: their pool slots,
        allocated when the job was made.
      done: tokens written so far.
      all_logits: return logits of every new token (else of the last one).
      q_idx_X: indices into ``tokens`` whose post-RoPE queries are captured.
      attn_mass: accumulate the attention mass each position receives.
      logits: list of ``[n_chunk or 1, V]`` float32 arrays; q_rows ``[L, X, Hq, D]``;
      mass ``[seq_len]`` (positions of the whole row after the job; mean over
      layers and query heads, summed over the job's queries).
      kv_plan: a quantized engine's ``WritePlan`` (slots and INT2 pages per chunk).
      kv_source: a ``KVSource``: the job writes its K/V instead of running the
        model (an imported prefill).
    """

    row: int
    tokens: np.ndarray
    slots: np.ndarray
    all_logits: bool = False
    q_idx_X: np.ndarray | None = None
    attn_mass: bool = False
    done: int = 0
    logits: list = dataclasses.field(default_factory=list)
    q_rows: np.ndarray | None = None
    mass: np.ndarray | None = None
    kv_plan: object = None
    kv_source: KVSource | None = None

    @property
    def finished(self) -> bool:
        return self.done >= self.tokens.size

    @property
    def features(self) -> Features:
        return Features(query_rows=self.q_idx_X is not None, attn_mass=self.attn_mass)

    def result_logits(self) -> np.ndarray:
        """``[n, V]`` with ``all_logits``, else the last token's ``[V]``."""
        return np.concatenate(self.logits) if self.all_logits else self.logits[-1][-1]


@dataclasses.dataclass
class DecodeJob:
    """One row's decode of up to ``n_steps`` tokens, advanced by ``Engine.step_decode``.

    Attributes:
      row: the cache row; first_token: the token fed at the first step.
      n_steps: tokens to decode at most (the row may stop earlier at a stop token).
      temperature / top_k / top_p: the row's sampler (``jaxkv.sampling.RowSamplers``).
      key: the row's ``jax.random`` key; step0: index of the first step in the
        request's reply (the key of step s is ``fold_in(key, step0 + s)``).
      stop_ids: tokens that end the row (the stop token is emitted).
      forced: teacher-forced tokens fed after the first step (or None).
      return_logits / features: what to bring back per step.
      tokens, fed: sampled tokens and how many tokens were written so far;
      logits ``[n, V]``, q_rows ``[n, L, Hq, D]``, mass ``[seq_len]`` (per
      position, for this job's steps) filled as it runs; stopped: a stop token came.
    """

    row: int
    first_token: int
    n_steps: int
    temperature: float
    top_k: int | None
    top_p: float | None
    key: jax.Array
    stop_ids: tuple = ()
    step0: int = 0
    forced: list | None = None
    return_logits: bool = False
    features: Features = NO_FEATURES
    tokens: list = dataclasses.field(default_factory=list)
    fed: int = 0
    stopped: bool = False
    logits: list = dataclasses.field(default_factory=list)
    q_rows: list = dataclasses.field(default_factory=list)
    mass: np.ndarray | None = None

    @property
    def finished(self) -> bool:
        return self.stopped or self.fed >= self.n_steps

    @property
    def next_feed(self) -> int:
        """The token the next step feeds: the first token, then the last sample
        (or, teacher-forced, the next forced token)."""
        if self.fed == 0:
            return self.first_token
        return self.forced[self.fed - 1] if self.forced is not None else self.tokens[-1]


@dataclasses.dataclass(frozen=True)
class KeptWindow:
    """The last decode call's window (``jaxkv.cache.window.DecodeWindow``), kept so
    that the next decode call over the same rows starts from it instead of copying
    every row's list again (``Engine.step_decode``).

    Attributes:
      rows: the call's rows, padding included; n_steps and width: its window's shape.
      window: the window as the call returned it (blocks as at the call's start,
        its new entries in the second part).
      len_JB: the list lengths the blocks held at the call's start, per live list
        and call row (host); fed_B: the entries the call wrote per row.
    """

    rows: tuple
    n_steps: int
    width: int
    window: object
    len_JB: np.ndarray
    fed_B: np.ndarray


# ============================================================================ the engine
@dataclasses.dataclass(frozen=True)
class EngineCheckpoint:
    """What ``Engine.checkpoint`` saved: the device pool and tables (or the tables
    alone, a tuple, with ``kv=False``), each row's ``RequestState`` (None: free),
    the allocator's state and, with ``kv=False``, the slots it pins."""

    cache: PagedKVCache | tuple
    rows: list
    allocator_state: dict
    held: np.ndarray | None = None  # kv=False: the slots held at the checkpoint, pinned until a rollback


def _platform(mesh) -> str:
    """The platform the pool lives on: the mesh's devices', else JAX's default backend."""
    return mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()


class Engine:
    """A paged KV pool plus the host bookkeeping for up to ``rows`` requests.

    Args:
      model: a loaded ``Model``.
      rows: concurrent requests (cache rows).
      max_positions: positions per row (P); defaults to the model context, at most 8192.
      num_slots: pool slots including the sentinel; default ``rows * P + 1``.
      prefill_chunk: the most tokens of one row a step takes (``PREFILL_CHUNK``).
      token_budget: the most tokens of one step (default
        ``buckets.token_budget``: a whole chunk beside a decode token of every row).
      backend: the ragged attention's backend (``jaxkv.pallas.ragged_attention``;
        None: the blocked XLA implementation on the CPU, the kernels elsewhere).
      reclaim: optional ``reclaim(n_slots) -> freed`` called when fewer than the
        needed slots are free (e.g. the radix cache's LRU eviction); only if it
        cannot free enough does the allocation raise ``OutOfSlotsError``.
      kv_quant: None (float pool) or a mode of ``jaxkv.cache.quantized_host.MODES``:
        a dual INT2/INT4 (and, for ``kivi2``/``kivi4``, float) pool whose token region holds
        ``num_slots - 1`` tokens; prefills take per-token ``kv_bits``. Either is
        ``self.pool`` (``jaxkv.cache.pools``).
      kv_memory_bytes: size the pool by memory instead of ``num_slots``: the
        largest pool of this ``kv_quant`` whose KV bytes (codes, scales and zero
        points, float rows; not the tables) fit (``jaxkv.cache.pools.pool_for_bytes``).
      kv_page_share: with ``kv_memory_bytes``, the share of a quantized pool's
        tokens that go to INT2 pages (default 0 for ``int4`` and the triaxial modes;
        the KIVI modes need one).
      layer_lists: give each row one live list per layer (J = L, ``jaxkv.cache.state``),
        so a row may keep a set per layer (``RequestState.layer_live``,
        ``keep_sets="layer"``); False (default): one list per row read by every
        layer (J = 1). Rows that keep one set for the model hold L equal lists.
    """

    def __init__(self, model: Model, *, rows: int = 1, max_positions: int | None = None, num_slots: int | None = None, prefill_chunk: int = PREFILL_CHUNK, token_budget: int | None = None, backend=None, reclaim=None, kv_quant=None, kv_memory_bytes: int | None = None, kv_page_share: float | None = None, layer_lists: bool = False):
        cfg = model.config
        self.model = model
        self.graphdef, self.params = model.split()
        self._layer_params_kept = None  # _layer_params
        self._kept_window = None  # KeptWindow: the last decode call's window (``_decode_window``)
        P = int(max_positions or min(cfg.max_position_embeddings, 8192))
        if P > cfg.max_position_embeddings:
            raise ContextLengthError(
                f"max_positions {P} exceeds the model context {cfg.max_position_embeddings}"
            )
        self.max_positions = P
        self.mesh = model.mesh  # tensor / data parallel (jaxkv.models.sharding), or None
        pool_dtype = float_pool_dtype(model.dtype, _platform(self.mesh))  # float pool, or a quantized pool's float region
        if kv_memory_bytes is not None:
            if num_slots is not None:
                raise ConfigError("give num_slots or kv_memory_bytes, not both")
            self.pool = pool_for_bytes(kv_quant, kv_memory_bytes, cfg, float_dtype=pool_dtype, page_share=kv_page_share, backend=backend)
        else:
            self.pool = make_pool(kv_quant, num_slots or rows * P + 1, head_dim=cfg.head_dim, float_dtype=pool_dtype, backend=backend)
        self.pool.check_mesh(self.mesh)
        self.allocator = self.pool.allocator
        self.lists = cfg.num_layers if layer_lists else 1  # J: live lists per row
        create = self.pool.cache_factory(cfg, rows=rows, positions=P, dtype=pool_dtype, lists=self.lists)
        if self.mesh is None:
            self.cache = create()
        else:  # made in place on the mesh: no device ever holds the whole pool
            self.cache = jax.jit(create, out_shardings=cache_sharding(jax.eval_shape(create), self.mesh))()
        self.prefill_chunk = int(prefill_chunk)
        if self.prefill_chunk < 1:
            raise JaxKVError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.token_budget = int(token_budget) if token_budget is not None else buckets.token_budget(self.prefill_chunk, rows)
        if self.token_budget < max(self.prefill_chunk, rows) or self.token_budget < rows + (self.prefill_chunk if self.pool.whole_chunks else 1):
            raise JaxKVError(
                f"token_budget {self.token_budget} cannot hold a decode token of each of {rows} rows beside a prefill "
                f"piece{' of a whole chunk' if self.pool.whole_chunks else ''} (prefill_chunk {self.prefill_chunk})"
            )
        self.backend = backend
        self.attention_backend = ragged_backend(backend)  # "blocked" on the CPU, or a kernel backend
        self.decode_window = True  # CPU: decode calls read a per-call copy of the rows' lists (``uses_window``)
        self.row_state: list[RequestState | None] = [None] * rows
        self.reclaim = reclaim

    @property
    def cache(self) -> PagedKVCache:
        """The device state: the pool and every row's tables. Every write of it
        but a decode call's own drops the decode window that call kept
        (``KeptWindow``): whatever else changed, the next decode call copies the
        rows' lists again. ``truncate_row`` alone keeps it (a truncated list is a
        prefix of the one the window holds)."""
        return self._cache

    @cache.setter
    def cache(self, value) -> None:
        self._cache = value
        self._kept_window = None

    @property
    def rows(self) -> int:
        return len(self.row_state)

    @property
    def layer_lists(self) -> bool:
        """Whether each row has a live list per layer (rows may keep per-layer sets)."""
        return self.lists > 1

    @property
    def free_rows(self) -> int:
        return sum(state is None for state in self.row_state)

    def allocate(self, n: int, row: int | None = None) -> np.ndarray:
        """``n`` fresh slots, reclaiming cached ones first when the pool is short;
        counted against ``row``'s request when given."""
        short = n - self.allocator.num_free
        if short > 0 and self.reclaim is not None:
            self.reclaim(short)
        slots = self.allocator.allocate(n)
        if row is not None:
            self._row(row).allocated += int(n)
        return slots

    # -- branches ----------------------------------------------------------------
    def checkpoint(self, *, kv: bool = True) -> "EngineCheckpoint":
        """Everything a later ``rollback`` needs to undo what happens meanwhile:
        a copy of the device tables and, with ``kv``, of the pool (later steps
        donate the live ones), and of the host bookkeeping (rows, allocator).
        Evaluations branch with it: try one decision on an open row, measure, roll
        back, try the next, without prefilling the shared prompt again.

        ``kv=False`` skips the pool's copy (the larger part by far, once per
        rollback too). Every slot held at the checkpoint then keeps one more
        reference until the rollback (which takes it again for the next branch), so
        a slot an eviction frees meanwhile is not handed out again and new tokens
        land in slots that were free: the KV of every slot held at the checkpoint
        is untouched by prefill, decode and dead-slot or compact evictions on the
        float pool. A quantized pool (its pages settle and requantize in place), a
        segment-reuse rewrite or a repair that writes back needs ``kv=True``."""
        rows, allocator_state = copy.deepcopy(self.row_state), copy.deepcopy(self.allocator.__dict__)
        if kv:
            return EngineCheckpoint(jax.tree.map(jnp.copy, self.cache), rows, allocator_state)
        tables = tuple(jnp.copy(t) for t in (self.cache.slot_map, self.cache.live_idx, self.cache.live_len, self.cache.seq_len))
        held = np.flatnonzero(self.allocator.refcounts() > 0)
        self.allocator.ref(held)
        return EngineCheckpoint(tables, rows, allocator_state, held)

    def rollback(self, checkpoint: "EngineCheckpoint") -> None:
        """Return to ``checkpoint`` (it stays valid: roll back to it again later).
        Host objects are restored in place, so references to an open row's
        ``RequestState`` or to the allocator keep pointing at the live ones."""
        if checkpoint.held is not None:  # tables only (checkpoint(kv=False)): the pool stays as it is
            slot_map, live_idx, live_len, seq_len = (jnp.copy(t) for t in checkpoint.cache)
            self.cache = self.cache.replace(slot_map=slot_map, live_idx=live_idx, live_len=live_len, seq_len=seq_len)
        else:
            self.cache = jax.tree.map(jnp.copy, checkpoint.cache)
        self.allocator.__dict__.update(copy.deepcopy(checkpoint.allocator_state))
        if checkpoint.held is not None:
            self.allocator.ref(checkpoint.held)  # pinned again for the next branch
        for row, saved in enumerate(checkpoint.rows):
            if saved is None or self.row_state[row] is None:
                self.row_state[row] = copy.deepcopy(saved)
            else:
                self.row_state[row].__dict__.update(copy.deepcopy(saved.__dict__))

    def discard(self, checkpoint: "EngineCheckpoint") -> None:
        """Done with ``checkpoint``: drop the references a ``kv=False`` checkpoint
        holds on its slots (call it after the last rollback to it)."""
        if checkpoint.held is not None:
            self.allocator.release(checkpoint.held)

    # -- rows --------------------------------------------------------------------
    def close(self) -> None:
        """Free the KV pool (its device arrays) now; idempotent. The engine takes no
        more work afterwards: opening a row or running a step raises ``JaxKVError``."""
        self.cache = None
        self._layer_params_kept = None

    @property
    def closed(self) -> bool:
        return self.cache is None

    def _check_open(self) -> None:
        if self.cache is None:
            raise JaxKVError("the engine is closed (its KV pool was freed)")

    def open_row(self, prefix_slots: Sequence[int] = (), prefix_tokens: Sequence[int] | None = None) -> int:
        """Take a free row; install ``prefix_slots`` (may contain sentinel holes)
        and, when known, the tokens at those positions."""
        self._check_open()
        try:
            row = self.row_state.index(None)
        except ValueError:
            raise JaxKVError(f"all {len(self.row_state)} cache rows are in use") from None
        prefix = np.asarray(prefix_slots, dtype=np.int64).reshape(-1)
        if prefix.size > self.max_positions:
            raise ContextLengthError(f"prefix of {prefix.size} tokens exceeds {self.max_positions} positions")
        state = RequestState(prefix.tolist(), prefix_tokens)  # validates before any change
        self.allocator.ref(state.owned())  # validates before changing anything
        self.row_state[row] = state
        self._push_row(row)
        return row

    def close_row(self, row: int) -> np.ndarray:
        """Release the row's references; returns slots that became free."""
        state = self._row(row)
        freed = self.allocator.release(state.owned())
        self.row_state[row] = None
        return freed

    def _row(self, row: int) -> RequestState:
        if not 0 <= row < len(self.row_state) or self.row_state[row] is None:
            raise JaxKVError(f"cache row {row} is not open")
        return self.row_state[row]

    def _push_row(self, row: int) -> None:
        state = self.row_state[row]
        P, J = self.max_positions, self.lists
        slot_map = np.zeros(P, np.int32)
        slot_map[: state.seq_len] = state.slots
        live, lengths = np.zeros((J, P), np.int32), np.zeros(J, np.int32)
        for j, slots in enumerate(state.layer_lists(J)):
            live[j, : len(slots)], lengths[j] = slots, len(slots)
        self.cache = _install_row(self.cache, row, slot_map, live, lengths, state.seq_len)

    def set_layer_live(self, row: int, mask_LP) -> None:
        """Per-layer keep sets of a row's positions (bool ``[L, seq_len]``; None: one
        set for the model): layer ``l`` reads position ``p`` iff ``mask[l, p]``. Holes
        must be read by no layer and a live position by some layer
        (``RequestState.set_layer_live``). Needs ``layer_lists`` (``ConfigError``)."""
        state = self._row(row)
        if mask_LP is not None and not self.layer_lists:
            raise ConfigError("per-layer keep sets need an engine with a live list per layer (Engine(layer_lists=True))")
        state.set_layer_live(mask_LP)
        self._push_row(row)

    def truncate_row(self, row: int, length: int) -> np.ndarray:
        """Forget positions ``>= length`` of a row (e.g. a generation that a replay
        discards); returns the slots that became free."""
        state = self._row(row)
        if not 0 <= length <= state.seq_len:
            raise JaxKVError(f"cannot truncate row {row} of {state.seq_len} positions to {length}")
        freed = self.allocator.release(state.truncate(length))
        kept = self._kept_window
        self._push_row(row)
        self._kept_window = kept  # the row's lists are prefixes of what the window holds (``_decode_window``)
        return freed

    def live_positions(self, row: int) -> np.ndarray:
        """Positions of the row's live entries (in live-list order = position order)."""
        return self._row(row).live_positions()

    def gather_keys(self, row: int, n: int | None = None) -> jax.Array:
        """Post-RoPE keys of the row's live positions ``[L, N, Hkv, D]``, padded
        with the sentinel's row up to ``n`` entries when given."""
        live = np.asarray(self._row(row).live, np.int32)
        if n is not None:
            live = np.concatenate([live, np.full(n - live.size, SENTINEL_SLOT, np.int32)])
        return self.pool.gather_keys(self.cache, live)

    def gather_layer_keys(self, row: int, n: int | None = None) -> tuple[jax.Array, list[np.ndarray]]:
        """Each layer's own live keys: ``(keys [L, N, Hkv, D], positions)`` where
        layer ``l``'s entries are the keys of ``positions[l]`` (its live list, in
        position order), padded up to ``n`` entries (zeros with per-layer sets).
        Without per-layer sets every layer holds the row's live keys (``gather_keys``)."""
        state = self._row(row)
        L = self.model.config.num_layers
        union = state.live_positions()
        keys = self.gather_keys(row, n)
        if state.layer_live is None:
            return keys, [union] * L
        per_layer = [np.flatnonzero(m) for m in state.layer_live]
        N = keys.shape[1]
        idx = np.zeros((L, N), np.int32)
        valid = np.zeros((L, N), bool)
        for l, pos in enumerate(per_layer):
            idx[l, : pos.size], valid[l, : pos.size] = np.searchsorted(union, pos), True
        return _layer_keys(keys, jnp.asarray(idx), jnp.asarray(valid)), per_layer

    def gather_rows(self, slots) -> tuple[np.ndarray, np.ndarray]:
        """Host copies of the K and V rows at ``slots``: ``[L, M, Hkv, D]`` each
        (a quantized pool: packed blobs ``[L, M, Hkv, W]`` uint8, see
        ``jaxkv.cache.quantized_host``; ``host_keys`` dequantizes their keys)."""
        return self.pool.gather_rows(self.cache, slots)

    def gather_float(self, slots) -> tuple[np.ndarray, np.ndarray]:
        """float32 host copies of the K and V rows at ``slots`` ``[L, M, Hkv, D]``
        (a quantized pool's dequantized): what a reused segment stores."""
        return self.pool.gather_float(self.cache, slots)

    def requantize(self, row: int, positions, bits) -> None:
        """Move the row's tokens at ``positions`` to the precision ``bits`` (2 or 4
        per token) choose, as a prefill with these ``kv_bits`` would have written
        them (a quantized pool: 2-bit tokens into whole INT2 pages): for tokens
        first written another way, such as a spliced prefill's."""
        self._row(row)
        self.pool.requantize(self, row, positions, bits)

    def host_keys(self, k_LMKD) -> np.ndarray:
        """float keys of host rows from ``gather_rows`` (a quantized pool's blobs
        dequantized; float rows as they are): what RepairKV scores."""
        return self.pool.host_keys(k_LMKD)

    def fresh_slots(self, row: int, positions) -> np.ndarray:
        """Fresh slots to copy a row's ``positions`` into (a compact layout),
        counted against the row; a quantized pool keeps each token's precision
        class (INT2 tokens regrouped into whole pages)."""
        return self.pool.fresh_slots(self, row, positions)

    def kv_composition(self, row: int) -> dict:
        """Live tokens of the row per precision ``{2: n, 4: n, 16: n}`` (a float
        pool: all 16)."""
        return self.pool.composition(self._row(row))

    def page_table(self, row: int):
        """A quantized pool's page table of the row (``PageTable``: INT2 pages
        first, then INT4 tokens, then float tokens), as decode reads it."""
        return self.pool.page_table(self._row(row))

    # -- eviction and promotion -----------------------------------------------------
    def apply_layout(self, row: int, plan, *, keep_evicted: bool = False):
        """Apply a ``jaxkv.policies.layouts.LayoutPlan`` to a row (pool + tables).

        With ``keep_evicted``, returns host copies ``(k_LMKD, v_LMKD)`` of the
        evicted rows (``plan.evicted_slots``), read before they are released: what
        the RepairKV host tier shelves. A renumbering plan (compact) re-indexes the
        row's ``RequestState``.
        """
        state = self._row(row)
        if plan.layer_keep is not None and not self.layer_lists:
            raise ConfigError("per-layer keep sets need an engine with a live list per layer (Engine(layer_lists=True))")
        evicted = self.gather_rows(plan.evicted_slots) if keep_evicted else None
        if plan.copy_src.size:  # kept rows to fresh slots, keys rotated (a quantized pool re-encodes)
            self.cache = self.pool.compact(self.cache, plan, self.model.config.rope)
        if plan.renumbered:
            state.reindex(plan.kept_positions, plan.slots, plan.live)
        else:
            state.set_tables(plan.slots, plan.live)
        if plan.layer_keep is not None:  # per-layer keep sets (their union is the plan's kept set)
            state.set_layer_live(plan.layer_keep)
        self._push_row(row)
        self.allocator.release(plan.released)
        return evicted

    def restore_rows(self, row: int, positions_M, k_LMKD, v_LMKD) -> np.ndarray:
        """RepairKV apply step: bring evicted rows back into ``row`` at their
        original positions. Fresh slots are allocated, the K/V rows written there
        unchanged (post-RoPE at the same positions: no rotation), the positions'
        slot-map entries (holes) pointed at them and the live-index list grown in
        position order. Returns the fresh slots. ``RepairError`` (nothing changed)
        when a position is not a hole of the row."""
        pos = np.asarray(positions_M, np.int64)
        if pos.size == 0:
            return np.zeros(0, np.int64)
        state = self._row(row)
        promotion_tables(state.slots, pos, np.ones(pos.size, np.int64))  # validate first
        fresh = self.pool.restore(self, row, k_LMKD, v_LMKD)  # bit-identical rows in fresh slots
        slots, live = promotion_tables(state.slots, pos, fresh)
        self.set_row_tables(row, slots, live)
        return fresh

    def set_row_tables(self, row: int, slots: Sequence[int], live: Sequence[int]) -> None:
        """Replace a row's host + device tables for the same positions."""
        self._row(row).set_tables(slots, live)
        self._push_row(row)

    # -- prefill -------------------------------------------------------------------
    def start_prefill(self, row: int, tokens: Sequence[int], *, all_logits: bool = False, q_idx=None, attn_mass: bool = False, kv_bits=None, kv_source: KVSource | None = None) -> PrefillJob:
        """A prefill job for ``row``; its slots are allocated now (``OutOfSlotsError``
        or ``ContextLengthError`` before any change). ``q_idx``: indices into
        ``tokens`` whose post-RoPE queries to capture. ``kv_bits`` (quantized pool):
        2 or 4 per token (None: INT4; ``kivi2``/``kivi4`` ignore it: KIVI's own rule).
        ``kv_source``: import these K/V instead of running the model (``KVSource``;
        no features, no logits but its last ones, no mesh: ``JaxKVError``)."""
        state = self._row(row)
        tokens = np.asarray(tokens, np.int32).reshape(-1)
        if state.seq_len + tokens.size > self.max_positions:
            raise ContextLengthError(
                f"row {row}: {state.seq_len} cached + {tokens.size} new tokens exceed {self.max_positions} positions"
            )
        if kv_source is not None:
            self._check_import(kv_source, tokens.size, all_logits=all_logits, q_idx=q_idx, attn_mass=attn_mass)
        plan, slots = self.pool.plan_prefill(self, row, kv_bits, tokens.size)
        q_idx_X = None if q_idx is None else np.asarray(q_idx, np.int64).reshape(-1)
        job = PrefillJob(row, tokens, slots, all_logits, q_idx_X, attn_mass, kv_plan=plan, kv_source=kv_source)
        cfg = self.model.config
        if attn_mass:
            job.mass = np.zeros(state.seq_len + tokens.size, np.float32)
        if q_idx_X is not None:
            job.q_rows = np.zeros((cfg.num_layers, q_idx_X.size, cfg.num_heads, cfg.head_dim), np.float32)
        return job

    def _check_import(self, src: KVSource, n: int, *, all_logits, q_idx, attn_mass) -> None:
        cfg = self.model.config
        want = (cfg.num_layers, n, cfg.num_kv_heads, cfg.head_dim)
        if tuple(np.shape(src.k)) != want or tuple(np.shape(src.v)) != want:
            raise JaxKVError(f"an imported prefill of {n} tokens needs K and V of shape {want}, got {np.shape(src.k)} and {np.shape(src.v)}")
        if all_logits or q_idx is not None or attn_mass:
            raise JaxKVError("an imported prefill runs no forward: it has no logits but its last ones, no query rows, no attention mass")
        if self.mesh is not None:
            raise JaxKVError("an imported prefill runs on one device (no mesh)")

    def abandon_prefill(self, job: PrefillJob) -> np.ndarray:
        """Release the slots of a prefill job's unwritten tokens (the request was
        cancelled or failed half-way); returns the slots freed."""
        rest = job.slots[job.done :]
        job.done = job.tokens.size
        job.slots = job.slots[: job.done]
        return self.allocator.release(rest)

    # -- steps -------------------------------------------------------------------
    def step_prefill(self, jobs: Sequence[PrefillJob]) -> None:
        """Advance unfinished prefill jobs by one step (``step``, no decode rows)."""
        self.step(prefill_jobs=jobs)

    def step(self, prefill_jobs: Sequence[PrefillJob] = (), decode_jobs: Sequence[DecodeJob] = ()) -> None:
        """One engine step over a flat batch of at most ``token_budget`` tokens:
        the next token of every unfinished decode job first (so a decoding row
        never waits behind a prompt), then a piece of each unfinished prefill job,
        in order, while the budget lasts (chunked prefill, as vLLM V1 schedules).
        A piece is at most ``prefill_chunk`` tokens; a pool that writes whole
        chunks (``pool.whole_chunks``: a quantized pool's INT2 pages are planned
        per chunk) takes a job's next chunk whole or waits for the next step.

        Jobs that import their K/V (``KVSource``) run no forward: they are stored
        here, one job per call. Decode jobs' slots are allocated first
        (``OutOfSlotsError`` before any change)."""
        self._check_open()
        prefill_jobs = [j for j in prefill_jobs if not j.finished]
        decode_jobs = [j for j in decode_jobs if not j.finished]
        imports = [j for j in prefill_jobs if j.kv_source is not None]
        if imports:
            return self._import_chunk(imports[0])
        if len(decode_jobs) > self.rows:
            raise JaxKVError(f"{len(decode_jobs)} decode jobs in one step; the engine has {self.rows} rows")
        budget = self.token_budget - len(decode_jobs)
        pieces: list[tuple[PrefillJob, int]] = []
        for j in prefill_jobs:
            if len(pieces) + len(decode_jobs) == self.rows or budget <= 0:
                break
            n = self._piece(j, budget)
            if n:
                pieces.append((j, n))
                budget -= n
        if not pieces and not decode_jobs:
            if prefill_jobs:
                raise JaxKVError(f"no prefill piece fits a step of {self.token_budget} tokens")
            return
        self._run_step(pieces, decode_jobs)

    def _piece(self, job: PrefillJob, budget: int) -> int:
        """Tokens of ``job``'s next piece within ``budget`` (0: none this step)."""
        left = job.tokens.size - job.done
        n = min(left, self.prefill_chunk, budget)
        if self.pool.whole_chunks and n < min(left, self.prefill_chunk - job.done % self.prefill_chunk):
            return 0
        return n

    def _run_step(self, pieces, decode_jobs) -> None:
        """Build one ``StepBatch`` (decode tokens first, then the pieces), run it and
        bring the host records up to date."""
        R = self.rows
        cfg = self.model.config
        fresh = self.allocate(len(decode_jobs)) if decode_jobs else np.zeros(0, np.int64)  # raises before any change
        entries = []  # (job, tokens, slots, is_decode)
        for j, s in zip(decode_jobs, fresh):
            entries.append((j, np.asarray([j.next_feed], np.int32), np.asarray([s], np.int64), True))
        for j, n in pieces:
            entries.append((j, j.tokens[j.done : j.done + n], j.slots[j.done : j.done + n], False))
        total = sum(e[1].size for e in entries)
        T = buckets.step_tokens(total, self.token_budget)
        tokens, positions, slots = np.zeros(T, np.int32), np.zeros(T, np.int32), np.zeros(T, np.int32)
        rows, q_start, q_len = np.full(R, R, np.int32), np.zeros(R, np.int32), np.zeros(R, np.int32)
        key_data = np.zeros((R, *jax.random.key_data(jax.random.key(0)).shape), np.uint32)
        step_idx = np.zeros(R, np.int32)
        settings = [(0.0, None, None)] * R
        at = 0
        for r, (j, toks, sl, is_decode) in enumerate(entries):
            st = self._row(j.row)
            n = toks.size
            tokens[at : at + n], slots[at : at + n] = toks, sl
            positions[at : at + n] = st.seq_len + np.arange(n)
            rows[r], q_start[r], q_len[r] = j.row, at, n
            if is_decode:
                key_data[r] = np.asarray(jax.random.key_data(j.key))
                step_idx[r] = j.step0 + j.fed
                settings[r] = (j.temperature, j.top_k, j.top_p)
            at += n
        mass = any((not d and j.attn_mass) or (d and j.features.attn_mass) for j, _, _, d in entries)
        # a mass step captures query rows too: one variant, whatever mix of jobs shares it
        capture_q = mass or any((not d and j.q_idx_X is not None) or (d and j.features.query_rows) for j, _, _, d in entries)
        all_logits = any(not d and j.all_logits for j, _, _, d in entries)
        batch = StepBatch(tokens, positions, slots, rows, q_start, q_len, key_data, step_idx, RowSamplers.of(settings))
        plan = self.pool.step_plan([(j, n) for j, n in pieces], [int(q_start[len(decode_jobs) + i]) for i in range(len(pieces))], T)
        sampled, logits, self.cache, aux = run_step(
            self.graphdef, self.params, self.cache, batch, plan, layers=self.pool.layers, backend=self.attention_backend,
            mesh=self.mesh, capture_q=capture_q, all_logits=all_logits, attn_mass=mass,
        )
        sampled = np.asarray(sampled)
        logits = np.asarray(logits)  # [R, V]: each row's last token
        every = np.asarray(aux["all_logits"]) if all_logits else None  # [T, V]
        q_rows = np.asarray(aux["q_rows"]) if capture_q else None  # [L, T, Hq, D]
        mass_JRN = np.asarray(aux["mass"]) if mass else None  # [J, R, N] per live list, its layers' share of the mean over layers and heads
        for r, (j, toks, sl, is_decode) in enumerate(entries):
            st = self._row(j.row)
            n, start = toks.size, int(q_start[r])
            if mass_JRN is not None and (is_decode and j.features.attn_mass or not is_decode and j.attn_mass):
                mass_P = _list_mass(mass_JRN[:, r], st.layer_positions(self.lists), st.seq_len, n)  # old positions, then the n new
            if is_decode:
                tok = int(sampled[r])
                st.append([j.next_feed], sl)
                st.allocated += 1
                j.tokens.append(tok)
                j.fed += 1
                j.stopped = tok in j.stop_ids
                if j.return_logits:
                    j.logits.append(logits[r][None])
                if j.features.query_rows:
                    j.q_rows.append(q_rows[:, start][None])
                if j.features.attn_mass:
                    m = mass_P  # (st.append above: seq_len counts the new token)
                    if j.mass is not None:
                        m[: j.mass.size] += j.mass
                    j.mass = m
                continue
            if j.attn_mass:
                j.mass[: mass_P.size] += mass_P
            if j.q_idx_X is not None:
                here = np.flatnonzero((j.q_idx_X >= j.done) & (j.q_idx_X < j.done + n))
                j.q_rows[:, here] = q_rows[:, start + j.q_idx_X[here] - j.done]
            j.logits.append(every[start : start + n] if j.all_logits else logits[r][None])
            st.append(toks, sl)
            j.done += n
        self.pool.settle(self, [e[0].row for e in entries])  # kivi2: aged residual -> INT2 pages

    def _import_chunk(self, job: PrefillJob) -> None:
        """Store the next chunk of an imported prefill (``KVSource``) as a step
        would store it, without a forward."""
        st = self._row(job.row)
        n = min(job.tokens.size - job.done, self.prefill_chunk)
        T = buckets.step_tokens(n, self.token_budget)
        cfg = self.model.config
        k = np.zeros((cfg.num_layers, T, cfg.num_kv_heads, cfg.head_dim), np.float32)
        v = np.zeros_like(k)
        k[:, :n] = job.kv_source.k[:, job.done : job.done + n]
        v[:, :n] = job.kv_source.v[:, job.done : job.done + n]
        slots = np.zeros(T, np.int32)
        slots[:n] = job.slots[job.done : job.done + n]
        plan = self.pool.step_plan([(job, n)], [0], T)
        self.cache = import_rows(self.cache, slots, k, v, plan, layers=self.pool.layers)
        job.logits.append(np.asarray(job.kv_source.last_logits, np.float32)[None])  # the source's; only the last chunk's is read
        st.append(job.tokens[job.done : job.done + n], job.slots[job.done : job.done + n])
        self._push_row(job.row)
        job.done += n
        self.pool.settle(self, [job.row])

    def prefill(self, rows: Sequence[int], token_lists: Sequence[Sequence[int]], *, all_logits=False, features: Features = NO_FEATURES, q_row_positions=None, kv_bits=None):
        """Append ``token_lists[i]`` to ``rows[i]``; returns logits of the new tokens.

        Returns a list (one per row) of float32 numpy arrays: ``[n_i, V]`` when
        ``all_logits`` else ``[V]`` for the last token. With ``features``, returns
        ``(logits, aux)``: with ``features.attn_mass``, ``aux["attn_mass"][i]`` is
        ``[seq_len]`` float32, the attention mass each position of row i received
        from this prefill's queries (mean over layers and query heads, summed over
        queries; 0 at holes); with ``features.query_rows``, ``aux["q_rows"]`` is
        ``[L, len(rows), X, Hq, D]``: the post-RoPE queries at
        ``q_row_positions[i]`` (X indices into ``token_lists[i]``). ``kv_bits[i]``:
        per-token bits of row i on a quantized pool (``start_prefill``).
        """
        for r, tokens in zip(rows, token_lists):
            st = self._row(r)
            if st.seq_len + len(tokens) > self.max_positions:
                raise ContextLengthError(
                    f"row {r}: {st.seq_len} cached + {len(tokens)} new tokens exceed {self.max_positions} positions"
                )
        need = sum(len(t) for t in token_lists)
        if need > self.allocator.num_free and self.reclaim is not None:
            self.reclaim(need - self.allocator.num_free)
        if need > self.allocator.num_free:
            raise OutOfSlotsError(f"prefill needs {need} slots, {self.allocator.num_free} free")
        jobs = [
            self.start_prefill(
                r, t, all_logits=all_logits, attn_mass=features.attn_mass,
                q_idx=q_row_positions[i] if features.query_rows and q_row_positions is not None else None,
                kv_bits=None if kv_bits is None else kv_bits[i],
            )
            for i, (r, t) in enumerate(zip(rows, token_lists))
        ]
        while not all(j.finished for j in jobs):
            self.step(prefill_jobs=jobs)
        result = [j.result_logits() for j in jobs]
        if features == NO_FEATURES:
            return result
        aux_out = {}
        if features.attn_mass:
            aux_out["attn_mass"] = [j.mass for j in jobs]
        if features.query_rows:
            aux_out["q_rows"] = np.stack([j.q_rows for j in jobs], axis=1)
        return result, aux_out

    # -- decode --------------------------------------------------------------------
    def start_decode(self, row: int, first_token: int, n_steps: int, *, temperature=0.0, top_k=None, top_p=None, key=None, step0: int = 0, stop_token_ids=(), return_logits=False, forced_tokens=None, features: Features = NO_FEATURES) -> DecodeJob:
        """A decode job for ``row`` (``ContextLengthError`` up front; slots are
        allocated per step)."""
        make_sampler(temperature, top_k, top_p)  # validates
        st = self._row(row)
        if st.seq_len + n_steps > self.max_positions:
            raise ContextLengthError(
                f"row {row}: {st.seq_len} cached + {n_steps} decode steps exceed {self.max_positions} positions"
            )
        return DecodeJob(
            row, int(first_token), int(n_steps), float(temperature), top_k, top_p,
            key if key is not None else jax.random.key(0), tuple(sorted(set(int(t) for t in stop_token_ids))),
            step0, None if forced_tokens is None else list(forced_tokens), return_logits, features,
        )

    def step_decode(self, jobs: Sequence[DecodeJob], max_steps: int | None = None, *, regroup: bool = False) -> None:
        """Advance every unfinished job by up to ``max_steps`` steps (default: all
        it has left) in one ``run_decode`` call (the decode fast path: no prefill
        beside it). Jobs of any samplers share the call. ``regroup``: end the call
        once half its rows have stopped (the caller then calls again for the
        unfinished jobs, as the scheduler does). Slots for the steps are allocated
        first (``OutOfSlotsError`` before any change) and the unused ones released
        after. Jobs capturing attention mass run as single steps (``step``)."""
        self._check_open()
        jobs = [j for j in jobs if not j.finished]
        if not jobs:
            return
        if any(j.features.attn_mass for j in jobs):  # mass needs the second pass of ``run_step``
            for _ in range(max_steps or max(j.n_steps - j.fed for j in jobs)):
                self.step(decode_jobs=[j for j in jobs if not j.finished])
                if all(j.finished for j in jobs):
                    break
            return
        steps = [j.n_steps - j.fed if max_steps is None else min(j.n_steps - j.fed, max_steps) for j in jobs]
        n = max(steps) if max_steps is None else int(max_steps)  # a fixed chunk: one compile, rows stop at their limit
        total = sum(steps)
        if total > self.allocator.num_free and self.reclaim is not None:
            self.reclaim(total - self.allocator.num_free)
        fresh = self.allocator.allocate(total)  # raises before any change
        per_job = np.split(fresh, np.cumsum(steps)[:-1])
        states = [self._row(j.row) for j in jobs]
        B = buckets.decode_rows(len(jobs))
        R = self.rows
        rows = np.full(B, R, np.int32)
        first = np.zeros(B, np.int32)
        limit = np.zeros(B, np.int32)
        slots = np.zeros((B, n), np.int32)
        stop_width = max(1, max(len(j.stop_ids) for j in jobs))
        stop = np.full((B, stop_width), -1, np.int32)
        key_data = np.zeros((B, *jax.random.key_data(jobs[0].key).shape), np.uint32)
        step0 = np.zeros(B, np.int32)
        forced = np.zeros((B, n), np.int32)
        settings = [(0.0, None, None)] * B
        for b, (j, k, s) in enumerate(zip(jobs, steps, per_job)):
            rows[b], first[b], limit[b] = j.row, j.next_feed, k
            slots[b, :k] = s
            stop[b, : len(j.stop_ids)] = j.stop_ids
            key_data[b] = np.asarray(jax.random.key_data(j.key))
            step0[b] = j.step0 + j.fed
            settings[b] = (j.temperature, j.top_k, j.top_p)
            if j.forced is not None:
                f = j.forced[j.fed : j.fed + n]
                forced[b, : len(f)] = f
        return_logits = any(j.return_logits for j in jobs)
        batch = DecodeBatch(rows, first, limit, slots, stop, key_data, step0, RowSamplers.of(settings), forced)
        plan = self.pool.decode_plan(states, [s[:k] for s, k in zip(per_job, steps)], B, n)
        width = buckets.window_width(self.pool.window_entries(states, plan), self.max_positions)
        window, window_len, len_JB = self._decode_window(rows, states, plan, width, n) if self.uses_window(B, width) else (None, None, None)
        layer_params = self._layer_params() if window is not None else None
        tokens, fed, cache, logits, q_rows, window = run_decode(
            self.graphdef, self.params, self.cache, batch, plan, window, layer_params, window_len,
            layers=self.pool.layers, n_steps=n, backend=self.attention_backend, return_logits=return_logits,
            teacher_forced=any(j.forced is not None for j in jobs), mesh=self.mesh, regroup=regroup,
        )
        tokens, fed = np.asarray(tokens), np.asarray(fed)
        self._cache = cache  # the call's window is in step with it: kept below, not dropped
        self._kept_window = KeptWindow(tuple(int(r) for r in rows), n, width, window, len_JB, fed) if window_len is not None else None
        q_rows = np.asarray(q_rows) if any(j.features.query_rows for j in jobs) else None
        unused = []
        for b, (j, st, s) in enumerate(zip(jobs, states, per_job)):
            k = int(fed[b])
            new = tokens[b, :k].tolist()
            rest = j.forced[j.fed : j.fed + k - 1] if j.forced is not None else new[: k - 1]
            written = ([j.next_feed] + list(rest))[:k]
            st.append(written, s[:k])
            st.allocated += k
            unused.append(s[k:])
            j.tokens += new
            j.fed += k
            j.stopped = bool(k and new[-1] in j.stop_ids)
            if j.return_logits:
                j.logits.append(np.asarray(logits[b, :k]))
            if j.features.query_rows:
                j.q_rows.append(q_rows[:k, :, b])
        self.allocator.release(np.concatenate(unused))
        self.pool.settle(self, [j.row for j in jobs])  # kivi2: aged residual -> INT2 pages

    def _decode_window(self, rows, states, plan, width: int, n: int):
        """The window of a decode call over ``rows`` (``B``, padding included;
        ``states`` the real rows' host records): ``(window, len_LR, len_JB)``.

        The last call's window (``KeptWindow``) when it was over the same rows with
        the same shape and every list is still at most what it held after that
        call (nothing but truncations since: any other write of the cache drops
        it); else a fresh copy (the pool's ``gather_window``). ``len_LR`` ``[L,
        B]`` are the entries each layer's list of each row has now (``-1``: a
        padding row), which ``DecodeWindow.roll`` brings the window to inside the
        call; None for a pool whose window is not kept (``keeps_window``).
        ``len_JB``: the same per live list."""
        J, L = self.lists, self.model.config.num_layers
        len_JB = np.full((J, len(rows)), -1, np.int32)
        for b, st in enumerate(states):
            len_JB[:, b] = [len(x) for x in st.layer_lists(J)]
        len_LR = len_JB[np.minimum(np.arange(L), J - 1)]
        kept = self._kept_window
        if (kept is not None and kept.rows == tuple(int(r) for r in rows) and kept.n_steps == n and kept.width == width
                and np.all(len_JB <= kept.len_JB + kept.fed_B[None, :])):
            return kept.window, len_LR, len_JB
        window = self.pool.gather_window(self.cache, jnp.asarray(rows), plan, width=width, n_steps=n)
        return (window, len_LR, len_JB) if self.pool.keeps_window else (window, None, None)

    def _layer_params(self) -> tuple:
        """The layers' weights one array set per layer (``jaxkv.step.layer_copies``),
        taken on the first windowed decode call and kept: the CPU decode loop's
        weights. A second copy of the layer weights in host memory, for about a
        tenth more batch-1 decode speed (``eval/bench/engine.py``)."""
        if self._layer_params_kept is None:
            self._layer_params_kept = layer_copies(self.graphdef, self.params)
        return self._layer_params_kept

    def uses_window(self, B: int, width: int) -> bool:
        """Whether a decode call of ``B`` rows reads a per-call copy of the rows'
        entries (the pool's ``gather_window``: ``jaxkv.cache.window.gather_window`` for the
        float pool, ``jaxkv.cache.quantized.gather_quant_window`` for INT4 and
        INT2 entries) instead of gathering key blocks from the pool every step. On
        the CPU (the blocked attention) the copy's contiguous blocks read several
        times faster than gathered ones (``eval/bench/decode.py`` and
        ``eval/bench/quant_decode.py`` print both). It is taken while the copy has
        no more entries than the pool has slots (``B * width <= S``), never by a
        kernel backend, a pool whose ``uses_window`` is false (KIVI's float
        residual) or a mesh."""
        return (
            self.decode_window and self.pool.uses_window and self.mesh is None
            and self.attention_backend == "blocked" and B * width <= self.allocator.num_slots
        )

    def decode(self, rows: Sequence[int], first_tokens: Sequence[int], n_steps: int, *, temperature=0.0, top_k=None, top_p=None, key=None, stop_token_ids=(), return_logits=False, forced_tokens=None, features: Features = NO_FEATURES):
        """Feed ``first_tokens`` and decode up to ``n_steps`` tokens per row.

        Returns ``(tokens, logits)``: ``tokens[i]`` the sampled tokens of row i
        (ending with its stop token when one was hit); ``logits[i]`` ``[n, V]``
        when ``return_logits``. ``forced_tokens[i]`` (teacher forcing) replaces
        the fed token of every step after the first. Row ``i`` samples with
        ``fold_in(key, i)``. With ``features``, returns ``(tokens, logits, aux)``:
        ``aux["q_rows"][i]`` ``[n_i, L, Hq, D]`` the query of each fed token;
        ``aux["attn_mass"][i]`` ``[seq_len]`` the mass each position of row i
        received during this call (mean over layers and heads, summed over steps).
        """
        make_sampler(temperature, top_k, top_p)
        if n_steps <= 0:
            return [[] for _ in rows], None
        key = key if key is not None else jax.random.key(0)
        jobs = [
            self.start_decode(
                r, first_tokens[i], n_steps, temperature=temperature, top_k=top_k, top_p=top_p,
                key=jax.random.fold_in(key, i), stop_token_ids=stop_token_ids, return_logits=return_logits,
                forced_tokens=None if forced_tokens is None else list(forced_tokens[i]), features=features,
            )
            for i, r in enumerate(rows)
        ]
        self.step_decode(jobs)
        out_tokens = [j.tokens for j in jobs]
        out_logits = [np.concatenate(j.logits) if j.logits else np.zeros((0, self.model.config.vocab_size), np.float32) for j in jobs] if return_logits else None
        if features == NO_FEATURES:
            return out_tokens, out_logits
        aux_out = {}
        if features.query_rows:
            aux_out["q_rows"] = [np.concatenate(j.q_rows) for j in jobs]
        if features.attn_mass:
            aux_out["attn_mass"] = [j.mass for j in jobs]
        return out_tokens, out_logits, aux_out

    # -- warm-up -------------------------------------------------------------------
    def shape_set(self, decode_chunk: int) -> buckets.ShapeSet:
        """The bounded set of step shapes this engine compiles (``jaxkv.buckets``)."""
        windows = self.decode_window and self.pool.uses_window and self.mesh is None and self.attention_backend == "blocked"
        return buckets.shape_set(self.rows, self.max_positions, self.token_budget, decode_chunk, windows=windows)

    def warmup(self, decode_chunk: int, *, stop_token_ids=(), progress=None, capture_q: bool = False, attn_mass: bool = False) -> int:
        """Compile every program of ``shape_set``: each step token bucket (with
        ``capture_q``, also its query-capturing variant; with ``attn_mass``, its
        attention-mass variant, which captures query rows too) and each decode
        program (rows x window width), by
        running each once on scratch rows through the methods requests use (so a
        quantized pool warms its own steps). Samplers are data, so one decode
        program serves them all. ``stop_token_ids`` must be the server's (their
        count is a shape). ``progress(n)`` is called after each program. The engine
        must be idle; scratch rows are closed afterwards. Returns how many programs
        it ran."""
        if any(state is not None for state in self.row_state):
            raise JaxKVError("warm-up needs an idle engine (a row is open)")
        shapes = self.shape_set(decode_chunk)
        ran = 0

        def tick():
            nonlocal ran
            compiles.release_if_crowded()
            ran += 1
            if progress is not None:
                progress(1)

        row = self.open_row()
        try:
            variants = [(False, False)] + [(q, m) for q, m, on in ((True, False, capture_q), (True, True, attn_mass)) if on]
            for T in shapes.steps:
                for q, m in variants:
                    n = min(T, self.prefill_chunk) if T > buckets.MIN_STEP_TOKENS else 1
                    self.step(prefill_jobs=[self.start_prefill(row, np.zeros(n, np.int32), q_idx=[0] if q else None, attn_mass=m)])
                    self.truncate_row(row, 0)
                    tick()
        finally:
            self.close_row(row)
        for B, W in shapes.decode:
            rows = [self.open_row() for _ in range(B)]
            try:
                live = min(W, self.max_positions - decode_chunk) if W else 1  # a list length whose window is W
                for r in rows:  # a live length that asks for this window width
                    self.prefill([r], [np.zeros(live, np.int32)])
                self.step_decode([self.start_decode(r, 0, decode_chunk, stop_token_ids=stop_token_ids) for r in rows], decode_chunk, regroup=True)
                tick()
            finally:
                for r in rows:
                    self.close_row(r)
        return ran

    def splice_prefill(self, row: int, plan, *, mode: str = "append"):
        """Run one ``jaxkv.splice.SplicePlan`` on ``row``; returns ``(logits [Y, V],
        resid [A, M])`` (float32 numpy: next-token logits at ``plan.logit_idx`` and
        group A's residual at the input of layer ``plan.cut``).

        ``mode``: ``"append"`` allocates slots for the plan's tokens at the row's
        next positions and records them in the row; ``"rewrite"`` recomputes tokens
        the row holds at ``[plan.base, plan.base + T)`` in their own slots;
        ``"probe"`` runs on scratch slots (released after) reading only the row's
        keys before ``plan.base``, and leaves the row as it was. Host checks
        (context length, slots, holes) run before any device call.
        """
        from jaxkv.splice import PAD_POS, splice_step

        state = self._row(row)
        cfg = self.model.config
        tokens = np.asarray(plan.tokens, np.int32).reshape(-1)
        T = tokens.size
        live = np.asarray(state.live, np.int64)
        live_pos = state.live_positions()
        if mode == "append":
            base = state.seq_len
            if base + T > self.max_positions:
                raise ContextLengthError(f"row {row}: {base} cached + {T} new tokens exceed {self.max_positions} positions")
            slots = self.allocate(T, row)
            keys, key_pos = np.concatenate([live, slots]), np.concatenate([live_pos, base + np.arange(T)])
        elif mode == "rewrite":
            base = int(plan.base)
            if base < 0 or base + T > state.seq_len:
                raise JaxKVError(f"rewrite of positions [{base}, {base + T}) outside row {row} of {state.seq_len}")
            slots = np.asarray(state.slots[base : base + T], np.int64)
            if (slots == SENTINEL_SLOT).any():
                raise JaxKVError(f"rewrite of positions [{base}, {base + T}) of row {row} crosses a hole")
            keys, key_pos = live, live_pos
        elif mode == "probe":
            base = int(plan.base)
            slots = self.allocate(T)  # scratch (not counted against the row): released below
            before = live_pos < base
            keys, key_pos = np.concatenate([live[before], slots]), np.concatenate([live_pos[before], base + np.arange(T)])
        else:
            raise JaxKVError(f"unknown splice mode {mode!r}; expected append, rewrite or probe")
        try:
            positions = base + np.arange(T)
            a_idx, b_idx = np.asarray(plan.a_idx, np.int64), np.asarray(plan.b_idx, np.int64)
            A, B = bucket(a_idx.size), bucket(b_idx.size)
            a_tok, a_pos, a_slot = np.zeros(A, np.int32), np.full(A, -1, np.int32), np.zeros(A, np.int32)
            a_tok[: a_idx.size], a_pos[: a_idx.size], a_slot[: a_idx.size] = tokens[a_idx], positions[a_idx], slots[a_idx]
            in_a = np.full(T, -1, np.int64)
            in_a[a_idx] = np.arange(a_idx.size)
            b_src, b_pos = np.full(B, -1, np.int32), np.full(B, -1, np.int32)
            b_slot, b_cut_slot = np.zeros(B, np.int32), np.zeros(B, np.int32)
            b_resid = np.zeros((B, cfg.hidden_size), np.float32)
            b_src[: b_idx.size], b_pos[: b_idx.size], b_slot[: b_idx.size] = in_a[b_idx], positions[b_idx], slots[b_idx]
            cut_write = np.ones(b_idx.size, bool) if plan.b_cut_write is None else np.asarray(plan.b_cut_write, bool)
            b_cut_slot[: b_idx.size] = np.where(cut_write, slots[b_idx], SENTINEL_SLOT)
            if plan.b_resid is not None:
                b_resid[: b_idx.size] = plan.b_resid
            kv_idx = np.asarray(plan.kv_idx, np.int64)
            M = bucket(kv_idx.size)
            nl = max(plan.kv_hi - plan.kv_lo, 0)
            kv_k = np.zeros((nl, M, cfg.num_kv_heads, cfg.head_dim), np.float32)
            kv_v = np.zeros_like(kv_k)
            kv_slot, kv_delta = np.zeros(M, np.int32), np.zeros(M, np.int32)
            if kv_idx.size and nl:
                kv_k[:, : kv_idx.size], kv_v[:, : kv_idx.size] = plan.kv_k, plan.kv_v
                kv_slot[: kv_idx.size] = slots[kv_idx]
                kv_delta[: kv_idx.size] = positions[kv_idx] - np.asarray(plan.kv_old_pos, np.int64)
            order = np.argsort(key_pos, kind="stable")
            N = bucket(max(keys.size, 1))
            read = np.ones((1, keys.size), bool)  # which layers read each key (one set for the model: all)
            if state.layer_live is not None:  # per-layer keep sets: a layer sees only its own (new tokens: all)
                old = key_pos < state.seq_len
                read = np.ones((self.lists, keys.size), bool)
                read[:, old] = state.layer_live[:, key_pos[old]]
            live_N, live_pos_JN = np.zeros(N, np.int32), np.full((read.shape[0], N), PAD_POS, np.int32)
            live_N[: keys.size] = keys[order]
            live_pos_JN[:, : keys.size] = np.where(read[:, order], key_pos[order][None], PAD_POS)
            logit_idx = np.asarray(plan.logit_idx, np.int64)
            Y = bucket(max(logit_idx.size, 1), minimum=8)
            src = in_a if plan.cut >= cfg.num_layers else np.searchsorted(b_idx, np.arange(T))
            logit_src = np.zeros(Y, np.int32)
            logit_src[: logit_idx.size] = src[logit_idx]
            logits, self.cache, resid = splice_step(
                self.graphdef, self.params, self.cache, a_tok, a_pos, a_slot, b_src, b_resid, b_pos, b_slot, b_cut_slot,
                kv_k, kv_v, kv_slot, kv_delta, live_N, live_pos_JN, logit_src,
                cut=int(plan.cut), kv_lo=int(plan.kv_lo), kv_hi=int(plan.kv_hi) if nl else int(plan.kv_lo), io=self.pool.layers,
            )
            logits, resid = np.asarray(logits)[: logit_idx.size], np.asarray(resid)[: a_idx.size]
        finally:
            if mode == "probe":
                self.allocator.release(slots)
        if mode == "append":
            state.append(tokens, slots)
            self._push_row(row)
            self.pool.settle(self, [row])  # kivi2: aged residual -> INT2 pages
        return logits, resid

    def key_deviation(self, x_XM, positions_X, k_old_XKD, old_positions_X, layer: int) -> np.ndarray:
        """CacheBlend's signal: per token, the distance between the post-RoPE key of
        ``layer`` recomputed from the residual ``x_XM`` at its input and the stored
        key rotated from ``old_positions_X`` to ``positions_X`` (``[X]`` float32)."""
        from jaxkv.splice import layer_key_deviation

        X = len(positions_X)
        P = bucket(X)
        cfg = self.model.config
        x = np.zeros((P, cfg.hidden_size), np.float32)
        pos, delta = np.zeros(P, np.int32), np.zeros(P, np.int32)
        k = np.zeros((P, cfg.num_kv_heads, cfg.head_dim), np.float32)
        x[:X], pos[:X], k[:X] = x_XM, positions_X, k_old_XKD
        delta[:X] = np.asarray(positions_X, np.int64) - np.asarray(old_positions_X, np.int64)
        out = layer_key_deviation(self.graphdef, self.params, x, pos, k, delta, layer=int(layer))
        return np.asarray(out)[:X]


# ============================================================================ public
def score_logits(model: Model, token_ids) -> jax.Array:
    """Full-sequence float32 logits ``[B,T,V]`` with no cache: the parity oracle."""
    tokens = jnp.asarray(token_ids, dtype=jnp.int32)
    if tokens.ndim != 2:
        raise ValueError(f"token_ids must be [batch, time], got shape {tokens.shape}")
    _check_ids(model, np.asarray(tokens).reshape(-1))
    graphdef, params = model.split()
    return _dense_logits(graphdef, params, tokens)


def _check_ids(model: Model, ids: np.ndarray) -> None:
    bad = (ids < 0) | (ids >= model.config.vocab_size)
    if bad.any():
        raise ValueError(f"token ids out of range [0, {model.config.vocab_size}): {ids[bad][:5].tolist()}")


def generate(model: Model, prompts, max_new_tokens: int, temperature: float = 0.0, top_k=None, top_p=None, seed: int = 0, stop_token_ids=None, *, backend=None) -> list[list[int]]:
    """Generate up to ``max_new_tokens`` tokens for each prompt (a list of id lists).

    Greedy when ``temperature == 0``. Sampling draws from ``jax.random.key(seed)``.
    A row ends after its first stop token (included in its output).
    """
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    prompts = [list(map(int, p)) for p in prompts]
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    for p in prompts:
        _check_ids(model, np.asarray(p))
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    spec, temp, top_p_val = make_sampler(temperature, top_k, top_p)  # validate before any work
    longest = max(len(p) for p in prompts) + max_new_tokens
    if longest > model.config.max_position_embeddings:
        raise ContextLengthError(
            f"prompt + max_new_tokens = {longest} tokens exceed the model context "
            f"{model.config.max_position_embeddings}"
        )
    if max_new_tokens == 0:
        return [[] for _ in prompts]
    P = min(bucket(longest), model.config.max_position_embeddings)
    engine = Engine(model, rows=len(prompts), max_positions=P, backend=backend)
    rows = [engine.open_row() for _ in prompts]
    last_logits = engine.prefill(rows, prompts)
    key = jax.random.key(seed)
    first = np.asarray(sample(jnp.asarray(np.stack(last_logits)), jax.random.fold_in(key, FIRST_TOKEN_KEY), spec, temp, top_p_val))
    stop = set(stop_token_ids or ())
    outputs = [[int(t)] for t in first]
    live_rows = [i for i, t in enumerate(first) if int(t) not in stop]
    if max_new_tokens > 1 and live_rows:
        tokens, _ = engine.decode(
            [rows[i] for i in live_rows], [int(first[i]) for i in live_rows], max_new_tokens - 1,
            temperature=temperature, top_k=top_k, top_p=top_p, key=key, stop_token_ids=stop,
        )
        for i, toks in zip(live_rows, tokens):
            outputs[i] += toks
    return outputs
