"""Synthetic multi-turn agent traces whose later turns copy values from older tool output.

One trace (``agent_traces``):

1. system prompt + 2-4 tool schemas (``search``, ``open``, optionally ``lookup``,
   plus 0-2 tools that are never used);
2. the user names a project and 1-3 records, each the topic of the report holding
   it and a key ("In the Orchid project, find budget k173, travel k044 and legal
   k310. Resolve the first value in the registry, then answer.");
3. ``search(query=<project>)`` -> a result list: the project's reports, one line per
   topic (``Orchid budget: d123``), among other projects' record listings
   (``Cedar budget records: d044``);
4. for each record in the user's order, ``open(doc_id=<id from the search results>)``
   -> a long document of ``key: value`` records, one of them the wanted key;
5. with the registry: ``lookup(key=<value found in the first document>)`` -> a long
   table ``value: value``;
6. the final answer lists every record in the user's order and with the user's
   separators (``Answer: budget k173: v032, travel k044: v310 and legal k310: v002.``)
   and, with the registry, the resolved first value (`` Registry: v032: v219.``).

Every tool response ends with a footer naming what it was (``End of the budget
report.``), and every reasoning opens with the step just finished and the next one
(``After budget, next is travel k044. Orchid travel: d017``): the next record is
the one after the finished one in the user's list, and the call copies the id it has
just quoted from the search results. So the ``open`` calls copy ids from the search
results one to three tool responses back, ``lookup`` copies a value from a document
several turns back, and the answer copies from the latest and from older responses:
what must survive in the cache changes from turn to turn.

The wording keeps every copied identifier a few tokens after a cue that names it
uniquely (a key before its value, a topic before its id, the previous record before
the next), which is what a small model's induction heads match on
(``train/retrieval_probe.py``); nothing is quoted at length.

``length`` is the target rendered length in tokens (``approx_tokens``): everything
that is not the skeleton is distractor records, split between the search results (15%)
and the documents / registry table (the rest, evenly). Identifiers come from fixed
pools (``jaxkv.tasks.words``); past the pools' capacity the rest of each table is
filler sentences.

Documents from a corpus (``one_trace(..., shelves=...)``, the segment-reuse workload
``jaxkv.tasks.shared_docs``): the same builder, with the opened documents taken from
a ``Shelf`` (documents of one project with distinct topics, keys, values and ids,
themselves the documents of a generated trace) instead of generated for the trace:
the trace draws a shelf and 1-3 of its documents in its own order; project, topics,
document ids and document texts are the shelf's, each needle is a record of its
document drawn by the trace, and everything else (tools, search results, registry,
reasoning, answer, their sizes from ``table_sizes``) is drawn as for a generated
trace, from an identifier pool without the shelf's identifiers, so identifiers stay
unique within the trace. Without ``shelves`` a trace is what it always was: the
random draws are the same, in the same order, so every seed gives the same trace
byte for byte (``tests/test_tasks.py`` pins digests).
"""

from __future__ import annotations

import dataclasses
import random
import re

from jaxkv.tasks.example import Example, IdentifierPool, approx_tokens, conversation_tokens, example_seed, join_list, scored, tool_call
from jaxkv.tasks.words import PROJECTS, SYSTEM_AGENT, TOOL_SCHEMAS, TOPICS, filler_sentence
from jaxkv.chat.toy import schema

SEARCH_SHARE = 0.15
MIN_SEARCH_DISTRACTORS = 3
MIN_RECORD_DISTRACTORS = 4
UNUSED_TOOLS = ("calculate", "translate", "weather")
SEARCH_FOOTER = "End of the search results."
REGISTRY_FOOTER = "End of the registry."


def tool_schema(name: str) -> dict:
    description, params = TOOL_SCHEMAS[name]
    return schema(name, description, **params)


def _records(rng: random.Random, needle: str, n_records: int, filler_tokens: int, make_line) -> tuple[str, int]:
    """``n_records`` lines from ``make_line()`` plus about ``filler_tokens`` tokens of
    filler sentences (used when the identifier pools run short), shuffled, with
    ``needle`` inserted at a random line. Returns ``(text, needle line index)``."""
    lines = [make_line() for _ in range(n_records)]
    while filler_tokens > 0:
        lines.append(filler_sentence(rng))
        filler_tokens -= approx_tokens(lines[-1]) + 1
    rng.shuffle(lines)
    at = rng.randint(0, len(lines))
    lines.insert(at, needle)
    return "\n".join(lines), at


@dataclasses.dataclass(frozen=True)
class Document:
    """One corpus document: id, project, topic, its ``(key, value)`` records in text
    order, and ``text`` (the ``open`` tool response, verbatim)."""

    doc_id: str
    project: str
    topic: str
    records: tuple
    text: str


@dataclasses.dataclass(frozen=True)
class Shelf:
    """Documents of one project with pairwise distinct topics, keys, values and ids."""

    project: str
    docs: tuple

    @property
    def identifiers(self) -> frozenset:
        return frozenset(x for d in self.docs for x in (d.doc_id, *(i for rec in d.records for i in rec)))


def opened_documents(example: Example) -> list[Document]:
    """The documents ``example`` opens, in order, parsed from its ``open`` responses."""
    out = []
    for i, m in enumerate(example.messages):
        if m["role"] == "tool" and m["name"] == "open":
            doc_id = example.messages[i - 1]["tool_calls"][0]["function"]["arguments"]["doc_id"]
            header = m["content"].split("\n", 1)[0]  # "Document d123: <project> <topic> report"
            project, topic = header.split(": ", 1)[1].rsplit(" report", 1)[0].split(" ", 1)
            records = tuple(tuple(line.split(": ")) for line in m["content"].split("\n")[1:-1] if _RECORD_RE.fullmatch(line))
            out.append(Document(doc_id, project, topic, records, m["content"]))
    return out


_RECORD_RE = re.compile(r"k\d{3}: v\d{3}")


def one_trace(
    seed: int, length: int = 2048, n_docs: int | None = None, registry: bool | None = None, shelves: list[Shelf] | None = None
) -> Example:
    """One agent trace (see the module docstring); ``n_docs`` in 1..3, ``registry`` on/off;
    with ``shelves``, the documents are a shelf's (a ``"shared_docs"`` example)."""
    rng = random.Random(seed)
    ids = IdentifierPool(rng)
    n_docs = n_docs if n_docs is not None else rng.randint(1, 3)
    registry = registry if registry is not None else rng.random() < 0.6
    if shelves is None:
        project = rng.choice(PROJECTS)
        topics = rng.sample(TOPICS, n_docs)
        keys = [ids.key() for _ in topics]
        values = [ids.value() for _ in topics]
        doc_ids = [ids.doc_id() for _ in topics]
        texts = [None] * n_docs
    else:
        shelf = shelves[rng.randrange(len(shelves))]
        if n_docs > len(shelf.docs):
            raise ValueError(f"{n_docs} documents asked of a shelf of {len(shelf.docs)}")
        ids.exclude(shelf.identifiers)
        opened = rng.sample(shelf.docs, n_docs)
        project, topics, doc_ids, texts = shelf.project, [d.topic for d in opened], [d.doc_id for d in opened], [d.text for d in opened]
        wanted = [rng.choice(d.records) for d in opened]
        keys, values = [k for k, _ in wanted], [v for _, v in wanted]
    resolved = ids.value() if registry else None

    used = ["search", "open"] + (["lookup"] if registry else [])
    extra = rng.sample(UNUSED_TOOLS, rng.randint(0, 4 - len(used)))
    tool_names = used + extra
    rng.shuffle(tool_names)
    tools = [tool_schema(n) for n in tool_names]

    user = f"In the {project} project, find {join_list([f'{t} {k}' for k, t in zip(keys, topics)])}. "
    user += "Resolve the first value in the registry, then answer." if registry else "Then answer."

    # Skeleton first (distractor counts 0) to measure it; then fill the budget.
    def build(n_search: int, n_records: int, filler_tokens: int = 0) -> tuple[list[dict], dict]:
        r = random.Random(rng.random())  # distractors: own stream, skeleton unaffected
        pool = ids
        labels = {
            "project": project,
            "topics": topics,
            "keys": keys,
            "values": values,
            "doc_ids": doc_ids,
            "resolved": resolved,
            "needle_lines": [],
        }
        messages = [{"role": "system", "content": SYSTEM_AGENT}, {"role": "user", "content": user}]
        query = project
        messages.append(
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": f"First, the search for {project}.",
                "tool_calls": [tool_call("search", query=query)],
            }
        )

        # The project's other reports first (one line per topic, so the topic names
        # the line), then other projects' record listings.
        others = [t for t in TOPICS if t not in topics]
        r.shuffle(others)
        lines = [f"{project} {t}: {pool.doc_id()}" for t in others[: n_search // 3]]
        while len(lines) < n_search:
            p = r.choice([q for q in PROJECTS if q != project])
            lines.append(f"{p} {r.choice(TOPICS)} records: {pool.doc_id()}")
        r.shuffle(lines)
        for d, t in zip(doc_ids, topics):
            lines.insert(r.randint(0, len(lines)), f"{project} {t}: {d}")
        messages.append(
            {"role": "tool", "name": "search", "content": f"Search results for {query}:\n" + "\n".join(lines) + f"\n{SEARCH_FOOTER}"}
        )

        previous = "the search"
        for key, value, d, t, text in zip(keys, values, doc_ids, topics, texts):
            messages.append(
                {
                    "role": "assistant",
                    "content": "",
                    "reasoning_content": f"After {previous}, next is {t} {key}. {project} {t}: {d}",
                    "tool_calls": [tool_call("open", doc_id=d)],
                }
            )
            if text is None:
                body, at = _records(r, f"{key}: {value}", n_records, filler_tokens, lambda: f"{pool.key()}: {pool.value()}")
                text = f"Document {d}: {project} {t} report\n{body}\nEnd of the {t} report."
            else:
                at = text.split("\n").index(f"{key}: {value}") - 1
            labels["needle_lines"].append(at)
            messages.append({"role": "tool", "name": "open", "content": text})
            previous = t

        # "topic k: v" per record, in the user's order and with the user's separators:
        # each value follows its key as in the document, and each topic follows the
        # previous record's key and separator as in the user's list (a newline would
        # make the next line look like the document's next record).
        answer = "Answer: " + join_list([f"{t} {k}: {v}" for k, t, v in zip(keys, topics, values)]) + "."
        answer_values = values[:]
        if registry:
            messages.append(
                {
                    "role": "assistant",
                    "content": "",
                    "reasoning_content": f"After {previous}, next is the registry for {keys[0]}: {values[0]}",
                    "tool_calls": [tool_call("lookup", key=values[0])],
                }
            )
            body, at = _records(r, f"{values[0]}: {resolved}", n_records, filler_tokens, lambda: f"{pool.value()}: {pool.value()}")
            labels["registry_line"] = at
            messages.append({"role": "tool", "name": "lookup", "content": f"Registry entries:\n{body}\n{REGISTRY_FOOTER}"})
            previous = "the registry"
            answer += f" Registry: {values[0]}: {resolved}."
            answer_values.append(resolved)
        messages.append({"role": "assistant", "content": answer, "reasoning_content": f"After {previous}, next is the answer."})
        labels["answer_values"] = answer_values
        return messages, labels

    skeleton, _ = build(0, 0)
    messages, labels = build(*table_sizes(ids, project, length - conversation_tokens(skeleton, tools), n_docs, registry))

    targets = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if m.get("tool_calls"):
            fn = m["tool_calls"][0]["function"]
            targets.append(
                scored(messages, i, "tool_call", {"name": fn["name"], "arguments": dict(fn["arguments"])}, list(fn["arguments"].values()))
            )
        else:
            targets.append(scored(messages, i, "answer", m["content"], labels["answer_values"]))
    labels.update(n_docs=n_docs, registry=registry)
    return Example("agent_traces" if shelves is None else "shared_docs", seed, messages, tools, targets, labels)


def table_sizes(ids: IdentifierPool, project: str, budget: int, n_docs: int, registry: bool) -> tuple[int, int, int]:
    """``(search distractors, records per table, filler tokens per table)`` of a trace
    with ``budget`` tokens beyond its skeleton: 15% to the search results, the rest
    evenly to the documents and the registry, records capped so the pools last."""
    budget = max(0, budget)
    record_tokens = approx_tokens("k123: v123\n")
    search_tokens = approx_tokens(f"{project} budget records: d123\n")
    n_search = min(ids.left("d"), max(MIN_SEARCH_DISTRACTORS, int(budget * SEARCH_SHARE / search_tokens)))
    n_tables = n_docs + int(registry)
    table_tokens = max(MIN_RECORD_DISTRACTORS * record_tokens, int(budget * (1 - SEARCH_SHARE) / n_tables))
    # Records per table, capped so the key and value pools last for every table.
    n_records = min(table_tokens // record_tokens, ids.left("k") // n_docs, ids.left("v") // (n_docs + 2 * int(registry)))
    return n_search, n_records, table_tokens - n_records * record_tokens


def agent_traces(n: int, seed: int, length: int = 2048, n_docs: int | None = None, registry: bool | None = None) -> list[Example]:
    """``n`` agent traces of about ``length`` tokens (see the module docstring).

    Args:
      n: number of examples.
      seed: batch seed; example ``i`` uses ``example_seed(seed, i)``.
      length: target rendered length in tokens (``approx_tokens``; controls distractors).
      n_docs: documents to open (1-3); random per example when None.
      registry: whether the first value must be resolved with ``lookup``; random
        (60% yes) when None.
    """
    return [one_trace(example_seed(seed, i), length, n_docs, registry) for i in range(n)]
