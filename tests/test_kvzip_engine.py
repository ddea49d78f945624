"""KVzip as a retention policy through jaxkv's engine (``policy="kvzip"``).

* The scores an event reads are kvpress's: the row's reconstruction inputs
  (``kvzip.repeat_chunks``, several chunks) fed through the engine's prefill, their
  queries and keys scored; here the same inputs run through the model densely
  (no pool, no slots: ``module.run_layers``), scored by the float64 NumPy statement
  of ``KVzipPress`` (``test_kvzip.kvpress_chunk``) and assembled as kvpress does.
  The event's evicted scores are the reference's means over layers and KV heads,
  and its kept set is ``F ∪ top-k`` of them.
* A pass is not cut to the step's capture cap (``runner.CAPTURE_ROWS``, lowered
  below a pass here): its job is ``wide_capture``, so each step returns every
  token's queries and the pass runs as whole prefill chunks; the packer cuts an
  ordinary capturing job to the cap and lifts it for a step holding a wide piece.
* The passes leave nothing behind: after them the row has its context's length,
  slots, live list and per-layer sets, on the host and on the device, and the
  pool has as many free slots as before; their tokens are counted in the event's
  report (``scoring_tokens``).
* Per-layer keep sets: each layer keeps its own top of its own scores (the mean
  over its KV heads); a second event scores a row with per-layer holes.
* RepairKV: a kvzip session repairs at turn boundaries and leaks no slot.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_kvzip import kvpress_chunk
from test_layer_sets import L, model  # noqa: F401  (fixture: 4 layers, 4 query heads over 2 KV heads)
from test_repair import _assert_no_leak, _conversation

import jaxkv
from jaxkv import attention
from jaxkv.engine import packing, runner
from jaxkv.engine.jobs import PrefillJob
from jaxkv.errors import ConfigError
from jaxkv.policies import kvzip
from jaxkv.serving import Server, Session
from jaxkv.serving.stages import reconstruction

B, CHUNK = 40, 48  # a budget under the prompt; chunks small enough for several passes


def _messages(seed: int, turns: int = 1):
    return _conversation(seed)[: 1 + 2 * turns] if turns == 1 else _conversation(seed)


@pytest.fixture
def passes(monkeypatch):
    """Every reconstruction run: the row before and after it, and its result."""
    seen = []
    original = reconstruction.run_passes

    def state(turn):
        req, kv = turn.req, turn.engine.kv
        cache = kv.cache
        return {
            "seq_len": req.seq_len,
            "slots": list(req.slots),
            "live": list(req.live),
            "layers": req.layer_mask(turn.engine.model.config.num_layers),
            "free": kv.allocator.num_free,
            "device": (int(cache.seq_len[turn.row]), np.asarray(cache.live_len[:, turn.row]).tolist()),
        }

    def spy(turn, config):
        before = state(turn)
        tokens = list(turn.req.tokens)
        result = yield from original(turn, config)
        seen.append({"before": before, "after": state(turn), "result": result, "tokens": tokens})
        return result

    monkeypatch.setattr(reconstruction, "run_passes", spy)
    return seen


@functools.cache
def _dense_run(module, T):
    """The jit'd dense run of ``T`` tokens returning every layer's (q, k)."""

    def capture(i, q, k, v, carry):
        return attention.causal_attention(q, k, v), carry, (q, k)

    return jax.jit(lambda ids: module.run_layers(module.embed_tokens(ids), jnp.arange(T, dtype=jnp.int32)[None], capture)[2])


def dense_reference(model, tokens, chunk_size=CHUNK):
    """KVzipPress's scores of a context ``[L, n, Hkv]`` (float64), from a dense run of
    the context followed by each reconstruction input (causal: padding after them
    changes nothing, so every run is one compiled length)."""
    n = len(tokens)
    want = np.zeros((L, n, model.config.num_kv_heads))
    chunks = kvzip.repeat_chunks(model.tokenizer, tokens, chunk_size)
    assert len(chunks) >= 2  # the test means several passes
    T = -(-(n + max(c.ids.size for c in chunks)) // 128) * 128  # a multiple of 128: the tests' runs share one program
    run = _dense_run(model.module, T)
    for c in chunks:
        ids = np.zeros((1, T), np.int32)
        ids[0, : n + c.ids.size] = list(tokens) + c.ids.tolist()
        q, k = (np.asarray(a, np.float64)[:, 0, : n + c.ids.size] for a in run(ids))  # [L, n + X, H, D]
        want[:, c.start : c.end] = kvpress_chunk(q[:, n:], k[:, :n], k[:, n:], c.start, c.end, kvzip.N_SINK)
    want[:, : kvzip.N_SINK] = want.max() + 1.0
    return want, chunks


def top_set(score, forced, budget):
    """``F ∪ top-k`` of ``score`` (ties: lower position first)."""
    cand = np.flatnonzero(~forced)
    order = cand[np.lexsort((cand, -score[cand]))]
    return np.union1d(np.flatnonzero(forced), order[: max(budget - int(forced.sum()), 0)])


def assert_left_nothing(run):
    before, after = run["before"], run["after"]
    for key in ("seq_len", "slots", "live", "free", "device"):
        assert before[key] == after[key], key
    assert np.array_equal(before["layers"], after["layers"])
    assert run["result"].tokens == sum(c.ids.size for c in run["result"].chunks) > before["seq_len"]


def test_scores_through_the_engine_are_kvpress_scores_and_the_passes_leave_nothing(model, passes, monkeypatch):
    monkeypatch.setattr(runner, "CAPTURE_ROWS", 16)  # below every pass (prompt + a 48-token chunk)
    pieces = []
    original = runner.ModelRunner.run

    def run_step(self, step):
        pieces.extend((job.wide_capture, n, job.tokens.size) for job, n in step.pieces)
        return original(self, step)

    monkeypatch.setattr(runner.ModelRunner, "run", run_step)
    session = Session(model, max_positions=512, policy="kvzip", budget=B, chunk_size=CHUNK, protect_query=False)
    session.replay(_messages(0), None)
    (run,) = passes
    wide = [(n, size) for is_wide, n, size in pieces if is_wide]
    assert len(wide) == len(run["result"].chunks) and all(n == size > 16 for n, size in wide)  # one whole piece each
    assert_left_nothing(run)
    (report,) = session.compressions
    assert report.scoring_tokens == run["result"].tokens

    tokens = run["tokens"]
    want, chunks = dense_reference(model, tokens)
    assert [c.ids.tolist() for c in chunks] == [c.ids.tolist() for c in run["result"].chunks]
    n = len(tokens)
    np.testing.assert_allclose(run["result"].scores_LNK[:, :n], want, rtol=1e-4, atol=1e-6)
    score = want.mean(axis=(0, 2))
    np.testing.assert_allclose(report.evicted_scores, score[report.plan.evicted_positions], rtol=1e-4, atol=1e-6)
    forced = np.zeros(n, bool)
    forced[: kvzip.N_SINK] = True
    forced |= _pinned(session, tokens)
    assert report.live_after == B
    assert np.array_equal(report.kept_positions, top_set(score, forced, B))
    session.close()


def _pinned(session, tokens):
    """The protected prefix of the session's first request (the system prompt)."""
    rendered = session._render(_messages(0)[:2], None, add_generation_prompt=True)
    assert rendered.ids.tolist() == list(tokens)
    a, b = rendered.spans.protected_prefix
    out = np.zeros(len(tokens), bool)
    out[a:b] = True
    return out


def test_per_layer_sets_keep_each_layers_own_top_and_score_a_row_with_holes(model, passes):
    with Server(model, max_positions=512, layer_lists=True) as server:
        session = server.session(policy="kvzip", budget=B, chunk_size=CHUNK, keep_sets="layer", protect_query=False)
        session.replay(_messages(1, turns=3), None)
        assert len(passes) >= 2 and len(session.compressions) == len(passes)
        for run in passes:
            assert_left_nothing(run)
        first = session.compressions[0]
        tokens = passes[0]["tokens"]
        want, _ = dense_reference(model, tokens)
        forced = np.zeros(len(tokens), bool)
        forced[: kvzip.N_SINK] = True
        forced[: _system_end(session, tokens)] = True
        keep_LP = first.plan.layer_keep
        for l in range(L):  # layer l: its own scores (the mean over its KV heads), no mean over layers
            assert np.array_equal(np.flatnonzero(keep_LP[l]), top_set(want[l].mean(axis=-1), forced, B)), l
        assert len({tuple(np.flatnonzero(m)) for m in keep_LP}) > 1  # the layers chose differently
        assert first.layer_live_after.tolist() == [B] * L
        later = passes[1]["before"]["layers"]
        assert not (later == later[0]).all()  # the second event's row had per-layer holes
        for report in session.compressions[1:]:
            assert report.layer_live_after.tolist() == [B] * L and report.scoring_tokens > 0
        session.close()
        _assert_no_leak(server)


def _system_end(session, tokens):
    rendered = session._render(_messages(1)[:2], None, add_generation_prompt=True)
    assert rendered.ids.tolist() == list(tokens)
    return rendered.spans.protected_prefix[1]


def test_repairkv_promotes_over_a_kvzip_cache_and_leaks_nothing(model, passes):
    K = 8
    with Server(model, max_positions=512) as server:
        session = server.session(policy="kvzip", budget=B, chunk_size=CHUNK, repair=K, protect_query=False)
        session.replay(_messages(2, turns=3), None)
        assert len(session.compressions) >= 3 and all(c.scoring_tokens > 0 for c in session.compressions)
        for run in passes:
            assert_left_nothing(run)
        promoted = [r.promoted_positions.size for r in session.repairs[1:]]
        assert promoted and all(0 < p <= K for p in promoted)
        session.close()
        _assert_no_leak(server)


def test_bad_options_and_a_model_without_tokenizer_are_config_errors(model):
    for options in ({"aggregate": "median"}, {"chunk_size": 0}, {"n_sink": -1}):
        with pytest.raises(ConfigError):
            Session(model, policy="kvzip", budget=B, **options)
    bare = jaxkv.model_from_config(model.config, seed=0)
    assert bare.tokenizer is None
    with pytest.raises(ConfigError, match="tokenizer"):
        Session(bare, policy="kvzip", budget=B)


def test_the_packer_cuts_a_capturing_piece_to_the_cap_and_lifts_it_for_a_wide_one():
    def job(n, wide):
        return PrefillJob(0, np.zeros(n, np.int32), q_idx_X=np.arange(n), wide_capture=wide)

    pack = {"budget": 512, "rows": 4, "chunk": 512, "whole_chunks": False, "max_captured": 128}
    (piece,) = packing.pack_step([job(300, False)], [], **pack).pieces
    assert piece[1] == 128
    (piece,) = packing.pack_step([job(300, True)], [], **pack).pieces
    assert piece[1] == 300
    narrow, wide = packing.pack_step([job(100, False), job(300, True)], [], **pack).pieces
    assert (narrow[1], wide[1]) == (100, 300)  # the wide piece's step returns every token's queries
