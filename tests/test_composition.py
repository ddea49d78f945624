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
from jaxkv.errors import ConfigError
from jaxkv.tasks import shared_corpus
from test_reuse import conversation as document_conversation

MECHANISMS = ("policy", "repair", "kv_quant", "reuse", "mesh", "http")
PAIRS = {  # (a, b) -> "module::test" that runs the pair
    ("policy", "repair"): "test_composition::test_policy_and_repair_compose",
    ("policy", "kv_quant"): "test_composition::test_retention_composes_with_a_quantized_pool",
    ("repair", "kv_quant"): "test_composition::test_retention_composes_with_a_quantized_pool",
    ("policy", "reuse"): "test_composition::test_retention_composes_with_segment_reuse",
    ("repair", "reuse"): "test_composition::test_retention_composes_with_segment_reuse",
    ("kv_quant", "reuse"): "test_composition::test_segment_reuse_on_a_quantized_pool",
    ("policy", "mesh"): "test_sharding::test_session_with_eviction_and_repair_runs_sharded",
    ("repair", "mesh"): "test_sharding::test_session_with_eviction_and_repair_runs_sharded",
    ("kv_quant", "mesh"): "test_sharding::test_quantized_pool_with_reuse_eviction_and_repair_runs_sharded",
    ("reuse", "mesh"): "test_sharding::test_segment_reuse_runs_sharded",
    ("mesh", "http"): "test_sharding::test_meshes_built_with_jax_match_one_device",
    ("policy", "http"): "test_server_options::test_every_per_request_option_matches_its_session",
    ("repair", "http"): "test_server_options::test_every_per_request_option_matches_its_session",
    ("kv_quant", "http"): "test_server_options::test_every_per_request_option_matches_its_session",
    ("reuse", "http"): "test_server_options::test_every_per_request_option_matches_its_session",
}
NEW_TOKENS = 3
WIDE = 100_000  # a budget no conversation here reaches: the policy evicts nothing


@pytest.fixture(scope="module")
def model():
    return jaxkv.load_model("embedded")


@pytest.fixture(scope="module")
def talk():
    """A three-turn conversation around one document (~310 tokens at its end)."""
    doc = shared_corpus(5, n_shelves=1, length=1400)[0]
    msgs, tools = document_conversation(doc, 1)
    msgs = msgs + [{"role": "assistant", "content": "The record is open."},
                   {"role": "user", "content": f"Which {doc.topic} record is it?"},
                   {"role": "assistant", "content": "The first one."}]
    return msgs, tools, doc


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
        for options in (dict(repair=16), dict(layout="compact")):
            _, wide, _ = replay(server, msgs, tools, policy="snapkv", budget=WIDE, **options)
            assert wide == alone  # nothing to evict, nothing to repair: the full cache's replies
            s, _, _ = replay(server, msgs, tools, policy="snapkv", budget=120, **options)
            assert any(c.live_after < c.live_before for c in s.compressions)
            assert "repair" not in options or sum(r.promoted_positions.size for r in s.repairs) > 0
        assert_no_leak(server)


def test_retention_composes_with_a_quantized_pool(model, talk):
    msgs, tools, _ = talk
    with jaxkv.Server(model, max_positions=2048, kv_quant="int4") as server:
        _, alone, _ = replay(server, msgs, tools)
        _, wide, _ = replay(server, msgs, tools, policy="h2o", budget=WIDE, repair=16)
        assert wide == alone
        s, _, _ = replay(server, msgs, tools, policy="h2o", budget=120, repair=16)
        assert any(c.live_after < c.live_before for c in s.compressions)
        assert sum(r.promoted_positions.size for r in s.repairs) > 0
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
        # 250: the document's turn splices over an intact context, then the policy evicts
        s, _, _ = replay(server, msgs, tools, policy="streaming_llm", budget=250, **opts)
        assert spliced(s) > 0
        assert any(c.live_after < c.live_before for c in s.compressions)
        forget()
        _, tova_alone, _ = replay(server, msgs, tools, policy="tova", budget=250, repair=16)
        forget()
        s_tova, tova_reuse, _ = replay(server, msgs, tools, policy="tova", budget=250, repair=16, **opts)
        reports = s_tova._stage("reuse").reports
        assert reports and all(r.skipped and r.spliced_tokens == 0 for r in reports)
        assert tova_reuse == tova_alone
        assert_no_leak(server)


def _spliced_against_unspliced(model, msgs, tools, kv_quant):
    """The last prompt logits of a reuse session's first run (nothing stored yet:
    every token prefilled by the reuse stage) and of a second run that splices
    every layer of the document under the same left context, with its report."""
    opts = dict(reuse="segment", tenant="t", reuse_layers=model.config.num_layers, halo=2)
    with jaxkv.Server(model, max_positions=2048, kv_quant=kv_quant) as server:
        first = server.session(**opts)
        first.chat(msgs, tools, max_new_tokens=1)
        server.scheduler.call(lambda: server.radix.evict(server.engine.allocator.capacity)).result()
        again = server.session(**opts)
        again.chat(msgs, tools, max_new_tokens=1)
        assert_no_leak(server)
        return np.asarray(first._stage("reuse").last_logits), np.asarray(again._stage("reuse").last_logits), again._stage("reuse").reports[-1]


def test_segment_reuse_on_a_quantized_pool(model, talk):
    """On the float pool the spliced prefill equals the unspliced one within 1e-5
    (``test_reuse``'s anchor). On an INT4 pool it splices the same spans; the
    stored segments are the pool's dequantized rows and are quantized again when
    written back, which is not bit-exact (a group's scale is rounded up to float16
    from a recomputed range), so the anchor there is that reuse costs less than
    quantization itself: the spliced logits are closer to the unspliced INT4 ones
    than those are to the float pool's, with the same next token."""
    _, tools, doc = talk
    msgs, tools = document_conversation(doc, 1)  # the prompt that ends with the document
    f_first, f_spliced, f_report = _spliced_against_unspliced(model, msgs, tools, None)
    q_first, q_spliced, q_report = _spliced_against_unspliced(model, msgs, tools, "int4")
    assert f_report.accepted >= 2 and f_report.spliced_tokens > 0.6 * f_report.suffix_tokens
    assert (q_report.accepted, q_report.spliced_tokens) == (f_report.accepted, f_report.spliced_tokens)
    float_err = float(np.abs(f_spliced - f_first).max())
    reuse_err = float(np.abs(q_spliced - q_first).max())
    quant_err = float(np.abs(q_first - f_first).max())
    print(f"\nspliced vs unspliced: float pool {float_err:.2e}, INT4 pool {reuse_err:.2e}; INT4 vs float {quant_err:.2e}")
    assert float_err <= 1e-5
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
