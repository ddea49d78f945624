"""Host bookkeeping of the dual quantized pool's slots: the modes, the bytes a
token of each format occupies, the allocator over the regions, write plans (the
page-completion rule) and page tables. ``jaxkv.cache.quantized_host`` (the
engine's quantized half, ``QuantizedKV``) builds on them and re-exports them.

Invariants: a page is handed out whole and comes back when its last slot's
reference goes; a page's kind (INT2 or INT3) is fixed by its id
(``Geometry.page_kind``); every count of bytes includes every scale and zero point
(``bytes_per_token``), so ``stored_bits`` is what the KV occupies.
"""

from __future__ import annotations

import dataclasses
import heapq

import numpy as np

from jaxkv.cache.allocator import RefCountedSlots
from jaxkv.cache.quantized import FLOAT, INT2, INT3, INT4, PAGED, Geometry, is_paged
from jaxkv.errors import ConfigError, OutOfSlotsError, SlotError
from jaxkv.kernels.quant import PAGE
from jaxkv.kernels.quant3 import page3_bytes

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
    over 32 tokens) ``+ (D/4 + 2*2*D/32)`` (values) ``= 0.75 D``; INT3 pages
    (``jaxkv.kernels.quant3.page3_bytes``) ``3D/8`` bytes of codes (low and high
    planes) for keys and for values, one-byte scale and zero point per channel over
    the page's 32 tokens (``2D/32``) and per value group of 64 channels (``2D/64``;
    32 where the head dim is not a multiple of 64), ``= 0.84375 D``; full precision
    counted as bf16, ``2 * 2D = 4 D``. Stored bits (``stored_bits``): INT2 3.0,
    INT3 3.375 (3.5 at a head dim of 32), INT4 5.0, float 16.
    """
    D = head_dim
    if kind not in (INT2, INT3, INT4, FLOAT):
        raise ConfigError(f"no KV format of {kind} bits")
    # INT3's own bytes only when asked: its page format needs a head dim quantized pools take, a float pool's may not
    per = page3_bytes(D) if kind == INT3 else {INT2: 0.75 * D, INT4: 1.25 * D, FLOAT: 4.0 * D}[kind]
    return per * num_layers * num_kv_heads


def elements_per_token(*, head_dim: int, num_layers: int, num_kv_heads: int) -> int:
    """K and V elements one token holds: ``2 D`` per layer and KV head."""
    return 2 * head_dim * num_layers * num_kv_heads


def stored_bits(nbytes: float, elements: float) -> float:
    """Stored bits per element, ``8 * bytes / elements``: the one definition every
    report of stored bits uses. ``nbytes`` counts everything the KV occupies (codes,
    every scale and zero point, float outliers and float-window rows, full precision
    as bf16; ``bytes_per_token``), so INT4 per token stores 5.0 bits, INT3 pages 3.375,
    INT2 pages 3.0 and the float pool 16.0, where the code widths alone say 4, 3, 2
    and 16."""
    return 8.0 * nbytes / elements


# ============================================================================ allocator
class DualAllocator(RefCountedSlots):
    """Reference counts over a ``Geometry``'s slots, one free list per region
    (``jaxkv.cache.quantized_host``'s docstring). Pages (INT2, and INT3 where the
    geometry has them, one free list each) are handed out whole
    (``allocate_pages``); rows and the radix cache reference their slots one by
    one, and a page goes back to its free list when all 32 of its slots are at
    refcount 0."""

    def __init__(self, geometry: Geometry, token_kind: int = INT4):
        super().__init__(geometry.num_slots)
        self.geometry = geometry
        self.token_kind = token_kind
        self._free_page = {INT2: list(range(1, geometry.first3)), INT3: list(range(geometry.first3, geometry.pages))}  # page 0: reserved
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
        """Free slots of a region (INT2, INT3: 32 per free page)."""
        return PAGE * len(self._free_page[kind]) if kind in PAGED else len(self._free[kind])

    def pages_free_of(self, kind: int) -> int:
        """Free pages of one kind (INT2 or INT3)."""
        return len(self._free_page[kind])

    @property
    def pages_free(self) -> int:
        """Free pages, INT2 and INT3."""
        return len(self._free_page[INT2]) + len(self._free_page[INT3])

    @property
    def pages_used(self) -> int:
        return self.geometry.pages - 1 - self.pages_free

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

    def allocate_pages(self, counts, kind: int = INT2) -> tuple[np.ndarray, np.ndarray]:
        """Whole pages of ``kind`` (INT2 or INT3), one per entry of ``counts``; the
        first ``counts[i]`` slots of page ``i`` get refcount 1. Returns ``(page ids,
        slots)``, slots in page order."""
        counts = np.asarray(counts, np.int64).reshape(-1)
        if kind not in PAGED:
            raise SlotError(f"pages are INT2 or INT3, not {kind}-bit")
        if ((counts < 1) | (counts > PAGE)).any():
            raise SlotError(f"a page holds 1 to {PAGE} tokens, got {counts.tolist()}")
        free = self._free_page[kind]
        if counts.size > len(free):
            raise OutOfSlotsError(f"asked for {counts.size} INT{kind} pages but only {len(free)} are free")
        pages = np.fromiter((heapq.heappop(free) for _ in range(counts.size)), dtype=np.int32, count=counts.size)
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
        paged = is_paged(self.geometry.kind(zero))
        freed = []
        for s in zero[~paged].tolist():
            heapq.heappush(self._free[int(self.geometry.kind(np.asarray(s)))], s)
            freed.append(np.asarray([s]))
        for p in np.unique(zero[paged] // PAGE).tolist():
            if self._page_out[p] and not self._refcount[p * PAGE : (p + 1) * PAGE].any():
                self._page_out[p] = False
                heapq.heappush(self._free_page[int(self.geometry.page_kind(p))], p)
                freed.append(p * PAGE + np.arange(PAGE))
        return np.concatenate(freed).astype(np.int32) if freed else np.zeros(0, np.int32)


# ============================================================================ plans
@dataclasses.dataclass
class WritePlan:
    """Where a run of new tokens goes.

    Attributes:
      slots: ``[T]`` int32, one slot per token (page tokens: their page slot).
      kinds: ``[T]`` int8, the kind each token is written as.
      pages: per chunk of ``chunk`` tokens, ``(page ids [Q], token indices [Q, 32])``
        (indices into the run, in page-token order; INT2 and INT3 pages alike, a
        page's kind is its id's).
    """

    slots: np.ndarray
    kinds: np.ndarray
    pages: list
    chunk: int


def page_groups(kinds, chunk: int):
    """Apply the page-completion rule to wanted ``kinds [T]`` (in place): per chunk
    and page kind (INT2, then INT3), the tokens of that kind in position order fill
    pages of 32, the rest become INT4. Returns per chunk the ``[Q, 32]`` token
    indices of its pages (its INT2 pages first; a page's kind is its tokens')."""
    groups = []
    for c in range(0, max(kinds.size, 1), chunk):
        pages = []
        for kind in PAGED:
            idx = np.flatnonzero(kinds[c : c + chunk] == kind) + c
            n = idx.size // PAGE * PAGE
            kinds[idx[n:]] = INT4
            pages.append(idx[:n].reshape(-1, PAGE))
        groups.append(np.concatenate(pages))
    return groups


@dataclasses.dataclass(frozen=True)
class PageTable:
    """A request's page table as decode reads it: pages first (INT2 and INT3 alike,
    in page order), then INT4 tokens, then float tokens (TriAxialKV §3.2.3).

    Attributes:
      pages: page ids; masks: uint32 bitmask of the request's tokens in each.
      int4: INT4 slots (position order); floats: float slots (position order).
    """

    pages: np.ndarray
    masks: np.ndarray
    int4: np.ndarray
    floats: np.ndarray

    def entries(self) -> np.ndarray:
        """The one list: page ids, then INT4 slots, then float slots."""
        return np.concatenate([self.pages, self.int4, self.floats]).astype(np.int64)
