"""The fixed word lists every synthetic task draws its prose from.

``vocabulary()`` is the closed set of ``\\w+`` runs the generators can emit: the prose
words of the lists and fixed sentences below, then the identifier pools (keys
``k000``..``k399``, values ``v000``..``v399``, document ids ``d000``..``d199``). Every
identifier is one vocabulary word, so it is one token of the word-level tokenizer and
retrieving a value is single-token induction (find the key token, copy the value token
after it). Adding a phrase here is enough to keep the tokenizer vocabulary complete.
"""

from __future__ import annotations

import re

PROJECTS = (
    "Orchid Falcon Harbor Juniper Cobalt Summit Willow Ember Granite Meadow "
    "Beacon Cedar Lantern Aurora Quartz Delta Maple Raven Saffron Tundra"
).split()

TOPICS = (
    "budget safety inventory travel hiring security training supply energy "
    "marketing legal quality research shipping facilities payroll compliance "
    "maintenance pricing support"
).split()

# Filler for the needle haystack: sentences are random draws from these words.
FILLER_SUBJECTS = (
    "The river",
    "The market",
    "The old house",
    "A small boat",
    "The north road",
    "The garden",
    "The city",
    "The forest",
    "A quiet town",
    "The harbor",
)
FILLER_WORDS = (
    "calm early late bright cold warm green grey long short quiet busy open closed "
    "slowly often never always again today yesterday morning evening winter summer "
    "spring autumn rain wind snow light stone water bridge tower field hill valley "
    "people workers children travelers birds trees clouds lamps windows doors "
    "walked waited opened turned moved grew stayed passed rested watched"
).split()

SYSTEM_AGENT = "You are a research agent. Use the tools to find facts in the documents and answer with the exact values you found."
SYSTEM_PLAIN = "You are a helpful assistant."

# Sentence templates (``str.format`` fields are filled with words or identifiers).
PHRASES = (
    # agent traces (jaxkv.tasks.agent)
    "In the {project} project, find {topic} {key}, {topic} {key} and {topic} {key}.",
    "Resolve the first value in the registry, then answer.",
    "Then answer.",
    "First, the search for {project}.",
    "After the search, next is {topic} {key}. {project} {topic}: {doc}",
    "After {topic}, next is the registry for {key}: {value}",
    "After the registry, next is the answer.",
    "{project} {topic} records: {doc}",
    "Answer: {topic} {key}: {value}, {topic} {key}: {value}. Registry: {value}: {value}.",
    "Search results for {query}:",
    "End of the search results.",
    "Document {doc}: {project} {topic} report",
    "End of the {topic} report.",
    "Registry entries:",
    "End of the registry.",
    # split-query needle retrieval (jaxkv.tasks.mqniah)
    "Read the document below and answer the questions about it.",
    "Question: What are the special codes of {keys}? Answer one key per line.",
    "{key} is {value}",
    "The special code for {key} is {value}.",
    "and",
    # the trainer's copy drill (train.embedded_model.copy_drill)
    "Repeat the list: {items}",
)

TOOL_SCHEMAS = {
    "search": ("Search the document index and list matching documents.", {"query": "words to search for"}),
    "open": ("Open a document by its id and return its records.", {"doc_id": "the document id, for example d123"}),
    "lookup": ("Resolve a value code in the registry.", {"key": "the value code to resolve"}),
    "calculate": ("Evaluate an arithmetic expression.", {"expression": "the expression to evaluate"}),
    "translate": ("Translate a text into another language.", {"text": "the text", "language": "the target language"}),
    "weather": ("Get the weather forecast for a city.", {"city": "the city name"}),
}

# Identifier pools: a generator draws from them without replacement per example.
KEY_POOL = tuple(f"k{i:03d}" for i in range(400))
VALUE_POOL = tuple(f"v{i:03d}" for i in range(400))
DOC_POOL = tuple(f"d{i:03d}" for i in range(200))
IDENTIFIERS = frozenset(KEY_POOL + VALUE_POOL + DOC_POOL)
# Words a tool call copies into its JSON arguments (identifiers, project names): the
# embedded tokenizer gives them no space-prefixed variant, so each is one token
# wherever it appears (``"d123"`` in a call, `` d123`` in prose).
UNSPACED_WORDS = IDENTIFIERS | frozenset(PROJECTS)

# Words the JSON schemas themselves contain (keys and type names).
SCHEMA_WORDS = ("type", "function", "name", "description", "parameters", "object", "properties", "string", "required")


def filler_sentence(rng) -> str:
    """A random prose sentence from ``FILLER_SUBJECTS`` and ``FILLER_WORDS``."""
    words = rng.choices(FILLER_WORDS, k=rng.randint(4, 9))
    return f"{rng.choice(FILLER_SUBJECTS)} {' '.join(words)}."


_WORD_RE = re.compile(r"[A-Za-z_][A-Za-z_0-9]*")


def vocabulary() -> list[str]:
    """Every word the task generators can emit (order fixed): prose words, then identifiers."""
    texts = [*PROJECTS, *TOPICS, *FILLER_SUBJECTS, *FILLER_WORDS, SYSTEM_AGENT, SYSTEM_PLAIN, *PHRASES, *SCHEMA_WORDS]
    for name, (description, params) in TOOL_SCHEMAS.items():
        texts += [name, description, *params, *params.values()]
    words = []
    for text in texts:
        words += [w for w in _WORD_RE.findall(re.sub(r"\{\w+\}", " ", text)) if not re.fullmatch(r"[kvd]\d+", w)]
    # Single letters are already characters of the toy tokenizer.
    prose = [w for w in dict.fromkeys(words) if len(w) > 1]
    return prose + [*KEY_POOL, *VALUE_POOL, *DOC_POOL]
