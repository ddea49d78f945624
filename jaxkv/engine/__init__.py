"""The engine: a KV manager, a model runner and the packing of steps, behind one facade.

An ``Engine`` is three parts with one job each, in the shape of tpu-inference's and
sglang-jax's runners:

* ``engine.kv`` (``jaxkv.engine.kv_manager.KVManager``): the one writer of cache
  state: the paged pool, its allocator and every row's tables and host record.
  Stages ask it for eviction (``apply_layout``), promotion (``restore_rows``),
  keys and host copies of rows.
* ``engine.runner`` (``jaxkv.engine.runner.ModelRunner``): executes one scheduled
  step or one decode-loop call through the one forward (``jaxkv.forward``) and the
  attention backend chosen for the pool and platform (``jaxkv.backends``), and
  returns token ids (logits, query rows, attention mass only when asked).
* packing (``jaxkv.engine.packing``): which rows, and how many tokens of each, go
  into a step under the token budget: the scheduler's decision.

Read top to bottom, a request goes:

1. ``open_row(prefix_slots, prefix_tokens)``: take a cache row; a reused prefix (from
   the radix cache) is installed as its first positions (sentinel entries are holes).
2. ``start(PrefillJob(row, tokens, ...))``: slots are allocated on the host, before
   any change; ``step(prefill_jobs, decode_jobs)`` packs one step and runs it; the
   job's last piece samples the reply's first token. ``prefill(rows, token_lists)``
   runs jobs to completion. A job with a ``KVSource`` imports K/V instead.
3. ``kv.apply_layout`` / ``kv.restore_rows``: a compression event's decision and
   RepairKV's promotion, applied by the KV manager.
4. ``start(DecodeJob(row, first_token, n, ...))`` then ``step_decode(jobs, steps)``:
   one decode-loop call over the jobs' rows; ``decode(rows, first_tokens, n)`` runs
   jobs to completion.
5. ``truncate_row`` (drop a probe generation), ``close_row`` (drop references).

The scheduler (``jaxkv.serving.scheduler``) starts and steps jobs of many rows at
once; a single request (``generate``, tests) calls the run-to-completion methods.
``warmup`` (``jaxkv.engine.warmup``) compiles every program a server can reach;
``splice_prefill`` (``jaxkv.engine.splicing``) runs segment reuse's spliced step.

Invariants: host checks run before any device call, so a failing call leaves cache
and allocator untouched; lengths that reach shapes are bucketed
(``jaxkv.buckets``); one thread drives an engine; with a model on a mesh the pool
is split by KV head and stays so, donated, through every step.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from jaxkv import buckets
from jaxkv.backends import select_backend
from jaxkv.cache.pools import make_pool, pool_for_bytes
from jaxkv.cache.state import float_pool_dtype
from jaxkv.engine.jobs import GREEDY, DecodeJob, KVSource, PrefillJob, Sampling
from jaxkv.engine.kv_manager import KVCheckpoint, KVManager
from jaxkv.engine.packing import ScheduledStep, pack_step
from jaxkv.engine.runner import ModelRunner
from jaxkv.errors import ConfigError, ContextLengthError, JaxKVError
from jaxkv.forward import cache_sharding
from jaxkv.models.loading import Model
from jaxkv.sampling import make_sampler

PREFILL_CHUNK = 512  # tokens per prefill piece at most; chosen by eval/bench/prefill.py (README)
FIRST_TOKEN_KEY = 1 << 30  # the first reply token is drawn with fold_in(key, this)


def _platform(mesh) -> str:
    """The platform the pool lives on: the mesh's devices', else JAX's default backend."""
    return mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()


class Engine:
    """A paged KV pool and the steps over it for up to ``rows`` requests.

    Args:
      model: a loaded ``Model``. rows: concurrent requests (cache rows).
      max_positions: positions per row (P); default the model context, at most 8192.
      num_slots: pool slots including the sentinel; default ``rows * P + 1``.
      prefill_chunk: the most tokens of one row a step takes (``PREFILL_CHUNK``).
      token_budget: the most tokens of one step (default ``buckets.token_budget``:
        a whole chunk beside a decode token of every row).
      backend: the attention backend's platform (``jaxkv.backends.select_backend``;
        None: the blocked XLA implementation on the CPU, the kernels elsewhere).
      reclaim: optional ``reclaim(n_slots)``, called when fewer slots are free than
        an allocation needs (the radix cache's LRU eviction).
      kv_quant: None (float pool) or a mode of ``jaxkv.cache.quantized_host.MODES``.
      kv_memory_bytes: size the pool by memory instead of ``num_slots``
        (``jaxkv.cache.pools.pool_for_bytes``); kv_page_share: the share of a
        quantized pool's tokens in INT2 pages then.
      layer_lists: one live list per layer (J = L), so a row may keep a set per
        layer; False: one list per row read by every layer.
      kv_rotate: a quantized pool stores K and V rotated per (layer, KV head)
        (``jaxkv.cache.rotation``; attention rotates queries and output to match).
    """

    def __init__(
        self,
        model: Model,
        *,
        rows: int = 1,
        max_positions: int | None = None,
        num_slots: int | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
        token_budget: int | None = None,
        backend=None,
        reclaim=None,
        kv_quant=None,
        kv_memory_bytes: int | None = None,
        kv_page_share: float | None = None,
        layer_lists: bool = False,
        kv_rotate: bool = False,
    ):
        cfg = model.config
        self.model = model
        P = int(max_positions or min(cfg.max_position_embeddings, 8192))
        if P > cfg.max_position_embeddings:
            raise ContextLengthError(f"max_positions {P} exceeds the model context {cfg.max_position_embeddings}")
        self.prefill_chunk = int(prefill_chunk)
        if self.prefill_chunk < 1:
            raise JaxKVError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        mesh = model.mesh
        dtype = float_pool_dtype(model.dtype, _platform(mesh))  # float pool, or a quantized pool's float region
        if kv_memory_bytes is not None:
            if num_slots is not None:
                raise ConfigError("give num_slots or kv_memory_bytes, not both")
            pool = pool_for_bytes(kv_quant, kv_memory_bytes, cfg, float_dtype=dtype, page_share=kv_page_share, rotate=kv_rotate)
        else:
            pool = make_pool(kv_quant, num_slots or rows * P + 1, head_dim=cfg.head_dim, float_dtype=dtype, rotate=kv_rotate)
        pool.check_mesh(mesh)
        lists = cfg.num_layers if layer_lists else 1
        create = pool.cache_factory(cfg, rows=rows, positions=P, dtype=dtype, lists=lists)
        cache = create() if mesh is None else jax.jit(create, out_shardings=cache_sharding(jax.eval_shape(create), mesh))()
        self.token_budget = int(token_budget) if token_budget is not None else buckets.token_budget(self.prefill_chunk, rows)
        if self.token_budget < max(self.prefill_chunk, rows) or self.token_budget < rows + (self.prefill_chunk if pool.whole_chunks else 1):
            raise JaxKVError(
                f"token_budget {self.token_budget} cannot hold a decode token of each of {rows} rows beside a prefill "
                f"piece{' of a whole chunk' if pool.whole_chunks else ''} (prefill_chunk {self.prefill_chunk})"
            )
        self.kv = KVManager(pool, cache, cfg, rows=rows, max_positions=P, lists=lists, mesh=mesh, reclaim=reclaim)
        self.backend = select_backend(pool.layers, backend)
        self.runner = ModelRunner(model, self.kv, self.backend, token_budget=self.token_budget)

    # -- the KV manager's state, as every caller reads it ------------------------------
    cache = property(lambda self: self.kv.cache, doc="The device cache (``KVManager.cache``).")
    row_state = property(lambda self: self.kv.row_state, doc="Each row's ``RequestState`` (None: free).")
    allocator = property(lambda self: self.kv.allocator, doc="The pool's slot allocator.")
    pool = property(lambda self: self.kv.pool, doc="The pool object (``jaxkv.cache.pools``).")
    rows = property(lambda self: self.kv.rows)
    free_rows = property(lambda self: self.kv.free_rows)
    max_positions = property(lambda self: self.kv.max_positions)
    mesh = property(lambda self: self.model.mesh)
    layer_lists = property(lambda self: self.kv.lists > 1, doc="Whether each row has a live list per layer.")
    closed = property(lambda self: self.kv.closed)

    @property
    def reclaim(self):
        """The radix cache's eviction the KV manager calls when the pool is short."""
        return self.kv.reclaim

    @reclaim.setter
    def reclaim(self, fn) -> None:
        self.kv.reclaim = fn

    def close(self) -> None:
        """Free the KV pool now; idempotent. Opening a row afterwards raises ``JaxKVError``."""
        self.kv.close()
        self.runner.close()

    def open_row(self, prefix_slots: Sequence[int] = (), prefix_tokens: Sequence[int] | None = None) -> int:
        """``KVManager.open_row``: a free row with ``prefix_slots`` installed."""
        return self.kv.open_row(prefix_slots, prefix_tokens)

    def close_row(self, row: int) -> np.ndarray:
        """``KVManager.close_row``: the row's references released."""
        return self.kv.close_row(row)

    def truncate_row(self, row: int, length: int) -> np.ndarray:
        """``KVManager.truncate_row``: positions ``>= length`` forgotten."""
        return self.kv.truncate_row(row, length)

    # -- jobs ------------------------------------------------------------------------
    def start(self, job):
        """``KVManager.start``: a job's slots (prefill) or positions (decode) taken or
        checked now, before any change. Returns the job."""
        make_sampler(*job.sampling.settings)  # validates
        return self.kv.start(job, self.prefill_chunk)

    def start_prefill(
        self, row: int, tokens, *, all_logits=False, q_idx=None, attn_mass=False, kv_bits=None, kv_source: KVSource | None = None
    ) -> PrefillJob:
        """``start(PrefillJob(...))`` bringing back the logits of every token
        (``all_logits``) or of the last, and the queries at ``q_idx`` (indices into ``tokens``)."""
        return self.start(
            PrefillJob(
                row,
                tokens,
                logits="all" if all_logits else "last",
                q_idx_X=q_idx,
                attn_mass=attn_mass,
                kv_bits=kv_bits,
                kv_source=kv_source,
            )
        )

    def start_decode(
        self,
        row: int,
        first_token: int,
        n_steps: int,
        *,
        temperature=0.0,
        top_k=None,
        top_p=None,
        key=None,
        step0: int = 0,
        stop_token_ids=(),
        return_logits=False,
        forced_tokens=None,
        query_rows=False,
        attn_mass=False,
    ) -> DecodeJob:
        """``start(DecodeJob(...))``: step ``s`` samples with ``fold_in(key, step0 + s)``."""
        stops = tuple(sorted(set(int(t) for t in stop_token_ids)))
        forced = None if forced_tokens is None else list(forced_tokens)
        sampling = Sampling(float(temperature), top_k, top_p, key, step0)
        return self.start(DecodeJob(row, int(first_token), int(n_steps), sampling, stops, forced, return_logits, query_rows, attn_mass))

    def abandon_prefill(self, job: PrefillJob) -> np.ndarray:
        """Release the slots of a prefill job's unwritten tokens (cancelled or failed
        half-way); returns the slots freed."""
        rest = job.slots[job.done :]
        job.done, job.slots = job.tokens.size, job.slots[: job.done]
        return self.kv.release(rest)

    def step(self, prefill_jobs: Sequence[PrefillJob] = (), decode_jobs: Sequence[DecodeJob] = ()) -> None:
        """Pack one step of at most ``token_budget`` tokens (``pack_step``) and run it.
        An imported prefill (``KVSource``) stores its next chunk instead, alone."""
        self.kv.check_open()
        imports = [j for j in prefill_jobs if j.kv_source is not None and not j.finished]
        if imports:
            return self.runner.import_chunk(imports[0], self.prefill_chunk)
        step = pack_step(
            prefill_jobs,
            decode_jobs,
            budget=self.token_budget,
            rows=self.kv.rows,
            chunk=self.prefill_chunk,
            whole_chunks=self.kv.pool.whole_chunks,
            max_captured=self.runner.max_captured,
        )
        self.run(step)

    def run(self, step: ScheduledStep) -> None:
        """Execute a scheduled step (the scheduler packs its own)."""
        if not step.empty:
            self.runner.run(step)

    def step_decode(self, jobs: Sequence[DecodeJob], max_steps: int | None = None, *, regroup: bool = False) -> None:
        """Advance every unfinished job by up to ``max_steps`` steps in one decode-loop
        call (``ModelRunner.decode``). Jobs that bring back attention mass run as
        single steps (the mass is the step program's second pass)."""
        self.kv.check_open()
        jobs = [j for j in jobs if not j.finished]
        if not jobs:
            return
        if any(j.attn_mass for j in jobs):
            for _ in range(max_steps or max(j.n_steps - j.fed for j in jobs)):
                self.step(decode_jobs=[j for j in jobs if not j.finished])
                if all(j.finished for j in jobs):
                    break
            return
        self.runner.decode(jobs, max_steps, regroup=regroup)

    # -- run to completion -------------------------------------------------------------
    def prefill(self, rows: Sequence[int], token_lists, *, all_logits=False, attn_mass=False, q_row_positions=None, kv_bits=None):
        """Append ``token_lists[i]`` to ``rows[i]``; returns the logits of the new
        tokens per row (``[n_i, V]`` with ``all_logits``, else the last one's ``[V]``).
        With ``attn_mass`` or ``q_row_positions`` it returns ``(logits, aux)``:
        ``aux["attn_mass"][i]`` ``[seq_len]`` the mass each position of row i received
        from this prefill's queries (mean over layers and heads, summed over
        queries); ``aux["q_rows"]`` ``[L, len(rows), X, Hq, D]`` the post-RoPE queries
        at ``q_row_positions[i]`` (indices into ``token_lists[i]``)."""
        for r, tokens in zip(rows, token_lists):
            self.kv.check_room(r, len(tokens))
        self.kv.reserve(sum(len(t) for t in token_lists))
        jobs = [
            self.start_prefill(
                r,
                t,
                all_logits=all_logits,
                attn_mass=attn_mass,
                kv_bits=None if kv_bits is None else kv_bits[i],
                q_idx=None if q_row_positions is None else q_row_positions[i],
            )
            for i, (r, t) in enumerate(zip(rows, token_lists))
        ]
        while not all(j.finished for j in jobs):
            self.step(prefill_jobs=jobs)
        logits = [j.result_logits() for j in jobs]
        if not attn_mass and q_row_positions is None:
            return logits
        aux = {}
        if attn_mass:
            aux["attn_mass"] = [j.mass for j in jobs]
        if q_row_positions is not None:
            aux["q_rows"] = np.stack([j.q_rows for j in jobs], axis=1)
        return logits, aux

    def decode(
        self,
        rows: Sequence[int],
        first_tokens: Sequence[int],
        n_steps: int,
        *,
        temperature=0.0,
        top_k=None,
        top_p=None,
        key=None,
        stop_token_ids=(),
        return_logits=False,
        forced_tokens=None,
        query_rows=False,
        attn_mass=False,
    ):
        """Feed ``first_tokens`` and decode up to ``n_steps`` tokens per row. Returns
        ``(tokens, logits)``: ``tokens[i]`` row i's sampled tokens (ending with its stop
        token when one came); ``logits[i]`` ``[n, V]`` with ``return_logits``.
        ``forced_tokens[i]`` replaces the fed token of every step after the first.
        Row ``i`` samples with ``fold_in(key, i)``. With ``query_rows`` or
        ``attn_mass`` it returns ``(tokens, logits, aux)``: ``aux["q_rows"][i]`` ``[n_i,
        L, Hq, D]`` the query of each fed token; ``aux["attn_mass"][i]`` ``[seq_len]``."""
        make_sampler(temperature, top_k, top_p)
        if n_steps <= 0:
            return [[] for _ in rows], None
        key = key if key is not None else jax.random.key(0)
        jobs = [
            self.start_decode(
                r,
                first_tokens[i],
                n_steps,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                key=jax.random.fold_in(key, i),
                stop_token_ids=stop_token_ids,
                return_logits=return_logits,
                query_rows=query_rows,
                attn_mass=attn_mass,
                forced_tokens=None if forced_tokens is None else forced_tokens[i],
            )
            for i, r in enumerate(rows)
        ]
        self.step_decode(jobs)
        V = self.model.config.vocab_size
        logits = [np.concatenate(j.logits) if j.logits else np.zeros((0, V), np.float32) for j in jobs] if return_logits else None
        if not query_rows and not attn_mass:
            return [j.tokens for j in jobs], logits
        aux = {}
        if query_rows:
            aux["q_rows"] = [np.concatenate(j.q_rows) for j in jobs]
        if attn_mass:
            aux["attn_mass"] = [j.mass for j in jobs]
        return [j.tokens for j in jobs], logits, aux

    # -- programs and spliced steps ------------------------------------------------------
    def shape_set(self, decode_chunk: int) -> buckets.ShapeSet:
        """The bounded set of step shapes this engine compiles (``jaxkv.buckets``)."""
        from jaxkv.engine.warmup import shape_set

        return shape_set(self, decode_chunk)

    def warmup(self, decode_chunk: int, **options) -> int:
        """Compile every program of ``shape_set`` (``jaxkv.engine.warmup.warmup``)."""
        from jaxkv.engine.warmup import warmup

        return warmup(self, decode_chunk, **options)

    def splice_prefill(self, row: int, plan, *, mode: str = "append"):
        """Run one ``jaxkv.splice.SplicePlan`` on ``row`` (``jaxkv.engine.splicing``)."""
        from jaxkv.engine.splicing import splice_prefill

        return splice_prefill(self, row, plan, mode=mode)

    def key_deviation(self, x_XM, positions_X, k_old_XKD, old_positions_X, layer: int) -> np.ndarray:
        """CacheBlend's per-token key deviation (``jaxkv.engine.splicing``)."""
        from jaxkv.engine.splicing import key_deviation

        return key_deviation(self, x_XM, positions_X, k_old_XKD, old_positions_X, layer)


from jaxkv.engine.oneshot import generate, score_logits  # noqa: E402  (they build an Engine)

__all__ = [
    "FIRST_TOKEN_KEY",
    "GREEDY",
    "PREFILL_CHUNK",
    "DecodeJob",
    "Engine",
    "KVCheckpoint",
    "KVSource",
    "PrefillJob",
    "Sampling",
    "generate",
    "score_logits",
]
