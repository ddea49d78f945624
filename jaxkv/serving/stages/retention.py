"""The retention stage: compression events of a session's retention policy.

Session options it owns: ``policy`` (a name in ``jaxkv.policies.REGISTRY``),
``budget`` (B, live history tokens kept at an event), ``layout`` (``"dead_slot"``
or ``"compact"``) and the policy's own config fields (``w=16``...).

What it does in a turn (ALGORITHMS.md §1-5):

* ``prompt_capture``: the query rows the policy needs from the prompt (SnapKV's
  observation window, IntentKV's actionable-query span, AgentKV's per-phase
  rows) and attention mass (H2O).
* ``after_prefill``: folds them into the policy state (``observe``), then one
  compression event if the live history exceeds B.
* ``after_decode_chunk`` (policies with a decode interval Δ): the same, every Δ
  decoded tokens.

An event (``compress``): live positions P split into forced F (pinned positions:
protected prefix, actionable query; plus the policy's ``keep`` set) and
candidates; ``score_and_select`` keeps ``F ∪ topk_C(score, B − |F|)``; the layout
turns the kept set into a ``LayoutPlan`` and ``Turn.evict`` applies it (the
RepairKV stage shelves what leaves). Reports go to ``session.compressions``.

State: the policy's pytree state and the per-position attention mass live in the
server's LRU session store under ``(session id, spec key)``, so they outlive a turn
(the mass is copied into ``RequestState.mass`` at ``begin`` and back at ``end``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.buckets import bucket, event_size, event_sizes
from jaxkv.cache.allocator import SENTINEL_SLOT
from jaxkv.chat.tags import Phase
from jaxkv.errors import ConfigError
from jaxkv.models import registry
from jaxkv.policies import EventFeatures, Observation, get_policy, layouts
from jaxkv.policies.base import select
from jaxkv.policies.intentkv_head import CONFIG_FILE as HEAD_CONFIG_FILE
from jaxkv.policies.intentkv_head import HEAD_FOLDER
from jaxkv.policies.layouts import LAYOUTS
from jaxkv.serving.stages.base import Capture, Stage, register


PROMPT_RING_ROWS = 64  # query rows per phase a prompt feeds ``observe`` (``Needs.observe_rows=True``)
OBSERVE_ROWS = len(Phase) * PROMPT_RING_ROWS  # rows of every ``observe`` call (padded): one compile


def window_rows(needs) -> int:
    """Query rows of every event's observation window (``EventFeatures.window_q_LWHD``),
    padded to the policy's window so an event's shape depends only on its live bucket."""
    return max(int(needs.window), 1)


def head_folder_of(model):
    """The IntentKV head trained for ``model``, or None (``IntentKVConfig``'s default
    then: the embedded model's head, which ``check_head_model`` refuses for any other
    model). Looked for, first found wins (``registry.find_artifact``):

    1. ``<model folder>/intentkv-head`` (a checkpoint folder; the embedded model's
       ships there);
    2. ``<cache>/models/<name>/intentkv-head`` (``train.intentkv_head --export``;
       outside the converted copy, which a reconversion replaces) for a reference
       model: the one whose cache folder the model's folder is, or whose weights
       the model holds;
    3. the head shipped in ``jaxkv/assets/<name>/intentkv-head`` for the model whose
       ``weights.json`` records the identity of these weights
       (``jaxkv.models.loading.weights_id``), however they were loaded (by name,
       from the converted folder, from the GGUF file, from a copy).

    Lives here, not in ``policies``, because policies never import ``models``."""
    return registry.find_artifact(model, HEAD_FOLDER, lambda c: (c / HEAD_CONFIG_FILE).is_file())


@dataclasses.dataclass(frozen=True)
class RetentionSpec:
    """A session's retention choice: policy, typed config, budget, layout."""

    policy: object
    config: object
    budget: int
    layout: str

    @classmethod
    def make(cls, name, budget, layout, options, model=None):
        """``model``: the session's model; a policy with a learned head (``head``
        in its config) and none given takes the head trained for that model
        (``head_folder_of``)."""
        policy = get_policy(name)
        options = dict(options)
        if options.get("head") is None and "head" in {f.name for f in dataclasses.fields(policy.config)}:
            found = head_folder_of(model)
            if found is not None:
                options["head"] = str(found)
        config = policy.make_config(**options)
        if budget is None or int(budget) < 1:
            raise ConfigError(f"policy {name!r} needs a positive budget, got {budget!r}")
        if layout not in LAYOUTS:
            raise ConfigError(f"unknown layout {layout!r}; known: {', '.join(LAYOUTS)}")
        return cls(policy, config, int(budget), layout)

    @property
    def key(self):
        return (self.policy.name, repr(self.config), self.budget, self.layout)


class RetentionState:
    """Per-session policy state plus per-position history that outlives a turn.

    Attributes:
      state: the policy's pytree state (rings, QueryMemory, ...).
      acc_mass: attention mass per position accumulated over the session (H2O).
    """

    def __init__(self, spec: RetentionSpec, model_cfg):
        self.spec = spec
        self.state = spec.policy.init_state(spec.config, model_cfg)
        self.acc_mass = np.zeros(0, np.float32)


@dataclasses.dataclass(frozen=True)
class CompressionReport:
    """What one compression event did (positions in the numbering before it)."""

    live_before: int
    live_after: int
    kept_positions: np.ndarray
    plan: object
    evicted_scores: np.ndarray | None = None  # policy score of each plan.evicted_positions entry
    decision_margin: float = float("inf")  # lowest kept candidate score minus highest evicted one (inf: none evicted)


@functools.partial(jax.jit, static_argnames=("policy", "cfg"))
def score_and_select(policy, cfg, state, feats, forced_N, budget):
    """One event's decision, jit'd per (policy, config, padded N): forced set =
    engine-forced ∪ the policy's keep set (real entries only), scores, kept mask."""
    valid = feats.valid()
    forced = jnp.asarray(forced_N, bool)
    if policy.keep is not None:
        forced = forced | policy.keep(cfg, feats)
    forced = forced & valid
    candidates = ~forced & valid
    scores, state = policy.score(cfg, state, feats, candidates)
    return select(scores, forced, candidates, budget), scores, state


def compress_row(engine, row: int, policy, cfg, state, feats, forced_N, budget: int, layout: str, *, on_evict=None, apply=None):
    """One compression event on a row: score, select, plan the layout, apply it.

    ``feats`` are the row's ``EventFeatures`` (live positions in order, padded
    with ``valid_N`` false entries) and ``forced_N`` the pinned mask; the policy's
    own keep set is added here. The plan is applied by ``apply(plan,
    evicted_scores)`` when given (a turn's ``evict``), else by the engine, with
    ``on_evict(plan, k_LMKD, v_LMKD, scores_M)`` receiving host copies of the
    evicted rows first. Returns ``(state, report)``.
    """
    valid = np.asarray(feats.valid())
    live_pos = np.asarray(feats.positions_N)[valid]
    keep_mask, scores, state = score_and_select(policy, cfg, state, feats, np.asarray(forced_N, bool), np.int32(budget))
    kept = live_pos[np.asarray(keep_mask)[valid]]
    slots = engine.row_state[row].slots
    if layout == "dead_slot":
        plan = layouts.dead_slot(slots, kept)
    elif layout == "compact":
        plan = layouts.compact(slots, kept, engine.fresh_slots(row, kept))
    else:
        raise ConfigError(f"unknown layout {layout!r}; known: {', '.join(LAYOUTS)}")
    live_scores = np.asarray(scores, np.float32)[valid]
    evicted_scores = live_scores[np.searchsorted(live_pos, plan.evicted_positions)]
    margin = float("inf")  # how far the decision was from flipping (a near tie under other arithmetic)
    if evicted_scores.size:
        boundary = float(evicted_scores.max())
        kept_free = np.isin(live_pos, kept) & ~np.asarray(forced_N, bool)[valid]
        above = live_scores[kept_free & (live_scores >= boundary)]
        margin = float(above.min() - boundary) if above.size else float("inf")
    if apply is not None:
        apply(plan, evicted_scores)
    else:
        kv = engine.apply_layout(row, plan, keep_evicted=on_evict is not None and plan.evicted_positions.size > 0)
        if kv is not None:
            on_evict(plan, *kv, evicted_scores)
    return state, CompressionReport(int(live_pos.size), int(kept.size), kept, plan, evicted_scores, margin)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _observe_jit(observe, cfg, state, obs):
    return observe(cfg, state, obs)


class RetentionStage(Stage):
    """Compression events of one session's retention policy (module docstring)."""

    name = "retention"
    edits_holes = True

    def __init__(self, spec: RetentionSpec):
        self.spec = spec
        self.needs = spec.policy.needs(spec.config)

    # -- turn hooks ------------------------------------------------------------------
    def begin(self, turn) -> None:
        key = (turn.session.session_id, self.spec.key)
        self.retention = turn.server.store.get_or_create(key, lambda: RetentionState(self.spec, turn.engine.model.config))
        acc = self.retention.acc_mass
        n = min(acc.size, turn.reused)
        turn.req.mass[:n] = acc[:n]
        self.window = None  # (q [L, W, Hq, D], positions [W])
        self.query_mean = None  # q̄_t [L, Hq, D]
        self.ring_pos = np.zeros(0, np.int64)

    def end(self, turn) -> None:
        if getattr(self, "retention", None) is not None and turn.row is not None:
            self.retention.acc_mass = turn.req.mass.copy()
        self.retention = None

    def prompt_capture(self, turn) -> Capture:
        needs, ids, offset = self.needs, turn.rendered.ids, turn.reused
        n = ids.size
        window_pos = np.arange(max(offset, n - needs.window), n) if needs.window else np.zeros(0, np.int64)
        a, b = turn.rendered.spans.actionable_query
        span_pos = np.arange(max(a, offset), b) if needs.query_mean else np.zeros(0, np.int64)
        ring_pos = np.zeros(0, np.int64)
        if needs.observe_rows and n > offset:
            phase = np.asarray(turn.rendered.phase, np.int32)
            per_phase = int(needs.observe_rows) if not isinstance(needs.observe_rows, bool) else PROMPT_RING_ROWS
            ring_pos = np.sort(np.concatenate([
                np.flatnonzero(phase[offset:] == ph)[-per_phase:] + offset for ph in np.unique(phase[offset:])
            ]))
        self.window_pos, self.span_pos, self.ring_pos = window_pos, span_pos, ring_pos
        return Capture(np.concatenate([window_pos, span_pos, ring_pos]).astype(np.int64), attn_mass=needs.attn_mass)

    def after_prefill(self, turn, captured) -> None:
        if self.window_pos.size:
            self.window = (captured.q_rows(self.window_pos), self.window_pos)
        if self.span_pos.size:
            self.query_mean = captured.q_rows(self.span_pos).mean(axis=1)
        if self.spec.policy.observe is not None:
            ring = self.ring_pos
            q = captured.q_rows(ring) if ring.size else None
            self._observe(turn, q, np.asarray(turn.rendered.phase, np.int32)[ring], new_turn=True)
        self.compress(turn)

    def decode_interval(self, turn) -> int | None:
        return self.needs.decode_interval

    def decode_capture(self, turn) -> Capture:
        return Capture(query_rows=bool(self.needs.window or self.needs.observe_rows), attn_mass=self.needs.attn_mass)

    def after_decode_chunk(self, turn, captured, more: bool) -> None:
        q = captured.q_rows_LXHD  # [L, n, Hq, D] of the fed tokens
        if q is not None and self.needs.window:
            w = min(self.needs.window, q.shape[1])
            self.window = (q[:, -w:], np.arange(captured.end - w, captured.end))
        if q is not None and self.spec.policy.observe is not None:
            self._observe(turn, q, captured.phases, new_turn=False)
        if more:
            self.compress(turn)

    # -- the event ---------------------------------------------------------------------
    def compress(self, turn) -> None:
        """One compression event if the request's live history exceeds the budget."""
        spec, req = self.spec, turn.req
        live_pos = req.live_positions()
        if live_pos.size <= spec.budget:
            return
        cfg = turn.engine.model.config
        seq_len = req.seq_len
        wq, wpos, wvalid = self._window_rows(cfg, req, seq_len)
        qm = self.query_mean if self.query_mean is not None else np.zeros((cfg.num_layers, cfg.num_heads, cfg.head_dim), np.float32)
        n, N = live_pos.size, event_size(live_pos.size)  # one compile per event size, not per event

        def pad(x, fill):
            x = np.asarray(x)
            return np.concatenate([x, np.full(N - n, fill, x.dtype)])

        feats = EventFeatures(  # host arrays: a jnp.asarray here would compile a transfer per shape
            keys_LNKD=turn.engine.gather_keys(turn.row, N),
            positions_N=np.concatenate([live_pos, seq_len + 1 + np.arange(N - n)]).astype(np.int32),
            phase_N=pad(req.phase[live_pos], 3).astype(np.int32),
            window_q_LWHD=wq,
            window_pos_W=wpos,
            window_valid_W=wvalid,
            acc_mass_N=pad(req.mass[live_pos], 0.0).astype(np.float32),
            query_mean_LHD=np.asarray(qm, np.float32),
            seq_len=np.int32(seq_len),
            valid_N=np.arange(N) < n,
            query_span_N=pad(req.query[live_pos], False),
        )
        forced = pad(req.pinned[live_pos], False)
        self.retention.state, report = compress_row(
            turn.engine, turn.row, spec.policy, spec.config, self.retention.state, feats, forced, spec.budget, spec.layout,
            apply=turn.evict,
        )
        turn.session.compressions.append(report)
        if report.plan.renumbered:  # compact: positions are now 0..K-1; the window's are gone
            self.window = None
        turn.observe_live()

    def _window_rows(self, cfg, req, seq_len: int):
        """The observation window as an event reads it: ``window_rows`` query rows
        (the captured ones first, then invalid zero rows), their positions and
        validity. A window shorter than the policy's (a short prompt suffix, a
        short decode chunk) is padded, so the event compiles once per live bucket."""
        W = window_rows(self.needs)
        wq = np.zeros((cfg.num_layers, W, cfg.num_heads, cfg.head_dim), np.float32)
        wpos, wvalid = np.full(W, max(seq_len - 1, 0), np.int32), np.zeros(W, bool)  # padding rows see every key (no empty softmax)
        if self.window is not None:
            q, pos = self.window
            k = min(W, pos.size)
            wq[:, :k], wpos[:k] = q[:, -k:], pos[-k:]
            wvalid[:k] = [req.is_live(p) or p >= seq_len - 1 for p in pos[-k:]]
        return wq, wpos, wvalid

    def _observe(self, turn, q_LXHD, phase_X, *, new_turn: bool) -> None:
        cfg = turn.engine.model.config
        n = 0 if q_LXHD is None else q_LXHD.shape[1]
        X = bucket(max(n, 1), minimum=OBSERVE_ROWS)  # padded rows: one compile (more only past OBSERVE_ROWS)
        q = np.zeros((cfg.num_layers, X, cfg.num_heads, cfg.head_dim), np.float32)
        phases = np.zeros(X, np.int32)
        if n:
            q[:, :n] = q_LXHD
            phases[:n] = phase_X
        qm = self.query_mean if self.query_mean is not None else np.zeros((cfg.num_layers, cfg.num_heads, cfg.head_dim), np.float32)
        obs = Observation(
            q_LXHD=q, phase_X=phases, valid_X=np.arange(X) < n,
            query_mean_LHD=np.asarray(qm, np.float32),
            new_turn=np.bool_(new_turn and self.query_mean is not None),
        )
        self.retention.state = _observe_jit(self.spec.policy.observe, self.spec.config, self.retention.state, obs)


def policy_warmup(policies=None):
    """What a server's warm-up compiles for retention ``policies`` (None: every
    registered policy at its default config; else names, or ``(name, config
    dict)`` pairs): ``(specs, capture_q, attn_mass)``, where ``specs`` pairs each
    policy's scratch-session options with its spec, and the flags say which
    variants of the engine's steps its turns run: steps that capture query rows
    (windows, query spans, phase rows) or attention mass (``jaxkv.step``; decode
    calls capture query rows always)."""
    from jaxkv.policies import REGISTRY

    items = sorted(REGISTRY) if policies is None else list(policies)
    specs, capture_q, attn_mass = [], False, False
    for item in items:
        name, config = (item, {}) if isinstance(item, str) else (item[0], dict(item[1]))
        spec = RetentionSpec.make(name, 1, "dead_slot", config)
        specs.append(({"policy": name, "budget": 1, **config}, spec))
        needs = spec.policy.needs(spec.config)
        capture_q |= bool(needs.window or needs.query_mean or needs.observe_rows)
        attn_mass |= bool(needs.attn_mass)
    return specs, capture_q, attn_mass


def warm_events(spec: RetentionSpec, engine) -> int:
    """Compile one policy's event programs for every live bucket an engine's rows
    can reach (``buckets.event_sizes``): the key gather, ``score_and_select`` and
    ``observe``, on zero features of each shape (the server's warm-up). The shapes
    are those ``RetentionStage.compress`` and ``_observe`` build. Returns the
    programs run."""
    cfg = engine.model.config
    needs = spec.policy.needs(spec.config)
    state = spec.policy.init_state(spec.config, cfg)
    W = window_rows(needs)
    ran = 0
    for N in event_sizes(engine.max_positions):
        keys = engine.pool.gather_keys(engine.cache, np.full(N, SENTINEL_SLOT, np.int32))
        feats = EventFeatures(
            keys_LNKD=keys, positions_N=np.arange(N, dtype=np.int32), phase_N=np.zeros(N, np.int32),
            window_q_LWHD=np.zeros((cfg.num_layers, W, cfg.num_heads, cfg.head_dim), np.float32),
            window_pos_W=np.zeros(W, np.int32), window_valid_W=np.zeros(W, bool),
            acc_mass_N=np.zeros(N, np.float32), query_mean_LHD=np.zeros((cfg.num_layers, cfg.num_heads, cfg.head_dim), np.float32),
            seq_len=np.int32(N), valid_N=np.ones(N, bool), query_span_N=np.zeros(N, bool),
        )
        jax.block_until_ready(score_and_select(spec.policy, spec.config, state, feats, np.zeros(N, bool), np.int32(1)))
        ran += 2
    if spec.policy.observe is not None:
        obs = Observation(
            q_LXHD=np.zeros((cfg.num_layers, OBSERVE_ROWS, cfg.num_heads, cfg.head_dim), np.float32),
            phase_X=np.zeros(OBSERVE_ROWS, np.int32), valid_X=np.zeros(OBSERVE_ROWS, bool),
            query_mean_LHD=np.zeros((cfg.num_layers, cfg.num_heads, cfg.head_dim), np.float32), new_turn=np.bool_(False),
        )
        jax.block_until_ready(_observe_jit(spec.policy.observe, spec.config, state, obs))
        ran += 1
    return ran


def _factory(session, options: dict, built: list):
    name = options.pop("policy", None)
    budget = options.pop("budget", None)
    layout = options.pop("layout", None)
    if name is None:
        if budget is not None or layout is not None:
            raise ConfigError(f"{'budget' if budget is not None else 'layout'} needs a retention policy (policy=...)")
        return None
    layout = "dead_slot" if layout is None else layout
    policy = get_policy(name)
    fields = {f.name for f in dataclasses.fields(policy.config)}
    config = {k: options.pop(k) for k in list(options) if k in fields}
    spec = RetentionSpec.make(name, budget, layout, config, model=session.model)
    spec.policy.init_state(spec.config, session.model.config)  # a state that cannot be built fails here, not mid-turn
    return RetentionStage(spec)


register("retention", 20, _factory)
