"""Retrieval tasks for real pretrained models: passkey and RULER-style needles in a haystack.

The synthetic tasks (``agent``, ``mqniah``) are written in the embedded model's
word-level vocabulary. These are for pretrained models with their own tokenizer:
every generator takes that tokenizer and renders each example with the model's own
chat template, and ``length`` is the rendered prompt (the document, the question
and the template) in the model's tokens.

* ``passkey``: a 5-digit key in a haystack of repeated noise sentences
  (``PASSKEY_FILLER``), its depth drawn uniformly in [0, 1].
* ``niah``: RULER-style needles ("One of the special magic numbers for Lisbon is:
  4512907.") in a haystack of real text that ships with Python: the docstrings of
  standard-library modules and their public names (``haystack="docs"``), or their
  source code (``haystack="code"``). Variants: ``single`` (one needle, asked),
  ``multikey`` (``needles`` needles with different keys, one asked), ``multivalue``
  (``needles`` values of one key, all asked, in document order).

Two settings, as kvpress distinguishes them:

* ``"agnostic"`` (question-agnostic): the document is the first user message, a
  fixed acknowledgement is the first assistant turn, the question is the second
  user message. A managed cache compresses the document when turn 1 ends, before
  it has seen the question (the multi-turn case RepairKV exists for).
* ``"aware"`` (question-aware): document and question in one user message, so the
  question sits in the observation window of the prompt's compression.

Scoring: every example has one scored answer turn (``targets[0]``) whose reply
starts with ``labels["reply_prefix"]`` ("The pass key is"): a small model names the
value far more reliably when its reply is started for it, and the prefix makes
greedy exact match and teacher forcing score the same tokens. ``answer_values``
reads the values a reply names; ``is_correct`` compares them with the needles'.

Invariants (``tests/test_retrieval_tasks.py``): the same arguments give the same
examples; each example's rendered prompt (up to the scored turn's generation
prompt) is within ``LENGTH_TOLERANCE`` of ``length`` tokens; every needle's
``char_start``/``char_end`` index its sentence in the document message and its
``depth`` is where it was drawn (the fraction of haystack text before it).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import random
import re

from jaxkv.tasks.example import Example, ScoredTurn, example_seed, find_evidence

LENGTH_TOLERANCE = 0.02
SETTINGS = ("agnostic", "aware")
NIAH_VARIANTS = ("single", "multikey", "multivalue")
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
ACKNOWLEDGEMENT = "I have read the document. Ask me about it."

# Standard-library modules whose docstrings (and sources) make the niah haystack:
# text every Python installation has, in a fixed order so a seed means the same text.
HAYSTACK_MODULES = (
    "argparse", "asyncio", "bisect", "calendar", "collections", "configparser", "contextlib", "csv",
    "dataclasses", "datetime", "decimal", "difflib", "email.message", "enum", "fractions", "functools",
    "gzip", "heapq", "http.client", "inspect", "ipaddress", "itertools", "json", "logging", "mailbox",
    "pathlib", "pickle", "pprint", "queue", "random", "shutil", "statistics", "string", "subprocess",
    "tarfile", "tempfile", "textwrap", "threading", "tokenize", "typing", "unittest", "urllib.parse",
    "uuid", "warnings", "weakref", "zipfile",
)
KEYS = (
    "Lisbon", "Nairobi", "Osaka", "Quito", "Reykjavik", "Tbilisi", "Hanoi", "Lima", "Oslo", "Dakar",
    "Montreal", "Bergen", "Cusco", "Porto", "Seville", "Tallinn", "Valparaiso", "Zanzibar", "Kyoto",
    "Marrakesh", "Adelaide", "Bogota", "Cairo", "Dublin", "Edinburgh", "Florence", "Geneva", "Havana",
    "Istanbul", "Jakarta", "Kigali", "Lagos", "Manila", "Naples", "Ottawa", "Prague", "Riga", "Santiago",
    "Tunis", "Utrecht", "Vienna", "Windhoek", "Yerevan", "Zagreb",
)


@functools.lru_cache(maxsize=2)
def haystack_units(haystack: str = "docs") -> tuple[tuple[str, ...], str]:
    """Standard-library text cut into small units, in a fixed order, and the separator
    that joins them: sentences of docstrings joined by spaces (``"docs"``), or
    non-blank source lines joined by newlines (``"code"``). Small units let a
    generator hit a token length closely."""
    if haystack not in ("docs", "code"):
        raise ValueError(f"haystack must be 'docs' or 'code', got {haystack!r}")
    units: list[str] = []
    seen: set[str] = set()
    for name in HAYSTACK_MODULES:
        module = importlib.import_module(name)
        if haystack == "code":
            try:
                pieces = [line for line in inspect.getsource(module).splitlines() if line.strip()]
            except (OSError, TypeError):
                continue
        else:
            objs = [module] + [getattr(module, n) for n in sorted(getattr(module, "__all__", ()) or ()) if hasattr(module, n)]
            docs = [inspect.getdoc(o) for o in objs if inspect.ismodule(o) or inspect.isclass(o) or inspect.isfunction(o)]
            text = " ".join(" ".join(d.split()) for d in docs if d and d not in seen)
            seen.update(d for d in docs if d)
            pieces = [c for p in re.split(r"(?<=[.!?])\s+", text) if len(p) >= 20 for c in _chunks(p)]
        units.extend(p for p in pieces if "magic number" not in p and "pass key" not in p and not re.search(r"\d{5}", p))
    return tuple(units), ("\n" if haystack == "code" else " ")


def _chunks(sentence: str, words: int = 12) -> list[str]:
    """A sentence cut into runs of at most ``words`` words (~20 tokens), so that a
    haystack can hit a 1k-token target within 2% (half a unit either way)."""
    w = sentence.split(" ")
    return [" ".join(w[i : i + words]) for i in range(0, len(w), words)]


# --------------------------------------------------------------------------- rendering
def _render_ids(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _messages(setting: str, intro: str, document: str, question: str, answer: str) -> list[dict]:
    if setting == "agnostic":
        return [
            {"role": "user", "content": f"{intro}\n\n{document}"},
            {"role": "assistant", "content": ACKNOWLEDGEMENT},
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ]
    return [
        {"role": "user", "content": f"{intro}\n\n{document}\n\n{question}"},
        {"role": "assistant", "content": answer},
    ]


def _fit(tokenizer, length: int, build) -> tuple[list[dict], dict]:
    """Call ``build(units) -> (messages, labels)`` with the number of haystack units that
    brings the rendered prompt (up to the scored turn) within tolerance of ``length``."""

    def tokens(units: int):
        messages, labels = build(units)
        return len(_render_ids(tokenizer, messages[:-1])), messages, labels

    lo, hi = 1, 1
    n_hi, m, lab = tokens(hi)
    while n_hi < length:
        lo, hi = hi, hi * 2
        n_hi, m, lab = tokens(hi)
    best = (abs(n_hi - length), m, lab, n_hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        n, m, lab = tokens(mid)
        if abs(n - length) < best[0]:
            best = (abs(n - length), m, lab, n)
        lo, hi = (mid, hi) if n < length else (lo, mid)
    n_lo, m, lab = tokens(lo)
    if abs(n_lo - length) < best[0]:
        best = (abs(n_lo - length), m, lab, n_lo)
    err, messages, labels, n = best
    if err > LENGTH_TOLERANCE * length:
        raise ValueError(f"could not fit {length} tokens within {LENGTH_TOLERANCE:.0%} (closest {n})")
    labels["prompt_tokens"] = n
    return messages, labels


def _place(units: list[str], inserts: list[tuple[float, str]], sep: str = " ") -> tuple[str, list[tuple[int, int, float]]]:
    """Join haystack ``units`` with each insert placed at its depth (the fraction of
    units before it); returns the document and each insert's (start, end, depth)."""
    slots = sorted(range(len(inserts)), key=lambda i: inserts[i][0])
    at = {}
    for i in slots:
        at.setdefault(round(inserts[i][0] * len(units)), []).append(i)
    pieces: list[str] = []
    spans: list[tuple[int, int, float]] = [None] * len(inserts)  # type: ignore[list-item]
    pos = 0
    for j in range(len(units) + 1):
        for i in at.get(j, ()):
            start = pos + (len(sep) if pieces else 0)
            pieces.append(inserts[i][1])
            pos = start + len(inserts[i][1])
            spans[i] = (start, pos, j / len(units))
        if j < len(units):
            pos += (len(sep) if pieces else 0) + len(units[j])
            pieces.append(units[j])
    return sep.join(pieces), spans


def _example(task: str, seed: int, messages: list[dict], labels: dict, values: list[str]) -> Example:
    index = len(messages) - 1
    evidence = tuple(find_evidence(messages, v, index) for v in values)
    answer = messages[index]["content"]
    target = ScoredTurn(index, "answer", answer, evidence, tuple(values))
    return Example(task, seed, messages, [], [target], labels)


# --------------------------------------------------------------------------- passkey
def passkey(n: int, seed: int, length: int, tokenizer, *, setting: str = "agnostic") -> list[Example]:
    """``n`` passkey examples of ``length`` rendered tokens (see the module docstring)."""
    _check(setting, length)
    return [_one_passkey(example_seed(seed, i), length, tokenizer, setting) for i in range(n)]


def _one_passkey(seed: int, length: int, tokenizer, setting: str) -> Example:
    rng = random.Random(seed)
    key = f"{rng.randrange(10_000, 100_000)}"
    depth = rng.random()
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    intro = "A lot of irrelevant text follows, and somewhere in it one piece of important information. Find it and remember it: I will ask you about it."
    question = "What is the pass key? Answer with the number only."
    prefix = "The pass key is"

    def build(units: int):
        document, spans = _place([PASSKEY_FILLER] * units, [(depth, needle)])
        messages = _messages(setting, intro, document, question, f"{prefix} {key}.")
        start, end, at = spans[0]
        return messages, _labels(setting, prefix, units, [dict(key="pass key", value=key, char_start=len(intro) + 2 + start, char_end=len(intro) + 2 + end, depth=at, drawn_depth=depth)])

    messages, labels = _fit(tokenizer, length, build)
    return _example("passkey", seed, messages, labels, [key])


# --------------------------------------------------------------------------- niah
def niah(n: int, seed: int, length: int, tokenizer, *, variant: str = "single", setting: str = "agnostic", needles: int = 4, haystack: str = "docs") -> list[Example]:
    """``n`` RULER-style needle examples of ``length`` rendered tokens (module docstring)."""
    _check(setting, length)
    if variant not in NIAH_VARIANTS:
        raise ValueError(f"variant must be one of {NIAH_VARIANTS}, got {variant!r}")
    if variant != "single" and not 2 <= needles <= len(KEYS):
        raise ValueError(f"needles must be in [2, {len(KEYS)}], got {needles}")
    return [_one_niah(example_seed(seed, i), length, tokenizer, variant, setting, needles, haystack) for i in range(n)]


def _one_niah(seed: int, length: int, tokenizer, variant: str, setting: str, needles: int, haystack: str) -> Example:
    rng = random.Random(seed)
    units, sep = haystack_units(haystack)
    start_at = rng.randrange(len(units))
    order = units[start_at:] + units[:start_at]
    count = 1 if variant == "single" else needles
    keys = rng.sample(KEYS, 1 if variant == "multivalue" else count)
    if variant == "multivalue":
        keys = keys * count
    values = [f"{rng.randrange(1_000_000, 10_000_000)}" for _ in range(count)]
    depths = [rng.random() for _ in range(count)]
    asked = keys[rng.randrange(count)] if variant == "multikey" else keys[0]
    intro = "Some special magic numbers are hidden inside the following text. Make sure to memorize them. I will quiz you about the numbers afterwards."
    if variant == "multivalue":
        question = f"What are all the special magic numbers for {asked} mentioned in the provided text?"
        prefix = f"The special magic numbers for {asked} mentioned in the provided text are"
    else:
        question = f"What is the special magic number for {asked} mentioned in the provided text?"
        prefix = f"The special magic number for {asked} mentioned in the provided text is"
    inserts = [(d, f"One of the special magic numbers for {k} is: {v}.") for d, k, v in zip(depths, keys, values)]

    def build(n_units: int):
        document, spans = _place(list((order * (n_units // len(order) + 1))[:n_units]), inserts, sep)
        placed = sorted(range(count), key=lambda i: spans[i][0])
        want = [values[i] for i in placed if keys[i] == asked]
        messages = _messages(setting, intro, document, question, f"{prefix} {', '.join(want)}.")
        off = len(intro) + 2
        labels = _labels(setting, prefix, n_units, [
            dict(key=keys[i], value=values[i], char_start=off + spans[i][0], char_end=off + spans[i][1], depth=spans[i][2], drawn_depth=depths[i])
            for i in placed
        ])
        labels.update(variant=variant, haystack=haystack, asked=asked)
        return messages, labels

    messages, labels = _fit(tokenizer, length, build)
    asked_values = [nd["value"] for nd in labels["needles"] if nd["key"] == asked]
    return _example("niah", seed, messages, labels, asked_values)


# --------------------------------------------------------------------------- scoring
def answer_values(text: str) -> list[str]:
    """The numbers a reply names, in order."""
    return re.findall(r"\d+", text or "")


def is_correct(example: Example, reply_text: str) -> bool:
    """Exact match: the first numbers the reply names are exactly the asked values,
    in document order (what the model says after them, often the needle's sentence
    repeated, is not scored)."""
    want = list(example.targets[0].values)
    return answer_values(reply_text)[: len(want)] == want


def _labels(setting: str, prefix: str, units: int, needles: list[dict]) -> dict:
    return {"setting": setting, "reply_prefix": prefix, "document_message": 0, "haystack_units": units, "needles": needles}


def _check(setting: str, length: int) -> None:
    if setting not in SETTINGS:
        raise ValueError(f"setting must be one of {SETTINGS}, got {setting!r}")
    if length < 128:
        raise ValueError(f"length must be at least 128 tokens, got {length}")
