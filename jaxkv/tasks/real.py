"""The real-model tasks by name: what every harness that runs them asks for.

jaxkv's grid (``eval.quality.real_model``) and kvpress's side
(``eval.quality.kvpress_side``) run the same examples and score the same ids
through these three functions, whatever the task:

* ``examples(task, n, length=, tokenizer=, seed=)``: ``passkey``, ``niah``,
  ``niah_<variant>`` and ``lm`` from ``jaxkv.tasks.haystack``, ``multiq`` from
  ``jaxkv.tasks.multiq``; ``seed`` None is each module's own ``EVAL_SEED``;
* ``plans(example, tokenizer, setting)``: one ``TokenPlan`` per scored answer (a
  haystack example has one; a multiq example one per question, sharing the
  compressed request);
* ``views(example)``: the ``HaystackExample`` each plan is scored against
  (``reply_correct``, ``answer_digit_positions``), in the plans' order.
"""

from __future__ import annotations

from jaxkv.tasks import haystack, multiq

TASKS = ("passkey", "niah", "niah_single", "niah_multikey", "niah_multivalue", "lm", multiq.TASK)


def examples(task: str, n: int, *, length: int, tokenizer, seed: int | None = None) -> list:
    """The evaluation examples of ``task`` (module docstring); example ``i`` does not depend on ``n``."""
    if task == multiq.TASK:
        return multiq.examples(n, length=length, tokenizer=tokenizer, seed=seed)
    return haystack.examples(task, n, length=length, tokenizer=tokenizer, seed=seed)


def plans(example, tokenizer, setting: str) -> list[haystack.TokenPlan]:
    """One ``TokenPlan`` per scored answer of ``example`` in ``setting``."""
    if example.task == multiq.TASK:
        return multiq.token_plans(example, tokenizer, setting)
    return [haystack.token_plan(example, tokenizer, setting)]


def views(example) -> list:
    """What each of ``plans(example, ...)`` is scored against."""
    return example.views() if example.task == multiq.TASK else [example]
