"""Cross-query segment reuse: exactness anchors, failure handling, isolation, eviction.

End-to-end checks run sessions of the embedded model (sharp next-token
distributions, so the acceptance test has something to measure) on conversations
that show one document behind different histories, at different positions.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxkv
from jaxkv.cache.segments import PromptIndex, SegmentStore, align, minhash, segment_units
from jaxkv.chat import render
from jaxkv.engine import Engine
from jaxkv.kernels import rope_delta
from jaxkv.kernels.testing import rel_err
from jaxkv.tasks import shared_corpus, shared_docs
from jaxkv.tasks.example import tool_call
from jaxkv.tasks.words import SYSTEM_AGENT

NS = ("segment", 3, 32, 6)


@pytest.fixture(scope="module")
def model():
    return jaxkv.load_model("embedded")


@pytest.fixture(scope="module")
def doc():
    return shared_corpus(5, n_shelves=1, length=1400)[0]  # 14 records


def conversation(doc, history: int):
    """A conversation that opens ``doc`` after ``history`` earlier records of prose."""
    tools = None  # short system prompt: the document is most of each prompt
    msgs = [
        {"role": "system", "content": SYSTEM_AGENT},
        {"role": "user", "content": f"In the {doc.project} project, find {doc.topic} {doc.records[history % 5][0]}. Then answer."},
    ]
    for i in range(history):
        msgs.append(
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": f"First, the search for {doc.project}.",
                "tool_calls": [tool_call("search", query=doc.project)],
            }
        )
        msgs.append(
            {
                "role": "tool",
                "name": "search",
                "content": f"Search results for {doc.project}:\n"
                + "\n".join(f"{doc.project} {t}: d1{i}{j}" for j, t in enumerate(("budget", "travel", "legal")[: 1 + i % 3])),
            }
        )
    msgs.append(
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": f"After the search, next is {doc.topic}.",
            "tool_calls": [tool_call("open", doc_id=doc.doc_id)],
        }
    )
    msgs.append({"role": "tool", "name": "open", "content": doc.text})
    return msgs, tools


def reference_logits(model, msgs, tools):
    ids = render(model.tokenizer, msgs, tools, add_generation_prompt=True).ids
    return np.asarray(jaxkv.score_logits(model, ids[None])[0, -1]), ids


def chat(server, msgs, tools, **options):
    s = server.session(**options)
    reply = s.chat(msgs, tools, max_new_tokens=2)
    return s, s._stage("reuse"), reply


# ============================================================================ exactness anchors
@pytest.mark.parametrize("halo", [0, 5])
def test_layer0_reuse_equals_full_recompute_whatever_the_left_context(model, doc, halo):
    server = jaxkv.Server(model, max_positions=2048)
    opts = dict(reuse="segment", tenant="t", reuse_layers=1, halo=halo)
    chat(server, *conversation(doc, 0), **opts)
    msgs, tools = conversation(doc, 2)  # another history: the document sits elsewhere
    _, stage, _ = chat(server, msgs, tools, **opts)
    rep = stage.reports[-1]
    assert rep.accepted >= 1 and rep.spliced_tokens >= 60  # the document was really spliced
    ref, _ = reference_logits(model, msgs, tools)
    np.testing.assert_allclose(stage.last_logits, ref, atol=1e-5, rtol=0)
    server.close()


def test_rope_delta_rotated_segment_equals_rope_at_new_positions(model, doc):
    """Layer-0 keys depend on token and position only: the keys a row computed at
    positions p, rotated by ``rope_delta`` to p + d, are the keys computed at p + d."""
    ids = np.asarray(model.tokenizer(doc.text)["input_ids"], np.int32)
    engine = Engine(model, rows=2, max_positions=1024)
    d = 137
    rows = [engine.open_row(), engine.open_row()]
    engine.prefill(rows, [ids, np.concatenate([np.full(d, ids[0], np.int32), ids])])
    k_old, _ = engine.kv.gather_rows(engine.row_state[rows[0]].slots)
    k_new, _ = engine.kv.gather_rows(engine.row_state[rows[1]].slots[d:])
    m = ids.size
    rotated = rope_delta(jnp.asarray(k_old[:1]), jnp.arange(m, dtype=jnp.int32), jnp.full(m, d, jnp.int32), model.config.rope)
    assert rel_err(np.asarray(rotated)[0], k_new[0]) <= 1e-5  # the standard of tests/test_rope_delta.py
    assert np.abs(k_old[0] - k_new[0]).max() > 0.1  # the move is not a no-op


def test_full_reuse_under_identical_left_context_equals_prefix_caching(model, doc):
    msgs, tools = conversation(doc, 1)
    L = model.config.num_layers
    # prefix caching: the second identical request reuses all but its last token
    server = jaxkv.Server(model, max_positions=2048)
    replay = msgs + [{"role": "assistant", "content": "Answer: done."}]
    server.session().replay(replay, tools)
    cached = server.session().replay(replay, tools, return_logits=True)[-1]  # the turn whose prompt is msgs
    assert cached.prefix_hit == cached.prompt_ids.size - 1
    server.close()
    # segment reuse of every layer, same tokens before every segment, radix emptied
    server = jaxkv.Server(model, max_positions=2048)
    opts = dict(reuse="segment", tenant="t", reuse_layers=L, halo=2)
    chat(server, msgs, tools, **opts)
    server.scheduler.call(lambda: server.radix.evict(server.engine.allocator.capacity)).result()
    _, stage, _ = chat(server, msgs, tools, **opts)
    rep = stage.reports[-1]
    assert rep.accepted >= 2 and rep.spliced_tokens > 0.6 * rep.suffix_tokens
    np.testing.assert_allclose(stage.last_logits, cached.prompt_logits[-1], atol=1e-5, rtol=0)
    server.close()


# ============================================================================ failure handling
def test_corrupted_segment_is_rejected_and_output_equals_no_reuse(model, doc):
    server = jaxkv.Server(model, max_positions=2048)
    opts = dict(reuse="segment", tenant="t")
    chat(server, *conversation(doc, 0), **opts)
    rng = np.random.default_rng(0)
    corrupted = list(server.segments._lru.values())
    for seg in corrupted:
        for a in (seg.k, seg.v, seg.resid):
            a[...] = rng.standard_normal(a.shape).astype(a.dtype) * a.std()
    msgs, tools = conversation(doc, 2)
    _, stage, reply = chat(server, msgs, tools, **opts)
    rep = stage.reports[-1]
    assert rep.rejected >= 1 and rep.accepted == 0 and max(rep.probe_kl) > 0.1
    plain = jaxkv.Server(model, max_positions=2048)
    assert plain.session().chat(msgs, tools, max_new_tokens=2) == reply
    ref, _ = reference_logits(model, msgs, tools)
    np.testing.assert_allclose(stage.last_logits, ref, atol=1e-5, rtol=0)
    live = set(server.segments._lru)
    assert any(seg.id not in live for seg in corrupted) and rep.stored > 0  # rejected segments replaced by fresh ones
    server.close()
    plain.close()


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(offset=st.integers(0, 600), edit_frac=st.floats(0.0, 0.1), seed=st.integers(0, 2**16))
def test_lsh_finds_shifted_and_edited_segment(offset, edit_frac, seed):
    rng = np.random.default_rng(seed)
    store = SegmentStore()
    seg_tokens = rng.integers(0, 1900, 128)
    segs = []
    for i in range(16):  # the target among unrelated segments
        toks = seg_tokens if i == 7 else rng.integers(0, 1900, 128)
        z = np.zeros((1, 128, 1, 2), np.float32)
        segs.append(store.add("t", NS, toks, np.arange(128), z, z, None, minhash(toks), minhash([]), origin=i))
    target = segs[7]
    edited = seg_tokens.copy()
    where = rng.choice(128, int(edit_frac * 128), replace=False)
    edited[where] = (edited[where] + 1 + rng.integers(0, 1000, where.size)) % 1900
    query = np.concatenate([rng.integers(0, 1900, offset), edited, rng.integers(0, 1900, 40)])
    units = segment_units(query.size, [(0, query.size)], window=128, stride=32)
    found = store.candidates("t", NS, [minhash(query[a:b]) for a, b in units])
    assert target in found
    best = max(align(target, PromptIndex(query, 0, query.size), min_run=1), key=lambda a: a.similarity)
    assert best.offset == offset and best.similarity >= 1 - where.size / 128 - 1e-9


# ============================================================================ isolation, eviction
OPS = st.lists(
    st.tuples(st.sampled_from(["add", "lookup", "remove"]), st.sampled_from(["a", "b", "c"]), st.integers(0, 7)), min_size=1, max_size=40
)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(ops=OPS)
def test_segments_never_cross_tenants(ops):
    docs = [np.random.default_rng(i).integers(0, 500, 64) for i in range(8)]  # shared texts: every tenant may store them
    z = np.zeros((1, 64, 1, 4), np.float32)
    store = SegmentStore(cap_bytes=6 * (2 * z.nbytes + 64 * 12))
    owner = {}
    for op, tenant, i in ops:
        if op == "add":
            seg = store.add(tenant, NS, docs[i], np.arange(64), z + i, z, None, minhash(docs[i]), minhash([]))
            owner[seg.id] = tenant
        elif op == "lookup":
            for seg in store.candidates(tenant, NS, [minhash(docs[i])]):
                assert seg.tenant == tenant == owner[seg.id]
            for other in {"a", "b", "c"} - {tenant}:
                for seg in store.segments(other, NS):
                    with pytest.raises(jaxkv.JaxKVError):
                        store.get(tenant, NS, seg.id)
        else:
            mine = store.segments(tenant, NS)
            if mine:
                store.remove(mine[i % len(mine)])
        assert store.nbytes <= store.cap_bytes
        assert all(s.tenant == t for t in "abc" for s in store.segments(t, NS))


def test_sessions_of_another_tenant_never_splice(model, doc):
    server = jaxkv.Server(model, max_positions=2048)
    chat(server, *conversation(doc, 0), reuse="segment", tenant="alice")
    _, stage, _ = chat(server, *conversation(doc, 2), reuse="segment", tenant="bob")
    assert stage.reports[-1].spans == 0 and stage.reports[-1].stored > 0
    _, stage, _ = chat(server, *conversation(doc, 1), reuse="segment", tenant="alice")
    assert stage.reports[-1].spans >= 1  # the same document does match within alice's namespace
    server.close()


def test_eviction_zeroises_stored_arrays():
    rng = np.random.default_rng(0)

    def add(store, tenant="t"):
        toks = rng.integers(0, 100, 32)
        return store.add(
            tenant,
            NS,
            toks,
            np.arange(32),
            rng.standard_normal((2, 32, 1, 4)),
            rng.standard_normal((2, 32, 1, 4)),
            rng.standard_normal((32, 8)),
            minhash(toks),
            minhash([]),
        )

    store = SegmentStore(cap_bytes=2 * 5000)
    first, second = add(store), add(store)
    arrays = first.arrays
    assert all(np.abs(a).sum() > 0 for a in arrays)
    third = add(store)  # over the cap: the least recently used (first) goes
    assert first.id not in {s.id for s in store.segments("t", NS)} and store.evictions == 1
    assert all(not a.any() for a in arrays)
    store.remove(second)
    assert all(not a.any() for a in second.arrays)
    assert store.drop_tenant("t") == 1 and not any(a.any() for a in third.arrays) and store.nbytes == 0


# ============================================================================ CacheBlend, options, workload
def test_cacheblend_recomputes_the_top_fraction_of_reused_tokens(model, doc):
    server = jaxkv.Server(model, max_positions=2048)
    chat(server, *conversation(doc, 0), reuse="cacheblend", tenant="t")
    msgs, tools = conversation(doc, 2)
    _, stage, _ = chat(server, msgs, tools, reuse="cacheblend", tenant="t")
    rep = stage.reports[-1]
    L = model.config.num_layers
    kept = rep.spliced_tokens
    assert rep.accepted >= 1 and rep.matched_tokens >= 60
    assert kept == rep.matched_tokens - math.ceil(0.15 * rep.matched_tokens)
    assert rep.units == rep.suffix_tokens + (rep.suffix_tokens - kept) * (L - 1)
    assert np.isfinite(stage.last_logits).all()
    server.close()


def test_reuse_options_are_validated(model):
    with pytest.raises(jaxkv.ConfigError):
        jaxkv.Session(model, reuse="bogus")
    with pytest.raises(jaxkv.ConfigError):
        jaxkv.Session(model, halo=4)  # a reuse option without reuse
    with pytest.raises(jaxkv.ConfigError):
        jaxkv.Session(model, reuse="segment", reuse_layers={1, 2})  # L_reuse must be the lower layers
    s = jaxkv.Session(model, reuse="segment", tenant="x", reuse_layers={0, 1}, tau_seg=0.9)
    assert s._stage("reuse").config.reuse_layers == 2 and s._stage("reuse").tenant == "x"


def test_shared_docs_repeat_documents_at_different_positions():
    a, b = shared_docs(40, 3), shared_docs(40, 3)
    assert [e.messages for e in a] == [e.messages for e in b]
    corpus = {d.doc_id: d.text for d in shared_corpus(0)}
    seen: dict[str, set] = {}
    for ex in a:
        for i, m in enumerate(ex.messages):
            if m["role"] == "tool" and m["name"] == "open":
                doc_id = ex.messages[i - 1]["tool_calls"][0]["function"]["arguments"]["doc_id"]
                assert m["content"] == corpus[doc_id]  # verbatim corpus text
                seen.setdefault(doc_id, set()).add(sum(len(x.get("content") or "") for x in ex.messages[:i]))
        for t in ex.targets:
            for ev in t.evidence:
                assert ev.message_index < t.message_index
    assert max(len(v) for v in seen.values()) >= 3  # the same document behind different histories
