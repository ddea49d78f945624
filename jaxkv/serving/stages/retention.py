"""The retention stage: compression events of a session's retention policy.

Session options it owns: ``policy`` (a name in ``jaxkv.policies.REGISTRY``),
``budget`` (B, live history tokens kept at an event), ``layout`` (``"dead_slot"``
or ``"compact"``), ``keep_sets`` (``"model"``, default: one kept set for every
layer; ``"layer"``: a set per layer) with ``layer_budgets`` (``"equal"``, default:
B in every layer; ``"pyramid"``: PyramidKV's budgets, ``L x B`` in all;
``"shared"``: one pool of ``L x B`` the layers divide by score at each event),
``events`` (``"always"``, default: an event whenever the request reads more than
B; ``"once"``: the session's first such event only, below) and the policy's own
config fields (``w=16``...).

What it does in a turn (ALGORITHMS.md §1-5):

* ``prompt_capture``: the query rows the policy needs from the prompt (SnapKV's
  observation window, IntentKV's actionable-query span, AgentKV's per-phase
  rows) and attention mass (H2O).
* ``after_prefill``: folds them into the policy state (``observe``), then one
  compression event if the live history exceeds B. A policy that scores from
  reconstruction passes (``Needs.reconstruction``: KVzip) runs them first, as
  engine work the hook returns (``reconstruction.run_passes``), and its event
  reads their scores.
* ``after_decode_chunk`` (policies with a decode interval Δ): the same, every Δ
  decoded tokens.

An event (``compress``): live positions P split into forced F (pinned positions:
protected prefix, actionable query; plus the policy's ``keep`` set) and
candidates; ``score_and_select`` (``jaxkv.serving.stages.events``, which runs one
event on one row) keeps ``F ∪ topk_C(score, B − |F|)``; the layout
turns the kept set into a ``LayoutPlan`` and ``Turn.evict`` applies it (the
RepairKV stage shelves what leaves). Reports go to ``session.compressions``.

Per-layer keep sets (``keep_sets="layer"``, ``compress_layers``): layer ``l``
keeps ``F ∪ topk_C(score^l, B_l − |F|)`` of the positions it still reads, scored
by the policy on a one-layer view of the features (``policies.base``); an event
fires when some layer reads more than its ``B_l``. With ``layer_budgets="shared"``
the layers rank their candidates together (``select_across_layers``): the model
keeps ``F ∪ topk_C(score, L·B − |F|)`` over every layer's entries, and an event
fires when the layers read more than ``L·B`` in all. The layout applies the union
of the sets (a slot holds every layer's K/V: it is released only when no layer
keeps its position) and the engine gives each layer its own live list. Every
position some layer drops makes the rest of the request private to the session
in the radix cache (``pipeline.Turn.evict``), and the sets of the cached prefix
come back at the session's next turn (``begin``). The pool's slots are the union
of the sets: per-layer sets read ``B_l`` keys per layer, but hold up to
``min(N, Σ B_l)`` slots.

Once per session (``events="once"``): the session compresses the first time its
live history exceeds B (normally when the context's prefill ends) and never
again; later turns, decode chunks included, only append, whatever the keep sets.
The rule reads the session's reports (``session.compressions`` is not empty), which
outlive its turns as the session does, so it needs no state of its own. RepairKV
still promotes at every turn boundary, from the rows that one event shelved (the
live history then grows by up to K rows a turn). For several questions over one
context compressed once (issue #75's ``multiq``), and for an event too costly to
repeat (KVzip's passes are skipped with it).

State: the policy's pytree state, the per-position attention mass and the
per-layer sets live in the server's LRU session store under ``(session id, spec
key)``, so they outlive a turn (copied into ``RequestState`` at ``begin`` and
back at ``end``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from jaxkv.buckets import bucket, event_size, event_sizes
from jaxkv.cache.allocator import SENTINEL_SLOT
from jaxkv.chat.tags import Phase
from jaxkv.errors import ConfigError, JaxKVError
from jaxkv.models import registry
from jaxkv.policies import EventFeatures, Observation, get_policy
from jaxkv.policies.base import KEEP_SETS, LAYER_BUDGETS, layer_budgets
from jaxkv.policies.intentkv_head import CONFIG_FILE as HEAD_CONFIG_FILE
from jaxkv.policies.intentkv_head import HEAD_FOLDER
from jaxkv.policies.layouts import LAYOUTS
from jaxkv.serving.stages import reconstruction
from jaxkv.serving.stages.base import Capture, Stage, register
from jaxkv.serving.stages.events import compress_row, compress_row_layers, layer_features, score_and_select

EVENTS = ("always", "once")  # when a session's events fire: whenever it is over budget, or its first time only

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
    """A session's retention choice: policy, typed config, budget, layout, and the
    granularity of the kept set (``keep_sets``: ``"model"`` or ``"layer"``;
    ``layer_budgets``: ``"equal"``, ``"pyramid"`` or ``"shared"``, per-layer sets
    only) and when events fire (``events``: ``"always"`` or ``"once"``)."""

    policy: object
    config: object
    budget: int
    layout: str
    keep_sets: str = "model"
    layer_budgets: str = "equal"
    events: str = "always"

    @classmethod
    def make(cls, name, budget, layout, options, model=None, keep_sets="model", layer_budgets="equal", events="always"):
        """``model``: the session's model; a policy with a learned head (``head``
        in its config) and none given takes the head trained for that model
        (``head_folder_of``)."""
        policy = get_policy(name)
        if keep_sets not in KEEP_SETS:
            raise ConfigError(f"unknown keep_sets {keep_sets!r}; known: {', '.join(KEEP_SETS)}")
        if layer_budgets not in LAYER_BUDGETS:
            raise ConfigError(f"unknown layer_budgets {layer_budgets!r}; known: {', '.join(LAYER_BUDGETS)}")
        if events not in EVENTS:
            raise ConfigError(f"unknown events {events!r}; known: {', '.join(EVENTS)}")
        if keep_sets == "model" and layer_budgets != "equal":
            raise ConfigError(f"layer_budgets={layer_budgets!r} splits the budget over per-layer sets: it needs keep_sets='layer'")
        if keep_sets == "layer" and policy.one_set_only:
            raise ConfigError(f"policy {name!r} keeps one set for the model only (keep_sets='layer'): {policy.one_set_only}")
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
        return cls(policy, config, int(budget), layout, keep_sets, layer_budgets, events)

    @property
    def key(self):
        return (self.policy.name, repr(self.config), self.budget, self.layout, self.keep_sets, self.layer_budgets, self.events)


class RetentionState:
    """Per-session policy state plus per-position history that outlives a turn.

    Attributes:
      state: the policy's pytree state (rings, QueryMemory, ...).
      acc_mass: attention mass per position accumulated over the session (H2O).
      layer_live: the per-layer sets of the session's last request (bool ``[L, P]``,
        ``RequestState.layer_live``), or None.
    """

    def __init__(self, spec: RetentionSpec, model_cfg):
        self.spec = spec
        self.state = spec.policy.init_state(spec.config, model_cfg)
        self.acc_mass = np.zeros(0, np.float32)
        self.layer_live: np.ndarray | None = None


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
        saved = self.retention.layer_live
        if self.spec.keep_sets == "layer" and saved is not None and turn.reused:  # the cached prefix's per-layer sets
            live = np.asarray(turn.req.slots, np.int64) != SENTINEL_SLOT
            mask = np.broadcast_to(live, (saved.shape[0], live.size)).copy()
            n = min(saved.shape[1], live.size)
            mask[:, :n] &= saved[:, :n]
            mask[:, live & ~mask.any(axis=0)] = True  # live in the cache but read by no saved layer (not this session's drop): all
            if not mask[:, live].all():
                turn.engine.kv.set_layer_live(turn.row, mask)
        self.window = None  # (q [L, W, Hq, D], positions [W])
        self.query_mean = None  # q̄_t [L, Hq, D]
        self.ring_pos = np.zeros(0, np.int64)

    def end(self, turn) -> None:
        if getattr(self, "retention", None) is not None and turn.row is not None:
            self.retention.acc_mass = turn.req.mass.copy()
            layer_live = turn.req.layer_live
            self.retention.layer_live = None if layer_live is None or turn.req.renumbered else layer_live.copy()
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
            ring_pos = np.sort(
                np.concatenate([np.flatnonzero(phase[offset:] == ph)[-per_phase:] + offset for ph in np.unique(phase[offset:])])
            )
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
        if self.needs.reconstruction:
            return self.compress_after_passes(turn)  # engine work: the pipeline runs it
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
    def event_due(self, turn) -> bool:
        """Whether the request reads more than the budget: its live history (one
        set), or some layer's list more than that layer's budget (per-layer sets).
        Never once the session has compressed, with ``events="once"``."""
        spec, req = self.spec, turn.req
        if spec.events == "once" and turn.session.compressions:  # its one event has run (module docstring)
            return False
        if spec.keep_sets == "layer":
            L = turn.engine.model.config.num_layers
            sizes = [pos.size for pos in req.layer_positions(L)]
            if spec.layer_budgets == "shared":  # the layers' pool: their sizes differ after an event
                return sum(sizes) > L * spec.budget
            return any(n > b for n, b in zip(sizes, layer_budgets(spec.budget, L, spec.layer_budgets)))
        return req.live_positions().size > spec.budget

    def compress_after_passes(self, turn):
        """A turn program: when an event is due, the policy's reconstruction passes
        (``reconstruction.run_passes``), then the event on their scores."""
        if not self.event_due(turn):
            return
        passes = yield from reconstruction.run_passes(turn, self.spec.config)
        self.compress(turn, passes)

    def compress(self, turn, passes=None) -> None:
        """One compression event if the request's live history exceeds the budget;
        ``passes``: the ``reconstruction.PassResult`` a reconstruction policy's
        event scores from (the stage's ``compress_after_passes`` gives it)."""
        if self.needs.reconstruction and passes is None:
            raise JaxKVError(f"policy {self.spec.policy.name!r} scores from reconstruction passes: none ran before this event")
        if not self.event_due(turn):
            return
        if self.spec.keep_sets == "layer":
            return self.compress_layers(turn, passes)
        spec, req = self.spec, turn.req
        live_pos = req.live_positions()
        cfg = turn.engine.model.config
        seq_len = req.seq_len
        wq, wpos, wvalid = self._window_rows(cfg, req, seq_len)
        qm = self.query_mean if self.query_mean is not None else np.zeros((cfg.num_layers, cfg.num_heads, cfg.head_dim), np.float32)
        n, N = live_pos.size, event_size(live_pos.size)  # one compile per event size, not per event

        def pad(x, fill):
            x = np.asarray(x)
            return np.concatenate([x, np.full(N - n, fill, x.dtype)])

        feats = EventFeatures(  # host arrays: a jnp.asarray here would compile a transfer per shape
            keys_LNKD=turn.engine.kv.gather_keys(turn.row, N),
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
            pass_scores_LNK=None if passes is None else passes.scores_LNK,
        )
        forced = pad(req.pinned[live_pos], False)
        self.retention.state, report = compress_row(
            turn.engine, turn.row, spec.policy, spec.config, self.retention.state, feats, forced, spec.budget, spec.layout, apply=turn.evict
        )
        if passes is not None:
            report = dataclasses.replace(report, scoring_tokens=passes.tokens)
        turn.session.compressions.append(report)
        if report.plan.renumbered:  # compact: positions are now 0..K-1; the window's are gone
            self.window = None
        turn.observe_live()

    def compress_layers(self, turn, passes=None) -> None:
        """One per-layer event (``keep_sets="layer"``), called by ``compress`` when
        some layer reads more than its budget (``layer_features``,
        ``compress_row_layers``)."""
        spec, req, engine = self.spec, turn.req, turn.engine
        cfg = engine.model.config
        budgets = layer_budgets(spec.budget, cfg.num_layers, spec.layer_budgets)
        qm = self.query_mean if self.query_mean is not None else np.zeros((cfg.num_layers, cfg.num_heads, cfg.head_dim), np.float32)
        scores = None if passes is None else passes.scores_LNK
        feats, per_layer, forced = layer_features(engine, turn.row, *self._window_rows(cfg, req, req.seq_len), qm, scores)
        self.retention.state, report = compress_row_layers(
            engine,
            turn.row,
            spec.policy,
            spec.config,
            self.retention.state,
            feats,
            per_layer,
            forced,
            budgets,
            spec.layout,
            shared=spec.layer_budgets == "shared",
            apply=turn.evict,
        )
        if passes is not None:
            report = dataclasses.replace(report, scoring_tokens=passes.tokens)
        turn.session.compressions.append(report)
        if report.plan.renumbered:
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
            q_LXHD=q,
            phase_X=phases,
            valid_X=np.arange(X) < n,
            query_mean_LHD=np.asarray(qm, np.float32),
            new_turn=np.bool_(new_turn and self.query_mean is not None),
        )
        self.retention.state = _observe_jit(self.spec.policy.observe, self.spec.config, self.retention.state, obs)


def policy_warmup(policies=None):
    """What a server's warm-up compiles for retention ``policies`` (None: every
    registered policy at its default config; else names, or ``(name, config
    dict)`` pairs): ``(specs, variants)``, where ``specs`` pairs each policy's
    scratch-session options with its spec, and ``variants`` are the flags of
    ``jaxkv.engine.warmup.warmup`` saying which variants of the engine's programs
    its turns run: steps that bring back query rows (windows, query spans, phase
    rows: ``capture_q``) or attention mass (``attn_mass``), decode calls that bring
    back every fed token's query (``decode_q``: a policy that compresses during
    decode and reads windows or phase rows, ``decode_capture``), and steps that
    bring back every flat token's query (``capture_wide``: a reconstruction
    policy's passes, ``PrefillJob.wide_capture``)."""
    from jaxkv.policies import REGISTRY

    items = sorted(REGISTRY) if policies is None else list(policies)
    specs, variants = [], dict(capture_q=False, attn_mass=False, decode_q=False, capture_wide=False)
    for item in items:
        name, config = (item, {}) if isinstance(item, str) else (item[0], dict(item[1]))
        spec = RetentionSpec.make(name, 1, "dead_slot", config)
        specs.append(({"policy": name, "budget": 1, **config}, spec))
        needs = spec.policy.needs(spec.config)
        variants["capture_q"] |= bool(needs.window or needs.query_mean or needs.observe_rows or needs.reconstruction)
        variants["attn_mass"] |= bool(needs.attn_mass)
        variants["decode_q"] |= bool(needs.decode_interval and (needs.window or needs.observe_rows) and not needs.attn_mass)
        variants["capture_wide"] |= bool(needs.reconstruction)
    return specs, variants


def warm_events(spec: RetentionSpec, engine) -> int:
    """Compile one policy's event programs for every live bucket an engine's rows
    can reach (``buckets.event_sizes``): the key gather, ``score_and_select`` and
    ``observe``, on zero features of each shape (the server's warm-up), and a
    reconstruction policy's pass scoring (``reconstruction.warm``). The shapes
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
            keys_LNKD=keys,
            positions_N=np.arange(N, dtype=np.int32),
            phase_N=np.zeros(N, np.int32),
            window_q_LWHD=np.zeros((cfg.num_layers, W, cfg.num_heads, cfg.head_dim), np.float32),
            window_pos_W=np.zeros(W, np.int32),
            window_valid_W=np.zeros(W, bool),
            acc_mass_N=np.zeros(N, np.float32),
            query_mean_LHD=np.zeros((cfg.num_layers, cfg.num_heads, cfg.head_dim), np.float32),
            seq_len=np.int32(N),
            valid_N=np.ones(N, bool),
            query_span_N=np.zeros(N, bool),
            pass_scores_LNK=np.zeros((cfg.num_layers, N, cfg.num_kv_heads), np.float32) if needs.reconstruction else None,
        )
        jax.block_until_ready(score_and_select(spec.policy, spec.config, state, feats, np.zeros(N, bool), np.int32(1)))
        ran += 2
    if spec.policy.observe is not None:
        obs = Observation(
            q_LXHD=np.zeros((cfg.num_layers, OBSERVE_ROWS, cfg.num_heads, cfg.head_dim), np.float32),
            phase_X=np.zeros(OBSERVE_ROWS, np.int32),
            valid_X=np.zeros(OBSERVE_ROWS, bool),
            query_mean_LHD=np.zeros((cfg.num_layers, cfg.num_heads, cfg.head_dim), np.float32),
            new_turn=np.bool_(False),
        )
        jax.block_until_ready(_observe_jit(spec.policy.observe, spec.config, state, obs))
        ran += 1
    if needs.reconstruction:
        ran += reconstruction.warm(spec.config, engine)
    return ran


def _factory(session, options: dict, built: list):
    name = options.pop("policy", None)
    budget = options.pop("budget", None)
    layout = options.pop("layout", None)
    keep_sets = options.pop("keep_sets", None)
    shape = options.pop("layer_budgets", None)
    events = options.pop("events", None)
    if name is None:
        named = (("budget", budget), ("layout", layout), ("keep_sets", keep_sets), ("layer_budgets", shape), ("events", events))
        given = [k for k, v in named if v is not None]
        if given:
            raise ConfigError(f"{given[0]} needs a retention policy (policy=...)")
        return None
    layout = "dead_slot" if layout is None else layout
    policy = get_policy(name)
    fields = {f.name for f in dataclasses.fields(policy.config)}
    config = {k: options.pop(k) for k in list(options) if k in fields}
    spec = RetentionSpec.make(
        name,
        budget,
        layout,
        config,
        model=session.model,
        keep_sets=keep_sets or "model",
        layer_budgets=shape or "equal",
        events=events or "always",
    )
    server = getattr(session, "server", None)
    if spec.keep_sets == "layer" and server is not None and not server.engine.layer_lists:
        raise ConfigError(
            "keep_sets='layer' needs a server whose engine keeps a live list per layer: Server(model, layer_lists=True) "
            "(a session without server= builds one)"
        )
    spec.policy.init_state(spec.config, session.model.config)  # a state that cannot be built fails here, not mid-turn
    if spec.policy.needs(spec.config).reconstruction and getattr(session.model, "tokenizer", None) is None:
        raise ConfigError(f"policy {name!r} repeats the context to score it: it needs the model's tokenizer (the repeat prompt)")
    return RetentionStage(spec)


register("retention", 20, _factory)
