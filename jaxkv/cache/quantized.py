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
in the page arrays, in the bytes an INT2 page's codes take, its high bit in
``DualPool.hi`` (``[L, pages3, K, 32, D/8]`` for keys and for values, indexed by
``page - first INT3 page``), and its parameters in ``DualPool.p3``: one-byte scale
codes and zero points (``jaxkv.kernels.quant3``), keys per channel over the page,
values per token in groups of 64 channels. Readers of a pool with INT3 pages go
through the one page reader: ``page_rows`` gives every page token as a 3-bit row
(the low row, then the high row, zero for an INT2 page, whose codes are then its
INT2 codes) and ``page_params`` its float32 scale and zero at one granularity
(keys per channel, values per 32 channels; an INT3 page's expanded), so one code
path dequantizes both tiers.

Shape letters: L layers, P2 pages, S4 INT4 slots, SF float slots, K = Hkv, D head
dim, B rows, T chunk tokens, Q pages written by a chunk, G = 32 tokens of a page,
N live entries, E page-table entries.

``DualPool`` attributes:
  int2: ``Int2Pool``: k.data ``[L, P2, K, 32, D/4]``, k.scale/zero ``[L, P2 - P3, K, D]``;
    v.data ``[L, P2, K, 32, D/4]``, v.scale/zero ``[L, P2 - P3, K, 32, D/32]``. A
    ``kivi4`` pool's pages hold 4-bit codes instead (data ``[..., D/2]``): the page
    region keeps its name and its INT2 token kind, and ``Int2Pool.bits`` says 4.
  int4: ``Int4Pool``: k/v.data ``[L, S4, K, D/2]``, k/v.scale/zero ``[L, S4, K, D/32]``.
  flt_k, flt_v: ``[L, SF, K, D]`` in the model dtype (``jaxkv.cache.state.float_pool_dtype``: float32 for bf16 on the CPU).
  hi: ``(k, v)`` uint8 ``[L, P3, K, 32, D/8]``, the INT3 pages' high bit-planes
    (None without INT3 pages: the pytree, and every program, of a pool without
    them is what it was before the tier).
  p3: the INT3 pages' parameters ``(k scale codes uint8 [L, P3, K, D], k zero
    points int8 [L, P3, K, D], v scale codes uint8 [L, P3, K, 32, D/G], v zero
    points int8 [...])``, ``G = jaxkv.kernels.quant3.value_group(D)`` (None without
    INT3 pages). The INT2 parameter arrays of ``int2`` hold the INT2 pages' rows
    only (``[L, P2 - P3, ...]``), so a pool's bytes per INT3 token are
    ``bytes_per_token``'s.

Moving rows as a whole (re-encoding at new slots, packed host copies and their
return) is ``jaxkv.cache.quantized_rows``.

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
from jaxkv.kernels.quant3 import params as params3, quantize_pages3, value_group
from jaxkv.errors import ConfigError
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
    p3: tuple | None = None

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
        P2p = geo.first3  # INT2 pages' parameter rows (an INT3 page's are ``p3``'s)
        int2 = Int2Pool(
            PackedKeyPages(jnp.zeros((L, P2, K, PAGE, R), u8), jnp.zeros((L, P2p, K, D), f16), jnp.zeros((L, P2p, K, D), f16), page_bits),
            PackedRows(
                jnp.zeros((L, P2, K, PAGE, R), u8),
                jnp.zeros((L, P2p, K, PAGE, D // 32), f16),
                jnp.zeros((L, P2p, K, PAGE, D // 32), f16),
                page_bits,
            ),
        )
        hi = p3 = None
        if geo.pages3:
            P3, Dg = geo.pages3, D // value_group(D)
            hi = tuple(jnp.zeros((L, P3, K, PAGE, D // 8), u8) for _ in range(2))
            p3 = (
                jnp.zeros((L, P3, K, D), u8),
                jnp.zeros((L, P3, K, D), jnp.int8),
                jnp.zeros((L, P3, K, PAGE, Dg), u8),
                jnp.zeros((L, P3, K, PAGE, Dg), jnp.int8),
            )
        return cls(int2, Int4Pool(rows(S4, 4), rows(S4, 4)), jnp.zeros((L, SF, K, D), dtype), jnp.zeros((L, SF, K, D), dtype), hi, p3)

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


def page_params(pool: DualPool, geo: Geometry, which: int, take, page):
    """float32 ``(scale, zero)`` of page tokens, the other half of the one page
    reader (``page_rows``: the codes): ``take(a)`` indexes a page-parameter array
    ``a`` (keys ``which = 0``: ``[P, K, D]``, per channel over the page; values 1:
    ``[P, K, 32, D/32]``, per token) the way the caller reads it, ``take(a, j)``
    with other page indices. An INT2 page's are its float16 parameters; an INT3
    page's its one-byte parameters (``jaxkv.kernels.quant3``) expanded to the same
    granularity, a 64-channel value group's pair repeated over its two 32-channel
    halves, so every reader dequantizes both tiers with ``zero + code * scale``."""
    p = (pool.int2.k, pool.int2.v)[which]
    scale, zero = take(p.scale).astype(jnp.float32), take(p.zero).astype(jnp.float32)  # (INT3 ids clamp; replaced below)
    if not geo.pages3:
        return scale, zero
    j = page - geo.first3
    jj = jnp.clip(j, 0, geo.pages3 - 1)
    D = pool.int2.k.scale.shape[-1]
    s3, z3 = params3(take(pool.p3[2 * which], jj), take(pool.p3[2 * which + 1], jj), 1 if which == 0 else value_group(D) // GROUP)
    own = (j >= 0).reshape(j.shape + (1,) * (s3.ndim - j.ndim))
    return jnp.where(own, s3, scale), jnp.where(own, z3, zero)


def _page_tokens(pool: DualPool, geo: Geometry, take_row, take_page, page):
    """float32 ``(k, v)`` of page tokens through the one page reader: ``take_row``
    indexes the per-token arrays ``[P, K, 32, ...]`` (codes, value parameters),
    ``take_page`` the per-page ones ``[P, K, D]`` (key parameters), both as the
    caller reads them with ``page`` the page ids."""
    (kd, bits), (vd, _) = page_rows(pool, geo, 0, take_row, page), page_rows(pool, geo, 1, take_row, page)
    ks, kz = page_params(pool, geo, 0, take_page, page)
    vs, vz = page_params(pool, geo, 1, take_row, page)
    return dequantize_int2_tokens(kd, ks, kz, bits), dequantize_codes(unpack(vd, bits), vs, vz)


def dequantize_slots(pool: DualPool, geo: Geometry, slots):
    """float32 ``(k, v)`` ``[..., K, D]`` of one layer's pool at ``slots [...]``."""
    slots = slots.astype(jnp.int32)
    kind = geo.kind(slots)
    i4 = jnp.clip(slots - geo.off4, 0, geo.int4_slots - 1)
    k = dequantize_rows(pool.int4.k.take(i4))
    v = dequantize_rows(pool.int4.v.take(i4))
    if geo.pages > 1:
        page, t = jnp.clip(slots // PAGE, 0, geo.pages - 1), slots % PAGE
        k2, v2 = _page_tokens(pool, geo, lambda a, p=page: a[p, :, t], lambda a, p=page: a[p], page)
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


def page3_fit(rotation) -> str:
    """How a pool fits its INT3 pages' parameters (``jaxkv.kernels.quant3.FITS``):
    ``"mse"`` for a rotated pool (``rotation`` not None), else ``"cover"``."""
    return "cover" if rotation is None else "mse"


def write_tokens(
    pool: DualPool, geo: Geometry, i, k_XKD, v_XKD, slots_X, page_src_QG=None, page_ids_Q=None, fit3: str = "cover"
) -> DualPool:
    """Store float K/V rows ``[X, K, D]`` into layer ``i`` of the pool at ``slots_X``.

    INT4 and float slots are written row by row (quantized per token for INT4).
    Pages are written whole: page ``page_ids_Q[q]`` is quantized from rows
    ``page_src_QG[q]`` (32 indices into X, in the page's token order) at its
    page's bits (an INT3 page: 3, its high plane into ``pool.hi``); page id
    ``geo.pages`` is padding. The page slots in ``slots_X`` are not used (a page
    plan says where page tokens go). ``fit3``: how INT3 pages' parameters are chosen
    (``page3_fit``).

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
        three = None
        if geo.pages3:  # the INT3 pages of the plan: their low planes here, high planes in ``hi``, parameters in ``p3``
            three = quantize_pages3(k_XKD[src], v_XKD[src], fit3)
            new = _with_int3_pages(new, three, ids >= geo.first3)
        kp = pool.int2.k
        put = lambda a, b: a.at[i, ids].set(b, mode="drop")
        pool = pool.replace(
            int2=Int2Pool(
                PackedKeyPages(put(kp.data, new.k.data), put(kp.scale, new.k.scale), put(kp.zero, new.k.zero), kp.bits),
                _scatter(pool.int2.v, (i, ids), new.v),
            )
        )
        if three is not None:
            low = kp.data.shape[-1]
            j = jnp.where(ids >= geo.first3, ids - geo.first3, geo.pages3)  # INT2 pages and padding: dropped
            high = (three.k_data[..., low:], three.v_data[..., low:])
            pool = pool.replace(
                hi=tuple(h.at[i, j].set(x, mode="drop") for h, x in zip(pool.hi, high)),
                p3=tuple(a.at[i, j].set(x, mode="drop") for a, x in zip(pool.p3, three.params())),
            )
    return pool


def _with_int3_pages(two: Int2Pool, three, is3_Q) -> Int2Pool:
    """Pages ``two`` (2-bit) with the low planes of ``three`` (``Pages3``) where
    ``is3_Q`` (their parameters are ``p3``'s: the INT2 parameter rows drop them)."""
    low = two.k.data.shape[-1]
    pick = lambda a, b: jnp.where(is3_Q.reshape((-1,) + (1,) * (a.ndim - 1)), b, a)  # noqa: E731
    k = PackedKeyPages(pick(two.k.data, three.k_data[..., :low]), two.k.scale, two.k.zero, 2)
    v = PackedRows(pick(two.v.data, three.v_data[..., :low]), two.v.scale, two.v.zero, 2)
    return Int2Pool(k, v)


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
        k2, v2 = _page_tokens(pool, geo, lambda a, p=page: a[i, p, :, t], lambda a, p=page: a[i, p], page)
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
        return write_tokens(pool, self.geometry, i, k_TKD, v_TKD, slots_T, page_src, page_ids, page3_fit(self.rotation))

    def read(self, pool: DualPool, i, slots_N):
        return dequantize_at(pool, self.geometry, i, slots_N)

    def read_pool(self, pool: DualPool, i):
        return dequantize_at(pool, self.geometry, i, jnp.arange(self.geometry.num_slots, dtype=jnp.int32))
