"""Every pair of mechanisms composes (issue: one pool interface, every mechanism composable).

The mechanisms: retention (a policy and its layout), RepairKV, ``kv_quant``,
segment reuse, a mesh, HTTP. For each pair one multi-turn conversation of the
embedded model runs with both mechanisms on, and is checked against its
single-mechanism references where they must match:

* with a budget above the conversation's length a policy evicts nothing, so a
  session with the policy (and RepairKV, which then has nothing to promote) and
  any other mechanism must reply exactly as that other mechanism alone;
* with a budget that evicts, the pair runs: the policy evicts, RepairKV promotes,
  and no slot leaks (only the radix cache holds slots afterwards);
* segment reuse on a quantized pool splices what it splices on the float pool;
  the stored segments are the pool's own float view, written back at the
  precision the pool stores, so the spliced prefill adds less error than the
  quantization itself (``test_segment_reuse_on_a_quantized_pool``).

Retention and RepairKV on a quantized pool (both layouts, TriAxialKV) are
``test_triaxial``'s ``test_quantized_session_composes_with_retention_and_repair``.
The pairs with a mesh run in the 8-device process (``tests/test_sharding.py``:
``session``: policy + layout + RepairKV; ``reuse``; ``quant``: an INT4 pool with
reuse, SnapKV and RepairKV; ``user_meshes``: a ``Server`` and ``Session``); the
HTTP pairs in ``tests/test_server_options.py`` (every per-request option against the
``Session`` it builds). ``PAIRS`` names the test that covers each pair and
``test_every_pair_is_covered`` checks that each one exists. Pairs without a
meaning raise ``ConfigError`` (``test_meaningless_pairs_raise_config_error``).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import jaxkv
from jaxkv.chat import render
from jaxkv.errors import ConfigError
from jaxkv.tasks import shared_corpus
from test_reuse import conversation as document_conversation

MECHANISMS = ("policy", "repair", "kv_quant", "reuse", "mesh", "http")
PAIRS = {  # (a, b) -> "module::test" that runs the pair
    ("policy", "repair"): "test_composition::test_policy_and_repair_compose",
    ("policy", "kv_quant"): "test_triaxial::test_quantized_session_composes_with_retention_and_repair",
    ("repair", "kv_quant"): "test_triaxial::test_quantized_session_composes_with_retention_and_repair",
    ("policy", "reuse"): "test_composition::test_retention_composes_with_segment_reuse",
    ("repair", "reuse"): "test_composition::test_retention_composes_with_segment_reuse",
    ("kv_quant", "reuse"): "test_composition::test_segment_reuse_on_a_quantized_pool",
    ("policy", "mesh"): "test_sharding::test_session_with_eviction_and_repair_runs_sharded",
    ("repair", "mesh"): "test_sharding::test_session_with_eviction_and_repair_runs_sharded",
    ("kv_quant", "mesh"): "test_sharding::test_quantized_pool_with_reuse_runs_sharded",
    ("reuse", "mesh"): "test_sharding::test_segment_reuse_runs_sharded",
    ("mesh", "http"): "test_sharding::test_the_http_app_on_a_mesh_replies_as_on_one_device",
    ("policy", "http"): "test_server_options::test_every_per_request_option_matches_its_session",
    ("repair", "http"): "test_server_options::test_every_per_request_option_matches_its_session",
    ("kv_quant", "http"): "test_server_options::test_every_per_request_option_matches_its_session",
    ("reuse", "http"): "test_server_options::test_every_per_request_option_matches_its_session",
}
NEW_TOKENS = 2
WIDE = 100_000  # a budget no conversation here reaches: the policy evicts nothing


@pytest.fixture(scope="module")
def model():
    return jaxkv.load_model("embedded")


@pytest.fixture(scope="module")
def talk():
    """Three assistant turns around one document (a search, opening the document,
    the answer: ~280 tokens at the last prompt)."""
    doc = shared_corpus(5, n_shelves=1, length=1400)[0]
    msgs, tools = document_conversation(doc, 1)
    return msgs + [{"role": "assistant", "content": "The record is open."}], tools, doc


def replay(server, msgs, tools, **options):
    session = server.session(keep_reasoning=True, **options)
    turns = session.replay(msgs, tools, generate=True, max_new_tokens=NEW_TOKENS)
    return session, [t.generated for t in turns], turns


def assert_no_leak(server):
    held = server.radix.held_slots()
    alloc = server.engine.allocator
    assert all(state is None for state in server.engine.row_state)
    assert np.array_equal(alloc.refcounts(), np.bincount(held, minlength=alloc.num_slots))


def test_every_pair_is_covered():
    import importlib

    assert set(PAIRS) | {(b, a) for a, b in PAIRS} >= set(itertools.permutations(MECHANISMS, 2))
    for target in set(PAIRS.values()):
        module, name = target.split("::")
        assert hasattr(importlib.import_module(module), name), target


def test_policy_and_repair_compose(model, talk):
    """Both layouts; RepairKV with the dead-slot layout (a compact layout renumbers
    positions, so there is nothing to repair into: ``ConfigError``, below)."""
    msgs, tools, _ = talk
    with jaxkv.Server(model, max_positions=2048) as server:
        _, alone, _ = replay(server, msgs, tools)
        _, wide, _ = replay(server, msgs, tools, policy="snapkv", budget=WIDE, repair=16)
        assert wide == alone  # nothing to evict, nothing to repair: the full cache's replies
        for options in (dict(repair=16), dict(layout="compact")):
            s, _, _ = replay(server, msgs, tools, policy="snapkv", budget=100, **options)
            assert any(c.live_after < c.live_before for c in s.compressions)
            assert "repair" not in options or sum(r.promoted_positions.size for r in s.repairs) > 0
        assert_no_leak(server)


def test_retention_composes_with_segment_reuse(model, talk):
    """A policy that reads no prefill feature (StreamingLLM) splices, then evicts.
    Stages that read prefill features (TOVA's attention mass, RepairKV's query
    rows) have their prefills run in full: the reports say so and the replies
    are those of the session without reuse."""
    msgs, tools, _ = talk
    opts = dict(reuse="segment", tenant="t", reuse_layers=2, halo=2)
    with jaxkv.Server(model, max_positions=2048) as server:
        forget = lambda: server.scheduler.call(lambda: server.radix.evict(server.engine.allocator.capacity)).result()  # noqa: E731
        spliced = lambda s: sum(r.spliced_tokens for r in s._stage("reuse").reports)  # noqa: E731
        replay(server, msgs, tools, **opts)  # stores the document's segments
        forget()
        s_alone, alone, _ = replay(server, msgs, tools, **opts)
        assert spliced(s_alone) > 0
        forget()
        s_wide, wide, _ = replay(server, msgs, tools, policy="streaming_llm", budget=WIDE, **opts)
        assert wide == alone and spliced(s_wide) == spliced(s_alone)
        forget()
        # 200: the document's turn splices over an intact context, then the policy evicts
        s, _, _ = replay(server, msgs, tools, policy="streaming_llm", budget=200, **opts)
        assert spliced(s) > 0
        assert any(c.live_after < c.live_before for c in s.compressions)
        forget()
        _, tova_alone, _ = replay(server, msgs, tools, policy="tova", budget=200, repair=16)
        forget()
        s_tova, tova_reuse, _ = replay(server, msgs, tools, policy="tova", budget=200, repair=16, **opts)
        reports = s_tova._stage("reuse").reports
        assert reports and all(r.skipped and r.spliced_tokens == 0 for r in reports)
        assert tova_reuse == tova_alone
        assert_no_leak(server)


def test_segment_reuse_on_a_quantized_pool(model, talk):
    """A triaxial session with segment reuse, on one triaxial pool: the same prompt
    run without reuse, through reuse with nothing stored yet, and through reuse
    splicing every layer of the document under the same left context.

    * Precision: after the spliced prefill the prompt holds as many INT2, INT4 and
      float tokens as without reuse (the tags' 2-bit tokens moved into whole INT2
      pages, ``Engine.requantize``), though most of it was spliced.
    * Values: the stored segments are the pool's dequantized rows, quantized again
      when written back, which is not bit-exact (a group's scale is rounded up to
      float16 from a recomputed range; on the float pool the spliced prefill equals
      the unspliced one within 1e-5, ``test_reuse``). So the anchor is that reuse
      costs less than quantization: the spliced logits are closer to the unspliced
      ones than those are to the float model's, with the same next token."""
    from test_triaxial import allocation

    _, _, doc = talk
    msgs, tools = document_conversation(doc, 1)  # the prompt that ends with the document
    quant = dict(kv_bits=2.0, kv_allocation=allocation())
    opts = dict(reuse="segment", tenant="t", reuse_layers=model.config.num_layers, halo=2, **quant)
    with jaxkv.Server(model, max_positions=2048, kv_quant="triaxial") as server:
        forget = lambda: server.scheduler.call(lambda: server.radix.evict(server.engine.allocator.capacity)).result()  # noqa: E731
        plain = server.session(**quant)
        plain.chat(msgs, tools, max_new_tokens=1)
        forget()
        first = server.session(**opts)
        first.chat(msgs, tools, max_new_tokens=1)  # stores the segments
        forget()
        spliced = server.session(**opts)
        spliced.chat(msgs, tools, max_new_tokens=1)
        report = spliced.reuse.reports[-1]
        assert report.accepted >= 2 and report.spliced_tokens > 0.6 * report.suffix_tokens
        want, got = plain.quantization.records[-1], spliced.quantization.records[-1]
        assert want.int2 > 0 and (got.int2, got.int4, got.full) == (want.int2, want.int4, want.full)
        assert_no_leak(server)
    ids = render(model.tokenizer, msgs, tools, add_generation_prompt=True).ids
    dense = np.asarray(jaxkv.score_logits(model, ids[None])[0, -1])
    q_first, q_spliced = np.asarray(first.reuse.last_logits), np.asarray(spliced.reuse.last_logits)
    reuse_err, quant_err = float(np.abs(q_spliced - q_first).max()), float(np.abs(q_first - dense).max())
    print(f"\ntriaxial pool: spliced vs unspliced max logit error {reuse_err:.2e}; unspliced vs float {quant_err:.2e}")
    assert reuse_err < quant_err and np.argmax(q_spliced) == np.argmax(q_first)


def test_meaningless_pairs_raise_config_error(model):
    with jaxkv.Server(model, max_positions=512, kv_quant="int4") as server:
        with pytest.raises(ConfigError):
            server.session(kv_quant="kivi2")  # another pool's regions
        with pytest.raises(ConfigError):
            server.session(kv_bits=2.5)  # an average budget is a triaxial mode's
    with pytest.raises(ConfigError):
        jaxkv.Session(model, repair=16)  # RepairKV repairs a policy's evictions
    with pytest.raises(ConfigError):
        jaxkv.Session(model, policy="snapkv", budget=64, layout="compact", repair=16)  # positions renumbered
    with pytest.raises(ConfigError):
        jaxkv.Session(model, layout="compact")  # a layout places a policy's survivors
