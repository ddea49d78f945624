"""Per-layer keep sets (``keep_sets="layer"``, docs/retention.md "Per-layer keep sets").

* ``layer_budgets``: equal and PyramidKV budgets sum to ``L x B``, the pyramid
  falls from the lowest layer to the top; a shared budget (``select_across_layers``)
  keeps the forced entries and the model's top ``L x B − |F|`` candidates over
  every layer at once (a NumPy ranking with ties to the lower layer, then
  position), on random scores and on an engine row, where the layers end with
  different counts summing to ``L x B``.
* Selection, on an engine row: each layer keeps exactly ``max(B_l, |F|)`` of the
  positions it reads (equal and pyramid budgets), its set is ``F ∪ topk`` of the
  policy's score of *that layer alone* (KeyDiff's cosines recomputed here from
  the layer's keys: no mean over layers), a second event chooses only among what
  each layer still reads, and the device's per-layer lists mirror the host's.
* Logits: a per-layer-pruned row decodes the logits of a dense run with each
  layer's dropped keys masked (``oracles.logits_over_layer_kept``), on the
  dead-slot layout and, renumbered, on the compact one.
* RepairKV: rows evicted by every layer go to the host tier and come back
  bit-identical at their positions, read by every layer; logits match the oracle.
* A quantized pool reads a per-layer row through its lists: with every layer
  keeping the same set, its decode equals the page-table decode.
* Sessions: a per-layer-pruned prefix never reaches another session (its replies
  and prefix hits are those it gets alone, and another owner's radix match stops
  before the first position any layer dropped); repair, compact and segment reuse
  compose, with no slot leaked; meaningless combinations raise ``ConfigError``.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxkv
from jaxkv.cache.host_tier import HostTier
from jaxkv.chat import build_tokenizer
from jaxkv.config import ModelConfig
from jaxkv.errors import ConfigError
from jaxkv.policies import get_policy
from jaxkv.policies.base import layer_budgets, select_across_layers
from jaxkv.policies.keydiff import key_dissimilarity
from jaxkv.serving import Server, Session
from jaxkv.serving.stages.events import compress_row_layers, layer_features
from oracles import logits_over_layer_kept
from test_repair import _assert_no_leak, _conversation
from test_session import WORDS

L = 4


@pytest.fixture(scope="module")
def model():
    """A tiny 4-layer GQA model with the chat tokenizer (so pyramids have a slope)."""
    tok = build_tokenizer(WORDS)
    cfg = ModelConfig(
        model_type="qwen3",
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_layers=L,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        qk_norm=True,
        max_position_embeddings=2048,
        eos_token_ids=(tok.convert_tokens_to_ids("<|im_end|>"),),
    )
    return jaxkv.model_from_config(cfg, seed=3, tokenizer=tok)


# ============================================================================ budgets
def test_layer_budgets_split_l_times_b():
    assert layer_budgets(40, 4, "equal").tolist() == [40] * 4
    for B, layers in ((40, 4), (100, 30), (7, 5), (1, 3), (512, 24)):
        b = layer_budgets(B, layers, "pyramid")
        assert b.sum() == B * layers and (b >= 1).all() and (np.diff(b) <= 0).all(), (B, layers, b)
    b = layer_budgets(1000, 30, "pyramid")
    assert abs(b[0] - 1950) <= 1 and abs(b[-1] - 50) <= 1  # 2B - B/20 down to B/20 (PyramidKV, beta = 20)
    assert layer_budgets(64, 1, "pyramid").tolist() == [64]
    with pytest.raises(ConfigError, match="layer_budgets"):
        layer_budgets(40, 4, "triangle")


# ============================================================================ one row
def _prefilled(model, n, *, kv_quant=None, seed=0):
    engine = jaxkv.Engine(model, rows=1, max_positions=512, num_slots=1025, layer_lists=True, kv_quant=kv_quant)
    row = engine.open_row()
    prompt = np.random.default_rng(seed).integers(0, model.config.vocab_size, n).tolist()
    engine.prefill([row], [prompt])
    return engine, row, prompt


def _event(engine, row, policy_name, budgets, pinned, layout="dead_slot", on_evict=None, state=None, shared=False):
    cfg = engine.model.config
    policy = get_policy(policy_name)
    state = policy.init_state(policy.make_config(), cfg) if state is None else state
    req = engine.row_state[row]
    req.pinned[:] = False
    req.pinned[pinned] = True
    zeros_q = np.zeros((cfg.num_layers, 1, cfg.num_heads, cfg.head_dim), np.float32)
    feats, per_layer, forced = layer_features(
        engine, row, zeros_q, np.zeros(1, np.int32), np.zeros(1, bool), np.zeros((cfg.num_layers, cfg.num_heads, cfg.head_dim), np.float32)
    )
    _, report = compress_row_layers(
        engine,
        row,
        policy,
        policy.make_config(),
        state,
        feats,
        per_layer,
        forced,
        np.asarray(budgets),
        layout,
        shared=shared,
        on_evict=on_evict,
    )
    return report, per_layer


def _top_over_layers(scores_LN, forced_LN, candidates_LN, budget):
    """NumPy reference of one budget over every layer: forced entries, then the
    candidates by score (ties: the lower layer, then the lower position) up to the budget."""
    L_, N = scores_LN.shape
    kept = forced_LN.copy()
    cand = candidates_LN & ~forced_LN
    room = max(budget - int(forced_LN.sum()), 0)
    flat = [(-float(scores_LN[l, n]), l, n) for l in range(L_) for n in range(N) if cand[l, n]]
    for _, l, n in sorted(flat)[:room]:
        kept[l, n] = True
    return kept


@pytest.mark.parametrize("seed", [0, 1])
def test_a_shared_budget_keeps_the_models_top_over_every_layer(seed):
    rng = np.random.default_rng(seed)
    scale = rng.uniform(0.5, 2.0, (L, 1)).astype(np.float32)  # layers on other scales
    scores = rng.integers(0, 6, (L, 50)).astype(np.float32) * scale  # with ties
    valid = np.arange(50)[None, :] < rng.integers(30, 51, (L, 1))
    forced = valid & (rng.random((L, 50)) < 0.1)
    candidates = valid & ~forced
    select = jax.jit(select_across_layers)  # one program for every budget
    for budget in (0, 17, 60, 4 * 50):
        got = np.asarray(select(scores, forced, candidates, budget))
        want = _top_over_layers(scores, forced, candidates, budget)
        assert np.array_equal(got, want), budget
        assert got.sum() == min(max(budget, int(forced.sum())), int(valid.sum()))


def test_a_shared_budget_event_divides_l_times_b_by_score_across_the_layers(model):
    n, B = 120, 40
    engine, row, _ = _prefilled(model, n)
    pinned = np.r_[0:6, n - 4 : n]
    keys0 = np.asarray(engine.kv.gather_keys(row))  # [L, n, Hkv, D]
    budgets = layer_budgets(B, L, "shared")
    assert budgets.tolist() == [B] * L
    report, _ = _event(engine, row, "keydiff", budgets, pinned, shared=True)
    # the reference: each layer's own KeyDiff score, ranked over the model
    s = np.stack([np.asarray(key_dissimilarity(keys0[l : l + 1], np.ones(n, bool))).mean(axis=(0, 2)) for l in range(L)])
    f = np.zeros((L, n), bool)
    f[:, pinned] = True
    want = _top_over_layers(s, f, ~f, L * B)
    got = engine.row_state[row].layer_live[:, :n]
    assert np.array_equal(got, want)
    sizes = got.sum(axis=1)
    assert sizes.sum() == L * B and len(set(sizes.tolist())) > 1  # one pool, divided unevenly
    assert report.layer_live_after.tolist() == sizes.tolist()
    _assert_tables_mirror_host(engine, row)


def _topk_by_position(scores, candidates, k):
    """Candidates' top-k by score, ties to the lower position (``select``'s rule)."""
    idx = np.flatnonzero(candidates)
    order = idx[np.lexsort((idx, -scores[idx]))]
    return np.sort(order[:k])


def _assert_tables_mirror_host(engine, row):
    req = engine.row_state[row]
    req.check()
    live_idx, live_len = np.asarray(engine.cache.live_idx), np.asarray(engine.cache.live_len)
    for l, slots in enumerate(req.layer_lists(engine.kv.lists)):
        assert live_idx[l, row, : live_len[l, row]].tolist() == slots


@pytest.mark.parametrize("shape", ["equal", "pyramid"])
def test_each_layer_keeps_its_promised_count_and_its_own_top_k(model, shape):
    n, B = 120, 40
    engine, row, prompt = _prefilled(model, n)
    pinned = np.r_[0:6, n - 4 : n]  # F: 10 positions, kept in every layer
    keys0 = np.asarray(engine.kv.gather_keys(row))  # [L, n, Hkv, D]
    budgets = layer_budgets(B, L, shape)
    report, _ = _event(engine, row, "keydiff", budgets, pinned)
    req = engine.row_state[row]
    sets = [np.flatnonzero(m) for m in req.layer_live]
    for l in range(L):
        want = min(n, max(int(budgets[l]), pinned.size))  # a budget below |F| keeps F
        assert sets[l].size == want, (l, budgets[l])
        assert np.isin(pinned, sets[l]).all()
        # layer l's own KeyDiff score (its keys alone, no mean over layers), top-k over the rest
        s = np.asarray(key_dissimilarity(keys0[l : l + 1], np.ones(n, bool))).mean(axis=(0, 2))
        cand = np.ones(n, bool)
        cand[pinned] = False
        top = _topk_by_position(s, cand, max(int(budgets[l]) - pinned.size, 0))
        assert np.array_equal(sets[l], np.union1d(pinned, top)), l
    assert report.layer_live_after.tolist() == [s.size for s in sets]
    assert len({tuple(s) for s in sets}) > 1  # the layers chose differently
    union = np.flatnonzero(req.layer_live.any(axis=0))
    assert np.array_equal(union, report.kept_positions) and np.array_equal(req.live_positions(), union)
    assert report.plan.evicted_positions.tolist() == np.setdiff1d(np.arange(n), union).tolist()
    _assert_tables_mirror_host(engine, row)

    # a second, smaller event: each layer chooses only among what it still reads
    before = [s.copy() for s in sets]
    budgets2 = layer_budgets(24, L, shape)
    _event(engine, row, "keydiff", budgets2, pinned)
    for l, m in enumerate(engine.row_state[row].layer_live):
        kept = np.flatnonzero(m)
        assert kept.size == min(before[l].size, max(int(budgets2[l]), pinned.size))
        assert np.isin(kept, before[l]).all()
    _assert_tables_mirror_host(engine, row)

    # logits: each layer attends to its own set (a dense run with each layer's dropped keys masked)
    new = np.random.default_rng(9).integers(0, model.config.vocab_size, 5).tolist()
    keep_LP = engine.row_state[row].layer_live.copy()
    _, logits = engine.decode([row], [new[0]], len(new), return_logits=True, forced_tokens=[new[1:]])
    ref = logits_over_layer_kept(model, prompt, keep_LP, new)
    assert np.abs(np.asarray(logits[0], np.float64) - ref).max() / np.abs(ref).max() <= 1e-5
    # a prefill over the pruned row (the step path, not the decode loop) agrees too
    engine.truncate_row(row, n)
    out = engine.prefill([row], [new], all_logits=True)[0]
    assert np.abs(np.asarray(out, np.float64) - ref).max() / np.abs(ref).max() <= 1e-5
    # and so does a spliced prefill (segment reuse's step): each layer reads its own set
    from jaxkv.splice import SplicePlan

    engine.truncate_row(row, n)
    spliced, _ = engine.splice_prefill(row, SplicePlan.full(new, 1, logit_idx=np.arange(len(new))), mode="append")
    assert np.abs(np.asarray(spliced, np.float64) - ref).max() / np.abs(ref).max() <= 1e-5
    _assert_tables_mirror_host(engine, row)


def test_compact_layout_renumbers_the_union_and_keeps_each_layers_set(model):
    n = 120  # the prompt and new-token counts of the tests above: their programs serve this one
    engine, row, prompt = _prefilled(model, n, seed=1)
    pinned = np.r_[0:4]
    report, _ = _event(engine, row, "snapkv", layer_budgets(20, L, "pyramid"), pinned, layout="compact")
    union = report.kept_positions
    req = engine.row_state[row]
    assert req.renumbered == 1 and req.seq_len == union.size
    keep_before = report.plan.layer_keep  # over the renumbered positions 0..U-1
    assert keep_before.shape == (L, union.size) and np.array_equal(req.layer_live, keep_before)
    _assert_tables_mirror_host(engine, row)
    new = [5, 9, 11, 2, 6]
    _, logits = engine.decode([row], [new[0]], len(new), return_logits=True, forced_tokens=[new[1:]])
    # oracle: the dense prefix's keys of the union moved to positions 0..U-1, each layer masked to its set
    keep_LP = np.zeros((L, n), bool)
    keep_LP[:, union] = keep_before
    ref = logits_over_layer_kept(model, prompt, keep_LP, new, renumber=True)
    assert np.abs(np.asarray(logits[0], np.float64) - ref).max() / np.abs(ref).max() <= 1e-5


def test_repair_restores_rows_bit_identical_under_per_layer_sets(model):
    n = 120  # the prompt and new-token counts of the tests above: their programs serve this one
    engine, row, prompt = _prefilled(model, n, seed=2)
    slots0 = list(engine.row_state[row].slots)
    k0, v0 = engine.kv.gather_rows(slots0)
    tier = HostTier()

    def on_evict(plan, k, v, scores):
        tier.put("s", plan.evicted_positions, np.asarray(prompt)[plan.evicted_positions], k, v, scores)

    pinned = np.r_[0:4, n - 4 : n]
    report, _ = _event(engine, row, "keydiff", layer_budgets(24, L, "equal"), pinned, on_evict=on_evict)
    evicted = report.plan.evicted_positions
    assert evicted.size > 0 and report.evicted_scores.shape == evicted.shape
    shelf = tier.rows("s")
    assert np.array_equal(shelf.positions_M, evicted)
    assert np.array_equal(shelf.k_LMKD, k0[:, evicted]) and np.array_equal(shelf.v_LMKD, v0[:, evicted])
    sets_before = engine.row_state[row].layer_live.copy()
    promote = evicted[::3][:8]
    taken = tier.take("s", promote)
    fresh = engine.kv.restore_rows(row, taken.positions_M, taken.k_LMKD, taken.v_LMKD)
    req = engine.row_state[row]
    k1, v1 = engine.kv.gather_rows(fresh)
    assert np.array_equal(k1, k0[:, promote]) and np.array_equal(v1, v0[:, promote])  # bit-identical
    assert req.layer_live[:, promote].all()  # read by every layer
    others = np.setdiff1d(np.arange(n), promote)
    assert np.array_equal(req.layer_live[:, others], sets_before[:, others])  # every other choice untouched
    _assert_tables_mirror_host(engine, row)
    new = [3, 8, 2, 7, 4]
    _, logits = engine.decode([row], [new[0]], len(new), return_logits=True, forced_tokens=[new[1:]])
    ref = logits_over_layer_kept(model, prompt, req.layer_live[:, :n], new)
    assert np.abs(np.asarray(logits[0], np.float64) - ref).max() / np.abs(ref).max() <= 1e-5


@pytest.fixture(scope="module")
def quant_model():
    """``model``'s shape with head_dim 32 (a quantized pool's groups)."""
    cfg = ModelConfig(
        model_type="qwen3",
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_layers=L,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        qk_norm=True,
        max_position_embeddings=2048,
    )
    return jaxkv.model_from_config(cfg, seed=5)


def test_quantized_pool_reads_per_layer_rows_through_their_lists(quant_model):
    """INT4 pool: a row whose layers all keep the same set (so its lists equal the
    one-set row's) decodes through the per-layer lists what the page-table decode
    gives; a row with different sets decodes (what its layers read follows the
    host mirror)."""
    model = quant_model
    n = 80
    outs = []
    for per_layer in (False, True):
        engine, row, prompt = _prefilled(model, n, kv_quant="int4", seed=4)
        keep = np.r_[0:10, 30:60, 70:80]
        from jaxkv.policies import layouts

        plan = layouts.dead_slot(engine.row_state[row].slots, keep)
        if per_layer:
            m = np.zeros((L, n), bool)
            m[:, keep] = True
            plan = layouts.with_layers(plan, m)
        engine.kv.apply_layout(row, plan)
        assert (engine.pool.decode_plan([engine.row_state[row]], [[1]], 1, 1) is None) == per_layer
        _, logits = engine.decode([row], [4], 4, return_logits=True, forced_tokens=[[6, 1, 9]])
        outs.append(np.asarray(logits[0], np.float64))
    assert np.abs(outs[0] - outs[1]).max() / np.abs(outs[0]).max() <= 1e-5
    engine, row, prompt = _prefilled(model, n, kv_quant="int4", seed=4)
    report, _ = _event(engine, row, "keydiff", layer_budgets(30, L, "pyramid"), np.r_[0:4])
    _assert_tables_mirror_host(engine, row)
    tokens, _ = engine.decode([row], [4], 3)
    assert len(tokens[0]) == 3


def test_one_list_engine_refuses_per_layer_plans(model):
    engine = jaxkv.Engine(model, rows=1, max_positions=256)
    row = engine.open_row()
    engine.prefill([row], [list(range(1, 30))])
    from jaxkv.policies import layouts

    plan = layouts.with_layers(layouts.dead_slot(engine.row_state[row].slots, np.arange(20)), np.ones((L, 29), bool) & (np.arange(29) < 20))
    with pytest.raises(ConfigError, match="layer_lists"):
        engine.kv.apply_layout(row, plan)
    assert len(engine.row_state[row].live) == 29  # nothing changed


# ============================================================================ sessions
LAYER = dict(policy="snapkv", budget=40, w=8, keep_sets="layer")


def _replay(model, server, seed=0, **options):
    session = Session(model, server=server, keep_reasoning=True, **options)
    turns = session.replay(_conversation(seed), None, generate=True, max_new_tokens=4)
    return session, [t.generated for t in turns], [t.prefix_hit for t in turns]


def _first_layer_drop(session) -> int:
    """The first position any layer of the session dropped (dead-slot events): an
    evicted position, or a kept one that some layer no longer reads."""
    first = []
    for c in session.compressions:
        kept = c.plan.kept_positions
        partial = kept[~c.plan.layer_keep[:, kept].all(axis=0)]
        first += list(c.plan.evicted_positions) + list(partial)
    return int(min(first))


def test_a_per_layer_pruned_prefix_never_reaches_another_session(model):
    with Server(model, max_positions=512, layer_lists=True) as fresh:  # the same engine shapes as below
        _, alone_full, _ = _replay(model, fresh, seed=0)
    with Server(model, max_positions=512, layer_lists=True) as server:
        pruned, _, _ = _replay(model, server, seed=0, **LAYER)
        assert pruned.compressions and all(c.layer_live_after is not None for c in pruned.compressions)
        first = _first_layer_drop(pruned)
        tokens = pruned._cached_ids
        other = server.cache_owner()
        radix = server.radix_for(None)
        match = server.scheduler.call(lambda: radix.match(np.asarray(tokens), owner=other)).result()
        assert 0 < match.length <= first  # public only up to the first position any layer dropped
        server.scheduler.call(lambda: radix.unlock(match.handle)).result()
        _, full, hits = _replay(model, server, seed=0)
        assert full == alone_full  # as on a fresh server
        assert hits[0] <= first  # the full cache reused the pruned session's clean prefix at most
        _assert_no_leak(server)


def test_layer_sets_come_back_with_the_sessions_cached_prefix(model):
    """A later turn of the same session reads, in each layer, what that layer kept
    at the earlier event (not the union of the layers' sets): a position a layer
    dropped never comes back to it."""
    with Server(model, max_positions=512, layer_lists=True) as server:
        # KeyDiff (question-agnostic, so layers differ) and the question evictable (a small forced set)
        s, _, hits = _replay(model, server, seed=1, policy="keydiff", budget=40, keep_sets="layer", protect_query=False)
        assert max(hits[1:]) > 0 and len(s.compressions) >= 2
        for e1, e2 in zip(s.compressions, s.compressions[1:]):
            k1, k2 = e1.plan.layer_keep, e2.plan.layer_keep
            P = min(k1.shape[1], k2.shape[1])
            assert not (k2[:, :P] & ~k1[:, :P]).any()
        assert any(len({tuple(np.flatnonzero(m)) for m in c.plan.layer_keep}) > 1 for c in s.compressions)  # layers differ


@pytest.mark.parametrize(
    "options",
    [dict(repair=8), dict(layout="compact"), dict(layer_budgets="pyramid", repair=8), dict(layer_budgets="shared", budget=80, repair=8)],
)
def test_per_layer_sessions_compose_and_leak_nothing(model, options):
    with Server(model, max_positions=512, layer_lists=True) as server:
        s, _, _ = _replay(model, server, seed=2, **{**LAYER, **options})
        assert any(c.live_after < c.live_before or (c.layer_live_after < c.live_before).any() for c in s.compressions)
        if options.get("layer_budgets") == "shared":
            # one pool of L x B: an event keeps at most that, unless its forced positions alone
            # exceed it (then every layer keeps just those), and somewhere the layers' shares differ
            B = s.retention.budget
            assert all(c.layer_live_after.sum() <= L * B or len(set(c.layer_live_after.tolist())) == 1 for c in s.compressions)
            assert any(len(set(c.layer_live_after.tolist())) > 1 for c in s.compressions), [c.layer_live_after for c in s.compressions]
        if "repair" in options:
            assert sum(r.promoted_positions.size for r in s.repairs) > 0
        _assert_no_leak(server)


def test_per_layer_sets_compose_with_segment_reuse():
    """The composition test's document conversation with segment reuse and
    per-layer StreamingLLM: it splices, then evicts, and leaks no slot."""
    from jaxkv.tasks import shared_corpus
    from test_composition import assert_no_leak, replay
    from test_reuse import conversation

    model = jaxkv.load_model("embedded")
    msgs, tools = conversation(shared_corpus(5, n_shelves=1, length=1400)[0], 1)
    msgs = msgs + [{"role": "assistant", "content": "The record is open."}]
    opts = dict(reuse="segment", tenant="t", reuse_layers=2, halo=2)
    with Server(model, max_positions=2048, layer_lists=True) as server:
        forget = lambda: server.scheduler.call(lambda: server.radix.evict(server.engine.allocator.capacity)).result()  # noqa: E731
        replay(server, msgs, tools, **opts)  # stores the document's segments
        forget()
        s, _, _ = replay(server, msgs, tools, policy="streaming_llm", budget=200, keep_sets="layer", layer_budgets="pyramid", **opts)
        assert sum(r.spliced_tokens for r in s._stage("reuse").reports) > 0
        assert any((c.layer_live_after < c.live_before).any() for c in s.compressions)  # the top layers dropped
        # a later turn splices over a per-layer-pruned row: each layer reads its own set
        s2, _, _ = replay(server, msgs, tools, policy="streaming_llm", budget=200, keep_sets="layer", layer_budgets="pyramid", **opts)
        assert s2.compressions
        assert_no_leak(server)


def test_meaningless_combinations_raise_config_error(model):
    with pytest.raises(ConfigError, match="h2o"):
        Session(model, policy="h2o", budget=64, keep_sets="layer")
    with pytest.raises(ConfigError, match="keep_sets='layer'"):
        Session(model, policy="snapkv", budget=64, layer_budgets="pyramid")
    with pytest.raises(ConfigError, match="keep_sets"):
        Session(model, policy="snapkv", budget=64, keep_sets="head")
    with pytest.raises(ConfigError, match="layer_budgets"):
        Session(model, policy="snapkv", budget=64, keep_sets="layer", layer_budgets="triangle")
    with pytest.raises(ConfigError, match="needs a retention policy"):
        Session(model, keep_sets="layer")
    with Server(model, max_positions=256) as server:
        with pytest.raises(ConfigError, match="layer_lists=True"):
            server.session(policy="snapkv", budget=64, keep_sets="layer")
    for name in ("intentkv", "intentkv_no_xattn"):
        from jaxkv.serving.stages.retention import RetentionSpec

        with pytest.raises(ConfigError, match="learned head"):
            RetentionSpec.make(name, 64, "dead_slot", {"head": None}, keep_sets="layer")
    # the default stays one set for the model, and a private server keeps one list per row
    s = Session(model, policy="snapkv", budget=64)
    assert s.retention.keep_sets == "model" and not s.server.engine.layer_lists
    assert Session(model, policy="snapkv", budget=64, keep_sets="layer").server.engine.kv.lists == L
