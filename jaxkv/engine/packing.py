"""Packing a step: which rows, and how many tokens of each, under the token budget.

This is a scheduling decision (vLLM V1's scheduler makes it and hands the runner
``num_scheduled_tokens`` per request), kept apart from the runner that executes
the step. ``pack_step`` takes the started jobs that wait for the engine and
returns a ``ScheduledStep``:

* the next token of every unfinished decode job first, so a decoding row never
  waits behind a prompt;
* then a piece of each unfinished prefill job, in order, while the budget lasts
  (chunked prefill, as vLLM V1 and Sarathi-Serve schedule). A piece is at most
  ``chunk`` tokens; a pool that writes whole chunks (a quantized pool's INT2 pages
  are planned per chunk) takes a job's next chunk whole or waits for the next step;
* a step returns the queries of at most ``max_captured`` flat tokens (None: no
  limit), so a piece whose job captures more is cut before the first that does
  not fit; a piece of a ``wide_capture`` job lifts the limit for its step (the
  step returns every flat token's queries, ``ModelRunner.capture_rows``).

The serving scheduler (``jaxkv.serving.scheduler``) packs every engine step;
``Engine.step`` packs for callers that drive the engine directly.

Invariant: a scheduled step holds at most ``rows`` step rows and at most
``budget`` tokens, and every piece is a prefix of what its job has left.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from jaxkv.errors import JaxKVError


@dataclasses.dataclass(frozen=True)
class ScheduledStep:
    """One step's work: ``decode``: decode jobs, one token each; ``pieces``:
    ``(prefill job, tokens)`` in flat-batch order after the decode tokens."""

    decode: tuple
    pieces: tuple

    @property
    def tokens(self) -> int:
        return len(self.decode) + sum(n for _, n in self.pieces)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.pieces


def piece_size(job, budget: int, *, chunk: int, whole_chunks: bool) -> int:
    """Tokens of ``job``'s next piece within ``budget`` (0: none this step)."""
    left = job.tokens.size - job.done
    n = min(left, chunk, budget)
    if whole_chunks and n < min(left, chunk - job.done % chunk):
        return 0
    return n


def captured_in(job, n: int) -> np.ndarray:
    """Indices into ``job.tokens`` of the captured queries among its next ``n`` tokens."""
    if job.q_idx_X is None:
        return np.zeros(0, np.int64)
    q = np.sort(job.q_idx_X)
    return q[(q >= job.done) & (q < job.done + n)]


def pack_step(
    prefill_jobs: Sequence,
    decode_jobs: Sequence,
    *,
    budget: int,
    rows: int,
    chunk: int,
    whole_chunks: bool,
    max_captured: int | None = None,
) -> ScheduledStep:
    """The next step over the unfinished jobs (module docstring). ``JaxKVError``
    when no prefill piece fits and no decode token is due, or when more decode
    jobs than rows are given."""
    decode = tuple(j for j in decode_jobs if not j.finished)
    if len(decode) > rows:
        raise JaxKVError(f"{len(decode)} decode jobs in one step; the engine has {rows} rows")
    left = budget - len(decode)
    room = None if max_captured is None else max_captured - sum(bool(j.query_rows) for j in decode)
    pieces = []
    waiting = [j for j in prefill_jobs if not j.finished]
    for job in waiting:
        if len(pieces) + len(decode) == rows or left <= 0:
            break
        n = piece_size(job, left, chunk=chunk, whole_chunks=whole_chunks)
        if job.wide_capture and n:
            room = None  # this step returns every flat token's queries
        if room is not None and n:
            wanted = captured_in(job, n)
            if wanted.size > room:
                n = int(wanted[room]) - job.done  # up to the first captured token that does not fit
            room -= captured_in(job, n).size
        if n:
            pieces.append((job, n))
            left -= n
    if not pieces and not decode and waiting:
        raise JaxKVError(f"no prefill piece fits a step of {budget} tokens")
    return ScheduledStep(decode, tuple(pieces))
