"""Several questions over one shared context (SCBench-style, issue #75): ``multiq``.

One long document of real prose (the ``niah`` haystack: the text that ships with
Python, ``jaxkv.tasks.haystack``) holds facts of three kinds, and a conversation
asks about them one question per turn, each question in its own later turn:

* ``number``: a RULER needle, "One of the special magic numbers for Lisbon is:
  4512907." (7 digits), asked by its key;
* ``passkey``: "The pass key is 58203. Remember it." (5 digits; the key once);
* ``pair``: a fact with two keys, "The vault code of the amber falcon is 391207."
  (6 digits), asked by both; the document also holds a fact of the same colour and
  another animal and one of the same animal and another colour, so one key alone
  does not find it.

Every example also holds ``DISTRACTORS`` number needles whose keys are never asked.
An example asks ``questions`` facts (4 to 8, default ``QUESTIONS``): one passkey,
``max(1, questions // 4)`` pairs, the rest numbers, in a random order.

The protocol it is made for (``docs/evaluation.md``): the cache is compressed once,
when the context's turn ends, and every later question is answered from that one
cache; between questions the conversation goes on with the reference answers
(teacher-forced history, SCBench's multi-turn mode), and a repair stage may promote
rows at each turn boundary. Two settings, as the haystack tasks have them:

* ``"agnostic"``: the document is the first user message, ``haystack.ACK`` the first
  reply, then question 1, answer 1, question 2, ...: no question exists when the
  cache is compressed;
* ``"aware"``: the document and question 1 are the first user message, then answer
  1, question 2, ...: question 1 is in the compressed request, the others are not
  (the case KVzip's authors show query-aware methods failing on).

``token_plans(example, tokenizer, setting)`` gives one ``haystack.TokenPlan`` per
question, built by ``haystack.token_plan`` on the question's view
(``MultiQExample.view``): ``compressed`` (the same for every question), ``rest`` (all
that is fed after it up to question ``q``'s answer: the acknowledgement, the earlier
questions and their reference answers, question ``q``'s turn) and ``answer``. Plan
``q + 1``'s ``rest`` extends plan ``q``'s ``rest + answer`` token for token, so a
harness feeds the conversation once (``new_rest``) and both jaxkv and kvpress score
the same ids. A question's view is a ``haystack.HaystackExample``, so
``haystack.reply_correct``, ``reply_prefix`` and ``answer_digit_positions`` score it.

Invariants (``tests/test_multiq_task.py``):

* deterministic: example ``i`` is a function of ``example_seed(seed, i)`` and the
  other arguments; ``EVAL_SEED``'s examples are disjoint from the training seeds
  (below ``2**30``) and from the haystack tasks' evaluation examples;
* the aware compressed request (document and question 1) is within
  ``haystack.LENGTH_TOLERANCE`` of ``length`` tokens, as the haystack tasks' is;
* every fact's value is a whole digit run of the document exactly once, and in no
  question; the questions are distinct; every asked key is in the document;
* ``labels["facts"]`` lists every fact in document order with its kind, keys, value,
  span (``document[char_start:char_end]`` is its sentence), drawn ``depth`` and
  realised ``position``, and ``question`` (its index in the conversation, or None
  for a distractor).
"""

from __future__ import annotations

import dataclasses
import functools
import random

import numpy as np

from jaxkv.errors import ChatError
from jaxkv.tasks import haystack
from jaxkv.tasks.example import example_seed
from jaxkv.tasks.corpus import line_tokens
from jaxkv.tasks.haystack import (
    ACK,
    KEYS,
    NIAH_ANSWER,
    NIAH_NEEDLE,
    NIAH_QUESTION,
    PASSKEY_ANSWER,
    PASSKEY_QUESTION,
    SETTINGS,
    HaystackExample,
    TokenPlan,
    _fit,
    _NoFit,
    _place,
)

TASK = "multiq"
QUESTIONS = 6
QUESTION_COUNTS = range(4, 9)
DISTRACTORS = 2  # number needles never asked
KINDS = ("number", "passkey", "pair")
# The evaluation seed base of both sides: 100 above the haystack tasks' (example
# seeds ~1e8 apart), above every training seed (< 2**30).
EVAL_SEED = haystack.EVAL_SEED + 100

INTRO = (
    "Some special numbers are hidden within the following text: magic numbers, a pass key and vault codes. "
    "Make sure to memorize them. I will quiz you about them afterwards."
)
PASSKEY_NEEDLE = "The pass key is {value}. Remember it."
PAIR_NEEDLE = "The vault code of the {key} is {value}."
PAIR_QUESTION = "What is the vault code of the {key} mentioned in the provided text? Answer with the number only."
PAIR_ANSWER = "The vault code of the {key} is {value}."
COLOURS = tuple("amber azure crimson golden ivory jade silver violet scarlet copper indigo olive".split())
ANIMALS = tuple("falcon otter badger heron lynx walrus bison gecko marten ibis osprey tapir".split())
DIGITS = {"number": 7, "passkey": 5, "pair": 6}


@dataclasses.dataclass(frozen=True)
class QuestionView(HaystackExample):
    """One question of a ``MultiQExample`` as a ``HaystackExample``: ``question``,
    ``answer`` and ``values`` are this question's; ``history`` the ``(question,
    answer)`` pairs asked before it, which ``messages`` replays with their reference
    answers. ``haystack.token_plan`` renders it like any haystack example."""

    history: tuple = ()

    def messages(self, setting: str) -> list[dict]:
        turns = [*self.history, (self.question, self.answer)]
        if setting == "aware":
            (q1, a1), later = turns[0], turns[1:]
            out = [{"role": "user", "content": f"{self.document}\n\n{q1}"}, {"role": "assistant", "content": a1}]
        elif setting == "agnostic":
            later = turns
            out = [{"role": "user", "content": self.document}, {"role": "assistant", "content": ACK}]
        else:
            raise ValueError(f"setting must be one of {SETTINGS}, got {setting!r}")
        for q, a in later:
            out += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        return out


@dataclasses.dataclass(frozen=True)
class MultiQExample:
    """One document and the questions asked about it, in conversation order.

    Attributes:
      task: ``"multiq"``.
      seed: per-example seed (``example_seed(batch_seed, i)``).
      length: target tokens of the aware compressed request (document and question 1).
      document: the prose with its facts.
      questions: the questions, in the order the conversation asks them.
      answers: the reference reply of each ("The pass key is 58203.").
      values: per question, the digit strings its reply must contain (one each).
      labels: ``{"facts": [...], "body_start", "haystack", "first_line",
        "haystack_units", "prompt_tokens", "kinds"}`` (module docstring).
    """

    task: str
    seed: int
    length: int
    document: str
    questions: tuple[str, ...]
    answers: tuple[str, ...]
    values: tuple[tuple[str, ...], ...]
    labels: dict

    def view(self, q: int) -> QuestionView:
        """Question ``q`` (0-based) as a ``HaystackExample`` whose conversation runs
        through its answer, the earlier questions answered by their references."""
        if not 0 <= q < len(self.questions):
            raise IndexError(f"question {q} of {len(self.questions)}")
        labels = dict(self.labels, question=q, kind=self.labels["kinds"][q])
        return QuestionView(
            self.task,
            self.seed,
            self.length,
            self.document,
            self.questions[q],
            self.answers[q],
            self.values[q],
            labels,
            history=tuple(zip(self.questions[:q], self.answers[:q])),
        )

    def views(self) -> list[QuestionView]:
        return [self.view(q) for q in range(len(self.questions))]

    def messages(self, setting: str) -> list[dict]:
        """The whole conversation in ``setting``, every reference answer in it."""
        return self.view(len(self.questions) - 1).messages(setting)


def token_plans(example: MultiQExample, tokenizer, setting: str) -> list[TokenPlan]:
    """One ``TokenPlan`` per question (module docstring): the same ``compressed``
    request, then ``rest`` (the conversation after it up to the question's answer) and
    the ``answer``. Raises ``ChatError`` where plan ``q + 1`` does not extend plan
    ``q``'s ``rest + answer`` (a template that rewrites earlier turns)."""
    plans = [haystack.token_plan(v, tokenizer, setting) for v in example.views()]
    for q in range(1, len(plans)):
        before = np.concatenate([plans[q - 1].rest, plans[q - 1].answer])
        if not np.array_equal(plans[q].compressed, plans[0].compressed):
            raise ChatError(f"question {q}'s compressed request differs from question 0's")
        if plans[q].rest.size < before.size or not np.array_equal(plans[q].rest[: before.size], before):
            raise ChatError(f"question {q}'s conversation does not extend question {q - 1}'s rest and answer token for token")
    return plans


def new_rest(plans: list[TokenPlan], q: int) -> np.ndarray:
    """The tokens to feed before question ``q``'s answer once question ``q - 1``'s
    answer (teacher forced) is in the cache: ``plans[q].rest`` past ``plans[q - 1]``'s
    rest and answer (for ``q == 0``, all of ``plans[0].rest``)."""
    if q == 0:
        return plans[0].rest
    return plans[q].rest[plans[q - 1].rest.size + plans[q - 1].answer.size :]


def cell_record(per_question: list[dict], kinds) -> dict:
    """One cell's record of an example, the same on every harness: each question's
    scores (``questions``, in conversation order, each with its fact's ``kind``) and,
    as the cell's own ``tf_correct`` / ``gen_correct`` / ``answer_nll``, their means
    over the questions (the share of the example's questions answered right), which
    a report reads as it reads a one-question cell's verdicts."""
    per_question = [dict(q, kind=k) for q, k in zip(per_question, kinds, strict=True)]

    def mean(key):
        return round(float(np.mean([float(q[key]) for q in per_question])), 5)

    return {
        "tf_correct": mean("tf_correct"),
        "gen_correct": mean("gen_correct"),
        "answer_nll": mean("answer_nll"),
        "questions": per_question,
    }


# --------------------------------------------------------------------------- building
def examples(n: int, *, length: int, tokenizer, seed: int | None = None, questions: int = QUESTIONS) -> list[MultiQExample]:
    """``n`` examples whose aware request is ``length`` tokens, drawn from ``seed``
    (default ``EVAL_SEED``); example ``i`` does not depend on ``n``."""
    haystack._check_length(length)
    if questions not in QUESTION_COUNTS:
        raise ValueError(f"questions must be in {QUESTION_COUNTS.start}..{QUESTION_COUNTS.stop - 1}, got {questions}")
    seed = EVAL_SEED if seed is None else int(seed)
    return [one_example(example_seed(seed, i), length, tokenizer, questions) for i in range(n)]


def _facts(rng: random.Random, questions: int) -> tuple[list[dict], list[str]]:
    """The facts of one example (each with ``question``: its index in the
    conversation, None for a distractor) and the kind each question asks."""
    n_pair = max(1, questions // 4)
    kinds = ["passkey"] + ["pair"] * n_pair + ["number"] * (questions - 1 - n_pair)
    rng.shuffle(kinds)
    n_number = kinds.count("number") + DISTRACTORS
    cities = rng.sample(KEYS, n_number)
    colours = rng.sample(COLOURS, 2 * n_pair)
    animals = rng.sample(ANIMALS, 2 * n_pair)
    draws = {k: iter(rng.sample(range(10 ** (d - 1), 10**d), n_number + 3 * n_pair + 1)) for k, d in DIGITS.items()}
    facts, pair_i, city_i = [], 0, 0
    for q, kind in enumerate(kinds):
        if kind == "pair":
            colour, animal = colours[2 * pair_i], animals[2 * pair_i]
            other_c, other_a = colours[2 * pair_i + 1], animals[2 * pair_i + 1]
            pair_i += 1
            facts.append(dict(kind="pair", key=f"{colour} {animal}", question=q))
            # the same colour with another animal, the same animal with another colour: never asked
            facts += [
                dict(kind="pair", key=f"{colour} {other_a}", question=None),
                dict(kind="pair", key=f"{other_c} {animal}", question=None),
            ]
        elif kind == "number":
            facts.append(dict(kind="number", key=cities[city_i], question=q))
            city_i += 1
        else:
            facts.append(dict(kind="passkey", key="pass key", question=q))
    facts += [dict(kind="number", key=cities[city_i + j], question=None) for j in range(DISTRACTORS)]
    for f in facts:
        f["value"] = str(next(draws[f["kind"]]))
        f["depth"] = rng.random()
    return facts, kinds


def _sentence(fact: dict) -> str:
    if fact["kind"] == "number":
        return NIAH_NEEDLE.format(key=fact["key"], value=fact["value"])
    if fact["kind"] == "passkey":
        return PASSKEY_NEEDLE.format(value=fact["value"])
    return PAIR_NEEDLE.format(key=fact["key"], value=fact["value"])


def _question_and_answer(fact: dict) -> tuple[str, str]:
    if fact["kind"] == "number":
        return NIAH_QUESTION.format(key=fact["key"]), NIAH_ANSWER.format(key=fact["key"], values=fact["value"])
    if fact["kind"] == "passkey":
        return PASSKEY_QUESTION, PASSKEY_ANSWER.format(key=fact["value"])
    return PAIR_QUESTION.format(key=fact["key"]), PAIR_ANSWER.format(key=fact["key"], value=fact["value"])


def one_example(seed: int, length: int, tokenizer, questions: int = QUESTIONS) -> MultiQExample:
    """One example (module docstring) from its own ``seed``."""
    rng = random.Random(seed)
    lines, sep = haystack.haystack_units("prose")
    counts = line_tokens(tokenizer, "prose")
    first = rng.randrange(len(lines))
    facts, kinds = _facts(rng, questions)
    by_question = sorted((f for f in facts if f["question"] is not None), key=lambda f: f["question"])
    asked_qa = [_question_and_answer(f) for f in by_question]
    needles = [(f["depth"], _sentence(f)) for f in facts]
    body_start = len(INTRO) + 2
    span = min(len(lines), int(3 * length / max(counts.mean(), 1)) + 200)

    def build(k: int, shift: int) -> dict:
        units = [lines[(first + shift + i) % len(lines)] for i in range(k)]
        body, spans = _place(units, sep, needles)
        labels = [dict(f, char_start=body_start + s[0], char_end=body_start + s[1], position=s[2]) for f, s in zip(facts, spans)]
        labels.sort(key=lambda f: f["char_start"])
        return dict(document=f"{INTRO}\n\n{body}", question=asked_qa[0][0], facts=labels, units=k, first=first + shift)

    for shift in range(64):  # as haystack's niah: a window no cut of which fits starts one line later
        try:
            window = np.arange(first + shift, first + shift + span) % len(lines)
            fields, n = _fit(tokenizer, length, counts[window], functools.partial(build, shift=shift))
            break
        except _NoFit as error:
            last = error
    else:
        raise ValueError(f"{last}, from any of 64 starting lines") from last
    labels = {
        "facts": fields["facts"],
        "kinds": tuple(kinds),
        "body_start": body_start,
        "haystack": "prose",
        "first_line": fields["first"] % len(lines),
        "haystack_units": fields["units"],
        "prompt_tokens": n,
    }
    return MultiQExample(
        TASK,
        seed,
        length,
        fields["document"],
        tuple(q for q, _ in asked_qa),
        tuple(a for _, a in asked_qa),
        tuple((f["value"],) for f in by_question),
        labels,
    )
