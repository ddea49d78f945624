"""Retrieval tasks for pretrained models (``jaxkv.tasks.retrieval``) on SmolLM2's tokenizer:
seeded, lengths within 2% of the target in the model's own tokens, needles where drawn."""

from __future__ import annotations

import pytest

from jaxkv.tasks import retrieval as R

CASES = [
    ("passkey", {}),
    ("niah", {"variant": "single"}),
    ("niah", {"variant": "multikey", "needles": 4}),
    ("niah", {"variant": "multivalue", "needles": 3, "setting": "aware"}),
    ("niah", {"variant": "single", "haystack": "code"}),
]


def make(task, n, seed, length, tok, kw):
    return (R.passkey if task == "passkey" else R.niah)(n, seed, length, tok, **kw)


@pytest.mark.parametrize("task,kw", CASES)
@pytest.mark.parametrize("length", [1024, 2048])
def test_rendered_length_within_two_percent_and_needles_as_drawn(smollm2_tokenizer, task, kw, length):
    tok = smollm2_tokenizer
    for ex in make(task, 3, 11, length, tok, kw):
        msgs = ex.messages
        prompt = tok.apply_chat_template(msgs[:-1], tokenize=False, add_generation_prompt=True)
        n = len(tok(prompt, add_special_tokens=False)["input_ids"])
        assert abs(n - length) <= 0.02 * length and n == ex.labels["prompt_tokens"]
        doc = msgs[0]["content"]
        needles = ex.labels["needles"]
        units = ex.labels["haystack_units"]
        for nd in needles:
            sentence = doc[nd["char_start"]:nd["char_end"]]
            assert nd["value"] in sentence and sentence.endswith(".")
            # placed at the haystack unit boundary nearest the drawn depth
            assert abs(nd["depth"] - nd["drawn_depth"]) <= 0.5 / units + 1e-9
        starts = [nd["char_start"] for nd in needles]
        assert starts == sorted(starts)  # listed in document order
        # the answer names exactly the asked values; the scorer agrees with itself
        assert R.is_correct(ex, ex.targets[0].expected)
        assert msgs[-1]["content"].startswith(ex.labels["reply_prefix"])
        assert (len(msgs) == 4) == (ex.labels["setting"] == "agnostic")


@pytest.mark.parametrize("task,kw", CASES[:3])
def test_same_seed_same_examples_other_seed_other_needles(smollm2_tokenizer, task, kw):
    a = make(task, 2, 5, 1024, smollm2_tokenizer, kw)
    b = make(task, 2, 5, 1024, smollm2_tokenizer, kw)
    c = make(task, 2, 6, 1024, smollm2_tokenizer, kw)
    assert [x.messages for x in a] == [x.messages for x in b] and [x.labels for x in a] == [x.labels for x in b]
    assert [x.targets[0].values for x in a] != [x.targets[0].values for x in c]


def test_needle_depth_follows_the_drawn_depth(smollm2_tokenizer):
    """Over many examples the placed depth tracks the drawn one within one haystack unit."""
    exs = R.passkey(24, 3, 512, smollm2_tokenizer)
    for ex in exs:
        (nd,) = ex.labels["needles"]
        units = ex.messages[0]["content"].count(R.PASSKEY_FILLER)
        assert units == ex.labels["haystack_units"]
        assert abs(nd["depth"] - nd["drawn_depth"]) <= 0.5 / units + 1e-9
    drawn = sorted(ex.labels["needles"][0]["drawn_depth"] for ex in exs)
    assert drawn[0] < 0.3 and drawn[-1] > 0.7  # uniform draws cover the document


def test_multivalue_asks_every_value_in_document_order(smollm2_tokenizer):
    (ex,) = R.niah(1, 9, 1024, smollm2_tokenizer, variant="multivalue", needles=4)
    values = [nd["value"] for nd in ex.labels["needles"]]
    assert list(ex.targets[0].values) == values and len(set(nd["key"] for nd in ex.labels["needles"])) == 1
    assert R.is_correct(ex, "The numbers are " + ", ".join(values) + ". Then " + values[0])
    assert not R.is_correct(ex, "The numbers are " + ", ".join(reversed(values)))


def test_bad_arguments_are_value_errors(smollm2_tokenizer):
    with pytest.raises(ValueError, match="setting"):
        R.passkey(1, 0, 1024, smollm2_tokenizer, setting="both")
    with pytest.raises(ValueError, match="variant"):
        R.niah(1, 0, 1024, smollm2_tokenizer, variant="many")
