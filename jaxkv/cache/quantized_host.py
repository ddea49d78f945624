"""``QuantizedKV``, the engine's quantized half: the host side of the dual
quantized pool (plans behind every write, page tables, moving and shelving rows).
The allocator, write plans, page tables and byte counts are
``jaxkv.cache.quantized_plans`` (re-exported here).

Modes (``Engine(kv_quant=...)``, ``Server(kv_quant=...)``):

* ``"int4"``: every token INT4 (one reserved INT2 page, no float region).
* ``"triaxial"`` (and its ablations ``"triaxial_no_temporal"``,
  ``"triaxial_no_semantic"``, which differ only in the allocation a session
  uses): prompt tokens INT2, INT3 or INT4 as the prefill's ``kv_bits`` say (the
  quantization stage derives them from tags and the calibrated allocation;
  INT3 tokens go to INT3 pages, ``Geometry.pages3``, as many as INT2 pages);
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

Page-completion rule: within one prefill chunk, the tokens meant for INT2 (and
apart, those meant for INT3) fill pages of 32 in position order; the last
``n % 32`` of them (those that do not fill a page) go to INT4 (TriAxialKV §3.2.1). Precision is fixed when a token is
written: a token matched through the radix prefix cache keeps the precision it
was first written with (its slot, hence its region, is the tree's).

``DualAllocator`` mirrors ``SlotAllocator``'s interface and invariants over the
three regions. Its ``capacity`` / ``num_free`` / ``num_used`` count the *token
region* (INT4, or float for ``kivi2``) only: every token can fall back to it (an
INT2 plan short of pages writes the rest as INT4), so admission that fits the
token region never over-commits; pages are extra room, reported by
``pages_free`` / ``pages_used`` (``pages_free_of(INT3)``: one kind).

The host tier's packed-row codec (shelved rows as uint8 blobs) is ``jaxkv.cache.blobs``.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from jaxkv.buckets import bucket
from jaxkv.cache.allocator import SENTINEL_SLOT
from jaxkv.cache.quantized import (
    FLOAT,
    INT2,
    INT3,
    INT4,
    PAGED,
    DecodeParts,
    Geometry,
    QuantizedKVCache,
    QuantLayers,
    is_paged,
)
from jaxkv.cache.quantized_rows import (
    gather_dequantized,
    gather_keys as gather_dequantized_keys,
    gather_packed,
    rewrite_rows,
    write_packed,
)
from jaxkv.cache.quantized_plans import (  # noqa: F401  (re-exported: the names callers import from here)
    KIVI_PAGE_BITS,
    KIVI_RESIDUAL,
    MODES,
    DualAllocator,
    PageTable,
    WritePlan,
    bytes_per_token,
    check_mode,
    elements_per_token,
    page_groups,
    servable_modes,
    stored_bits,
)
from jaxkv.errors import ConfigError, OutOfSlotsError, SlotError
from jaxkv.cache.blobs import blob_keys, decode_blobs, encode_blobs
from jaxkv.cache.rotation import Rotation
from jaxkv.kernels.quant import PAGE


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
      page region's code width (4 for ``kivi4``, else 2; INT3 pages keep their low
      planes there, ``jaxkv.cache.quantized``); allocator: ``DualAllocator``;
      layers: the ``QuantLayers`` the engine's jit'd steps call.
      rotation: the pool's ``jaxkv.cache.rotation.Rotation`` when ``rotate`` (every
        region, float window included, stores ``K·R``, ``V·R``; the readers here
        hand out the model's frame), else None.
    """

    whole_chunks = True  # pages are planned per chunk: a step takes a job's chunk whole

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
        of ``num_slots`` would) and, except for ``int4``, as many more in INT2 pages,
        and for the triaxial modes as many again in INT3 pages: room for any mix."""
        mode = check_mode(mode)
        if head_dim % 32:
            raise ConfigError(f"kv_quant needs head_dim divisible by 32, got {head_dim}")
        n = max(int(num_slots) - 1, 1)
        pages = 1 if mode == "int4" else 1 + -(-n // PAGE)
        pages3 = -(-n // PAGE) if mode.startswith("triaxial") else 0
        geo = Geometry(pages, 1, n) if mode in KIVI_PAGE_BITS else Geometry(pages + pages3, n, 0, pages3)
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
    def _make_room(self, room, pages: dict, tokens: int) -> dict:
        """Reclaim radix-cached slots until ``pages`` (``{INT2 or INT3: count}``)
        pages and ``tokens`` token-region slots are free or nothing more comes back;
        returns how many pages of each kind can be had (the token region must fit,
        ``OutOfSlotsError`` else)."""
        alloc = self.allocator
        short = lambda: sum(max(n - alloc.pages_free_of(k), 0) for k, n in pages.items())  # noqa: E731
        while (short() or alloc.num_free < tokens) and room.reclaim is not None:
            before = (alloc.pages_free, alloc.num_free)
            room.reclaim(PAGE * short() + max(tokens - alloc.num_free, 0))
            if (alloc.pages_free, alloc.num_free) == before:
                break
        return {k: min(n, alloc.pages_free_of(k)) for k, n in pages.items()}

    def _fit(self, room, kinds, groups) -> list:
        """Make room for a plan (reclaiming radix-cached slots); pages the pool
        cannot give become INT4, last chunk first. ``OutOfSlotsError`` (nothing
        allocated) when the token region cannot hold the rest."""
        want = {k: sum(int((kinds[g[:, 0]] == k).sum()) for g in groups) for k in PAGED}
        have = self._make_room(room, want, int((~is_paged(kinds)).sum()))
        for kind in PAGED:
            drop = want[kind] - have[kind]
            for c in reversed(range(len(groups))):
                mine = np.flatnonzero(kinds[groups[c][:, 0]] == kind)
                k = min(drop, mine.size)
                if k > 0:
                    kinds[groups[c][mine[-k:]].reshape(-1)] = INT4
                    groups[c] = np.delete(groups[c], mine[-k:], axis=0)
                    drop -= k
        n_tok = int((~is_paged(kinds)).sum())
        self._make_room(room, {}, n_tok)
        if n_tok > self.allocator.num_free:
            raise OutOfSlotsError(f"the write needs {n_tok} KV slots, {self.allocator.num_free} free")
        return groups

    def _allocate(self, kinds, groups) -> np.ndarray:
        slots = np.zeros(kinds.size, np.int32)
        tokens = ~is_paged(kinds)
        slots[tokens] = self.allocator.allocate(int(tokens.sum()))
        for g in groups:
            for kind in PAGED:
                mine = g[kinds[g[:, 0]] == kind]
                if mine.shape[0]:
                    slots[mine.reshape(-1)] = self.allocator.allocate_pages(np.full(mine.shape[0], PAGE), kind)[1]
        return slots

    def plan(self, room, bits, n: int, chunk: int) -> WritePlan:
        """Slots for ``n`` new tokens: ``bits [n]`` (2, 3 or 4 per token; None: the
        token kind) through the page-completion rule (a pool without pages of a
        width writes those tokens INT4). Nothing changes on failure
        (``OutOfSlotsError``, ``ConfigError``)."""
        if bits is None or self.token_kind == FLOAT:
            kinds = np.full(n, self.token_kind, np.int8)
        else:
            bits = np.asarray(bits).reshape(-1)
            if bits.size != n:
                raise ConfigError(f"kv_bits has {bits.size} entries for {n} tokens")
            if not np.isin(bits, (INT2, INT3, INT4)).all():
                raise ConfigError(f"kv_bits must be 2, 3 or 4 per token, got {np.unique(bits).tolist()}")
            geo = self.geometry
            kinds = np.where((bits == INT2) & (geo.first3 > 1), INT2, np.where((bits == INT3) & (geo.pages3 > 0), INT3, INT4)).astype(
                np.int8
            )
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
        """The page plan of a step of ``T`` flat tokens: the pages of each
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
        """The reading plan of a decode call (``DecodeParts``): each row's pages (INT2
        and INT3 alike) with its bitmask, then its token part (INT4, or float for KIVI) with the
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
        s2 = live[is_paged(kind)]
        pages, inv = np.unique(s2 // PAGE, return_inverse=True)
        masks = np.zeros(pages.size, np.uint32)
        np.bitwise_or.at(masks, inv.reshape(-1), (np.uint32(1) << (s2 % PAGE).astype(np.uint32)))
        return PageTable(pages, masks, live[kind == INT4], live[kind == FLOAT])

    def composition(self, state) -> dict:
        """Live tokens of a request per bits per element: ``{2: n, 3: n, 4: n, 16: n}``
        (``kivi4``'s page tokens count as 4: their bytes per token are INT4's,
        ``bytes_per_token``)."""
        kind = self.geometry.kind(np.asarray(state.live, np.int64))
        out = {INT2: 0, INT3: int((kind == INT3).sum()), INT4: int((kind == INT4).sum()), FLOAT: int((kind == FLOAT).sum())}
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
        """Move the row's tokens at ``positions`` whose ``bits`` are 2 (3) into INT2
        (INT3) pages, whole pages in position order (the page-completion rule over
        those tokens: the ones that do not fill a page keep their precision): the
        precision a prefill with these ``kv_bits`` would have written, for tokens
        first written another way (a spliced prefill writes the token region)."""
        geo = self.geometry
        slots = np.asarray(state.slots, np.int64)
        bits = np.asarray(bits).reshape(-1)
        done, released = None, []
        for kind, present in ((INT2, geo.first3 > 1), (INT3, geo.pages3 > 0)):
            pos = np.asarray(positions, np.int64)[bits == kind]
            moved = present and self._into_pages(
                cache, room, slots, pos[(slots[pos] != SENTINEL_SLOT) & ~is_paged(geo.kind(slots[pos]))], kind
            )
            if moved:
                cache, slots, old = moved
                done = (cache, slots)
                released.append(old)
        return None if done is None else (*done, np.concatenate(released))

    def _into_pages(self, cache, room, slots, pos, kind: int = INT2):
        """Re-encode the row's tokens at positions ``pos`` (in order) into fresh pages
        of ``kind``, as many whole pages as they fill and the pool can give; the rest
        keep their slots. ``slots``: the row's slot map. Returns ``None`` or ``(cache,
        new slot map, the old slots to release)``."""
        n = PAGE * self._make_room(room, {kind: pos.size // PAGE}, 0)[kind]
        if n == 0:
            return None
        pos = pos[:n]
        pages, fresh = self.allocator.allocate_pages(np.full(n // PAGE, PAGE), kind)
        src = slots[pos]
        cache = self._rewrite(cache, src, fresh, np.zeros(n, np.int64), np.arange(n).reshape(-1, PAGE), pages)
        slots = slots.copy()
        slots[pos] = fresh
        return cache, slots, src

    def fresh_slots(self, room, state, positions) -> np.ndarray:
        """Fresh slots for a compact layout's kept ``positions`` (position order):
        INT2 and INT3 tokens regrouped into whole pages of their kind (the rest
        INT4), INT4 and float tokens to their own region."""
        kinds = self.geometry.kind(np.asarray(state.slots, np.int64)[np.asarray(positions, np.int64)]).astype(np.int8)
        groups = self._fit(room, kinds, page_groups(kinds, max(kinds.size, 1)))
        return self._allocate(kinds, groups).astype(np.int64)

    def compact(self, cache, plan, rope) -> QuantizedKVCache:
        """Re-encode a compact plan's kept rows at their fresh slots, keys rotated
        by ``plan.delta`` (pages requantized from the rotated keys)."""
        dst = np.asarray(plan.copy_dst, np.int64)
        two = np.flatnonzero(is_paged(self.geometry.kind(dst)))
        pages = np.unique(dst[two] // PAGE)
        src = np.zeros((pages.size, PAGE), np.int32)
        where = {int(s): m for m, s in zip(two, dst[two])}
        for q, p in enumerate(pages):
            src[q] = [where[int(p) * PAGE + t] for t in range(PAGE)]
        return self._rewrite(cache, plan.copy_src, dst, plan.delta, src, pages, rope)

    def _rewrite(self, cache, src, dst, delta, page_src, page_ids, rope=None):
        """``rewrite_rows`` with the row and page counts padded to buckets (one
        compile per bucket): padding rows read slot 0 and write nowhere (a page
        destination is written only by its page), padding pages go to page ``P``."""
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
        return encode_blobs(fields, self.geometry.kind(slots), self.head_dim, self.float_dtype, self.row_bits)

    @property
    def row_bits(self) -> int:
        """The width of page rows as the host tier keeps them: 3 with INT3 pages
        (an INT2 row with a zero high plane, ``jaxkv.cache.quantized.page_rows``),
        else the page region's bits."""
        return 3 if self.geometry.pages3 else self.page_bits

    def restore(self, cache, room, k_blob, v_blob, *, staged: bool = True):
        """Write shelved blobs back into fresh slots (bit-identical): ``(cache, the
        fresh slots in blob order)``. Page rows (INT2 or INT3) of one kind sharing
        page parameters share a page of that kind."""
        kinds, f = decode_blobs(np.asarray(k_blob), np.asarray(v_blob), self.head_dim, self.float_dtype, self.row_bits)
        M = kinds.size
        paged = is_paged(kinds)
        m2 = np.flatnonzero(paged)
        groups: dict[tuple, list[int]] = {}
        for i, m in enumerate(m2):
            key = (int(kinds[m]), f["k2_scale"][:, i].tobytes() + f["k2_zero"][:, i].tobytes())
            groups.setdefault(key, []).append(i)
        chunks = {kind: [g[a : a + PAGE] for (k, _), g in groups.items() if k == kind for a in range(0, len(g), PAGE)] for kind in PAGED}
        n_tok = int((~paged).sum())
        want = {kind: len(c) for kind, c in chunks.items()}
        if self._make_room(room, want, n_tok) != want or n_tok > self.allocator.num_free:
            raise OutOfSlotsError(f"promotion needs {want[INT2]} INT2 pages, {want[INT3]} INT3 pages and {n_tok} slots")
        fresh = np.zeros(M, np.int64)
        fresh[~paged] = self.allocator.allocate(n_tok)
        got = [self.allocator.allocate_pages([len(c) for c in chunks[kind]], kind) for kind in PAGED if chunks[kind]]
        pages = np.concatenate([g[0] for g in got]) if got else np.zeros(0, np.int32)
        page_slots = np.concatenate([g[1] for g in got]) if got else np.zeros(0, np.int32)
        chunks = chunks[INT2] + chunks[INT3]  # the order the pages were allocated in
        order = np.asarray([i for c in chunks for i in c], np.int64)  # page rows (index into m2) in page order
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
        k = blob_keys(np.asarray(k_blob), self.head_dim, self.float_dtype, self.row_bits)
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
