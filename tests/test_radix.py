"""RadixTree: sharing, eviction, holes, locks, and a refcount property test."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jaxkv.cache.allocator import SENTINEL_SLOT, SlotAllocator
from jaxkv.cache.radix import RadixTree, common_prefix_length
from jaxkv.errors import OutOfSlotsError, RadixError, SlotError

SYSTEM = [1, 2, 3, 4, 5]


def run_turn(tree, alloc, tokens):
    """What the engine does for one turn: match, take the request's own references,
    allocate the suffix, insert at the end, release, unlock. Returns the slot map."""
    m = tree.match(tokens)
    alloc.ref(m.slots[m.slots != SENTINEL_SLOT])
    slot_map = np.concatenate([m.slots, alloc.allocate(len(tokens) - m.length)])
    return m, slot_map


def finish_turn(tree, alloc, tokens, m, slot_map):
    tree.insert(tokens, slot_map)
    alloc.release(slot_map[slot_map != SENTINEL_SLOT])
    tree.unlock(m.handle)


def test_common_prefix_length():
    assert common_prefix_length([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2
    assert common_prefix_length([], [1]) == 0
    assert common_prefix_length(np.array([7]), np.array([8])) == 0


def test_two_sessions_share_the_system_prompt_slots():
    alloc = SlotAllocator(64)
    tree = RadixTree(alloc)
    a_tokens, b_tokens = SYSTEM + [10, 11, 12], SYSTEM + [20, 21]

    ma, a_map = run_turn(tree, alloc, a_tokens)
    assert ma.length == 0
    finish_turn(tree, alloc, a_tokens, ma, a_map)
    shared = a_map[:5]
    assert [alloc.refcount(s) for s in a_map] == [1] * 8  # tree only, A has ended

    mb, b_map = run_turn(tree, alloc, b_tokens)
    assert mb.length == 5 and (mb.slots == shared).all()
    # accounting: the tree's reference + B's own reference while B runs
    assert [alloc.refcount(s) for s in shared] == [2] * 5
    finish_turn(tree, alloc, b_tokens, mb, b_map)
    assert [alloc.refcount(s) for s in b_map] == [1] * 7
    assert tree.num_tokens == 5 + 3 + 2 and tree.num_nodes == 3  # split at the shared prefix

    # B touched last: evicting "one slot" removes A's leaf (LRU) and frees exactly it
    freed = tree.evict(1)
    assert sorted(freed.tolist()) == sorted(a_map[5:].tolist())
    assert all(alloc.refcount(s) == 1 for s in shared)
    assert tree.match(a_tokens, lock=False).length == 5

    # a running request locks the shared prefix: evicting everything frees B's suffix only
    mc, c_map = run_turn(tree, alloc, SYSTEM + [30])
    freed = tree.evict(100)
    assert sorted(freed.tolist()) == sorted(b_map[5:].tolist())
    assert all(alloc.refcount(s) == 2 for s in shared)  # tree + C
    assert tree.match(SYSTEM, lock=False).length == 5
    finish_turn(tree, alloc, SYSTEM + [30], mc, c_map)
    freed = tree.evict(100)
    assert set(shared.tolist()) <= set(freed.tolist())
    assert alloc.num_used == 0 and tree.num_nodes == 0 and tree.num_tokens == 0


def test_holes_are_returned_as_sentinels_and_never_referenced():
    alloc = SlotAllocator(16)
    tree = RadixTree(alloc)
    tokens = [1, 2, 3, 4]
    slots = alloc.allocate(4)
    alloc.release(slots[1:3])  # positions 1 and 2 were evicted: their slots are free
    slot_map = slots.copy()
    slot_map[1:3] = SENTINEL_SLOT
    with pytest.raises(RadixError):  # holes belong to somebody
        tree.insert(tokens, slot_map)
    tree.insert(tokens, slot_map, owner=7)
    alloc.release(slot_map[slot_map != SENTINEL_SLOT])
    assert alloc.refcount(slots[0]) == 1 and alloc.refcount(slots[3]) == 1
    assert alloc.refcounts()[SENTINEL_SLOT] == 0
    m = tree.match(tokens + [9], owner=7)
    assert m.length == 4 and m.slots.tolist() == [slots[0], 0, 0, slots[3]] and m.private_from == 1
    tree.unlock(m.handle)
    # Anyone else (another owner, a full-cache request) stops at the first hole.
    for other in (None, 8):
        m = tree.match(tokens + [9], owner=other, lock=False)
        assert m.length == 1 and m.slots.tolist() == [slots[0]] and m.private_from == 1
    tree.check_invariants()
    assert sorted(tree.evict(4).tolist()) == sorted([slots[0], slots[3]])
    assert alloc.refcounts()[SENTINEL_SLOT] == 0 and alloc.num_used == 0


def test_insert_keeps_the_trees_slots_for_a_cached_prefix():
    alloc = SlotAllocator(32)
    tree = RadixTree(alloc)
    first = alloc.allocate(4)
    tree.insert([1, 2, 3, 4], first)
    dup = alloc.allocate(6)  # a request that prefilled the same prefix itself
    assert tree.insert([1, 2, 3, 4, 5, 6], dup) == 2
    assert tree.match([1, 2, 3, 4, 5, 6], lock=False).slots.tolist() == [*first.tolist(), *dup[4:].tolist()]
    freed = alloc.release(dup)
    assert sorted(freed.tolist()) == sorted(dup[:4].tolist())  # duplicates freed, suffix kept


def test_insert_with_replace_from_hands_the_tree_the_refreshed_slots():
    """A request that prefilled cached tokens again (``replace_from``) leaves the
    tree its fresh slots from there on, on every node of the path (a shared one
    too), never over a hole, with references moved; a request still holding the
    old slots keeps them alive until it releases."""
    alloc = SlotAllocator(64)
    tree = RadixTree(alloc)
    seq = [1, 2, 3, 4, 5, 6, 7, 8]
    first = alloc.allocate(8)
    tree.insert(seq, first)
    branch = alloc.allocate(2)
    tree.insert([1, 2, 3, 4, 5, 9, 9], np.concatenate([first[:5], branch]))  # nodes [1..5], [6, 7, 8], [9, 9]
    alloc.release(np.concatenate([first, branch]))  # the writers' own references: the tree's remain
    other = tree.match(seq)  # a running request on the old slots
    alloc.ref(other.slots)
    m = tree.match([*seq, 10])
    alloc.ref(m.slots[:3])  # it reuses 3 tokens and prefills 4..8 again, and 10
    slot_map = np.concatenate([m.slots[:3], alloc.allocate(6)]).astype(np.int32)
    assert tree.insert([*seq, 10], slot_map, replace_from=3) == 1
    assert tree.match([*seq, 10], lock=False).slots.tolist() == slot_map.tolist()
    assert tree.match([1, 2, 3, 4, 5, 9, 9], lock=False).slots.tolist() == [*slot_map[:5].tolist(), *branch.tolist()]
    alloc.release(slot_map)
    tree.unlock(m.handle)
    tree.check_invariants()
    held = np.bincount(tree.held_slots(), minlength=alloc.num_slots)
    assert (alloc.refcounts() == held + np.bincount(other.slots, minlength=alloc.num_slots)).all()
    freed = alloc.release(other.slots)
    tree.unlock(other.handle)
    assert sorted(freed.tolist()) == sorted(first[3:].tolist())  # the superseded slots, once nobody holds them
    # a sequence ending inside an edge: only its own positions change
    mid = tree.match([*seq, 10], lock=False).slots[:6].copy()  # no split at 6: the insert ends inside an edge
    mid[5] = alloc.allocate(1)[0]
    assert tree.insert(seq[:6], mid, replace_from=5) == 0
    assert tree.match([*seq, 10], lock=False).slots.tolist() == [*mid.tolist(), *slot_map[6:].tolist()]
    alloc.release(mid[5:])
    # a hole is never replaced, nor filled
    holed = alloc.allocate(2)
    tree.insert([*seq, 11, 12], np.concatenate([mid, slot_map[6:8], [SENTINEL_SLOT, holed[1]]]).astype(np.int32), owner=1)
    alloc.release(holed)
    again = np.concatenate([mid, slot_map[6:8], alloc.allocate(2)]).astype(np.int32)
    tree.insert([*seq, 11, 12], again, owner=1, private_from=8, replace_from=8)
    assert tree.match([*seq, 11, 12], lock=False, owner=1).slots.tolist()[8:] == [SENTINEL_SLOT, int(again[9])]
    alloc.release(again[8:])
    tree.check_invariants()
    assert (alloc.refcounts() == np.bincount(tree.held_slots(), minlength=alloc.num_slots)).all()


def test_match_inside_an_edge_splits_it_and_locks_only_the_prefix():
    alloc = SlotAllocator(32)
    tree = RadixTree(alloc)
    s = alloc.allocate(6)
    tree.insert([1, 2, 3, 4, 5, 6], s)
    m = tree.match([1, 2, 3, 9])
    assert m.length == 3 and m.slots.tolist() == s[:3].tolist()
    assert tree.num_nodes == 2 and tree.num_locked_nodes == 1
    freed = tree.evict(10)  # the unlocked tail goes, the locked head stays
    assert freed.size == 0  # the test still holds its allocation references
    assert tree.num_tokens == 3
    tree.unlock(m.handle)
    with pytest.raises(RadixError):
        tree.unlock(m.handle)
    with pytest.raises(RadixError):
        tree.unlock(tree.match([1], lock=False).handle)


def test_splitting_a_locked_edge_keeps_the_lock_on_both_halves():
    alloc = SlotAllocator(32)
    tree = RadixTree(alloc)
    s = alloc.allocate(6)
    tree.insert([1, 2, 3, 4, 5, 6], s)
    alloc.release(s)  # only the tree holds them now
    whole = tree.match([1, 2, 3, 4, 5, 6])
    head = tree.match([1, 2, 3, 9])  # splits the locked edge
    tree.check_invariants()
    tree.unlock(head.handle)
    tree.check_invariants()
    assert tree.evict(100).size == 0 and tree.num_tokens == 6  # still locked by `whole`
    tree.unlock(whole.handle)
    tree.check_invariants()
    assert sorted(tree.evict(100).tolist()) == sorted(s.tolist())


def test_failed_insert_changes_nothing():
    alloc = SlotAllocator(8)
    tree = RadixTree(alloc)
    with pytest.raises(RadixError):
        tree.insert([1, 2, 3], [1, 2])
    with pytest.raises(SlotError):
        tree.insert([1, 2], [1, 2])  # slots never allocated
    with pytest.raises(RadixError):
        tree.insert([1.5], [1])
    assert tree.num_nodes == 0 and alloc.num_used == 0


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_refcounts_stay_consistent_under_random_operations(data):
    alloc = SlotAllocator(40)
    tree = RadixTree(alloc)
    external = np.zeros(alloc.num_slots, np.int64)  # references held by running requests
    running = []  # (tokens, match, slot_map, owner)
    token_seq = st.lists(st.integers(1, 3), min_size=0, max_size=10)

    def check():
        tree.check_invariants()
        held = np.bincount(tree.held_slots(), minlength=alloc.num_slots)
        assert (alloc.refcounts() == held + external).all()
        assert alloc.refcounts()[SENTINEL_SLOT] == 0 and held[SENTINEL_SLOT] == 0
        for _, m, _, _ in running:  # locked paths survive, slots and holes as matched
            path = [n.slots for n in m.handle._node.path_to_root()][::-1]
            assert (np.concatenate(path) == m.slots).all()

    for _ in range(data.draw(st.integers(1, 25))):
        op = data.draw(st.sampled_from(["start", "finish", "evict", "finish"]))
        if op == "start":
            tokens = data.draw(token_seq)
            owner = data.draw(st.sampled_from([None, 1, 2]))
            m = tree.match(tokens, owner=owner)
            mine = m.slots[m.slots != SENTINEL_SLOT]
            alloc.ref(mine)
            np.add.at(external, mine, 1)
            need = len(tokens) - m.length
            if need > alloc.num_free:
                freed = tree.evict(need - alloc.num_free)
                assert external[freed].sum() == 0
            try:
                new = alloc.allocate(need)
            except OutOfSlotsError:
                alloc.release(mine)
                np.add.at(external, mine, -1)
                tree.unlock(m.handle)
                check()
                continue
            np.add.at(external, new, 1)
            # some new positions get evicted by the request's policy: holes (an owner's only)
            holes = np.array(data.draw(st.lists(st.booleans(), min_size=need, max_size=need)), bool) & (owner is not None)
            alloc.release(new[holes])
            np.add.at(external, new[holes], -1)
            new[holes] = SENTINEL_SLOT
            running.append((tokens, m, np.concatenate([m.slots, new]).astype(np.int32), owner))
        elif op == "finish" and running:
            tokens, m, slot_map, owner = running.pop(data.draw(st.integers(0, len(running) - 1)))
            hole = np.flatnonzero(slot_map == SENTINEL_SLOT)
            read_private = [m.private_from] if m.private_from < m.length else []
            private_from = min([*read_private, *hole.tolist(), len(tokens)])
            tree.insert(tokens, slot_map, owner=owner, private_from=private_from)
            mine = slot_map[slot_map != SENTINEL_SLOT]
            alloc.release(mine)
            np.add.at(external, mine, -1)
            tree.unlock(m.handle)
        elif op == "evict":
            freed = tree.evict(data.draw(st.integers(0, 12)))
            assert (alloc.refcounts()[freed] == 0).all() and external[freed].sum() == 0
            assert SENTINEL_SLOT not in freed.tolist()
        check()
    for _, m, _, _ in running:
        tree.unlock(m.handle)
    assert tree.num_locked_nodes == 0
    tree.check_invariants()
