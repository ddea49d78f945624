"""KeyDiff and Expected Attention keep what their rules promise.

* KeyDiff: ``score_i = mean_{l,h} −cos(k_i, mean_j k̂_j)``; on hand-built keys the
  keys pointing away from the average unit key are kept, the anchor is the mean of
  *unit* keys (a key's norm never matters), padding takes no part.
* Expected Attention: ``score_i = mean_{l,h} softmax_i(μ·k_i/√d + k_iᵀΣk_i/(2d))``
  with ``μ``, ``Σ`` the window's pre-RoPE query statistics moved by the mean
  rotation of the next positions; on hand-built queries the key aligned with the
  *future* query wins (not the one aligned with the post-RoPE window query), the
  covariance term lifts keys along the direction queries vary in, sinks and
  padding are handled as documented.

Every score is checked against a numpy re-implementation written in kvpress's own
form (explicit RoPE matrices, ``R̄ μ̂`` and ``R̄ Σ̂ R̄ᵀ``), in float64. Kept sets are
``F ∪ top-k`` with the budget met exactly.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.config import ModelConfig, RopeConfig
from jaxkv.policies import EventFeatures, Needs, get_policy, select
from jaxkv.rope import apply_rope, mean_rotation

L, N, HQ, HKV, D, W = 2, 40, 4, 2, 16, 8
G = HQ // HKV
THETA = 10000.0


def model_cfg(num_layers=L, num_heads=HQ, num_kv_heads=HKV, head_dim=D, rope=RopeConfig(theta=THETA)):
    return ModelConfig(
        model_type="qwen3",
        vocab_size=64,
        hidden_size=64,
        intermediate_size=64,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rope=rope,
    )


def feats_of(keys, positions, window_q=None, window_pos=None, window_valid=None, seq_len=None, valid=None):
    """EventFeatures from numpy arrays (the fields these two policies do not read are zeros)."""
    keys = np.asarray(keys, np.float32)
    n, Lk = keys.shape[1], keys.shape[0]
    positions = np.asarray(positions, np.int32)
    if window_q is None:
        window_q, window_pos, window_valid = np.zeros((Lk, 1, HQ, keys.shape[-1])), np.zeros(1), np.zeros(1, bool)
    window_q = np.asarray(window_q, np.float32)
    return EventFeatures(
        keys_LNKD=jnp.asarray(keys),
        positions_N=jnp.asarray(positions),
        phase_N=jnp.zeros(n, jnp.int32),
        window_q_LWHD=jnp.asarray(window_q),
        window_pos_W=jnp.asarray(window_pos, jnp.int32),
        window_valid_W=jnp.asarray(np.ones(len(window_pos), bool) if window_valid is None else window_valid),
        acc_mass_N=jnp.zeros(n, jnp.float32),
        query_mean_LHD=jnp.zeros((Lk, window_q.shape[2], keys.shape[-1]), jnp.float32),
        seq_len=jnp.asarray(int(positions.max()) + 1 if seq_len is None else seq_len, jnp.int32),
        valid_N=None if valid is None else jnp.asarray(valid, bool),
    )


def random_feats(seed, n=N, w=W, positions=None, window_valid=None, valid=None):
    """Random keys and window queries; live positions have holes; window = the last w rows."""
    rng = np.random.default_rng(seed)
    if positions is None:
        positions = np.sort(rng.choice(n + 16, size=n, replace=False))
    positions = np.asarray(positions)
    real = np.ones(len(positions), bool) if valid is None else np.asarray(valid, bool)
    last = positions[real][-w:]
    return feats_of(
        rng.normal(size=(L, len(positions), HKV, D)),
        positions,
        window_q=rng.normal(size=(L, len(last), HQ, D)),
        window_pos=last,
        window_valid=window_valid,
        seq_len=int(positions[real].max()) + 1,
        valid=valid,
    )


def run_score(name, feats, mcfg=None, **options):
    policy = get_policy(name)
    cfg = policy.make_config(**options)
    state = policy.init_state(cfg, mcfg or model_cfg())
    cand = ~np.asarray(policy.keep(cfg, feats)) if policy.keep else np.ones(feats.positions_N.shape, bool)
    scores, _ = jax.jit(functools.partial(policy.score, cfg))(state, feats, jnp.asarray(cand & np.asarray(feats.valid())))
    return np.asarray(scores, np.float64)


def kept_positions(name, feats, budget, mcfg=None, engine_forced=None, **options):
    """One event as the retention stage runs it: forced = engine ∪ keep, candidates = the rest."""
    policy = get_policy(name)
    cfg = policy.make_config(**options)
    valid = np.asarray(feats.valid())
    forced = np.zeros(valid.shape, bool) if engine_forced is None else np.asarray(engine_forced, bool)
    if policy.keep:
        forced = forced | np.asarray(policy.keep(cfg, feats))
    forced &= valid
    cand = ~forced & valid
    scores, _ = policy.score(cfg, policy.init_state(cfg, mcfg or model_cfg()), feats, jnp.asarray(cand))
    kept = np.asarray(select(scores, jnp.asarray(forced), jnp.asarray(cand), budget))
    return kept, np.asarray(scores, np.float64), forced, cand


def np_topk_kept(scores, positions, forced, candidates, budget):
    """F ∪ top-(B−|F|) candidates by score, ties to the lower position."""
    k = max(budget - int(forced.sum()), 0)
    ranked = sorted(np.flatnonzero(candidates & ~forced), key=lambda i: (-float(scores[i]), int(positions[i])))
    kept = forced.copy()
    kept[ranked[:k]] = True
    return kept


# -- numpy references ---------------------------------------------------------------
def np_keydiff(keys_LNKD, valid_N):
    k = np.asarray(keys_LNKD, np.float64)
    valid = np.asarray(valid_N, bool)
    unit = k / np.linalg.norm(k, axis=-1, keepdims=True)
    anchor = unit[:, valid].mean(axis=1)  # [L, Hkv, D]
    cos = np.einsum("lnkd,lkd->lnk", unit, anchor) / np.linalg.norm(anchor, axis=-1)[:, None, :]
    return np.where(valid, (-cos).mean(axis=(0, 2)), 0.0)


def np_rope_matrix(t, d, theta=THETA):
    """kvpress's ``R = cos·I + sin·P`` for the NeoX pairs at position ``t`` (float64)."""
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    cos, sin = np.tile(np.cos(t * inv), 2), np.tile(np.sin(t * inv), 2)
    P = np.zeros((d, d))
    P[d // 2 :, : d // 2], P[: d // 2, d // 2 :] = np.eye(d // 2), -np.eye(d // 2)
    return cos[:, None] * np.eye(d) + sin[:, None] * P


def np_expected_attention(feats, n_future=512, n_sink=4, use_covariance=True):
    """kvpress's ExpectedAttentionPress score (use_vnorm=False) with jaxkv's inputs and
    one-set mean: pre-RoPE stats, R̄ = mean_t R(t), μ = R̄μ̂, Σ = R̄Σ̂R̄ᵀ."""
    q = np.asarray(feats.window_q_LWHD, np.float64)
    k = np.asarray(feats.keys_LNKD, np.float64)
    Lq, Wq, Hq, d = q.shape
    Hk = k.shape[2]
    pos_W = np.asarray(feats.window_pos_W)
    rows = np.asarray(feats.window_valid_W, bool) & (pos_W >= n_sink)
    pre = np.stack([q[:, r] @ np_rope_matrix(-pos_W[r], d).T for r in range(Wq)], axis=1)[:, rows]  # R(−p) q
    T = int(feats.seq_len)
    R_bar = np.mean([np_rope_matrix(t, d) for t in range(T, T + n_future)], axis=0)
    if rows.any():
        mu_hat = pre.mean(axis=1)  # [L, Hq, d]
        c = pre - mu_hat[:, None]
        cov_hat = np.einsum("lwhi,lwhj->lhij", c, c) / rows.sum()
    else:
        mu_hat, cov_hat = np.zeros((Lq, Hq, d)), np.zeros((Lq, Hq, d, d))
    mu = mu_hat @ R_bar.T
    cov = R_bar @ cov_hat @ R_bar.T
    kx = np.repeat(k, Hq // Hk, axis=2)  # [L, N, Hq, d]
    logits = np.einsum("lhd,lnhd->lhn", mu, kx) / np.sqrt(d)
    if use_covariance:
        logits = logits + np.einsum("lnhi,lhij,lnhj->lhn", kx, cov, kx) / d / 2
    mask = np.asarray(feats.valid()) & (np.asarray(feats.positions_N) >= n_sink)
    s = np.where(mask, logits, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p = p / p.sum(axis=-1, keepdims=True)
    per_kv = p.reshape(Lq, Hk, Hq // Hk, -1).mean(axis=2)
    return np.where(mask, per_kv.mean(axis=(0, 1)), 0.0)


# -- registry and configs -----------------------------------------------------------
@pytest.mark.parametrize("name", ["keydiff", "expected_attention"])
def test_registered_with_documented_frozen_config(name):
    policy = get_policy(name)
    cfg = policy.make_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(cfg, "x", 1)
    for field in dataclasses.fields(policy.config):
        assert f"{field.name}:" in policy.config.__doc__, (name, field.name)


def test_defaults_and_needs():
    ea = get_policy("expected_attention").make_config()
    assert (ea.n_future_positions, ea.n_sink, ea.use_covariance, ea.w, ea.decode_interval) == (512, 4, True, 256, None)
    assert get_policy("expected_attention").needs(ea) == Needs(window=256)
    assert get_policy("keydiff").needs(get_policy("keydiff").make_config()) == Needs()
    for name in ("keydiff", "expected_attention"):
        policy = get_policy(name)
        assert policy.needs(policy.make_config(decode_interval=64)).decode_interval == 64
    assert get_policy("expected_attention").needs(get_policy("expected_attention").make_config(w=32)).window == 32
    with pytest.raises(ValueError, match="n_future_positions"):
        get_policy("expected_attention").make_config(n_future_positions=0)
    with pytest.raises(TypeError, match="use_vnorm"):  # no values in EventFeatures: not an option (module docstring)
        get_policy("expected_attention").make_config(use_vnorm=True)


# -- KeyDiff --------------------------------------------------------------------------
def test_keydiff_keeps_the_keys_least_like_the_average():
    rng = np.random.default_rng(0)
    e = np.eye(4)
    typical = e[0] + 0.05 * rng.normal(size=(6, 4))  # six keys around e1
    keys = np.concatenate([typical[:3], [e[1]], typical[3:], [-0.1 * e[0]]])  # e2 at 3, a small −e1 at 7
    feats = feats_of(keys[None, :, None, :], np.arange(8))
    scores = run_score("keydiff", feats, mcfg=model_cfg(num_layers=1, num_heads=1, num_kv_heads=1, head_dim=4))
    np.testing.assert_allclose(scores, np_keydiff(feats.keys_LNKD, np.ones(8, bool)), rtol=1e-5, atol=1e-6)
    assert scores[7] > 0.9 and abs(scores[3]) < 0.3 and (scores[[0, 1, 2, 4, 5, 6]] < -0.9).all()
    assert list(np.argsort(-scores)[:2]) == [7, 3]  # most dissimilar first: −e1, then e2
    kept, *_ = kept_positions("keydiff", feats, 2, mcfg=model_cfg(num_layers=1, num_heads=1, num_kv_heads=1, head_dim=4))
    np.testing.assert_array_equal(np.flatnonzero(kept), [3, 7])


def test_keydiff_anchor_is_the_mean_of_unit_keys():
    """Five tiny keys along e1 and one huge key along e2: the mean of *unit* keys
    points mostly along e1, so the e2 key is the odd one out and is kept; the mean of
    raw keys would point along e2 and keep an e1 key instead."""
    e = np.eye(4)
    keys = np.concatenate([0.1 * np.tile(e[0], (5, 1)), [100.0 * e[1]]])
    feats = feats_of(keys[None, :, None, :], np.arange(6))
    mcfg = model_cfg(num_layers=1, num_heads=1, num_kv_heads=1, head_dim=4)
    scores = run_score("keydiff", feats, mcfg=mcfg)
    np.testing.assert_allclose(scores, [-5 / np.sqrt(26)] * 5 + [-1 / np.sqrt(26)], rtol=1e-5)
    kept, *_ = kept_positions("keydiff", feats, 1, mcfg=mcfg)
    np.testing.assert_array_equal(np.flatnonzero(kept), [5])
    # rescaling any key changes no score
    scale = np.random.default_rng(1).uniform(0.01, 100.0, size=(1, 6, 1, 1))
    rescaled = run_score("keydiff", dataclasses.replace(feats, keys_LNKD=feats.keys_LNKD * scale), mcfg=mcfg)
    np.testing.assert_allclose(rescaled, scores, rtol=1e-5, atol=1e-6)


def test_keydiff_matches_numpy_over_layers_and_heads_and_ignores_padding():
    n_real = 30
    valid = np.arange(N) < n_real
    feats = random_feats(2, valid=valid)
    rng = np.random.default_rng(3)
    padded = np.asarray(feats.keys_LNKD).copy()
    padded[:, ~valid] = 50.0 * rng.normal(size=padded[:, ~valid].shape)  # garbage padding keys
    feats = dataclasses.replace(feats, keys_LNKD=jnp.asarray(padded))
    scores = run_score("keydiff", feats)
    np.testing.assert_allclose(scores, np_keydiff(padded, valid), rtol=1e-5, atol=1e-6)
    assert (scores[~valid] == 0).all()
    trimmed = feats_of(padded[:, valid], np.asarray(feats.positions_N)[valid])
    np.testing.assert_allclose(run_score("keydiff", trimmed)[:n_real], scores[valid], rtol=1e-5, atol=1e-6)
    # every layer and KV head counts: the mean is not one head's score
    one_head = np_keydiff(padded[:1, :, :1], valid)
    assert np.abs(scores - one_head).max() > 1e-2


@pytest.mark.parametrize("budget", [5, 20, N])
@pytest.mark.parametrize("name", ["keydiff", "expected_attention"])
def test_kept_set_is_forced_plus_topk_and_padding_never_kept(name, budget):
    valid = np.arange(N) < N - 6
    feats = random_feats(4, valid=valid)
    engine_forced = np.asarray(feats.positions_N) < 6
    engine_forced[[11, 17]] = True
    kept, scores, forced, cand = kept_positions(name, feats, budget, engine_forced=engine_forced)
    expected = np_topk_kept(scores, np.asarray(feats.positions_N), forced, cand, budget)
    np.testing.assert_array_equal(kept, expected)
    assert not kept[~valid].any() and kept[forced].all()
    assert kept.sum() == min(max(budget, forced.sum()), valid.sum())


# -- Expected Attention: the rotation ----------------------------------------------
def test_mean_rotation_is_the_mean_of_the_rotations():
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(3, 2, D)), jnp.float32)
    rope = RopeConfig(theta=THETA)
    each = np.stack([np.asarray(apply_rope(x, jnp.full((3,), t), rope)) for t in range(40, 47)])
    np.testing.assert_allclose(mean_rotation(x, 40, 7, rope), each.mean(axis=0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(mean_rotation(x, 9, 1, rope), apply_rope(x, jnp.full((3,), 9), rope), rtol=1e-6, atol=1e-6)
    R_bar = np.mean([np_rope_matrix(t, D) for t in range(40, 47)], axis=0)  # kvpress's form: x R̄ᵀ
    np.testing.assert_allclose(mean_rotation(x, 40, 7, rope), np.asarray(x, np.float64) @ R_bar.T, rtol=1e-4, atol=1e-5)


def one_head_cfg(d=8):
    return model_cfg(num_layers=1, num_heads=1, num_kv_heads=1, head_dim=d)


def window_of(pre_WD, pos_W, d=8):
    """Post-RoPE window queries ``[1, W, 1, d]`` whose pre-RoPE vectors are ``pre_WD``."""
    pre = jnp.asarray(np.asarray(pre_WD)[None, :, None, :], jnp.float32)
    return np.asarray(apply_rope(pre, jnp.asarray(pos_W)[None, :], RopeConfig(theta=THETA)))


def test_expected_attention_rotates_queries_to_the_future():
    """Every window query is ``u`` before RoPE (no variance). With one future
    position T the expected query is ``R(T)u``: the key along it beats the key
    along the newest window query as stored (``R(p)u``), which a scorer using the
    post-RoPE window queries without moving them would prefer."""
    d, T = 8, 60
    u = np.array([1.0, 0.8, 0.1, 0.0, -0.6, 0.9, 0.0, 0.1])
    pos_W = np.array([10, 11, 12, 13])
    future = np_rope_matrix(T, d) @ u
    stored = np_rope_matrix(13, d) @ u
    assert future @ stored / (u @ u) < 0.2  # the two directions really differ
    rng = np.random.default_rng(6)
    others = rng.normal(size=(6, d))
    others *= np.linalg.norm(u) / np.linalg.norm(others, axis=1, keepdims=True)
    keys = np.concatenate([others[:2], [stored], others[2:4], [future], others[4:]]) * 2.0  # stored at 2, future at 5
    feats = feats_of(keys[None, :, None, :], np.arange(4, 12), window_q=window_of(np.tile(u, (4, 1)), pos_W), window_pos=pos_W, seq_len=T)
    scores = run_score("expected_attention", feats, mcfg=one_head_cfg(), n_future_positions=1)
    np.testing.assert_allclose(scores, np_expected_attention(feats, n_future=1), rtol=1e-4, atol=1e-7)
    assert np.argmax(scores) == 5 and scores[5] > 5 * scores[2]
    kept, *_ = kept_positions("expected_attention", feats, 1, mcfg=one_head_cfg(), n_future_positions=1)
    np.testing.assert_array_equal(np.flatnonzero(kept), [5])
    # the default 512 future positions average the rotation: still the rule, exactly
    scores512 = run_score("expected_attention", feats, mcfg=one_head_cfg())
    np.testing.assert_allclose(scores512, np_expected_attention(feats), rtol=1e-4, atol=1e-7)


def test_expected_attention_covariance_lifts_keys_along_the_query_spread():
    """Queries ``u ± 2e`` (mean u, variance 4 along e, u ⊥ e): a key along the future
    ``e`` and a key along a third direction both have ``μ·k = 0``; only the
    ``kᵀΣk/(2d)`` term tells them apart, in favour of the one along e."""
    d, T = 8, 30
    eye = np.eye(d)
    u, e, other = eye[0] + eye[5], eye[1], eye[6]
    pos_W = np.arange(10, 18)
    pre = u + 2.0 * np.array([1, -1] * 4)[:, None] * e
    R = np_rope_matrix(T, d)
    keys = np.stack([R @ other, R @ e, R @ (-u), R @ e * 0.5, R @ other]) * 2.0  # spread dir at 1 (and 3, shorter)
    feats = feats_of(keys[None, :, None, :], np.arange(5, 10), window_q=window_of(pre, pos_W), window_pos=pos_W, seq_len=T)
    cfg = one_head_cfg()
    with_cov = run_score("expected_attention", feats, mcfg=cfg, n_future_positions=1)
    mean_only = run_score("expected_attention", feats, mcfg=cfg, n_future_positions=1, use_covariance=False)
    np.testing.assert_allclose(with_cov, np_expected_attention(feats, n_future=1), rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(mean_only, np_expected_attention(feats, n_future=1, use_covariance=False), rtol=1e-4, atol=1e-7)
    # logits: key 1 (|k| = 2 along e) 0 + 4·2²/(2·8) = 1, key 3 (|k| = 1) 4·1²/16 = 0.25, keys 0 and 4 zero
    np.testing.assert_allclose(np.log(with_cov[1] / with_cov[0]), 1.0, rtol=1e-4)
    np.testing.assert_allclose(np.log(with_cov[3] / with_cov[0]), 0.25, rtol=1e-4)
    assert mean_only[1] == pytest.approx(mean_only[0]) == pytest.approx(mean_only[3])
    assert list(np.argsort(-with_cov, kind="stable")[:2]) == [1, 3]
    kept, *_ = kept_positions("expected_attention", feats, 2, mcfg=cfg, n_future_positions=1)
    np.testing.assert_array_equal(np.asarray(feats.positions_N)[kept], [6, 8])


@pytest.mark.parametrize("use_covariance", [True, False])
def test_expected_attention_matches_numpy_with_gqa_holes_and_invalid_rows(use_covariance):
    window_valid = np.ones(W, bool)
    window_valid[[0, 3]] = False
    feats = random_feats(7, window_valid=window_valid)
    rng = np.random.default_rng(8)
    junk = np.asarray(feats.window_q_LWHD).copy()
    junk[:, ~window_valid] = 100.0 * rng.normal(size=junk[:, ~window_valid].shape)  # invalid rows: never read
    feats = dataclasses.replace(feats, window_q_LWHD=jnp.asarray(junk))
    scores = run_score("expected_attention", feats, use_covariance=use_covariance)
    np.testing.assert_allclose(scores, np_expected_attention(feats, use_covariance=use_covariance), rtol=2e-4, atol=1e-7)
    sinks = np.asarray(feats.positions_N) < 4
    assert (scores[sinks] == 0).all()
    np.testing.assert_allclose(scores[~sinks].sum(), 1.0, rtol=1e-5)  # a mean of distributions over non-sinks


def test_expected_attention_padding_and_sinks_take_no_part():
    n_real = 28
    valid = np.arange(N) < n_real
    positions = np.arange(N)  # sinks 0..3 are live
    feats = random_feats(9, positions=positions, valid=valid)
    rng = np.random.default_rng(10)
    keys = np.asarray(feats.keys_LNKD).copy()
    keys[:, ~valid] = 30.0 * rng.normal(size=keys[:, ~valid].shape)
    feats = dataclasses.replace(feats, keys_LNKD=jnp.asarray(keys))
    scores = run_score("expected_attention", feats)
    np.testing.assert_allclose(scores, np_expected_attention(feats), rtol=2e-4, atol=1e-7)
    assert (scores[~valid] == 0).all() and (scores[:4] == 0).all()
    trimmed = dataclasses.replace(
        feats,
        keys_LNKD=feats.keys_LNKD[:, :n_real],
        positions_N=feats.positions_N[:n_real],
        phase_N=feats.phase_N[:n_real],
        acc_mass_N=feats.acc_mass_N[:n_real],
        valid_N=None,
    )
    np.testing.assert_allclose(run_score("expected_attention", trimmed), scores[:n_real], rtol=1e-5, atol=1e-8)
    kept, *_ = kept_positions("expected_attention", feats, N)
    np.testing.assert_array_equal(kept, valid)  # a budget past the live count keeps every real entry, no padding
    np.testing.assert_array_equal(
        np.asarray(get_policy("expected_attention").keep(get_policy("expected_attention").make_config(), feats)), positions < 4
    )


def test_expected_attention_window_rows_at_sink_positions_are_not_samples():
    positions = np.arange(12)
    feats = random_feats(11, n=12, w=10, positions=positions)  # window rows at positions 2..11
    assert np.asarray(feats.window_pos_W)[:2].tolist() == [2, 3]
    changed = np.asarray(feats.window_q_LWHD).copy()
    changed[:, :2] = 50.0
    a = run_score("expected_attention", feats)
    b = run_score("expected_attention", dataclasses.replace(feats, window_q_LWHD=jnp.asarray(changed)))
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(a, np_expected_attention(feats), rtol=2e-4, atol=1e-7)
    c = run_score("expected_attention", feats, n_sink=2)  # rows at 2, 3 now count
    d = run_score("expected_attention", dataclasses.replace(feats, window_q_LWHD=jnp.asarray(changed)), n_sink=2)
    assert np.abs(c - d).max() > 1e-3


def test_expected_attention_without_window_rows_scores_alike():
    feats = random_feats(12, window_valid=np.zeros(W, bool))
    scores = run_score("expected_attention", feats)
    rest = np.asarray(feats.positions_N) >= 4
    np.testing.assert_allclose(scores[rest], 1.0 / rest.sum(), rtol=1e-5)
