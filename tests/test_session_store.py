"""SessionStore: LRU order, capacity, per-key state."""

import threading

import numpy as np
import pytest

from jaxkv.cache.session_store import SessionStore


def test_lru_eviction_respects_uses():
    evicted = []
    store = SessionStore(2, on_evict=lambda k, v: evicted.append(k))
    store.put("a", 1)
    store.put("b", 2)
    assert store.get("a") == 1  # a is now most recent
    store.put("c", 3)
    assert evicted == ["b"] and "b" not in store and len(store) == 2
    assert "a" in store  # membership does not touch the order
    store.peek("a")
    store.put("d", 4)  # a is LRU: peek and `in` did not count as uses
    assert evicted == ["b", "a"]
    assert list(store.keys()) == ["c", "d"] and store.evictions == 2


def test_get_or_create_gives_each_session_its_own_state():
    store = SessionStore(8)
    a = store.get_or_create("a", lambda: {"memory": np.zeros(3)})
    b = store.get_or_create("b", lambda: {"memory": np.zeros(3)})
    a["memory"][0] = 1.0
    assert b["memory"][0] == 0.0 and a is not b
    assert store.get_or_create("a", lambda: pytest.fail("factory called twice")) is a
    assert store.get("missing", "default") == "default"
    assert store.pop("a") is a and "a" not in store


def test_capacity_holds_under_concurrent_use():
    store = SessionStore(16)

    def worker(k):
        for i in range(200):
            store.get_or_create((k, i % 20), dict)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(store) == 16
    with pytest.raises(ValueError):
        SessionStore(0)
