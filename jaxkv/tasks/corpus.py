"""The real text the real-model tasks are built from: it ships with Python.

No machine running jaxkv's evaluations reaches a dataset host, so the haystacks and
the ``lm`` stream come from the running interpreter: ``pydoc_data.topics`` and the
docstrings (prose) or source (code) of a fixed list of standard-library modules
(``CORPUS_MODULES``). ``jaxkv.tasks.haystack`` and ``jaxkv.tasks.multiq`` build
their examples from these units; ``eval/bench/peers.py`` takes real text of any
length from them.

Invariants: the corpus is a pure function of the Python version (fixed module
order, sorted names, each docstring once); no haystack line holds a run of five or
more digits or the needles' words (``BANNED``), so a needle's value can only come
from its needle; token counts are cached per tokenizer (weakly) and never change
the text.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import warnings
import weakref

import numpy as np

HAYSTACKS = ("prose", "code")

# Standard-library modules whose docstrings (prose) or source (code) make the haystacks,
# in a fixed order so that a seed means the same text on every machine with one Python.
CORPUS_MODULES = (
    "argparse",
    "bisect",
    "calendar",
    "collections",
    "configparser",
    "contextlib",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "email.message",
    "enum",
    "fractions",
    "functools",
    "gzip",
    "heapq",
    "http.client",
    "inspect",
    "ipaddress",
    "json",
    "logging",
    "mailbox",
    "pathlib",
    "pickle",
    "pprint",
    "queue",
    "random",
    "shutil",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "tokenize",
    "typing",
    "unittest",
    "urllib.parse",
    "uuid",
    "warnings",
    "weakref",
    "zipfile",
)
# What no haystack line may hold: a needle's digit run or its words.
BANNED = re.compile(r"\d{5,}|magic number|pass ?key", re.IGNORECASE)


@functools.lru_cache(maxsize=None)
def prose_documents() -> tuple[str, ...]:
    """The prose corpus: every ``pydoc_data.topics`` topic (sorted by name), then the
    docstrings of ``CORPUS_MODULES`` (each module's, then its own public classes,
    their public methods and its functions, sorted by name; each text once)."""
    from pydoc_data.topics import topics

    docs = [topics[k].strip("\n") for k in sorted(topics)]
    seen: set[str] = set()
    for name in CORPUS_MODULES:
        module = importlib.import_module(name)
        objs = [module]
        with warnings.catch_warnings():  # typing's deprecated aliases warn when read
            warnings.simplefilter("ignore", DeprecationWarning)
            namespace = dict(vars(module))
        for attr in sorted(namespace):
            obj = namespace[attr]
            if attr.startswith("_") or getattr(obj, "__module__", None) != name:
                continue
            if inspect.isclass(obj) or inspect.isfunction(obj):
                objs.append(obj)
                if inspect.isclass(obj):
                    objs += [f for a, f in sorted(vars(obj).items()) if not a.startswith("_") and inspect.isfunction(f)]
        for obj in objs:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                doc = inspect.getdoc(obj)
            if doc and doc not in seen:
                seen.add(doc)
                docs.append(doc.strip("\n"))
    return tuple(docs)


@functools.lru_cache(maxsize=None)
def haystack_lines(haystack: str = "prose") -> tuple[str, ...]:
    """The niah haystack as lines, in corpus order: the prose documents (a blank line
    after each) or the modules' source; lines with a run of 5+ digits or the needles'
    words are left out."""
    if haystack == "prose":
        lines = [line for doc in prose_documents() for line in doc.split("\n") + [""]]
    elif haystack == "code":
        lines = [line for name in CORPUS_MODULES for line in inspect.getsource(importlib.import_module(name)).split("\n")]
    else:
        raise ValueError(f"haystack must be one of {HAYSTACKS}, got {haystack!r}")
    return tuple(line.rstrip() for line in lines if not BANNED.search(line))


_counts_cache: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _per_tokenizer(tokenizer) -> dict:
    try:
        return _counts_cache.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable: no cache
        return {}


def line_tokens(tokenizer, haystack: str) -> np.ndarray:
    """Tokens of each haystack line with its newline (an estimate for fitting lengths)."""
    cache = _per_tokenizer(tokenizer)
    if ("lines", haystack) not in cache:
        ids = tokenizer([line + "\n" for line in haystack_lines(haystack)], add_special_tokens=False)["input_ids"]
        cache[("lines", haystack)] = np.asarray([len(x) for x in ids], np.int64)
    return cache[("lines", haystack)]


def corpus_ids(tokenizer) -> np.ndarray:
    """The prose corpus tokenized raw (each document with a blank line after it),
    concatenated: the ``lm`` task's token stream."""
    cache = _per_tokenizer(tokenizer)
    if "corpus" not in cache:
        ids = tokenizer([d + "\n\n" for d in prose_documents()], add_special_tokens=False, verbose=False)["input_ids"]
        cache["corpus"] = np.concatenate([np.asarray(x, np.int32) for x in ids])
    return cache["corpus"]
