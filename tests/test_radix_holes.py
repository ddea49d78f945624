"""RadixTree.sync_holes: evictions punch holes and repairs fill them, except where
another cached sequence or running request shares the position."""

from __future__ import annotations

import numpy as np

from jaxkv.cache.allocator import SENTINEL_SLOT, SlotAllocator
from jaxkv.cache.radix import RadixTree


OWNER = 3  # the session whose evictions these are (holes are private: jaxkv.cache.radix)


def _cached(tree, alloc, ids, private_from=0):
    """Cache ``ids`` as ``OWNER``'s (private from ``private_from``)."""
    slots = alloc.allocate(len(ids))
    tree.insert(ids, slots, owner=OWNER, private_from=private_from)
    alloc.release(slots)  # only the tree holds them now
    return slots


def test_punch_and_fill_on_an_exclusive_sequence():
    alloc = SlotAllocator(64)
    tree = RadixTree(alloc)
    ids = list(range(1, 11))
    slots = _cached(tree, alloc, ids)
    request = slots.copy()
    request[[3, 4]] = SENTINEL_SLOT  # the request evicted positions 3 and 4
    freed, filled = tree.sync_holes(ids, request, owner=OWNER)
    assert sorted(freed.tolist()) == sorted(slots[[3, 4]].tolist()) and filled.size == 0
    assert tree.match(ids, lock=False, owner=OWNER).slots.tolist() == request.tolist()
    # A later request repairs position 3 into a fresh slot: the tree takes it.
    fresh = alloc.allocate(1)
    repaired = request.copy()
    repaired[3] = fresh[0]
    freed, filled = tree.sync_holes(ids, repaired, owner=OWNER)
    assert freed.size == 0 and filled.tolist() == [3]
    assert alloc.refcount(int(fresh[0])) == 2  # the request's reference + the tree's
    assert tree.match(ids, lock=False, owner=OWNER).slots.tolist() == repaired.tolist()
    tree.check_invariants()


def test_shared_prefix_is_protected():
    alloc = SlotAllocator(64)
    tree = RadixTree(alloc)
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    b = [1, 2, 3, 4, 5, 90, 91]
    slots_a = _cached(tree, alloc, a)
    _cached(tree, alloc, b)  # b shares a's first five tokens
    request = slots_a.copy()
    request[[1, 6]] = SENTINEL_SLOT  # 1 is shared with b, 6 is a's own
    freed, _ = tree.sync_holes(a, request, owner=OWNER)
    assert freed.tolist() == [int(slots_a[6])]
    got = tree.match(a, lock=False, owner=OWNER).slots
    assert got[1] == slots_a[1] and got[6] == SENTINEL_SLOT
    assert tree.match(b, lock=False, owner=OWNER).slots[1] == slots_a[1]


def test_positions_locked_by_another_request_are_protected():
    alloc = SlotAllocator(64)
    tree = RadixTree(alloc)
    ids = list(range(1, 9))
    slots = _cached(tree, alloc, ids)
    other = tree.match(ids[:6], owner=OWNER)  # another running request holds the first six
    mine = tree.match(ids, owner=OWNER)
    request = slots.copy()
    request[[2, 7]] = SENTINEL_SLOT
    freed, _ = tree.sync_holes(ids, request, own_handle=mine.handle, owner=OWNER)
    assert freed.tolist() == [int(slots[7])]
    tree.unlock(other.handle)
    tree.unlock(mine.handle)
    tree.check_invariants()
    assert np.count_nonzero(tree.match(ids, lock=False, owner=OWNER).slots == SENTINEL_SLOT) == 1


def test_drop_branch_removes_only_the_superseded_tail():
    alloc = SlotAllocator(64)
    tree = RadixTree(alloc)
    old = [1, 2, 3, 4, 5, 6, 7]
    new = [1, 2, 3, 4, 9, 9, 9, 9]
    old_slots = _cached(tree, alloc, old)
    _cached(tree, alloc, new)
    assert tree.num_tokens == 7 + 4
    freed = tree.drop_branch(old, new, owner=OWNER)
    assert sorted(freed.tolist()) == sorted(old_slots[4:].tolist())
    assert tree.match(old, lock=False, owner=OWNER).length == 4 and tree.match(new, lock=False, owner=OWNER).length == 8
    # A tail another request holds, or another sequence extends, stays.
    third = [1, 2, 3, 4, 9, 9, 9, 9, 8]
    _cached(tree, alloc, third)
    handle = tree.match(third, owner=OWNER).handle
    assert tree.drop_branch(third, new, owner=OWNER).size == 0
    tree.unlock(handle)
    assert tree.drop_branch(new, [1, 2, 3], owner=OWNER).size == 0  # 'third' extends 'new': kept
    tree.check_invariants()
