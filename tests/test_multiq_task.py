"""The multi-question shared-context task (``jaxkv.tasks.multiq``, issue #75) on SmolLM2's tokenizer.

What the module promises: seeded determinism (example i from its own seed), the aware
request within 2% of 2k / 4k / 8k tokens, every fact's value in the document exactly
once and in no question, distinct questions of the promised kinds, facts at their
drawn depths, the token plans of the questions sharing one compressed request and
extending each other token for token, and evaluation seeds disjoint from the
training seeds and from the haystack tasks'. Tokenizer only: no weights.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from jaxkv.tasks import haystack as H
from jaxkv.tasks import multiq as M
from jaxkv.tasks.example import example_seed


def test_seeded_and_each_example_reproducible(smollm2_tokenizer):
    tok = smollm2_tokenizer
    a = M.examples(3, length=1024, tokenizer=tok, seed=7)
    assert a == M.examples(3, length=1024, tokenizer=tok, seed=7)
    assert M.examples(2, length=1024, tokenizer=tok, seed=7) == a[:2]  # example i depends on (seed, i) only
    assert M.one_example(example_seed(7, 2), 1024, tok) == a[2]
    other = M.examples(3, length=1024, tokenizer=tok, seed=8)
    assert all(x.values != y.values and x.document != y.document for x, y in zip(a, other))
    assert M.examples(1, length=1024, tokenizer=tok)[0].seed == example_seed(M.EVAL_SEED, 0)


@pytest.mark.parametrize("length", [2048, 4096, 8192])
def test_lengths_within_two_percent(smollm2_tokenizer, length):
    for ex in M.examples(2, length=length, tokenizer=smollm2_tokenizer, seed=length):
        aware, agnostic = (M.token_plans(ex, smollm2_tokenizer, s)[0] for s in ("aware", "agnostic"))
        assert abs(aware.compressed.size - length) <= H.LENGTH_TOLERANCE * length, aware.compressed.size
        assert ex.labels["prompt_tokens"] == aware.compressed.size
        # the agnostic request is the document's turn alone: question 1 fewer tokens
        assert 0 < aware.compressed.size - agnostic.compressed.size <= 40


@pytest.mark.parametrize("questions", [4, 6, 8])
def test_facts_answers_and_questions(smollm2_tokenizer, questions):
    for ex in M.examples(3, length=2048, tokenizer=smollm2_tokenizer, seed=3, questions=questions):
        facts = ex.labels["facts"]
        asked = sorted((f for f in facts if f["question"] is not None), key=lambda f: f["question"])
        assert len(ex.questions) == len(ex.answers) == len(ex.values) == len(asked) == questions
        kinds = list(ex.labels["kinds"])
        assert kinds == [f["kind"] for f in asked]
        assert kinds.count("passkey") == 1 and kinds.count("pair") == max(1, questions // 4)
        assert len(set(ex.questions)) == questions  # distinct questions
        runs = re.findall(r"\d+", ex.document)
        for f in facts:
            assert ex.document[f["char_start"] : f["char_end"]] == M._sentence(f)
            assert runs.count(f["value"]) == 1, f  # every value exactly once in the context
            assert abs(f["position"] - f["depth"]) <= 0.02
            assert not any(f["value"] in q for q in ex.questions)
        assert [f["char_start"] for f in facts] == sorted(f["char_start"] for f in facts)
        assert len({f["value"] for f in facts}) == len(facts) and len({f["key"] for f in facts}) == len(facts)
        distractors = [f for f in facts if f["question"] is None]
        assert sum(f["kind"] == "number" for f in distractors) == M.DISTRACTORS
        for f, question, answer, values in zip(asked, ex.questions, ex.answers, ex.values):
            assert values == (f["value"],) and answer.endswith(f" {f['value']}.")
            assert f["kind"] == "passkey" or (f["key"] in question and f["key"] in answer and f["key"] in ex.document)
            assert question.endswith("? Answer with the number only.")
        for f in (f for f in asked if f["kind"] == "pair"):  # one key alone does not find a pair
            colour, animal = f["key"].split()
            same = [d["key"] for d in distractors if d["kind"] == "pair"]
            assert any(k.startswith(colour + " ") for k in same) and any(k.endswith(" " + animal) for k in same)
    with pytest.raises(ValueError, match="questions"):
        M.examples(1, length=1024, tokenizer=smollm2_tokenizer, questions=3)


@pytest.mark.parametrize("setting", H.SETTINGS)
def test_token_plans_share_the_request_and_extend(smollm2_tokenizer, setting):
    from jaxkv.chat.render import render

    tok = smollm2_tokenizer
    (ex,) = M.examples(1, length=1024, tokenizer=tok, seed=5)
    plans = M.token_plans(ex, tok, setting)
    assert len(plans) == len(ex.questions)
    fed = plans[0].compressed
    for q, (plan, view) in enumerate(zip(plans, ex.views())):
        assert np.array_equal(plan.compressed, plans[0].compressed)
        assert all(a.dtype == np.int32 for a in plan)
        fed = np.concatenate([fed, M.new_rest(plans, q)])
        assert np.array_equal(fed, np.concatenate([plan.compressed, plan.rest]))  # the conversation fed once
        assert np.array_equal(fed, render(tok, view.messages(setting)[:-1]).ids)
        assert tok.decode(plan.answer.tolist()).strip() == ex.answers[q]
        digits = H.answer_digit_positions(view, tok, plan.answer)
        assert "".join(tok.decode([t]) for t in plan.answer[digits].tolist()) == ex.values[q][0]
        assert H.reply_correct(view, ex.answers[q]) and not H.reply_correct(view, ex.answers[q - 1] if q else "none")
        assert ex.answers[q].startswith(H.reply_prefix(view) + " " + ex.values[q][0])
        fed = np.concatenate([fed, plan.answer])
    rest0 = tok.decode(plans[0].rest.tolist())
    if setting == "aware":  # question 1 is in the compressed request
        assert plans[0].rest.size == 0 and ex.questions[0] in tok.decode(plans[0].compressed.tolist())
    else:
        assert H.ACK in rest0 and ex.questions[0] in rest0 and ex.questions[0] not in tok.decode(plans[0].compressed.tolist())
    messages = ex.messages(setting)
    assert [m["content"] for m in messages if m["role"] == "assistant"][-len(ex.answers) :] == list(ex.answers)
    with pytest.raises(ValueError, match="setting"):
        ex.view(0).messages("both")
    with pytest.raises(IndexError):
        ex.view(len(ex.questions))


def test_evaluation_seeds_are_held_out():
    """``EVAL_SEED``'s example seeds (a million examples) meet neither the training
    seeds (below 2**30 for the bases; the IntentKV head's example seed ranges) nor the
    haystack tasks' evaluation examples."""
    from train import intentkv_data

    n = 1_000_000
    start = example_seed(M.EVAL_SEED, 0)
    assert example_seed(M.EVAL_SEED, n - 1) == start + n - 1  # no wrap-around
    ours = range(start, start + n)
    hay = example_seed(H.EVAL_SEED, 0)
    others = {
        "haystack eval": range(hay, hay + n),
        **intentkv_data.evaluation_seed_ranges(),
        **{name: range(base, base + intentkv_data.SPLIT_SEEDS) for name, base in intentkv_data.SPLITS.items()},
    }
    for name, r in others.items():
        assert ours.stop <= r.start or r.stop <= ours.start, name
    assert M.EVAL_SEED >= 1 << 30 > max(intentkv_data.SPLITS.values())
