"""Loading a checkpoint folder's tokenizer (transformers') without importing torch
when the folder does not need it.

``transformers.AutoTokenizer`` imports torch when torch is installed (its config
machinery does), 4-5 s of CPU in every process that loads a model: ``jaxkv serve``'s
start-up, each worker of an evaluation, each subprocess of the test suite. A folder
whose ``tokenizer_config.json`` names transformers' generic fast tokenizer
(``TokenizersBackend``, which ``PreTrainedTokenizerFast`` names too) needs none of
that: ``AutoTokenizer`` would resolve the name to that class and call its
``from_pretrained``, which is what ``folder_tokenizer`` calls directly. Every other
folder (a model-specific class, or no class named) goes through ``AutoTokenizer``.

Invariant: ``folder_tokenizer(folder)`` returns the tokenizer ``AutoTokenizer`` returns
for the folder, of the same class, with the same vocabulary, special tokens and chat
template (``tests/test_chat_render.py::test_folder_tokenizer_skips_auto_tokenizer_only_for_the_generic_class``).
"""

from __future__ import annotations

import json
from pathlib import Path

GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def named_class(folder: Path) -> str | None:
    """The ``tokenizer_class`` of ``folder/tokenizer_config.json``; None without one."""
    path = Path(folder) / "tokenizer_config.json"
    try:
        return json.loads(path.read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None


def folder_tokenizer(folder: Path | str):
    """transformers' tokenizer of ``folder`` (see the module docstring for the class)."""
    folder = Path(folder)
    if named_class(folder) in GENERIC_CLASSES and (folder / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(folder))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))
