"""Property test of the slot allocator: refcounts, sentinel, exhaustion."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv.cache.allocator import SENTINEL_SLOT, SlotAllocator
from jaxkv.errors import OutOfSlotsError, SlotError

ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(0, 12)),
        st.tuples(st.just("ref"), st.integers(0, 10_000)),
        st.tuples(st.just("release"), st.integers(0, 10_000)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(num_slots=st.integers(2, 24), ops=ops)
def test_random_interleavings_keep_invariants(num_slots, ops):
    alloc = SlotAllocator(num_slots)
    held: dict[int, int] = {}  # slot -> references the test model holds
    for op, arg in ops:
        snapshot = (alloc.refcounts(), alloc.num_free)
        if op == "alloc":
            if arg > alloc.num_free:
                with pytest.raises(OutOfSlotsError):
                    alloc.allocate(arg)
                assert (alloc.refcounts() == snapshot[0]).all() and alloc.num_free == snapshot[1]
                continue
            got = alloc.allocate(arg).tolist()
            assert len(set(got)) == len(got) == arg
            assert SENTINEL_SLOT not in got
            assert not set(got) & set(held), "handed out a slot still referenced"
            for s in got:
                held[s] = 1
        elif op == "ref" and held:
            s = sorted(held)[arg % len(held)]
            alloc.ref([s])
            held[s] += 1
        elif op == "release" and held:
            s = sorted(held)[arg % len(held)]
            freed = alloc.release([s]).tolist()
            held[s] -= 1
            if held[s] == 0:
                del held[s]
                assert freed == [s]
            else:
                assert freed == []
        counts = alloc.refcounts()
        assert counts[SENTINEL_SLOT] == 0
        assert alloc.num_free + alloc.num_used == alloc.capacity == num_slots - 1
        assert alloc.num_used == len(held)
        assert all(counts[s] == n for s, n in held.items())


def test_bad_slot_operations_change_nothing():
    alloc = SlotAllocator(8)
    slots = alloc.allocate(3)
    before = alloc.refcounts()
    for bad in ([SENTINEL_SLOT], [99], [-1], [int(slots[0]), 7]):  # 7 is unallocated
        with pytest.raises(SlotError):
            alloc.ref(bad)
        assert (alloc.refcounts() == before).all()
    with pytest.raises(SlotError):
        alloc.release([int(slots[0]), int(slots[0])])  # only one reference held
    with pytest.raises(SlotError):
        alloc.release([SENTINEL_SLOT])
    with pytest.raises(SlotError):
        alloc.allocate(-1)
    assert (alloc.refcounts() == before).all() and alloc.num_free == 4
    with pytest.raises(OutOfSlotsError, match="5 KV slots but only 4"):
        alloc.allocate(5)
    assert isinstance(OutOfSlotsError("x"), MemoryError)
    assert np.array_equal(alloc.allocate(4), np.arange(4, 8))
