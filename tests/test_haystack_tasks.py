"""The real-model task generators (``jaxkv.tasks.haystack``, issue #32) on SmolLM2's tokenizer.

Seeded determinism, lengths within 2% of the target at 1k/2k/4k/8k tokens, needles
at their drawn depths (at the haystack unit boundary nearest it), the answer's values
in the document, multikey distractors never asked, ``token_plan``'s prefix extensions
and answer tokens, exact-match scoring and the reply prefix, and the lm windows (exact
lengths, no overlap). Tokenizer only: no weights.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from jaxkv.errors import ChatError
from jaxkv.tasks import corpus as C
from jaxkv.tasks import haystack as H
from jaxkv.tasks import lm_text, niah, passkey, reply_correct, reply_prefix, token_plan


def _needle_text(ex, nd):
    if ex.task == "passkey":
        return H.PASSKEY_NEEDLE.format(key=nd["value"])
    return H.NIAH_NEEDLE.format(key=nd["key"], value=nd["value"])


def _all(tok, length, n_niah=3, seed=7):
    return passkey(1, length=length, seed=seed, tokenizer=tok) + niah(n_niah, length=length, seed=seed, tokenizer=tok)


def test_seeded_and_each_example_reproducible(smollm2_tokenizer):
    tok = smollm2_tokenizer
    a = _all(tok, 1024)
    assert a == _all(tok, 1024)
    other = _all(tok, 1024, seed=8)
    assert a != other and all(x.values != y.values for x, y in zip(a, other))
    assert [e.task for e in a] == ["passkey", "niah_single", "niah_multikey", "niah_multivalue"]
    # example i depends on (seed, i) only: a longer call extends a shorter one
    assert niah(2, length=1024, seed=7, tokenizer=tok) == a[1:3]
    assert lm_text(3, length=512, seed=3, tokenizer=tok)[:2] == lm_text(2, length=512, seed=3, tokenizer=tok)


@pytest.mark.parametrize("length", [1024, 2048, 4096, 8192])
def test_lengths_within_two_percent(smollm2_tokenizer, length):
    for ex in _all(smollm2_tokenizer, length, seed=length):
        plan = token_plan(ex, smollm2_tokenizer, "aware")
        assert abs(plan.compressed.size - length) <= 0.02 * length, (ex.task, plan.compressed.size)
        assert ex.labels["prompt_tokens"] == plan.compressed.size
    for ex in lm_text(2, length=length, seed=length, tokenizer=smollm2_tokenizer):
        assert len(ex.context_ids) == length and len(ex.target_ids) == H.CONTINUATION


def test_needles_at_their_drawn_depths_and_values_in_the_document(smollm2_tokenizer):
    examples = _all(smollm2_tokenizer, 1024, n_niah=6, seed=11) + niah(
        3, length=2048, seed=11, tokenizer=smollm2_tokenizer, haystack="code"
    )
    for ex in examples:
        body = ex.labels["body_start"]
        needles = ex.labels["needles"]
        assert len(needles) == (1 if ex.task in ("passkey", "niah_single") else H.NEEDLES)
        sep = 1  # one space (passkey) or newline (niah) joins units and needles
        body_chars = len(ex.document) - body - sum(nd["char_end"] - nd["char_start"] + sep for nd in needles)
        for k, nd in enumerate(needles):
            assert ex.document[nd["char_start"] : nd["char_end"]] == _needle_text(ex, nd)
            # the haystack text before the needle (the earlier needles excluded) over all of it
            before = nd["char_start"] - body - sum(p["char_end"] - p["char_start"] + sep for p in needles[:k])
            assert abs(before / body_chars - nd["depth"]) <= 0.02, (ex.task, k, before / body_chars, nd["depth"])
            assert abs(nd["position"] - nd["depth"]) <= 0.02
        assert [nd["char_start"] for nd in needles] == sorted(nd["char_start"] for nd in needles)
        runs = re.findall(r"\d+", ex.document)
        for v in ex.values:
            assert runs.count(v) == (2 if ex.task == "passkey" else 1), (ex.task, v)  # only in its needle
        assert ex.answer.endswith(", ".join(ex.values) + ".") and ex.labels.get("asked_key", "pass key") in ex.answer
        assert reply_correct(ex, ex.answer) and ex.answer.startswith(reply_prefix(ex) + " " + ex.values[0])
    passkeys = [e for e in examples if e.task == "passkey"]
    assert all(len(e.values[0]) == 5 and e.values[0][0] != "0" and e.answer == f"The pass key is {e.values[0]}." for e in passkeys)


def _units_of(ex):
    """The haystack units an example's body is made of, and their separator (module docstring)."""
    units, sep = H.haystack_units(ex.labels["haystack"])
    first = ex.labels.get("first_line", 0)
    return [units[(first + i) % len(units)] for i in range(ex.labels["haystack_units"])], sep


def test_needles_sit_at_the_unit_boundary_nearest_their_depth(smollm2_tokenizer):
    """The body is exactly ``labels["haystack_units"]`` units of its haystack with the
    needles between them, each at the unit boundary nearest its drawn depth (so within
    half a unit of it); over many examples the drawn depths cover the document."""
    tok = smollm2_tokenizer
    passkeys = passkey(24, length=512, seed=3, tokenizer=tok)
    examples = passkeys + niah(3, length=1024, seed=3, tokenizer=tok) + niah(1, length=1024, seed=3, tokenizer=tok, haystack="code")
    for ex in examples:
        units, sep = _units_of(ex)
        total = len(sep.join(units))
        bounds = np.cumsum([0] + [len(u) + len(sep) for u in units[:-1]] + [len(units[-1])])  # boundary j: before unit j
        at: dict = {}
        for nd in ex.labels["needles"]:
            (j,) = np.flatnonzero(np.isclose(bounds / total, nd["position"], rtol=0, atol=1e-12))[:1]
            miss = np.abs(bounds - nd["depth"] * total)
            assert miss[j] <= miss.min() + 1e-9, (ex.task, ex.seed)
            at.setdefault(int(j), []).append(_needle_text(ex, nd))
        pieces = [p for j in range(len(units) + 1) for p in at.get(j, []) + units[j : j + 1]]
        assert ex.document[ex.labels["body_start"] :] == sep.join(pieces), (ex.task, ex.seed)
    drawn = sorted(ex.labels["needles"][0]["depth"] for ex in passkeys)
    assert drawn[0] < 0.3 and drawn[-1] > 0.7  # uniform draws cover the document
    assert H.haystack_units("filler") == (tuple(s.strip() for s in re.findall(r"[^.]+\.", H.PASSKEY_FILLER)), " ")
    assert H.haystack_units("prose") == (C.haystack_lines("prose"), "\n")
    with pytest.raises(ValueError, match="haystack"):
        H.haystack_units("docs")


def test_variants_ask_the_right_needles(smollm2_tokenizer):
    tok = smollm2_tokenizer
    for ex in niah(4, length=1024, seed=3, tokenizer=tok, variant="multikey"):
        needles = ex.labels["needles"]
        assert len({nd["key"] for nd in needles}) == H.NEEDLES
        (asked,) = [nd for nd in needles if nd["asked"]]
        assert ex.values == (asked["value"],) and asked["key"] == ex.labels["asked_key"] and asked["key"] in ex.question
        assert not any(nd["key"] in ex.question for nd in needles if not nd["asked"])  # distractors never asked
    for ex in niah(2, length=1024, seed=3, tokenizer=tok, variant="multivalue"):
        needles = ex.labels["needles"]
        assert {nd["key"] for nd in needles} == {ex.labels["asked_key"]} and all(nd["asked"] for nd in needles)
        assert ex.values == tuple(nd["value"] for nd in needles) and len(set(ex.values)) == H.NEEDLES  # document order
        assert "all the special magic numbers" in ex.question
    with pytest.raises(ValueError, match="variant"):
        niah(1, length=1024, seed=0, tokenizer=tok, variant="multi")


@pytest.mark.parametrize("setting", H.SETTINGS)
def test_token_plan_extends_and_ends_on_the_answer(smollm2_tokenizer, setting):
    from jaxkv.chat.render import render

    tok = smollm2_tokenizer
    for ex in _all(tok, 1024, seed=5):
        plan = token_plan(ex, tok, setting)
        assert all(a.dtype == np.int32 for a in plan)
        messages = ex.messages(setting)
        assert len(messages) == (4 if setting == "agnostic" else 2) and messages[-1]["content"] == ex.answer
        head = np.concatenate([plan.compressed, plan.rest])
        assert np.array_equal(head, render(tok, messages[:-1]).ids)
        full = render(tok, messages, add_generation_prompt=False).ids
        assert np.array_equal(np.concatenate([head, plan.answer]), full[: head.size + plan.answer.size])
        assert tok.decode(plan.answer.tolist()).strip() == ex.answer  # no end-of-turn marker
        digits = H.answer_digit_positions(ex, tok, plan.answer)
        assert "".join(tok.decode([t]) for t in plan.answer[digits].tolist()) == "".join(ex.values)
        if setting == "aware":
            assert plan.rest.size == 0
        else:
            assert H.ACK in tok.decode(plan.rest.tolist()) and ex.question in tok.decode(plan.rest.tolist())
    with pytest.raises(ValueError, match="setting"):
        ex.messages("both")


def test_a_template_that_does_not_extend_is_refused(smollm2_tokenizer):
    (ex,) = passkey(1, length=512, seed=0, tokenizer=smollm2_tokenizer)

    class Rewrites:  # renders the same messages differently at every call
        def __init__(self, tok):
            self.tok, self.calls = tok, 0

        def __getattr__(self, name):
            return getattr(self.tok, name)

        def apply_chat_template(self, messages, **kw):
            self.calls += 1
            return self.tok.apply_chat_template(messages, **kw).replace("<|im_start|>system\n", "<|im_start|>system\n" + "x " * self.calls)

        def __call__(self, *a, **kw):
            return self.tok(*a, **kw)

    with pytest.raises(ChatError, match="not a token prefix"):
        token_plan(ex, Rewrites(smollm2_tokenizer), "agnostic")


def test_reply_correct(smollm2_tokenizer):
    (ex,) = passkey(1, length=512, seed=1, tokenizer=smollm2_tokenizer)
    key = ex.values[0]
    assert reply_correct(ex, key) and reply_correct(ex, f"The pass key is {key}.")
    assert not reply_correct(ex, key + "6") and not reply_correct(ex, "6" + key)
    assert not reply_correct(ex, f"1 then {key}") and not reply_correct(ex, "") and not reply_correct(ex, None)
    mv = niah(1, length=512, seed=1, tokenizer=smollm2_tokenizer, variant="multivalue")[0]
    assert reply_correct(mv, mv.answer) and reply_correct(mv, " and ".join(reversed(mv.values)))
    assert not reply_correct(mv, ", ".join(mv.values[:-1])) and not reply_correct(mv, mv.answer.replace(mv.values[0], mv.values[0] + "1"))
    assert reply_prefix(ex) == "The pass key is"
    for setting in H.SETTINGS:  # every question asks for the number(s) only (a small model names them then)
        assert ex.messages(setting)[-2]["content"].endswith("? Answer with the number only.")
        assert mv.messages(setting)[-2]["content"].endswith("? Answer with the numbers only, separated by commas.")
    assert reply_prefix(mv) == f"The special magic numbers for {mv.labels['asked_key']} are"
    with pytest.raises(ValueError):
        reply_correct(lm_text(1, length=64, seed=0, tokenizer=smollm2_tokenizer)[0], "1")
    with pytest.raises(ValueError):
        reply_prefix(lm_text(1, length=64, seed=0, tokenizer=smollm2_tokenizer)[0])


def test_lm_windows(smollm2_tokenizer):
    tok = smollm2_tokenizer
    examples = lm_text(6, length=1000, seed=2, tokenizer=tok, continuation=100)
    spans = sorted((e.labels["token_start"], e.labels["token_start"] + 1100) for e in examples)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # never overlap within a call
    corpus = C.corpus_ids(tok)
    for ex in examples:
        assert len(ex.context_ids) == 1000 and len(ex.target_ids) == 100
        s = ex.labels["token_start"]
        assert list(corpus[s : s + 1100]) == list(ex.context_ids + ex.target_ids)
        assert ex.question == "" and ex.values == () and ex.document and ex.answer
        plan = token_plan(ex, tok, "agnostic")
        assert plan.compressed.tolist() == list(ex.context_ids) and plan.rest.size == 0
        with pytest.raises(ValueError, match="no chat form"):
            ex.messages("aware")
    with pytest.raises(ValueError, match="windows"):
        lm_text(10_000, length=1000, seed=2, tokenizer=tok)


def test_lm_windows_overlap_only_where_the_corpus_holds_too_few(smollm2_tokenizer):
    """The prose corpus holds 50+ consecutive windows at 2k but not at 4k: at 2k the
    windows stay consecutive (the journals' examples are unchanged), at 4k they
    overlap just enough for 50, and no two continuations share a token."""
    size = int(C.corpus_ids(smollm2_tokenizer).size)
    short, long = 2048 + H.CONTINUATION, 4096 + H.CONTINUATION
    assert size // short >= H.LM_WINDOWS > size // long
    assert H.lm_windows(size, short) == [i * short for i in range(size // short)]
    starts = H.lm_windows(size, long)
    assert len(starts) >= H.LM_WINDOWS and starts[-1] + long <= size
    assert min(np.diff(starts)) > H.CONTINUATION
    windows = lm_text(H.LM_WINDOWS, length=4096, seed=7, tokenizer=smollm2_tokenizer)
    targets = sorted(e.labels["token_start"] + 4096 for e in windows)
    assert len(set(targets)) == H.LM_WINDOWS and min(np.diff(targets)) >= H.CONTINUATION
    assert H.lm_windows(100, 101) == [] and len(H.lm_windows(10_000, 100)) == 100  # consecutive when it can
