"""Host-side slot allocator with reference counts.

The pool has ``num_slots`` rows; slot 0 is the **sentinel**: reserved at
construction, never handed out, never referenced, never freed. Evicted positions
point at it and attention never reads it.

Invariants (checked by the property test):
  * ``num_free + num_used == capacity == num_slots - 1``;
  * a slot is in the free list iff its refcount is 0 (the sentinel excepted);
  * every public method validates its whole input before changing anything, so a
    failing call (``OutOfSlotsError``, ``SlotError``) leaves the allocator exactly
    as it was.

Cost: allocate / ref / release are O(n) in the slots touched. Free slots are
handed out lowest id first (a heap), so a fresh pool is filled contiguously and a
fragmented one reuses the holes.
"""

from __future__ import annotations

import heapq

import numpy as np

from jaxkv.errors import OutOfSlotsError, SlotError

SENTINEL_SLOT = 0


class RefCountedSlots:
    """The reference counts every allocator keeps over a pool's slots ``0 ..
    num_slots - 1`` (the sentinel is never counted): queries, ``ref``, dropping
    references, and the id checks. Subclasses own the free lists (``capacity``,
    ``num_free``, ``allocate``, ``release``)."""

    def __init__(self, num_slots: int):
        self.num_slots = int(num_slots)
        self._refcount = np.zeros(self.num_slots, dtype=np.int64)

    @property
    def num_used(self) -> int:
        return self.capacity - self.num_free

    def refcount(self, slot: int) -> int:
        self._check_ids(np.asarray([slot]))
        return int(self._refcount[slot])

    def refcounts(self) -> np.ndarray:
        """A copy of the refcount table ``[S]``."""
        return self._refcount.copy()

    def ref(self, slots) -> None:
        """Add one reference to each listed slot (repeats count repeatedly)."""
        slots = self._as_ids(slots)
        held = self._refcount[slots] > 0
        if not held.all():
            raise SlotError(f"cannot reference unallocated slots {slots[~held][:8].tolist()}")
        np.add.at(self._refcount, slots, 1)

    def _drop_refs(self, slots) -> np.ndarray:
        """Drop one reference per listed slot (``SlotError``, before any change,
        for more than are held); returns the distinct slots now at 0."""
        slots = self._as_ids(slots)
        uniq, counts = np.unique(slots, return_counts=True)
        short = self._refcount[uniq] < counts
        if short.any():
            raise SlotError(f"releasing more references than held for slots {uniq[short][:8].tolist()}")
        self._refcount[uniq] -= counts
        return uniq[self._refcount[uniq] == 0]

    def _check_ids(self, slots: np.ndarray) -> None:
        check_slot_ids(slots, self.num_slots)

    def _as_ids(self, slots) -> np.ndarray:
        return as_slot_ids(slots, self.num_slots)


class SlotAllocator(RefCountedSlots):
    """Reference-counted free list over pool slots ``1 .. num_slots - 1``."""

    def __init__(self, num_slots: int):
        if num_slots < 2:
            raise SlotError(f"a pool needs at least 2 slots (sentinel + 1), got {num_slots}")
        super().__init__(num_slots)
        self._free: list[int] = list(range(1, self.num_slots))  # already a valid heap

    @property
    def capacity(self) -> int:
        return self.num_slots - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> np.ndarray:
        """Hand out ``n`` free slots with refcount 1 (lowest ids first)."""
        n = int(n)
        if n < 0:
            raise SlotError(f"cannot allocate a negative number of slots ({n})")
        if n > len(self._free):
            raise OutOfSlotsError(f"asked for {n} KV slots but only {len(self._free)} of {self.capacity} are free")
        slots = np.fromiter((heapq.heappop(self._free) for _ in range(n)), dtype=np.int32, count=n)
        self._refcount[slots] = 1
        return slots

    def release(self, slots) -> np.ndarray:
        """Drop one reference from each listed slot; returns the slots now free."""
        freed = self._drop_refs(slots)
        for s in freed.tolist():
            heapq.heappush(self._free, s)
        return freed.astype(np.int32)


def check_slot_ids(slots: np.ndarray, num_slots: int) -> None:
    """``SlotError`` unless every id is a real slot of a pool of ``num_slots``
    (in range, and not the sentinel): the one check of every allocator."""
    bad = (slots < 0) | (slots >= num_slots)
    if bad.any():
        raise SlotError(f"slot ids out of range [0, {num_slots}): {slots[bad][:8].tolist()}")
    if (slots == SENTINEL_SLOT).any():
        raise SlotError("the sentinel slot 0 is never referenced or released")


def as_slot_ids(slots, num_slots: int) -> np.ndarray:
    """``slots`` as a flat int64 array of checked slot ids (``SlotError`` otherwise)."""
    arr = np.asarray(slots)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise SlotError(f"slot ids must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64).reshape(-1)
    check_slot_ids(arr, num_slots)
    return arr
