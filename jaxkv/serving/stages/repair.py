"""The RepairKV stage: shelve evicted rows, promote some back at turn boundaries.

Session options it owns: ``repair`` (K, rows restored per turn boundary; 0/None
is off), ``repair_policy`` (``"repairkv" | "random" | "oldest" | "staleq" |
"wrongq" | "refresh"``), ``repair_when`` (``"turn"`` or ``"tool"``: only when the
new actionable message is a tool result) and ``repair_wrong_signal`` (the
``repair.Signal`` WrongQ-K scores with; default: the latest signal of another
session on the server). Repair needs a retention policy with the dead-slot layout
(positions must survive eviction): ``ConfigError`` otherwise.

What it does in a turn (ALGORITHMS.md §6, papers/repairkv.md):

* ``on_evict``: rows a compression event evicts go to the server's host tier
  (``jaxkv.cache.host_tier``) with their original positions, tokens and scores.
* ``prompt_capture``: the signal, post-RoPE queries of the last ``signal_rows``
  rows of the new actionable query span.
* ``after_prefill`` (after the retention stage's event): the session's rows
  shelved by *earlier* requests (not by this request's own events, which already
  saw this turn's prompt) that are holes of this request, with the same token,
  are scored against the signal and up to K promoted back at their original
  positions (``Engine.restore_rows``).
* ``after_insert``: the radix cache took promoted rows into its holes, so the
  repair persists across turns; ``end`` re-shelves promoted rows the radix cache
  could not take (positions shared with another cached sequence or locked by
  another request), and remembers the request's tokens (a later request that
  diverges drops the shelved rows past the divergence).

Reports: ``session.repairs`` (one ``RepairReport`` per turn boundary).
"""

from __future__ import annotations

import numpy as np

from jaxkv.cache.allocator import SENTINEL_SLOT
from jaxkv.cache.host_tier import TierRows
from jaxkv.cache.radix import common_prefix_length
from jaxkv.errors import ConfigError
from jaxkv.policies import layouts, repair as repairkv
from jaxkv.serving.stages.base import Capture, Stage, register

SIGNALS_KEPT = 8  # latest repair signals a server keeps (one per session) for WrongQ-K


class RepairStage(Stage):
    """RepairKV for one session (module docstring)."""

    name = "repair"
    wants_evicted_rows = True
    edits_holes = True

    def __init__(self, config: repairkv.RepairConfig, wrong_signal=None):
        self.config = config
        self.wrong_signal = wrong_signal
        self.last_signal = None  # the previous request's signal (StaleQ-K)
        self.last_tokens = None  # the previous request's tokens (divergence check)

    # -- turn hooks ------------------------------------------------------------------
    def begin(self, turn) -> None:
        self.signal = None  # this request's Signal
        self.promoted = None  # TierRows promoted into this request (re-shelved at end)
        self.persisted: set[int] = set()  # promoted positions the radix cache took over
        self.tier_clock = turn.server.host_tier.clock  # rows shelved before this request
        if self.last_tokens is not None:
            # Shelved rows past the divergence describe tokens this prompt does not have.
            turn.server.host_tier.drop_from(turn.session.session_id, common_prefix_length(self.last_tokens, turn.rendered.ids))

    def prompt_capture(self, turn) -> Capture:
        a, b = turn.rendered.spans.actionable_query
        self.signal_pos = np.arange(max(a, turn.reused, b - self.config.signal_rows), b)
        return Capture(self.signal_pos)

    def on_evict(self, turn, evicted) -> None:
        turn.server.host_tier.put(
            turn.session.session_id,
            evicted.positions_M,
            evicted.tokens_M.astype(np.int32),
            evicted.k_LMKD,
            evicted.v_LMKD,
            evicted.scores_M,
        )

    def after_prefill(self, turn, captured) -> None:
        if self.signal_pos.size:
            self.signal = repairkv.Signal(np.asarray(captured.q_rows(self.signal_pos), np.float32), self.signal_pos)
        self.repair(turn)

    def after_insert(self, turn, filled) -> None:
        self.persisted = set(np.asarray(filled).tolist())

    def end(self, turn) -> None:
        if turn.row is None:
            return
        if self.promoted is not None:  # the radix keeps holes below the matched prefix
            rows = self.promoted
            back = (rows.positions_M < turn.reused) & np.asarray(
                [turn.req.is_live(int(p)) and int(p) not in self.persisted for p in rows.positions_M], bool
            )
            if back.any():
                r = rows.subset(np.flatnonzero(back))
                turn.server.host_tier.put(turn.session.session_id, r.positions_M, r.tokens_M, r.k_LMKD, r.v_LMKD, r.scores_M)
        self.last_tokens = list(turn.req.tokens)

    # -- the repair ------------------------------------------------------------------
    def repair(self, turn) -> None:
        """Promote up to K shelved rows before decoding (module docstring)."""
        cfg, engine, server = self.config, turn.engine, turn.server
        key, tier = turn.session.session_id, server.host_tier
        stale, signal = self.last_signal, self.signal
        if signal is not None:
            self.last_signal = signal
            server.repair_signals.pop(key, None)
            server.repair_signals[key] = signal
            while len(server.repair_signals) > SIGNALS_KEPT:
                server.repair_signals.pop(next(iter(server.repair_signals)))
        live_before = len(turn.req.live)
        empty = np.zeros(0, np.int64)

        def report(promoted=empty, demoted=empty, candidates=0, skipped=None):
            turn.session.repairs.append(
                repairkv.RepairReport(
                    turn.index, cfg.policy, cfg.k, candidates, promoted, demoted, live_before, len(turn.req.live), skipped
                )
            )

        if cfg.when == "tool" and turn.actionable_kind() != "tool":
            return report(skipped="the actionable message is not a tool result")
        rows = tier.rows(key)
        if rows is not None:  # eligible: earlier requests' rows, holes here, same token
            slots = np.asarray(turn.req.slots, np.int64)
            tokens = np.asarray(turn.req.tokens, np.int64)
            p = rows.positions_M
            inside = p < slots.size
            ok = np.zeros(p.size, bool)
            ok[inside] = (slots[p[inside]] == SENTINEL_SLOT) & (tokens[p[inside]] == rows.tokens_M[inside])
            ok &= rows.stamp_M < self.tier_clock
            rows = rows.subset(np.flatnonzero(ok))
        if rows is None or rows.size == 0:
            return report(skipped="no evicted rows")
        use = {"staleq": stale, "wrongq": self._wrong_signal(turn)}.get(cfg.policy, signal)
        if cfg.policy in repairkv.SCORED and use is None:
            return report(candidates=rows.size, skipped=f"no signal for {cfg.policy}")
        live_pos = turn.req.live_positions()
        demoted = empty
        if cfg.policy == "refresh":
            promote, demoted = self._refresh(turn, use, rows, live_pos)
        else:
            a = None
            if cfg.policy in repairkv.SCORED:
                a = repairkv.score_rows(
                    use,
                    engine.kv.gather_keys(turn.row),
                    live_pos,
                    engine.pool.host_keys(rows.k_LMKD),
                    rows.positions_M,
                    chunk=cfg.chunk,
                    see_all=cfg.policy == "wrongq",
                )
            promote = repairkv.choose(cfg, rows.positions_M, rows.scores_M, a, event=turn.index)
        taken = tier.take(key, promote)
        engine.kv.restore_rows(turn.row, taken.positions_M, taken.k_LMKD, taken.v_LMKD)
        self.promoted = taken if self.promoted is None else TierRows.concat(self.promoted, taken)
        report(taken.positions_M, demoted, rows.size)

    def _refresh(self, turn, signal, rows, live_pos):
        """Refresh: rescore active ∪ evicted, keep the best ``B + K`` of them.

        Forced (never demoted, normalise only): the pinned positions (protected
        prefix, actionable query) and everything from the actionable query on.
        Returns ``(promote positions, demoted positions)``; demoted rows are shelved.
        """
        cfg, engine = self.config, turn.engine
        forced = turn.req.pinned[live_pos] | (live_pos >= turn.rendered.spans.actionable_query[0])
        keys = np.asarray(engine.kv.gather_keys(turn.row))
        act = np.flatnonzero(~forced)
        cand_k = np.concatenate([keys[:, act], np.asarray(engine.pool.host_keys(rows.k_LMKD), keys.dtype)], axis=1)
        cand_pos = np.concatenate([live_pos[act], rows.positions_M])
        a = repairkv.score_rows(signal, keys[:, forced], live_pos[forced], cand_k, cand_pos, chunk=cfg.chunk)
        comp = np.concatenate([np.full(act.size, np.inf, np.float32), rows.scores_M])
        keep = repairkv.select_refresh(a, comp, cand_pos, act.size + min(cfg.k, rows.size))
        demote = ~keep[: act.size]
        if demote.any():
            plan = layouts.dead_slot(turn.req.slots, np.setdiff1d(live_pos, live_pos[act[demote]]))
            turn.evict(plan, a[: act.size][demote])
        return np.sort(rows.positions_M[keep[act.size :]]), np.sort(live_pos[act[demote]])

    def _wrong_signal(self, turn):
        if self.wrong_signal is not None:
            return self.wrong_signal
        others = [sig for sid, sig in turn.server.repair_signals.items() if sid != turn.session.session_id]
        return others[-1] if others else None


def make_config(k, policy: str = "repairkv", when: str = "turn", retention=None) -> repairkv.RepairConfig | None:
    """A validated ``RepairConfig`` (None when ``k`` is 0/None); ``retention`` is
    the session's retention stage (repair needs one with the dead-slot layout)."""
    if not k:
        return None
    config = repairkv.RepairConfig(int(k), policy, when)
    if retention is None or retention.spec.layout != "dead_slot":
        raise ConfigError("repair needs a retention policy with the dead_slot layout (positions must survive eviction)")
    return config


def _factory(session, options: dict, built: list):
    k = options.pop("repair", None)
    policy = options.pop("repair_policy", "repairkv")
    when = options.pop("repair_when", "turn")
    wrong = options.pop("repair_wrong_signal", None)
    retention = next((s for s in built if s.name == "retention"), None)
    config = make_config(k, policy, when, retention)
    return None if config is None else RepairStage(config, wrong)


register("repair", 30, _factory)
