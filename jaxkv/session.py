"""Agent sessions: multi-turn chat over the engine with radix prefix reuse.

A ``Server`` owns what sessions share: one ``Engine`` (pool + rows), one radix
prefix cache over the pool, and an LRU ``SessionStore`` of per-session policy
state. A ``Session`` is one conversation on a server (its own server unless one
is passed). One turn (``Session.chat``):

  render (chat template + tags + spans) -> context check -> radix match (reused
  slots, holes included, path locked) -> open a row with the matched prefix ->
  prefill only the suffix -> decode until a stop token -> parse the reply
  (content / reasoning / tool calls) -> insert the turn's tokens into the radix
  cache -> close the row, unlock -> metrics.

RepairKV (``repair=K``, ALGORITHMS.md §6): rows a compression event evicts go to
the server's host tier (``jaxkv.cache.host_tier``) with their original positions
and scores. At each turn boundary (or only when the new actionable message is a
tool result, ``repair_when="tool"``), after the prompt suffix is prefilled (and
compressed) and before decoding, ``_Turn._repair`` scores the session's rows
shelved by earlier requests (not by this request's own events, which already saw
this turn's prompt) that are holes of this request against the signal
(post-RoPE query rows of the new actionable query span) and promotes up to K
back at their original positions (``promote_rows``). At the end of the turn the
radix cache takes the promoted rows into its holes (``RadixTree.sync_holes``), so
a repair persists across turns; only rows at positions the radix cache must not
change (shared with another cached sequence or locked by another request) return
to the host tier. Reports: ``Session.repairs``.

``Session.replay`` feeds a recorded conversation turn by turn, teacher-forcing
the recorded assistant messages (and optionally generating a reply at each
assistant turn for scoring, then discarding it), so evaluations do not depend on
what a small model happens to generate. ``Session.fork`` copies a session that
owns its server (pool copied, weights shared), so an evaluation can branch after a
shared prefix of turns.

Invariants: at least one prompt token is always prefilled (its logits start the
reply), so a fully cached prompt reuses all but its last token; a request's
references on its slots are dropped when its turn ends, the radix cache keeps
its own; sessions never share policy state (keys are session ids, ALGORITHMS §4).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.cache.host_tier import HostTier, TierRows, restore_rows, stage
from jaxkv.cache.radix import RadixTree, common_prefix_length
from jaxkv.cache.session_store import SessionStore
from jaxkv.chat import derive_session_id, parse_assistant, render
from jaxkv.chat.render import tool_name
from jaxkv.cache.allocator import SENTINEL_SLOT
from jaxkv.engine import Engine, bucket, compress_row
from jaxkv.errors import ConfigError, ContextLengthError, JaxKVError
from jaxkv.metrics import Metrics
from jaxkv.models.loading import Model
from jaxkv.models.transformer import NO_FEATURES, Features
from jaxkv.policies import EventFeatures, Observation, get_policy
from jaxkv.policies import layouts, repair as repairkv
from jaxkv.policies.layouts import LAYOUTS
from jaxkv.sampling import make_sampler, sample

SIGNALS_KEPT = 8  # latest repair signals a server keeps (one per session) for WrongQ-K


class Server:
    """Shared serving state for many sessions.

    Args:
      model: a loaded ``Model`` with a tokenizer.
      max_positions: positions per request (default: model context, at most 8192).
      num_slots: pool slots (default: ``2 * rows * max_positions + 1``, room for
        cached prefixes beside running requests).
      rows: concurrent requests.
      session_cap: how many sessions' policy state the LRU store keeps.
      host_tier: the ``HostTier`` evicted rows go to when a session repairs
        (default: unbounded per session, at most 2**16 rows in all).
    """

    def __init__(self, model: Model, *, max_positions: int | None = None, num_slots: int | None = None, rows: int = 1, session_cap: int = 1024, backend=None, host_tier: HostTier | None = None):
        if model.tokenizer is None:
            raise ConfigError("sessions need a model with a tokenizer (the folder had none)")
        P = int(max_positions or min(model.config.max_position_embeddings, 8192))
        self.model = model
        self.engine = Engine(
            model, rows=rows, max_positions=P, num_slots=num_slots or 2 * rows * P + 1, backend=backend,
        )
        self.radix = RadixTree(self.engine.allocator)
        self.engine.reclaim = self.radix.evict
        self.store = SessionStore(session_cap)
        self.host_tier = host_tier if host_tier is not None else HostTier(global_rows=1 << 16)
        self.repair_signals: dict = {}  # session id -> latest repair Signal (WrongQ-K); oldest first, SIGNALS_KEPT at most
        tok = model.tokenizer
        stops = set(model.config.eos_token_ids)
        for name in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|eom_id|>"):
            tid = tok.convert_tokens_to_ids(name) if name in tok.get_vocab() else None
            if tid is not None:
                stops.add(int(tid))
        if tok.eos_token_id is not None:
            stops.add(int(tok.eos_token_id))
        self.stop_token_ids = frozenset(stops)

    def session(self, **options) -> "Session":
        return Session(self.model, server=self, **options)


@dataclasses.dataclass
class TurnResult:
    """One replayed assistant turn.

    Attributes:
      prompt_ids: the rendered request (history + generation prompt).
      prefix_hit: prompt tokens reused from the radix cache.
      prompt_logits: ``[len(prompt) - prefix_hit, V]`` logits of the prefilled
        suffix (only when ``return_logits``).
      target_ids / target_logits: the recorded assistant message's tokens and
        their teacher-forced logits (``return_logits``).
      generated: the parsed reply generated at this turn (``generate=True``).
    """

    prompt_ids: np.ndarray
    prefix_hit: int
    prompt_logits: np.ndarray | None = None
    target_ids: np.ndarray | None = None
    target_logits: np.ndarray | None = None
    generated: dict | None = None


class Session:
    """One conversation. ``Session(model, **options)`` makes a private server.

    Options:
      server: share a ``Server`` (pool, radix cache, session store) with others.
      session_id: explicit session id (else derived, ALGORITHMS.md §4).
      keep_reasoning: render earlier reasoning too, so histories stay append-only.
      max_new_tokens: default reply budget for ``chat``.
      max_positions, num_slots: sizing of a private server.
      policy: a retention method from ``jaxkv.policies.REGISTRY`` (None: full cache).
      budget: the retention budget B (live history tokens kept at an event).
      layout: ``"dead_slot"`` (default) or ``"compact"``.
      protect_query: keep the actionable query (the latest user / tool message)
        out of eviction, as ALGORITHMS.md §1 forces (default). False lets an event
        evict inside it: for document QA where the document and the question
        arrive in one message (the RepairKV protocol's MQ-NIAH), so the first
        event compresses the document with the question's signal.
      repair: RepairKV restore budget K per turn boundary (0/None: off; needs a
        policy and the dead-slot layout).
      repair_policy: ``"repairkv" | "random" | "oldest" | "staleq" | "wrongq" | "refresh"``.
      repair_when: ``"turn"`` (every turn boundary) or ``"tool"`` (only when the
        new actionable message is a tool result).
      repair_wrong_signal: the ``repair.Signal`` WrongQ-K scores with (default:
        the latest signal of another session on the server).
      **policy_config: options of the policy's config (e.g. ``window=16``).
    """

    def __init__(self, model: Model, *, server: Server | None = None, session_id: str | None = None, keep_reasoning: bool = False, max_new_tokens: int = 256, max_positions: int | None = None, num_slots: int | None = None, backend=None, policy: str | None = None, budget: int | None = None, layout: str = "dead_slot", protect_query: bool = True, repair: int | None = None, repair_policy: str = "repairkv", repair_when: str = "turn", repair_wrong_signal=None, **policy_config):
        self._owns_server = server is None
        self.server = server or Server(model, max_positions=max_positions, num_slots=num_slots, backend=backend)
        if self.server.model is not model:
            raise ConfigError("a session's model must be its server's model")
        self.model = model
        self.tokenizer = model.tokenizer
        self.explicit_session_id = session_id
        self.keep_reasoning = keep_reasoning
        self.max_new_tokens = max_new_tokens
        self.metrics = Metrics()
        self.session_id: str | None = None
        self.retention = _RetentionSpec.make(policy, budget, layout, policy_config, protect_query) if policy else None
        self.compressions: list = []  # CompressionReports of this session, in order
        self._cached_ids: list[int] | None = None  # what this session's last request cached
        self.repair = self._repair_config(repair, repair_policy, repair_when)
        self.repair_wrong_signal = repair_wrong_signal
        self.repairs: list = []  # RepairReports of this session, one per turn boundary it ran at
        self._requests = 0  # requests opened so far (the turn index of reports)
        self._repair_signal = None  # the previous request's signal (StaleQ-K)
        self._repair_tokens = None  # the previous request's tokens (divergence check)

    # ------------------------------------------------------------------ public
    def chat(self, messages: Sequence[Mapping[str, Any]], tools=None, *, max_new_tokens: int | None = None, temperature: float = 0.0, top_k=None, top_p=None, seed: int = 0) -> dict:
        """Answer ``messages``: an OpenAI-style assistant message dict."""
        rendered = self._render(messages, tools, add_generation_prompt=True)
        n_new = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        make_sampler(temperature, top_k, top_p)
        self._check_length(rendered.ids.size, n_new)
        turn = self._open(rendered)
        try:
            logits = turn.prefill_prompt()
            reply_ids = turn.generate(logits, n_new, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
            turn.insert()
        finally:
            turn.close()
        text = self.tokenizer.decode(reply_ids, skip_special_tokens=False)
        names = [tool_name(t) for t in tools] if tools else None
        return parse_assistant(text, names)

    def replay(self, messages: Sequence[Mapping[str, Any]], tools=None, *, generate: bool = False, max_new_tokens: int | None = None, return_logits: bool = False, start_turn: int = 0) -> list[TurnResult]:
        """Feed a recorded conversation turn by turn (see the module docstring).

        ``start_turn``: skip the first ``start_turn`` assistant turns, which this
        session (or the session it was forked from) has already replayed; one
        ``TurnResult`` per replayed turn."""
        if start_turn < 0:
            raise ValueError(f"start_turn must be >= 0, got {start_turn}")
        results = []
        n_new = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        assistant_at = [j for j, m in enumerate(messages) if m.get("role") == "assistant"]
        for j in assistant_at[start_turn:]:
            prompt = self._render(messages[:j], tools, add_generation_prompt=True)
            full = self._render(messages[: j + 1], tools, add_generation_prompt=False).ids
            self._check_length(max(full.size, prompt.ids.size + (n_new if generate else 0)), 0)
            turn = self._open(prompt)
            try:
                logits = turn.prefill_prompt(all_logits=return_logits)
                result = TurnResult(prompt.ids, turn.reused, logits if return_logits else None)
                if generate:
                    mark = turn.mark()
                    reply = turn.generate(logits[-1] if return_logits else logits, n_new)
                    text = self.tokenizer.decode(reply, skip_special_tokens=False)
                    result.generated = parse_assistant(text, [tool_name(t) for t in tools] if tools else None)
                    turn.rewind(mark)
                if full[: prompt.ids.size].tolist() == prompt.ids.tolist() and full.size > prompt.ids.size:
                    target = full[prompt.ids.size:]
                    target_logits = turn.prefill(target, all_logits=return_logits)
                    result.target_ids = target
                    if return_logits:
                        result.target_logits = target_logits
                turn.insert()
            finally:
                turn.close()
            results.append(result)
        return results

    @property
    def repair_signal(self):
        """The latest request's repair ``Signal`` (post-RoPE query rows of its
        actionable query), or None before the first request or without repair."""
        return self._repair_signal

    def fork(self, **repair_options) -> "Session":
        """An independent copy of this conversation and its private server.

        The copy has the same cached tokens (pool, slot maps, radix cache with its
        holes), host tier, policy state, metrics and repair history; turns run on
        either afterwards leave the other untouched. Evaluations use it to branch
        after a shared prefix: the RepairKV protocol replays turn 1 once and every
        repair policy from there, which equals replaying each from scratch (the
        first request never repairs: nothing was shelved before it).

        ``repair_options`` (``repair``, ``repair_policy``, ``repair_when``,
        ``repair_wrong_signal``) change the copy's repair choice from its next
        turn on, validated as in ``Session(...)``. Only a session with its own
        server can fork (``ConfigError`` otherwise: a shared server holds other
        sessions' state). The model's weights are shared, the pool is copied.
        """
        import copy

        if not self._owns_server:
            raise ConfigError("only a session with its own server can fork (this one shares a Server)")
        unknown = set(repair_options) - {"repair", "repair_policy", "repair_when", "repair_wrong_signal"}
        if unknown:
            raise ConfigError(f"fork changes only the repair options, not {', '.join(sorted(unknown))}")
        current = self.repair or repairkv.RepairConfig(1)
        repair = self._repair_config(
            repair_options.get("repair", self.repair.k if self.repair else None),
            repair_options.get("repair_policy", current.policy), repair_options.get("repair_when", current.when))
        engine = self.server.engine
        if any(state is not None for state in engine.row_state):
            raise JaxKVError("cannot fork a session in the middle of a turn (a cache row is open)")
        shared = (self.model, self.tokenizer, engine.params, engine.graphdef)
        memo = {id(x): x for x in shared}
        memo[id(engine.cache)] = jax.tree.map(jnp.copy, engine.cache)  # the pool is donated by later updates
        twin = copy.deepcopy(self, memo)
        twin.repair = repair
        if "repair_wrong_signal" in repair_options:
            twin.repair_wrong_signal = repair_options["repair_wrong_signal"]
        return twin

    def close(self) -> None:
        """End the session: release its host-tier rows and repair signal."""
        if self.session_id is not None:
            self.server.host_tier.drop_session(self.session_id)
            self.server.repair_signals.pop(self.session_id, None)

    # ------------------------------------------------------------------ helpers
    def _render(self, messages, tools, *, add_generation_prompt):
        rendered = render(self.tokenizer, messages, tools, add_generation_prompt=add_generation_prompt, keep_reasoning=self.keep_reasoning)
        if self.session_id is None:
            self.session_id = derive_session_id(rendered.ids, rendered.spans.session_span, explicit=self.explicit_session_id)
        return rendered

    def _check_length(self, prompt_tokens: int, new_tokens: int) -> None:
        limit = min(self.model.config.max_position_embeddings, self.server.engine.max_positions)
        if prompt_tokens + new_tokens > limit:
            raise ContextLengthError(
                f"conversation of {prompt_tokens} tokens + {new_tokens} new tokens exceeds the "
                f"context of {limit} tokens"
            )

    def _open(self, rendered) -> "_Turn":
        return _Turn(self, rendered)

    def _repair_config(self, k, policy, when):
        if not k:
            return None
        config = repairkv.RepairConfig(int(k), policy, when)
        if self.retention is None or self.retention.layout != "dead_slot":
            raise ConfigError("repair needs a retention policy with the dead_slot layout (positions must survive eviction)")
        return config

    def _retention_state(self) -> "_RetentionState | None":
        """This session's policy state, kept in the server's LRU session store."""
        spec = self.retention
        if spec is None:
            return None
        key = (self.session_id, spec.key)
        return self.server.store.get_or_create(key, lambda: _RetentionState(spec, self.model.config))


@dataclasses.dataclass(frozen=True)
class _RetentionSpec:
    """A session's retention choice: policy, typed config, budget, layout."""

    policy: object
    config: object
    budget: int
    layout: str
    protect_query: bool = True

    @classmethod
    def make(cls, name, budget, layout, options, protect_query=True):
        policy = get_policy(name)
        config = policy.make_config(**options)
        if budget is None or int(budget) < 1:
            raise ConfigError(f"policy {name!r} needs a positive budget, got {budget!r}")
        if layout not in LAYOUTS:
            raise ConfigError(f"unknown layout {layout!r}; known: {', '.join(LAYOUTS)}")
        if not isinstance(protect_query, bool):
            raise ConfigError(f"protect_query must be True or False, got {protect_query!r}")
        return cls(policy, config, int(budget), layout, protect_query)

    @property
    def key(self):
        return (self.policy.name, repr(self.config), self.budget, self.layout, self.protect_query)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _observe_jit(observe, cfg, state, obs):
    return observe(cfg, state, obs)


class _RetentionState:
    """Per-session policy state plus per-position history that outlives a turn.

    Attributes:
      state: the policy's pytree state (rings, QueryMemory, ...).
      acc_mass: attention mass per position accumulated over the session (H2O).
    """

    def __init__(self, spec: _RetentionSpec, model_cfg):
        self.spec = spec
        self.state = spec.policy.init_state(spec.config, model_cfg)
        self.acc_mass = np.zeros(0, np.float32)


class _Turn:
    """One request's life on the engine: matched prefix, row, retention, accounting.

    Per-position arrays (``tokens``, ``phase``, ``pinned``) cover the row's
    positions and are re-indexed together when a compact layout renumbers them.
    """

    def __init__(self, session: Session, rendered):
        self.session = session
        self.server = session.server
        self.engine = self.server.engine
        self.rendered = rendered
        ids = rendered.ids
        self.spec = session.retention
        self.retention = session._retention_state()
        self.needs = self.spec.policy.needs(self.spec.config) if self.spec else None
        match = self.server.radix.match(ids)
        self.handle = match.handle
        self.reused = min(match.length, ids.size - 1)  # always prefill >= 1 token
        try:
            self.row = self.engine.open_row(match.slots[: self.reused])
        except Exception:
            self.server.radix.unlock(self.handle)
            raise
        n = ids.size
        self.tokens: list[int] = ids[: self.reused].tolist()
        self.phase = np.asarray(rendered.phase, np.int32)[: self.reused]
        pinned = np.zeros(n, bool)
        spans = [rendered.spans.protected_prefix]
        if self.spec is None or self.spec.protect_query:
            spans.append(rendered.spans.actionable_query)
        for a, b in spans:
            pinned[a:b] = True
        self._pinned_prompt = pinned
        self.pinned = pinned[: self.reused]
        self.renumbered = False
        self.persisted: set[int] = set()  # repaired positions the radix cache took over
        self.renumber_count = 0
        self.uncompressed = int(n)  # request size without pruning (raw reads, PT)
        self.window: tuple[np.ndarray, np.ndarray] | None = None  # (q [L,W,Hq,D], positions [W])
        self.query_mean = None
        if self.retention is not None and self.retention.acc_mass.size < self.reused:
            self.retention.acc_mass = np.zeros(self.reused, np.float32)
        self.index = session._requests
        session._requests += 1
        self.signal = None  # this request's repair Signal
        self.promoted = None  # TierRows promoted into this request (re-shelved at close)
        self.tier_clock = self.server.host_tier.clock  # rows shelved before this request
        if session.repair is not None and session._repair_tokens is not None:
            # Shelved rows past the divergence describe tokens this prompt does not have.
            self.server.host_tier.drop_from(session.session_id, common_prefix_length(session._repair_tokens, ids))
        session.metrics.start_request(prompt_tokens=int(n), prefix_hit_tokens=self.reused, session_id=session.session_id)

    # -- prefill ------------------------------------------------------------------
    def prefill_prompt(self, *, all_logits=False):
        """Prefill the unmatched prompt suffix, then run a compression event if due."""
        logits = self._prefill_prompt(all_logits)
        if self.session.repair is not None:
            self._repair()
        self._observe_live()  # post-pruning live KV of the prompt (and promoted rows)
        return logits

    def _prefill_prompt(self, all_logits):
        ids = self.rendered.ids
        suffix = ids[self.reused:]
        if self.spec is None:
            return self.prefill(suffix, all_logits=all_logits)
        needs = self.needs
        offset = self.reused
        n = ids.size
        phase = np.asarray(self.rendered.phase, np.int32)
        window_pos = np.arange(max(offset, n - needs.window), n) if needs.window else np.zeros(0, np.int64)
        a, b = self.rendered.spans.actionable_query
        span_pos = np.arange(max(a, offset), b) if needs.query_mean else np.zeros(0, np.int64)
        ring_pos = np.zeros(0, np.int64)
        if needs.observe_rows:
            per_phase = int(needs.observe_rows) if not isinstance(needs.observe_rows, bool) else 64
            ring_pos = np.concatenate([
                np.flatnonzero(phase[offset:] == ph)[-per_phase:] + offset for ph in np.unique(phase[offset:])
            ]) if suffix.size else ring_pos
            ring_pos = np.sort(ring_pos)
        signal_pos = np.zeros(0, np.int64)
        if self.session.repair is not None:  # the repair signal: the actionable query's last rows
            signal_pos = np.arange(max(a, offset, b - self.session.repair.signal_rows), b)
        capture = np.unique(np.concatenate([window_pos, span_pos, ring_pos, signal_pos]).astype(np.int64))
        feats = Features(query_rows=capture.size > 0, attn_mass=needs.attn_mass)
        if feats == NO_FEATURES:
            logits = self.prefill(suffix, all_logits=all_logits)
            self._maybe_compress()
            return logits
        X = bucket(max(capture.size, 1), minimum=8)
        idx = np.full(X, capture[-1] - offset if capture.size else 0, np.int64)
        idx[: capture.size] = capture - offset
        logits, aux = self.engine.prefill([self.row], [suffix.tolist()], all_logits=all_logits, features=feats, q_row_positions=[idx])
        logits = logits[0]
        self._extend(suffix.tolist())
        if needs.attn_mass:
            self._add_mass(aux["attn_mass"][0].mean(axis=(0, 1)))
        q_of = {}
        if capture.size:
            q_rows = aux["q_rows"][:, 0]  # [L, X, Hq, D]
            q_of = {int(p): i for i, p in enumerate(capture)}
        if window_pos.size:
            self.window = (q_rows[:, [q_of[int(p)] for p in window_pos]], window_pos)
        if span_pos.size:
            self.query_mean = q_rows[:, [q_of[int(p)] for p in span_pos]].mean(axis=1)
        if signal_pos.size:
            self.signal = repairkv.Signal(np.asarray(q_rows[:, [q_of[int(p)] for p in signal_pos]], np.float32), signal_pos)
        if self.spec.policy.observe is not None:
            rows = [q_of[int(p)] for p in ring_pos]
            self._observe(q_rows[:, rows] if rows else None, phase[ring_pos], new_turn=True)
        self._maybe_compress()
        return logits

    def prefill(self, ids, *, all_logits=False):
        ids = np.asarray(ids).tolist()
        out = self.engine.prefill([self.row], [ids], all_logits=all_logits)[0]
        self._extend(ids)
        return out

    def _extend(self, ids, phases=None):
        start = len(self.tokens)
        self.tokens += list(ids)
        if phases is None:  # prompt tokens: tags from the render
            phases = np.asarray(self.rendered.phase, np.int32)[start : start + len(ids)]
            pinned = self._pinned_prompt[start : start + len(ids)] if not self.renumbered else np.zeros(len(ids), bool)
            if phases.size < len(ids):  # teacher-forced target past the prompt
                phases = np.concatenate([phases, np.full(len(ids) - phases.size, phases[-1] if phases.size else 3, np.int32)])
                pinned = np.concatenate([pinned, np.zeros(len(ids) - pinned.size, bool)])
        else:
            pinned = np.zeros(len(ids), bool)
        self.phase = np.concatenate([self.phase, phases])
        self.pinned = np.concatenate([self.pinned, pinned])

    def _add_mass(self, mass_P):
        acc = self.retention.acc_mass
        if acc.size < mass_P.size:
            acc = np.concatenate([acc, np.zeros(mass_P.size - acc.size, np.float32)])
        acc[: mass_P.size] += mass_P
        self.retention.acc_mass = acc

    def _observe(self, q_LXHD, phase_X, *, new_turn):
        spec = self.spec
        cfg = self.session.model.config
        n = 0 if q_LXHD is None else q_LXHD.shape[1]
        X = bucket(max(n, 1), minimum=8)  # padded rows: one compile per bucket
        q = np.zeros((cfg.num_layers, X, cfg.num_heads, cfg.head_dim), np.float32)
        phases = np.zeros(X, np.int32)
        valid = np.arange(X) < n
        if n:
            q[:, :n] = q_LXHD
            phases[:n] = phase_X
        q_LXHD, phase_X = q, phases
        qm = self.query_mean if self.query_mean is not None else np.zeros((cfg.num_layers, cfg.num_heads, cfg.head_dim), np.float32)
        obs = Observation(
            q_LXHD=jnp.asarray(q_LXHD, jnp.float32), phase_X=jnp.asarray(phase_X, jnp.int32),
            valid_X=jnp.asarray(valid), query_mean_LHD=jnp.asarray(qm, jnp.float32),
            new_turn=jnp.asarray(bool(new_turn and self.query_mean is not None)),
        )
        self.retention.state = _observe_jit(spec.policy.observe, spec.config, self.retention.state, obs)

    # -- compression ----------------------------------------------------------------
    def _maybe_compress(self):
        spec = self.spec
        live_pos = self.engine.live_positions(self.row)
        if live_pos.size <= spec.budget:
            return
        cfg = self.session.model.config
        if self.window is not None:
            wq, wpos = self.window
        else:
            wq = np.zeros((cfg.num_layers, 1, cfg.num_heads, cfg.head_dim), np.float32)
            wpos = np.zeros(1, np.int64)
        wvalid = np.asarray([self._is_live(p) or p >= len(self.tokens) - 1 for p in wpos]) if self.window is not None else np.zeros(1, bool)
        acc = self.retention.acc_mass
        acc_live = np.where(live_pos < acc.size, acc[np.minimum(live_pos, max(acc.size - 1, 0))], 0.0) if acc.size else np.zeros(live_pos.size)
        qm = self.query_mean if self.query_mean is not None else np.zeros((cfg.num_layers, cfg.num_heads, cfg.head_dim), np.float32)
        # Pad N to a bucket so the jit'd scorer compiles once per bucket, not per event.
        n, N = live_pos.size, bucket(live_pos.size)
        seq_len = len(self.tokens)

        def pad(x, fill):
            return np.concatenate([np.asarray(x), np.full(N - n, fill, np.asarray(x).dtype)])

        feats = EventFeatures(
            keys_LNKD=self.engine.gather_keys(self.row, N),
            positions_N=jnp.asarray(np.concatenate([live_pos, seq_len + 1 + np.arange(N - n)]), jnp.int32),
            phase_N=jnp.asarray(pad(self.phase[live_pos], 3), jnp.int32),
            window_q_LWHD=jnp.asarray(wq, jnp.float32),
            window_pos_W=jnp.asarray(wpos, jnp.int32),
            window_valid_W=jnp.asarray(wvalid),
            acc_mass_N=jnp.asarray(pad(acc_live.astype(np.float32), 0.0), jnp.float32),
            query_mean_LHD=jnp.asarray(qm, jnp.float32),
            seq_len=jnp.int32(seq_len),
            valid_N=jnp.asarray(np.arange(N) < n),
        )
        forced = pad(self.pinned[live_pos], False)
        self.retention.state, report = compress_row(
            self.engine, self.row, spec.policy, spec.config, self.retention.state, feats, forced, spec.budget, spec.layout,
            on_evict=self._shelve if self.session.repair is not None else None,
        )
        self.session.compressions.append(report)
        if report.plan.renumbered:  # compact: positions are now 0..K-1
            kept = report.kept_positions
            self.tokens = [self.tokens[p] for p in kept]
            self.phase, self.pinned = self.phase[kept], self.pinned[kept]
            if acc.size:
                self.retention.acc_mass = np.where(kept < acc.size, acc[np.minimum(kept, acc.size - 1)], 0.0).astype(np.float32)
            self.window = None
            self.renumbered = True
            self.renumber_count += 1
        self._observe_live()

    # -- repair (RepairKV, ALGORITHMS.md §6) ----------------------------------------
    def _shelve(self, plan, k_LMKD, v_LMKD, scores_M):
        """Evicted rows -> the server's host tier, under this session."""
        pos = plan.evicted_positions
        tokens = np.asarray(self.tokens, np.int32)[pos]
        self.server.host_tier.put(self.session.session_id, pos, tokens, k_LMKD, v_LMKD, scores_M)

    def _repair(self):
        """Promote up to K shelved rows before decoding (module docstring)."""
        session, cfg, engine = self.session, self.session.repair, self.engine
        key, tier = session.session_id, self.server.host_tier
        stale, signal = session._repair_signal, self.signal
        if signal is not None:
            session._repair_signal = signal
            self.server.repair_signals.pop(key, None)
            self.server.repair_signals[key] = signal
            while len(self.server.repair_signals) > SIGNALS_KEPT:
                self.server.repair_signals.pop(next(iter(self.server.repair_signals)))
        live_before = len(engine.row_state[self.row].live)
        empty = np.zeros(0, np.int64)

        def report(promoted=empty, demoted=empty, candidates=0, skipped=None):
            session.repairs.append(repairkv.RepairReport(
                self.index, cfg.policy, cfg.k, candidates, promoted, demoted,
                live_before, len(engine.row_state[self.row].live), skipped,
            ))

        if cfg.when == "tool" and self._actionable_kind() != "tool":
            return report(skipped="the actionable message is not a tool result")
        rows = tier.rows(key)
        if rows is not None:  # eligible: earlier requests' rows, holes here, same token
            slots = np.asarray(engine.row_state[self.row].slots, np.int64)
            tokens = np.asarray(self.tokens, np.int64)
            p = rows.positions_M
            inside = p < slots.size
            ok = np.zeros(p.size, bool)
            ok[inside] = (slots[p[inside]] == SENTINEL_SLOT) & (tokens[p[inside]] == rows.tokens_M[inside])
            ok &= rows.stamp_M < self.tier_clock
            rows = rows.subset(np.flatnonzero(ok))
        if rows is None or rows.size == 0:
            return report(skipped="no evicted rows")
        use = {"staleq": stale, "wrongq": self._wrong_signal()}.get(cfg.policy, signal)
        if cfg.policy in repairkv.SCORED and use is None:
            return report(candidates=rows.size, skipped=f"no signal for {cfg.policy}")
        live_pos = engine.live_positions(self.row)
        demoted = empty
        if cfg.policy == "refresh":
            promote, demoted = self._refresh(use, rows, live_pos)
        else:
            a = None
            if cfg.policy in repairkv.SCORED:
                a = repairkv.score_rows(
                    use, engine.gather_keys(self.row), live_pos, rows.k_LMKD, rows.positions_M,
                    chunk=cfg.chunk, see_all=cfg.policy == "wrongq",
                )
            promote = repairkv.choose(cfg, rows.positions_M, rows.scores_M, a, event=self.index)
        taken = tier.take(key, promote)
        promote_rows(engine, self.row, taken.positions_M, taken.k_LMKD, taken.v_LMKD)
        self.promoted = taken if self.promoted is None else TierRows.concat(self.promoted, taken)
        report(taken.positions_M, demoted, rows.size)

    def _refresh(self, signal, rows, live_pos):
        """Refresh: rescore active ∪ evicted, keep the best ``B + K`` of them.

        Forced (never demoted, normalise only): the pinned positions (protected
        prefix, actionable query) and everything from the actionable query on.
        Returns ``(promote positions, demoted positions)``; demoted rows are shelved.
        """
        cfg, engine = self.session.repair, self.engine
        forced = self.pinned[live_pos] | (live_pos >= self.rendered.spans.actionable_query[0])
        keys = np.asarray(engine.gather_keys(self.row))
        act = np.flatnonzero(~forced)
        cand_k = np.concatenate([keys[:, act], np.asarray(rows.k_LMKD, keys.dtype)], axis=1)
        cand_pos = np.concatenate([live_pos[act], rows.positions_M])
        a = repairkv.score_rows(signal, keys[:, forced], live_pos[forced], cand_k, cand_pos, chunk=cfg.chunk)
        comp = np.concatenate([np.full(act.size, np.inf, np.float32), rows.scores_M])
        keep = repairkv.select_refresh(a, comp, cand_pos, act.size + min(cfg.k, rows.size))
        demote = ~keep[: act.size]
        if demote.any():
            slots = engine.row_state[self.row].slots
            plan = layouts.dead_slot(slots, np.setdiff1d(live_pos, live_pos[act[demote]]))
            self._shelve(plan, *engine.gather_rows(plan.evicted_slots), a[: act.size][demote])
            engine.apply_layout(self.row, plan)
        return np.sort(rows.positions_M[keep[act.size:]]), np.sort(live_pos[act[demote]])

    def _wrong_signal(self):
        if self.session.repair_wrong_signal is not None:
            return self.session.repair_wrong_signal
        others = [sig for sid, sig in self.server.repair_signals.items() if sid != self.session.session_id]
        return others[-1] if others else None

    def _actionable_kind(self) -> str | None:
        kinds = [m.kind for m in self.rendered.messages if m.kind in ("user", "tool")]
        return kinds[-1] if kinds else None

    def _is_live(self, p) -> bool:
        slots = self.engine.row_state[self.row].slots
        return p < len(slots) and slots[p] != SENTINEL_SLOT

    # -- decode -------------------------------------------------------------------
    def generate(self, last_logits, n_new, *, temperature=0.0, top_k=None, top_p=None, seed=0):
        if n_new <= 0:
            return []
        spec, temp, top_p_val = make_sampler(temperature, top_k, top_p)
        key = jax.random.key(seed)
        first = int(sample(jnp.asarray(last_logits)[None], jax.random.fold_in(key, 1 << 30), spec, temp, top_p_val)[0])
        reply = [first]
        stops = self.server.stop_token_ids
        needs = self.needs
        interval = needs.decode_interval if needs is not None and needs.decode_interval else n_new
        feats = NO_FEATURES
        if needs is not None and needs.decode_interval:
            feats = Features(query_rows=bool(needs.window or needs.observe_rows), attn_mass=needs.attn_mass)
        remaining = n_new - 1
        chunk_index = 0
        while reply[-1] not in stops and remaining > 0:
            n = min(interval, remaining)
            state = self.engine.row_state[self.row]
            raw0, eff0 = self.uncompressed, len(state.live)
            out = self.engine.decode(
                [self.row], [reply[-1]], n, temperature=temperature, top_k=top_k, top_p=top_p,
                key=jax.random.fold_in(key, chunk_index), stop_token_ids=stops, features=feats,
            )
            tokens = out[0][0]
            fed = [reply[-1]] + tokens[:-1]  # the tokens written to the cache this chunk
            for s in range(1, len(tokens) + 1):  # each step attends to everything so far + itself
                self.session.metrics.on_decode_step(raw_attended=raw0 + s, effective_attended=eff0 + s)
            phases = self.rendered.scanner.feed(fed).phase.astype(np.int32)
            start = len(self.tokens)
            self._extend(fed, phases)
            self.uncompressed += len(fed)
            reply += tokens
            remaining -= n
            chunk_index += 1
            if feats != NO_FEATURES:
                aux = out[2]
                if needs.attn_mass:
                    self._add_mass(aux["attn_mass"][0])
                q = aux["q_rows"][0].transpose(1, 0, 2, 3) if "q_rows" in aux else None  # [L, n, Hq, D]
                if q is not None and needs.window:
                    w = min(needs.window, q.shape[1])
                    self.window = (q[:, -w:], np.arange(start + len(fed) - w, start + len(fed)))
                if q is not None and self.spec.policy.observe is not None:
                    self._observe(q, phases, new_turn=False)
                if remaining > 0 and reply[-1] not in stops:
                    self._maybe_compress()
        return reply

    def mark(self):
        """A point to ``rewind`` to (used by replay to drop a probe generation;
        evictions made meanwhile persist, like any other eviction)."""
        return (len(self.tokens), self.renumber_count)

    def rewind(self, mark) -> None:
        length, renumber_count = mark
        if renumber_count != self.renumber_count:
            raise ConfigError("cannot rewind past a compact renumbering of the request's positions")
        self.engine.truncate_row(self.row, length)
        self.tokens = self.tokens[:length]
        self.phase, self.pinned = self.phase[:length], self.pinned[:length]

    def insert(self) -> None:
        if self.renumbered:  # compact layout: the row no longer matches its tokens
            return
        state = self.engine.row_state[self.row]
        slots = state.slots[: len(self.tokens)]
        previous = self.session._cached_ids
        if previous is not None:  # this session's superseded tail is stale now
            self.server.radix.drop_branch(previous, self.tokens)
        self.server.radix.insert(self.tokens, slots)
        self.session._cached_ids = list(self.tokens)
        if self.spec is not None:  # evictions become holes in the cache, repairs fill them
            _, filled = self.server.radix.sync_holes(self.tokens, slots, own_handle=self.handle)
            self.persisted = set(filled.tolist())

    def _reshelve_promoted(self):
        rows = self.promoted
        back = (rows.positions_M < self.reused) & np.asarray(
            [self._is_live(p) and int(p) not in self.persisted for p in rows.positions_M], bool
        )
        if back.any():
            r = rows.subset(np.flatnonzero(back))
            self.server.host_tier.put(self.session.session_id, r.positions_M, r.tokens_M, r.k_LMKD, r.v_LMKD, r.scores_M)

    def _observe_live(self):
        self.session.metrics.on_live(len(self.engine.row_state[self.row].live))

    def close(self) -> None:
        try:
            if self.promoted is not None:  # the radix keeps holes below the matched prefix
                self._reshelve_promoted()
            if self.session.repair is not None:
                self.session._repair_tokens = list(self.tokens)
            self.engine.close_row(self.row)
        finally:
            self.server.radix.unlock(self.handle)
            self.session.metrics.end_request()


def promote_rows(engine: Engine, row: int, positions_M, k_LMKD, v_LMKD) -> np.ndarray:
    """RepairKV apply step: bring evicted rows back into ``row`` at their original
    positions. Fresh slots are allocated, the K/V rows written there unchanged
    (post-RoPE at the same positions: no rotation), the positions' slot-map
    entries (holes) pointed at them and the live-index list grown in position
    order. Returns the fresh slots. ``RepairError`` (nothing changed) when a
    position is not a hole of the row."""
    pos = np.asarray(positions_M, np.int64)
    if pos.size == 0:
        return np.zeros(0, np.int64)
    state = engine.row_state[row]
    if state is None:
        raise JaxKVError(f"cache row {row} is not open")
    repairkv.promotion_tables(state.slots, pos, np.ones(pos.size, np.int64))  # validate first
    fresh = engine.allocate(pos.size)
    slots, live = repairkv.promotion_tables(state.slots, pos, fresh)
    engine.cache = restore_rows(engine.cache, jnp.asarray(fresh, jnp.int32), stage(np.asarray(k_LMKD)), stage(np.asarray(v_LMKD)))
    engine.set_row_tables(row, slots, live)
    return fresh
