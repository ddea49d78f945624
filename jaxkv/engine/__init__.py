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
``warmup`` (``jaxkv.engine.warmup``, with its ``shape_set``) compiles every program a
server can reach; ``splice_prefill`` (``jaxkv.engine.splicing``, with CacheBlend's
``key_deviation``) runs segment reuse's spliced step.

Invariants: host checks run before any device call, so a failing call leaves cache
and allocator untouched; lengths that reach shapes are bucketed
(``jaxkv.buckets``); one thread drives an engine; with a model on a mesh the pool
is split by KV head and stays so, donated, through every step.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from jaxkv import buckets
from jaxkv.backends import select_backend
from jaxkv.engine.jobs import GREEDY, DecodeJob, KVSource, PrefillJob, Sampling
from jaxkv.engine.kv_manager import KVCheckpoint, KVManager
from jaxkv.engine.packing import ScheduledStep, pack_step
from jaxkv.engine.runner import ModelRunner
from jaxkv.errors import ContextLengthError, JaxKVError
from jaxkv.models.loading import Model
from jaxkv.sampling import make_sampler

PREFILL_CHUNK = 512  # tokens per prefill piece at most; chosen by eval/bench/prefill.py (README)
FIRST_TOKEN_KEY = 1 << 30  # the first reply token is drawn with fold_in(key, this)


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
        self.kv = KVManager.create(
            model,
            rows=rows,
            max_positions=P,
            num_slots=num_slots,
            kv_quant=kv_quant,
            kv_memory_bytes=kv_memory_bytes,
            kv_page_share=kv_page_share,
            layer_lists=layer_lists,
            kv_rotate=kv_rotate,
            reclaim=reclaim,
        )
        pool = self.kv.pool
        self.token_budget = int(token_budget) if token_budget is not None else buckets.token_budget(self.prefill_chunk, rows)
        if self.token_budget < max(self.prefill_chunk, rows) or self.token_budget < rows + (self.prefill_chunk if pool.whole_chunks else 1):
            raise JaxKVError(
                f"token_budget {self.token_budget} cannot hold a decode token of each of {rows} rows beside a prefill "
                f"piece{' of a whole chunk' if pool.whole_chunks else ''} (prefill_chunk {self.prefill_chunk})"
            )
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

    reclaim = property(
        lambda self: self.kv.reclaim,
        lambda self, fn: setattr(self.kv, "reclaim", fn),
        doc="The radix cache's eviction the KV manager calls.",
    )

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

    # -- run to completion (``jaxkv.engine.oneshot``) -----------------------------------
    def prefill(self, rows: Sequence[int], token_lists, **options):
        """Append ``token_lists[i]`` to ``rows[i]`` and return the new tokens' logits
        (``jaxkv.engine.oneshot.prefill``: its options and what comes back)."""
        return oneshot.prefill(self, rows, token_lists, **options)

    def decode(self, rows: Sequence[int], first_tokens: Sequence[int], n_steps: int, **options):
        """Feed ``first_tokens`` and decode up to ``n_steps`` tokens per row; returns
        ``(tokens, logits)`` (``jaxkv.engine.oneshot.decode``: its options)."""
        return oneshot.decode(self, rows, first_tokens, n_steps, **options)

    # -- programs and spliced steps ------------------------------------------------------
    def warmup(self, decode_chunk: int, **options) -> int:
        """Compile every program of ``shape_set`` (``jaxkv.engine.warmup.warmup``)."""
        from jaxkv.engine.warmup import warmup

        return warmup(self, decode_chunk, **options)

    def splice_prefill(self, row: int, plan, *, mode: str = "append"):
        """Run one ``jaxkv.splice.SplicePlan`` on ``row`` (``jaxkv.engine.splicing``)."""
        from jaxkv.engine.splicing import splice_prefill

        return splice_prefill(self, row, plan, mode=mode)


from jaxkv.engine import oneshot  # noqa: E402  (its entry points build an Engine)
from jaxkv.engine.oneshot import generate, score_logits  # noqa: E402

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
