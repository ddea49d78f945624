"""One request's per-position host record: the engine row's mirror and its tags.

Every fact jaxkv keeps about a position of a running request lives here, in
arrays of one length (the row's ``seq_len``), so that one operation re-indexes
all of them when a compact layout renumbers the request:

Attributes:
  tokens: ``list[int]`` token id at each position (-1 where a prefix was
    installed without its tokens, e.g. by a test).
  slots: ``list[int]`` position -> pool slot; ``SENTINEL_SLOT`` marks a hole (a
    position evicted by slot-map eviction, or cached as a hole by the radix tree).
  live: ``list[int]`` the live-index list: the non-sentinel slots, in position
    order. With one keep set for the model every layer's attention reads exactly
    these.
  layer_live: None (every layer reads ``live``), or bool ``[L, P]``: per-layer
    keep sets (``keep_sets="layer"``), position ``p`` is read by layer ``l`` iff
    ``layer_live[l, p]``. A position stays in the slot map (``live``) while any
    layer reads it, so ``live`` is the union of the layers' lists; a hole is read
    by no layer. ``layer_lists(J)`` gives each layer's list of slots.
  phase: int32 ``[P]`` AgentKV phase of each position (``jaxkv.chat.Phase``).
  pinned: bool ``[P]`` positions every kept set must contain (the protected
    prefix and, unless a session says otherwise, the actionable query).
  query: bool ``[P]`` positions inside the current turn's actionable query span
    (IntentKV's K̄_Q reads them, whether pinned or not).
  mass: float32 ``[P]`` attention mass each position has received over the
    session so far (mean over layers and query heads, summed over query rows): H2O's
    score.
  renumbered: how many compact layouts renumbered the positions (0: the positions
    are the rendered conversation's, so the request may enter the radix cache).
  allocated: fresh slots the engine handed to this request (admission control
    compares it with the request's reservation).

Invariants (``check``): every per-position field has ``seq_len`` entries;
``live`` equals the non-sentinel entries of ``slots`` in position order; the
sentinel is never live; with ``layer_live``, a position is in some layer's list
iff it is not a hole (new tokens and promoted rows join every layer's list). The engine is the only writer of ``slots``/``live``
(it mirrors them on the device); the pipeline writes the tags.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from jaxkv.cache.allocator import SENTINEL_SLOT
from jaxkv.errors import RepairError


class RequestState:
    """Host state of one engine row (see the module docstring)."""

    def __init__(self, slots: Sequence[int] = (), tokens: Sequence[int] | None = None):
        slots = [int(s) for s in slots]
        self.slots: list[int] = slots
        self.live: list[int] = [s for s in slots if s != SENTINEL_SLOT]
        self.tokens: list[int] = [int(t) for t in tokens] if tokens is not None else [-1] * len(slots)
        if len(self.tokens) != len(slots):
            raise ValueError(f"{len(self.tokens)} tokens for {len(slots)} slots")
        n = len(slots)
        self.phase = np.zeros(n, np.int32)
        self.pinned = np.zeros(n, bool)
        self.query = np.zeros(n, bool)
        self.mass = np.zeros(n, np.float32)
        self.layer_live: np.ndarray | None = None
        self.renumbered = 0
        self.allocated = 0

    # -- reading -----------------------------------------------------------------
    @property
    def seq_len(self) -> int:
        return len(self.slots)

    def owned(self) -> np.ndarray:
        """Slots this row holds a reference on (its non-sentinel positions)."""
        s = np.asarray(self.slots, dtype=np.int64)
        return s[s != SENTINEL_SLOT]

    def live_positions(self) -> np.ndarray:
        """Positions of the live entries, in live-list order (= position order)."""
        return np.flatnonzero(np.asarray(self.slots, np.int64) != SENTINEL_SLOT)

    def is_live(self, position: int) -> bool:
        return 0 <= position < len(self.slots) and self.slots[position] != SENTINEL_SLOT

    def layer_mask(self, num_layers: int) -> np.ndarray:
        """bool ``[num_layers, seq_len]``: which positions each layer reads (every
        live position in every layer when the row keeps one set for the model)."""
        if self.layer_live is not None:
            return self.layer_live.copy()
        live = np.asarray(self.slots, np.int64) != SENTINEL_SLOT
        return np.broadcast_to(live, (num_layers, live.size)).copy()

    def reads_per_layer(self) -> int:
        """Keys a layer's attention reads, averaged over layers and rounded (the
        live length without per-layer sets): what decode reads, where ``live``
        counts the slots held."""
        if self.layer_live is None:
            return len(self.live)
        return int(round(float(self.layer_live.sum(axis=1).mean())))

    def layer_lists(self, lists: int) -> list[list[int]]:
        """The slot list each of ``lists`` live lists holds (``J``, see
        ``jaxkv.cache.state``): list ``j`` is what layer ``j`` reads (the last one
        serving every layer past it); every list is ``live`` without per-layer sets."""
        if self.layer_live is None:
            return [list(self.live)] * lists
        if lists < self.layer_live.shape[0]:
            if lists == 1 and self.layer_live.all(axis=0)[np.asarray(self.slots, np.int64) != SENTINEL_SLOT].all():
                return [list(self.live)]
            raise ValueError(f"a row with per-layer keep sets of {self.layer_live.shape[0]} layers needs that many live lists, not {lists}")
        slots = np.asarray(self.slots, np.int64)
        return [slots[m].tolist() for m in self.layer_live]

    def layer_positions(self, lists: int) -> list[np.ndarray]:
        """Positions of each of ``lists`` live lists' entries, in list order."""
        if self.layer_live is None:
            return [self.live_positions()] * lists
        return [np.flatnonzero(m) for m in self.layer_live]

    def set_layer_live(self, mask_LP) -> None:
        """Per-layer keep sets for the current positions (None: one set for the
        model). Holes are read by no layer; a live position no layer reads is an
        error (a layout takes it out of the slot map instead)."""
        if mask_LP is None:
            self.layer_live = None
            return
        mask = np.asarray(mask_LP, bool)
        if mask.ndim != 2 or mask.shape[1] != len(self.slots):
            raise ValueError(f"per-layer keep sets of shape {mask.shape} for a request of {len(self.slots)} positions")
        live = np.asarray(self.slots, np.int64) != SENTINEL_SLOT
        if (mask & ~live[None]).any():
            raise ValueError("a layer's keep set holds a hole")
        if (live & ~mask.any(axis=0)).any():
            raise ValueError("a live position is read by no layer (evict it from the slot map)")
        self.layer_live = mask.copy()

    # -- growing (engine) ------------------------------------------------------------
    def append(self, tokens: Sequence[int], slots: Sequence[int]) -> None:
        """New positions at the end: their tokens and slots (untagged: phase 0,
        not pinned, no mass; the pipeline tags them)."""
        tokens, slots = [int(t) for t in tokens], [int(s) for s in slots]
        if len(tokens) != len(slots):
            raise ValueError(f"{len(tokens)} tokens for {len(slots)} slots")
        self.tokens += tokens
        self.slots += slots
        self.live += [s for s in slots if s != SENTINEL_SLOT]
        n = len(tokens)
        if self.layer_live is not None:  # new tokens are read by every layer
            new = np.asarray(slots, np.int64) != SENTINEL_SLOT
            self.layer_live = np.concatenate([self.layer_live, np.broadcast_to(new, (self.layer_live.shape[0], n))], axis=1)
        self.phase = np.concatenate([self.phase, np.zeros(n, np.int32)])
        self.pinned = np.concatenate([self.pinned, np.zeros(n, bool)])
        self.query = np.concatenate([self.query, np.zeros(n, bool)])
        self.mass = np.concatenate([self.mass, np.zeros(n, np.float32)])

    def set_tables(self, slots: Sequence[int], live: Sequence[int]) -> None:
        """New slot map and live list for the same positions (dead-slot eviction,
        promotion)."""
        if len(slots) != len(self.slots):
            raise ValueError(f"slot map of {len(slots)} positions for a request of {len(self.slots)}")
        if self.layer_live is not None:  # holes leave every layer; filled holes (promotion) join every layer
            was = np.asarray(self.slots, np.int64) != SENTINEL_SLOT
            now = np.asarray(slots, np.int64) != SENTINEL_SLOT
            self.layer_live = (self.layer_live & now[None]) | (now & ~was)[None]
        self.slots, self.live = [int(s) for s in slots], [int(s) for s in live]

    # -- the one re-indexing operation -------------------------------------------------
    def reindex(self, kept_positions, slots: Sequence[int], live: Sequence[int]) -> None:
        """Renumber the request: position ``i`` afterwards is ``kept_positions[i]``
        before (a compact layout). Every per-position field follows."""
        kept = np.asarray(kept_positions, np.int64)
        if len(slots) != kept.size:
            raise ValueError(f"{len(slots)} slots for {kept.size} kept positions")
        self.tokens = [self.tokens[p] for p in kept]
        self.phase, self.pinned, self.query, self.mass = self.phase[kept], self.pinned[kept], self.query[kept], self.mass[kept]
        if self.layer_live is not None:
            self.layer_live = self.layer_live[:, kept]
        self.slots, self.live = [int(s) for s in slots], [int(s) for s in live]
        self.renumbered += 1

    def truncate(self, length: int) -> np.ndarray:
        """Forget positions ``>= length``; returns the slots they held (sentinels dropped)."""
        dropped = np.asarray(self.slots[length:], np.int64)
        dropped = dropped[dropped != SENTINEL_SLOT]
        gone = set(dropped.tolist())
        self.slots, self.tokens = self.slots[:length], self.tokens[:length]
        self.live = [s for s in self.live if s not in gone]
        self.phase, self.pinned, self.mass = self.phase[:length], self.pinned[:length], self.mass[:length]
        self.query = self.query[:length]
        if self.layer_live is not None:
            self.layer_live = self.layer_live[:, :length]
        return dropped

    # -- tags (pipeline) ------------------------------------------------------------
    def tag(self, start: int, phase=None, pinned=None, query=None) -> None:
        """Set the phase / pin / query-span flag of positions ``start .. start + len``."""
        if phase is not None:
            phase = np.asarray(phase, np.int32)
            self.phase[start : start + phase.size] = phase
        if pinned is not None:
            pinned = np.asarray(pinned, bool)
            self.pinned[start : start + pinned.size] = pinned
        if query is not None:
            query = np.asarray(query, bool)
            self.query[start : start + query.size] = query

    def add_mass(self, mass_P) -> None:
        """Add attention mass received by positions ``0 .. len(mass_P)``."""
        mass_P = np.asarray(mass_P, np.float32)
        self.mass[: mass_P.size] += mass_P[: self.mass.size]

    def check(self) -> None:
        n = len(self.slots)
        assert len(self.tokens) == n and self.phase.size == n and self.pinned.size == n and self.mass.size == n
        assert self.query.size == n
        assert self.live == [s for s in self.slots if s != SENTINEL_SLOT]
        if self.layer_live is not None:
            live = np.asarray(self.slots, np.int64) != SENTINEL_SLOT
            assert self.layer_live.shape[1] == n and (self.layer_live.any(axis=0) == live).all()


def promotion_tables(slots_P, positions_M, fresh_M) -> tuple[list[int], list[int]]:
    """New ``(slots, live)`` of a request after promoting ``positions_M`` into
    ``fresh_M``: each position must be a hole (evicted, sentinel) of the request."""
    slots = np.asarray(slots_P, np.int64).copy()
    pos = np.asarray(positions_M, np.int64)
    fresh = np.asarray(fresh_M, np.int64)
    if fresh.size != pos.size or np.unique(pos).size != pos.size:
        raise RepairError(f"promotion needs distinct positions and one fresh slot each ({pos.size} vs {fresh.size})")
    bad = pos[(pos < 0) | (pos >= slots.size)]
    if bad.size:
        raise RepairError(f"promoted positions {bad[:5].tolist()} are outside the request's {slots.size} positions")
    taken = pos[slots[pos] != SENTINEL_SLOT]
    if taken.size:
        raise RepairError(f"promoted positions {taken[:5].tolist()} are live, not evicted holes")
    slots[pos] = fresh
    return slots.tolist(), slots[slots != SENTINEL_SLOT].tolist()
