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
from flax import nnx, struct
from jax.sharding import NamedSharding, PartitionSpec

from jaxkv import pallas
from jaxkv import buckets, compiles
from jaxkv.buckets import DECODE_ROW_STEP, SHORT_CHUNK, WINDOW_STEP, bucket  # noqa: F401 (re-exported)
from jaxkv.cache.allocator import SENTINEL_SLOT
from jaxkv.cache.pools import FloatDecodeStep, FloatPrefill, make_pool
from jaxkv.cache.request import RequestState, promotion_tables
from jaxkv.cache.state import PagedKVCache, append_tokens, float_pool_dtype, put_rows, take_rows
from jaxkv.errors import ContextLengthError, JaxKVError, OutOfSlotsError
from jaxkv.models import sharding
from jaxkv.models.loading import Model
from jaxkv.models.transformer import NO_FEATURES, DecodeWindow, Features
from jaxkv.sampling import SamplerSpec, make_sampler, sample, sample_rows

PREFILL_CHUNK = 512  # tokens per prefill step; chosen by eval/bench_prefill.py (README)
FIRST_TOKEN_KEY = 1 << 30  # the first reply token is drawn with fold_in(key, this)


# ============================================================================ batches
@struct.dataclass
class PrefillBatch:
    """One prefill step's input for B rows (padding rows: index >= R, length 0).

    Attributes:
      rows_B: cache rows served. tokens_BT: the chunk (T tokens, padded).
      chunk_len_B: real tokens per row. slots_BT: pool slots of the chunk's tokens
        (the sentinel for padding). q_idx_BX: chunk indices whose post-RoPE queries
        are captured. logit_idx_BY: chunk indices whose logits are returned.
    """

    rows_B: jax.Array
    tokens_BT: jax.Array
    chunk_len_B: jax.Array
    slots_BT: jax.Array
    q_idx_BX: jax.Array
    logit_idx_BY: jax.Array


@struct.dataclass
class DecodeBatch:
    """One decode call's input for B rows (padding rows: limit 0).

    Attributes:
      rows_B: cache rows. first_token_B: the token fed at step 0. limit_B: steps
        the row may take. slots_BN: the pool slot of each step's token. stop_BX:
        stop tokens per row (padded with -1). key_data_B / step0_B: the row's key
        and the reply index of step 0 (step s samples with fold_in(key, step0 + s)).
      temperature_B / top_p_B: sampler values. forced_BN: teacher-forced tokens.
    """

    rows_B: jax.Array
    first_token_B: jax.Array
    limit_B: jax.Array
    slots_BN: jax.Array
    stop_BX: jax.Array
    key_data_B: jax.Array
    step0_B: jax.Array
    temperature_B: jax.Array
    top_p_B: jax.Array
    forced_BN: jax.Array


# ============================================================================ jit'd steps
@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "n_read", "features", "mesh", "kv_op"),
    donate_argnames=("cache",),
)
def prefill_step(graphdef, params, cache: PagedKVCache, batch: PrefillBatch, *, n_read, features, mesh=None, kv_op=FloatPrefill(), kv_args=None):
    """Prefill one chunk for the rows of ``batch`` (a ``PrefillBatch``).

    ``kv_op`` is the pool's ``prefill_op`` (``jaxkv.cache.pools``; default: the float
    pool's) with its per-chunk ``kv_args`` (a quantized pool's page plan). With a ``mesh`` (the model's, ``jaxkv.models.sharding``) the batch is split over
    ``dp``, the pool stays split by KV head, and the outputs come back replicated.
    Returns ``(logits [B,Y,V] at chunk indices logit_idx_BY, cache, aux)``.
    """
    model = nnx.merge(graphdef, params)
    batch = batch if mesh is None else sharding.constrain_rows(batch, mesh)
    tables = take_rows(cache, batch.rows_B)
    T = batch.tokens_BT.shape[1]
    positions = tables.seq_len[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    logits, kv, aux = kv_op(model, batch, tables, positions, cache.kv, kv_args, n_read, features)
    tables = append_tokens(tables, batch.slots_BT, batch.chunk_len_B)
    cache = put_rows(cache.with_kv(kv), batch.rows_B, tables)
    if mesh is not None:
        (logits, aux), cache = sharding.replicate((logits, aux), mesh), constrain_cache(cache, mesh)
    return logits, cache, aux


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "n_steps", "n_read", "spec", "backend", "return_logits", "teacher_forced", "features", "mesh", "kv_step", "regroup"),
    donate_argnames=("cache",),
)
def decode_loop(
    graphdef,
    params,
    cache: PagedKVCache,
    batch: DecodeBatch,
    *,
    n_steps,
    n_read,
    spec: SamplerSpec,
    backend=None,
    return_logits=False,
    teacher_forced=False,
    features: Features = NO_FEATURES,
    mesh=None,
    kv_step=FloatDecodeStep(),
    kv_args=None,
    window: DecodeWindow | None = None,
    regroup: bool = False,
):
    """Decode up to ``n_steps`` tokens for each row of ``batch`` (a ``DecodeBatch``).

    Step ``s`` feeds each active row its last token (writing its K/V at
    ``slots_BN[:, s]``) and samples the next with key ``fold_in(key_b, step0_b +
    s)``, so a row's tokens do not depend on which other rows share the batch. A
    row stops after emitting a token in its ``stop_BX`` row (padded with -1) or
    after ``limit_B`` steps; padding rows have limit 0. With ``teacher_forced`` the
    fed token of step ``s > 0`` is ``forced_BN[:, s-1]`` instead of the sample.

    Returns ``(tokens [B,n], n_fed [B], cache, logits [B,n,V] or None, aux)``:
    ``aux["q_rows"]`` ``[n, L, B, Hq, D]`` (post-RoPE query of each fed token) and
    ``aux["mass_BN"]`` (attention mass each live-list entry received, mean over
    layers and heads, summed over steps) when ``features`` asks. With a ``mesh``
    (as ``prefill_step``) decode attention runs per device on its own KV heads
    (``sharding.shard_heads``). With ``regroup`` the call also ends once half of
    its rows or more have stopped (after at least one step): every step costs
    every row of the batch (a stopped row still reads its K/V), so the rest
    continue in the caller's next call with fewer rows, beside any row that is
    ready to join. A row's tokens do not depend on where calls end.

    The pool is ``cache.kv``; each step is the pool's ``decode_op`` (``kv_step``,
    ``jaxkv.cache.pools``; default: the float pool's) with its per-call ``kv_args``
    (a quantized pool's page tables).
    With a ``window`` (``gather_decode_window`` of the same rows, see
    ``gather_window``) every step attends over that copy of the rows' live K/V
    plus the chunk's own new rows (``decode_attention_two_parts``) and gathers
    nothing from the pool.
    """
    model = nnx.merge(graphdef, params)
    cfg = model.cfg
    b = batch if mesh is None else sharding.constrain_rows(batch, mesh)
    B = b.first_token_B.shape[0]
    logits_buf = jnp.zeros((B, n_steps if return_logits else 0, cfg.vocab_size), jnp.float32)
    aux0 = {}
    if features.query_rows:
        aux0["q_rows"] = jnp.zeros((n_steps, cfg.num_layers, B, cfg.num_heads, cfg.head_dim), jnp.float32)
    if features.attn_mass:
        aux0["mass_BN"] = jnp.zeros((B, n_read), jnp.float32)
    keys_B = jax.random.wrap_key_data(b.key_data_B)
    attend = functools.partial(pallas.decode_attention, backend=backend)
    attend = attend if mesh is None else sharding.shard_heads(attend, mesh)

    started = (b.limit_B > 0).sum()

    def cond(carry):
        step, _, _, _, active, _, _, _ = carry
        go_on = (step < n_steps) & active.any()
        if regroup:
            go_on = go_on & ((step == 0) | (2 * active.sum() > started))
        return go_on

    def body(carry):
        step, kv, tables, tokens, active, last, logits_buf, aux = carry
        slot = jnp.where(active, b.slots_BN[:, step], SENTINEL_SLOT)
        pos = tables.seq_len
        tables = append_tokens(tables, slot[:, None], active.astype(jnp.int32))
        logits, kv, step_aux = kv_step(
            model, last, pos, kv, kv_args, tables, slot, n_read, features, attend=attend,
            window=aux["window"]._replace(step=step) if window is not None else None,
        )
        aux = dict(aux)
        if "window" in aux:
            aux["window"] = step_aux["window"]
        if features.query_rows:
            aux["q_rows"] = aux["q_rows"].at[step].set(step_aux["q_rows"][:, :, 0].astype(jnp.float32))
        if features.attn_mass:
            aux["mass_BN"] = aux["mass_BN"] + step_aux["attn_mass"].mean(axis=(0, 2)) * active[:, None]
        step_keys = jax.vmap(jax.random.fold_in)(keys_B, b.step0_B + step)
        nxt = sample_rows(logits, step_keys, spec, b.temperature_B, b.top_p_B)
        nxt = jnp.where(active, nxt, -1)
        tokens = tokens.at[:, step].set(nxt)
        if return_logits:
            logits_buf = logits_buf.at[:, step].set(logits)
        stopped = (nxt[:, None] == b.stop_BX).any(-1)
        new_active = active & ~stopped & (step + 1 < b.limit_B)
        feed = b.forced_BN[:, step] if teacher_forced else nxt
        return step + 1, kv, tables, tokens, new_active, feed, logits_buf, aux

    tokens = jnp.full((B, n_steps), -1, jnp.int32)
    tables = take_rows(cache, b.rows_B)
    if window is not None:
        aux0["window"] = window
    carry = (jnp.int32(0), cache.kv, tables, tokens, b.limit_B > 0, b.first_token_B, logits_buf, aux0)
    _, kv, tables, tokens, _, _, logits_buf, aux = jax.lax.while_loop(cond, body, carry)
    aux.pop("window", None)
    fed = tables.seq_len - take_rows(cache, b.rows_B).seq_len
    cache = put_rows(cache.with_kv(kv), b.rows_B, tables)
    if mesh is not None:
        (tokens, fed, logits_buf, aux), cache = sharding.replicate((tokens, fed, logits_buf, aux), mesh), constrain_cache(cache, mesh)
    return tokens, fed, cache, (logits_buf if return_logits else None), aux


@functools.partial(jax.jit, static_argnames=("width", "n_steps"))
def gather_decode_window(cache: PagedKVCache, rows_B, *, width: int, n_steps: int) -> DecodeWindow:
    """The ``DecodeWindow`` of a decode chunk of ``n_steps`` steps over ``rows_B``:
    the first ``width`` entries of each row's live list, head-major.

    A jit of its own, not the start of ``decode_loop``: there, reading the pool
    before the loop writes it made XLA:CPU copy the whole pool every call."""
    tables = take_rows(cache, rows_B)
    live_BW = tables.live_idx[:, :width]
    L, B = cache.k.shape[0], rows_B.shape[0]
    k_old = tuple(jnp.transpose(cache.k[i][live_BW], (0, 2, 3, 1)) for i in range(L))  # L x [B, Hkv, D, W]
    v_old = tuple(jnp.transpose(cache.v[i][live_BW], (0, 2, 1, 3)) for i in range(L))  # L x [B, Hkv, W, D]
    new = tuple(jnp.zeros((B, n_steps, *cache.k.shape[2:]), cache.k.dtype) for _ in range(L))
    return DecodeWindow(k_old, v_old, tables.live_len, new, new, jnp.int32(0))


def gather_window(cache: PagedKVCache, B: int, width: int, backend, mesh, uses_window: bool = True) -> bool:
    """Whether ``Engine.step_decode`` has ``decode_loop`` gather each row's live
    K/V once per chunk (a ``DecodeWindow`` of ``width`` entries per row) instead of
    gathering it from the pool in every step.

    On the CPU reference path the per-step gather is a large part of decode
    attention: XLA:CPU gathers rows far slower than it streams a contiguous array
    (``eval/bench_decode.py`` prints both). The window costs one ``[B, width,
    Hkv, D]`` copy of K and of V per layer, so it is used only while that copy is
    no larger than the pool (``B * width <= S``). Kernel backends read the pool
    through the live list directly and never use it; nor do a pool whose
    ``uses_window`` is false (the quantized pool reads its page tables) and a
    mesh, which have their own steps.
    """
    return (
        uses_window
        and mesh is None
        and pallas.resolve_backend(backend) == "reference"
        and B * width <= cache.k.shape[1]
    )


def cache_sharding(cache: PagedKVCache, mesh) -> PagedKVCache:
    """Where each array of ``cache`` lives on ``mesh`` (a pytree of ``NamedSharding``):
    every pool array split by KV head (its axis 2 in both pools' layouts,
    ``sharding.POOL_SPEC``), the tables replicated."""
    pool = NamedSharding(mesh, sharding.POOL_SPEC)
    replicated = jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), cache)
    return replicated.with_kv(jax.tree.map(lambda _: pool, cache.kv))


def constrain_cache(cache: PagedKVCache, mesh) -> PagedKVCache:
    """Inside jit: keep ``cache`` in ``cache_sharding`` (a donated pool comes back
    where it was, so its buffers are reused)."""
    return jax.lax.with_sharding_constraint(cache, cache_sharding(cache, mesh))


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _dense_logits(graphdef, params, tokens_BT):
    return nnx.merge(graphdef, params)(tokens_BT)


@functools.partial(jax.jit, donate_argnames=("cache",))
def _install_row(cache: PagedKVCache, row, slot_map_P, live_idx_P, live_len, seq_len):
    return cache.replace(
        slot_map=cache.slot_map.at[row].set(slot_map_P),
        live_idx=cache.live_idx.at[row].set(live_idx_P),
        live_len=cache.live_len.at[row].set(live_len),
        seq_len=cache.seq_len.at[row].set(seq_len),
    )


# ============================================================================ jobs
@dataclasses.dataclass(frozen=True)
class KVSource:
    """A prompt's K/V computed elsewhere, for an *imported* prefill
    (``Engine.start_prefill(kv_source=...)``): the pool stores these rows exactly as
    a prefill stores the K/V it computes, and no forward runs.

    What it is for: branching one full-precision prefill into pools of other
    formats (``eval.real_model``'s quantized cells). A chunked prefill on a
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
      mass ``[L, Hq, seq_len]`` (positions of the whole row after the job).
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
      spec / temperature / top_p: the sampler (``make_sampler``).
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
    spec: SamplerSpec
    temperature: float
    top_p: float
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
      prefill_chunk: tokens per prefill step (``PREFILL_CHUNK``).
      backend: decode-attention backend passed to ``jaxkv.pallas.decode_attention``.
      reclaim: optional ``reclaim(n_slots) -> freed`` called when fewer than the
        needed slots are free (e.g. the radix cache's LRU eviction); only if it
        cannot free enough does the allocation raise ``OutOfSlotsError``.
      kv_quant: None (float pool) or a mode of ``jaxkv.cache.quantized_host.MODES``:
        a dual INT2/INT4 (and, for ``kivi2``/``kivi4``, float) pool whose token region holds
        ``num_slots - 1`` tokens; prefills take per-token ``kv_bits``. Either is
        ``self.pool`` (``jaxkv.cache.pools``).
    """

    def __init__(self, model: Model, *, rows: int = 1, max_positions: int | None = None, num_slots: int | None = None, prefill_chunk: int = PREFILL_CHUNK, backend=None, reclaim=None, kv_quant=None):
        cfg = model.config
        self.model = model
        self.graphdef, self.params = model.split()
        P = int(max_positions or min(cfg.max_position_embeddings, 8192))
        if P > cfg.max_position_embeddings:
            raise ContextLengthError(
                f"max_positions {P} exceeds the model context {cfg.max_position_embeddings}"
            )
        self.max_positions = P
        self.mesh = model.mesh  # tensor / data parallel (jaxkv.models.sharding), or None
        self.min_batch = sharding.axis_size(self.mesh, sharding.DP)  # every step's rows split evenly over dp
        pool_dtype = float_pool_dtype(model.dtype, _platform(self.mesh))  # float pool, or a quantized pool's float region
        self.pool = make_pool(kv_quant, num_slots or rows * P + 1, head_dim=cfg.head_dim, float_dtype=pool_dtype, backend=backend)
        self.pool.check_mesh(self.mesh)
        self.allocator = self.pool.allocator
        create = self.pool.cache_factory(cfg, rows=rows, positions=P, dtype=pool_dtype)
        if self.mesh is None:
            self.cache = create()
        else:  # made in place on the mesh: no device ever holds the whole pool
            self.cache = jax.jit(create, out_shardings=cache_sharding(jax.eval_shape(create), self.mesh))()
        self.prefill_chunk = int(prefill_chunk)
        self.short_chunk = SHORT_CHUNK  # narrowest prefill width (``buckets.prefill_width``); narrower pads less, compiles more
        self.backend = backend
        self.decode_window = True  # CPU reference: gather each row's K/V once per decode chunk (``gather_window``)
        self.row_state: list[RequestState | None] = [None] * rows
        self.reclaim = reclaim

    @property
    def rows(self) -> int:
        return len(self.row_state)

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
        P = self.max_positions
        slot_map = np.zeros(P, np.int32)
        slot_map[: state.seq_len] = state.slots
        live = np.zeros(P, np.int32)
        live[: len(state.live)] = state.live
        self.cache = _install_row(self.cache, row, slot_map, live, len(state.live), state.seq_len)

    def truncate_row(self, row: int, length: int) -> np.ndarray:
        """Forget positions ``>= length`` of a row (e.g. a generation that a replay
        discards); returns the slots that became free."""
        state = self._row(row)
        if not 0 <= length <= state.seq_len:
            raise JaxKVError(f"cannot truncate row {row} of {state.seq_len} positions to {length}")
        freed = self.allocator.release(state.truncate(length))
        self._push_row(row)
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
        evicted = self.gather_rows(plan.evicted_slots) if keep_evicted else None
        if plan.copy_src.size:  # kept rows to fresh slots, keys rotated (a quantized pool re-encodes)
            self.cache = self.pool.compact(self.cache, plan, self.model.config.rope)
        if plan.renumbered:
            state.reindex(plan.kept_positions, plan.slots, plan.live)
            self._push_row(row)
        else:
            self.set_row_tables(row, plan.slots, plan.live)
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
        plan, slots = self.pool.plan_prefill(self, row, kv_bits, tokens.size, self.prefill_chunk)
        q_idx_X = None if q_idx is None else np.asarray(q_idx, np.int64).reshape(-1)
        job = PrefillJob(row, tokens, slots, all_logits, q_idx_X, attn_mass, kv_plan=plan, kv_source=kv_source)
        cfg = self.model.config
        if attn_mass:
            job.mass = np.zeros((cfg.num_layers, cfg.num_heads, state.seq_len + tokens.size), np.float32)
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

    def step_prefill(self, jobs: Sequence[PrefillJob]) -> None:
        """Advance every unfinished job by one chunk.

        A step costs rows x width x read window, padding included (a padding row
        runs the whole forward on its width), so the jobs are split before they
        are padded: by the features they capture (query rows, attention mass: a
        plain job never pays for another's, and each step is one program
        variant), by chunk width (a power of two from ``SHORT_CHUNK`` up to the
        chunk size, so a piece is padded less than 2x and batches reuse a handful
        of compiles: 128, 256, 512 at the defaults), then, shortest context first, into power-of-two
        groups (9 jobs run as 8 + 1, not as 16 rows), so rows of similar context
        share a read window and no row is padding unless a mesh's data-parallel
        size asks for it."""
        self._check_open()
        by_width: dict[tuple, list[PrefillJob]] = {}
        for j in jobs:
            if not j.finished:
                C = buckets.prefill_width(j.tokens.size - j.done, self.prefill_chunk, self.short_chunk)
                by_width.setdefault((C, j.q_idx_X is not None, j.attn_mass, j.kv_source is not None), []).append(j)
        for (C, *_), group in sorted(by_width.items()):
            group.sort(key=lambda j: len(self._row(j.row).live))
            while group:
                take = 1 << (len(group).bit_length() - 1)  # the largest power of two <= len(group)
                if take < self.min_batch:
                    take = len(group)  # the rest, padded up to the mesh's rows
                self._prefill_chunk(group[-take:], C)
                group = group[:-take]

    def _prefill_chunk(self, jobs: Sequence[PrefillJob], C: int) -> None:
        """One ``prefill_step`` of the next piece (at most ``C`` tokens) of each job."""
        states = [self._row(j.row) for j in jobs]
        pieces = [j.tokens[j.done : j.done + C] for j in jobs]
        B = buckets.prefill_rows(len(jobs), self.min_batch)
        R = self.rows
        rows = np.full(B, R, np.int32)
        tokens = np.zeros((B, C), np.int32)
        slots = np.zeros((B, C), np.int32)
        counts = np.zeros(B, np.int32)
        # One feature set per step (step_prefill groups jobs by it), so a capturing
        # step is a variant of the plain one: query rows of every chunk row (X = C,
        # the host keeps the ones it asked for) and/or attention mass.
        features = Features(query_rows=any(j.q_idx_X is not None for j in jobs), attn_mass=any(j.attn_mass for j in jobs))
        X = C if features.query_rows else 1
        Y = C if any(j.all_logits for j in jobs) else 1
        q_idx = np.zeros((B, X), np.int32)
        logit_idx = np.zeros((B, Y), np.int32)
        for b, (j, piece) in enumerate(zip(jobs, pieces)):
            rows[b], counts[b] = j.row, piece.size
            tokens[b, : piece.size] = piece
            slots[b, : piece.size] = j.slots[j.done : j.done + piece.size]
            if j.q_idx_X is not None:
                q_idx[b, : piece.size] = np.arange(piece.size)  # every row of the piece
            logit_idx[b] = np.arange(Y) if Y == C else piece.size - 1  # Y == 1: the last real token
        n_read = buckets.read_length(max(len(s.live) for s in states), self.max_positions)
        batch = PrefillBatch(rows, tokens, counts, slots, q_idx, logit_idx)
        kv_op, kv_args = self.pool.prefill_op, self.pool.prefill_args(jobs, B, C)
        importing = jobs[0].kv_source is not None  # step_prefill groups jobs by it
        if importing:
            cfg = self.model.config
            k_src = np.zeros((cfg.num_layers, B, C, cfg.num_kv_heads, cfg.head_dim), np.float32)
            v_src = np.zeros_like(k_src)
            for b, (j, piece) in enumerate(zip(jobs, pieces)):
                k_src[:, b, : piece.size] = j.kv_source.k[:, j.done : j.done + piece.size]
                v_src[:, b, : piece.size] = j.kv_source.v[:, j.done : j.done + piece.size]
            kv_op, kv_args = self.pool.import_op, (kv_args, jnp.asarray(k_src), jnp.asarray(v_src))
        logits, self.cache, aux = prefill_step(
            self.graphdef, self.params, self.cache, batch, n_read=n_read, features=features, mesh=self.mesh,
            kv_op=kv_op, kv_args=kv_args,
        )
        logits = np.asarray(logits)
        chunk_mass = np.asarray(aux["attn_mass"]) if features.attn_mass else None  # [L, B, Hq, n_read + C]
        chunk_q = np.asarray(aux["q_rows"]) if features.query_rows else None  # [L, B, C, Hq, D]
        for b, (j, st, piece) in enumerate(zip(jobs, states, pieces)):
            n = piece.size
            if j.attn_mass:
                live_pos = st.live_positions()  # the live list is in position order
                j.mass[:, :, live_pos] += chunk_mass[:, b, :, : live_pos.size]
                j.mass[:, :, st.seq_len : st.seq_len + n] += chunk_mass[:, b, :, n_read : n_read + n]
            if j.q_idx_X is not None:
                here = np.flatnonzero((j.q_idx_X >= j.done) & (j.q_idx_X < j.done + n))
                j.q_rows[:, here] = chunk_q[:, b, j.q_idx_X[here] - j.done]
            if importing:
                j.logits.append(np.asarray(j.kv_source.last_logits, np.float32)[None])  # the source's; only the last chunk's is read
            else:
                j.logits.append(logits[b, :n] if j.all_logits else logits[b, n - 1 if Y == C else 0][None])
            st.append(piece, j.slots[j.done : j.done + n])
            j.done += n
        self.pool.settle(self, [j.row for j in jobs])  # kivi2: aged residual -> INT2 pages

    def prefill(self, rows: Sequence[int], token_lists: Sequence[Sequence[int]], *, all_logits=False, features: Features = NO_FEATURES, q_row_positions=None, kv_bits=None):
        """Append ``token_lists[i]`` to ``rows[i]``; returns logits of the new tokens.

        Returns a list (one per row) of float32 numpy arrays: ``[n_i, V]`` when
        ``all_logits`` else ``[V]`` for the last token. With ``features``, returns
        ``(logits, aux)``: with ``features.attn_mass``, ``aux["attn_mass"][i]`` is
        ``[L, Hq, seq_len]`` float32, the attention mass each position of row i
        received from this prefill's query rows (summed over rows and chunks; 0
        at holes); with ``features.query_rows``, ``aux["q_rows"]`` is
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
            self.step_prefill(jobs)
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
        allocated per chunk)."""
        spec, temp, top_p_val = make_sampler(temperature, top_k, top_p)
        st = self._row(row)
        if st.seq_len + n_steps > self.max_positions:
            raise ContextLengthError(
                f"row {row}: {st.seq_len} cached + {n_steps} decode steps exceed {self.max_positions} positions"
            )
        return DecodeJob(
            row, int(first_token), int(n_steps), spec, float(temp), float(top_p_val),
            key if key is not None else jax.random.key(0), tuple(sorted(set(int(t) for t in stop_token_ids))),
            step0, None if forced_tokens is None else list(forced_tokens), return_logits, features,
        )

    def step_decode(self, jobs: Sequence[DecodeJob], max_steps: int | None = None, *, regroup: bool = False) -> None:
        """Advance every unfinished job by up to ``max_steps`` steps (default: all
        it has left) in one ``decode_loop``. All jobs must share one sampler spec.
        ``regroup``: end the call once half its rows have stopped (``decode_loop``;
        the caller then calls again for the unfinished jobs, as the scheduler does).
        Slots for the steps are allocated first (``OutOfSlotsError`` before any
        change) and the unused ones released after."""
        self._check_open()
        jobs = [j for j in jobs if not j.finished]
        if not jobs:
            return
        spec = jobs[0].spec
        if any(j.spec != spec for j in jobs):
            raise JaxKVError("step_decode batches jobs of one sampler spec")
        steps = [j.n_steps - j.fed if max_steps is None else min(j.n_steps - j.fed, max_steps) for j in jobs]
        n = max(steps) if max_steps is None else int(max_steps)  # a fixed chunk: one compile, rows stop at their limit
        total = sum(steps)
        if total > self.allocator.num_free and self.reclaim is not None:
            self.reclaim(total - self.allocator.num_free)
        fresh = self.allocator.allocate(total)  # raises before any change
        per_job = np.split(fresh, np.cumsum(steps)[:-1])
        states = [self._row(j.row) for j in jobs]
        # Rows: multiples of 4 past 4 (12 jobs run as 12 rows, not 16): a padding row
        # still gathers and attends over the whole read window every step.
        B = buckets.decode_rows(len(jobs), self.min_batch)
        R = self.rows
        rows = np.full(B, R, np.int32)
        first = np.zeros(B, np.int32)
        limit = np.zeros(B, np.int32)
        slots = np.zeros((B, n), np.int32)
        stop_width = max(1, max(len(j.stop_ids) for j in jobs))
        stop = np.full((B, stop_width), -1, np.int32)
        key_data = np.zeros((B, *jax.random.key_data(jobs[0].key).shape), np.uint32)
        step0 = np.zeros(B, np.int32)
        temp = np.ones(B, np.float32)
        top_p = np.ones(B, np.float32)
        forced = np.zeros((B, n), np.int32)
        teacher_forced = any(j.forced is not None for j in jobs)
        for b, (j, k, s) in enumerate(zip(jobs, steps, per_job)):
            rows[b], first[b], limit[b] = j.row, j.next_feed, k
            slots[b, :k] = s
            stop[b, : len(j.stop_ids)] = j.stop_ids
            key_data[b] = np.asarray(jax.random.key_data(j.key))
            step0[b], temp[b], top_p[b] = j.step0 + j.fed, j.temperature, j.top_p
            if j.forced is not None:
                f = j.forced[j.fed : j.fed + n]
                forced[b, : len(f)] = f
        # Query rows every call captures (one compiled program for capturing and
        # plain jobs); attention mass is a variant (the scheduler groups by it).
        features = Features(query_rows=True, attn_mass=any(j.features.attn_mass for j in jobs))
        return_logits = any(j.return_logits for j in jobs)
        longest = max(len(s.live) for s in states) + n
        n_read = buckets.read_length(longest, self.max_positions)
        kv_args = self.pool.decode_args(states, [s[:k] for s, k in zip(per_job, steps)], B, n)  # page tables
        batch = DecodeBatch(rows, first, limit, slots, stop, key_data, step0, temp, top_p, forced)
        # The window's width sets every step's attention work, so it is bucketed finer
        # than shapes elsewhere (multiples of WINDOW_STEP past it): a row of 1,100 live
        # tokens reads 1,152 entries, not 1,536. More widths mean more compiles, once.
        width = buckets.window_width(max(len(s.live) for s in states), self.max_positions)
        window = None
        if self.decode_window and gather_window(self.cache, B, width, self.backend, self.mesh, self.pool.uses_window):
            window = gather_decode_window(self.cache, jnp.asarray(rows), width=width, n_steps=n)
        tokens, fed, self.cache, logits, aux = decode_loop(
            self.graphdef, self.params, self.cache, batch,
            n_steps=n, n_read=n_read, spec=spec, backend=self.backend, return_logits=return_logits,
            teacher_forced=any(j.forced is not None for j in jobs), features=features, mesh=self.mesh, kv_step=self.pool.decode_op, kv_args=kv_args,
            window=window, regroup=regroup,
        )
        tokens, fed = np.asarray(tokens), np.asarray(fed)
        q_rows = np.asarray(aux["q_rows"]) if any(j.features.query_rows for j in jobs) else None
        mass_BN = np.asarray(aux["mass_BN"]) if features.attn_mass else None
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
            if j.features.attn_mass:
                m = np.zeros(st.seq_len, np.float32)
                live_pos = st.live_positions()  # entry i of the live list is position live_pos[i]
                m[live_pos] = mass_BN[b, : live_pos.size]
                if j.mass is not None:
                    m[: j.mass.size] += j.mass
                j.mass = m
        self.allocator.release(np.concatenate(unused))
        self.pool.settle(self, [j.row for j in jobs])  # kivi2: aged residual -> INT2 pages

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


    # -- segment reuse (jaxkv.splice) ----------------------------------------------------
    # -- warm-up -------------------------------------------------------------------
    WARMUP_SAMPLERS = {"greedy": {}, "sample": {"temperature": 1.0}, "top_p": {"temperature": 1.0, "top_p": 0.9}}

    def warmup(self, decode_chunk: int, *, samplers=("greedy", "sample", "top_p"), stop_token_ids=(), progress=None, prefill_rows: bool = False, prefill_mass: bool = False, decode_mass: bool = False) -> int:
        """Compile every program of ``buckets.shape_set`` (prefill steps by rows,
        width and read length; decode calls by rows, read length and window width,
        for each sampler in ``samplers``, names of ``WARMUP_SAMPLERS``) by running
        each once on scratch rows, through the same methods requests use (so a
        quantized pool warms its own steps). ``prefill_rows`` adds the variant of
        every prefill program that captures query rows (retention policies'
        windows and spans), ``prefill_mass`` / ``decode_mass`` the attention-mass
        variant of every prefill / decode program (H2O-like policies; decode
        programs capture query rows always). ``stop_token_ids`` must be the
        server's (their count is a shape). ``progress(n)`` is called after each
        program. Where the process cannot hold every program's memory mappings,
        the compiled programs are dropped as it fills (``compiles.release_if_crowded``):
        the persistent cache keeps them for the requests that need them. The
        engine must be idle; scratch rows are closed afterwards.
        Returns how many programs it ran."""
        if any(state is not None for state in self.row_state):
            raise JaxKVError("warm-up needs an idle engine (a row is open)")
        shapes = buckets.shape_set(self.rows, self.max_positions, self.prefill_chunk, decode_chunk, self.min_batch, self.short_chunk)
        sampler_options = [self.WARMUP_SAMPLERS[name] for name in samplers]
        prefill_variants = [(False, False)] + [v for v, on in (((True, False), prefill_rows), ((False, True), prefill_mass)) if on]  # (rows, mass)
        decode_variants = [Features(attn_mass=m) for m in ([False, True] if decode_mass else [False])]
        work: dict[int, dict[int, list]] = {}  # jobs -> live length -> programs to run there
        for B, C, _, live in shapes.prefill:
            jobs = min(B, self.rows)
            work.setdefault(jobs, {}).setdefault(live, []).extend(("prefill", (C, f)) for f in prefill_variants)
        for B, _, _, live in shapes.decode:
            jobs = next(j for j in range(1, self.rows + 1) if buckets.decode_rows(j, self.min_batch) == B)
            work.setdefault(jobs, {}).setdefault(live, []).extend(
                ("decode", (opts, f)) for f in decode_variants for opts in sampler_options
            )
        ran = 0
        for jobs, by_live in sorted(work.items()):
            rows = [self.open_row() for _ in range(jobs)]
            try:
                for live, programs in sorted(by_live.items()):
                    self._warm_grow(rows, live)
                    for kind, arg in programs:
                        if kind == "prefill":
                            C, (rows_q, mass) = arg
                            self.step_prefill([
                                self.start_prefill(r, np.zeros(C, np.int32), q_idx=[0] if rows_q else None, attn_mass=mass) for r in rows
                            ])
                        else:
                            opts, f = arg
                            self.step_decode([
                                self.start_decode(r, 0, decode_chunk, stop_token_ids=stop_token_ids, features=f, **opts) for r in rows
                            ], decode_chunk, regroup=True)  # as the scheduler calls it
                        for r in rows:
                            self.truncate_row(r, live)
                        compiles.release_if_crowded()  # the whole set may not fit the process's mappings
                        ran += 1
                        if progress is not None:
                            progress(1)
            finally:
                for r in rows:
                    self.close_row(r)
        return ran

    def _warm_grow(self, rows, live: int) -> None:
        """Prefill scratch rows up to ``live`` positions (warm-up)."""
        need = live - self._row(rows[0]).seq_len
        if need > 0:
            self.prefill(rows, [np.zeros(need, np.int32)] * len(rows))

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
            live_N, live_pos_N = np.zeros(N, np.int32), np.full(N, PAD_POS, np.int32)
            live_N[: keys.size], live_pos_N[: keys.size] = keys[order], key_pos[order]
            logit_idx = np.asarray(plan.logit_idx, np.int64)
            Y = bucket(max(logit_idx.size, 1), minimum=8)
            src = in_a if plan.cut >= cfg.num_layers else np.searchsorted(b_idx, np.arange(T))
            logit_src = np.zeros(Y, np.int32)
            logit_src[: logit_idx.size] = src[logit_idx]
            logits, self.cache, resid = splice_step(
                self.graphdef, self.params, self.cache, a_tok, a_pos, a_slot, b_src, b_resid, b_pos, b_slot, b_cut_slot,
                kv_k, kv_v, kv_slot, kv_delta, live_N, live_pos_N, logit_src,
                cut=int(plan.cut), kv_lo=int(plan.kv_lo), kv_hi=int(plan.kv_hi) if nl else int(plan.kv_lo), io=self.pool.layer_io,
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
