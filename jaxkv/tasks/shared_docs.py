"""Template-heavy agent sessions of one tenant over a shared document corpus.

The workload of cross-query segment reuse: many sessions open the same documents,
so the same document text (hundreds of tokens) appears in many prompts, at
different positions, behind different histories; and the scaffolding repeats
(one system prompt, the same tool schemas in a different order per session).

The sessions are the embedded model's own agent traces (``jaxkv.tasks.agent``,
``one_trace(..., shelves=...)``), so the model reads them in distribution; only
the opened documents come from the corpus instead of being generated per trace.

``shared_corpus(seed, n_shelves, length)``: ``n_shelves`` shelves, each the three
documents a generated agent trace of ``length`` tokens (three documents, with the
registry) opens, verbatim; shelves have distinct projects and document ids, so a
document id names one document in the whole corpus.

``shared_docs(n, seed, ...)``: ``n`` sessions; each draws a shelf, opens 1-3 of its
documents in its own order and asks for one record of each (drawn per session, so
the same document serves different questions); everything else (tools, search
results, registry, reasoning, answer, sizes) is drawn as for an agent trace of
``length`` tokens. Scored turns: every tool call and the answer.

Invariants (``tests/test_reuse.py``, ``tests/test_tasks.py``): deterministic; every
copied value appears verbatim earlier; identifiers are unique within a session; a
corpus document's text is identical in every session that opens it; agent traces
are unchanged by the shelf path (pinned digests).
"""

from __future__ import annotations

from jaxkv.tasks.agent import Document, Shelf, one_trace, opened_documents
from jaxkv.tasks.example import Example, example_seed

DOCS_PER_SHELF = 3


def shelves(seed: int = 0, n_shelves: int = 4, length: int = 2048) -> list[Shelf]:
    """The corpus grouped by project (module docstring)."""
    out, projects, doc_ids = [], set(), set()
    i = 0
    while len(out) < n_shelves:
        if i > 100 * n_shelves:
            raise ValueError(f"no {n_shelves} shelves with distinct projects and documents at length {length}")
        docs = opened_documents(one_trace(example_seed(seed, i), length, n_docs=DOCS_PER_SHELF, registry=True))
        i += 1
        ids = {d.doc_id for d in docs}
        if docs[0].project in projects or ids & doc_ids:
            continue
        projects.add(docs[0].project)
        doc_ids |= ids
        out.append(Shelf(docs[0].project, tuple(docs)))
    return out


def shared_corpus(seed: int = 0, n_shelves: int = 4, length: int = 2048) -> list[Document]:
    """Every document of ``shelves(seed, n_shelves, length)``."""
    return [d for s in shelves(seed, n_shelves, length) for d in s.docs]


def shared_docs(n: int, seed: int, corpus_seed: int = 0, n_shelves: int = 4, length: int = 2048) -> list[Example]:
    """``n`` sessions over one shared corpus (module docstring); session ``i`` uses
    ``example_seed(seed, i)``, the corpus ``shelves(corpus_seed, n_shelves, length)``."""
    corpus = shelves(corpus_seed, n_shelves, length)
    return [one_trace(example_seed(seed, i), length, shelves=corpus) for i in range(n)]
