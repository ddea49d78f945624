"""The retention stage: compression events of a session's retention policy.

Session options it owns: ``policy`` (a name in ``jaxkv.policies.REGISTRY``),
``budget`` (B, live history tokens kept at an event), ``layout`` (``"dead_slot"``
or ``"compact"``), ``keep_sets`` (``"model"``, default: one kept set for every
layer; ``"layer"``: a set per layer) with ``layer_budgets`` (``"equal"``, default:
B in every layer; ``"pyramid"``: PyramidKV's budgets, ``L x B`` in all) and the
policy's own config fields (``w=16``...).

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
candidates; ``score_and_select`` keeps ``F ∪ topk_C(score, B − |F|)``; the layout
turns the kept set into a ``LayoutPlan`` and ``Turn.evict`` applies it (the
RepairKV stage shelves what leaves). Reports go to ``session.compressions``.

Per-layer keep sets (``keep_sets="layer"``, ``compress_layers``): layer ``l``
keeps ``F ∪ topk_C(score^l, B_l − |F|)`` of the positions it still reads, scored
by the policy on a one-layer view of the features (``policies.base``); an event
fires when some layer reads more than its ``B_l``. The layout applies the union
of the sets (a slot holds every layer's K/V: it is released only when no layer
keeps its position) and the engine gives each layer its own live list. Every
position some layer drops makes the rest of the request private to the session
in the radix cache (``pipeline.Turn.evict``), and the sets of the cached prefix
come back at the session's next turn (``begin``). The pool's slots are the union
of the sets: per-layer sets read ``B_l`` keys per layer, but hold up to
``min(N, Σ B_l)`` slots.

State: the policy's pytree state, the per-position attention mass and the
per-layer sets live in the server's LRU session store under ``(session id, spec
key)``, so they outlive a turn (copied into ``RequestState`` at ``begin`` and
back at ``end``).
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
from jaxkv.errors import ConfigError, JaxKVError
from jaxkv.models import registry
from jaxkv.policies import EventFeatures, Observation, get_policy, layouts
from jaxkv.policies.base import KEEP_SETS, LAYER_BUDGETS, layer_budgets, select
from jaxkv.policies.intentkv_head import CONFIG_FILE as HEAD_CONFIG_FILE
from jaxkv.policies.intentkv_head import HEAD_FOLDER
from jaxkv.policies.layouts import LAYOUTS
from jaxkv.serving.stages import reconstruction
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
    """A session's retention choice: policy, typed config, budget, layout, and the
    granularity of the kept set (``keep_sets``: ``"model"`` or ``"layer"``;
    ``layer_budgets``: ``"equal"`` or ``"pyramid"``, per-layer sets only)."""

    policy: object
    config: object
    budget: int
    layout: str
    keep_sets: str = "model"
    layer_budgets: str = "equal"

    @classmethod
    def make(cls, name, budget, layout, options, model=None, keep_sets="model", layer_budgets="equal"):
        """``model``: the session's model; a policy with a learned head (``head``
        in its config) and none given takes the head trained for that model
        (``head_folder_of``)."""
        policy = get_policy(name)
        if keep_sets not in KEEP_SETS:
            raise ConfigError(f"unknown keep_sets {keep_sets!r}; known: {', '.join(KEEP_SETS)}")
        if layer_budgets not in LAYER_BUDGETS:
            raise ConfigError(f"unknown layer_budgets {layer_budgets!r}; known: {', '.join(LAYER_BUDGETS)}")
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
        return cls(policy, config, int(budget), layout, keep_sets, layer_budgets)

    @property
    def key(self):
        return (self.policy.name, repr(self.config), self.budget, self.layout, self.keep_sets, self.layer_budgets)


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


@dataclasses.dataclass(frozen=True)
class CompressionReport:
    """What one compression event did (positions in the numbering before it)."""

    live_before: int
    live_after: int
    kept_positions: np.ndarray
    plan: object
    evicted_scores: np.ndarray | None = None  # policy score of each plan.evicted_positions entry
    decision_margin: float = float("inf")  # lowest kept candidate score minus highest evicted one (inf: none evicted)
    layer_live_after: np.ndarray | None = None  # per-layer sets: positions each layer reads after the event ([L])
    scoring_tokens: int = 0  # tokens forwarded to score the event beside the context's own (KVzip's reconstruction passes)


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
        plan = layouts.compact(slots, kept, engine.kv.fresh_slots(row, kept))
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
        kv = engine.kv.apply_layout(row, plan, keep_evicted=on_evict is not None and plan.evicted_positions.size > 0)
        if kv is not None:
            on_evict(plan, *kv, evicted_scores)
    return state, CompressionReport(int(live_pos.size), int(kept.size), kept, plan, evicted_scores, margin)


@functools.partial(jax.jit, static_argnames=("policy", "cfg"))
def score_and_select_layers(policy, cfg, state, feats, forced_LN, budgets_L):
    """One per-layer event's decision: ``score_and_select`` on each layer's view.

    ``feats`` carry a leading layer axis on every field (``[L, ...]``: the
    one-layer views, ``keys_LNKD`` as ``[L, 1, N, Hkv, D]``, positions ``[L, N]``
    of each layer's own live list...), ``forced_LN`` and ``budgets_L`` likewise.
    Returns ``(kept [L, N], scores [L, N], state)``: the policy's state is the one
    it had (scoring a view changes nothing, except a state without a layer axis,
    e.g. a random control's counter, which comes back from layer 0's call)."""
    L = budgets_L.shape[0]

    def one(l, feats_l, forced_l, budget_l):
        view = state if policy.layer_state is None else policy.layer_state(state, l)
        kept, scores, new = score_and_select(policy, cfg, view, feats_l, forced_l, budget_l)
        return kept, scores, (new if policy.layer_state is None else ())

    kept, scores, states = jax.vmap(one)(jnp.arange(L), feats, forced_LN, budgets_L)
    return kept, scores, (jax.tree.map(lambda x: x[0], states) if policy.layer_state is None else state)


def layer_features(engine, row: int, window_q_LWHD, window_pos_W, window_valid_W, query_mean_LHD, pass_scores_LNK=None):
    """A per-layer event's features of a row: ``(feats, positions_L, forced_LN)``.

    ``feats`` stack the one-layer views ``score_and_select_layers`` takes: layer
    ``l``'s keys are those of its own live list (``Engine.gather_layer_keys``),
    ``[L, 1, N, Hkv, D]``, its positions, phases, mass and query-span flags those
    of the positions it reads (``[L, N]``, padded as one set's are), the window's
    queries and the query mean cut to layer ``l``. ``N`` is the event size of the
    row's union of live positions (one compile per size, as for one set);
    ``forced_LN`` the pinned positions of each layer's list. ``pass_scores_LNK``
    (reconstruction passes' scores over the union's entries, ``[L, N, Hkv]``)
    become each layer's view of its own entries, ``[L, 1, N, Hkv]``."""
    req = engine.row_state[row]
    L = engine.model.config.num_layers
    seq_len = req.seq_len
    N = event_size(req.live_positions().size)
    keys, per_layer = engine.kv.gather_layer_keys(row, N)

    def per_position(values, fill, dtype):
        out = np.full((L, N), fill, dtype)
        for l, pos in enumerate(per_layer):
            out[l, : pos.size] = np.asarray(values)[pos]
        return out

    wpos, wvalid = np.asarray(window_pos_W), np.asarray(window_valid_W)
    layer_pass = None
    if pass_scores_LNK is not None:
        union, S = req.live_positions(), np.asarray(pass_scores_LNK, np.float32)
        layer_pass = np.zeros((L, 1, *S.shape[1:]), np.float32)
        for l, pos in enumerate(per_layer):
            layer_pass[l, 0, : pos.size] = S[l, np.searchsorted(union, pos)]
    feats = EventFeatures(
        keys_LNKD=keys[:, None],
        positions_N=np.stack([np.concatenate([pos, seq_len + 1 + np.arange(N - pos.size)]) for pos in per_layer]).astype(np.int32),
        phase_N=per_position(req.phase, 3, np.int32),
        window_q_LWHD=np.asarray(window_q_LWHD, np.float32)[:, None],
        window_pos_W=np.broadcast_to(wpos, (L, wpos.size)),
        window_valid_W=np.broadcast_to(wvalid, (L, wvalid.size)),
        acc_mass_N=per_position(req.mass, 0.0, np.float32),
        query_mean_LHD=np.asarray(query_mean_LHD, np.float32)[:, None],
        seq_len=np.full(L, seq_len, np.int32),
        valid_N=np.arange(N)[None, :] < np.asarray([pos.size for pos in per_layer])[:, None],
        query_span_N=per_position(req.query, False, bool),
        pass_scores_LNK=layer_pass,
    )
    return feats, per_layer, per_position(req.pinned, False, bool)


def compress_row_layers(
    engine, row: int, policy, cfg, state, feats, positions_L, forced_LN, budgets_L, layout: str, *, on_evict=None, apply=None
):
    """``compress_row`` for per-layer keep sets: ``feats`` as
    ``score_and_select_layers`` takes them, ``positions_L[l]`` the positions of
    layer ``l``'s real entries. The layout applies the union of the layers' sets
    (``layouts.with_layers``). An evicted row's score is the highest any layer gave
    it; the margin is the smallest over layers. Returns ``(state, report)``."""
    kept_LN, scores_LN, state = score_and_select_layers(
        policy, cfg, state, feats, np.asarray(forced_LN, bool), np.asarray(budgets_L, np.int32)
    )
    kept_LN, scores_LN = np.asarray(kept_LN), np.asarray(scores_LN, np.float32)
    forced_LN = np.asarray(forced_LN, bool)
    req = engine.row_state[row]
    L, P = len(positions_L), req.seq_len
    keep_LP = np.zeros((L, P), bool)
    score_LP = np.full((L, P), -np.inf, np.float32)
    margin = float("inf")
    for l, pos in enumerate(positions_L):
        n = pos.size
        keep_LP[l, pos[kept_LN[l, :n]]] = True
        score_LP[l, pos] = scores_LN[l, :n]
        dropped = ~kept_LN[l, :n]
        free = kept_LN[l, :n] & ~forced_LN[l, :n]
        if dropped.any() and free.any():
            boundary = scores_LN[l, :n][dropped].max()
            above = scores_LN[l, :n][free & (scores_LN[l, :n] >= boundary)]
            margin = min(margin, float(above.min() - boundary) if above.size else float("inf"))
    kept = np.flatnonzero(keep_LP.any(axis=0))
    if layout == "dead_slot":
        plan = layouts.dead_slot(req.slots, kept)
    elif layout == "compact":
        plan = layouts.compact(req.slots, kept, engine.kv.fresh_slots(row, kept))
    else:
        raise ConfigError(f"unknown layout {layout!r}; known: {', '.join(LAYOUTS)}")
    plan = layouts.with_layers(plan, keep_LP)
    evicted_scores = score_LP[:, plan.evicted_positions].max(axis=0) if plan.evicted_positions.size else np.zeros(0, np.float32)
    live_before = int(req.live_positions().size)
    if apply is not None:
        apply(plan, evicted_scores)
    else:
        kv = engine.kv.apply_layout(row, plan, keep_evicted=on_evict is not None and plan.evicted_positions.size > 0)
        if kv is not None:
            on_evict(plan, *kv, evicted_scores)
    report = CompressionReport(live_before, int(kept.size), kept, plan, evicted_scores, margin, keep_LP.sum(axis=1))
    return state, report


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
        set), or some layer's list more than that layer's budget (per-layer sets)."""
        spec, req = self.spec, turn.req
        if spec.keep_sets == "layer":
            L = turn.engine.model.config.num_layers
            return any(pos.size > b for pos, b in zip(req.layer_positions(L), layer_budgets(spec.budget, L, spec.layer_budgets)))
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
    if name is None:
        given = [
            k for k, v in (("budget", budget), ("layout", layout), ("keep_sets", keep_sets), ("layer_budgets", shape)) if v is not None
        ]
        if given:
            raise ConfigError(f"{given[0]} needs a retention policy (policy=...)")
        return None
    layout = "dead_slot" if layout is None else layout
    policy = get_policy(name)
    fields = {f.name for f in dataclasses.fields(policy.config)}
    config = {k: options.pop(k) for k in list(options) if k in fields}
    spec = RetentionSpec.make(
        name, budget, layout, config, model=session.model, keep_sets=keep_sets or "model", layer_budgets=shape or "equal"
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
