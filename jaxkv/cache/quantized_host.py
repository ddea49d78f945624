"""Host bookkeeping of the dual quantized pool: allocator, write plans, page
tables, the packed-row codec of the host tier, and ``QuantizedKV``, the engine's
quantized half.

Modes (``Engine(kv_quant=...)``, ``Server(kv_quant=...)``):

* ``"int4"``: every token INT4 (one reserved INT2 page, no float region).
* ``"triaxial"`` (and its ablations ``"triaxial_no_temporal"``,
  ``"triaxial_no_semantic"``, which differ only in the allocation a session
  uses): prompt tokens INT2 or INT4 as the prefill's ``kv_bits`` say (the
  quantization stage derives them from tags and the calibrated allocation);
  everything else INT4: decode tokens, and prefills with no ``kv_bits`` (a
  teacher-forced reply is what decode would have written).
* ``"kivi2"`` (KIVI, Liu et al. 2024, on this substrate): tokens are written in
  full precision into the float region; after every prefill chunk and decode
  chunk, float tokens older than the most recent ``KIVI_RESIDUAL = 128``
  positions move to INT2 pages in groups of 32, oldest first (keys per channel,
  values per token), so a request holds 128 to 159 recent float tokens (plus at
  most one decode chunk) and everything older at 2 bits. A radix-cached prefix
  keeps the slots the tree holds (its float residual's slots); the request
  re-quantizes them the same way when they age (KIVI's rule, applied per request).
* ``"kivi4"``: ``kivi2`` with 4-bit pages (keys per channel, values per token;
  KIVI's recommendation for GQA models). The page region keeps its INT2 token
  kind (``Geometry.kind``); ``QuantizedKV.page_bits`` is 4 and every count of
  precision (``composition``) reports those tokens as 4-bit. On NVIDIA GPUs its
  page part runs through ``jaxkv.kernels.triton.decode.masked_int2_partials`` (jnp): the Triton
  page kernel reads 2-bit codes only.

Page-completion rule: within one prefill chunk, the tokens meant for INT2 fill
pages of 32 in position order; the last ``n % 32`` of them (those that do not
fill a page) go to INT4 (TriAxialKV §3.2.1). Precision is fixed when a token is
written: a token matched through the radix prefix cache keeps the precision it
was first written with (its slot, hence its region, is the tree's).

``DualAllocator`` mirrors ``SlotAllocator``'s interface and invariants over the
three regions. Its ``capacity`` / ``num_free`` / ``num_used`` count the *token
region* (INT4, or float for ``kivi2``) only: every token can fall back to it (an
INT2 plan short of pages writes the rest as INT4), so admission that fits the
token region never over-commits; INT2 pages are extra room, reported by
``pages_free`` / ``pages_used``.

The host tier's packed-row codec (shelved rows as uint8 blobs) is ``jaxkv.cache.blobs``.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.buckets import bucket
from jaxkv.cache.allocator import SENTINEL_SLOT, RefCountedSlots
from jaxkv.cache.quantized import (
    FLOAT,
    INT2,
    INT4,
    DecodeParts,
    Geometry,
    QuantizedKVCache,
    QuantLayers,
    gather_dequantized,
    gather_keys as gather_dequantized_keys,
    gather_packed,
    rewrite_rows,
    write_packed,
)
from jaxkv.errors import ConfigError, OutOfSlotsError, SlotError
from jaxkv.cache.blobs import blob_keys, decode_blobs, encode_blobs
from jaxkv.cache.rotation import Rotation
from jaxkv.kernels.quant import PAGE

MODES = ("int4", "kivi2", "kivi4", "triaxial", "triaxial_no_temporal", "triaxial_no_semantic")
KIVI_PAGE_BITS = {"kivi2": 2, "kivi4": 4}  # the KIVI modes: a float residual window, then pages of these bits
KIVI_RESIDUAL = 128  # KIVI's residual: the most recent tokens kept in full precision


def check_mode(mode) -> str | None:
    """``None`` or a name of ``MODES`` (``"none"`` means None); ``ConfigError`` else."""
    if mode is None or mode == "none":
        return None
    if mode not in MODES:
        raise ConfigError(f"unknown kv_quant {mode!r}; known: None, {', '.join(MODES)}")
    return mode


# Modes a pool built for one mode can serve per request: they write the same
# regions and differ only in the prefill's ``kv_bits`` annotation (the triaxial
# modes and ``int4``, on a pool with INT2 pages), so sessions of each share it.
_POOL_SERVES = {
    None: (None,),
    "int4": ("int4",),  # no INT2 pages: a triaxial plan would silently fall back to INT4
    "kivi2": ("kivi2",),
    "kivi4": ("kivi4",),
    **{m: ("int4", "triaxial", "triaxial_no_temporal", "triaxial_no_semantic") for m in MODES if m.startswith("triaxial")},
}


def servable_modes(pool_mode) -> tuple:
    """The ``kv_quant`` modes a session may ask for on a pool built with
    ``pool_mode`` (``None``: the float pool, which serves only full precision)."""
    return _POOL_SERVES[check_mode(pool_mode)]


def bytes_per_token(kind: int, *, head_dim: int, num_layers: int, num_kv_heads: int) -> float:
    """KV bytes one token occupies in a format, scales and zero points included.

    Per layer and KV head, K + V: INT4 ``2 (D/2 + 2*2*D/32) = 1.25 D`` (``kivi4``'s
    4-bit pages too: keys ``D/2 + 4D/32``, values ``D/2 + 2*2*D/32``); INT2
    ``(D/4 + 2*2*D/32)`` (keys: the page's per-channel scale and zero, ``4D`` bytes
    over 32 tokens) ``+ (D/4 + 2*2*D/32)`` (values) ``= 0.75 D``; full precision
    counted as bf16, ``2 * 2D = 4 D``.
    """
    D = head_dim
    per = {INT2: 0.75 * D, INT4: 1.25 * D, FLOAT: 4.0 * D}[kind]
    return per * num_layers * num_kv_heads


def elements_per_token(*, head_dim: int, num_layers: int, num_kv_heads: int) -> int:
    """K and V elements one token holds: ``2 D`` per layer and KV head."""
    return 2 * head_dim * num_layers * num_kv_heads


def stored_bits(nbytes: float, elements: float) -> float:
    """Stored bits per element, ``8 * bytes / elements``: the one definition every
    report of stored bits uses. ``nbytes`` counts everything the KV occupies (codes,
    every scale and zero point, float outliers and float-window rows, full precision
    as bf16; ``bytes_per_token``), so INT4 per token stores 5.0 bits, INT2 pages 3.0
    and the float pool 16.0, where the code widths alone say 4, 2 and 16."""
    return 8.0 * nbytes / elements


# ============================================================================ allocator
class DualAllocator(RefCountedSlots):
    """Reference counts over a ``Geometry``'s slots, one free list per region
    (module docstring). INT2 pages are handed out whole (``allocate_pages``);
    rows and the radix cache reference their slots one by one, and a page goes
    back to its free list when all 32 of its slots are at refcount 0."""

    def __init__(self, geometry: Geometry, token_kind: int = INT4):
        super().__init__(geometry.num_slots)
        self.geometry = geometry
        self.token_kind = token_kind
        self._free_pages = list(range(1, geometry.pages))  # page 0 is reserved
        self._page_out = np.zeros(geometry.pages, bool)
        self._free = {INT4: list(range(geometry.off4, geometry.off_float)), FLOAT: list(range(geometry.off_float, geometry.num_slots))}
        if token_kind == FLOAT:  # kivi2: the INT4 region is one unused row
            self._free[INT4] = []

    # -- queries ---------------------------------------------------------------
    @property
    def capacity(self) -> int:
        g = self.geometry
        return g.float_slots if self.token_kind == FLOAT else g.int4_slots

    @property
    def num_free(self) -> int:
        return len(self._free[self.token_kind])

    def free_of(self, kind: int) -> int:
        """Free slots of a region (INT2: 32 per free page)."""
        return PAGE * len(self._free_pages) if kind == INT2 else len(self._free[kind])

    @property
    def pages_free(self) -> int:
        return len(self._free_pages)

    @property
    def pages_used(self) -> int:
        return self.geometry.pages - 1 - len(self._free_pages)

    # -- mutations -----------------------------------------------------------------
    def allocate(self, n: int, kind: int | None = None) -> np.ndarray:
        """``n`` free slots of a token region (default: the token kind), refcount 1."""
        kind = self.token_kind if kind is None else kind
        n = int(n)
        if n < 0:
            raise SlotError(f"cannot allocate a negative number of slots ({n})")
        free = self._free[kind]
        if n > len(free):
            raise OutOfSlotsError(f"asked for {n} {'INT4' if kind == INT4 else 'float'} KV slots but only {len(free)} are free")
        slots = np.fromiter((heapq.heappop(free) for _ in range(n)), dtype=np.int32, count=n)
        self._refcount[slots] = 1
        return slots

    def allocate_pages(self, counts) -> tuple[np.ndarray, np.ndarray]:
        """Whole INT2 pages, one per entry of ``counts``; the first ``counts[i]``
        slots of page ``i`` get refcount 1. Returns ``(page ids, slots)``, slots
        in page order."""
        counts = np.asarray(counts, np.int64).reshape(-1)
        if ((counts < 1) | (counts > PAGE)).any():
            raise SlotError(f"a page holds 1 to {PAGE} tokens, got {counts.tolist()}")
        if counts.size > len(self._free_pages):
            raise OutOfSlotsError(f"asked for {counts.size} INT2 pages but only {len(self._free_pages)} are free")
        pages = np.fromiter((heapq.heappop(self._free_pages) for _ in range(counts.size)), dtype=np.int32, count=counts.size)
        self._page_out[pages] = True
        slots = (
            np.concatenate([p * PAGE + np.arange(c) for p, c in zip(pages, counts)]).astype(np.int32)
            if pages.size
            else np.zeros(0, np.int32)
        )
        self._refcount[slots] = 1
        return pages, slots

    def release(self, slots) -> np.ndarray:
        """Drop one reference per listed slot; returns the slots whose storage
        became free (a token slot at 0; all 32 slots of a page whose last
        reference went)."""
        zero = self._drop_refs(slots)
        kind = self.geometry.kind(zero)
        freed = []
        for s in zero[kind != INT2].tolist():
            heapq.heappush(self._free[int(self.geometry.kind(np.asarray(s)))], s)
            freed.append(np.asarray([s]))
        for p in np.unique(zero[kind == INT2] // PAGE).tolist():
            if self._page_out[p] and not self._refcount[p * PAGE : (p + 1) * PAGE].any():
                self._page_out[p] = False
                heapq.heappush(self._free_pages, p)
                freed.append(p * PAGE + np.arange(PAGE))
        return np.concatenate(freed).astype(np.int32) if freed else np.zeros(0, np.int32)


# ============================================================================ plans
@dataclasses.dataclass
class WritePlan:
    """Where a run of new tokens goes.

    Attributes:
      slots: ``[T]`` int32, one slot per token (INT2 tokens: their page slot).
      kinds: ``[T]`` int8, the kind each token is written as.
      pages: per chunk of ``chunk`` tokens, ``(page ids [Q], token indices [Q, 32])``
        (indices into the run, in page-token order).
    """

    slots: np.ndarray
    kinds: np.ndarray
    pages: list
    chunk: int


def page_groups(kinds, chunk: int):
    """Apply the page-completion rule to wanted ``kinds [T]`` (in place): per chunk,
    INT2 tokens in position order fill pages of 32, the rest become INT4. Returns
    per chunk the ``[Q, 32]`` token indices of its pages."""
    groups = []
    for c in range(0, max(kinds.size, 1), chunk):
        idx = np.flatnonzero(kinds[c : c + chunk] == INT2) + c
        n = idx.size // PAGE * PAGE
        kinds[idx[n:]] = INT4
        groups.append(idx[:n].reshape(-1, PAGE))
    return groups


@dataclasses.dataclass(frozen=True)
class PageTable:
    """A request's page table as decode reads it: INT2 pages first, then INT4
    tokens, then float tokens (TriAxialKV §3.2.3).

    Attributes:
      pages: INT2 page ids; masks: uint32 bitmask of the request's tokens in each.
      int4: INT4 slots (position order); floats: float slots (position order).
    """

    pages: np.ndarray
    masks: np.ndarray
    int4: np.ndarray
    floats: np.ndarray

    def entries(self) -> np.ndarray:
        """The one list: page ids, then INT4 slots, then float slots."""
        return np.concatenate([self.pages, self.int4, self.floats]).astype(np.int64)


# ============================================================================ the engine's half
class QuantizedKV:
    """The quantized pool behind the pool interface (``jaxkv.cache.pools``): mode,
    geometry, allocator, the device layers, and the host plans behind every
    quantized write. Methods that write return the new cache; methods that
    allocate take the KV manager as ``room`` (its ``reclaim`` frees radix-cached
    slots).

    Attributes:
      mode: a name of ``MODES``; geometry: the pool's ``Geometry``;
      token_kind: INT4 (FLOAT for ``kivi2``/``kivi4``): decode tokens and unplanned prefills;
      residual: KIVI's residual length (``kivi2``/``kivi4``) or None; page_bits: the
      page region's code width (4 for ``kivi4``, else 2); allocator: ``DualAllocator``;
      layers: the ``QuantLayers`` the engine's jit'd steps call.
      rotation: the pool's ``jaxkv.cache.rotation.Rotation`` when ``rotate`` (every
        region, float window included, stores ``K·R``, ``V·R``; the readers here
        hand out the model's frame), else None.
    """

    whole_chunks = True  # INT2 pages are planned per chunk: a step takes a job's chunk whole

    def __init__(self, mode: str, geometry: Geometry, *, head_dim: int, float_dtype, rotate: bool = False):
        self.mode = check_mode(mode)
        self.geometry = geometry
        kivi = mode in KIVI_PAGE_BITS
        self.token_kind = FLOAT if kivi else INT4
        self.residual = KIVI_RESIDUAL if kivi else None
        self.page_bits = KIVI_PAGE_BITS.get(mode, 2)
        self.head_dim = head_dim
        self.float_dtype = np.dtype(float_dtype)
        self.allocator = DualAllocator(geometry, self.token_kind)
        self.rotation = Rotation(head_dim) if rotate else None
        self.layers = QuantLayers(geometry, self.token_kind, self.rotation)

    @classmethod
    def sized(cls, mode: str, num_slots: int, *, head_dim: int, float_dtype, rotate: bool = False) -> "QuantizedKV":
        """A pool whose token region holds ``num_slots - 1`` tokens (as a float pool
        of ``num_slots`` would) and, except for ``int4``, as many more in INT2 pages:
        room for any mix."""
        mode = check_mode(mode)
        if head_dim % 32:
            raise ConfigError(f"kv_quant needs head_dim divisible by 32, got {head_dim}")
        n = max(int(num_slots) - 1, 1)
        pages = 1 if mode == "int4" else 1 + -(-n // PAGE)
        geo = Geometry(pages, 1, n) if mode in KIVI_PAGE_BITS else Geometry(pages, n, 0)
        return cls(mode, geo, head_dim=head_dim, float_dtype=float_dtype, rotate=rotate)

    def check_mesh(self, mesh) -> None:
        """Any mesh jaxkv accepts: every region is split by KV head (its axis 2),
        the page tables and slot tables replicated, as the float pool's."""

    def cache_factory(self, cfg, *, rows: int, positions: int, dtype, lists: int = 1):
        """A zero-argument function making the empty cache (as ``FloatKV``'s)."""
        self._positions = int(positions)  # the decode plans' widths (``decode_plan``)
        return functools.partial(
            QuantizedKVCache.create,
            self.geometry,
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            rows=rows,
            positions=positions,
            dtype=dtype,
            page_bits=self.page_bits,
            lists=lists,
        )

    # -- allocation ------------------------------------------------------------------
    def _make_room(self, room, pages: int, tokens: int) -> int:
        """Reclaim radix-cached slots until ``pages`` INT2 pages and ``tokens``
        token-region slots are free or nothing more comes back; returns how many
        pages can be had (the token region must fit, ``OutOfSlotsError`` else)."""
        alloc = self.allocator
        while (alloc.pages_free < pages or alloc.num_free < tokens) and room.reclaim is not None:
            before = (alloc.pages_free, alloc.num_free)
            room.reclaim(PAGE * max(pages - alloc.pages_free, 0) + max(tokens - alloc.num_free, 0))
            if (alloc.pages_free, alloc.num_free) == before:
                break
        return min(pages, alloc.pages_free)

    def _fit(self, room, kinds, groups) -> list:
        """Make room for a plan (reclaiming radix-cached slots); pages the pool
        cannot give become INT4, last chunk first. ``OutOfSlotsError`` (nothing
        allocated) when the token region cannot hold the rest."""
        want = sum(g.shape[0] for g in groups)
        drop = want - self._make_room(room, want, int((kinds != INT2).sum()))
        for c in reversed(range(len(groups))):
            k = min(drop, groups[c].shape[0])
            if k > 0:
                kinds[groups[c][-k:].reshape(-1)] = INT4
                groups[c] = groups[c][:-k]
                drop -= k
        n_tok = int((kinds != INT2).sum())
        self._make_room(room, 0, n_tok)
        if n_tok > self.allocator.num_free:
            raise OutOfSlotsError(f"the write needs {n_tok} KV slots, {self.allocator.num_free} free")
        return groups

    def _allocate(self, kinds, groups) -> np.ndarray:
        slots = np.zeros(kinds.size, np.int32)
        slots[kinds != INT2] = self.allocator.allocate(int((kinds != INT2).sum()))
        for g in groups:
            if g.shape[0]:
                slots[g.reshape(-1)] = self.allocator.allocate_pages(np.full(g.shape[0], PAGE))[1]
        return slots

    def plan(self, room, bits, n: int, chunk: int) -> WritePlan:
        """Slots for ``n`` new tokens: ``bits [n]`` (2 or 4 per token; None: the
        token kind) through the page-completion rule. Nothing changes on failure
        (``OutOfSlotsError``, ``ConfigError``)."""
        if bits is None or self.token_kind == FLOAT:
            kinds = np.full(n, self.token_kind, np.int8)
        else:
            bits = np.asarray(bits).reshape(-1)
            if bits.size != n:
                raise ConfigError(f"kv_bits has {bits.size} entries for {n} tokens")
            if not np.isin(bits, (INT2, INT4)).all():
                raise ConfigError(f"kv_bits must be 2 or 4 per token, got {np.unique(bits).tolist()}")
            kinds = np.where((bits == INT2) & (self.geometry.pages > 1), INT2, INT4).astype(np.int8)
        groups = self._fit(room, kinds, page_groups(kinds, chunk))
        slots = self._allocate(kinds, groups)
        pages = [(slots[g[:, 0]] // PAGE if g.shape[0] else np.zeros(0, np.int32), g) for g in groups]
        return WritePlan(slots, kinds, pages, chunk)

    def plan_prefill(self, room, kv_bits, n: int, chunk: int):
        """``(WritePlan, slots)`` of a prefill of ``n`` tokens (``plan``, pages per
        ``chunk`` tokens)."""
        plan = self.plan(room, kv_bits, n, chunk)
        return plan, plan.slots

    def step_plan(self, pieces, starts, T: int):
        """The INT2 page plan of a step of ``T`` flat tokens: the pages of each
        job's piece (one whole chunk of its plan: ``whole_chunks``), as flat token
        indices ``page_src [T/32, 32]`` and page ids ``[T/32]`` (padding id: the
        page count, dropped by the write)."""
        Q = max(T // PAGE, 1)
        src = np.zeros((Q, PAGE), np.int32)
        ids = np.full(Q, self.geometry.pages, np.int32)
        q = 0
        for (job, _), start in zip(pieces, starts):
            page_ids, groups = job.kv_plan.pages[job.done // job.kv_plan.chunk]
            src[q : q + page_ids.size] = groups - job.done + start
            ids[q : q + page_ids.size] = page_ids
            q += page_ids.size
        return src, ids

    def decode_plan(self, states, new_slots, B: int, steps: int) -> DecodeParts:
        """The reading plan of a decode call (``DecodeParts``): each row's INT2 pages
        with its bitmask, then its token part (INT4, or float for KIVI) with the
        call's new slots appended; widths fixed by the engine's positions, so the
        call's program does not depend on the rows' lengths. (Decode tokens are
        written by slot.) None when a row keeps per-layer sets
        (``RequestState.layer_live``): a page table is one per row, so such a call
        reads every row through its layers' live lists (``QuantReader``), as a
        prefill step does."""
        if any(st.layer_live is not None for st in states):
            return None
        from jaxkv.cache.quantized import PAGE_BLOCK
        from jaxkv.kernels.attention.ragged import KEY_BLOCK

        P = -(-self._positions // KEY_BLOCK) * KEY_BLOCK  # whole blocks of the decode loop
        Q = -(-(-(-P // PAGE)) // PAGE_BLOCK) * PAGE_BLOCK
        pages, masks = np.zeros((B, Q), np.int32), np.zeros((B, Q), np.uint32)
        tokens = np.zeros((B, P), np.int32)
        n2, nt, live0 = (np.zeros(B, np.int32) for _ in range(3))
        four = self.token_kind == INT4
        for b, (st, new) in enumerate(zip(states, new_slots)):
            t = self.page_table(st)
            if four and t.floats.size:
                raise SlotError("an INT4-decoding pool holds float tokens")
            part = np.concatenate([t.int4 if four else t.floats, np.asarray(new, np.int64)])
            pages[b, : t.pages.size], masks[b, : t.pages.size] = t.pages, t.masks
            tokens[b, : part.size] = part
            n2[b], nt[b], live0[b] = t.pages.size, (t.int4 if four else t.floats).size, len(st.live)
        return DecodeParts(pages, masks, n2, tokens, nt, live0)

    # -- page tables -------------------------------------------------------------------
    def page_table(self, state) -> PageTable:
        live = np.asarray(state.live, np.int64)
        kind = self.geometry.kind(live)
        s2 = live[kind == INT2]
        pages, inv = np.unique(s2 // PAGE, return_inverse=True)
        masks = np.zeros(pages.size, np.uint32)
        np.bitwise_or.at(masks, inv.reshape(-1), (np.uint32(1) << (s2 % PAGE).astype(np.uint32)))
        return PageTable(pages, masks, live[kind == INT4], live[kind == FLOAT])

    def composition(self, state) -> dict:
        """Live tokens of a request per bits per element: ``{2: n, 4: n, 16: n}``
        (``kivi4``'s page tokens count as 4: their bytes per token are INT4's,
        ``bytes_per_token``)."""
        kind = self.geometry.kind(np.asarray(state.live, np.int64))
        out = {INT2: 0, INT4: int((kind == INT4).sum()), FLOAT: int((kind == FLOAT).sum())}
        out[self.page_bits] += int((kind == INT2).sum())
        return out

    # -- moving rows ---------------------------------------------------------------------
    def settle(self, cache, room, state):
        """After a write: ``kivi2``/``kivi4`` move the row's float tokens older than the
        residual window into pages, in whole pages, oldest first (module
        docstring). ``None`` (nothing moved) or ``(cache, slots_P, released)``."""
        if not self.residual:
            return None
        slots = np.asarray(state.slots, np.int64)
        pos = np.flatnonzero((slots != SENTINEL_SLOT) & (self.geometry.kind(slots) == FLOAT))
        return self._into_pages(cache, room, slots, pos[pos < state.seq_len - self.residual])

    def requantize(self, cache, room, state, positions, bits):
        """Move the row's tokens at ``positions`` whose ``bits`` are 2 into INT2
        pages, whole pages in position order (the page-completion rule over those
        tokens: the ones that do not fill a page keep their precision): the
        precision a prefill with these ``kv_bits`` would have written, for tokens
        first written another way (a spliced prefill writes the token region)."""
        if self.geometry.pages <= 1:
            return None
        slots = np.asarray(state.slots, np.int64)
        pos = np.asarray(positions, np.int64)[np.asarray(bits).reshape(-1) == INT2]
        return self._into_pages(cache, room, slots, pos[(slots[pos] != SENTINEL_SLOT) & (self.geometry.kind(slots[pos]) != INT2)])

    def _into_pages(self, cache, room, slots, pos):
        """Re-encode the row's tokens at positions ``pos`` (in order) into fresh INT2
        pages, as many whole pages as they fill and the pool can give; the rest keep
        their slots. ``slots``: the row's slot map. Returns ``None`` or ``(cache, new
        slot map, the old slots to release)``."""
        n = PAGE * self._make_room(room, pos.size // PAGE, 0)
        if n == 0:
            return None
        pos = pos[:n]
        pages, fresh = self.allocator.allocate_pages(np.full(n // PAGE, PAGE))
        src = slots[pos]
        cache = self._rewrite(cache, src, fresh, np.zeros(n, np.int64), np.arange(n).reshape(-1, PAGE), pages)
        slots = slots.copy()
        slots[pos] = fresh
        return cache, slots, src

    def fresh_slots(self, room, state, positions) -> np.ndarray:
        """Fresh slots for a compact layout's kept ``positions`` (position order):
        INT2 tokens regrouped into whole pages (the rest INT4), INT4 and float
        tokens to their own region."""
        kinds = self.geometry.kind(np.asarray(state.slots, np.int64)[np.asarray(positions, np.int64)]).astype(np.int8)
        groups = self._fit(room, kinds, page_groups(kinds, max(kinds.size, 1)))
        return self._allocate(kinds, groups).astype(np.int64)

    def compact(self, cache, plan, rope) -> QuantizedKVCache:
        """Re-encode a compact plan's kept rows at their fresh slots, keys rotated
        by ``plan.delta`` (INT2 pages requantized from the rotated keys)."""
        dst = np.asarray(plan.copy_dst, np.int64)
        two = np.flatnonzero(self.geometry.kind(dst) == INT2)
        pages = np.unique(dst[two] // PAGE)
        src = np.zeros((pages.size, PAGE), np.int32)
        where = {int(s): m for m, s in zip(two, dst[two])}
        for q, p in enumerate(pages):
            src[q] = [where[int(p) * PAGE + t] for t in range(PAGE)]
        return self._rewrite(cache, plan.copy_src, dst, plan.delta, src, pages, rope)

    def _rewrite(self, cache, src, dst, delta, page_src, page_ids, rope=None):
        """``rewrite_rows`` with the row and page counts padded to buckets (one
        compile per bucket): padding rows read slot 0 and write nowhere (an INT2
        destination is written only by its page), padding pages go to page ``P2``."""
        M, Q = len(src), len(page_ids)
        Mp, Qp = bucket(M, minimum=PAGE), bucket(Q, minimum=1)
        pad = lambda a, n, fill=0: np.concatenate([np.asarray(a, np.int64).reshape(-1), np.full(n, fill, np.int64)]).astype(np.int32)
        page_src = np.concatenate([np.asarray(page_src, np.int64).reshape(-1, PAGE), np.zeros((Qp - Q, PAGE), np.int64)]).astype(np.int32)
        return rewrite_rows(
            cache,
            pad(src, Mp - M),
            pad(dst, Mp - M),
            pad(delta, Mp - M),
            page_src,
            pad(page_ids, Qp - Q, self.geometry.pages),
            rope=rope,
            rotation=self.rotation,
        )

    def gather_rows(self, cache, slots) -> tuple[np.ndarray, np.ndarray]:
        """Packed host copies (blobs) of the rows at ``slots``."""
        slots = np.asarray(slots, np.int64)
        M = slots.size
        pad = np.concatenate([slots, np.full(bucket(M, minimum=8) - M, SENTINEL_SLOT)])
        fields = {k: np.asarray(v)[:, :M] for k, v in gather_packed(cache, np.asarray(pad, np.int32)).items()}
        return encode_blobs(fields, self.geometry.kind(slots), self.head_dim, self.float_dtype, self.page_bits)

    def restore(self, cache, room, k_blob, v_blob, *, staged: bool = True):
        """Write shelved blobs back into fresh slots (bit-identical): ``(cache, the
        fresh slots in blob order)``. INT2 rows sharing page parameters share a page."""
        kinds, f = decode_blobs(np.asarray(k_blob), np.asarray(v_blob), self.head_dim, self.float_dtype, self.page_bits)
        M = kinds.size
        m2 = np.flatnonzero(kinds == INT2)
        groups: dict[bytes, list[int]] = {}
        for i, m in enumerate(m2):
            key = f["k2_scale"][:, i].tobytes() + f["k2_zero"][:, i].tobytes()
            groups.setdefault(key, []).append(i)
        chunks = [g[a : a + PAGE] for g in groups.values() for a in range(0, len(g), PAGE)]
        n_tok = int((kinds != INT2).sum())
        if self._make_room(room, len(chunks), n_tok) < len(chunks) or n_tok > self.allocator.num_free:
            raise OutOfSlotsError(f"promotion needs {len(chunks)} INT2 pages and {n_tok} slots")
        fresh = np.zeros(M, np.int64)
        fresh[kinds != INT2] = self.allocator.allocate(n_tok)
        pages, page_slots = (
            self.allocator.allocate_pages([len(c) for c in chunks]) if chunks else (np.zeros(0, np.int32), np.zeros(0, np.int32))
        )
        order = np.asarray([i for c in chunks for i in c], np.int64)  # INT2 rows (index into m2) in page order
        fresh[m2[order]] = page_slots
        L, _, K = np.asarray(k_blob).shape[:3]
        D, geo = self.head_dim, self.geometry
        m4, mf = np.flatnonzero(kinds == INT4), np.flatnonzero(kinds == FLOAT)
        pad = lambda a, n, fill: np.concatenate([a, np.full(n - a.shape[0], fill, a.dtype)]) if a.shape[0] < n else a
        padL = lambda a, n: np.concatenate([a, np.zeros((a.shape[0], n - a.shape[1], *a.shape[2:]), a.dtype)], axis=1)
        n4, n2, np_, nf = (bucket(x, minimum=8) for x in (m4.size, m2.size, pages.size, mf.size))
        rows = {
            "i4": pad(fresh[m4] - geo.off4, n4, geo.int4_slots).astype(np.int32),
            "page": pad(pages.astype(np.int64), np_, geo.pages).astype(np.int32),
            "p2": pad(page_slots.astype(np.int64) // PAGE, n2, geo.pages).astype(np.int32),
            "t2": pad(page_slots.astype(np.int64) % PAGE, n2, 0).astype(np.int32),
            "f": pad(fresh[mf] - geo.off_float, nf, geo.float_slots).astype(np.int32),
        }
        for name in ("k4_data", "k4_scale", "k4_zero", "v4_data", "v4_scale", "v4_zero"):
            rows[name] = padL(f[name], n4)
        for name in ("k2_data", "v2_data", "v2_scale", "v2_zero"):
            rows[name] = padL(f[name][:, order], n2)
        first = [c[0] for c in chunks]
        for name in ("k2_scale", "k2_zero"):
            rows[name] = padL(f[name][:, first], np_) if chunks else np.zeros((L, np_, K, D), np.float16)
        if geo.float_slots:
            rows["f_k"], rows["f_v"] = padL(f["f_k"], nf), padL(f["f_v"], nf)
        return write_packed(cache, rows), fresh

    def host_keys(self, k_blob) -> np.ndarray:
        """Float post-RoPE keys ``[L, M, K, D]`` of shelved blobs, in the model's frame."""
        k = blob_keys(np.asarray(k_blob), self.head_dim, self.float_dtype, self.page_bits)
        if self.rotation is None:
            return k
        s = self.rotation.signs(np.arange(k.shape[0])[:, None], k.shape[2], xp=np)
        return np.einsum("lmke,de->lmkd", k.astype(np.float32) * s, self.rotation.basis).astype(k.dtype)

    def gather_keys(self, cache, live) -> jax.Array:
        """Dequantized post-RoPE keys ``[L, N, K, D]`` float32 at ``live``, in the model's frame."""
        return gather_dequantized_keys(cache, np.asarray(live, np.int32), self.rotation)

    def gather_float(self, cache, slots) -> tuple[np.ndarray, np.ndarray]:
        """Dequantized K and V ``[L, M, K, D]`` float32 at ``slots``."""
        slots = np.asarray(slots, np.int64)
        M = slots.size
        pad = np.concatenate([slots, np.full(bucket(M, minimum=8) - M, SENTINEL_SLOT)]).astype(np.int32)
        k, v = gather_dequantized(cache, pad, self.rotation)
        return np.asarray(k)[:, :M], np.asarray(v)[:, :M]
