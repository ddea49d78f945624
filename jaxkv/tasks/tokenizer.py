"""The embedded model's tokenizer, built from the task vocabulary.

``embedded_tokenizer()`` is the toy word-level tokenizer (``jaxkv.chat.toy``) over
every word the task generators emit plus the words of the Qwen3-format chat
template; prose words carry their leading space, identifiers and project names
(``words.UNSPACED_WORDS``) are one token of their own. It is what the shipped
embedded model was trained with, what ``jaxkv demo`` uses to build a random
stand-in model, and what the trainers import.
"""

from __future__ import annotations

import re

from jaxkv.chat.toy import QWEN3_CHAT_TEMPLATE, build_tokenizer
from jaxkv.tasks.words import UNSPACED_WORDS, vocabulary


def template_words(template: str = QWEN3_CHAT_TEMPLATE) -> list[str]:
    """Words inside the string literals of a chat template (role names, tool preamble)."""
    literals = re.findall(r"'((?:[^'\\]|\\.)*)'|\"((?:[^\"\\]|\\.)*)\"", template)
    text = " ".join(a or b for a, b in literals)
    return [w for w in dict.fromkeys(re.findall(r"[A-Za-z_]\w*", text)) if len(w) > 1]


def embedded_tokenizer(save_dir=None):
    """The toy tokenizer over the task vocabulary and the template's words, prose words
    carrying their leading space (``build_tokenizer(spaced_words=...)``): a word after a
    space is one token, an identifier or project name (``UNSPACED_WORDS``) stays one
    token of its own (the same in prose and in JSON arguments), so a value sits three
    tokens after its key (``k1`` ``:`` ``␣`` ``v1``) instead of four or five."""
    words = list(dict.fromkeys(vocabulary() + template_words()))
    return build_tokenizer(words, save_dir=save_dir, spaced_words=[w for w in words if w not in UNSPACED_WORDS])
