"""Retention policies: the kept set is exactly F ∪ top-k of each method's scores, and
each scorer computes its paper rule (checked against numpy references by hand).

Shapes are tiny (L=2, N=48, Hq=4, Hkv=2, D=16); data is random from fixed seeds.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.chat.tags import Phase
from jaxkv.config import ModelConfig
from jaxkv.policies import REGISTRY, EventFeatures, Needs, Observation, get_policy, select
from jaxkv.policies.agentkv import AgentKVState
from jaxkv.policies.intentkv import QueryMemory
from jaxkv.policies.snapkv import pool_1d

L, N, HQ, HKV, D, W, X = 2, 48, 4, 2, 16, 8, 24
G = HQ // HKV
MODEL_CFG = ModelConfig(
    model_type="qwen3", vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=L, num_heads=HQ, num_kv_heads=HKV, head_dim=D
)
ALL_METHODS = (
    "agentkv",
    "expected_attention",
    "h2o",
    "intentkv_memory",
    "intentkv_query",
    "keydiff",
    "oldest",
    "random",
    "snapkv",
    "streaming_llm",
    "tova",
)


# -- builders ---------------------------------------------------------------------
def make_feats(seed, n=N, w=W, positions=None, window_valid=None):
    """Random event features; live positions have holes (earlier evictions)."""
    rng = np.random.default_rng(seed)
    if positions is None:
        positions = np.sort(rng.choice(n + 16, size=n, replace=False))
    positions = np.asarray(positions, np.int32)
    window_pos = positions[-w:]
    valid = np.ones(w, bool) if window_valid is None else np.asarray(window_valid, bool)
    return EventFeatures(
        keys_LNKD=jnp.asarray(rng.normal(size=(L, len(positions), HKV, D)), jnp.float32),
        positions_N=jnp.asarray(positions),
        phase_N=jnp.asarray(rng.integers(0, len(Phase), len(positions)), jnp.int32),
        window_q_LWHD=jnp.asarray(rng.normal(size=(L, w, HQ, D)) * 2.0, jnp.float32),
        window_pos_W=jnp.asarray(window_pos),
        window_valid_W=jnp.asarray(valid),
        acc_mass_N=jnp.asarray(rng.uniform(0.1, 5.0, len(positions)), jnp.float32),
        query_mean_LHD=jnp.asarray(rng.normal(size=(L, HQ, D)), jnp.float32),
        seq_len=jnp.asarray(positions[-1] + 1, jnp.int32),
    )


def make_obs(seed, x=X, phases=None, valid=None, new_turn=True):
    rng = np.random.default_rng(seed)
    phases = rng.integers(0, len(Phase), x) if phases is None else np.asarray(phases)
    return Observation(
        q_LXHD=jnp.asarray(rng.normal(size=(L, len(phases), HQ, D)), jnp.float32),
        phase_X=jnp.asarray(phases, jnp.int32),
        valid_X=jnp.asarray(np.ones(len(phases), bool) if valid is None else valid),
        query_mean_LHD=jnp.asarray(rng.normal(size=(L, HQ, D)), jnp.float32),
        new_turn=jnp.asarray(new_turn),
    )


@functools.lru_cache(maxsize=None)
def jitted(name):
    """(cfg, jit'd score, jit'd observe or None) of a registered method, compiled once."""
    policy = get_policy(name)
    cfg = policy.make_config()
    obs = jax.jit(functools.partial(policy.observe, cfg)) if policy.observe else None
    return cfg, jax.jit(functools.partial(policy.score, cfg)), obs


select_jit = jax.jit(select)


# -- numpy oracles ----------------------------------------------------------------
def np_topk_kept(scores, positions, forced, candidates, budget):
    """F ∪ top-(B−|F|) candidates by score, ties to the lower position."""
    forced = np.asarray(forced, bool)
    cand = np.asarray(candidates, bool) & ~forced
    k = max(budget - int(forced.sum()), 0)
    ranked = sorted(np.flatnonzero(cand), key=lambda i: (-float(scores[i]), int(positions[i])))
    kept = forced.copy()
    kept[ranked[:k]] = True
    return kept


def np_softmax(s, mask):
    s = np.where(mask, s, -np.inf)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def np_logits(q_LRHD, keys_LNKD):
    """Scaled dot products ``[L, Hq, R, N]`` with K expanded under GQA."""
    k_LNHD = np.repeat(np.asarray(keys_LNKD, np.float64), G, axis=2)
    return np.einsum("lrhd,lnhd->lhrn", np.asarray(q_LRHD, np.float64), k_LNHD) / np.sqrt(D)


def np_candidate_score(q_LRHD, keys_LNKD, cand):
    """mean over rows, layers, heads of softmax over candidates (AgentKV / IntentKV)."""
    p = np_softmax(np_logits(q_LRHD, keys_LNKD), np.asarray(cand, bool)[None, None, None])
    return np.where(cand, p.mean(axis=(0, 1, 2)), 0.0)


def np_causal_probs(feats):
    """Window rows' softmax over the live keys each sees: ``[L, Hq, W, N]``."""
    pos = np.asarray(feats.positions_N)
    mask = pos[None, :] <= np.asarray(feats.window_pos_W)[:, None]
    return np_softmax(np_logits(feats.window_q_LWHD, feats.keys_LNKD), mask[None, None])


# -- every method: kept set is exactly F ∪ top-k of its scores --------------------
def policy_scores(name, feats):
    policy = get_policy(name)
    cfg, score, observe = jitted(name)
    state = policy.init_state(cfg, MODEL_CFG)
    if observe is not None:
        state = observe(state, make_obs(7))
    own = np.zeros(N, bool) if policy.keep is None else np.asarray(policy.keep(cfg, feats))
    rng = np.random.default_rng(11)
    engine_forced = np.asarray(feats.positions_N) < 12  # a protected prefix ...
    engine_forced[rng.choice(N, 3, replace=False)] = True  # ... and a scattered query span
    forced = own | engine_forced
    candidates = ~forced
    scores, _ = score(state, feats, jnp.asarray(candidates))
    return np.asarray(scores), forced, candidates


@pytest.mark.parametrize("budget", [6, 24, N + 4])
@pytest.mark.parametrize("name", ALL_METHODS)
def test_kept_set_is_forced_plus_topk(name, budget):
    feats = make_feats(3)
    scores, forced, candidates = policy_scores(name, feats)
    assert scores.shape == (N,) and np.isfinite(scores[candidates]).all()
    kept = np.asarray(select_jit(jnp.asarray(scores), jnp.asarray(forced), jnp.asarray(candidates), budget))
    expected = np_topk_kept(scores, np.asarray(feats.positions_N), forced, candidates, budget)
    np.testing.assert_array_equal(kept, expected)
    assert kept[forced].all()
    if forced.sum() <= budget:
        assert kept.sum() == min(budget, forced.sum() + candidates.sum())
    else:
        assert kept.sum() == forced.sum()


def test_registry_holds_every_method():
    assert set(ALL_METHODS) <= set(REGISTRY)


@pytest.mark.parametrize("name", ALL_METHODS)
def test_config_is_frozen_and_documents_every_field(name):
    policy = get_policy(name)
    cfg = policy.make_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(cfg, "x", 1)
    for field in dataclasses.fields(policy.config):
        assert f"{field.name}:" in policy.config.__doc__, (name, field.name)


EXPECTED_NEEDS = {
    "streaming_llm": Needs(),
    "snapkv": Needs(window=32),
    "h2o": Needs(attn_mass=True, decode_interval=128),
    "tova": Needs(window=1, decode_interval=128),
    "random": Needs(),
    "oldest": Needs(),
    "agentkv": Needs(observe_rows=True, decode_interval=128),
    "intentkv_memory": Needs(query_mean=True),
    "intentkv_query": Needs(query_mean=True),
    "keydiff": Needs(),
    "expected_attention": Needs(window=256),
}


@pytest.mark.parametrize("name", ALL_METHODS)
def test_needs_defaults(name):
    policy = get_policy(name)
    assert policy.needs(policy.make_config()) == EXPECTED_NEEDS[name]


def test_needs_follow_config():
    assert get_policy("snapkv").needs(get_policy("snapkv").make_config(w=5)).window == 5
    for name in ("h2o", "tova", "agentkv", "streaming_llm"):
        policy = get_policy(name)
        assert policy.needs(policy.make_config(decode_interval=64)).decode_interval == 64


# -- select -------------------------------------------------------------------------
def test_select_ties_break_to_lower_position():
    scores = jnp.asarray([1.0, 2.0, 2.0, 0.0, 2.0, 2.0])
    none = jnp.zeros(6, bool)
    kept = select(scores, none, jnp.ones(6, bool), 2)
    np.testing.assert_array_equal(kept, [False, True, True, False, False, False])
    # a forced position takes budget but not a candidate's place in the ranking
    forced = none.at[0].set(True)
    kept = select(scores, forced, jnp.ones(6, bool), 3)
    np.testing.assert_array_equal(kept, [True, True, True, False, False, False])


def test_select_budget_below_forced_keeps_exactly_forced():
    forced = jnp.asarray([True, False, True, True, False, True])
    kept = select(jnp.arange(6.0), forced, jnp.ones(6, bool), 2)
    np.testing.assert_array_equal(kept, forced)


def test_select_drops_non_candidates_and_jits():
    rng = np.random.default_rng(0)
    for budget in (0, 5, 17, 40):
        scores = jnp.asarray(rng.integers(0, 4, 32), jnp.float32)  # many ties
        forced = jnp.asarray(rng.random(32) < 0.2)
        cand = jnp.asarray(rng.random(32) < 0.7)
        kept = np.asarray(select_jit(scores, forced, cand, budget))
        np.testing.assert_array_equal(kept, np.asarray(select(scores, forced, cand, budget)))
        np.testing.assert_array_equal(kept, np_topk_kept(np.asarray(scores), np.arange(32), forced, cand & ~forced, budget))
        assert not kept[~np.asarray(forced) & ~np.asarray(cand)].any()


# -- registry and configs -----------------------------------------------------------
def test_make_config_rejects_unknown_options():
    with pytest.raises(TypeError, match="bogus.*window_size"):
        get_policy("snapkv").make_config(kernel=3, bogus=1, window_size=4)
    assert get_policy("snapkv").make_config(kernel=3, pooling="avg").kernel == 3
    with pytest.raises(TypeError, match="beta"):
        get_policy("intentkv_query").make_config(beta=0.5)


def test_get_policy_unknown_lists_known():
    with pytest.raises(ValueError, match="nope.*agentkv.*snapkv"):
        get_policy("nope")


def test_config_validation():
    with pytest.raises(ValueError, match="pooling"):
        get_policy("snapkv").make_config(pooling="median")
    with pytest.raises(ValueError, match="multiple of 4"):
        get_policy("agentkv").make_config(q=6)


# -- baselines, hand-checked --------------------------------------------------------
def test_snapkv_pooling_max_vs_avg():
    x = jnp.asarray([3.0, 0.0, 0.0, 0.0, 0.0, 6.0])
    np.testing.assert_allclose(pool_1d(x, 3, "max"), [3, 3, 0, 0, 6, 6])
    np.testing.assert_allclose(pool_1d(x, 3, "avg"), [1.5, 1, 0, 0, 2, 3])  # edges: in-range mean
    np.testing.assert_allclose(pool_1d(x, 1, "avg"), x)
    # an even kernel still gives a same-size output (one more on the right)
    np.testing.assert_allclose(pool_1d(x, 2, "max"), [3, 0, 0, 0, 6, 6])


@pytest.mark.parametrize("pooling", ["max", "avg"])
def test_snapkv_score_matches_numpy(pooling):
    valid = np.ones(W, bool)
    valid[0] = False
    feats = make_feats(5, window_valid=valid)
    policy = get_policy("snapkv")
    cfg = policy.make_config(kernel=5, pooling=pooling)
    scores, _ = policy.score(cfg, (), feats, jnp.ones(N, bool))
    probs = np_causal_probs(feats)[:, :, valid]  # [L, Hq, W', N]
    mass_LKN = probs.sum(axis=2).reshape(L, HKV, G, N).mean(axis=2)
    padded = np.pad(mass_LKN, [(0, 0), (0, 0), (2, 2)], constant_values=np.nan)
    win = np.stack([padded[..., i : i + N] for i in range(5)])
    pooled = np.nanmax(win, axis=0) if pooling == "max" else np.nanmean(win, axis=0)
    np.testing.assert_allclose(scores, pooled.mean(axis=(0, 1)), rtol=1e-5, atol=1e-7)
    # the window rows' positions are kept, the invalid row's is not
    kept = np.asarray(policy.keep(cfg, feats))
    np.testing.assert_array_equal(kept, np.isin(np.asarray(feats.positions_N), np.asarray(feats.window_pos_W)[valid]))


@pytest.mark.parametrize("last_valid", [W - 1, W - 3])
def test_tova_is_attention_of_last_row(last_valid):
    valid = np.arange(W) <= last_valid
    feats = make_feats(6, window_valid=valid)
    policy = get_policy("tova")
    cfg = policy.make_config()
    scores, _ = policy.score(cfg, (), feats, jnp.ones(N, bool))
    expected = np_causal_probs(feats)[:, :, last_valid].mean(axis=(0, 1))
    np.testing.assert_allclose(scores, expected, rtol=1e-5, atol=1e-7)
    assert np.all(expected[np.asarray(feats.positions_N) > int(feats.window_pos_W[last_valid])] == 0)
    kept = np.asarray(policy.keep(cfg, feats))
    np.testing.assert_array_equal(np.flatnonzero(kept), [N - W + last_valid])


def test_h2o_scores_are_accumulated_mass_with_recent_floor():
    feats = make_feats(8)
    policy = get_policy("h2o")
    cfg = policy.make_config(recent=5)
    scores, _ = policy.score(cfg, (), feats, jnp.ones(N, bool))
    np.testing.assert_array_equal(scores, feats.acc_mass_N)
    np.testing.assert_array_equal(np.flatnonzero(policy.keep(cfg, feats)), np.arange(N - 5, N))


def run_event(name, feats, budget, **options):
    policy = get_policy(name)
    cfg = policy.make_config(**options)
    forced = policy.keep(cfg, feats) if policy.keep else jnp.zeros(N, bool)
    state = policy.init_state(cfg, MODEL_CFG)
    scores, _ = policy.score(cfg, state, feats, ~forced)
    return np.flatnonzero(select(scores, forced, ~forced, budget))


def test_streaming_llm_keeps_sinks_and_most_recent():
    feats = make_feats(9, positions=np.arange(N))
    np.testing.assert_array_equal(run_event("streaming_llm", feats, 10), [0, 1, 2, 3, *range(N - 6, N)])
    np.testing.assert_array_equal(run_event("streaming_llm", feats, 10, n_sink=2), [0, 1, *range(N - 8, N)])


def test_oldest_keeps_oldest():
    feats = make_feats(10)
    np.testing.assert_array_equal(run_event("oldest", feats, 7), np.arange(7))


def test_random_is_reproducible_and_fresh_per_event():
    feats = make_feats(11)
    policy = get_policy("random")
    cand = jnp.ones(N, bool)

    def two_events(seed):
        cfg = policy.make_config(seed=seed)
        s1, state = policy.score(cfg, policy.init_state(cfg, MODEL_CFG), feats, cand)
        s2, state = policy.score(cfg, state, feats, cand)
        assert int(state) == 2
        return np.asarray(s1), np.asarray(s2)

    a1, a2 = two_events(0)
    b1, b2 = two_events(0)
    c1, _ = two_events(1)
    np.testing.assert_array_equal(a1, b1)
    np.testing.assert_array_equal(a2, b2)
    assert not np.array_equal(a1, a2)
    assert not np.array_equal(a1, c1)
    assert len(np.unique(a1)) == N


# -- AgentKV ------------------------------------------------------------------------
def ring_in_order(state: AgentKVState, phase: int):
    """Ring ``phase``'s entries oldest first, as the row ids written into them."""
    R = state.ring_PRLHD.shape[1]
    count = int(state.count_P[phase])
    start = count % R if count >= R else 0
    slots = [(start + j) % R for j in range(min(count, R))]
    return [state.ring_PRLHD[phase, s] for s in slots]


def test_agentkv_rings_hold_last_q_over_4_rows_per_phase():
    policy = get_policy("agentkv")
    cfg = policy.make_config(q=16)  # R = 4 per phase
    R = cfg.ring_size
    observe = jax.jit(functools.partial(policy.observe, cfg))
    state = policy.init_state(cfg, MODEL_CFG)
    T, A, O = Phase.THINK, Phase.ACT, Phase.TOOL
    # THINK wraps around (11 rows, 6 in one chunk); ACT has 2 < R; TOOL exactly R + 1
    # over chunks; OTHERS never appears; some rows are padding (invalid).
    chunks = [
        ([T, T, A, O, T, T, T, T], [1, 1, 1, 1, 1, 0, 1, 1]),
        ([O, O, T], [1, 1, 1]),
        ([T, T, T, T, T, T, A, O, O], [1, 1, 1, 1, 1, 1, 1, 1, 0]),
        ([O, T], [1, 1]),
    ]
    history = {p: collections.deque(maxlen=R) for p in Phase}
    counts = collections.Counter()
    row_id = 0
    for phases, valid in chunks:
        ids = np.arange(row_id + 1, row_id + 1 + len(phases), dtype=np.float32)
        row_id += len(phases)
        # row j of the chunk is id_j, offset per layer / head / dim so every value is distinct
        q = (
            ids[None, :, None, None]
            + 1000 * np.arange(L)[:, None, None, None]
            + 100 * np.arange(HQ)[None, None, :, None]
            + 0.01 * np.arange(D)
        ).astype(np.float32)
        obs = Observation(
            q_LXHD=jnp.asarray(q, jnp.float32),
            phase_X=jnp.asarray(phases, jnp.int32),
            valid_X=jnp.asarray(valid, bool),
            query_mean_LHD=jnp.zeros((L, HQ, D)),
            new_turn=jnp.asarray(False),
        )
        state = observe(state, obs)
        for p, v, j in zip(phases, valid, range(len(phases))):
            if v:
                history[Phase(p)].append(q[:, j])
                counts[Phase(p)] += 1
        for p in Phase:
            got = ring_in_order(state, p)
            assert len(got) == len(history[p]) == min(counts[p], R)
            for g, e in zip(got, history[p]):
                np.testing.assert_array_equal(g, e)
    assert [int(c) for c in state.count_P] == [counts[p] for p in Phase]
    assert counts[T] > 2 * R and counts[A] < R and counts[Phase.OTHERS] == 0
    np.testing.assert_array_equal(state.filled_PR.sum(axis=1), [R, 2, R, 0])
    np.testing.assert_array_equal(state.ring_PRLHD[Phase.OTHERS], 0)  # empty ring untouched
    np.testing.assert_array_equal(state.ring_PRLHD[A, 2:], 0)


def test_agentkv_score_is_candidate_softmax_over_filled_rings():
    policy = get_policy("agentkv")
    cfg = policy.make_config(q=8)
    state = policy.init_state(cfg, MODEL_CFG)
    state = policy.observe(cfg, state, make_obs(12, phases=[0, 0, 0, 1, 2, 2], new_turn=False))
    feats = make_feats(13)
    cand = np.random.default_rng(14).random(N) < 0.6
    scores, _ = policy.score(cfg, state, feats, jnp.asarray(cand))
    filled = np.asarray(state.filled_PR).reshape(-1)
    rows = np.asarray(state.ring_PRLHD).reshape(-1, L, HQ, D)[filled]  # 5 rows: 2 + 1 + 2 + 0
    assert rows.shape[0] == 5
    expected = np_candidate_score(np.moveaxis(rows, 0, 1), feats.keys_LNKD, cand)
    np.testing.assert_allclose(scores, expected, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(scores)[cand].sum(), 1.0, rtol=1e-5)  # a distribution over C
    assert policy.keep is None


# -- IntentKV -----------------------------------------------------------------------
def unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def test_intentkv_memory_update():
    policy = get_policy("intentkv_memory")
    cfg = policy.make_config()
    assert cfg.beta == 0.7
    observe = jax.jit(functools.partial(policy.observe, cfg))
    state = policy.init_state(cfg, MODEL_CFG)
    turn1, turn2 = make_obs(20), make_obs(21)
    q1, q2 = np.asarray(turn1.query_mean_LHD, np.float64), np.asarray(turn2.query_mean_LHD, np.float64)

    state = observe(state, turn1)
    assert bool(state.initialized)
    np.testing.assert_allclose(state.m_LHD, unit(q1), rtol=1e-5)
    unchanged = observe(state, make_obs(22, new_turn=False))  # mid-turn observation: no update
    np.testing.assert_array_equal(unchanged.m_LHD, state.m_LHD)
    state = observe(state, turn2)
    np.testing.assert_allclose(state.m_LHD, unit(0.7 * unit(q1) + 0.3 * q2), rtol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(state.m_LHD, axis=-1), np.ones((L, HQ)), rtol=1e-5)
    # a zero query mean does not produce NaNs
    zero = dataclasses.replace(make_obs(23), query_mean_LHD=jnp.zeros((L, HQ, D)))
    assert np.isfinite(observe(policy.init_state(cfg, MODEL_CFG), zero).m_LHD).all()


def test_intentkv_modes_differ_only_through_the_vector():
    memory, query = get_policy("intentkv_memory"), get_policy("intentkv_query")
    feats = make_feats(24)
    cand = jnp.asarray(np.random.default_rng(25).random(N) < 0.7)
    q_scores, _ = query.score(query.make_config(), (), feats, cand)
    np.testing.assert_allclose(
        q_scores, np_candidate_score(np.asarray(feats.query_mean_LHD)[:, None], feats.keys_LNKD, np.asarray(cand)), rtol=1e-5, atol=1e-7
    )
    cfg = memory.make_config()
    same = QueryMemory(feats.query_mean_LHD, jnp.asarray(True))
    m_scores, _ = memory.score(cfg, same, feats, cand)
    np.testing.assert_array_equal(m_scores, q_scores)
    other = QueryMemory(jnp.asarray(np.random.default_rng(26).normal(size=(L, HQ, D)), jnp.float32), jnp.asarray(True))
    o_scores, _ = memory.score(cfg, other, feats, cand)
    assert np.abs(np.asarray(o_scores) - np.asarray(q_scores)).max() > 1e-4
    np.testing.assert_allclose(
        o_scores, np_candidate_score(np.asarray(other.m_LHD)[:, None], feats.keys_LNKD, np.asarray(cand)), rtol=1e-5, atol=1e-7
    )
    # before any turn is observed the memory scores with the normalised q̄_t
    fresh, _ = memory.score(cfg, memory.init_state(cfg, MODEL_CFG), feats, cand)
    unit_feats = dataclasses.replace(feats, query_mean_LHD=jnp.asarray(unit(np.asarray(feats.query_mean_LHD))))
    normalised, _ = query.score(query.make_config(), (), unit_feats, cand)
    np.testing.assert_allclose(fresh, normalised, rtol=1e-6)
