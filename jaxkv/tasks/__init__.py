"""Synthetic, seeded tasks for multi-turn agent KV-cache experiments.

* ``agent_traces``: tool-using agent conversations whose later calls and final answer
  copy identifiers from tool responses several turns back.
* ``mqniah``: split-query multi-query needle-in-a-haystack (RepairKV §4.1).
* ``shared_docs``: agent sessions of one tenant opening documents of a shared
  corpus (the same text at many positions): the segment-reuse workload.
* ``embedded_tokenizer``: the word-level tokenizer of the embedded model.

Every generator returns ``Example`` records (messages, tools, scored turns with
evidence spans, labels); ``vocabulary()`` lists every prose word they emit, for
``jaxkv.chat.toy.build_tokenizer``. They live in the package because the demo,
the trainers and the evaluation all use them; ``eval.tasks`` re-exports them.
"""

from jaxkv.tasks.agent import agent_traces
from jaxkv.tasks.example import Evidence, Example, ScoredTurn, approx_tokens
from jaxkv.tasks.mqniah import NEEDLE_COUNTS, mqniah
from jaxkv.tasks.shared_docs import shared_corpus, shared_docs
from jaxkv.tasks.tokenizer import embedded_tokenizer, template_words
from jaxkv.tasks.words import vocabulary

__all__ = [
    "Evidence",
    "Example",
    "NEEDLE_COUNTS",
    "ScoredTurn",
    "agent_traces",
    "approx_tokens",
    "embedded_tokenizer",
    "mqniah",
    "shared_corpus",
    "shared_docs",
    "template_words",
    "vocabulary",
]
