"""Synthetic tasks: labels point at the needles, splits avoid the tail, values precede
their use, seeds reproduce, lengths scale, and the vocabulary covers every word."""

from __future__ import annotations

import json
import re

import pytest

from jaxkv.tasks import NEEDLE_COUNTS, agent_traces, approx_tokens, mqniah, vocabulary
from jaxkv.tasks.mqniah import NEEDLE_TEMPLATE
from jaxkv.tasks.words import IDENTIFIERS


def _all_examples():
    return [
        *agent_traces(12, seed=3, length=1500),
        *agent_traces(4, seed=4, length=4096, n_docs=3, registry=True),
        *[ex for k in NEEDLE_COUNTS for ex in mqniah(4, seed=k, needles=k, length=1500)],
        *[ex for k in (4, 8) for ex in mqniah(3, seed=k, needles=k, length=1500, turns=5)],
    ]


@pytest.fixture(scope="module")
def examples():
    return _all_examples()


@pytest.mark.parametrize("k", NEEDLE_COUNTS)
def test_needles_are_where_the_labels_say(k):
    for ex in mqniah(6, seed=11, needles=k, length=2048):
        doc = ex.messages[1]["content"]
        document = doc[: doc.index("Question:")]
        needles = ex.labels["needles"]
        assert len(needles) == k
        for n in needles:
            assert doc[n["char_start"] : n["char_end"]] == NEEDLE_TEMPLATE.format(key=n["key"], value=n["value"])
            assert document.count(n["key"]) == 1 and doc.count(n["value"]) == 1
        starts = [n["char_start"] for n in needles]
        assert starts == sorted(starts)
        depths = [n["depth"] for n in needles]
        assert all(0.0 <= d <= 1.0 for d in depths) and depths == sorted(depths)


@pytest.mark.parametrize("k", NEEDLE_COUNTS)
def test_turn2_keys_are_never_the_tail_needles(k):
    for ex in mqniah(20, seed=5, needles=k, length=1024):
        needles = ex.labels["needles"]
        tail = needles[len(needles) - max(1, k // 4) :]
        turn2 = set(ex.labels["turn2_keys"])
        assert not turn2 & {n["key"] for n in tail}
        assert len(turn2) == k // 2 and len(ex.labels["turn1_keys"]) == k - k // 2
        assert turn2 == {n["key"] for n in needles if n["turn"] == 2}
        assert not turn2 & set(ex.labels["turn1_keys"])
        # the turn-2 question really asks these keys, and only after the turn-1 answer
        assert ex.messages[3]["role"] == "user" and all(key in ex.messages[3]["content"] for key in turn2)


@pytest.mark.parametrize("k", (4, 8))
def test_five_turn_schedule_revisits_and_never_asks_the_tail_after_turn_1(k):
    from jaxkv.tasks.mqniah import REVISIT_SCHEDULE

    for ex in mqniah(10, seed=7, needles=k, length=1500, turns=5):
        needles, asks = ex.labels["needles"], ex.labels["turn_keys"]
        tail = {n["key"] for n in needles[len(needles) - k // 4 :]}
        assert len(asks) == 5 and all(len(a) == k // 4 for a in asks)
        assert set(asks[0]) == tail and not tail & set().union(*map(set, asks[1:]))
        assert set(asks[3]) == set(asks[1])  # the revisit
        assert len(set().union(*map(set, asks))) == k  # every needle asked at least once
        for g, ask in zip(REVISIT_SCHEDULE, asks):
            assert set(ask) == set(asks[REVISIT_SCHEDULE.index(g)])
        users = [m for m in ex.messages if m["role"] == "user"]
        assert len(users) == 5 and len(ex.targets) == 5
        for user, ask in zip(users, asks):
            assert all(key in user["content"] for key in ask)
        assert {n["key"]: n["turn"] for n in needles} == {
            key: 1 + min(t for t, a in enumerate(asks) if key in a) for key in (n["key"] for n in needles)
        }


def test_mqniah_rejects_bad_turn_counts():
    with pytest.raises(ValueError, match="turns"):
        mqniah(1, 0, needles=4, turns=3)
    with pytest.raises(ValueError, match="4 or 8"):
        mqniah(1, 0, needles=6, turns=5)


def test_every_copied_value_appears_before_it_is_needed(examples):
    for ex in examples:
        assert ex.targets, ex.task
        for turn in ex.targets:
            msg = ex.messages[turn.message_index]
            assert msg["role"] == "assistant"
            if turn.kind == "tool_call":
                call = msg["tool_calls"][0]["function"]
                assert {"name": call["name"], "arguments": call["arguments"]} == turn.expected
            else:
                assert msg["content"] == turn.expected
            for value, ev in zip(turn.values, turn.evidence):
                assert ev.message_index < turn.message_index
                assert ex.messages[ev.message_index]["content"][ev.char_start : ev.char_end] == value
                assert value in json.dumps(turn.expected)


def test_agent_traces_copy_from_several_turns_back():
    """Open calls copy from the search results, lookup and answer from older documents."""
    exs = agent_traces(10, seed=9, length=2048, n_docs=3, registry=True)
    for ex in exs:
        kinds = [(t.kind, t.expected["name"] if t.kind == "tool_call" else None) for t in ex.targets]
        assert kinds == [("tool_call", "search")] + [("tool_call", "open")] * 3 + [("tool_call", "lookup"), ("answer", None)]
        search_response = ex.targets[0].message_index + 1
        for t in ex.targets[1:4]:
            assert t.evidence[0].message_index == search_response
        lookup, answer = ex.targets[4], ex.targets[5]
        assert lookup.message_index - lookup.evidence[0].message_index == 5  # three tool responses back
        sources = [e.message_index for e in answer.evidence]
        assert sources[-1] == answer.message_index - 1  # the resolved value: the registry (latest response)
        assert all(answer.message_index - s > 2 for s in sources[:-1])  # the records: older documents
        # retrieve, then call: an open / lookup reasoning ends with the line it read
        # (topic or key, then the identifier the call copies); the answer's reasoning
        # names no identifier
        search_lines = ex.messages[search_response]["content"].splitlines()
        for t in ex.targets[1:5]:
            reasoning = ex.messages[t.message_index]["reasoning_content"]
            assert reasoning.endswith(": " + t.values[0])
            quoted = reasoning.rsplit(". ", 1)[-1] if t.expected["name"] == "open" else reasoning.rsplit(" for ", 1)[-1]
            source = ex.messages[t.evidence[0].message_index]["content"].splitlines()
            assert quoted in source
        assert sum(line.endswith(": " + ex.targets[1].values[0]) for line in search_lines) == 1
        assert not any(v in ex.messages[answer.message_index]["reasoning_content"] for v in answer.values)
        # every reasoning names the step it follows, which the latest tool response's
        # footer names too, and the records go in the user's order
        keys, topics = ex.labels["keys"], ex.labels["topics"]
        previous = ["the search", *topics, "the registry"]
        for i, t in enumerate(ex.targets[1:], start=0):
            reasoning = ex.messages[t.message_index]["reasoning_content"]
            assert reasoning.startswith(f"After {previous[i]}, next is ")
            footer = ex.messages[t.message_index - 1]["content"].splitlines()[-1]
            assert previous[i].removeprefix("the ") in footer and footer.startswith("End of the ")
            if i < 3:
                assert f"next is {topics[i]} {keys[i]}." in reasoning
        user = ex.messages[1]["content"]
        assert [user.index(f"{t} {k}") + len(t) + 1 for k, t in zip(keys, topics)] == sorted(user.index(k) for k in keys)


def test_agent_traces_offer_two_to_four_tools(examples):
    for ex in (e for e in examples if e.task == "agent_traces"):
        names = [t["function"]["name"] for t in ex.tools]
        assert 2 <= len(names) <= 4 and len(set(names)) == len(names)
        called = {c["function"]["name"] for m in ex.messages for c in m.get("tool_calls") or ()}
        assert called <= set(names)
        assert ("lookup" in called) == ex.labels["registry"]


def test_seeds_are_deterministic_and_distinct():
    a = agent_traces(3, seed=1, length=1024) + mqniah(3, seed=1, needles=6, length=1024)
    b = agent_traces(3, seed=1, length=1024) + mqniah(3, seed=1, needles=6, length=1024)
    c = agent_traces(3, seed=2, length=1024) + mqniah(3, seed=2, needles=6, length=1024)
    assert [(e.messages, e.tools, e.targets, e.labels) for e in a] == [(e.messages, e.tools, e.targets, e.labels) for e in b]
    assert [e.messages for e in a] != [e.messages for e in c]


@pytest.mark.parametrize("make", [lambda L: agent_traces(4, 0, length=L, n_docs=2), lambda L: mqniah(4, 0, needles=4, length=L)])
def test_length_knob_scales_the_rendered_length(make):
    for length in (2048, 4096, 8192):
        for ex in make(length):
            assert abs(ex.approx_tokens() - length) < 0.05 * length


def test_approx_tokens_match_the_embedded_tokenizer(examples):
    from train.embedded_model import embedded_tokenizer

    tok = embedded_tokenizer()
    for ex in examples[::5]:
        for m in ex.messages:
            text = m["content"] + "\n" + (m.get("reasoning_content") or "")
            assert len(tok(text, add_special_tokens=False)["input_ids"]) == approx_tokens(text)


def test_vocabulary_covers_every_word(examples):
    vocab = set(vocabulary())
    assert len(vocab - IDENTIFIERS) < 1000 and len(vocab) < 1500  # a few hundred words + the pools
    for ex in examples:
        texts = [json.dumps(ex.tools)]
        for m in ex.messages:
            texts += [m["content"], m.get("reasoning_content") or ""]
            texts += [json.dumps(c["function"]["arguments"]) for c in m.get("tool_calls") or ()]
        words = {w for t in texts for w in re.findall(r"\w+", t)}
        identifiers = {w for w in words if re.fullmatch(r"[kvd]\d+", w)}
        assert identifiers <= IDENTIFIERS, sorted(identifiers - IDENTIFIERS)[:10]
        unknown = words - vocab - {w for w in words if len(w) == 1}
        assert not unknown, (ex.task, sorted(unknown)[:10])


def test_identifiers_are_single_tokens(examples):
    """Keys, values and document ids are one token each, the same token in prose and in
    JSON arguments: retrieval is single-token induction."""
    from train.embedded_model import embedded_tokenizer

    tok = embedded_tokenizer()
    for ex in examples[::7]:
        for turn in ex.targets:
            for value in turn.values:
                alone = tok(value, add_special_tokens=False)["input_ids"]
                assert len(alone) == 1, value
                assert tok(f" {value}", add_special_tokens=False)["input_ids"][1:] == alone
                assert tok(f'"{value}"', add_special_tokens=False)["input_ids"][1:2] == alone


def test_long_examples_stay_unique_when_the_pools_run_short():
    """Past the pools' capacity the tables fill with prose, identifiers stay unique."""
    for ex in agent_traces(2, seed=6, length=8192, n_docs=3, registry=True):
        text = "\n".join(m["content"] for m in ex.messages if m["role"] == "tool")
        idents = re.findall(r"\b[kvd]\d{3}\b", text)
        # each identifier occurs once, except values that the registry resolves and
        # document ids that head their document
        assert all(idents.count(i) <= 2 for i in idents)
        assert abs(ex.approx_tokens() - 8192) < 0.05 * 8192


# sha256 (first 16 hex digits) of the generated examples, pinned before the shelf
# path of ``one_trace`` (``jaxkv.tasks.shared_docs``) existed: agent traces, and so
# the embedded model's training data and every agent result, are unchanged by it.
AGENT_DIGESTS = {
    (12, 3, 1500, None, None): "e971a0a7da24456f",
    (4, 4, 4096, 3, True): "d202cfd83d1835fc",
    (6, 1 << 30, 2048, None, None): "312b139b7a1d81ce",
    (6, 99, 1100, 1, False): "e2554855072a2548",
}


@pytest.mark.parametrize("args", sorted(AGENT_DIGESTS, key=str))
def test_agent_traces_are_byte_identical_for_fixed_seeds(args):
    import dataclasses
    import hashlib

    n, seed, length, n_docs, registry = args
    exs = agent_traces(n, seed, length=length, n_docs=n_docs, registry=registry)
    blob = json.dumps([dataclasses.asdict(e) for e in exs], sort_keys=True).encode()
    assert hashlib.sha256(blob).hexdigest()[:16] == AGENT_DIGESTS[args]


def test_shared_docs_sessions_are_agent_traces_over_a_shared_corpus():
    from jaxkv.tasks import shared_corpus, shared_docs
    from jaxkv.tasks.agent import opened_documents

    corpus = {d.doc_id: d for d in shared_corpus(0)}
    assert len(corpus) == 12 and len({d.project for d in corpus.values()}) == 4
    for ex in shared_docs(30, 5):
        assert ex.task == "shared_docs"
        for d in opened_documents(ex):
            assert d == corpus[d.doc_id]  # verbatim, with the corpus's records
        # identifiers unique within the session: each occurs once in the tool responses
        # (less the documents' headers, which repeat their search result, and the
        # registry's needle, which repeats the first value)
        tool_text = "\n".join(
            m["content"].split("\n", 1)[1] if m["name"] == "open" else m["content"] for m in ex.messages if m["role"] == "tool"
        )
        if ex.labels["registry"]:
            tool_text = tool_text.replace(f"\n{ex.labels['values'][0]}: {ex.labels['resolved']}\n", "\n")
        for ident in set(re.findall(r"\b[kvd]\d{3}\b", tool_text)):
            assert len(re.findall(rf"\b{ident}\b", tool_text)) == 1, ident
        for key, value in zip(ex.labels["keys"], ex.labels["values"]):
            assert f"{key}: {value}" in tool_text
