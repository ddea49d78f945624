"""RepairKV: the host tier, the scorer (chunked == unchunked == softmax oracle),
burst selection (K cap, clipping, ties), controls, the apply step (bit-identical
rows at original positions; logits == attention over kept ∪ promoted) and a
repairing multi-turn session that leaks no slot."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxkv
from jaxkv.cache.allocator import SENTINEL_SLOT
from jaxkv.cache.host_tier import HostTier
from jaxkv.serving.stages.events import compress_row
from jaxkv.errors import ConfigError, RepairError
from jaxkv.policies import EventFeatures, attention_probs, get_policy
from jaxkv.policies import repair
from jaxkv.serving import Server, Session
from oracles import logits_over_kept
from test_session import WORDS, agent_model  # noqa: F401  (fixture)


# ============================================================================ host tier
def _rows(positions, L=2, K=1, D=3, fill=None):
    pos = np.asarray(positions, np.int64)
    k = np.broadcast_to(pos[None, :, None, None] if fill is None else fill, (L, pos.size, K, D)).astype(np.float32)
    return pos, pos.astype(np.int32) + 100, k, -k, pos.astype(np.float32) / 10


def test_host_tier_capacity_lru_and_drop():
    tier = HostTier(session_rows=6, global_rows=10)
    tier.put("a", *_rows([5, 1, 3]))
    tier.put("a", *_rows([7, 9, 11, 13]))  # 7 rows > 6: the oldest (position 1, first put, lowest position) goes
    assert tier.rows("a").positions_M.tolist() == [3, 5, 7, 9, 11, 13]
    tier.put("b", *_rows([2, 4, 6]))
    assert tier.num_rows == 9
    tier.rows("a")  # a is now the most recently used: b is the LRU session
    tier.put("c", *_rows([0, 1, 2, 3]))  # 13 > 10: b's 3 rows go, then nothing more is needed
    assert tier.sessions() == ["a", "c"] and tier.num_rows == 10 and tier.dropped_rows == 4
    tier.put("c", *_rows([8]))  # 11 > 10: the LRU session (a) loses its oldest row
    assert tier.rows("a").positions_M.tolist() == [5, 7, 9, 11, 13]
    tier.check_invariants()
    # a re-evicted position replaces its row (newest wins), positions stay sorted
    tier.put("c", *_rows([2], fill=7.0))
    got = tier.rows("c")
    assert got.positions_M.tolist() == [0, 1, 2, 3, 8] and got.k_LMKD[0, 2, 0, 0] == 7.0
    taken = tier.take("c", [3, 0])
    assert taken.positions_M.tolist() == [0, 3] and taken.tokens_M.tolist() == [100, 103]
    assert np.array_equal(taken.v_LMKD, -taken.k_LMKD)
    with pytest.raises(RepairError, match="not shelved"):
        tier.take("c", [3])
    assert tier.drop_from("c", 2) == 2 and tier.rows("c").positions_M.tolist() == [1]
    assert tier.drop_session("a") == 5 and tier.drop_session("a") == 0
    assert tier.num_rows == 1 and tier.sessions() == ["c"]
    tier.check_invariants()
    with pytest.raises(RepairError, match="distinct"):
        tier.put("c", *_rows([4, 4]))


# ============================================================================ scorer
def _scoring_case(seed=0, L=2, X=5, Hq=4, Hkv=2, D=8, N=7, M=37):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(L, X, Hq, D)).astype(np.float32)
    ctx_k = rng.normal(size=(L, N, Hkv, D)).astype(np.float32)
    cand_k = rng.normal(size=(L, M, Hkv, D)).astype(np.float32)
    pos = rng.permutation(N + M)
    ctx_pos, cand_pos = np.sort(pos[:N]), np.sort(pos[N:])
    q_pos = np.sort(rng.integers(N + M - 20, N + M - 8, X))  # some keys come after every row
    return q, q_pos, ctx_k, ctx_pos, cand_k, cand_pos


def _oracle_scores(q, q_pos, ctx_k, ctx_pos, cand_k, cand_pos):
    """Unchunked: one softmax over active ∪ evicted, evicted columns, max_t, mean_{l,h}."""
    keys = jnp.concatenate([ctx_k, cand_k], axis=1)
    k_pos = jnp.asarray(np.concatenate([ctx_pos, cand_pos]))
    p = attention_probs(jnp.asarray(q), keys, causal_q_pos=jnp.asarray(q_pos), k_pos_N=k_pos)  # [L, Hq, X, N+M]
    return np.asarray(p[..., ctx_k.shape[1] :].max(axis=2).mean(axis=(0, 1)))


def test_chunked_scoring_equals_unchunked_softmax():
    q, q_pos, ctx_k, ctx_pos, cand_k, cand_pos = _scoring_case()
    ref = _oracle_scores(q, q_pos, ctx_k, ctx_pos, cand_k, cand_pos)
    assert (ref == 0).any() and (ref > 0).sum() > 20  # the causal mask matters here
    X, N, M = q.shape[1], ctx_pos.size, cand_pos.size
    for chunk in (M, 5, 8):
        got = repair.repair_scores(
            q, q_pos, np.ones(X, bool), ctx_k, ctx_pos, np.ones(N, bool), cand_k, cand_pos, np.ones(M, bool), chunk=chunk
        )
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-7)

    def chunks(C=8):
        for s in range(0, M, C):
            k = np.zeros((q.shape[0], C) + cand_k.shape[2:], np.float32)
            k[:, : min(C, M - s)] = cand_k[:, s : s + C]
            p = np.zeros(C, np.int64)
            p[: min(C, M - s)] = cand_pos[s : s + C]
            yield k, p, np.arange(C) < M - s

    streamed = repair.repair_scores_streamed(q, q_pos, np.ones(X, bool), ctx_k, ctx_pos, np.ones(N, bool), chunks)
    np.testing.assert_allclose(streamed[:M], ref, rtol=1e-5, atol=1e-7)
    # the padded host entry point gives the same numbers
    padded = repair.score_rows(repair.Signal(q, q_pos), ctx_k, ctx_pos, cand_k, cand_pos, chunk=16)
    np.testing.assert_allclose(padded, ref, rtol=1e-5, atol=1e-7)


# ============================================================================ selection
def test_bursts_clip_at_sequence_ends_and_active_rows():
    evicted = np.setdiff1d(np.arange(100), [5, 6, 50])  # 5, 6 and 50 are active
    pos = evicted

    def pick(first, k, **kw):  # rank `first` best, then ascending position
        a = np.where(pos == first, 1.0, 0.0)
        return repair.select_bursts(pos, repair.rank(a, np.zeros(pos.size), pos), k, **kw).tolist()

    # anchor 3: burst 1..23 skips the active 5, 6 and continues; K=23 -> 1 anchor, 2 backfilled (0, 24)
    assert pick(3, 23) == [0, 1, 2, 3, 4] + list(range(7, 24)) + [24]
    assert pick(0, 23) == list(range(0, 5)) + list(range(7, 25))  # left end clipped: 0..20 minus 5, 6, then backfill
    assert pick(0, 10) == [0, 1, 2, 3, 4, 7, 8, 9, 10, 11]  # cut nearest-first at K
    assert pick(98, 23) == [0, 1, 2, 3, 4] + list(range(7, 21)) + [96, 97, 98, 99]  # right end clipped at the last row; 19 backfilled
    assert pick(40, 7) == [38, 39, 40, 41, 42, 43, 44]  # nearest first: 40, 41, 39, 42, 38, 43, 44
    # a row selected by an earlier burst is not an anchor: the second anchor is 60
    a = np.zeros(pos.size)
    a[pos == 30], a[pos == 31], a[pos == 60] = 3.0, 2.0, 1.0
    got = repair.select_bursts(pos, repair.rank(a, np.zeros(pos.size), pos), 46)
    # 2 anchors for K=46: 30 -> 28..49 (50 active), 31 skipped, 60 -> 58..80; then 1 backfilled (0)
    assert got.tolist() == [0] + list(range(28, 50)) + list(range(58, 81))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=120, unique=True), st.integers(1, 150), st.integers(0, 2**31 - 1))
def test_selection_is_a_valid_set_of_min_k_m(positions, k, seed):
    pos = np.asarray(sorted(positions), np.int64)
    rng = np.random.default_rng(seed)
    a, comp = rng.random(pos.size).round(1), rng.random(pos.size).round(1)
    want = min(k, pos.size)
    for policy in ("repairkv", "staleq", "wrongq", "random", "oldest"):
        got = repair.choose(repair.RepairConfig(k, policy), pos, comp, a, event=seed)
        assert got.size == want == np.unique(got).size and np.isin(got, pos).all()
    assert repair.choose(repair.RepairConfig(k, "oldest"), pos, comp).tolist() == pos[:want].tolist()
    # refresh: the best n_keep of active ∪ evicted; net growth of the active set is min(K, M)
    n_active = int(rng.integers(0, 40))
    all_pos = np.arange(pos.size + n_active) + 1000
    keep = repair.select_refresh(rng.random(all_pos.size), np.r_[np.full(n_active, np.inf), comp], all_pos, n_active + want)
    assert keep.sum() == n_active + want


def test_ties_break_by_compression_score_then_position():
    a = np.asarray([0.5, 0.5, 0.5, 0.9, 0.5])
    comp = np.asarray([1.0, 3.0, 3.0, 0.0, 3.0])
    pos = np.asarray([10, 30, 20, 40, 25])
    assert pos[repair.rank(a, comp, pos)].tolist() == [40, 20, 25, 30, 10]
    cfg = repair.RepairConfig(1)
    assert repair.choose(cfg, pos, comp, a).tolist() == [40]
    assert repair.choose(cfg, pos[:3], comp[:3], a[:3]).tolist() == [20]
    assert repair.choose(cfg, pos[:2], comp[:2], a[:2]).tolist() == [30]
    assert repair.choose(cfg, pos[:1], comp[:1], a[:1]).tolist() == [10]
    with pytest.raises(RepairError, match="unknown repair policy"):
        repair.RepairConfig(4, "magic")


# ============================================================================ apply step
def _event_features(engine, row, n):
    positions = engine.kv.live_positions(row)
    L = engine.model.config.num_layers
    cfg = engine.model.config
    return EventFeatures(
        keys_LNKD=engine.kv.gather_keys(row),
        positions_N=jnp.asarray(positions, jnp.int32),
        phase_N=jnp.zeros(n, jnp.int32),
        window_q_LWHD=jnp.zeros((L, 1, cfg.num_heads, cfg.head_dim)),
        window_pos_W=jnp.zeros(1, jnp.int32),
        window_valid_W=jnp.zeros(1, bool),
        acc_mass_N=jnp.zeros(n),
        query_mean_LHD=jnp.zeros((L, cfg.num_heads, cfg.head_dim)),
        seq_len=jnp.int32(n),
    )


def test_promoted_rows_are_bit_identical_and_logits_match_attention_over_kept(agent_model):
    model = agent_model
    V = model.config.vocab_size
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, V, 60).tolist()
    new = rng.integers(0, V, 5).tolist()
    engine = jaxkv.Engine(model, rows=1, max_positions=512, num_slots=1025)  # the sessions' shapes: shared compiles
    row = engine.open_row()
    engine.prefill([row], [prompt])
    before = list(engine.row_state[row].slots)
    k0, v0 = engine.kv.gather_rows(before)  # [L, 60, Hkv, D]
    tier = HostTier()

    def on_evict(plan, k, v, scores):
        tier.put("s", plan.evicted_positions, np.asarray(prompt)[plan.evicted_positions], k, v, scores)

    policy = get_policy("random")
    forced = np.zeros(60, bool)
    forced[:4] = forced[-8:] = True
    _, report = compress_row(
        engine,
        row,
        policy,
        policy.make_config(seed=1),
        policy.init_state(None, None),
        _event_features(engine, row, 60),
        forced,
        24,
        "dead_slot",
        on_evict=on_evict,
    )
    kept = report.kept_positions
    evicted = report.plan.evicted_positions
    assert kept.size == 24 and evicted.size == 36 and report.evicted_scores.shape == (36,)
    shelf = tier.rows("s")
    assert np.array_equal(shelf.positions_M, evicted) and np.array_equal(shelf.k_LMKD, k0[:, evicted])
    assert np.array_equal(shelf.v_LMKD, v0[:, evicted])
    # score with a signal of random query rows seen from the end, promote K = 12
    cfg = model.config
    sig = repair.Signal(rng.normal(size=(cfg.num_layers, 3, cfg.num_heads, cfg.head_dim)).astype(np.float32), np.full(3, 59))
    a = repair.score_rows(sig, engine.kv.gather_keys(row), engine.kv.live_positions(row), shelf.k_LMKD, shelf.positions_M)
    promote = repair.choose(repair.RepairConfig(12), shelf.positions_M, shelf.scores_M, a)
    assert promote.size == 12
    used_before = engine.allocator.num_used
    with pytest.raises(RepairError, match="live"):  # a kept position is not a hole: nothing changes
        engine.kv.restore_rows(row, kept[:1], k0[:, kept[:1]], v0[:, kept[:1]])
    assert engine.allocator.num_used == used_before
    taken = tier.take("s", promote)
    fresh = engine.kv.restore_rows(row, taken.positions_M, taken.k_LMKD, taken.v_LMKD)
    state = engine.row_state[row]
    assert [state.slots[p] for p in promote] == fresh.tolist() and SENTINEL_SLOT not in fresh
    assert [state.slots[p] for p in kept] == [before[p] for p in kept]  # survivors untouched
    k1, v1 = engine.kv.gather_rows([state.slots[p] for p in promote])
    assert np.array_equal(k1, k0[:, promote]) and np.array_equal(v1, v0[:, promote])  # bit-identical
    keep = np.union1d(kept, promote)
    assert state.live == [state.slots[p] for p in keep]  # live list grew, position order
    assert tier.session_size("s") == 36 - 12
    _, logits = engine.decode([row], [new[0]], len(new), return_logits=True, forced_tokens=[new[1:]])
    ref = logits_over_kept(model, prompt, keep, new)
    assert np.abs(np.asarray(logits[0], np.float64) - ref).max() / np.abs(ref).max() <= 1e-5


# ============================================================================ sessions
def _conversation(seed, first_user=120, tool=20, last_user=20):
    """Three assistant turns answering a user, a tool result, a user (no schemas:
    a short protected prefix, so most history is evictable); the three lengths are
    in words (``tests/multidevice.py`` replays a shorter one)."""
    rng = np.random.default_rng(seed)

    def words(n):
        return " ".join(rng.choice(WORDS, n))

    return [
        {"role": "system", "content": "answer"},
        {"role": "user", "content": words(first_user)},
        {"role": "assistant", "content": words(6)},
        {"role": "tool", "content": words(tool)},
        {"role": "assistant", "content": words(6)},
        {"role": "user", "content": words(last_user)},
        {"role": "assistant", "content": words(4)},
    ]


def _replay(model, server, seed=0, **options):
    session = Session(model, server=server, keep_reasoning=True, policy="snapkv", budget=40, w=8, **options)
    session.replay(_conversation(seed), None, generate=True, max_new_tokens=4)
    return session


def _assert_no_leak(server):
    """Only the radix cache holds slots; every reference is one of its entries."""
    held = server.radix.held_slots()
    alloc = server.engine.allocator
    assert np.array_equal(alloc.refcounts(), np.bincount(held, minlength=alloc.num_slots))
    assert alloc.num_used == np.unique(held).size
    server.host_tier.check_invariants()


def test_repairing_sessions_promote_at_most_k_and_leak_nothing(agent_model):
    K = 8
    for policy in ("repairkv", "refresh", "random", "oldest", "staleq"):
        server = Server(agent_model, max_positions=512)
        session = _replay(agent_model, server, repair=K, repair_policy=policy)
        reports = session.repairs
        assert len(session.compressions) >= 3 and len(reports) == 3
        assert reports[0].skipped == "no evicted rows"  # the first request's own evictions are not repaired
        assert all(r.candidates > 0 and r.skipped is None for r in reports[1:]), policy
        for r in reports[1:]:
            assert r.promoted_positions.size <= K
            if policy == "refresh":  # may swap rows; the active set grows by min(K, candidates)
                assert r.live_after - r.live_before == min(K, r.candidates)
            else:
                assert r.promoted_positions.size == min(K, r.candidates)
                assert r.live_after - r.live_before == r.promoted_positions.size
        _assert_no_leak(server)
        assert server.host_tier.session_size(session.session_id) > 0
        session.close()
        assert server.host_tier.num_rows == 0


def test_wrongq_uses_another_sessions_signal_and_when_tool(agent_model):
    server = Server(agent_model, max_positions=512)
    right = _replay(agent_model, server, seed=0, session_id="a", repair=4)
    wrong = _replay(agent_model, server, seed=1, session_id="b", repair=4, repair_policy="wrongq")
    # b's first turns share a's system prompt (the radix keeps shared rows, so no holes there)
    assert wrong.repairs[2].skipped is None and wrong.repairs[2].promoted_positions.size == 4
    assert set(server.repair_signals) == {right.session_id, wrong.session_id}
    _assert_no_leak(server)
    right.close(), wrong.close()
    assert server.host_tier.num_rows == 0
    server = Server(agent_model, max_positions=512)  # a fresh radix: turn 1 has holes to repair
    only_tool = _replay(agent_model, server, seed=2, repair=4, repair_when="tool")
    skipped = [r.skipped for r in only_tool.repairs]
    assert skipped == ["the actionable message is not a tool result", None, "the actionable message is not a tool result"]
    assert 0 < only_tool.repairs[1].promoted_positions.size == min(4, only_tool.repairs[1].candidates)
    _assert_no_leak(server)
    with pytest.raises(ConfigError, match="dead_slot"):
        Session(agent_model, max_positions=256, policy="snapkv", budget=50, layout="compact", repair=4)
    with pytest.raises(RepairError, match="repair_when"):
        Session(agent_model, max_positions=256, policy="snapkv", budget=50, repair=4, repair_when="never")


def test_refresh_swaps_rows_and_shelves_the_demoted(agent_model):
    """With a roomier budget, refresh demotes active history rows that the new signal
    ranks below evicted ones: the active set still grows by exactly min(K, candidates)."""
    server = Server(agent_model, max_positions=512)
    session = Session(agent_model, server=server, keep_reasoning=True, policy="snapkv", budget=150, w=8, repair=4, repair_policy="refresh")
    session.replay(_conversation(0), None, generate=True, max_new_tokens=4)
    last = session.repairs[-1]
    assert last.demoted_positions.size > 0 and not np.intersect1d(last.demoted_positions, last.promoted_positions).size
    assert last.live_after - last.live_before == min(4, last.candidates)
    assert last.promoted_positions.size == last.demoted_positions.size + min(4, last.candidates)
    assert np.isin(last.demoted_positions, server.host_tier.rows(session.session_id).positions_M).all()
    _assert_no_leak(server)


def test_repairs_persist_in_the_radix_cache(agent_model):
    """Rows promoted at a turn boundary fill the radix cache's holes when the turn
    ends, so the next request matches them as real slots and they leave the tier."""
    from jaxkv.cache.allocator import SENTINEL_SLOT

    server = Server(agent_model, max_positions=512)
    session = _replay(agent_model, server, repair=8, repair_policy="repairkv")
    promoted = session.repairs[-1].promoted_positions  # no event after the last turn re-evicts them
    assert promoted.size > 0
    convo = _conversation(0)
    from jaxkv.chat import render

    ids = render(agent_model.tokenizer, convo, None, add_generation_prompt=False, keep_reasoning=True).ids
    cached = server.radix.match(ids, lock=False, owner=session.cache_owner).slots  # its own (private) holes
    assert (cached[promoted] != SENTINEL_SLOT).all()
    shelved = (
        set(server.host_tier.rows(session.session_id).positions_M.tolist()) if server.host_tier.session_size(session.session_id) else set()
    )
    assert not shelved & set(promoted.tolist())
    _assert_no_leak(server)


# ============================================================================ forking and protect_query
def _turn_counts(messages):
    return sum(m["role"] == "assistant" for m in messages)


def test_a_fork_replays_like_a_fresh_session_and_leaves_its_origin_alone(agent_model):
    """Replaying turn 1, forking with a repair choice and replaying the rest gives the
    same replies, repairs and cache contents as one session with that choice from
    the start; the origin's pool, tables, radix and tier are untouched by the fork."""
    convo = _conversation(3)
    opts = dict(max_positions=512, keep_reasoning=True, policy="snapkv", budget=40, w=8)
    origin = Session(agent_model, repair=1, **opts)
    first = origin.replay(convo[:3], None, generate=True, max_new_tokens=4)
    before = (
        np.asarray(origin.server.engine.cache.k).copy(),
        origin.server.radix.held_slots().copy(),
        origin.server.host_tier.session_size(origin.session_id),
    )
    for policy in ("repairkv", "refresh", "oldest"):
        twin = origin.fork(repair=6, repair_policy=policy)
        rest = twin.replay(convo, None, generate=True, max_new_tokens=4, start_turn=1)
        fresh = Session(agent_model, repair=6, repair_policy=policy, **opts)
        ref = fresh.replay(convo, None, generate=True, max_new_tokens=4)
        assert [t.generated for t in first + rest] == [t.generated for t in ref]
        assert [r.promoted_positions.tolist() for r in twin.repairs] == [r.promoted_positions.tolist() for r in fresh.repairs]
        assert twin.repairs[1].promoted_positions.size > 0, policy
        assert np.array_equal(twin.server.radix.held_slots(), fresh.server.radix.held_slots())
        _assert_no_leak(twin.server)
    assert np.array_equal(np.asarray(origin.server.engine.cache.k), before[0])
    assert np.array_equal(origin.server.radix.held_slots(), before[1])
    assert origin.server.host_tier.session_size(origin.session_id) == before[2] > 0
    assert len(origin.repairs) == 1 and _turn_counts(convo) == 3


def test_fork_rejects_shared_servers_and_other_options(agent_model):
    server = Server(agent_model, max_positions=256)
    shared = Session(agent_model, server=server, policy="snapkv", budget=50)
    with pytest.raises(ConfigError, match="own server"):
        shared.fork()
    own = Session(agent_model, max_positions=256, policy="snapkv", budget=50)
    with pytest.raises(ConfigError, match="budget"):
        own.fork(budget=10)
    with pytest.raises(RepairError, match="repair policy"):
        own.fork(repair=4, repair_policy="nope")
    assert own.repair is None and own.fork(repair=4).repair.k == 4
    with pytest.raises(ConfigError, match="dead_slot"):
        Session(agent_model, max_positions=256, policy="snapkv", budget=50, layout="compact").fork(repair=4)
    with pytest.raises(ValueError, match="start_turn"):
        own.replay(_conversation(0), None, start_turn=-1)


def test_protect_query_false_lets_the_first_event_evict_inside_the_question(agent_model):
    """A document + question in one user message: protected (the default) the event
    cannot evict any of it; with ``protect_query=False`` it keeps the budget."""
    convo = _conversation(4)[:3]
    kept = {}
    for protect in (True, False):
        session = Session(agent_model, max_positions=512, keep_reasoning=True, policy="snapkv", budget=40, w=8, protect_query=protect)
        session.replay(convo, None, generate=False)
        event = session.compressions[0]
        kept[protect] = (event.live_before, event.live_after)
    live, after_protected = kept[True]
    assert after_protected > 120 > 40  # the 120-word user message survives whole
    assert kept[False] == (live, 40)
    with pytest.raises(ConfigError, match="protect_query"):
        Session(agent_model, max_positions=256, policy="snapkv", budget=50, protect_query="no")
