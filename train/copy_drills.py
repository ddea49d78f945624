"""The synthetic copy drills: token sequences whose targets can only be predicted by
copying from earlier in the context (the formats of ``train.retrieval_probe``).

The trainer's warm-up (``train.embedded_model``'s raw needle batches) and the probe
both build their batches here, so neither imports the other. Pure Python and numpy
over a tokenizer: no model, no JAX.

Formats (``k``: a key identifier, ``v``: a value identifier, ``␣``: a space token of
the toy tokenizer, which makes every space its own token):

* ``repeat``: ``n`` random identifiers, then the same ``n`` again; every token of
  the second half is a target. Classic induction: the token before a target in
  the copy equals the token before it in the source, and it is distinctive.
* ``chunks``: random identifiers, then chunks of 3-8 of them copied from random
  places: content-based induction (``repeat`` can be solved by one head at a fixed
  offset, since both halves have the same length).
* ``general``: ``chunks`` over the whole task vocabulary (words, names,
  punctuation, identifiers), not only identifiers.
* ``needles``: needle sentences ("The special code for k ␣ is ␣ v .") among filler,
  then "Question:" and ``␣ k ␣ is ␣ v ,`` per needle; the value is the target. The
  key sits 3 tokens before the target in the answer and 4 before the value in the
  document: a second-order match, not classic induction.
* ``adjacent``: as ``needles`` but the needle ends "for k v ." and the answer is
  ``␣ k v ,``: classic induction, with one target per ~16 tokens.
* ``nospace``: ``needles`` with every space token removed ("for k is v ."), every
  needle asked: what a tokenizer whose words carry their spaces would give.
* ``mix``: half ``repeat``, half ``needles`` sequences; ``mix_adjacent`` and
  ``mix_nospace`` the same with ``adjacent`` / ``nospace`` (scored on that half);
  ``chunks_adjacent`` and ``chunks_nospace`` with ``chunks`` instead of ``repeat``.
"""

from __future__ import annotations

import random

import numpy as np

from jaxkv.tasks.words import IDENTIFIERS, KEY_POOL, VALUE_POOL, filler_sentence

FORMATS = (
    "repeat",
    "chunks",
    "general",
    "needles",
    "adjacent",
    "nospace",
    "mix",
    "mix_adjacent",
    "mix_nospace",
    "chunks_adjacent",
    "chunks_nospace",
)


class Formats:
    """Sequence builders: each returns ``(ids, mask)`` with ``mask[t] = 1`` where the
    token ``t + 1`` is a copy target."""

    def __init__(self, tokenizer, seq_len: int, pairs: int, filler: float):
        self.tok, self.T, self.pairs, self.filler = tokenizer, seq_len, pairs, filler
        self.space = self.enc(" ")[0]

    def enc(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def ids(self, *tokens: str) -> list[int]:
        return self.tok.convert_tokens_to_ids(list(tokens))

    def cut(self, ids, mask):
        return ids[: self.T], mask[: self.T]

    def repeat(self, rng):
        n = (self.T - 4) // 2
        items = self.ids(*(rng.choice(KEY_POOL + VALUE_POOL) for _ in range(n)))
        return self.cut(items + items, [0] * n + [1] * (n - 1) + [0])

    def chunks(self, rng):
        """``n`` random identifiers, then chunks of 3-8 of them copied from random
        places: the offset to the source changes from chunk to chunk, so only content
        (induction) predicts them, never a fixed relative position as in ``repeat``.
        A chunk's first token is not a target (nothing says where it starts)."""
        n = self.T // 3
        items = self.ids(*(rng.choice(KEY_POOL + VALUE_POOL) for _ in range(n)))
        ids, mask = list(items), [0] * n
        while len(ids) < self.T:
            length = rng.randint(3, 8)
            start = rng.randrange(n - length)
            ids += items[start : start + length]
            mask += [0] * (len(ids) - len(mask))
        return self.cut(ids, self._chunk_mask(ids, n))

    @staticmethod
    def _chunk_mask(ids, n):
        # mask[t] = 1 where token t+1 continues the chunk token t belongs to; chunks are
        # recognised by their source: token t+1 follows token t in the first n.
        follows = {(a, b) for a, b in zip(ids[: n - 1], ids[1:n])}
        return [int(t >= n and t + 1 < len(ids) and (ids[t], ids[t + 1]) in follows) for t in range(len(ids))]

    def general(self, rng):
        """``chunks`` over the whole task vocabulary (prose words with and without
        their space, project names, punctuation and identifiers): copying the token
        that followed the same context earlier, whatever kind of token it is, which
        is what every tool-call argument and quoted line of an agent trace needs."""
        words, identifiers = self._general_pool()
        n = self.T // 3
        items = [rng.choice(words if rng.random() < 0.6 else identifiers) for _ in range(n)]
        ids = list(items)
        while len(ids) < self.T:
            length = rng.randint(3, 8)
            start = rng.randrange(n - length)
            ids += items[start : start + length]
        return self.cut(ids, self._chunk_mask(ids, n))

    def _general_pool(self) -> tuple[list[int], list[int]]:
        """``(word ids, identifier ids)``: every token but specials, markers, bytes and
        single letters / digits, split so that words are drawn as often as identifiers."""
        if not hasattr(self, "_pool"):
            vocab = self.tok.get_vocab()
            keep = {t: i for t, i in vocab.items() if not t.startswith("<") and (len(t.strip()) > 1 or not t.strip().isalnum())}
            idents = {i for t, i in keep.items() if t in IDENTIFIERS}
            self._pool = (sorted(set(keep.values()) - idents), sorted(idents))
        return self._pool

    def _document(self, rng, needle):
        """Needles (``needle(k, v)`` ids) among filler sentences, up to 60% of ``T``."""
        keys, values = rng.sample(KEY_POOL, 60), rng.sample(VALUE_POOL, 60)
        ids, pairs = [], []
        while len(pairs) < min(self.pairs, 60):
            is_needle = rng.random() >= self.filler
            k, v = keys[len(pairs)], values[len(pairs)]
            piece = needle(k, v) if is_needle else self.enc(filler_sentence(rng) + " ")
            if len(ids) + len(piece) > self.T * 0.6:
                break
            ids += piece
            if is_needle:
                pairs.append((k, v))
        return ids, pairs

    def needles(self, rng):
        ids, pairs = self._document(rng, lambda k, v: self.enc(f"The special code for {k} is {v}. "))
        ids += self.enc("\nQuestion:")
        mask = [0] * len(ids)
        for k, v in rng.sample(pairs, len(pairs)):
            piece = self.enc(f" {k} is {v},")  # the value's token is the target
            value = self.ids(v)[0]
            ids += piece
            mask += [int(nxt == value) for nxt in piece[1:]] + [0]
        return self.cut(ids, mask)

    def adjacent(self, rng):
        dot = self.enc(".")[0]
        ids, pairs = self._document(rng, lambda k, v: self.enc("The special code for ") + self.ids(k, v) + [dot, self.space])
        ids += self.enc("\nQuestion:")
        mask = [0] * len(ids)
        for k, v in rng.sample(pairs, len(pairs)):
            ids += [self.space, *self.ids(k, v), self.enc(",")[0]]
            mask += [0, 1, 0, 0]
        return self.cut(ids, mask)

    def nospace(self, rng):
        strip = lambda text: [i for i in self.enc(text) if i != self.space]
        keys, values = rng.sample(KEY_POOL, self.pairs), rng.sample(VALUE_POOL, self.pairs)
        ids = [i for k, v in zip(keys, values) for i in strip(f"The special code for {k} is {v}.")]
        order = rng.sample(range(self.pairs), self.pairs)
        ids += strip("Question: What are the special codes for " + ", ".join(keys[i] for i in order) + "? Answer:")
        mask = [0] * len(ids)
        for i in order:
            ids += strip(f"{keys[i]} is {values[i]},")
            mask += [0, 1, 0, 0]
        return self.cut(ids, mask)

    def mix(self, rng):
        return self.repeat(rng) if rng.random() < 0.5 else self.needles(rng)

    def mix_adjacent(self, rng):
        return self.repeat(rng) if rng.random() < 0.5 else self.adjacent(rng)

    def mix_nospace(self, rng):
        return self.repeat(rng) if rng.random() < 0.5 else self.nospace(rng)

    def chunks_adjacent(self, rng):
        return self.chunks(rng) if rng.random() < 0.5 else self.adjacent(rng)

    def chunks_nospace(self, rng):
        return self.chunks(rng) if rng.random() < 0.5 else self.nospace(rng)


def raw_batch(builder, seed: int, batch: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens [B, T] int32, mask [B, T] float32)`` from ``builder(rng)`` (a ``Formats``
    method), seeded; padding is token 0 with mask 0."""
    rng = random.Random(seed)
    tokens = np.zeros((batch, seq_len), np.int32)
    mask = np.zeros((batch, seq_len), np.float32)
    for b in range(batch):
        ids, m = builder(rng)
        tokens[b, : len(ids)], mask[b, : len(m)] = ids, m
    return tokens, mask
