"""The turn pipeline: one request of a session, from rendered prompt to radix insert.

A turn runs these steps, in this order (``chat_turn`` / ``replay_turn``):

    render (Session, caller's thread)
      -> radix match (holes included; path locked)          Turn.open
      -> stages.begin
      -> prefill the unmatched suffix, capturing what stages asked for
                                                             Turn.prefill_prompt
      -> stages.after_prefill: compression event, repair     (stage order)
      -> decode in chunks; stages.after_decode_chunk between them
                                                             Turn.generate
      -> parse (Session)
      -> radix insert, holes synced; stages.after_insert     Turn.insert
      -> stages.end, row closed, radix unlocked, metrics     Turn.close

A turn program is a **generator**: everything on the host runs inline, and the
device work is *yielded* to the scheduler: the engine's jobs
(``jaxkv.engine.jobs``): ``PrefillJob`` and ``DecodeJob``, which the scheduler
packs with other turns' into batched steps, and ``SpliceJob`` (a segment-reuse
spliced step), which it runs between steps; it sends the finished job back. Run alone,
``run_to_completion`` is a scheduler with one turn. So a turn reads top to bottom
like one request, while many of them share the engine's batched steps.

Stages (``jaxkv.serving.stages``) plug in at the hooks named above; their
interface is documented in ``stages/base.py``. The pipeline owns what every
stage shares: the row, its ``RequestState`` (tokens, phases, pins, mass, slot
map), the KV accounting, ``evict`` (which hands evicted rows to the stages that
want them before the engine releases their slots), and the radix cache calls.

Invariants: a turn holds one engine row and one radix lock from ``open`` to
``close``, and ``close`` runs on every exit path (return, error, cancellation:
the generator's ``finally``); at least one prompt token is always prefilled (its
logits start the reply), so a fully cached prompt reuses all but its last token;
only the scheduler thread runs turn programs, so host bookkeeping is never
touched by two threads at once.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Generator

import jax
import numpy as np

from jaxkv.cache.radix import common_prefix_length
from jaxkv.engine import FIRST_TOKEN_KEY
from jaxkv.engine.jobs import DecodeJob, PrefillJob, Sampling
from jaxkv.sampling import RowSamplers, make_sampler, sample_row
from jaxkv.serving.stages.base import Capture


@dataclasses.dataclass
class Captured:
    """What a prefill or decode chunk brought back for the stages.

    Attributes:
      start, end: positions of the new tokens ``[start, end)``.
      q_positions / q_rows_LXHD: positions whose queries were captured and the
        queries ``[L, X, Hq, D]`` (decode: every fed token).
      mass_P: attention mass the chunk added per position (or None).
      phases: phases of the new tokens (decode chunks).
    """

    start: int
    end: int
    q_positions: np.ndarray
    q_rows_LXHD: np.ndarray | None
    mass_P: np.ndarray | None = None
    phases: np.ndarray | None = None

    def q_rows(self, positions) -> np.ndarray:
        """Queries at ``positions`` (each must have been captured) ``[L, X, Hq, D]``."""
        index = {int(p): i for i, p in enumerate(self.q_positions)}
        return self.q_rows_LXHD[:, [index[int(p)] for p in positions]]


@dataclasses.dataclass
class Evicted:
    """Rows a layout plan takes off the device, as the stages see them.

    Attributes:
      plan: the ``LayoutPlan``; positions_M / slots_M / tokens_M: what leaves;
      scores_M: the compression score that evicted each row; k_LMKD / v_LMKD:
      host copies of their K/V (None unless a stage wants evicted rows).
    """

    plan: Any
    positions_M: np.ndarray
    tokens_M: np.ndarray
    scores_M: np.ndarray
    k_LMKD: np.ndarray | None
    v_LMKD: np.ndarray | None


@dataclasses.dataclass
class TurnResult:
    """One replayed assistant turn.

    Attributes:
      prompt_ids: the rendered request (history + generation prompt).
      prefix_hit: prompt tokens reused from the radix cache.
      prompt_logits: ``[len(prompt) - prefix_hit, V]`` logits of the prefilled
        suffix (``return_logits=True``), or its last row ``[1, V]``
        (``return_logits="reply"``).
      target_ids / target_logits: the recorded assistant message's tokens and
        their teacher-forced logits (``return_logits``).
      generated: the parsed reply generated at this turn (``generate=True``).
      reply_ids: its token ids. reply_margins: for each of them, the top-1 minus
        top-2 logit of the distribution it was drawn from (``reply_margins=True``):
        how near a greedy tie each choice was.
      compressions: the session's compression events before the recorded reply
        was fed (this turn's own prompt event included): 0 while the cache is
        still the full cache.
    """

    prompt_ids: np.ndarray
    prefix_hit: int
    prompt_logits: np.ndarray | None = None
    target_ids: np.ndarray | None = None
    target_logits: np.ndarray | None = None
    generated: dict | None = None
    reply_ids: list | None = None
    reply_margins: np.ndarray | None = None
    compressions: int = 0


# ============================================================================ the turn
class Turn:
    """One request's life on the engine (see the module docstring).

    Attributes:
      session, server, engine: where it runs. rendered: the prompt.
      row / req: the engine row and its ``RequestState``.
      reused: prompt tokens taken from the radix cache (holes included).
      refreshed_from: where a stage cut the matched prefix short
        (``Stage.reuse_cut``; None: it did not): the matched tokens from there on
        are prefilled again, and the tree takes their fresh slots at insert.
      owner / makes_holes / private_from: the session's radix owner; whether
        its stages can make holes (a turn that cannot reads public nodes only,
        so it never attends over a hole); the first position this turn read
        from its owner's private nodes or evicted (None: none), where its
        insert turns private (``jaxkv.cache.radix``).
      index: the request's index in its session (0-based).
      uncompressed: request size without pruning (raw KV reads, peak request tokens).
      metrics: this request's ``RequestMetrics``.
      stages: the session's stages.
      memo: what stages computed from the row as it stands, keyed by what it
        depends on (KVzip's reconstruction passes), so an evaluation's cells
        branched from one prefill compute it once.
    """

    def __init__(self, session, rendered):
        self.session = session
        self.server = session.server
        self.engine = self.server.engine
        self.radix = self.server.radix_for(getattr(session, "cache_namespace", None))  # the session's view of the cache
        self.owner = session.cache_owner  # whose private radix nodes (holes) this turn may read and write
        self.makes_holes = any(stage.edits_holes for stage in session.stages)  # else it reads public nodes only
        self.private_from: int | None = None  # first position read from a private path or evicted (radix docstring)
        self.rendered = rendered
        self.stages = session.stages
        self.row: int | None = None
        self.handle = None
        self.reused = 0
        self.refreshed_from: int | None = None  # a stage's reuse cut: the tree takes the turn's slots from here
        self.ignore_eos = False  # decode past the model's stop tokens (Session.start_chat)
        self.index = -1
        self.uncompressed = int(rendered.ids.size)
        self.metrics = None
        self.listener = None  # listener(ids): newly generated tokens (streaming)
        self.record_margins = bool(getattr(session, "record_margins", False))  # each reply token's top-2 logit margin
        self.reply_margins: list[float] = []
        self.stop_requested = False  # end the reply at the next decode-chunk boundary (``request_stop``)
        self._sent = 0  # tokens of the current decode job already passed to the listener
        self.memo: dict = {}
        self._began: list = []

    # -- open / close ------------------------------------------------------------------
    def open(self) -> None:
        """Radix match, open the row with the matched prefix, tag it, begin stages."""
        ids = self.rendered.ids
        match = self.radix.match(ids, owner=self.owner if self.makes_holes else None)
        self.handle = match.handle
        reused = self._reuse_limit(match.length)
        self.reused = self._reuse_cut(reused, match.slots)
        self.refreshed_from = self.reused if self.reused < reused else None
        self.private_from = match.private_from if match.private_from < self.reused else None
        try:
            self.row = self.engine.open_row(match.slots[: self.reused], ids[: self.reused])
        except Exception:
            self.radix.unlock(self.handle)
            self.handle = None
            raise
        self.req = self.engine.row_state[self.row]
        self._tag_prompt(0, self.reused)
        session = self.session
        self.index = session._requests
        session._requests += 1
        self.metrics = session.metrics.start_request(
            prompt_tokens=int(ids.size), prefix_hit_tokens=self.reused, session_id=session.session_id
        )
        self.server.counters.update(prompt_tokens=int(ids.size), cached_tokens=self.reused)
        self._repairs0 = len(session.repairs)
        for stage in self.stages:
            self._began.append(stage)
            stage.begin(self)

    def pin_reuse(self):
        """Before admission (scheduler thread): how many prompt tokens ``open`` will
        surely take from the radix cache, with a lock on them so that making room
        for this turn cannot evict them. That is the prefix this session's
        previous request cached that the prompt repeats and the tree still holds
        (``_reuse_limit`` never reuses less). Returns ``(tokens, handle)``; the
        caller unlocks the handle (None: nothing locked) before ``open``."""
        previous = self.session._cached_ids
        ids = self.rendered.ids
        if previous is None or ids.size < 2:
            return 0, None
        match = self.radix.match(ids, owner=self.owner if self.makes_holes else None)
        reused = min(match.length, common_prefix_length(previous, ids), ids.size - 1)
        return self._reuse_cut(reused, match.slots), match.handle

    def _reuse_cut(self, reused: int, slots) -> int:
        """``reused`` cut back to the first position a stage wants prefilled again
        (``Stage.reuse_cut``)."""
        cuts = [stage.reuse_cut(self, np.asarray(slots[:reused])) for stage in self.stages]
        return min([reused] + [int(c) for c in cuts if c is not None])

    def _reuse_limit(self, matched: int) -> int:
        """How many of the ``matched`` cached prompt tokens this turn reuses.

        All but the last (its logits start the reply). A turn whose stages
        observe its prefill (query rows, attention mass: a retention policy's
        inputs) reuses past its own session's history only inside the protected
        prefix and before the first row it observes, so it observes exactly what
        it would observe alone, and every decision its stages make is the one
        it would make alone (other sessions' cached prefixes only save it the
        prefill of what its policy never looks at).
        """
        ids = self.rendered.ids
        limit = min(matched, ids.size - 1)
        previous = self.session._cached_ids
        own = min(common_prefix_length(previous, ids) if previous is not None else 0, ids.size - 1)
        if limit <= own:
            return limit
        self.reused = own  # the capture this turn would ask for alone
        capture = Capture.union(stage.prompt_capture(self) for stage in self.stages)
        if not capture.q_positions.size and not capture.attn_mass:
            return limit
        first_observed = int(capture.q_positions.min()) if capture.q_positions.size else limit
        return min(limit, max(own, min(self.rendered.spans.protected_prefix[1], first_observed)))

    def close(self) -> None:
        """End stages, close the row, unlock the radix path, end the request's
        metrics. Safe on a turn that failed half-way."""
        try:
            for stage in reversed(self._began):
                stage.end(self)
        finally:
            self._began = []
            try:
                if self.row is not None:
                    self.engine.close_row(self.row)
                    self.row = None
            finally:
                if self.handle is not None and self.handle.locked:
                    self.radix.unlock(self.handle)
                if self.metrics is not None and self.metrics.open:
                    self.session.metrics.end_request(self.metrics)
                    reports = self.session.repairs[self._repairs0 :]
                    self.server.counters["repaired_rows"] += sum(len(r.promoted_positions) for r in reports)

    # -- tags ------------------------------------------------------------------------
    def pinned_prompt(self) -> np.ndarray:
        """Pins of the prompt's positions: the protected prefix and (unless the
        session lets events evict inside it) the actionable query."""
        n = self.rendered.ids.size
        pinned = np.zeros(n, bool)
        spans = [self.rendered.spans.protected_prefix]
        if self.session.protect_query:
            spans.append(self.rendered.spans.actionable_query)
        for a, b in spans:
            pinned[a:b] = True
        return pinned

    def _tag_prompt(self, start: int, end: int) -> None:
        """Tag positions ``[start, end)`` of the prompt (before any event of this
        turn, so positions are still the rendered ones)."""
        a, b = self.rendered.spans.actionable_query
        query = (np.arange(start, end) >= a) & (np.arange(start, end) < b)
        self.req.tag(start, phase=np.asarray(self.rendered.phase, np.int32)[start:end], pinned=self.pinned_prompt()[start:end], query=query)

    # -- services for stages ------------------------------------------------------
    def evict(self, plan, scores_M) -> Evicted:
        """Apply a layout plan: hand the evicted rows to the stages that want them,
        then let the engine release them."""
        pos = np.asarray(plan.evicted_positions, np.int64)
        tokens = np.asarray(self.req.tokens, np.int64)[pos]
        wants = [s for s in self.stages if s.wants_evicted_rows] if pos.size else []
        dropped = pos
        if plan.layer_keep is not None and not plan.renumbered:  # per-layer sets: a position one layer drops counts too
            before = self.req.layer_mask(plan.layer_keep.shape[0])
            dropped = np.flatnonzero((before & ~plan.layer_keep).any(axis=0))
        kv = self.engine.kv.apply_layout(self.row, plan, keep_evicted=bool(wants))
        if dropped.size:  # every later token attends over these holes: the rest is the owner's
            first = int(dropped.min())
            self.private_from = first if self.private_from is None else min(self.private_from, first)
        self.server.counters["evicted_tokens"] += int(pos.size)
        evicted = Evicted(plan, pos, tokens, np.asarray(scores_M, np.float32), *(kv or (None, None)))
        for stage in wants:
            stage.on_evict(self, evicted)
        return evicted

    def emit(self, ids) -> None:
        """Pass newly generated tokens to the listener, if any."""
        if self.listener is not None and len(ids):
            self.listener([int(t) for t in ids])

    def progress(self, job) -> None:
        """A decode job advanced (called by the scheduler after each engine step):
        emit the tokens it sampled since the last call; if a stop was requested,
        end the job here (its next steps never run, no slot is taken for them)."""
        new = job.tokens[self._sent :]
        self._sent = len(job.tokens)
        self.emit(new)
        if self.stop_requested and not job.finished:
            job.n_steps = job.fed

    def request_stop(self) -> None:
        """End the reply early, keeping the turn: decoding stops at the next
        decode-chunk boundary (at once when asked from the listener, which runs
        between chunks), then the turn parses and enters the radix cache as usual.
        Any thread may call it."""
        self.stop_requested = True

    def observe_live(self) -> None:
        """Report the request's live KV size to the metrics (after an edit)."""
        self.metrics.on_live(len(self.req.live))

    @property
    def seq_len(self) -> int:
        return self.req.seq_len

    def actionable_kind(self) -> str | None:
        """``"user"`` or ``"tool"``: the kind of the latest actionable message."""
        kinds = [m.kind for m in self.rendered.messages if m.kind in ("user", "tool")]
        return kinds[-1] if kinds else None

    # -- prefill -----------------------------------------------------------------------
    def prefill_prompt(self, *, logits: str | None = None, sampling: Sampling | None = None) -> Generator:
        """Prefill the unmatched prompt suffix (capturing what the stages asked
        for), then run the stages' ``after_prefill`` hooks. Returns the prefill job:
        its ``first_token`` is the reply's first token, drawn with ``sampling`` in
        the step that computed the prompt's last logits (None after a spliced
        prefill, whose logits ``generate`` samples), and ``result_logits()`` the
        logits asked for (``logits``: ``"all"``, ``"last"`` or None)."""
        ids = self.rendered.ids
        start = self.reused
        capture = Capture.union(stage.prompt_capture(self) for stage in self.stages)
        q_pos = capture.q_positions[capture.q_positions >= start]
        if self.record_margins and logits is None:
            logits = "last"
        job = PrefillJob(
            self.row,
            ids[start:],
            logits=logits,
            q_idx_X=(q_pos - start) if q_pos.size else None,
            attn_mass=capture.attn_mass,
            sampling=sampling or Sampling(index=FIRST_TOKEN_KEY),
        )
        handler = None
        for stage in self.stages:
            handler = stage.before_prefill(self, job) or handler
        job = yield from (handler if handler is not None else self.run(job))
        self._tag_prompt(start, self.req.seq_len)
        captured = Captured(start, self.req.seq_len, q_pos, job.q_rows if q_pos.size else None, self._add_mass(job.mass))
        for stage in self.stages:
            work = stage.after_prefill(self, captured)
            if work is not None:  # engine work of the stage's own (KVzip's reconstruction passes)
                yield from work
        self.observe_live()  # post-pruning live KV of the prompt (and promoted rows)
        return job

    def prefill(self, ids, *, all_logits: bool = False, phase=None) -> Generator:
        """Prefill extra tokens (a teacher-forced reply) with no stage hooks;
        ``phase`` tags them. Returns their logits (``[n, V]`` with ``all_logits``,
        else the last token's ``[V]``)."""
        start = self.req.seq_len
        job = yield from self.run(PrefillJob(self.row, np.asarray(ids, np.int32), logits="all" if all_logits else "last"))
        self.uncompressed += self.req.seq_len - start
        if phase is not None:
            self.req.tag(start, phase=phase)
        return job.result_logits()

    def run(self, work) -> Generator:
        """Yield one engine job for this turn's row; returns it, finished. Slots of a prefill the turn leaves
        unfinished (cancelled, failed) go back."""
        try:
            yield work
        finally:
            if isinstance(work, PrefillJob) and work.started and not work.finished:
                self.engine.kv.abandon_prefill(work)
        return work

    def _add_mass(self, mass_LHP):
        if mass_LHP is None:
            return None
        mass_P = np.asarray(mass_LHP).mean(axis=(0, 1)) if np.ndim(mass_LHP) == 3 else np.asarray(mass_LHP)
        self.req.add_mass(mass_P)
        return mass_P

    @property
    def stop_token_ids(self):
        """The token ids that end this turn's reply (none with ``ignore_eos``)."""
        return () if self.ignore_eos else self.server.stop_token_ids

    # -- decode ------------------------------------------------------------------------
    def generate(self, prefilled, n_new: int, *, temperature=0.0, top_k=None, top_p=None, seed: int = 0) -> Generator:
        """Sample the reply: its first token is the prompt prefill's (``prefilled``,
        the job ``prefill_prompt`` returned; a spliced prefill's logits are sampled
        here, with the same key), the rest come in decode chunks (of the stages'
        decode interval, else all at once). Returns its ids (ending with a stop
        token when one came)."""
        if n_new <= 0:
            return []
        make_sampler(temperature, top_k, top_p)  # validates
        key = jax.random.key(seed)
        first = prefilled.first_token
        if first is None:
            first = int(
                sample_row(
                    np.asarray(prefilled.result_logits(), np.float32), key, FIRST_TOKEN_KEY, RowSamplers.of([(temperature, top_k, top_p)])
                )
            )
        reply = [first]
        if self.record_margins:
            self.reply_margins = list(_top2_margins(np.asarray(prefilled.result_logits())[None]))
        self.emit(reply)  # (a listener may request a stop already)
        stops = self.stop_token_ids
        intervals = [i for i in (stage.decode_interval(self) for stage in self.stages) if i]
        interval = min(intervals) if intervals else n_new
        capture = Capture.union(stage.decode_capture(self) for stage in self.stages) if intervals else Capture()
        remaining = n_new - 1
        while reply[-1] not in stops and remaining > 0 and not self.stop_requested:
            n = min(interval, remaining)
            raw0, eff0, start = self.uncompressed, self.req.reads_per_layer(), self.req.seq_len  # per-layer sets: a layer's reads
            self._sent = 0
            job = yield from self.run(
                DecodeJob(
                    self.row,
                    reply[-1],
                    n,
                    Sampling(temperature, top_k, top_p, key, len(reply) - 1),
                    tuple(sorted(stops)),
                    return_logits=self.record_margins,
                    query_rows=capture.query_rows,
                    attn_mass=capture.attn_mass,
                )
            )
            if self.record_margins and job.logits:
                self.reply_margins += list(_top2_margins(np.concatenate(job.logits)))
            self.progress(job)  # whatever the scheduler has not streamed yet
            tokens = job.tokens
            for s in range(1, len(tokens) + 1):  # each step attends to everything so far + itself
                self.metrics.on_decode_step(raw_attended=raw0 + s, effective_attended=eff0 + s)
            fed = self.req.tokens[start:]
            phases = self.rendered.scanner.feed(fed).phase.astype(np.int32)
            self.req.tag(start, phase=phases)
            self.uncompressed += len(fed)
            reply += tokens
            remaining -= n
            if intervals:  # a stage's decode interval: its hook runs after every chunk, whatever the chunk captured
                q = np.concatenate(job.q_rows).transpose(1, 0, 2, 3) if job.q_rows else None  # [L, n, Hq, D]
                captured = Captured(start, self.req.seq_len, np.arange(start, self.req.seq_len), q, self._add_mass(job.mass), phases)
                more = remaining > 0 and reply[-1] not in stops and not self.stop_requested
                for stage in self.stages:
                    stage.after_decode_chunk(self, captured, more)
        return reply

    def rewind(self, length: int) -> None:
        """Forget positions ``>= length`` (a probe generation that replay discards;
        evictions made meanwhile persist, like any other eviction)."""
        self.uncompressed -= max(0, self.req.seq_len - length)
        self.engine.truncate_row(self.row, length)

    # -- insert ------------------------------------------------------------------------
    def insert(self) -> None:
        """Cache the turn's tokens in the radix tree (unless renumbered) and sync
        its holes when a stage edits them."""
        if self.req.renumbered:  # compact layout: the row no longer matches its tokens
            return
        tokens = list(self.req.tokens)
        slots = self.req.slots
        radix, owner = self.radix, self.owner
        previous = self.session._cached_ids
        if previous is not None:  # this session's superseded tail is stale now
            radix.drop_branch(previous, tokens, owner=owner)
        private_from = len(tokens) if self.private_from is None else min(self.private_from, len(tokens))
        radix.insert(tokens, slots, owner=owner, private_from=private_from, replace_from=self.refreshed_from)
        self.session._cached_ids = tokens
        if self.makes_holes:  # evictions become holes, repairs fill them (private nodes only)
            _, filled = radix.sync_holes(tokens, slots, own_handle=self.handle, owner=owner)
            for stage in self.stages:
                stage.after_insert(self, filled)


# ============================================================================ programs
def chat_turn(turn: Turn, n_new: int, sampling: dict) -> Generator:
    """One chat turn: returns the reply's token ids."""
    try:
        turn.open()
        drawn = Sampling(
            float(sampling.get("temperature", 0.0)),
            sampling.get("top_k"),
            sampling.get("top_p"),
            jax.random.key(sampling.get("seed", 0)),
            FIRST_TOKEN_KEY,
        )
        prefilled = yield from turn.prefill_prompt(sampling=drawn)
        reply = yield from turn.generate(prefilled, n_new, **sampling)
        turn.insert()
        return reply
    finally:
        turn.close()


def _top2_margins(logits_NV: np.ndarray) -> np.ndarray:
    """Top-1 minus top-2 logit of each row."""
    top2 = np.sort(np.asarray(logits_NV, np.float32), axis=-1)[:, -2:]
    return top2[:, 1] - top2[:, 0]


def replay_turn(
    turn: Turn, full_ids: np.ndarray, full_phase: np.ndarray, *, generate: bool, n_new: int, return_logits: bool | str
) -> Generator:
    """One teacher-forced turn: prefill the prompt, optionally generate a probe
    reply (then rewind it), prefill the recorded reply. Returns ``(result,
    reply ids or None)``. ``return_logits``: ``True`` (every prompt row and the
    reply), ``"reply"`` (the prompt's last row and the reply) or ``False``."""
    if return_logits not in (True, False, "reply"):
        raise ValueError(f"return_logits must be True, False or 'reply', got {return_logits!r}")
    try:
        turn.open()
        prompt = turn.rendered.ids
        every_row = return_logits is True
        prefilled = yield from turn.prefill_prompt(logits="all" if every_row else ("last" if return_logits else None))
        logits = prefilled.result_logits()
        result = TurnResult(prompt, turn.reused, (logits if every_row else np.asarray(logits)[None]) if return_logits else None)
        reply = None
        if generate:
            mark = turn.req.seq_len
            renumbered = turn.req.renumbered
            reply = yield from turn.generate(prefilled, n_new)
            result.reply_ids = list(reply)
            if turn.record_margins:
                result.reply_margins = np.asarray(turn.reply_margins[: len(reply)], np.float32)
            if turn.req.renumbered != renumbered:
                from jaxkv.errors import ConfigError

                raise ConfigError("cannot rewind past a compact renumbering of the request's positions")
            turn.rewind(mark)
        result.compressions = len(turn.session.compressions)
        if common_prefix_length(full_ids, prompt) == prompt.size and full_ids.size > prompt.size:
            target = full_ids[prompt.size :]
            target_logits = yield from turn.prefill(target, all_logits=bool(return_logits), phase=full_phase[prompt.size :])
            result.target_ids = target
            if return_logits:
                result.target_logits = target_logits
        turn.insert()
        return result, reply
    finally:
        turn.close()


def run_to_completion(program: Generator, scheduler):
    """Drive one turn program on the calling thread: ``scheduler`` (idle) running it
    as its only turn (``Scheduler.run_alone``). Returns the program's value."""
    return scheduler.run_alone(program)
