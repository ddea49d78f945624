"""Host-side radix tree over token ids: the cross-request prefix cache.

Each edge holds a run of token ids and, aligned with it, the pool slot of each
token's K/V row (one slot per token). A slot may be ``SENTINEL_SLOT`` (0): a
*hole*, a position evicted by slot-map eviction (ALGORITHMS.md §5). Holes stay in
the tree so token identity (and hence later matches) survives eviction; a match
returns them as sentinel slots and the engine neither re-prefills nor reads them.

Ownership of holes (isolation between sessions). A hole exists because some
session's retention policy evicted the row, and every token computed after it in
that session attended over the pruned context. Such state belongs to its *owner*
(a positive int, one per session, chosen by the server) and nobody else may
read it:
  * the tree is split into *public* nodes (``owner == 0``) and *private* nodes
    of one owner. A public node never holds a hole, and every token on a public
    path was computed over a hole-free prefix: it is what a full-cache prefill
    of that prefix computes;
  * ``insert(ids, slots, owner, private_from)`` stores ``[0, private_from)`` on
    public nodes and ``[private_from, n)`` on the owner's private nodes hanging
    below (a private node's children are that owner's too). ``private_from``
    defaults to the first hole; the pipeline passes the first position its turn
    evicted or read from a private path, whichever comes first (a hole the
    session later repaired still taints what was computed while it was a hole);
  * ``match(ids, owner)`` walks public nodes and, where one exists, the
    requester's own private child (preferred over the public one: a session
    continues its own pruned history, holes included, as IntentKV requires).
    Another owner's private nodes are invisible, so another request reuses a
    cached prefix exactly up to the first hole it did not make and prefills the
    rest itself; ``owner=None`` (a full-cache request) sees only public nodes and
    therefore never a hole;
  * ``sync_holes`` edits private nodes only (public ones are always protected).
A negative token id is a namespace key (``NamespacedRadix``), not a position: its
slot is always the sentinel and it does not count as a hole.

Reference accounting (``SlotAllocator`` refcounts):
  * the tree holds ONE reference per occurrence of a non-sentinel slot in its
    nodes, however many cached sequences share that node; it never references
    the sentinel. A slot occurs twice when an owner's private branch holds a row
    that is also public (the owner evicted an earlier one);
  * a request holds its own reference on every slot in its slot map: after
    ``match`` the engine calls ``allocator.ref`` on the matched non-sentinel slots,
    and releases all its references when the request ends. So a system-prompt
    slot cached by the tree and used by one running request has refcount 2;
  * ``insert`` at the end of a turn references only the slots of tokens the tree
    did not have; for the existing prefix the tree keeps its own slots (holes
    included) and the request's duplicates, if any, are freed when it releases.
    The exception is ``replace_from``: a request that prefilled cached tokens
    again (TriAxialKV's rewrite from float) hands the tree its slots from there
    on (real slots only, never over or into a hole), the tree's old ones released;
  * ``evict`` drops the tree's references of whole unlocked leaves, least recently
    used first, and returns the slots whose refcount reached 0.
Locks: ``match`` locks the matched path (a lock count on each node from the match
point to the root) until ``unlock(handle)``; a locked node is never evicted. A
lock keeps the cache entry; the request's own references keep the slots alive.

Invariants:
  * a node's children are keyed by ``(owner, first token)``, distinct; every edge
    but the root's is non-empty; ``tokens`` and ``slots`` of an edge have equal
    length;
  * public nodes hold no hole; a private node's parent is public or private to
    the same owner;
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


PUBLIC = 0  # the owner of public nodes (no holes, computed over a hole-free prefix)


@dataclasses.dataclass(eq=False)
class _Node:
    tokens: np.ndarray  # int32 [E]
    slots: np.ndarray  # int32 [E], SENTINEL_SLOT at holes
    parent: "_Node | None"
    children: dict[tuple[int, int], "_Node"] = dataclasses.field(default_factory=dict)
    lock_count: int = 0
    last_access: int = 0
    owner: int = PUBLIC

    @property
    def key(self) -> tuple[int, int]:
        """This node's key in its parent's ``children``."""
        return (self.owner, int(self.tokens[0]))

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
      private_from: the position where the match entered the requester's private
        nodes (``length`` when it stayed public); holes only occur at or past it.
    """

    length: int
    slots: np.ndarray
    handle: LockHandle
    private_from: int = -1

    def __post_init__(self):
        if self.private_from < 0:
            object.__setattr__(self, "private_from", self.length)


def _check_owner(owner) -> int | None:
    if owner is None:
        return None
    if isinstance(owner, bool) or not isinstance(owner, (int, np.integer)) or int(owner) <= PUBLIC:
        raise RadixError(f"an owner is a positive int (or None for public only), got {owner!r}")
    return int(owner)


def _holes(ids: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """Mask of hole positions (namespace keys, negative ids, are not positions)."""
    return (slots == SENTINEL_SLOT) & (ids >= 0)


class RadixTree:
    """Prefix cache of token sequences -> pool slots, sharing an allocator."""

    def __init__(self, allocator: SlotAllocator):
        self._allocator = allocator
        self._root = _Node(np.zeros(0, np.int32), np.zeros(0, np.int32), None)
        self._clock = itertools.count(1)
        self.num_nodes = 0
        self.num_tokens = 0

    # -- lookups -----------------------------------------------------------------
    def match(self, token_ids, lock: bool = True, owner: int | None = None) -> PrefixMatch:
        """Longest prefix of ``token_ids`` cached on public nodes or ``owner``'s
        private ones (module docstring); locks its path unless ``lock=False``."""
        ids = _as_ids(token_ids)
        node, k, length, private_from = self._walk(ids, _check_owner(owner))
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
        return PrefixMatch(length, slots, LockHandle(node if lock else None), private_from)

    def unlock(self, handle: LockHandle) -> None:
        """Release a lock taken by ``match``. Unlocking twice raises ``RadixError``."""
        if not isinstance(handle, LockHandle) or not handle.locked:
            raise RadixError("unlock of a handle that is not locked (already unlocked, or lock=False)")
        for n in handle._node.path_to_root():
            n.lock_count -= 1
        handle.locked = False

    # -- updates -----------------------------------------------------------------
    def insert(self, token_ids, slots, owner: int | None = None, private_from: int | None = None, replace_from: int | None = None) -> int:
        """Cache ``token_ids`` with their ``slots`` (a finished turn's slot map).

        ``[0, private_from)`` goes to public nodes, the rest to ``owner``'s
        private nodes (module docstring; ``private_from`` defaults to the first
        hole, and a private part needs an owner). The cached prefix keeps the
        tree's slots, except from ``replace_from`` on (a request that prefilled
        those cached tokens again: ``Stage.reuse_cut``), where the request's
        slots replace the tree's wherever both are real slots; the tree takes one
        reference on each non-sentinel slot it stores and releases the ones it
        drops. Returns how many tokens were new.
        """
        ids = _as_ids(token_ids)
        slots = _as_ids(slots)
        owner = _check_owner(owner)
        if ids.size != slots.size:
            raise RadixError(f"insert got {ids.size} token ids but {slots.size} slots")
        holes = np.flatnonzero(_holes(ids, slots))
        first_hole = int(holes[0]) if holes.size else int(ids.size)
        cut = first_hole if private_from is None else int(private_from)
        if not 0 <= cut <= ids.size:
            raise RadixError(f"private_from={private_from} is outside the sequence of {ids.size} tokens")
        if first_hole < cut:
            raise RadixError(f"a hole at position {first_hole} lies before private_from={cut}: public nodes hold no holes")
        if cut < ids.size and owner is None:
            raise RadixError("a sequence with holes (or a private tail) needs an owner")
        # Where each part ends in the tree today (no change yet).
        node, k, length, _ = self._walk(ids[:cut], None)
        pieces = []  # (owner, start, end): new leaves to hang, top-down
        if length < cut:
            pieces.append((PUBLIC, length, cut))
        pnode, pk, plength = None, 0, cut
        if cut < ids.size:
            if length == cut and k == node.tokens.size:  # the public part is all cached, at a node boundary
                pnode, pk, plength = self._descend(node, ids, cut, owner)
            pieces.append((owner, plength, int(ids.size)))
        pieces = [p for p in pieces if p[2] > p[1]]
        held = np.concatenate([slots[a:b] for _, a, b in pieces] or [np.zeros(0, np.int32)])
        held = held[held != SENTINEL_SLOT]
        if held.size:
            self._allocator.ref(held)  # validates before anything changes
        # Apply: split where a new leaf hangs mid-edge, then hang the leaves.
        if k < node.tokens.size and (length < cut or cut < ids.size):
            node = self._split(node, k)
        if pnode is not None:
            node = self._split(pnode, pk) if pk < pnode.tokens.size else pnode
        for piece_owner, a, b in pieces:
            leaf = _Node(ids[a:b].copy(), slots[a:b].copy(), node, owner=piece_owner)
            node.children[leaf.key] = leaf
            self.num_nodes += 1
            self.num_tokens += b - a
            node = leaf
        now = next(self._clock)
        for n in node.path_to_root():
            n.last_access = now
        if replace_from is not None:
            # the sequence ends inside ``node``'s edge only when nothing was hung and the walk stopped mid-edge
            within = k if not pieces and pnode is None and k < node.tokens.size else node.tokens.size
            self._replace_slots(node, within, slots, int(replace_from))
        return sum(b - a for _, a, b in pieces)

    def _replace_slots(self, last: _Node, within: int, slots: np.ndarray, start: int) -> None:
        """On the path from the root to ``last``, whose first ``within`` edge tokens
        end the sequence of ``slots``: its slots at positions ``>= start`` replace
        the tree's where both are real and differ (references moved with them)."""
        end, edge = int(slots.size), within  # ``n`` covers [end - edge, end) of the sequence
        for n in last.path_to_root():
            a = end - edge
            lo = max(start, a)
            if lo < end:
                old, new = n.slots[lo - a : edge], slots[lo:end]
                swap = (old != new) & (old != SENTINEL_SLOT) & (new != SENTINEL_SLOT)
                if swap.any():
                    self._allocator.ref(new[swap])
                    self._allocator.release(old[swap])
                    n.slots = n.slots.copy()
                    n.slots[lo - a + np.flatnonzero(swap)] = new[swap]
            end = a
            if n.parent is not None:
                edge = n.parent.tokens.size

    def sync_holes(self, token_ids, slots, own_handle: LockHandle | None = None, owner: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Make the tree's holes agree with a request's slot map, where allowed.

        ``token_ids`` must be cached (call after ``insert``, with the same
        ``owner``). Where ``slots`` holds the sentinel but the tree a real slot
        (the request evicted it), the tree's entry becomes a hole and its
        reference is released; where ``slots`` holds a real slot but the tree a
        hole (the request repaired it), the tree takes a reference and stores
        it. Positions are *protected* and left alone when they are public, shared
        with another cached sequence (at or above a branching node) or locked by
        another running request (locks of ``own_handle`` do not count). Returns
        ``(freed slots, filled positions)``. Dead-slot eviction and repair then
        persist across the owner's turns while every other sequence keeps what
        it shares.
        """
        ids = _as_ids(token_ids)
        slots = _as_ids(slots)
        if ids.size != slots.size:
            raise RadixError(f"sync_holes got {ids.size} token ids but {slots.size} slots")
        node, k, length, _ = self._walk(ids, _check_owner(owner))
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
            if n.owner == PUBLIC or branching or other_locks > 0 or (n is node and k < n.tokens.size):
                protected_depth = depth
        edits = []  # (node, hole mask, fill mask, span start)
        start = 0
        for depth, n in enumerate(path):
            end = start + n.tokens.size
            if depth > protected_depth:
                want = slots[start:end]
                hole = _holes(n.tokens, want) & (n.slots != SENTINEL_SLOT)
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

    def drop_branch(self, old_ids, keep_ids, owner: int | None = None) -> np.ndarray:
        """Remove the cached tail of ``old_ids`` that ``keep_ids`` superseded.

        A session's next request can diverge from what its previous request
        cached (Qwen3's template renders the last assistant message with an empty
        think block, later ones without). The old tail past the divergence is
        then a stale branch that would make the shared history look shared with
        another sequence. Nodes of that tail (as ``owner`` sees it) are removed
        bottom-up while they are unlocked leaves lying wholly past the
        divergence; anything another sequence extends or a request holds stays.
        Returns the slots freed.
        """
        old, keep = _as_ids(old_ids), _as_ids(keep_ids)
        diverge = common_prefix_length(old, keep)
        node, k, length, _ = self._walk(old, _check_owner(owner))
        if length != old.size or k != node.tokens.size or diverge == old.size:
            return np.zeros(0, np.int32)
        end = old.size
        freed = []
        while node is not self._root and not node.children and node.lock_count == 0:
            start = end - node.tokens.size
            if start < diverge:
                break
            parent = node.parent
            self._remove_leaf(node, freed)
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
            n_freed += self._remove_leaf(leaf, freed)
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
            assert n.parent.children.get(n.key) is n, "child keyed by a wrong (owner, token)"
            assert 0 <= n.lock_count <= n.parent.lock_count, "lock count negative or not on the whole path"
            if n.owner == PUBLIC:
                assert not _holes(n.tokens, n.slots).any(), "a public node holds a hole"
            else:
                assert n.parent.owner in (PUBLIC, n.owner), "a private node below another owner's"
        assert (nodes, tokens) == (self.num_nodes, self.num_tokens), "stale node/token counters"

    # -- internals ---------------------------------------------------------------
    def _walk(self, ids: np.ndarray, owner: int | None) -> tuple[_Node, int, int, int]:
        """``(node, k, length, private_from)``: the deepest node reached on the
        public path or ``owner``'s private one (preferred where both go on), how
        many of its edge tokens matched (``k == edge length`` for a full edge),
        the total matched, and where the path entered private nodes (``length``
        if it did not)."""
        node, pos, private_from = self._root, 0, None
        while pos < ids.size:
            token = int(ids[pos])
            child = node.children.get((owner, token)) if owner is not None else None
            if child is None and node.owner == PUBLIC:
                child = node.children.get((PUBLIC, token))
            if child is None:
                break
            if child.owner != PUBLIC and private_from is None:
                private_from = pos
            k = common_prefix_length(child.tokens, ids[pos:])
            pos += k
            if k < child.tokens.size:
                return child, k, pos, pos if private_from is None else private_from
            node = child
        return node, node.tokens.size, pos, pos if private_from is None else private_from

    def _descend(self, node: _Node, ids: np.ndarray, pos: int, owner: int) -> tuple[_Node, int, int]:
        """From ``node`` (ending at ``pos``), follow ``owner``'s private children
        only: ``(node, k, length)`` as ``_walk``."""
        while pos < ids.size:
            child = node.children.get((owner, int(ids[pos])))
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
        upper = _Node(node.tokens[:k], node.slots[:k], parent, {}, node.lock_count, node.last_access, node.owner)
        parent.children[upper.key] = upper
        node.tokens, node.slots, node.parent = node.tokens[k:], node.slots[k:], upper
        upper.children[node.key] = node
        self.num_nodes += 1
        return upper

    def _remove_leaf(self, leaf: _Node, freed: list) -> int:
        """Unhang a leaf and release the tree's references; returns how many slots
        reached refcount 0 (appended to ``freed``)."""
        del leaf.parent.children[leaf.key]
        self.num_nodes -= 1
        self.num_tokens -= int(leaf.tokens.size)
        held = leaf.slots[leaf.slots != SENTINEL_SLOT]
        if not held.size:
            return 0
        released = self._allocator.release(held)
        freed.append(released)
        return int(released.size)

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
    tokenizer produces, stored with ``SENTINEL_SLOT`` (it holds no slot, is never
    prefilled or read, and is not a hole: it stays on public nodes). Two namespaces therefore diverge at their
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

    def match(self, token_ids, lock: bool = True, owner: int | None = None) -> PrefixMatch:
        found = self.tree.match(self._ids(token_ids), lock=lock, owner=owner)
        length = max(found.length - 1, 0)
        return PrefixMatch(length, found.slots[1:], found.handle, min(max(found.private_from - 1, 0), length))

    def unlock(self, handle: LockHandle) -> None:
        self.tree.unlock(handle)

    def insert(self, token_ids, slots, owner: int | None = None, private_from: int | None = None, replace_from: int | None = None) -> int:
        cut = None if private_from is None else int(private_from) + 1
        replace = None if replace_from is None else int(replace_from) + 1
        return self.tree.insert(self._ids(token_ids), self._slots(slots), owner, cut, replace)

    def sync_holes(self, token_ids, slots, own_handle: LockHandle | None = None, owner: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        freed, filled = self.tree.sync_holes(self._ids(token_ids), self._slots(slots), own_handle, owner)
        return freed, filled - 1  # the namespace token is public: never filled

    def drop_branch(self, old_ids, keep_ids, owner: int | None = None) -> np.ndarray:
        return self.tree.drop_branch(self._ids(old_ids), self._ids(keep_ids), owner)
