"""Real-model long-context tasks (issue #32): passkey, RULER-style needles, and LM continuation.

The synthetic tasks (``agent``, ``mqniah``) speak the embedded model's word-level
vocabulary. These are for pretrained models: every generator takes the model's
tokenizer, and ``length`` is measured in that tokenizer's tokens, so jaxkv and a
peer library (kvpress) consume the very same ids (``token_plan``).

* ``passkey``: a 5-digit key (first digit nonzero) in the repeated noise filler
  ``PASSKEY_FILLER``, inserted at a sentence boundary at a depth drawn uniformly in
  [0, 1]; the question asks for the key.
* ``niah``: RULER-style needles ("One of the special magic numbers for Lisbon is:
  4512907.") in a haystack of real text that ships with Python (``haystack="prose"``:
  the reference topics of ``pydoc_data.topics`` then the docstrings of a fixed list
  of standard-library modules; ``haystack="code"``: the source of the same modules),
  inserted at line boundaries. Variants (``VARIANTS``): ``single`` (one needle,
  asked), ``multikey`` (``NEEDLES`` needles with distinct keys, one asked; the
  distractor keys are never asked), ``multivalue`` (``NEEDLES`` needles of one key
  with distinct values, all asked; the answer lists them in document order).
* ``lm``: a window of the prose corpus tokenized raw (no chat template):
  ``context_ids`` is exactly ``length`` tokens and ``target_ids`` the next
  ``continuation`` tokens.

Two settings (``SETTINGS``), as kvpress's ``query_aware`` true/false:

* ``"aware"``: document and question in one user message, so the question is in
  the observation window when the request is compressed;
* ``"agnostic"``: the document is the first user message, ``ACK`` the first
  assistant reply, the question the second user message: the cache is compressed
  when turn 1 ends, before the question exists (the case RepairKV exists for).

Invariants (``tests/test_haystack_tasks.py``):

* deterministic: example ``i`` of a call is a function of ``example_seed(seed, i)``
  and the other arguments (``lm``: of ``seed`` and ``i``, since its windows are drawn
  jointly so that they never overlap within a call; a longer call extends a shorter
  one);
* passkey/niah: the aware compressed request (``token_plan(ex, tok, "aware").compressed``)
  is within ``LENGTH_TOLERANCE`` of ``length``; lm: ``len(context_ids) == length``;
* every needle's ``labels["needles"][k]`` has ``document[char_start:char_end] ==`` its
  sentence; ``depth`` is the drawn depth and ``position`` the realised one: the
  fraction of the haystack's own text (the other needles excluded) before the
  needle, within half a haystack unit (a line, a filler sentence) of ``depth``;
* every value is a whole digit run of the document, and no haystack text holds a
  run of five or more digits, so a value can only come from its needle.

The documents start with a short instruction (``labels["body_start"]`` is where the
haystack begins), as RULER's and kvpress's contexts do. The body is
``labels["haystack_units"]`` consecutive units of ``haystack_units(labels["haystack"])``
(cyclically, from unit ``labels.get("first_line", 0)``) with each needle at the unit
boundary nearest its depth. ``reply_prefix`` is the reference reply up to its first
value ("The pass key is"): a reply started with it names the value next. Every
question asks for the number only: SmolLM2-135M-Instruct, asked "What is the pass
key?" after the document's turn, says what a pass key is instead of naming it (0 of
6 examples with the full cache; 6 of 6 with the instruction). The texts are
read from the running interpreter, so they are the same for a given Python version.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import re
from typing import NamedTuple

import numpy as np

from jaxkv.errors import ChatError
from jaxkv.tasks.corpus import HAYSTACKS, corpus_ids, haystack_lines, line_tokens
from jaxkv.tasks.example import example_seed

SETTINGS = ("aware", "agnostic")
ACK = "I have read the document."
TASKS = ("passkey", "niah_single", "niah_multikey", "niah_multivalue", "lm")
VARIANTS = ("single", "multikey", "multivalue")
NEEDLES = 4  # needles of a multikey / multivalue example
LENGTH_TOLERANCE = 0.02
CONTINUATION = 256
LM_WINDOWS = 50  # windows the lm corpus must hold at any length (the issues' 50 per cell; lm_windows)

PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PASSKEY_INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about the important information there."
)
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = "What is the pass key? Answer with the number only."
# Reference replies: a sentence ending in the value(s), as RULER's answer prefixes
# have it, so teacher forcing scores the digits where the model says them (asked for
# the number only, SmolLM2 still answers "The pass key is 58203."; without the
# instruction it rambles about what a pass key is).
PASSKEY_ANSWER = "The pass key is {key}."

NIAH_INTRO = (
    "Some special magic numbers are hidden within the following text. "
    "Make sure to memorize it. I will quiz you about the numbers afterwards."
)
NIAH_NEEDLE = "One of the special magic numbers for {key} is: {value}."
NIAH_QUESTION = "What is the special magic number for {key} mentioned in the provided text? Answer with the number only."
NIAH_QUESTION_ALL = (
    "What are all the special magic numbers for {key} mentioned in the provided text? Answer with the numbers only, separated by commas."
)
NIAH_ANSWER = "The special magic number for {key} is {values}."
NIAH_ANSWER_ALL = "The special magic numbers for {key} are {values}."

# Needle keys: one-word city names, each a distinct key.
KEYS = tuple(
    """
Lisbon Nairobi Osaka Quito Reykjavik Tbilisi Hanoi Lima Oslo Dakar Montreal Bergen Cusco Porto Seville
Tallinn Valparaiso Zanzibar Kyoto Marrakesh Adelaide Bogota Cairo Dublin Edinburgh Florence Geneva Havana
Istanbul Jakarta Kigali Lagos Manila Naples Ottawa Prague Riga Santiago Tunis Utrecht Vienna Windhoek
Yerevan Zagreb Athens Berlin Boston Budapest Chicago Copenhagen Denver Seattle Helsinki Houston Madrid
Melbourne Milan Munich Nagoya Perth Phoenix Rotterdam Salzburg Seoul Shanghai Stockholm Sydney Taipei
Tehran Toronto Vancouver Warsaw Zurich Accra Amman Antwerp Baghdad Bangkok Barcelona Beirut Belgrade
Bratislava Brisbane Brussels Bucharest Calgary Casablanca Dallas Damascus Delhi Doha Dubai Glasgow
Hamburg Kabul Karachi Kampala Krakow Lyon Mumbai Beijing
""".split()
)


# The evaluation seed base of every real-model report (jaxkv and kvpress sides):
# disjoint from the training (< 2**30), held-out (+3e6), calibration (+7e6) and
# agent-evaluation (+9e6) seed ranges used elsewhere in this repository.
EVAL_SEED = (1 << 30) + 11_000_000


# --------------------------------------------------------------------------- the record
@dataclasses.dataclass(frozen=True)
class HaystackExample:
    """One real-model example (see the module docstring).

    Attributes:
      task: one of ``TASKS``.
      seed: per-example seed (``example_seed(batch_seed, i)``).
      length: target tokens (passkey/niah: the aware compressed request; lm: the context).
      document: the haystack with its needles (lm: the context text).
      question: the question ("" for lm).
      answer: the reference reply, a sentence ending in the values ("The pass key is 58203.",
        "The special magic numbers for Lima are 1234567, 7654321."; lm: the continuation text).
      values: the digit strings the reply must contain, in document order (lm: ()).
      labels: ``{"needles": [{"key", "value", "char_start", "char_end", "depth",
        "position", "asked"}], "body_start", "prompt_tokens", ...}``; lm: the window.
      context_ids, target_ids: lm only: the context and the scored continuation tokens.
    """

    task: str
    seed: int
    length: int
    document: str
    question: str
    answer: str
    values: tuple[str, ...]
    labels: dict
    context_ids: tuple[int, ...] = ()
    target_ids: tuple[int, ...] = ()

    def messages(self, setting: str) -> list[dict]:
        """The conversation in ``setting``, the reference answer as its last message."""
        if self.task == "lm":
            raise ValueError("the lm task has no chat form; use context_ids and target_ids")
        if setting == "aware":
            return [{"role": "user", "content": f"{self.document}\n\n{self.question}"}, {"role": "assistant", "content": self.answer}]
        if setting == "agnostic":
            return [
                {"role": "user", "content": self.document},
                {"role": "assistant", "content": ACK},
                {"role": "user", "content": self.question},
                {"role": "assistant", "content": self.answer},
            ]
        raise ValueError(f"setting must be one of {SETTINGS}, got {setting!r}")


class TokenPlan(NamedTuple):
    """The ids of one example in one setting (``np.int32`` arrays): ``compressed`` is the
    request compressed once, ``rest`` what is fed after it before the answer (the
    acknowledgement and the question in the agnostic setting; empty when aware),
    ``answer`` the reference answer's tokens (no end-of-turn marker)."""

    compressed: np.ndarray
    rest: np.ndarray
    answer: np.ndarray


def token_plan(example: HaystackExample, tokenizer, setting: str) -> TokenPlan:
    """``TokenPlan`` of ``example``: each part renders with ``jaxkv.chat.render.render``
    and extends the previous one token for token (ChatML templates do); a template
    that does not raises ``ChatError``."""
    if example.task == "lm":
        return TokenPlan(np.asarray(example.context_ids, np.int32), np.zeros(0, np.int32), np.asarray(example.target_ids, np.int32))
    from jaxkv.chat.render import render

    messages = example.messages(setting)
    compressed = render(tokenizer, messages[:1], add_generation_prompt=True)
    prompt = render(tokenizer, messages[:-1], add_generation_prompt=True) if len(messages) > 2 else compressed
    full = render(tokenizer, messages, add_generation_prompt=False)
    _extends(compressed.ids, prompt.ids, "the compressed request", f"the {setting} prompt up to the answer")
    _extends(prompt.ids, full.ids, f"the {setting} prompt", "the conversation with its answer")
    if not full.text.startswith(prompt.text):
        raise ChatError(f"the chat template's text of the {setting} prompt is not a prefix of the conversation's")
    cut = full.text.index(example.answer, len(prompt.text)) + len(example.answer)
    upto = np.asarray(tokenizer(full.text[:cut], add_special_tokens=False)["input_ids"], np.int32)
    _extends(prompt.ids, upto, f"the {setting} prompt", "the conversation up to the answer text")
    _extends(upto, full.ids, "the conversation up to the answer text", "the whole conversation")
    return TokenPlan(compressed.ids, prompt.ids[compressed.ids.size :], upto[prompt.ids.size :])


def _extends(prefix: np.ndarray, ids: np.ndarray, what: str, of: str) -> None:
    if ids.size < prefix.size or not np.array_equal(ids[: prefix.size], prefix):
        at = next((i for i in range(min(prefix.size, ids.size)) if prefix[i] != ids[i]), min(prefix.size, ids.size))
        raise ChatError(
            f"{what} ({prefix.size} tokens) is not a token prefix of {of} ({ids.size} tokens): they differ "
            f"at token {at}; this chat template (or tokenizer) does not extend a conversation token for token"
        )


# --------------------------------------------------------------------------- scoring
def reply_correct(example: HaystackExample, text: str) -> bool:
    """Greedy exact match: every value is a whole digit run of ``text``; with one value,
    the reply's first digit run is that value ("12345" and "The key is 12345." are
    right for 12345, "123456" is not)."""
    if not example.values:
        raise ValueError(f"the {example.task} task has no values to match")
    runs = re.findall(r"\d+", text or "")
    if len(example.values) == 1:
        return bool(runs) and runs[0] == example.values[0]
    return all(v in runs for v in example.values)


def reply_prefix(example: HaystackExample) -> str:
    """The reference reply up to its first value, without the space before it ("The pass
    key is", "The special magic number for Lima is"): the start of a reply that a small
    model, forced to continue it, completes with the value (``Session.chat(...,
    reply_prefix=)``), so greedy exact match reads the digits where teacher forcing scores them."""
    if not example.values:
        raise ValueError(f"the {example.task} task has no values to prefix")
    return example.answer[: example.answer.index(example.values[0])].rstrip()


def answer_digit_positions(example: HaystackExample, tokenizer, answer_ids) -> np.ndarray:
    """Indices into ``answer_ids`` (``token_plan(...).answer``) whose tokens hold a digit:
    the tokens the teacher-forced score (argmax, NLL) is taken on."""
    del example  # the same rule for every task
    return np.asarray(
        [i for i, t in enumerate(np.asarray(answer_ids).tolist()) if any(c.isdigit() for c in tokenizer.decode([t]))], np.int64
    )


# --------------------------------------------------------------------------- corpora
def haystack_units(haystack: str = "prose") -> tuple[tuple[str, ...], str]:
    """The units a haystack is made of, in order, and the separator that joins them:
    ``"prose"`` and ``"code"``: the niah lines (``haystack_lines``) joined by newlines;
    ``"filler"``: the sentences of ``PASSKEY_FILLER`` joined by spaces (passkey cycles
    them). ``labels["haystack"]`` names an example's haystack. Also real text of any
    length for a workload that needs some (``eval/bench/peers.py``)."""
    if haystack == "filler":
        return tuple(s.strip() for s in re.findall(r"[^.]+\.", PASSKEY_FILLER)), " "
    return haystack_lines(haystack), "\n"


# --------------------------------------------------------------------------- building
def _place(units: list[str], sep: str, needles: list[tuple[float, str]]) -> tuple[str, list[tuple[int, int, float]]]:
    """Join ``units`` with ``sep``, each needle at the unit boundary nearest its depth
    (the fraction of the units' own text before it). Returns the text and, per needle,
    ``(char_start, char_end, position)``; needles at one boundary keep their order."""
    starts = np.cumsum([0] + [len(u) + len(sep) for u in units])[:-1] if units else np.zeros(0, np.int64)
    total = len(sep.join(units))
    bounds = np.append(starts, total)  # boundary j: before unit j; the last is the end
    at: dict[int, list[int]] = {}
    where = []
    for i, (depth, _) in enumerate(needles):
        j = int(np.argmin(np.abs(bounds - depth * total)))
        at.setdefault(j, []).append(i)
        where.append(j)
    pieces, spans, pos = [], [None] * len(needles), 0
    for j in range(len(units) + 1):
        for i in at.get(j, ()):
            pos += len(sep) if pieces else 0
            spans[i] = (pos, pos + len(needles[i][1]), float(bounds[j]) / max(total, 1))
            pieces.append(needles[i][1])
            pos += len(needles[i][1])
        if j < len(units):
            pos += len(sep) if pieces else 0
            pieces.append(units[j])
            pos += len(units[j])
    return sep.join(pieces), spans


def _fit(tokenizer, length: int, unit_tokens: np.ndarray, build) -> tuple[dict, int]:
    """The unit count whose ``build(k) -> fields`` gives an aware compressed request
    closest to ``length`` tokens: estimate from ``unit_tokens`` (the tokens of unit i),
    render, correct by the miss, then bisect the bracket (about 5-10 renders).
    Raises ``_NoFit`` when no count is within ``LENGTH_TOLERANCE``."""
    from jaxkv.chat.render import render

    cum = np.cumsum(unit_tokens)
    tried: dict[int, tuple[dict, int]] = {}

    def measure(k: int) -> int:
        if k not in tried:
            fields = build(k)
            user = f"{fields['document']}\n\n{fields['question']}"
            tried[k] = (fields, int(render(tokenizer, [{"role": "user", "content": user}]).ids.size))
        return tried[k][1]

    lo, hi = 0, len(cum)  # measure(lo) < length <= measure(hi) once both are known
    body = length - measure(0)
    for _ in range(24):
        k = int(np.searchsorted(cum, max(body, 0)))
        if not lo < k < hi or k in tried:
            if hi - lo <= 1:
                break
            k = (lo + hi) // 2
        n = measure(k)
        if abs(n - length) <= max(1, length // 400):
            break
        lo, hi = (k, hi) if n < length else (lo, k)
        body += length - n
    fields, n = min(tried.values(), key=lambda fn: abs(fn[1] - length))
    if abs(n - length) > LENGTH_TOLERANCE * length:
        raise _NoFit(f"could not fit {length} tokens within {LENGTH_TOLERANCE:.0%} (closest: {n})")
    return fields, n


class _NoFit(ValueError):
    pass


def _check_length(length: int) -> None:
    if length < 256:
        raise ValueError(f"length must be at least 256 tokens, got {length}")


# --------------------------------------------------------------------------- passkey
def passkey(n: int, *, length: int, seed: int, tokenizer) -> list[HaystackExample]:
    """``n`` passkey examples whose aware request is ``length`` tokens (module docstring)."""
    _check_length(length)
    return [_one_passkey(example_seed(seed, i), length, tokenizer) for i in range(n)]


def _one_passkey(seed: int, length: int, tokenizer) -> HaystackExample:
    rng = random.Random(seed)
    key = str(rng.randrange(10_000, 100_000))
    depth = rng.random()
    needle = PASSKEY_NEEDLE.format(key=key)
    sentences, sep = haystack_units("filler")
    per = np.asarray([len(x) for x in tokenizer([" " + s for s in sentences], add_special_tokens=False)["input_ids"]])
    body_start = len(PASSKEY_INTRO) + 2
    cycles = length // int(per.sum()) + 2

    def build(k: int) -> dict:
        body, spans = _place([sentences[i % len(sentences)] for i in range(k)], sep, [(depth, needle)])
        start, end, position = spans[0]
        label = dict(
            key="pass key", value=key, char_start=body_start + start, char_end=body_start + end, depth=depth, position=position, asked=True
        )
        return dict(document=f"{PASSKEY_INTRO}\n\n{body}", question=PASSKEY_QUESTION, needles=[label], units=k)

    fields, n = _fit(tokenizer, length, np.tile(per, cycles), build)
    labels = {
        "needles": fields["needles"],
        "body_start": body_start,
        "haystack": "filler",
        "haystack_units": fields["units"],
        "prompt_tokens": n,
    }
    return HaystackExample("passkey", seed, length, fields["document"], fields["question"], PASSKEY_ANSWER.format(key=key), (key,), labels)


# --------------------------------------------------------------------------- niah
def niah(n: int, *, length: int, seed: int, tokenizer, variant: str | None = None, haystack: str = "prose") -> list[HaystackExample]:
    """``n`` RULER-style needle examples whose aware request is ``length`` tokens.

    ``variant``: one of ``VARIANTS``, or None for ``VARIANTS[i % 3]`` in example ``i``;
    ``haystack``: ``"prose"`` (default) or ``"code"`` (module docstring)."""
    _check_length(length)
    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS} or None, got {variant!r}")
    if haystack not in HAYSTACKS:
        raise ValueError(f"haystack must be one of {HAYSTACKS}, got {haystack!r}")
    return [_one_niah(example_seed(seed, i), length, tokenizer, variant or VARIANTS[i % len(VARIANTS)], haystack) for i in range(n)]


def _one_niah(seed: int, length: int, tokenizer, variant: str, haystack: str) -> HaystackExample:
    rng = random.Random(seed)
    (lines, sep), counts = haystack_units(haystack), line_tokens(tokenizer, haystack)
    first = rng.randrange(len(lines))
    count = 1 if variant == "single" else NEEDLES
    keys = rng.sample(KEYS, 1 if variant == "multivalue" else count)
    keys = keys * count if variant == "multivalue" else keys
    values = rng.sample(range(1_000_000, 10_000_000), count)
    values = [str(v) for v in values]
    depths = [rng.random() for _ in range(count)]
    asked = keys[rng.randrange(count)]
    question = (NIAH_QUESTION_ALL if variant == "multivalue" else NIAH_QUESTION).format(key=asked)
    needles = [NIAH_NEEDLE.format(key=k, value=v) for k, v in zip(keys, values)]
    body_start = len(NIAH_INTRO) + 2
    span = min(len(lines), int(3 * length / max(counts.mean(), 1)) + 200)  # lines enough for any request

    def build(k: int, shift: int) -> dict:
        units = [lines[(first + shift + i) % len(lines)] for i in range(k)]
        body, spans = _place(units, sep, list(zip(depths, needles)))
        order = sorted(range(count), key=lambda i: spans[i][0])
        labels = [
            dict(
                key=keys[i],
                value=values[i],
                char_start=body_start + spans[i][0],
                char_end=body_start + spans[i][1],
                depth=depths[i],
                position=spans[i][2],
                asked=keys[i] == asked,
            )
            for i in order
        ]
        return dict(document=f"{NIAH_INTRO}\n\n{body}", question=question, needles=labels, units=k, first=first + shift)

    # A window whose every cut misses the tolerance (a long digit-heavy line at its
    # end) starts one line later instead: deterministic, and rare.
    for shift in range(64):
        try:
            window = np.arange(first + shift, first + shift + span) % len(lines)
            fields, n = _fit(tokenizer, length, counts[window], functools.partial(build, shift=shift))
            break
        except _NoFit as error:
            last = error
    else:
        raise ValueError(f"{last}, from any of 64 starting lines") from last
    found = tuple(nd["value"] for nd in fields["needles"] if nd["asked"])
    labels = {
        "needles": fields["needles"],
        "variant": variant,
        "asked_key": asked,
        "body_start": body_start,
        "haystack": haystack,
        "first_line": fields["first"] % len(lines),
        "haystack_units": fields["units"],
        "prompt_tokens": n,
    }
    answer = (NIAH_ANSWER_ALL if variant == "multivalue" else NIAH_ANSWER).format(key=asked, values=", ".join(found))
    return HaystackExample(f"niah_{variant}", seed, length, fields["document"], question, answer, found, labels)


# --------------------------------------------------------------------------- lm
def lm_windows(corpus_tokens: int, width: int) -> list[int]:
    """Start offsets of the ``lm`` windows of ``width`` tokens in a corpus of
    ``corpus_tokens``: consecutive (never overlapping) while the corpus holds
    ``LM_WINDOWS`` of them; beyond that length they start every
    ``(corpus_tokens - width) // (LM_WINDOWS - 1)`` tokens, overlapping just enough
    for the corpus to hold ``LM_WINDOWS`` (the prose corpus, 187,829 SmolLM2 tokens,
    holds 81 consecutive windows of 2,048 + 256 but 43 of 4,096 + 256). A window's
    continuation never overlaps another's, since the stride stays above
    ``CONTINUATION`` for any context the corpus can hold 50 of. The offsets depend on
    the corpus and the width only, never on how many examples are drawn."""
    if corpus_tokens < width:
        return []
    stride = width
    if corpus_tokens // width < LM_WINDOWS:
        stride = max(1, (corpus_tokens - width) // (LM_WINDOWS - 1))
    return list(range(0, corpus_tokens - width + 1, stride))


def lm_text(n: int, *, length: int, seed: int, tokenizer, continuation: int = CONTINUATION) -> list[HaystackExample]:
    """``n`` continuation examples: ``length`` context tokens of the prose corpus and the
    next ``continuation`` tokens to score. The corpus is cut into windows of
    ``length + continuation`` tokens (``lm_windows``: consecutive where the corpus
    holds ``LM_WINDOWS`` of them, else overlapping) and example ``i`` takes the
    ``i``-th window of a shuffle drawn from ``seed``, so no window repeats within a
    call; raises ``ValueError`` when the corpus holds fewer than ``n`` windows."""
    if length < 1 or continuation < 1:
        raise ValueError(f"length and continuation must be positive, got {length} and {continuation}")
    ids = corpus_ids(tokenizer)
    width = length + continuation
    starts = lm_windows(int(ids.size), width)
    if n > len(starts):
        raise ValueError(f"the corpus ({ids.size} tokens) holds {len(starts)} windows of {width} tokens, fewer than {n}")
    slots = list(range(len(starts)))
    random.Random(seed).shuffle(slots)
    out = []
    for i in range(n):
        start = starts[slots[i]]
        context, target = ids[start : start + length], ids[start + length : start + width]
        labels = {"token_start": start, "window": slots[i], "corpus_tokens": int(ids.size)}
        out.append(
            HaystackExample(
                "lm",
                example_seed(seed, i),
                length,
                tokenizer.decode(context.tolist()),
                "",
                tokenizer.decode(target.tolist()),
                (),
                labels,
                tuple(context.tolist()),
                tuple(target.tolist()),
            )
        )
    return out


def examples(task: str, n: int, *, length: int, tokenizer, seed: int | None = None) -> list[HaystackExample]:
    """The evaluation examples of ``task`` (``passkey``, ``niah`` with the variants
    in turn, ``niah_<variant>``, ``lm``) drawn from ``seed`` (default ``EVAL_SEED``):
    what every side of a real-model report runs. Example ``i`` does not depend on ``n``."""
    seed = EVAL_SEED if seed is None else int(seed)
    if task == "passkey":
        return passkey(n, length=length, seed=seed, tokenizer=tokenizer)
    if task == "niah" or task.startswith("niah_"):
        variant = None if task == "niah" else task.split("_", 1)[1]
        if variant is not None and variant not in VARIANTS:
            raise ValueError(f"unknown niah variant {variant!r}; known: {', '.join(VARIANTS)}")
        return niah(n, length=length, seed=seed, tokenizer=tokenizer, variant=variant)
    if task == "lm":
        return lm_text(n, length=length, seed=seed, tokenizer=tokenizer)
    raise ValueError(f"unknown task {task!r}; known: passkey, niah, {', '.join('niah_' + v for v in VARIANTS)}, lm")


REPLY_SLACK = 8  # a greedy reply may run this many tokens past the reference reply
REPLY_CAP = 48  # ... and never more (a multivalue reply names four 7-digit values)


def reply_budget(plan: TokenPlan, cap: int = REPLY_CAP) -> int:
    """Tokens a greedy reply may take on every side of a report: the reference
    reply's length plus ``REPLY_SLACK``, at most ``cap``. A reply that has not
    named the values by then is wrong anyway (``reply_correct`` reads the first
    digit run), and a cell that rambles would otherwise decode to the cap."""
    return min(int(cap), int(np.asarray(plan.answer).size) + REPLY_SLACK)
