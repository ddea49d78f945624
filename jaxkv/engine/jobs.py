"""A request's work on the engine, as the scheduler and the runner see it.

A ``PrefillJob`` appends tokens to a row, a piece per step; a ``DecodeJob`` decodes
up to ``n_steps`` tokens of a row; a ``SpliceJob`` is one spliced step of segment
reuse (``jaxkv.engine.splicing``), which the scheduler runs between steps. A turn program (``jaxkv.serving.pipeline``)
makes a job, the scheduler starts it (``Engine.start``: slots are allocated then,
before anything runs) and packs pieces of started jobs into steps
(``jaxkv.engine.packing``), and the runner (``jaxkv.engine.runner``) executes each
step and writes what came back into the jobs. A job says what it wants back
besides tokens; the step computes nothing else.

Invariants: a job's ``row`` is open for as long as the job runs; ``done`` /
``fed`` count tokens written to the pool and recorded in the row; a prefill job's
slots are allocated when it starts and either written or released
(``KVManager.abandon_prefill``).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class KVSource:
    """A prompt's K/V computed elsewhere, for an *imported* prefill
    (``PrefillJob.kv_source``): the pool stores these rows exactly as a prefill
    stores the K/V it computes, and no forward runs.

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


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How a token is drawn: ``temperature`` (0: greedy), ``top_k``, ``top_p``, and
    the key ``fold_in(key, index)`` (``jaxkv.sampling.RowSamplers`` holds the first three
    per row)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    key: jax.Array | None = None
    index: int = 0

    @property
    def settings(self) -> tuple:
        return (self.temperature, self.top_k, self.top_p)


GREEDY = Sampling()


@dataclasses.dataclass(eq=False)
class PrefillJob:
    """One row's prefill, advanced a piece per step.

    Attributes:
      row: the cache row. tokens: ids to append ``[n]``.
      logits: what logits come back: ``"last"`` (the last token's, ``[V]``),
        ``"all"`` (every token's, ``[n, V]``) or None.
      q_idx_X: indices into ``tokens`` whose post-RoPE queries come back (or None).
      wide_capture: the job's steps return the queries of every flat token they run
        (``ModelRunner.capture_rows``), so a piece is never cut to the step's
        capture cap: a job that captures every token (KVzip's reconstruction pass)
        runs in steps of the prefill chunk, not of ``runner.CAPTURE_ROWS``.
      attn_mass: accumulate the attention mass each position receives.
      kv_bits: per-token bits (2 or 4) on a quantized pool (None: its token kind).
      kv_source: a ``KVSource``: the job writes its K/V instead of running the
        model (an imported prefill).
      sampling: how the token after the last one is drawn (the reply's first
        token), in the step that computes its logits; ``first_token`` holds it.
    Filled as it runs: slots (allocated by ``Engine.start``), kv_plan (a quantized
    pool's ``WritePlan``), done (tokens written), the logits pieces, q_rows
    ``[L, X, Hq, D]``, mass ``[seq_len]`` (positions of the whole row after the
    job; mean over layers and query heads, summed over the job's queries).
    """

    row: int
    tokens: np.ndarray
    logits: str | None = "last"
    q_idx_X: np.ndarray | None = None
    attn_mass: bool = False
    wide_capture: bool = False
    kv_bits: np.ndarray | None = None
    kv_source: KVSource | None = None
    sampling: Sampling = GREEDY
    slots: np.ndarray | None = None
    kv_plan: object = None
    done: int = 0
    logit_pieces: list = dataclasses.field(default_factory=list)
    q_rows: np.ndarray | None = None
    mass: np.ndarray | None = None
    first_token: int | None = None

    def __post_init__(self):
        self.tokens = np.asarray(self.tokens, np.int32).reshape(-1)
        if self.q_idx_X is not None:
            self.q_idx_X = np.asarray(self.q_idx_X, np.int64).reshape(-1)

    @property
    def started(self) -> bool:
        return self.slots is not None

    @property
    def finished(self) -> bool:
        return self.done >= self.tokens.size

    def result_logits(self) -> np.ndarray | None:
        """``[n, V]`` (``logits="all"``), the last token's ``[V]`` (``"last"``, and an
        imported prefill's: its source's), or None."""
        if not self.logit_pieces:
            return None
        return np.concatenate(self.logit_pieces) if self.logits == "all" else self.logit_pieces[-1][-1]


@dataclasses.dataclass(eq=False)
class DecodeJob:
    """One row's decode of up to ``n_steps`` tokens.

    Attributes:
      row: the cache row; first_token: the token fed at the first step.
      n_steps: tokens to decode at most (the row may stop earlier at a stop token).
      sampling: the row's sampler and key; step ``s`` of the job draws with
        ``fold_in(key, sampling.index + s)`` (``index``: the step's place in the reply).
      stop_ids: tokens that end the row (the stop token is emitted).
      forced: teacher-forced tokens fed after the first step (or None).
      return_logits / query_rows / attn_mass: what comes back per step.
    Filled as it runs: tokens (sampled), fed (tokens written), stopped (a stop
    token came), logits ``[n, V]`` pieces, q_rows ``[n, L, Hq, D]`` pieces, mass
    ``[seq_len]`` (per position, for this job's steps).
    """

    row: int
    first_token: int
    n_steps: int
    sampling: Sampling = GREEDY
    stop_ids: tuple = ()
    forced: list | None = None
    return_logits: bool = False
    query_rows: bool = False
    attn_mass: bool = False
    tokens: list = dataclasses.field(default_factory=list)
    fed: int = 0
    stopped: bool = False
    logits: list = dataclasses.field(default_factory=list)
    q_rows: list = dataclasses.field(default_factory=list)
    mass: np.ndarray | None = None
    started: bool = False

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

    @property
    def step_index(self) -> int:
        """The index folded into the key for this job's next step."""
        return self.sampling.index + self.fed


@dataclasses.dataclass(eq=False)
class SpliceJob:
    """One spliced step of segment reuse (``Engine.splice_prefill``).

    Attributes:
      row: the engine row; plan: the ``jaxkv.splice.SplicePlan``; mode: ``"append"``,
      ``"rewrite"`` or ``"probe"``; result: ``(logits [Y, V], resid [A, M])`` once run.
    """

    row: int
    plan: object
    mode: str = "append"
    result: tuple | None = None

    @property
    def finished(self) -> bool:
        return self.result is not None
