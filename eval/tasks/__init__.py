"""Synthetic, seeded tasks for multi-turn agent KV-cache experiments.

* ``agent_traces``: tool-using agent conversations whose later calls and final answer
  copy identifiers from tool responses several turns back.
* ``mqniah``: split-query multi-query needle-in-a-haystack (RepairKV §4.1).

Every generator returns ``Example`` records (messages, tools, scored turns with
evidence spans, labels); ``vocabulary()`` lists every prose word they emit, for
``jaxkv.chat.toy.build_tokenizer``.
"""

from eval.tasks.agent import agent_traces
from eval.tasks.example import Evidence, Example, ScoredTurn, approx_tokens
from eval.tasks.mqniah import NEEDLE_COUNTS, mqniah
from eval.tasks.words import vocabulary

__all__ = [
    "Evidence",
    "Example",
    "NEEDLE_COUNTS",
    "ScoredTurn",
    "agent_traces",
    "approx_tokens",
    "mqniah",
    "vocabulary",
]
