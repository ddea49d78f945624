"""Host-side radix tree over token ids: the cross-request prefix cache.

Each edge holds a run of token ids and, aligned with it, the pool slot of each
token's K/V row (one slot per token). A slot may be ``SENTINEL_SLOT`` (0): a
*hole*, a position evicted by slot-map eviction (ALGORITHMS.md §5). Holes stay in
the tree so token identity (and hence later matches) survives eviction; a match
returns them as sentinel slots and the engine neither re-prefills nor reads them.

Reference accounting (``SlotAllocator`` refcounts):
  * the tree holds exactly ONE reference on every non-sentinel slot it stores,
    however many cached sequences share it; it never references the sentinel;
  * a request holds its own reference on every slot in its slot map: after
    ``match`` the engine calls ``allocator.ref`` on the matched non-sentinel slots,
    and releases all its references when the request ends. So a system-prompt
    slot cached by the tree and used by one running request has refcount 2;
  * ``insert`` at the end of a turn references only the slots of tokens the tree
    did not have; for the existing prefix the tree keeps its own slots (holes
    included) and the request's duplicates, if any, are freed when it releases;
  * ``evict`` drops the tree's references of whole unlocked leaves, least recently
    used first, and returns the slots whose refcount reached 0.
Locks: ``match`` locks the matched path (a lock count on each node from the match
point to the root) until ``unlock(handle)``; a locked node is never evicted. A
lock keeps the cache entry; the request's own references keep the slots alive.

Invariants:
  * children of a node start with distinct tokens; every edge but the root's is
    non-empty; ``tokens`` and ``slots`` of an edge have equal length;
  * allocator refcount of a slot == (occurrences in the tree) + (references held
    by requests and other owners);
  * a node's lock count == number of live handles whose path contains it;
  * ``num_tokens`` == sum of edge lengths; ``num_nodes`` excludes the root.
A failing call (``RadixError``, ``SlotError``) changes nothing.

Prefix divergence: ``match`` returns the longest common prefix of the request and
anything cached, so a prompt that diverges early (Qwen3 dropping earlier reasoning)
simply reuses less; ``common_prefix_length`` is the comparison it uses.

Cost model (T = request tokens, N = nodes): ``match`` and ``insert`` are O(T)
token comparisons (numpy per edge) plus O(depth) node hops; a match that ends
inside an edge splits it (O(edge)). ``evict`` is O(N + k log N) for k leaves
removed. ``held_slots`` is O(N + tokens), for checks and debugging.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools

import numpy as np

from jaxkv.cache.allocator import SENTINEL_SLOT, SlotAllocator
from jaxkv.errors import RadixError


def common_prefix_length(a, b) -> int:
    """Number of leading positions where the id arrays ``a`` and ``b`` agree."""
    a, b = np.asarray(a), np.asarray(b)
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


@dataclasses.dataclass(eq=False)
class _Node:
    tokens: np.ndarray  # int32 [E]
    slots: np.ndarray  # int32 [E], SENTINEL_SLOT at holes
    parent: "_Node | None"
    children: dict[int, "_Node"] = dataclasses.field(default_factory=dict)
    lock_count: int = 0
    last_access: int = 0

    def path_to_root(self):
        node = self
        while node is not None:
            yield node
            node = node.parent


class LockHandle:
    """Opaque proof of a lock taken by ``match``; give it back to ``unlock`` once."""

    __slots__ = ("_node", "locked")

    def __init__(self, node: _Node | None):
        self._node = node
        self.locked = node is not None


@dataclasses.dataclass(frozen=True)
class PrefixMatch:
    """Result of ``RadixTree.match``.

    Attributes:
      length: number of leading request tokens found in the tree.
      slots: ``[length]`` int32 pool slots of those tokens, ``SENTINEL_SLOT`` at holes.
      handle: the lock on the matched path (pass to ``unlock``); unlocked if the
        match was taken with ``lock=False``.
    """

    length: int
    slots: np.ndarray
    handle: LockHandle


class RadixTree:
    """Prefix cache of token sequences -> pool slots, sharing an allocator."""

    def __init__(self, allocator: SlotAllocator):
        self._allocator = allocator
        self._root = _Node(np.zeros(0, np.int32), np.zeros(0, np.int32), None)
        self._clock = itertools.count(1)
        self.num_nodes = 0
        self.num_tokens = 0

    # -- lookups -----------------------------------------------------------------
    def match(self, token_ids, lock: bool = True) -> PrefixMatch:
        """Longest cached prefix of ``token_ids``; locks its path unless ``lock=False``."""
        ids = _as_ids(token_ids)
        node, k, length = self._walk(ids)
        if 0 < k < node.tokens.size:
            node = self._split(node, k)
        now = next(self._clock)
        parts = []
        for n in node.path_to_root():
            n.last_access = now
            parts.append(n.slots)
            if lock:
                n.lock_count += 1
        slots = np.concatenate(parts[::-1]).astype(np.int32) if parts else np.zeros(0, np.int32)
        assert slots.size == length
        return PrefixMatch(length, slots, LockHandle(node if lock else None))

    def unlock(self, handle: LockHandle) -> None:
        """Release a lock taken by ``match``. Unlocking twice raises ``RadixError``."""
        if not isinstance(handle, LockHandle) or not handle.locked:
            raise RadixError("unlock of a handle that is not locked (already unlocked, or lock=False)")
        for n in handle._node.path_to_root():
            n.lock_count -= 1
        handle.locked = False

    # -- updates -----------------------------------------------------------------
    def insert(self, token_ids, slots) -> int:
        """Cache ``token_ids`` with their ``slots`` (a finished turn's slot map).

        The cached prefix keeps the tree's slots; the tree takes one reference on each
        non-sentinel slot of the new tokens. Returns how many tokens were new.
        """
        ids = _as_ids(token_ids)
        slots = _as_ids(slots)
        if ids.size != slots.size:
            raise RadixError(f"insert got {ids.size} token ids but {slots.size} slots")
        node, k, length = self._walk(ids)
        new_ids, new_slots = ids[length:], slots[length:]
        if new_ids.size:
            held = new_slots[new_slots != SENTINEL_SLOT]
            if held.size:
                self._allocator.ref(held)  # validates before anything changes
            if k < node.tokens.size:
                node = self._split(node, k)
            leaf = _Node(new_ids.copy(), new_slots.copy(), node)
            node.children[int(new_ids[0])] = leaf
            self.num_nodes += 1
            self.num_tokens += int(new_ids.size)
            node = leaf
        now = next(self._clock)
        for n in node.path_to_root():
            n.last_access = now
        return int(new_ids.size)

    def sync_holes(self, token_ids, slots, own_handle: LockHandle | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Make the tree's holes agree with a request's slot map, where allowed.

        ``token_ids`` must be cached (call after ``insert``). Where ``slots``
        holds the sentinel but the tree a real slot (the request evicted it), the
        tree's entry becomes a hole and its reference is released; where ``slots``
        holds a real slot but the tree a hole (the request repaired it), the tree
        takes a reference and stores it. Positions are *protected* and left alone
        when they are shared with another cached sequence (at or above a
        branching node) or locked by another running request (locks of
        ``own_handle`` do not count). Returns ``(freed slots, filled positions)``.
        Dead-slot eviction and repair then persist across turns while every other
        sequence keeps what it shares.
        """
        ids = _as_ids(token_ids)
        slots = _as_ids(slots)
        if ids.size != slots.size:
            raise RadixError(f"sync_holes got {ids.size} token ids but {slots.size} slots")
        node, k, length = self._walk(ids)
        if length != ids.size:
            raise RadixError(f"sync_holes: only {length} of {ids.size} tokens are cached")
        path = list(node.path_to_root())[::-1][1:]  # root excluded, top-down
        own = set()
        if own_handle is not None and own_handle.locked:
            own = {id(n) for n in own_handle._node.path_to_root()}
        # The deepest protected node protects itself and everything above it.
        protected_depth = -1
        for depth, n in enumerate(path):
            other_locks = n.lock_count - (1 if id(n) in own else 0)
            # Shared if another cached sequence continues from it (our own path
            # accounts for one child of every node above our last one).
            branching = len(n.children) > (0 if n is node else 1)
            if branching or other_locks > 0 or (n is node and k < n.tokens.size):
                protected_depth = depth
        edits = []  # (node, hole mask, fill mask, span start)
        start = 0
        for depth, n in enumerate(path):
            end = start + n.tokens.size
            if depth > protected_depth:
                want = slots[start:end]
                hole = (want == SENTINEL_SLOT) & (n.slots != SENTINEL_SLOT)
                fill = (want != SENTINEL_SLOT) & (n.slots == SENTINEL_SLOT)
                if hole.any() or fill.any():
                    edits.append((n, hole, fill, start))
            start = end
        filled = [np.flatnonzero(f) + st for _, _, f, st in edits]
        new_refs = np.concatenate([slots[st : st + n.tokens.size][f] for n, _, f, st in edits]) if edits else np.zeros(0, np.int64)
        if new_refs.size:
            self._allocator.ref(new_refs)  # validates before anything changes
        release = []
        for n, hole, fill, st in edits:
            release.append(n.slots[hole].copy())
            want = slots[st : st + n.tokens.size]
            n.slots = np.where(hole, SENTINEL_SLOT, np.where(fill, want, n.slots)).astype(np.int32)
        freed = self._allocator.release(np.concatenate(release)) if release else np.zeros(0, np.int32)
        positions = np.concatenate(filled) if filled else np.zeros(0, np.int64)
        return freed.astype(np.int32), positions

    def drop_branch(self, old_ids, keep_ids) -> np.ndarray:
        """Remove the cached tail of ``old_ids`` that ``keep_ids`` superseded.

        A session's next request can diverge from what its previous request
        cached (Qwen3's template renders the last assistant message with an empty
        think block, later ones without). The old tail past the divergence is
        then a stale branch that would make the shared history look shared with
        another sequence. Nodes of that tail are removed bottom-up while they are
        unlocked leaves lying wholly past the divergence; anything another
        sequence extends or a request holds stays. Returns the slots freed.
        """
        old, keep = _as_ids(old_ids), _as_ids(keep_ids)
        diverge = common_prefix_length(old, keep)
        node, k, length = self._walk(old)
        if length != old.size or k != node.tokens.size or diverge == old.size:
            return np.zeros(0, np.int32)
        end = old.size
        freed = []
        while node is not self._root and not node.children and node.lock_count == 0:
            start = end - node.tokens.size
            if start < diverge:
                break
            parent = node.parent
            del parent.children[int(node.tokens[0])]
            self.num_nodes -= 1
            self.num_tokens -= int(node.tokens.size)
            held = node.slots[node.slots != SENTINEL_SLOT]
            if held.size:
                freed.append(self._allocator.release(held))
            node, end = parent, start
        return np.concatenate(freed).astype(np.int32) if freed else np.zeros(0, np.int32)

    def evict(self, n_slots: int) -> np.ndarray:
        """Drop least-recently-used unlocked leaves until at least ``n_slots`` slots
        are freed or nothing more is evictable. Returns the freed slots (refcount 0).

        Whole leaves are removed, so more than ``n_slots`` may be freed; a leaf made of
        holes or of slots still referenced elsewhere frees nothing but is removed.
        """
        freed: list[np.ndarray] = []
        n_freed = 0
        if n_slots <= 0:
            return np.zeros(0, np.int32)
        tie = itertools.count()
        heap = [(n.last_access, next(tie), n) for n in self._leaves() if n.lock_count == 0]
        heapq.heapify(heap)
        while heap and n_freed < n_slots:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[int(leaf.tokens[0])]
            self.num_nodes -= 1
            self.num_tokens -= int(leaf.tokens.size)
            held = leaf.slots[leaf.slots != SENTINEL_SLOT]
            if held.size:
                released = self._allocator.release(held)
                freed.append(released)
                n_freed += released.size
            if parent is not self._root and not parent.children and parent.lock_count == 0:
                heapq.heappush(heap, (parent.last_access, next(tie), parent))
        return np.concatenate(freed).astype(np.int32) if freed else np.zeros(0, np.int32)

    # -- introspection -----------------------------------------------------------
    def held_slots(self) -> np.ndarray:
        """Every non-sentinel slot the tree references, one entry per reference."""
        parts = [n.slots[n.slots != SENTINEL_SLOT] for n in self._nodes()]
        return np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)

    @property
    def num_locked_nodes(self) -> int:
        return sum(1 for n in self._nodes() if n.lock_count > 0)

    def check_invariants(self) -> None:
        """Assert the structural invariants of the module docstring (for tests)."""
        nodes = tokens = 0
        for n in self._nodes():
            nodes += 1
            tokens += n.tokens.size
            assert n.tokens.size > 0 and n.tokens.size == n.slots.size, "empty or misaligned edge"
            assert n.parent.children.get(int(n.tokens[0])) is n, "child keyed by a wrong token"
            assert 0 <= n.lock_count <= n.parent.lock_count, "lock count negative or not on the whole path"
        assert (nodes, tokens) == (self.num_nodes, self.num_tokens), "stale node/token counters"

    # -- internals ---------------------------------------------------------------
    def _walk(self, ids: np.ndarray) -> tuple[_Node, int, int]:
        """``(node, k, length)``: the deepest node reached, how many of its edge tokens
        matched (``k == edge length`` for a full edge), and the total matched."""
        node, pos = self._root, 0
        while pos < ids.size:
            child = node.children.get(int(ids[pos]))
            if child is None:
                break
            k = common_prefix_length(child.tokens, ids[pos:])
            pos += k
            if k < child.tokens.size:
                return child, k, pos
            node = child
        return node, node.tokens.size, pos

    def _split(self, node: _Node, k: int) -> _Node:
        """Cut ``node``'s edge after ``k`` tokens; returns the new upper node."""
        parent = node.parent
        upper = _Node(node.tokens[:k], node.slots[:k], parent, {}, node.lock_count, node.last_access)
        parent.children[int(node.tokens[0])] = upper
        node.tokens, node.slots, node.parent = node.tokens[k:], node.slots[k:], upper
        upper.children[int(node.tokens[0])] = node
        self.num_nodes += 1
        return upper

    def _nodes(self):
        stack = list(self._root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def _leaves(self):
        return (n for n in self._nodes() if not n.children)


def _as_ids(values) -> np.ndarray:
    arr = np.asarray(values)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise RadixError(f"token ids and slots must be integers, got dtype {arr.dtype}")
    if arr.ndim > 1:
        raise RadixError(f"expected a 1-D array, got shape {arr.shape}")
    return arr.astype(np.int32).reshape(-1)


class NamespacedRadix:
    """One namespace of a ``RadixTree``: a view whose sequences never share a
    prefix with another namespace's (or with the tree's un-namespaced ones).

    Every sequence is keyed with one leading *namespace token*, a negative id no
    tokenizer produces, stored with ``SENTINEL_SLOT`` (a hole: it holds no slot,
    is never prefilled and never read). Two namespaces therefore diverge at their
    first key position, so ``match`` only ever finds what the same namespace
    cached, while every namespace shares the tree's LRU eviction, lock and
    reference accounting (one pool, one ``evict``). Positions, lengths and slots
    seen through the view exclude the namespace token.

    The view offers the calls a turn makes (``match``, ``unlock``, ``insert``,
    ``sync_holes``, ``drop_branch``), with ``RadixTree``'s semantics.
    """

    def __init__(self, tree: RadixTree, namespace: int):
        if int(namespace) < 0:
            raise RadixError(f"a namespace is a non-negative int, got {namespace!r}")
        self.tree = tree
        self.namespace = int(namespace)
        self._key = np.asarray([-1 - self.namespace], np.int32)

    def _ids(self, token_ids) -> np.ndarray:
        return np.concatenate([self._key, _as_ids(token_ids)])

    def _slots(self, slots) -> np.ndarray:
        return np.concatenate([np.asarray([SENTINEL_SLOT], np.int32), _as_ids(slots)])

    def match(self, token_ids, lock: bool = True) -> PrefixMatch:
        found = self.tree.match(self._ids(token_ids), lock=lock)
        return PrefixMatch(max(found.length - 1, 0), found.slots[1:], found.handle)

    def unlock(self, handle: LockHandle) -> None:
        self.tree.unlock(handle)

    def insert(self, token_ids, slots) -> int:
        return self.tree.insert(self._ids(token_ids), self._slots(slots))

    def sync_holes(self, token_ids, slots, own_handle: LockHandle | None = None) -> tuple[np.ndarray, np.ndarray]:
        freed, filled = self.tree.sync_holes(self._ids(token_ids), self._slots(slots), own_handle)
        return freed, filled - 1  # the namespace token is a hole on both sides: never filled

    def drop_branch(self, old_ids, keep_ids) -> np.ndarray:
        return self.tree.drop_branch(self._ids(old_ids), self._ids(keep_ids))
