"""Synthetic, seeded tasks for multi-turn agent KV-cache experiments.

* ``agent_traces``: tool-using agent conversations whose later calls and final answer
  copy identifiers from tool responses several turns back.
* ``mqniah``: split-query multi-query needle-in-a-haystack (RepairKV §4.1).
* ``shared_docs``: agent sessions of one tenant opening documents of a shared
  corpus (the same text at many positions): the segment-reuse workload.
* ``embedded_tokenizer``: the word-level tokenizer of the embedded model.
* ``haystack``: real-model tasks in the model's own tokens (issue #32): ``passkey``,
  RULER-style ``niah`` over text that ships with Python, and ``lm_text``
  continuation windows, as ``HaystackExample`` records; ``token_plan`` gives the
  exact ids (compressed request, rest, answer) in the question-aware or -agnostic
  setting, so jaxkv and kvpress score the same tokens; ``reply_prefix`` and
  ``reply_correct`` start and score a greedy reply.
* ``seeds``: the seed bases of the held-out evaluation sets (``EVAL_SEED_BASE``, ...).
* ``multiq``: several questions, one per later turn, over one shared document of
  real prose (SCBench-style, issue #75); ``multiq.token_plans`` gives one
  ``TokenPlan`` per question, all sharing the compressed request.

The synthetic generators return ``Example`` records (messages, tools, scored turns with
evidence spans, labels), and ``reply_matches`` is a scored turn's exact-match rule;
``vocabulary()`` lists every prose word they emit, for ``jaxkv.chat.toy.build_tokenizer``. They live in the package because the demo,
the trainers and the evaluation all use them.
"""

from jaxkv.tasks.agent import agent_traces
from jaxkv.tasks.example import Evidence, Example, ScoredTurn, approx_tokens, reply_matches
from jaxkv.tasks.haystack import (
    HaystackExample,
    TokenPlan,
    answer_digit_positions,
    lm_text,
    niah,
    passkey,
    reply_correct,
    reply_prefix,
    token_plan,
)
from jaxkv.tasks.mqniah import NEEDLE_COUNTS, mqniah
from jaxkv.tasks import multiq
from jaxkv.tasks.shared_docs import shared_corpus, shared_docs
from jaxkv.tasks.tokenizer import embedded_tokenizer, template_words
from jaxkv.tasks.words import vocabulary

__all__ = [
    "Evidence",
    "Example",
    "HaystackExample",
    "NEEDLE_COUNTS",
    "ScoredTurn",
    "TokenPlan",
    "agent_traces",
    "answer_digit_positions",
    "approx_tokens",
    "embedded_tokenizer",
    "lm_text",
    "mqniah",
    "multiq",
    "niah",
    "passkey",
    "reply_correct",
    "reply_matches",
    "reply_prefix",
    "shared_corpus",
    "shared_docs",
    "template_words",
    "token_plan",
    "vocabulary",
]
