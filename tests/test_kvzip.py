"""KVzip's score (``jaxkv.policies.kvzip``) against a float64 NumPy statement of kvpress 0.5.5's ``KVzipPress``.

The reference below follows ``KVzipPress._compute_cross_attention`` and
``score_kvzip`` step by step: the sinks' keys, the chunk's keys and the input's own
keys concatenated, ``q·k/√D``, a causal mask on the input's own columns, a softmax,
KVzip+'s row and column factors when asked, the chunk's columns kept, the maximum
over the GQA group and the rows; ``compress_post``'s sinks at the maximum plus one.
Random inputs, GQA (6 query heads over 2 KV heads), padded input rows and padded
context entries (which the reference never sees), every chunk of a context, jitted.
Then the host-side builder of kvpress's reconstruction inputs on SmolLM2's template.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxkv.policies import kvzip

L, HQ, HKV, D = 3, 6, 2, 16


def kvpress_chunk(q, k_ctx, k_self, start, end, n_sink, h_norm=None, wov=None):
    """``KVzipPress.score_kvzip`` of one chunk, float64, one batch row, no padding:
    ``q [L, X, Hq, D]``, ``k_ctx [L, n, Hkv, D]``, ``k_self [L, X, Hkv, D]``,
    ``h_norm [L, X]`` (‖h‖ per row), ``wov [L, Hq, n + X]`` (‖v W_O‖ over the whole
    cache: context then input). Returns the chunk's scores ``[L, end - start, Hkv]``."""
    nl, x, hq, d = q.shape
    hkv, g = k_ctx.shape[2], hq // k_ctx.shape[2]
    sink = min(n_sink, start)
    keys = np.concatenate([k_ctx[:, :sink], k_ctx[:, start:end], k_self], axis=1)  # [L, M, Hkv, D]
    cols = np.r_[np.arange(sink), np.arange(start, end), k_ctx.shape[1] + np.arange(x)]
    out = np.zeros((nl, end - start, hkv))
    for l in range(nl):
        for k in range(hkv):
            best = np.zeros(end - start)
            for j in range(g):
                h = k * g + j
                logits = q[l, :, h] @ keys[l, :, k].T / np.sqrt(d)  # [X, M]
                causal = np.triu(np.ones((x, x), bool), 1)  # column > row: masked
                logits[:, -x:] = np.where(causal, np.finfo(np.float64).min, logits[:, -x:])
                p = np.exp(logits - logits.max(-1, keepdims=True))
                p /= p.sum(-1, keepdims=True)
                if h_norm is not None:
                    p = p / h_norm[l][:, None] * wov[l, h][cols][None, :]
                best = np.maximum(best, p[:, sink : sink + end - start].max(axis=0))
            out[l, :, k] = best
    return out


def _inputs(rng, n_ctx, x):
    q = rng.normal(size=(L, x, HQ, D)) * 2.0
    k_ctx = rng.normal(size=(L, n_ctx, HKV, D)) * 2.0
    k_self = rng.normal(size=(L, x, HKV, D)) * 2.0
    return q, k_ctx, k_self


def _padded(rng, q, k_ctx, k_self, pad_rows, pad_ctx):
    """The same inputs with ``pad_rows`` garbage input rows spread among the real ones
    and ``pad_ctx`` garbage context entries after the real ones."""
    x = q.shape[1]
    valid = np.ones(x + pad_rows, bool)
    valid[rng.choice(x + pad_rows, pad_rows, replace=False)] = False
    qp = rng.normal(size=(L, x + pad_rows, HQ, D)) * 50
    ksp = rng.normal(size=(L, x + pad_rows, HKV, D)) * 50
    qp[:, valid], ksp[:, valid] = q, k_self
    kcp = np.concatenate([k_ctx, rng.normal(size=(L, pad_ctx, HKV, D)) * 50], axis=1)
    return qp, kcp, ksp, valid


SCORE = jax.jit(kvzip.reconstruction_scores)


@pytest.mark.parametrize("start,end", [(0, 7), (2, 23), (5, 40), (30, 40)])
def test_one_pass_is_kvpress_score_with_gqa_and_padding(start, end):
    rng = np.random.default_rng(start * 100 + end)
    n_ctx, x = 40, 13
    q, k_ctx, k_self = _inputs(rng, n_ctx, x)
    want = kvpress_chunk(q, k_ctx, k_self, start, end, kvzip.N_SINK)
    qp, kcp, ksp, valid = _padded(rng, q, k_ctx, k_self, pad_rows=5, pad_ctx=6)
    softmax_n, scored_n = kvzip.chunk_masks(n_ctx, start, end)
    pad = np.zeros(6, bool)
    got = np.asarray(
        SCORE(qp.astype(np.float32), kcp.astype(np.float32), ksp.astype(np.float32), np.r_[softmax_n, pad], np.r_[scored_n, pad], valid)
    )
    assert got.shape == (L, n_ctx + 6, HKV) and got.dtype == np.float32
    np.testing.assert_allclose(got[:, start:end], want, rtol=2e-5, atol=1e-7)
    outside = np.ones(n_ctx + 6, bool)
    outside[start:end] = False
    assert not got[:, outside].any()  # sinks, other chunks, padding: no score


def test_kvzip_plus_factors():
    rng = np.random.default_rng(7)
    n_ctx, x, start, end = 30, 9, 6, 21
    q, k_ctx, k_self = _inputs(rng, n_ctx, x)
    h_norm = rng.uniform(0.5, 3.0, size=(L, x))
    wov = rng.uniform(0.1, 2.0, size=(L, HQ, n_ctx + x))
    want = kvpress_chunk(q, k_ctx, k_self, start, end, kvzip.N_SINK, h_norm, wov)
    softmax_n, scored_n = kvzip.chunk_masks(n_ctx, start, end)
    got = np.asarray(SCORE(q, k_ctx, k_self, softmax_n, scored_n, np.ones(x, bool), 1.0 / h_norm, wov[:, :, :n_ctx]))
    np.testing.assert_allclose(got[:, start:end], want, rtol=2e-5, atol=1e-7)


def test_the_rest_of_the_context_is_not_in_the_softmax():
    """kvpress's denominator is the sinks, the chunk and the input's own keys; a
    context key outside them changes nothing, one inside takes probability from
    every other column (no score rises, most fall)."""
    rng = np.random.default_rng(3)
    q, k_ctx, k_self = _inputs(rng, 30, 8)
    softmax_n, scored_n = kvzip.chunk_masks(30, 10, 20)
    base = np.asarray(SCORE(q, k_ctx, k_self, softmax_n, scored_n, np.ones(8, bool)))
    loud = k_ctx.copy()
    loud[:, 25] = q[:, :, ::3].mean(axis=1) * 10  # a key every query would attend to
    np.testing.assert_array_equal(np.asarray(SCORE(q, loud, k_self, softmax_n, scored_n, np.ones(8, bool))), base)
    wider = softmax_n.copy()
    wider[25] = True
    lower = np.asarray(SCORE(q, loud, k_self, wider, scored_n, np.ones(8, bool)))[:, 10:20]
    assert (lower <= base[:, 10:20] * (1 + 1e-6)).all() and (lower < 0.99 * base[:, 10:20]).mean() > 0.5


def test_chunks_assemble_with_the_sinks_on_top():
    rng = np.random.default_rng(11)
    n_ctx, x, prefix, size = 50, 10, 6, 16
    q, k_ctx, k_self = _inputs(rng, n_ctx, x)
    passes, want = [], np.zeros((L, n_ctx, HKV))
    for start in range(prefix, n_ctx, size):
        end = min(start + size, n_ctx)
        passes.append(SCORE(q, k_ctx, k_self, *kvzip.chunk_masks(n_ctx, start, end), np.ones(x, bool)))
        want[:, start:end] = kvpress_chunk(q, k_ctx, k_self, start, end, kvzip.N_SINK)
    want[:, : kvzip.N_SINK] = want.max() + 1.0  # compress_post
    got = np.asarray(jax.jit(kvzip.context_scores)(passes))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
    assert not got[:, kvzip.N_SINK : prefix].any()  # the template prefix is in no chunk: 0, dropped first
    with pytest.raises(ValueError, match="inside"):
        kvzip.chunk_masks(10, 4, 11)


def masked_scores64(q, k_ctx, k_self, softmax_n, scored_n, valid):
    """``reconstruction_scores`` stated in float64 for any masks, one layer: row ``x``
    (valid) takes a softmax over the ``softmax_n`` context entries and the valid
    input rows up to it; entry ``i`` of KV head ``k`` scores the maximum over those
    rows and ``k``'s query heads of its probability, 0 where not ``scored_n``.
    ``q [X, Hq, D]``, ``k_ctx [n, Hkv, D]``, ``k_self [X, Hkv, D]``; ``[n, Hkv]``."""
    x, hq, d = q.shape
    hkv, g = k_ctx.shape[1], hq // k_ctx.shape[1]
    out = np.zeros((k_ctx.shape[0], hkv))
    for h in range(hq):
        k = h // g
        ctx = q[:, h].astype(np.float64) @ k_ctx[:, k].astype(np.float64).T / np.sqrt(d)
        own = q[:, h].astype(np.float64) @ k_self[:, k].astype(np.float64).T / np.sqrt(d)
        for r in np.flatnonzero(valid):
            seen = (np.arange(x) <= r) & valid
            m = max(ctx[r, softmax_n].max(initial=-np.inf), own[r, seen].max())
            z = np.exp(ctx[r, softmax_n] - m).sum() + np.exp(own[r, seen] - m).sum()
            out[:, k] = np.maximum(out[:, k], np.where(softmax_n, np.exp(ctx[r] - m) / z, 0.0))
    return np.where(scored_n[:, None], out, 0.0)


def test_pass_scores_are_reconstruction_scores_one_layer_at_a_time():
    """``pass_scores`` (the engine's scorer: one layer and one block of rows at a
    time, the pass's own keys walked causally by an online log-sum-exp, a context
    mask per layer) is the float64 statement of ``reconstruction_scores``'s rule
    layer by layer, whatever the blocks, and ``reconstruction_scores`` is too."""
    rng = np.random.default_rng(5)
    n_ctx, x = 30, 9
    q, k_ctx, k_self = (a.astype(np.float32) for a in _inputs(rng, n_ctx, x))
    softmax_ln = rng.random((L, n_ctx)) < 0.7
    scored_ln = softmax_ln & (rng.random((L, n_ctx)) < 0.6)
    valid = np.arange(x) < 7
    want = np.stack([masked_scores64(q[l], k_ctx[l], k_self[l], softmax_ln[l], scored_ln[l], valid) for l in range(L)])
    got = np.asarray(jax.jit(kvzip.pass_scores)(q, k_ctx, k_self, softmax_ln, scored_ln, valid))
    assert got.shape == (L, n_ctx, HKV) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8)
    blocked = jax.jit(kvzip.pass_scores, static_argnames=("block", "self_block"))
    for block, self_block in ((4, 4), (2, 4), (3, 3)):
        # rows a few at a time and the pass's own keys in several blocks; with 4-row
        # blocks the third holds padding rows only and is skipped
        got_blocks = np.asarray(blocked(q, k_ctx, k_self, softmax_ln, scored_ln, valid, block=block, self_block=self_block))
        np.testing.assert_allclose(got_blocks, want, rtol=1e-6, atol=1e-8)
    for layer in range(L):  # the unblocked statement of the rule, one float32 softmax (its own rounding)
        one = slice(layer, layer + 1)
        dense = np.asarray(SCORE(q[one], k_ctx[one], k_self[one], softmax_ln[layer], scored_ln[layer], valid))[0]
        np.testing.assert_allclose(dense, want[layer], rtol=2e-6, atol=1e-8)
    assert got[~scored_ln].max() == 0 and got[scored_ln].min() > 0


@pytest.mark.parametrize("aggregate", ["mean", "max"])
def test_the_policy_keeps_the_sinks_and_the_top_aggregated_scores(aggregate):
    """``kvzip``'s event: forced (the engine's pins and the first ``n_sink`` real
    entries) ∪ the top of the passes' scores aggregated over layers and KV heads;
    padding neither scores nor is kept; no pass scores is a ``ConfigError``."""
    from jaxkv.errors import ConfigError
    from jaxkv.policies import EventFeatures, get_policy
    from jaxkv.serving.stages.events import score_and_select

    rng = np.random.default_rng(13)
    n, N, budget = 40, 64, 17
    positions = np.r_[np.sort(rng.choice(np.arange(2, 60), n, replace=False)), 100 + np.arange(N - n)].astype(np.int32)
    valid = np.arange(N) < n
    s_lnk = rng.random((L, N, HKV)).astype(np.float32) * valid[None, :, None]
    feats = EventFeatures(
        keys_LNKD=np.zeros((L, N, HKV, D), np.float32),
        positions_N=positions,
        phase_N=np.zeros(N, np.int32),
        window_q_LWHD=np.zeros((L, 1, HQ, D), np.float32),
        window_pos_W=np.zeros(1, np.int32),
        window_valid_W=np.zeros(1, bool),
        acc_mass_N=np.zeros(N, np.float32),
        query_mean_LHD=np.zeros((L, HQ, D), np.float32),
        seq_len=np.int32(100),
        valid_N=valid,
        pass_scores_LNK=s_lnk,
    )
    pinned = np.zeros(N, bool)
    pinned[[10, 20]] = True
    policy = get_policy("kvzip")
    cfg = policy.make_config(aggregate=aggregate)
    kept, scores, _ = score_and_select(policy, cfg, (), feats, pinned, np.int32(budget))
    kept = np.asarray(kept)
    agg = s_lnk.mean(axis=(0, 2)) if aggregate == "mean" else s_lnk.max(axis=(0, 2))
    forced = pinned | (np.arange(N) < kvzip.N_SINK)
    cand = np.flatnonzero(valid & ~forced)
    top = cand[np.argsort(-agg[cand], kind="stable")][: budget - int(forced.sum())]
    assert np.array_equal(np.flatnonzero(kept), np.union1d(np.flatnonzero(forced), top))
    np.testing.assert_allclose(np.asarray(scores)[cand], agg[cand], rtol=1e-6)
    with pytest.raises(ConfigError, match="pass_scores"):
        score_and_select(policy, cfg, (), feats.replace(pass_scores_LNK=None), pinned, np.int32(budget))


def test_repeat_chunks_on_smollm2s_template(smollm2_tokenizer):
    tok = smollm2_tokenizer
    from jaxkv.chat.render import render

    ids = render(tok, [{"role": "user", "content": "alpha beta gamma delta " * 60}], add_generation_prompt=True).ids
    prefix, suffix = kvzip.template_split(tok)
    assert tok.decode(ids[:prefix].tolist()).endswith("<|im_start|>user\n")
    assert tok.decode(suffix.tolist()) == "<|im_end|>\n<|im_start|>assistant\n"
    chunks = kvzip.repeat_chunks(tok, ids, chunk_size=100)
    assert [c.start for c in chunks] == list(range(prefix, ids.size, 100)) and chunks[-1].end == ids.size
    encode = lambda t: tok.encode(t, add_special_tokens=False)
    for i, c in enumerate(chunks):
        assert np.array_equal(c.ids[c.prompt :], ids[c.start : c.end]) and c.ids.dtype == np.int32
        assert np.array_equal(c.ids[c.prompt - suffix.size : c.prompt], suffix)
        head = c.ids[: c.prompt - suffix.size].tolist()
        if i == 0:
            assert head == encode(kvzip.FIRST_PROMPT)
        else:
            assert head == encode(kvzip.LATER_PROMPT) + ids[c.start - kvzip.PREV_POSTFIX : c.start].tolist()
    (one,) = kvzip.repeat_chunks(tok, ids)  # the default 2,048-token chunks: one pass
    assert one.start == prefix and one.end == ids.size
