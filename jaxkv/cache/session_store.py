"""LRU store of per-session policy state (QueryMemory, phase rings, ...).

Keys are session ids (``jaxkv.chat.derive_session_id``); values are whatever a
policy keeps across turns (pytrees of device arrays, numpy arrays, objects). The
store never copies, merges or inspects values.

Invariants:
  * at most ``capacity`` sessions are held; inserting one more evicts the least
    recently used (a ``get`` or ``put`` counts as a use; ``in`` and ``peek`` do not);
  * each key maps to its own value: ``get_or_create`` calls the factory once per
    new key, so two sessions never share state unless a caller stores the same
    object under two keys;
  * operations are atomic under an internal lock (safe from several threads);
    a copy (``copy.deepcopy``, pickling) gets its own lock.
Cost: O(1) per operation (``OrderedDict``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable, Hashable, Iterator

_MISSING = object()


class SessionStore:
    """Capped LRU map ``session id -> policy state``."""

    def __init__(self, capacity: int, on_evict: Callable[[Hashable, Any], None] | None = None):
        """``on_evict(key, value)`` is called (outside the lock) for each LRU eviction."""
        if int(capacity) < 1:
            raise ValueError(f"a session store needs capacity >= 1, got {capacity}")
        self.capacity = int(capacity)
        self._on_evict = on_evict
        self._items: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.evictions = 0

    def __getstate__(self):  # copies (Session.fork) get a lock of their own
        with self._lock:
            state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def get(self, key: Hashable, default: Any = None) -> Any:
        """The state of ``key`` (marking it most recently used), or ``default``."""
        with self._lock:
            value = self._items.get(key, _MISSING)
            if value is _MISSING:
                return default
            self._items.move_to_end(key)
            return value

    def peek(self, key: Hashable, default: Any = None) -> Any:
        """Like ``get`` without touching the LRU order."""
        with self._lock:
            return self._items.get(key, default)

    def put(self, key: Hashable, value: Any) -> None:
        """Store ``value`` as the state of ``key`` (most recently used)."""
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            evicted = self._trim()
        self._report(evicted)

    def get_or_create(self, key: Hashable, factory: Callable[[], Any]) -> Any:
        """The state of ``key``; a fresh ``factory()`` stored under it if absent."""
        with self._lock:
            value = self._items.get(key, _MISSING)
            if value is not _MISSING:
                self._items.move_to_end(key)
                return value
            value = self._items[key] = factory()
            evicted = self._trim()
        self._report(evicted)
        return value

    def pop(self, key: Hashable, default: Any = None) -> Any:
        with self._lock:
            return self._items.pop(key, default)

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def keys(self) -> Iterator[Hashable]:
        """Keys from least to most recently used (a snapshot)."""
        with self._lock:
            return iter(list(self._items))

    def _trim(self) -> list[tuple[Hashable, Any]]:
        evicted = []
        while len(self._items) > self.capacity:
            evicted.append(self._items.popitem(last=False))
        self.evictions += len(evicted)
        return evicted

    def _report(self, evicted: list[tuple[Hashable, Any]]) -> None:
        if self._on_evict is not None:
            for key, value in evicted:
                self._on_evict(key, value)
