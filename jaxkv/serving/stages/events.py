"""One compression event on one row: the decision, its layout plan, and the plan
applied, with a set for the whole model or one per layer.

``score_and_select`` (jit'd per policy, config and padded size) adds the policy's
keep set to the forced positions, scores the candidates and keeps ``F ∪
topk_C(score, B − |F|)`` (ALGORITHMS.md §1); ``compress_row`` turns the kept set
into a ``LayoutPlan`` and applies it (through the turn's ``evict`` when given, so
RepairKV shelves what leaves, else through the engine's KV manager). The per-layer
forms (``score_and_select_layers``, ``layer_features``, ``compress_row_layers``)
do the same for each layer on a one-layer view of the features and apply the
union of the sets. The retention stage (``jaxkv.serving.stages.retention``)
decides when an event fires and with which features; this module only runs one.

Invariants: the decision is a pure function of the policy state and the features;
a forced position is always kept; nothing touches the cache before the plan is
complete, and the report's positions are in the numbering before the event.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.buckets import event_size
from jaxkv.errors import ConfigError
from jaxkv.policies import EventFeatures, layouts
from jaxkv.policies.base import select, select_across_layers
from jaxkv.policies.layouts import LAYOUTS


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


def _scored(policy, cfg, state, feats, forced_N):
    """``(scores, forced, candidates, state)`` of one event: the forced set is the
    engine-forced positions with the policy's keep set added (real entries only),
    the candidates every other real entry."""
    valid = feats.valid()
    forced = jnp.asarray(forced_N, bool)
    if policy.keep is not None:
        forced = forced | policy.keep(cfg, feats)
    forced = forced & valid
    candidates = ~forced & valid
    scores, state = policy.score(cfg, state, feats, candidates)
    return scores, forced, candidates, state


@functools.partial(jax.jit, static_argnames=("policy", "cfg"))
def score_and_select(policy, cfg, state, feats, forced_N, budget):
    """One event's decision, jit'd per (policy, config, padded N): forced set =
    engine-forced ∪ the policy's keep set (real entries only), scores, kept mask."""
    scores, forced, candidates, state = _scored(policy, cfg, state, feats, forced_N)
    return select(scores, forced, candidates, budget), scores, state


def _apply(engine, row: int, plan, evicted_scores, on_evict, apply) -> None:
    """Apply an event's plan: through ``apply(plan, evicted_scores)`` (a turn's
    ``evict``) when given, else through the KV manager, handing ``on_evict`` host
    copies of the evicted rows first."""
    if apply is not None:
        apply(plan, evicted_scores)
        return
    kv = engine.kv.apply_layout(row, plan, keep_evicted=on_evict is not None and plan.evicted_positions.size > 0)
    if kv is not None:
        on_evict(plan, *kv, evicted_scores)


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
    _apply(engine, row, plan, evicted_scores, on_evict, apply)
    return state, CompressionReport(int(live_pos.size), int(kept.size), kept, plan, evicted_scores, margin)


@functools.partial(jax.jit, static_argnames=("policy", "cfg", "shared"))
def score_and_select_layers(policy, cfg, state, feats, forced_LN, budgets_L, shared: bool = False):
    """One per-layer event's decision: the policy scores each layer's view.

    ``feats`` carry a leading layer axis on every field (``[L, ...]``: the
    one-layer views, ``keys_LNKD`` as ``[L, 1, N, Hkv, D]``, positions ``[L, N]``
    of each layer's own live list...), ``forced_LN`` and ``budgets_L`` likewise.
    Each layer keeps ``F_l ∪ topk(score_l, B_l − |F_l|)``; with ``shared`` the
    layers pool their budgets instead (``layer_budgets="shared"``): the model
    keeps ``F ∪ topk(score, ΣB_l − |F|)`` over every layer's candidates at once
    (``select_across_layers``), so a layer whose scores stand out keeps more.
    Returns ``(kept [L, N], scores [L, N], state)``: the policy's state is the one
    it had (scoring a view changes nothing, except a state without a layer axis,
    e.g. a random control's counter, which comes back from layer 0's call)."""
    L = budgets_L.shape[0]

    def one(l, feats_l, forced_l):
        view = state if policy.layer_state is None else policy.layer_state(state, l)
        scores, forced, candidates, new = _scored(policy, cfg, view, feats_l, forced_l)
        return scores, forced, candidates, (new if policy.layer_state is None else ())

    scores, forced, candidates, states = jax.vmap(one)(jnp.arange(L), feats, forced_LN)
    if shared:
        kept = select_across_layers(scores, forced, candidates, jnp.sum(budgets_L))
    else:
        kept = jax.vmap(select)(scores, forced, candidates, budgets_L)
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
    engine, row: int, policy, cfg, state, feats, positions_L, forced_LN, budgets_L, layout: str, *, shared=False, on_evict=None, apply=None
):
    """``compress_row`` for per-layer keep sets: ``feats`` as
    ``score_and_select_layers`` takes them (``shared``: one budget pooled over the
    layers), ``positions_L[l]`` the positions of layer ``l``'s real entries. The
    layout applies the union of the layers' sets (``layouts.with_layers``). An
    evicted row's score is the highest any layer gave it; the margin is the
    smallest over layers (over the model's one ranking when shared). Returns
    ``(state, report)``."""
    kept_LN, scores_LN, state = score_and_select_layers(
        policy, cfg, state, feats, np.asarray(forced_LN, bool), np.asarray(budgets_L, np.int32), shared=bool(shared)
    )
    kept_LN, scores_LN = np.asarray(kept_LN), np.asarray(scores_LN, np.float32)
    forced_LN = np.asarray(forced_LN, bool)
    req = engine.row_state[row]
    L, P = len(positions_L), req.seq_len
    keep_LP = np.zeros((L, P), bool)
    score_LP = np.full((L, P), -np.inf, np.float32)
    dropped_scores, free_scores = [], []  # per layer; the margin compares them within a layer, or across (shared)
    for l, pos in enumerate(positions_L):
        n = pos.size
        keep_LP[l, pos[kept_LN[l, :n]]] = True
        score_LP[l, pos] = scores_LN[l, :n]
        dropped_scores.append(scores_LN[l, :n][~kept_LN[l, :n]])
        free_scores.append(scores_LN[l, :n][kept_LN[l, :n] & ~forced_LN[l, :n]])
    if shared:
        dropped_scores, free_scores = [np.concatenate(dropped_scores)], [np.concatenate(free_scores)]
    margin = float("inf")
    for dropped, free in zip(dropped_scores, free_scores):
        if dropped.size and free.size:
            above = free[free >= dropped.max()]
            margin = min(margin, float(above.min() - dropped.max()) if above.size else float("inf"))
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
    _apply(engine, row, plan, evicted_scores, on_evict, apply)
    report = CompressionReport(live_before, int(kept.size), kept, plan, evicted_scores, margin, keep_LP.sum(axis=1))
    return state, report
