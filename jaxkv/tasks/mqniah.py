"""Split-query multi-query needle-in-a-haystack (MQ-NIAH, RepairKV §4.1).

One example: a long distractor document in the first user message holding ``needles``
key-value needles ("The special code for k173 is v032.") among filler sentences and
distractor needles (same sentence, keys never asked). Turn 1 asks for one subset of
the keys, turn 2 (a second user message, after the turn-1 answer) for the rest. The
answer, with no reasoning, is one ``k173 is v032`` line per key asked: each value
follows its key as in the needle, and each key follows the previous one as in the
question.

Split rule (no recency shortcut): order the needles by position; the
``max(1, needles // 4)`` needles nearest the end of the document are always asked in
turn 1, so turn-2 keys are never the tail needles. The rest is split at random so that
each turn asks ``needles // 2`` keys.

Labels: ``labels["needles"]`` lists, in document order, ``{"key", "value", "turn",
"char_start", "char_end", "depth"}`` where the span indexes the first user message's
content and covers the needle sentence, and ``depth`` in [0, 1] is its relative
position in the document.

``length`` is the target rendered length in tokens (``approx_tokens``); the number of
distractor needles defaults to one per 128 tokens (capped by the identifier pools).

Repeated shifts (``turns=5``, RepairKV §5.3; the schedule is this project's choice,
the paper does not print its own): the needles form four groups of ``needles // 4``,
group 1 the tail needles, groups 2-4 the rest at random; the five turns ask groups 1, 2, 3, 2, 4
(group 2 is revisited after a shift away from it). Every group has ``needles // 4``
keys, so ``turns=5`` needs ``needles`` in {4, 8}; ``labels["turn_keys"]`` lists the
keys of every turn and ``needles[i]["turn"]`` is the first turn asking needle i.
"""

from __future__ import annotations

import random

from jaxkv.tasks.example import Example, IdentifierPool, approx_tokens, conversation_tokens, example_seed, join_list, scored
from jaxkv.tasks.words import SYSTEM_PLAIN, filler_sentence

NEEDLE_COUNTS = (2, 4, 6, 8)
TURN_COUNTS = (2, 5)
REVISIT_SCHEDULE = (0, 1, 2, 1, 3)  # turns=5: the group each turn asks
NEEDLE_TEMPLATE = "The special code for {key} is {value}."
INTRO = "Read the document below and answer the questions about it."


def _question(keys: list[str]) -> str:
    # "of" (the needles say "for"): the first key asked follows a cue no needle has.
    return f"Question: What are the special codes of {join_list(keys)}? Answer one key per line."


def _answer(keys: list[str], value_of: dict[str, str]) -> str:
    # One "k1 is v1" line per key, in the question's order: the tokens before each
    # value repeat the needle's ("... for k1 is v1."), so finding the value is
    # matching the key and copying what follows it, and each key follows the
    # previous one as in the question, four tokens back.
    return "\n".join(f"{k} is {value_of[k]}" for k in keys)


def split_turns(n_needles: int, rng: random.Random) -> list[int]:
    """Turn (1 or 2) of each needle, needles in document order (see module docstring)."""
    tail = max(1, n_needles // 4)
    head = list(range(n_needles - tail))
    turn2 = set(rng.sample(head, n_needles // 2))
    return [2 if i in turn2 else 1 for i in range(n_needles)]


def revisit_groups(n_needles: int, rng: random.Random) -> list[int]:
    """Group (0..3) of each needle, needles in document order: group 0 holds the tail."""
    size = n_needles // 4
    order = list(range(n_needles - size))
    rng.shuffle(order)
    groups = [0] * n_needles
    for rank, i in enumerate(order):
        groups[i] = 1 + rank // size
    return groups


def one_mqniah(seed: int, needles: int = 4, length: int = 2048, distractor_needles: int | None = None, turns: int = 2) -> Example:
    """One split-query MQ-NIAH example (see the module docstring)."""
    if needles not in NEEDLE_COUNTS:
        raise ValueError(f"needles must be one of {NEEDLE_COUNTS}, got {needles}")
    if turns not in TURN_COUNTS:
        raise ValueError(f"turns must be one of {TURN_COUNTS}, got {turns}")
    if turns == 5 and needles % 4:
        raise ValueError(f"turns=5 splits the needles into 4 equal groups; needles must be 4 or 8, got {needles}")
    rng = random.Random(seed)
    ids = IdentifierPool(rng)
    n_distractor_needles = length // 128 if distractor_needles is None else distractor_needles
    n_distractor_needles = min(n_distractor_needles, ids.left("k") - needles, ids.left("v") - needles)

    keys = [ids.key() for _ in range(needles)]
    value_of = {k: ids.value() for k in keys}
    if turns == 2:
        needle_turn = split_turns(needles, rng)
        asks = [[k for k, t in zip(keys, needle_turn) if t == turn] for turn in (1, 2)]
    else:
        groups = revisit_groups(needles, rng)
        members = [[k for k, g in zip(keys, groups) if g == group] for group in range(4)]
        asks = [list(members[g]) for g in REVISIT_SCHEDULE]
        needle_turn = [1 + REVISIT_SCHEDULE.index(g) for g in groups]
    for ask in asks:
        rng.shuffle(ask)
    ask1, ask2 = asks[0], asks[1]

    def messages_for(document: str) -> list[dict]:
        messages = [{"role": "system", "content": SYSTEM_PLAIN}]
        for t, ask in enumerate(asks):
            question = _question(ask)
            messages.append({"role": "user", "content": f"{INTRO}\n\n{document}\n\n{question}" if t == 0 else question})
            messages.append({"role": "assistant", "content": _answer(ask, value_of)})
        return messages

    # Document: filler sentences; needles and distractor needles inserted between them.
    distractors = [NEEDLE_TEMPLATE.format(key=ids.key(), value=ids.value()) for _ in range(n_distractor_needles)]
    budget = length - conversation_tokens(messages_for(""), [])
    # sentences are joined by one space, which the next sentence's first word carries
    budget -= sum(approx_tokens(" " + s) for s in distractors)
    budget -= needles * approx_tokens(" " + NEEDLE_TEMPLATE.format(key="k123", value="v123"))
    sentences = []
    while budget > 0:
        sentences.append(filler_sentence(rng))
        budget -= approx_tokens(" " + sentences[-1])
    for s in distractors:
        sentences.insert(rng.randint(0, len(sentences)), s)
    # Needle slots: distinct positions in the filler, sorted so keys[i] is the i-th needle.
    slots = sorted(rng.sample(range(len(sentences) + needles), needles))
    is_needle = {slot: keys[i] for i, slot in enumerate(slots)}
    body, filler = [], iter(sentences)
    for pos in range(len(sentences) + needles):
        body.append(NEEDLE_TEMPLATE.format(key=is_needle[pos], value=value_of[is_needle[pos]]) if pos in is_needle else next(filler))

    document = " ".join(body)
    messages = messages_for(document)
    offset = len(INTRO) + 2
    needle_labels = []
    for i, k in enumerate(keys):
        sentence = NEEDLE_TEMPLATE.format(key=k, value=value_of[k])
        start = offset + document.index(sentence)
        needle_labels.append(
            {
                "key": k,
                "value": value_of[k],
                "turn": needle_turn[i],
                "char_start": start,
                "char_end": start + len(sentence),
                "depth": document.index(sentence) / len(document),
            }
        )
    targets = [
        scored(messages, 2 + 2 * t, "answer", messages[2 + 2 * t]["content"], [value_of[k] for k in ask]) for t, ask in enumerate(asks)
    ]
    labels = {
        "needles": needle_labels,
        "turn1_keys": ask1,
        "turn2_keys": ask2,
        "turn_keys": asks,
        "distractor_needles": n_distractor_needles,
    }
    return Example("mqniah", seed, messages, [], targets, labels)


def mqniah(n: int, seed: int, needles: int = 4, length: int = 2048, distractor_needles: int | None = None, turns: int = 2) -> list[Example]:
    """``n`` split-query MQ-NIAH examples with ``needles`` in {2, 4, 6, 8} needles.

    Args:
      n: number of examples.
      seed: batch seed; example ``i`` uses ``example_seed(seed, i)``.
      needles: key-value needles per document; each turn asks half of them.
      length: target rendered length in toy-tokenizer tokens.
      distractor_needles: needle-shaped sentences with keys never asked
        (default ``length // 128``).
      turns: 2 (split query) or 5 (the repeated-shift schedule of the module docstring).
    """
    return [one_mqniah(example_seed(seed, i), needles, length, distractor_needles, turns) for i in range(n)]
