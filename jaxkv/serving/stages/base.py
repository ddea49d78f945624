"""The stage interface: how a KV-cache mechanism plugs into a turn.

A stage is one mechanism (retention, RepairKV, and later quantization or segment
reuse) seen from the turn pipeline (``jaxkv.serving.pipeline``). A session builds
its stages from its options through ``STAGES``; the pipeline calls their hooks
at fixed points of every turn, in ascending ``order``, and never needs to know
what a stage does. A stage object belongs to one session (a session runs one
turn at a time), so it may keep per-turn state on itself between ``begin`` and
``end``.

Hooks (every one optional; ``turn`` is the ``pipeline.Turn``):

* ``reuse_cut(turn, slots_P) -> int | None``: before the row opens (and when
  admission pins the reuse): the first of the matched positions the stage wants
  prefilled again rather than reused (TriAxialKV's rewrite from float); the turn
  reuses up to the smallest cut, and its radix insert hands the tree the fresh
  slots from there on.
* ``begin(turn)``: the row is open and the matched prefix installed; set up.
* ``prompt_capture(turn) -> Capture``: what this stage needs from the prompt's
  prefill: post-RoPE query rows at absolute positions, attention mass.
* ``before_prefill(turn, job) -> handler | None``: may annotate the prompt's
  ``PrefillJob`` (``kv_bits``) or take it over by returning a generator that runs
  the prefill itself (e.g. by splicing reused KV) and returns a job-like result.
* ``after_prefill(turn, captured) -> program | None``: after the prompt is
  prefilled (compression event, repair). Stages run in order, so repair sees the
  compressed request. A stage that needs engine work first (KVzip's
  reconstruction passes: prefills of the row it truncates again) returns a
  generator that yields engine jobs, as a turn program does; the pipeline runs it
  to its end before the next stage's hook.
* ``decode_interval(turn) -> int | None`` and ``decode_capture(turn) -> Capture``:
  decode in chunks of at most this many tokens, capturing these features.
* ``after_decode_chunk(turn, captured, more)``: after each decode chunk; ``more``
  says whether the reply goes on.
* ``on_evict(turn, evicted)``: rows are leaving the device (``turn.evict``); the
  K/V are host copies, read before the slots were released.
* ``after_insert(turn, filled)``: the turn entered the radix cache; ``filled``
  are positions whose holes the cache took over from this request.
* ``end(turn)``: always called once the turn ends (finished, failed or
  cancelled); must not raise for a half-run turn.

Attributes a stage may set: ``wants_evicted_rows`` (the pipeline gathers evicted
K/V to the host only if some stage wants them), ``edits_holes`` (the request
may hold holes its turns create, so the radix cache syncs them after insert).

Registering: ``register(name, order, factory)`` where ``factory(session,
options, built) -> Stage | None`` takes the options it owns out of the dict
(``pop``) and returns None when the session does not use the mechanism;
``built`` are the session's stages of lower order (repair checks the retention
stage it depends on). Options left over when
every factory has run raise ``OptionError``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np


@dataclasses.dataclass
class Capture:
    """Features a stage asks of a prefill or decode chunk.

    Attributes:
      q_positions: absolute positions whose post-RoPE queries are wanted (prompt
        prefill only; positions before the prefilled suffix are ignored).
      query_rows: the queries of every decoded token (decode chunks).
      attn_mass: attention mass per position (added to ``RequestState.mass``).
    """

    q_positions: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    query_rows: bool = False
    attn_mass: bool = False

    @staticmethod
    def union(captures) -> "Capture":
        caps = list(captures)
        pos = np.unique(np.concatenate([np.asarray(c.q_positions, np.int64) for c in caps] or [np.zeros(0, np.int64)]))
        return Capture(pos, any(c.query_rows for c in caps), any(c.attn_mass for c in caps))


@dataclasses.dataclass
class PrefillLogits:
    """A prompt prefill's result as the reply reads it when only its logits are at
    hand: a prefill a stage ran itself (spliced), or an evaluation's branch. No
    first token was drawn in a step (``Turn.generate`` draws it from ``logits``),
    no query rows, no attention mass."""

    logits: np.ndarray
    first_token: None = None
    q_rows: None = None
    mass: None = None

    def result_logits(self) -> np.ndarray:
        return self.logits


class Stage:
    """Base class with every hook a no-op (see the module docstring)."""

    name = "stage"
    order = 50
    wants_evicted_rows = False
    edits_holes = False

    def begin(self, turn) -> None: ...

    def prompt_capture(self, turn) -> Capture:
        return Capture()

    def reuse_cut(self, turn, slots_P: np.ndarray) -> int | None:
        """The first cached position this stage wants prefilled again (``slots_P``:
        the slots the turn would reuse), or None. The turn reuses the cache up to the
        smallest cut, and its radix insert gives the tree the fresh slots from there
        (``Turn.insert``)."""
        return None

    def before_prefill(self, turn, job):
        return None

    def after_prefill(self, turn, captured):
        return None

    def decode_interval(self, turn) -> int | None:
        return None

    def decode_capture(self, turn) -> Capture:
        return Capture()

    def after_decode_chunk(self, turn, captured, more: bool) -> None: ...

    def on_evict(self, turn, evicted) -> None: ...

    def after_insert(self, turn, filled: np.ndarray) -> None: ...

    def end(self, turn) -> None: ...


Factory = Callable[[Any, dict, list], "Stage | None"]


@dataclasses.dataclass(frozen=True)
class StageEntry:
    name: str
    order: int
    factory: Factory


STAGES: dict[str, StageEntry] = {}


def register(name: str, order: int, factory: Factory) -> StageEntry:
    """Make a mechanism available to sessions (see the module docstring)."""
    from jaxkv.errors import ConfigError

    if name in STAGES:
        raise ConfigError(f"stage {name!r} registered twice")
    entry = STAGES[name] = StageEntry(name, int(order), factory)
    return entry


def build_stages(session, options: dict) -> list[Stage]:
    """The session's stages, in order; unclaimed options raise ``OptionError``."""
    from jaxkv.errors import OptionError

    left = dict(options)
    stages = []
    for entry in sorted(STAGES.values(), key=lambda e: e.order):
        stage = entry.factory(session, left, list(stages))
        if stage is not None:
            stage.order = entry.order
            stages.append(stage)
    if left:
        raise OptionError(f"unknown session option(s) {', '.join(sorted(left))}")
    return stages
