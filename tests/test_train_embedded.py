"""The embedded-model trainer: masks, reproducible data, a 3-step run whose loss falls,
an HF export that loads back with the same logits, resuming from a checkpoint, and a
batch that fails to build raising in the trainer."""

from __future__ import annotations

import json
import random
import threading

import numpy as np
import pytest

from jaxkv.tasks import agent_traces, mqniah
from train import embedded_model as em


@pytest.fixture(scope="module")
def tokenizer():
    return em.embedded_tokenizer()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("embedded")
    args = em.parse_args(["--tiny", "--steps", "3", "--batch", "2", "--lr", "1e-2", "--out", str(out), "--eval-examples", "2", "--quiet"])
    return out, em.train(args)


def test_loss_mask_covers_exactly_the_assistant_messages(tokenizer):
    ex = agent_traces(1, seed=0, length=1200, n_docs=1, registry=False)[0]
    seq = em.render_sequence(tokenizer, ex, ex.messages)
    target_text = tokenizer.decode(seq.ids[seq.target_mask])
    assistants = [m for m in ex.messages if m["role"] == "assistant"]
    assert len(seq.scored) == len(assistants)
    for m in assistants:
        assert m["reasoning_content"] in target_text
        for call in m.get("tool_calls") or ():
            assert json.dumps(call["function"]["arguments"]) in target_text
    assert ex.messages[-1]["content"] in target_text
    # Exactly the assistant messages are targets, checked against an oracle that
    # does not use the tagger: assistant message j is what rendering messages[:j+1]
    # adds beyond the generation prompt of messages[:j] (its closing <|im_end|>
    # included, the newline after it not). Text checks cannot do this: the
    # reasoning quotes the user's task.
    from jaxkv.chat import render

    expected = np.zeros(seq.ids.size, bool)
    for j, m in enumerate(ex.messages):
        if m["role"] == "assistant":
            prompt = render(tokenizer, ex.messages[:j], ex.tools, add_generation_prompt=True).ids
            upto = render(tokenizer, ex.messages[: j + 1], ex.tools, add_generation_prompt=False).ids
            assert np.array_equal(seq.ids[: upto.size], upto) and np.array_equal(upto[: prompt.size], prompt)
            assert tokenizer.decode(upto[-1:]) == "\n"
            expected[prompt.size : upto.size - 1] = True
    assert np.array_equal(seq.target_mask, expected)
    batch = em.pack_batch([seq], seq.ids.size + 5, tokenizer.pad_token_id)
    assert batch["loss_mask"][0, :-1].sum() == seq.target_mask.sum()
    assert batch["loss_mask"][0, seq.ids.size - 1 :].sum() == 0  # padding is never predicted


def test_training_view_cuts_after_a_reply_to_a_user_turn():
    ex = mqniah(1, seed=0, needles=4, length=600)[0]
    cuts = {len(em.training_view(ex, random.Random(s))[0]) for s in range(20)}
    assert cuts == {3, 5}  # after the turn-1 answer, or the whole conversation


def test_batches_are_a_function_of_seed_and_step(tokenizer):
    a = em.batch_for_step(tokenizer, seed=0, step=7, seq_len=1024, batch=2)
    b = em.batch_for_step(tokenizer, seed=0, step=7, seq_len=1024, batch=2)
    c = em.batch_for_step(tokenizer, seed=0, step=8, seq_len=1024, batch=2)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["tokens"], c["tokens"])
    assert a["loss_mask"].sum() > 0


def test_curriculum_stages():
    stages = em.parse_curriculum("0.5:512,0.8:1024", max_len=2048)
    assert stages == [(0.5, 512), (0.8, 1024), (1.0, 2048)]
    assert [em.seq_len_at(s, 10, stages) for s in range(10)] == [512] * 5 + [1024] * 3 + [2048] * 2


def test_three_steps_reduce_the_loss(tiny_run):
    _, result = tiny_run
    losses = result["losses"]
    assert len(losses) == 3 and all(np.isfinite(losses))
    assert losses[-1] < losses[0] - 0.05


def test_export_loads_back_with_the_same_logits(tiny_run):
    import jax.numpy as jnp

    from jaxkv.models.loading import load_model

    out, result = tiny_run
    hf = json.loads((out / "hf" / "config.json").read_text())
    assert hf["model_type"] == "qwen3" and hf["num_hidden_layers"] == 1
    model = load_model(out / "hf")
    assert model.tokenizer is not None and len(model.tokenizer) == hf["vocab_size"]
    ids = jnp.asarray([model.tokenizer("The special code for k1234 is v5678.", add_special_tokens=False)["input_ids"]])
    np.testing.assert_allclose(np.asarray(model.module(ids)), np.asarray(result["module"](ids)), rtol=1e-5, atol=1e-5)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3] and "token_acc" in metrics[-1]


def test_resume_continues_the_same_run(tiny_run, tmp_path):
    """Stopping after step 2 and resuming gives the same step-3 loss as one 3-step run."""
    _, result = tiny_run
    common = ["--tiny", "--steps", "3", "--batch", "2", "--lr", "1e-2", "--out", str(tmp_path), "--eval-examples", "0", "--quiet"]
    first = em.train(em.parse_args(common + ["--stop-after", "2"]))
    second = em.train(em.parse_args(common))
    np.testing.assert_allclose(first["losses"], result["losses"][:2], rtol=1e-6)
    np.testing.assert_allclose(second["losses"], result["losses"][2:], rtol=1e-5)


def test_prefetcher_gives_batches_in_step_order_and_reraises_a_failed_one():
    def make(s):
        if s == 2:
            raise ValueError("batch 2 failed")
        return {"step": s}

    prefetch = em.Prefetcher(make, range(5), depth=2)
    assert [prefetch.get() for _ in range(2)] == [(0, {"step": 0}), (1, {"step": 1})]
    with pytest.raises(ValueError, match="batch 2 failed"):
        prefetch.get()
    prefetch.close()


def test_a_batch_that_fails_to_build_raises_in_the_trainer(tmp_path, monkeypatch):
    """The trainer gets the batch's own error, instead of waiting forever for a
    batch the prefetch thread will never build (run on a thread with a deadline,
    so a regression fails here instead of hanging the suite)."""

    def broken(*args, **kwargs):
        raise RuntimeError("no batch today")

    monkeypatch.setattr(em, "batch_for_step", broken)  # every batch of a --tiny run (no raw drill steps)
    args = em.parse_args(["--tiny", "--steps", "3", "--out", str(tmp_path), "--eval-examples", "0", "--quiet"])
    outcome = []
    runner = threading.Thread(target=lambda: outcome.append(capture(em.train, args)), daemon=True)
    runner.start()
    runner.join(300)
    assert outcome, "the trainer still waits for a batch that failed to build"
    assert isinstance(outcome[0], RuntimeError) and str(outcome[0]) == "no batch today", outcome


def capture(fn, *args):
    """``fn(*args)``'s result, or the exception it raised."""
    try:
        return fn(*args)
    except Exception as err:
        return err


def test_needle_drill_asks_every_needle_and_answers_from_the_document(tokenizer):
    import re

    for seed in range(5):
        ex = em.needle_drill(seed, 1024)
        user, reply = ex.messages[1]["content"], ex.messages[2]["content"]
        needles = dict(re.findall(r"The special code for (k\d+) is (v\d+)\.", user))
        answered = re.findall(r"(k\d+) is (v\d+)", reply)
        assert len(needles) >= 2 and sorted(answered) == sorted(needles.items())
        assert em.render_sequence(tokenizer, ex, ex.messages).ids.size <= 1024


def test_retrieval_probe_targets_are_copied_values(tokenizer):
    from train.copy_drills import Formats

    formats = Formats(tokenizer, 128, 8, 0.2)
    for name in ("repeat", "needles", "adjacent", "nospace"):
        ids, mask = getattr(formats, name)(random.Random(1))
        assert len(ids) == len(mask) <= 128
        targets = [t for t in range(len(mask) - 1) if mask[t]]
        assert targets, name
        for t in targets:  # every target token already occurred earlier in the sequence
            assert ids[t + 1] in ids[:t], (name, t)


def _layer0_attention(params, graphdef, cfg, T=32, seed=0):
    """Layer-0 attention weights ``[H, T, T]`` of the model ``(graphdef, params)``."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    model = nnx.merge(graphdef, params)
    ids = jnp.asarray(np.random.default_rng(seed).integers(300, 1500, size=(1, T)))
    layer = model.layer(0)
    q, k, _ = layer.self_attn.qkv(layer.input_layernorm(model.embed_tokens(ids)), jnp.arange(T)[None])
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(cfg.head_dim)
    scores = jnp.where(np.tril(np.ones((T, T), bool)), scores, -1e30)
    return np.asarray(jax.nn.softmax(scores, -1))[0]


@pytest.mark.parametrize("size", ["agent", "tiny"])
def test_copy_init_builds_positional_heads_and_mimetic_attention(tokenizer, size):
    """The "copy" init: layer-0 head h attends h+1 positions back on any tokens, the
    positional heads share one value subspace, and elsewhere W_k starts near W_q and
    W_o = W_v^T; the "random" init is the module's own."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxkv.models.transformer import Transformer

    cfg = em.model_config(em.SIZES[size], len(tokenizer), 0, 4096)
    graphdef, params = nnx.split(Transformer(cfg, jnp.float32, rngs=nnx.Rngs(0)), nnx.Param)
    assert em.copy_circuit_init(params, cfg, 0, "random") is params
    init = em.copy_circuit_init(params, cfg, 0, "copy")
    attn = _layer0_attention(init, graphdef, cfg)
    T = attn.shape[-1]
    for h in range(cfg.num_heads):
        d = h + 1
        assert np.mean([attn[h, t, t - d] for t in range(d + 4, T)]) > 0.95, (size, h)
    before = _layer0_attention(params, graphdef, cfg)
    assert np.mean([before[0, t, t - 1] for t in range(5, T)]) < 0.5  # random init: no such head
    flat = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(init)}
    attn_of = lambda layer, name: flat[f"['layers']['self_attn']['{name}']['kernel'].value"][layer]  # stacked [L, ...]
    D = cfg.head_dim
    v0 = attn_of(0, "v_proj")
    for h in range(cfg.num_heads):
        np.testing.assert_array_equal(v0[:, h * D : (h + 1) * D], v0[:, :D])
    for layer in range(1, cfg.num_layers):
        q, k = attn_of(layer, "q_proj")[:, D:], attn_of(layer, "k_proj")[:, D:]  # heads past the positional one
        assert np.corrcoef(q.ravel(), k.ravel())[0, 1] > 0.5
        np.testing.assert_array_equal(attn_of(layer, "o_proj")[D:], attn_of(layer, "v_proj")[:, D:].T)
    with pytest.raises(ValueError, match="unknown init"):
        em.copy_circuit_init(params, cfg, 0, "nope")


def test_raw_drill_batches_score_only_copies(tokenizer):
    """The warm-up batch: half raw needle documents, loss only where the next token is
    the value of a needle that is in the document; half copied chunks of any kind of
    token, loss only where the next token continues a copy; seeded."""
    from jaxkv.tasks.words import VALUE_POOL

    a, b = em.raw_drill_batch(tokenizer, 0, 3), em.raw_drill_batch(tokenizer, 0, 3)
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
    tokens, mask = a["tokens"], a["loss_mask"]
    assert tokens.shape == mask.shape == (em.RAW_DRILL_BATCH, em.RAW_DRILL_LEN)
    needle_rows = em.RAW_DRILL_BATCH - em.RAW_DRILL_BATCH // 2
    values = set(tokenizer.convert_tokens_to_ids(list(VALUE_POOL)))
    rows, cols = np.nonzero(mask[:, :-1])
    assert (rows < needle_rows).sum() > needle_rows and (rows >= needle_rows).sum() > needle_rows
    kinds = set()
    for r, c in zip(rows, cols):
        target = tokens[r, c + 1]
        earlier = tokens[r, : c + 1]
        if r < needle_rows:
            assert target in values
            assert target in earlier[:-1]  # present in the document before it is asked
        else:  # a copy: the same two tokens occurred earlier, in order
            assert any(earlier[i] == tokens[r, c] and earlier[i + 1] == target for i in range(c - 1))
            kinds.add(tokenizer.convert_ids_to_tokens(int(target))[:1])
    assert " " in kinds and len(kinds) > 3  # words with their space, identifiers, names, ...
    # the gathered targets the train step reads are exactly the masked positions
    for r in range(em.RAW_DRILL_BATCH):
        n = int((mask[r] > 0).sum())
        np.testing.assert_array_equal(a["target_pos"][r, :n], np.flatnonzero(mask[r]))
        np.testing.assert_array_equal(a["target_ids"][r, :n], tokens[r, np.flatnonzero(mask[r]) + 1])
        assert a["target_w"][r, n:].sum() == 0
