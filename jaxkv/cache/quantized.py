"""The dual quantized KV pool (TriAxialKV §3.2.2): device pytrees and the pure
functions and jit'd steps that read and write it.

One slot address space ``[0, S)`` split by three offsets (``Geometry``):

* ``[0, off4)``: the page region, in pages of 32 slots: page ``p`` is slots
  ``32p .. 32p+31`` and token ``t`` of the page is slot ``32p + t``. Page 0 is
  reserved and never written, so slot 0 stays the sentinel every table pads with.
  Its first pages ``[0, off3)`` are INT2 pages, the last ``pages3`` (slots
  ``[off3, off4)``) INT3 pages (none unless the geometry asks for them).
* ``[off4, offF)``: the INT4 region: slot ``s`` is INT4 row ``s - off4``.
* ``[offF, S)``: the float region (KIVI's full-precision residual window; empty
  for ``int4`` / ``triaxial`` pools): slot ``s`` is row ``s - offF``.

A token's precision is its slot's region, one comparison against the offsets
(``Geometry.kind``). Formats are ``jaxkv.kernels.quant``'s: INT2 (INT3) keys per
channel over a page's 32 tokens, INT2 (INT3) values per token, INT4 keys and values
per token in groups of 32 channels, float16 scale and zero point beside the codes.

An INT3 page is stored as ``jaxkv.kernels.quant``'s 2 + 1 split: its low two bits
in the page arrays, in the bytes an INT2 page's codes take, and its high bit in
``DualPool.hi`` (``[L, pages3, K, 32, D/8]`` for keys and for values, indexed by
``page - first INT3 page``). Readers of a pool with INT3 pages read every page
token as a 3-bit row (``page_rows``: the low row, then the high row, zero for an
INT2 page, whose codes are then its INT2 codes): one code path for both tiers.

Shape letters: L layers, P2 pages, S4 INT4 slots, SF float slots, K = Hkv, D head
dim, B rows, T chunk tokens, Q pages written by a chunk, G = 32 tokens of a page,
N live entries, E page-table entries.

``DualPool`` attributes:
  int2: ``Int2Pool``: k.data ``[L, P2, K, 32, D/4]``, k.scale/zero ``[L, P2, K, D]``;
    v.data ``[L, P2, K, 32, D/4]``, v.scale/zero ``[L, P2, K, 32, D/32]``. A
    ``kivi4`` pool's pages hold 4-bit codes instead (data ``[..., D/2]``): the page
    region keeps its name and its INT2 token kind, and ``Int2Pool.bits`` says 4.
  int4: ``Int4Pool``: k/v.data ``[L, S4, K, D/2]``, k/v.scale/zero ``[L, S4, K, D/32]``.
  flt_k, flt_v: ``[L, SF, K, D]`` in the model dtype (``jaxkv.cache.state.float_pool_dtype``: float32 for bf16 on the CPU).
  hi: ``(k, v)`` uint8 ``[L, P3, K, 32, D/8]``, the INT3 pages' high bit-planes
    (None without INT3 pages: the pytree, and every program, of a pool without
    them is what it was before the tier).

Writes (``write_tokens``) take a chunk's float K/V, one slot per token and a page
plan (which chunk tokens fill which INT2 page, in order): an INT2 page is quantized
from its 32 tokens at once (per-channel keys need the whole page), INT4 and float
tokens row by row. Each region's scatter drops the rows whose slot lies outside
it, so padding (slot 0, page id ``P2``) writes nowhere. Reads
(``dequantize_slots``) return float32 K/V at any slots, token by token.

The engine's programs (``jaxkv.forward``) write it through ``QuantLayers``: each
layer stores the step's tokens at their precision. Reading it is the attention
backends' business (``jaxkv.backends.cpu_quant``: a key block at a time through
the live lists, or by kind through ``DecodeParts``, the decode call's reading
plan built here by the host; ``jaxkv.backends.kernel_quant``: the fused
quantized decode kernels of ``jaxkv.kernels.attention.quantized``).

Invariants: page 0 is never written; a write touches only its slots and pages;
the same bytes always dequantize to the same float32 values, so packed rows moved
between slots (shelving, promotion) are bit-identical.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxkv.kernels.quant import (
    PAGE,
    Int2Pool,
    Int4Pool,
    PackedKeyPages,
    GROUP,
    PackedRows,
    dequantize_codes,
    dequantize_rows,
    quantize_int2_pool,
    quantize_rows,
    unpack,
)
from jaxkv.errors import ConfigError
from jaxkv.rope import apply_rope
from jaxkv.cache.rotation import Rotation
from jaxkv.cache.state import empty_tables

INT2, INT3, INT4, FLOAT = 2, 3, 4, 16  # token kinds: bits per element (FLOAT: full precision)
PAGED = (INT2, INT3)  # the kinds stored in pages


def is_paged(kind):
    """Whether a kind (numpy or jnp array, or int) is stored in pages (INT2 or INT3)."""
    return kind < INT4


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Sizes of the three regions (static under jit).

    Attributes:
      pages: pages ``P`` of the page region, the reserved page 0 included (>= 1):
        INT2 pages ``[0, P - P3)``, then INT3 pages.
      int4_slots: INT4 rows ``S4`` (>= 1: a KIVI pool keeps one unused row so
        the decode kernel's INT4 part is well formed). float_slots: float rows
        ``SF`` (0: none). pages3: INT3 pages ``P3`` (the last of the ``pages``; 0: none).
    """

    pages: int
    int4_slots: int
    float_slots: int = 0
    pages3: int = 0

    def __post_init__(self):
        if self.pages < 1 or self.int4_slots < 1 or self.float_slots < 0 or not 0 <= self.pages3 < self.pages:
            raise ConfigError(f"bad pool geometry {self}")

    @property
    def first3(self) -> int:
        """The first INT3 page (``pages`` when there is none)."""
        return self.pages - self.pages3

    @property
    def off3(self) -> int:
        return PAGE * self.first3

    @property
    def off4(self) -> int:
        return PAGE * self.pages

    @property
    def off_float(self) -> int:
        return self.off4 + self.int4_slots

    @property
    def num_slots(self) -> int:
        return self.off_float + self.float_slots

    def kind(self, slots):
        """``INT2`` / ``INT3`` / ``INT4`` / ``FLOAT`` of each slot (numpy or jnp, as given)."""
        xp = jnp if isinstance(slots, jax.Array) else np
        page = xp.where(slots < self.off3, INT2, INT3) if self.pages3 else INT2
        return xp.where(slots < self.off4, page, xp.where(slots < self.off_float, INT4, FLOAT))

    def page_kind(self, pages):
        """``INT2`` / ``INT3`` of page ids (numpy)."""
        return np.where(np.asarray(pages) < self.first3, INT2, INT3)


@struct.dataclass
class DualPool:
    """The packed page / INT4 regions, the float region and the INT3 pages' high
    bit-planes (module docstring)."""

    int2: Int2Pool
    int4: Int4Pool
    flt_k: jax.Array
    flt_v: jax.Array
    hi: tuple | None = None

    @classmethod
    def create(cls, geo: Geometry, *, num_layers, num_kv_heads, head_dim, dtype, page_bits: int = 2) -> "DualPool":
        """An empty pool; ``page_bits``: the page region's code width (2; ``kivi4``: 4;
        INT3 pages need 2, their low planes share the INT2 pages' rows)."""
        if geo.pages3 and page_bits != 2:
            raise ConfigError(f"INT3 pages share a 2-bit page region, not a {page_bits}-bit one")
        L, P2, S4, SF, K, D = num_layers, geo.pages, geo.int4_slots, geo.float_slots, num_kv_heads, head_dim
        u8, f16 = jnp.uint8, jnp.float16
        rows = lambda n, bits: PackedRows(
            jnp.zeros((L, n, K, D * bits // 8), u8), jnp.zeros((L, n, K, D // 32), f16), jnp.zeros((L, n, K, D // 32), f16), bits
        )
        R = D * page_bits // 8
        int2 = Int2Pool(
            PackedKeyPages(jnp.zeros((L, P2, K, PAGE, R), u8), jnp.zeros((L, P2, K, D), f16), jnp.zeros((L, P2, K, D), f16), page_bits),
            PackedRows(
                jnp.zeros((L, P2, K, PAGE, R), u8),
                jnp.zeros((L, P2, K, PAGE, D // 32), f16),
                jnp.zeros((L, P2, K, PAGE, D // 32), f16),
                page_bits,
            ),
        )
        hi = None
        if geo.pages3:
            hi = tuple(jnp.zeros((L, geo.pages3, K, PAGE, D // 8), u8) for _ in range(2))
        return cls(int2, Int4Pool(rows(S4, 4), rows(S4, 4)), jnp.zeros((L, SF, K, D), dtype), jnp.zeros((L, SF, K, D), dtype), hi)

    def layer(self, i) -> "DualPool":
        """One layer's pool (the leading L axis removed)."""
        return jax.tree.map(lambda a: a[i], self)


@struct.dataclass
class QuantizedKVCache:
    """``PagedKVCache``'s tables over a ``DualPool`` (same table fields and
    invariants; ``jaxkv.cache.state``'s ``take_rows``/``put_rows``/``append_tokens``
    work on it unchanged).

    Attributes:
      pool: the ``DualPool``. slot_map ``[R, P]``, live_idx ``[J, R, P]``,
      live_len ``[J, R]``, seq_len ``[R]``: as in ``PagedKVCache``.
      geometry: the ``Geometry`` (static).
    """

    pool: DualPool
    slot_map: jax.Array
    live_idx: jax.Array
    live_len: jax.Array
    seq_len: jax.Array
    geometry: Geometry = struct.field(pytree_node=False)

    @classmethod
    def create(cls, geo: Geometry, *, num_layers, num_kv_heads, head_dim, rows, positions, dtype, page_bits: int = 2, lists: int = 1):
        pool = DualPool.create(geo, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, page_bits=page_bits)
        return cls(pool, **empty_tables(rows, positions, lists), geometry=geo)

    @property
    def num_slots(self) -> int:
        return self.geometry.num_slots

    @property
    def rows(self) -> int:
        return self.slot_map.shape[0]

    @property
    def positions(self) -> int:
        return self.slot_map.shape[1]

    @property
    def kv(self) -> DualPool:
        """What a decode step reads and writes (``PagedKVCache.kv`` is ``(k, v)``)."""
        return self.pool

    def with_kv(self, pool: DualPool) -> "QuantizedKVCache":
        return self.replace(pool=pool)


# ============================================================================ reads
def dequantize_int2_tokens(data, scale, zero, bits: int = 2):
    """float32 keys of page tokens given each token's packed row ``[..., D*bits/8]``
    and its page's per-channel ``scale``/``zero`` ``[..., D]``."""
    return zero.astype(jnp.float32) + unpack(data, bits).astype(jnp.float32) * scale.astype(jnp.float32)


def page_rows(pool: DualPool, geo: Geometry, which: int, take, page):
    """Packed rows of page tokens and their width in bits: ``take(a)`` indexes a
    page array ``a`` (keys ``which = 0``, values 1) the way the caller reads it,
    ``page`` the page ids it reads (leading axes of what ``take`` returns). Without
    INT3 pages: the page arrays' rows at the region's bits; with them: 3-bit rows,
    the low plane from the page array and the high plane from ``pool.hi`` (zero
    for an INT2 page, so its codes read back as its INT2 codes)."""
    data = take((pool.int2.k, pool.int2.v)[which].data)
    if not geo.pages3:
        return data, pool.int2.bits
    j = page - geo.first3
    high = take(pool.hi[which], jnp.clip(j, 0, geo.pages3 - 1))
    own = (j >= 0).reshape(j.shape + (1,) * (high.ndim - j.ndim))
    return jnp.concatenate([data, jnp.where(own, high, jnp.uint8(0))], axis=-1), 3


def dequantize_slots(pool: DualPool, geo: Geometry, slots):
    """float32 ``(k, v)`` ``[..., K, D]`` of one layer's pool at ``slots [...]``."""
    slots = slots.astype(jnp.int32)
    kind = geo.kind(slots)
    i4 = jnp.clip(slots - geo.off4, 0, geo.int4_slots - 1)
    k = dequantize_rows(pool.int4.k.take(i4))
    v = dequantize_rows(pool.int4.v.take(i4))
    if geo.pages > 1:
        page, t = jnp.clip(slots // PAGE, 0, geo.pages - 1), slots % PAGE
        kp, vp = pool.int2.k, pool.int2.v
        kd, bits = page_rows(pool, geo, 0, lambda a, p=page: a[p, :, t], page)
        vd, _ = page_rows(pool, geo, 1, lambda a, p=page: a[p, :, t], page)
        k2 = dequantize_int2_tokens(kd, kp.scale[page], kp.zero[page], bits)
        v2 = dequantize_rows(PackedRows(vd, vp.scale[page, :, t], vp.zero[page, :, t], bits))
        two = is_paged(kind)[..., None, None]
        k, v = jnp.where(two, k2, k), jnp.where(two, v2, v)
    if geo.float_slots:
        f = jnp.clip(slots - geo.off_float, 0, geo.float_slots - 1)
        flt = (kind == FLOAT)[..., None, None]
        k = jnp.where(flt, pool.flt_k[f].astype(jnp.float32), k)
        v = jnp.where(flt, pool.flt_v[f].astype(jnp.float32), v)
    return k, v


# ============================================================================ writes
def _scatter(rows: PackedRows, at, new: PackedRows) -> PackedRows:
    put = lambda a, b: a.at[at].set(b, mode="drop")
    return PackedRows(put(rows.data, new.data), put(rows.scale, new.scale), put(rows.zero, new.zero), rows.bits)


def write_tokens(pool: DualPool, geo: Geometry, i, k_XKD, v_XKD, slots_X, page_src_QG=None, page_ids_Q=None) -> DualPool:
    """Store float K/V rows ``[X, K, D]`` into layer ``i`` of the pool at ``slots_X``.

    INT4 and float slots are written row by row (quantized per token for INT4).
    Pages are written whole: page ``page_ids_Q[q]`` is quantized from rows
    ``page_src_QG[q]`` (32 indices into X, in the page's token order) at its
    page's bits (an INT3 page: 3, its high plane into ``pool.hi``); page id
    ``geo.pages`` is padding. The page slots in ``slots_X`` are not used (a page
    plan says where page tokens go).

    Every scatter indexes the whole ``[L, ...]`` arrays at ``(i, rows)``: taking the
    layer out and setting it back made XLA:CPU copy every region's layer twice per
    layer and step, O(pool) per decode token (20x the float pool's step at 40,000
    slots for SmolLM2). Callers read the layer after writing it, for the same reason.
    """
    slots_X = slots_X.astype(jnp.int32)
    kind = geo.kind(slots_X)
    i4 = jnp.where(kind == INT4, slots_X - geo.off4, geo.int4_slots)
    pool = pool.replace(
        int4=Int4Pool(_scatter(pool.int4.k, (i, i4), quantize_rows(k_XKD, 4)), _scatter(pool.int4.v, (i, i4), quantize_rows(v_XKD, 4)))
    )
    if geo.float_slots:
        f = jnp.where(kind == FLOAT, slots_X - geo.off_float, geo.float_slots)
        pool = pool.replace(
            flt_k=pool.flt_k.at[i, f].set(k_XKD.astype(pool.flt_k.dtype), mode="drop"),
            flt_v=pool.flt_v.at[i, f].set(v_XKD.astype(pool.flt_v.dtype), mode="drop"),
        )
    if page_ids_Q is not None and page_ids_Q.shape[0]:
        src = page_src_QG.reshape(-1).astype(jnp.int32)
        new = quantize_int2_pool(k_XKD[src], v_XKD[src], pool.int2.bits)  # pages [Q, K, 32, ...]
        ids = page_ids_Q.astype(jnp.int32)
        high = None
        if geo.pages3:  # the INT3 pages of the plan: quantized at 3 bits, low plane here, high plane in ``hi``
            new, high = _with_int3_pages(new, quantize_int2_pool(k_XKD[src], v_XKD[src], 3), ids >= geo.first3)
        kp = pool.int2.k
        put = lambda a, b: a.at[i, ids].set(b, mode="drop")
        pool = pool.replace(
            int2=Int2Pool(
                PackedKeyPages(put(kp.data, new.k.data), put(kp.scale, new.k.scale), put(kp.zero, new.k.zero), kp.bits),
                _scatter(pool.int2.v, (i, ids), new.v),
            )
        )
        if high is not None:
            j = jnp.where(ids >= geo.first3, ids - geo.first3, geo.pages3)  # INT2 pages and padding: dropped
            pool = pool.replace(hi=tuple(h.at[i, j].set(x, mode="drop") for h, x in zip(pool.hi, high)))
    return pool


def _with_int3_pages(two: Int2Pool, three: Int2Pool, is3_Q):
    """Pages ``two`` (2-bit) with those where ``is3_Q`` taken from ``three`` (3-bit):
    their low planes and parameters in a 2-bit ``Int2Pool``, and their high planes
    ``(k, v)`` ``[Q, K, 32, D/8]``."""
    low = two.k.data.shape[-1]
    pick = lambda a, b: jnp.where(is3_Q.reshape((-1,) + (1,) * (a.ndim - 1)), b, a)  # noqa: E731
    k = PackedKeyPages(pick(two.k.data, three.k.data[..., :low]), pick(two.k.scale, three.k.scale), pick(two.k.zero, three.k.zero), 2)
    v = PackedRows(pick(two.v.data, three.v.data[..., :low]), pick(two.v.scale, three.v.scale), pick(two.v.zero, three.v.zero), 2)
    return Int2Pool(k, v), (three.k.data[..., low:], three.v.data[..., low:])


# ============================================================================ the engine's layers
def dequantize_at(pool: DualPool, geo: Geometry, i, slots):
    """``dequantize_slots`` of layer ``i`` without taking the layer out of the
    ``[L, ...]`` arrays (every gather indexes ``(i, slots)``): a read inside the
    attention's block loop that copies nothing but its rows."""
    slots = slots.astype(jnp.int32)
    kind = geo.kind(slots)
    i4 = jnp.clip(slots - geo.off4, 0, geo.int4_slots - 1)
    row4 = lambda r: PackedRows(r.data[i, i4], r.scale[i, i4], r.zero[i, i4], r.bits)  # noqa: E731
    k, v = dequantize_rows(row4(pool.int4.k)), dequantize_rows(row4(pool.int4.v))
    if geo.pages > 1:
        page, t = jnp.clip(slots // PAGE, 0, geo.pages - 1), slots % PAGE
        kp, vp = pool.int2.k, pool.int2.v
        kd, bits = page_rows(pool, geo, 0, lambda a, p=page: a[i, p, :, t], page)
        vd, _ = page_rows(pool, geo, 1, lambda a, p=page: a[i, p, :, t], page)
        k2 = dequantize_int2_tokens(kd, kp.scale[i, page], kp.zero[i, page], bits)
        v2 = dequantize_rows(PackedRows(vd, vp.scale[i, page, :, t], vp.zero[i, page, :, t], bits))
        two = is_paged(kind)[..., None, None]
        k, v = jnp.where(two, k2, k), jnp.where(two, v2, v)
    if geo.float_slots:
        f = jnp.clip(slots - geo.off_float, 0, geo.float_slots - 1)
        flt = (kind == FLOAT)[..., None, None]
        k = jnp.where(flt, pool.flt_k[i, f].astype(jnp.float32), k)
        v = jnp.where(flt, pool.flt_v[i, f].astype(jnp.float32), v)
    return k, v


@struct.dataclass
class DecodeParts:
    """A decode call's reading plan of each row's quantized entries, by kind
    (host-built per ``run_decode`` call; fixed widths, so one program serves every
    mix): the row's INT2 pages, then its token part (INT4 tokens, or KIVI's float
    residual), the call's new slots appended to the token part. Attention is a
    sum over entries, so the order does not matter; reading each kind in blocks of
    its own leaves no per-token branch between formats in the inner loop.

    Attributes:
      pages_RQ: page ids, ``n_pages_R`` of them per row; mask_RQ: uint32 bitmask of
        the row's tokens in each (a page shared with another row, or partly
        evicted, keeps only its own bits).
      tokens_RN: token-part slots, ``n_tokens_R`` before the call, then the slots
        the call's steps write (step ``s`` at ``n_tokens_R + s``).
      live0_R: the row's live-list length before the call (tokens appended so far
        = live length now - live0).
    """

    pages_RQ: jax.Array
    mask_RQ: jax.Array
    n_pages_R: jax.Array
    tokens_RN: jax.Array
    n_tokens_R: jax.Array
    live0_R: jax.Array


PAGE_BLOCK = 16  # INT2 pages per block of the decode plan and loop: 512 tokens, as the float path's key blocks


@dataclasses.dataclass(frozen=True)
class QuantLayers:
    """One layer's writes and reads of a ``DualPool`` (the interface of
    ``jaxkv.cache.pools.FloatLayers``; hashable, a static argument of the engine's
    programs).

    ``write`` stores float rows at their slots' precision: INT4 quantized per
    token, float as they are, INT2 pages whole by the step's page plan
    ``(page_src [Q, 32] flat token indices, page_ids [Q])`` (the INT2 slots in
    ``slots_T`` are not used; page id ``geometry.pages`` is padding; a decode step
    has no plan and writes by slot). ``read`` dequantizes rows at slots (the
    spliced prefill), ``read_pool`` the whole layer (the reference backend).
    Attention over the pool is the backends' business (``jaxkv.backends``).

    ``rotation``: a rotated pool's ``jaxkv.cache.rotation.Rotation`` (None: not
    rotated). ``write``, ``read`` and ``read_pool`` work in the stored frame (a
    rotated pool's ``K·R``, ``V·R``): the attention entry rotates the step's
    queries, keys and values into it before writing and attending and the output
    back (``AttentionBackend.rotate_in`` / ``rotate_out``); any other reader or
    writer goes through ``to_stored`` / ``from_stored``."""

    geometry: Geometry
    token_kind: int = INT4
    rotation: Rotation | None = None

    def to_stored(self, layer, x_KD):
        """Model-frame rows ``[..., K, D]`` of ``layer`` into the stored frame."""
        return x_KD if self.rotation is None else self.rotation.rotate(layer, x_KD)

    def from_stored(self, layer, x_KD):
        """Stored-frame rows back to the model's frame (what scorers, segments and RoPE read)."""
        return x_KD if self.rotation is None else self.rotation.unrotate(layer, x_KD)

    def write(self, pool: DualPool, i, k_TKD, v_TKD, slots_T, plan=None) -> DualPool:
        page_src, page_ids = plan if plan is not None else (None, None)
        return write_tokens(pool, self.geometry, i, k_TKD, v_TKD, slots_T, page_src, page_ids)

    def read(self, pool: DualPool, i, slots_N):
        return dequantize_at(pool, self.geometry, i, slots_N)

    def read_pool(self, pool: DualPool, i):
        return dequantize_at(pool, self.geometry, i, jnp.arange(self.geometry.num_slots, dtype=jnp.int32))


# ============================================================================ moving rows
@functools.partial(jax.jit, static_argnames=("rope", "rotation"), donate_argnames=("cache",))
def rewrite_rows(cache: QuantizedKVCache, src_M, dst_M, delta_M, page_src_QG, page_ids_Q, *, rope=None, rotation=None):
    """Re-encode rows: dequantize the rows at ``src_M`` (every layer), rotate their
    keys by ``delta_M`` positions when ``rope`` is given (a compact layout), and
    write them at ``dst_M`` with the page plan (``write_tokens``). Used to settle
    KIVI's aged residual into INT2 pages and to compact a quantized request. A
    rotated pool's keys leave the stored frame for the RoPE delta (``rotation``,
    ``QuantLayers.rotation``: RoPE's pairs are the model's channels) and return to it."""
    geo = cache.geometry
    pool = cache.pool
    L = pool.flt_k.shape[0]
    for i in range(L):
        k, v = dequantize_slots(pool.layer(i), geo, src_M)
        if rope is not None:
            k = k if rotation is None else rotation.unrotate(i, k)
            k = apply_rope(k, delta_M, rope)
            k = k if rotation is None else rotation.rotate(i, k)
        pool = write_tokens(pool, geo, i, k, v, dst_M, page_src_QG, page_ids_Q)
    return cache.with_kv(pool)


def _gather_layer(pool: DualPool, geo: Geometry, slots_M):
    """Packed fields of one layer at ``slots_M`` (every format; the host keeps the
    one each slot's kind names). Page rows are ``page_rows``': 3-bit rows (low
    plane, high plane) when the pool has INT3 pages."""
    i4 = jnp.clip(slots_M - geo.off4, 0, geo.int4_slots - 1)
    page, t = jnp.clip(slots_M // PAGE, 0, geo.pages - 1), slots_M % PAGE
    f = jnp.clip(slots_M - geo.off_float, 0, max(geo.float_slots - 1, 0))
    k2, v2 = pool.int2.k, pool.int2.v
    out = {
        "k4_data": pool.int4.k.data[i4],
        "k4_scale": pool.int4.k.scale[i4],
        "k4_zero": pool.int4.k.zero[i4],
        "v4_data": pool.int4.v.data[i4],
        "v4_scale": pool.int4.v.scale[i4],
        "v4_zero": pool.int4.v.zero[i4],
        "k2_data": page_rows(pool, geo, 0, lambda a, p=page: a[p, :, t], page)[0],
        "k2_scale": k2.scale[page],
        "k2_zero": k2.zero[page],
        "v2_data": page_rows(pool, geo, 1, lambda a, p=page: a[p, :, t], page)[0],
        "v2_scale": v2.scale[page, :, t],
        "v2_zero": v2.zero[page, :, t],
    }
    if geo.float_slots:
        out["f_k"], out["f_v"] = pool.flt_k[f], pool.flt_v[f]
    return out


def _model_frame(rotation, x_LMKD):
    """Stored-frame rows of every layer ``[L, M, K, D]`` back to the model's frame."""
    if rotation is None:
        return x_LMKD
    return rotation.unrotate(jnp.arange(x_LMKD.shape[0])[:, None], x_LMKD)


@functools.partial(jax.jit, static_argnames=("rotation",))
def gather_keys(cache: QuantizedKVCache, slots_N, rotation=None):
    """Dequantized keys of every layer at ``slots_N``: ``[L, N, K, D]`` float32, in
    the model's frame (a rotated pool's ``rotation`` undone)."""
    k = jax.vmap(lambda layer: dequantize_slots(layer, cache.geometry, slots_N)[0])(cache.pool)
    return _model_frame(rotation, k)


@functools.partial(jax.jit, static_argnames=("rotation",))
def gather_dequantized(cache: QuantizedKVCache, slots_M, rotation=None):
    """Dequantized keys and values of every layer at ``slots_M``: two ``[L, M, K, D]``
    float32, in the model's frame."""
    k, v = jax.vmap(lambda layer: dequantize_slots(layer, cache.geometry, slots_M))(cache.pool)
    return _model_frame(rotation, k), _model_frame(rotation, v)


@jax.jit
def gather_packed(cache: QuantizedKVCache, slots_M):
    """Packed fields of every layer at ``slots_M``: a dict of ``[L, M, K, ...]``."""
    return jax.vmap(lambda layer: _gather_layer(layer, cache.geometry, slots_M))(cache.pool)


@functools.partial(jax.jit, donate_argnames=("cache",))
def write_packed(cache: QuantizedKVCache, rows: dict):
    """Write packed rows back bit for bit (RepairKV promotion). ``rows`` holds
    ``[L, M, ...]`` fields: ``i4`` / ``k4_*`` / ``v4_*`` (INT4 rows), ``f`` /
    ``f_k`` / ``f_v`` (float rows), ``page`` / ``k2_scale`` / ``k2_zero`` (pages'
    per-channel key parameters) and ``p2`` / ``t2`` / ``k2_data`` / ``v2_*`` (INT2
    tokens: page and token index; with INT3 pages, 3-bit rows whose high plane goes
    to ``hi``, an INT2 page's dropped). Out-of-range indices (padding) are dropped."""
    geo = cache.geometry

    def one(layer: DualPool, r):
        at = lambda a, idx, b: a.at[idx].set(b, mode="drop")
        int4 = Int4Pool(
            PackedRows(
                at(layer.int4.k.data, r["i4"], r["k4_data"]),
                at(layer.int4.k.scale, r["i4"], r["k4_scale"]),
                at(layer.int4.k.zero, r["i4"], r["k4_zero"]),
                4,
            ),
            PackedRows(
                at(layer.int4.v.data, r["i4"], r["v4_data"]),
                at(layer.int4.v.scale, r["i4"], r["v4_scale"]),
                at(layer.int4.v.zero, r["i4"], r["v4_zero"]),
                4,
            ),
        )
        k2, v2 = layer.int2.k, layer.int2.v
        pt = (r["p2"], slice(None), r["t2"])
        k2_data, v2_data = r["k2_data"], r["v2_data"]
        if geo.pages3:  # 3-bit rows: the low plane to the page arrays, the high plane of INT3 pages to ``hi``
            low = k2.data.shape[-1]
            j = jnp.where(r["p2"] >= geo.first3, r["p2"] - geo.first3, geo.pages3)
            hj = (j, slice(None), r["t2"])
            layer = layer.replace(
                hi=(layer.hi[0].at[hj].set(k2_data[..., low:], mode="drop"), layer.hi[1].at[hj].set(v2_data[..., low:], mode="drop"))
            )
            k2_data, v2_data = k2_data[..., :low], v2_data[..., :low]
        int2 = Int2Pool(
            PackedKeyPages(
                k2.data.at[pt].set(k2_data, mode="drop"),
                at(k2.scale, r["page"], r["k2_scale"]),
                at(k2.zero, r["page"], r["k2_zero"]),
                k2.bits,
            ),
            PackedRows(
                v2.data.at[pt].set(v2_data, mode="drop"),
                v2.scale.at[pt].set(r["v2_scale"], mode="drop"),
                v2.zero.at[pt].set(r["v2_zero"], mode="drop"),
                v2.bits,
            ),
        )
        layer = layer.replace(int2=int2, int4=int4)
        if geo.float_slots:
            layer = layer.replace(flt_k=at(layer.flt_k, r["f"], r["f_k"]), flt_v=at(layer.flt_v, r["f"], r["f_v"]))
        return layer

    index_keys = ("i4", "f", "page", "p2", "t2")
    shared = {k: rows[k] for k in index_keys}
    per_layer = {k: v for k, v in rows.items() if k not in index_keys}
    pool = jax.vmap(lambda layer, r: one(layer, {**r, **shared}))(cache.pool, per_layer)
    return cache.with_kv(pool)
