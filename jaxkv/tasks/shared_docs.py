"""Template-heavy agent sessions of one tenant over a shared document corpus.

The workload of cross-query segment reuse: many sessions open the same documents,
so the same document text (hundreds of tokens) appears in many prompts, at
different positions, behind different histories; and the scaffolding repeats
(one system prompt, the same tool schemas in a different order per session).

``shared_corpus(seed)``: ``n_docs`` documents spread over a few projects, each a
``Document d…: <project> <topic> report`` of ``records`` ``key: value`` lines (keys
and values unique across the whole corpus) plus filler sentences, closed by
``End of the <topic> report.`` — the exact text of an ``open`` tool response.

``shared_docs(n, seed, ...)``: ``n`` sessions in the format of ``agent_traces``
(``jaxkv.tasks.agent``): the user asks for 1-3 records of one project; the agent
searches (results: the project's documents among other projects' listings,
different per session), opens each document of the corpus in the user's order
(the tool response is the corpus text verbatim) and answers with the values.
Scored turns: every tool call and the answer, as in ``agent_traces``, so the
embedded model reads them as its own traces. Which record a session asks for is
drawn per session, so the same document serves different questions.

Invariants (``tests/test_reuse.py``): deterministic; every copied value appears
verbatim earlier; identifiers are unique within a session; a corpus document's
text is identical in every session that opens it.
"""

from __future__ import annotations

import dataclasses
import random

from jaxkv.tasks.agent import SEARCH_FOOTER, tool_schema, UNUSED_TOOLS
from jaxkv.tasks.example import Example, example_seed, join_list, scored, tool_call
from jaxkv.tasks.words import DOC_POOL, KEY_POOL, PROJECTS, SYSTEM_AGENT, TOPICS, VALUE_POOL, filler_sentence


@dataclasses.dataclass(frozen=True)
class Document:
    """One corpus document: id, project, topic, its ``(key, value)`` records in text
    order, and ``text`` (the ``open`` tool response)."""

    doc_id: str
    project: str
    topic: str
    records: tuple
    text: str


def shared_corpus(seed: int = 0, n_docs: int = 10, records: int = 30, filler_tokens: int = 120, projects: int = 3) -> list[Document]:
    """The shared corpus (module docstring); ``n_docs * records <= 400``."""
    if n_docs * records > min(len(KEY_POOL), len(VALUE_POOL)) or n_docs > len(DOC_POOL) // 2:
        raise ValueError(f"{n_docs} documents of {records} records exceed the identifier pools")
    rng = random.Random(seed)
    keys, values = list(KEY_POOL), list(VALUE_POOL)
    rng.shuffle(keys)
    rng.shuffle(values)
    names = rng.sample(PROJECTS, projects)
    doc_ids = rng.sample(DOC_POOL, n_docs)
    topics_left = {p: rng.sample(TOPICS, len(TOPICS)) for p in names}
    docs = []
    for i in range(n_docs):
        project = names[i % projects]
        topic = topics_left[project].pop()
        recs = [(keys.pop(), values.pop()) for _ in range(records)]
        lines = [f"{k}: {v}" for k, v in recs]
        budget = filler_tokens
        while budget > 0:
            lines.insert(rng.randint(0, len(lines)), filler_sentence(rng))
            budget -= 8
        body = "\n".join(lines)
        docs.append(Document(doc_ids[i], project, topic, tuple(recs), f"Document {doc_ids[i]}: {project} {topic} report\n{body}\nEnd of the {topic} report."))
    return docs


def one_session(seed: int, corpus: list[Document], n_search: int = 24) -> Example:
    """One session over ``corpus`` (module docstring)."""
    rng = random.Random(seed)
    by_project: dict[str, list[Document]] = {}
    for d in corpus:
        by_project.setdefault(d.project, []).append(d)
    project = rng.choice(sorted(by_project))
    own = by_project[project]
    opened = rng.sample(own, rng.randint(1, min(3, len(own))))
    wanted = [rng.choice(d.records) for d in opened]
    topics = [d.topic for d in opened]
    keys = [k for k, _ in wanted]
    values = [v for _, v in wanted]

    tool_names = ["search", "open"] + rng.sample(UNUSED_TOOLS, rng.randint(0, 2))
    rng.shuffle(tool_names)
    tools = [tool_schema(t) for t in tool_names]
    user = f"In the {project} project, find {join_list([f'{t} {k}' for k, t in zip(keys, topics)])}. Then answer."
    messages = [{"role": "system", "content": SYSTEM_AGENT}, {"role": "user", "content": user}]
    messages.append({"role": "assistant", "content": "", "reasoning_content": f"First, the search for {project}.",
                     "tool_calls": [tool_call("search", query=project)]})
    corpus_ids = {d.doc_id for d in corpus}
    free_ids = [d for d in DOC_POOL if d not in corpus_ids]
    rng.shuffle(free_ids)
    lines = [f"{project} {d.topic}: {d.doc_id}" for d in own]
    others = [p for p in PROJECTS if p != project]
    while len(lines) < n_search:
        lines.append(f"{rng.choice(others)} {rng.choice(TOPICS)} records: {free_ids.pop()}")
    rng.shuffle(lines)
    messages.append({"role": "tool", "name": "search", "content": f"Search results for {project}:\n" + "\n".join(lines) + f"\n{SEARCH_FOOTER}"})
    previous = "the search"
    for d, key in zip(opened, keys):
        messages.append({"role": "assistant", "content": "",
                         "reasoning_content": f"After {previous}, next is {d.topic} {key}. {project} {d.topic}: {d.doc_id}",
                         "tool_calls": [tool_call("open", doc_id=d.doc_id)]})
        messages.append({"role": "tool", "name": "open", "content": d.text})
        previous = d.topic
    answer = "Answer: " + join_list([f"{t} {k}: {v}" for k, t, v in zip(keys, topics, values)]) + "."
    messages.append({"role": "assistant", "content": answer, "reasoning_content": f"After {previous}, next is the answer."})

    targets = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if m.get("tool_calls"):
            fn = m["tool_calls"][0]["function"]
            targets.append(scored(messages, i, "tool_call", {"name": fn["name"], "arguments": dict(fn["arguments"])}, list(fn["arguments"].values())))
        else:
            targets.append(scored(messages, i, "answer", answer, values))
    labels = {"project": project, "doc_ids": [d.doc_id for d in opened], "topics": topics, "keys": keys, "values": values,
              "answer_values": values, "n_docs": len(opened)}
    return Example("shared_docs", seed, messages, tools, targets, labels)


def shared_docs(n: int, seed: int, corpus_seed: int = 0, n_docs: int = 10, records: int = 30, filler_tokens: int = 120) -> list[Example]:
    """``n`` sessions over one shared corpus (module docstring); session ``i`` uses
    ``example_seed(seed, i)``, the corpus ``shared_corpus(corpus_seed, ...)``."""
    corpus = shared_corpus(corpus_seed, n_docs, records, filler_tokens)
    return [one_session(example_seed(seed, i), corpus) for i in range(n)]
