"""The dual quantized KV pool (TriAxialKV §3.2.2): device pytrees and the pure
functions and jit'd steps that read and write it.

One slot address space ``[0, S)`` split by two offsets (``Geometry``):

* ``[0, off4)``: the INT2 region, in pages of 32 slots: page ``p`` is slots
  ``32p .. 32p+31`` and token ``t`` of the page is slot ``32p + t``. Page 0 is
  reserved and never written, so slot 0 stays the sentinel every table pads with.
* ``[off4, offF)``: the INT4 region: slot ``s`` is INT4 row ``s - off4``.
* ``[offF, S)``: the float region (KIVI's full-precision residual window; empty
  for ``int4`` / ``triaxial`` pools): slot ``s`` is row ``s - offF``.

A token's precision is its slot's region, one comparison against the offsets
(``Geometry.kind``). Formats are ``jaxkv.pallas.quant``'s: INT2 keys per channel
over a page's 32 tokens, INT2 values per token, INT4 keys and values per token in
groups of 32 channels, float16 scale and zero point beside the codes.

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

Writes (``write_tokens``) take a chunk's float K/V, one slot per token and a page
plan (which chunk tokens fill which INT2 page, in order): an INT2 page is quantized
from its 32 tokens at once (per-channel keys need the whole page), INT4 and float
tokens row by row. Each region's scatter drops the rows whose slot lies outside
it, so padding (slot 0, page id ``P2``) writes nowhere. Reads
(``dequantize_slots``) return float32 K/V at any slots, token by token.

The engine's steps (``jaxkv.step``) write and read it through ``QuantLayers``:
each layer stores the step's tokens at their precision, then the ragged paged
attention reads every row's live list through ``QuantReader``, which gathers the
packed rows of one key block and dequantizes them in the block loop; a step never
holds a float copy of a live set. A step attends to its own tokens in full
precision (``StepTokens``: the papers' protocol, attention in full precision while
a prompt is prefilled), and later steps read them quantized. The decode fast path
reads by kind instead (``DecodeParts``: INT2 pages, then the token part): through
the packed pool every step (``decode_parts_attention``), or, in the CPU decode
loop, through a per-call copy of the rows' entries (``QuantWindow``, taken once by
``gather_quant_window``: codes unpacked to uint8 with float32 parameters,
token-major per KV head, dequantized block by block with the pool's arithmetic:
contiguous blocks instead of a gather by slot per step, at 160 bytes per entry,
head and layer for D = 64 against the pool's 80 and the float window's 512;
``eval/bench/quant_decode.py`` times both paths).
``jaxkv.pallas.quantized_decode_attention``
(INT2 pages, then INT4 tokens, by page table) is the decode kernel family the
device check measures.

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

from jaxkv.pallas.quant import (
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
from jaxkv.rope import apply_rope
from jaxkv.cache.state import empty_tables

INT2, INT4, FLOAT = 2, 4, 16  # token kinds: bits per element (FLOAT: full precision)


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Sizes of the three regions (static under jit).

    Attributes:
      pages: INT2 pages ``P2``, the reserved page 0 included (>= 1).
      int4_slots: INT4 rows ``S4`` (>= 1: a KIVI pool keeps one unused row so
        the decode kernel's INT4 part is well formed). float_slots: float rows
        ``SF`` (0: none).
    """

    pages: int
    int4_slots: int
    float_slots: int = 0

    def __post_init__(self):
        if self.pages < 1 or self.int4_slots < 1 or self.float_slots < 0:
            raise ValueError(f"bad pool geometry {self}")

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
        """``INT2`` / ``INT4`` / ``FLOAT`` of each slot (numpy or jnp, as given)."""
        xp = jnp if isinstance(slots, jax.Array) else np
        return xp.where(slots < self.off4, INT2, xp.where(slots < self.off_float, INT4, FLOAT))


@struct.dataclass
class DualPool:
    """The packed INT2 / INT4 regions and the float region (module docstring)."""

    int2: Int2Pool
    int4: Int4Pool
    flt_k: jax.Array
    flt_v: jax.Array

    @classmethod
    def create(cls, geo: Geometry, *, num_layers, num_kv_heads, head_dim, dtype, page_bits: int = 2) -> "DualPool":
        """An empty pool; ``page_bits``: the page region's code width (2; ``kivi4``: 4)."""
        L, P2, S4, SF, K, D = num_layers, geo.pages, geo.int4_slots, geo.float_slots, num_kv_heads, head_dim
        u8, f16 = jnp.uint8, jnp.float16
        rows = lambda n, bits: PackedRows(jnp.zeros((L, n, K, D * bits // 8), u8), jnp.zeros((L, n, K, D // 32), f16), jnp.zeros((L, n, K, D // 32), f16), bits)
        R = D * page_bits // 8
        int2 = Int2Pool(
            PackedKeyPages(jnp.zeros((L, P2, K, PAGE, R), u8), jnp.zeros((L, P2, K, D), f16), jnp.zeros((L, P2, K, D), f16), page_bits),
            PackedRows(jnp.zeros((L, P2, K, PAGE, R), u8), jnp.zeros((L, P2, K, PAGE, D // 32), f16), jnp.zeros((L, P2, K, PAGE, D // 32), f16), page_bits),
        )
        return cls(int2, Int4Pool(rows(S4, 4), rows(S4, 4)), jnp.zeros((L, SF, K, D), dtype), jnp.zeros((L, SF, K, D), dtype))

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
        pool = DualPool.create(geo, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                               page_bits=page_bits)
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
        k2 = dequantize_int2_tokens(kp.data[page, :, t], kp.scale[page], kp.zero[page], kp.bits)
        v2 = dequantize_rows(PackedRows(vp.data[page, :, t], vp.scale[page, :, t], vp.zero[page, :, t], vp.bits))
        two = (kind == INT2)[..., None, None]
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
    INT2 pages are written whole: page ``page_ids_Q[q]`` is quantized from rows
    ``page_src_QG[q]`` (32 indices into X, in the page's token order); page id
    ``geo.pages`` is padding. The INT2 slots in ``slots_X`` are not used (a page
    plan says where INT2 tokens go).

    Every scatter indexes the whole ``[L, ...]`` arrays at ``(i, rows)``: taking the
    layer out and setting it back made XLA:CPU copy every region's layer twice per
    layer and step, O(pool) per decode token (20x the float pool's step at 40,000
    slots for SmolLM2). Callers read the layer after writing it, for the same reason.
    """
    slots_X = slots_X.astype(jnp.int32)
    kind = geo.kind(slots_X)
    i4 = jnp.where(kind == INT4, slots_X - geo.off4, geo.int4_slots)
    pool = pool.replace(int4=Int4Pool(
        _scatter(pool.int4.k, (i, i4), quantize_rows(k_XKD, 4)), _scatter(pool.int4.v, (i, i4), quantize_rows(v_XKD, 4))
    ))
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
        kp = pool.int2.k
        put = lambda a, b: a.at[i, ids].set(b, mode="drop")
        pool = pool.replace(int2=Int2Pool(
            PackedKeyPages(put(kp.data, new.k.data), put(kp.scale, new.k.scale), put(kp.zero, new.k.zero), kp.bits),
            _scatter(pool.int2.v, (i, ids), new.v),
        ))
    return pool


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
        k2 = dequantize_int2_tokens(kp.data[i, page, :, t], kp.scale[i, page], kp.zero[i, page], kp.bits)
        v2 = dequantize_rows(PackedRows(vp.data[i, page, :, t], vp.scale[i, page, :, t], vp.zero[i, page, :, t], vp.bits))
        two = (kind == INT2)[..., None, None]
        k, v = jnp.where(two, k2, k), jnp.where(two, v2, v)
    if geo.float_slots:
        f = jnp.clip(slots - geo.off_float, 0, geo.float_slots - 1)
        flt = (kind == FLOAT)[..., None, None]
        k = jnp.where(flt, pool.flt_k[i, f].astype(jnp.float32), k)
        v = jnp.where(flt, pool.flt_v[i, f].astype(jnp.float32), v)
    return k, v


@struct.dataclass
class StepTokens:
    """The step's own tokens in full precision, for the attention of that step.

    A step stores its tokens quantized, but a prefill piece attends to its own
    tokens as computed: the papers' protocol (KIVI, TriAxialKV: attention in full
    precision during the prefill, the cache quantized for what comes after). A
    decode token reads itself back quantized. A row's new tokens are the last
    ``q_len`` entries of its list, entry ``kv_len - q_len + j`` being flat token
    ``q_start + j``.

    Attributes: ``k, v [T, K, D]`` the step's keys and values; ``kv_len_R``,
    ``q_len_R``, ``q_start_R`` ``[R]`` as in ``jaxkv.pallas.ragged_attention``.
    """

    k: jax.Array
    v: jax.Array
    kv_len_R: jax.Array
    q_len_R: jax.Array
    q_start_R: jax.Array

    def overlay(self, rows, e, k, v):
        """``k, v [..., E, K, D]`` of entries ``e [..., E]`` of ``rows [...]`` with the
        step's own tokens replaced by their float values."""
        base = (self.kv_len_R - self.q_len_R)[rows][..., None]
        fresh = (e >= base) & (e < self.kv_len_R[rows][..., None])
        flat = jnp.clip(self.q_start_R[rows][..., None] + e - base, 0, self.k.shape[0] - 1)
        pick = fresh[..., None, None]
        return jnp.where(pick, self.k[flat].astype(jnp.float32), k), jnp.where(pick, self.v[flat].astype(jnp.float32), v)


@struct.dataclass
class QuantReader:
    """Key blocks of a ``DualPool``'s layer through the rows' live lists,
    dequantized one block at a time (the ragged attention's reader: a step never
    holds a float copy of the live set).

    Attributes:
      pool: the whole ``DualPool``; layer: the layer read; live_RN: ``[R, N]`` slot
      ids per row (``N`` a multiple of the key block); fresh: the step's own tokens
      in full precision (``StepTokens``; None: read them back quantized);
      geometry: static.
    """

    pool: DualPool
    live_RN: jax.Array
    fresh: StepTokens | None
    layer: int = struct.field(pytree_node=False)
    geometry: Geometry = struct.field(pytree_node=False)

    @property
    def kv_heads(self) -> int:
        return self.pool.int4.k.data.shape[2]

    def gather(self, idx):
        return dequantize_at(self.pool, self.geometry, self.layer, idx)

    def row_block(self, r, e0, E: int):
        k, v = self.gather(jax.lax.dynamic_slice_in_dim(self.live_RN[r], e0, E))
        if self.fresh is None:
            return k, v
        return self.fresh.overlay(r, e0 + jnp.arange(E, dtype=jnp.int32), k, v)

    def rows_block(self, e0, E: int):
        """One-query rows (decode tokens) read their own new entry back quantized,
        as the decode kernels of the page-table layout always did."""
        return self.gather(jax.lax.dynamic_slice_in_dim(self.live_RN, e0, E, axis=1))


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


PAGE_BLOCK = 16  # INT2 pages per block of the decode loop: 512 tokens, as the float path's key blocks


def decode_parts_attention(pool: DualPool, geo: Geometry, i, q_RHD, plan: DecodeParts, kv_len_R, active_R, token_kind: int):
    """One query per row over its quantized entries, read by kind (``DecodeParts``):
    blocks of ``PAGE_BLOCK`` INT2 pages (keys per channel over the page, values per
    token, the row's bits only), then blocks of INT4 tokens (or float ones), each
    block dequantized from the packed pool inside the loop and folded into one
    online softmax (``jaxkv.pallas.ragged_attention``'s). Layer ``i`` (static or
    traced) is read in place. Returns ``[R, Hq, D]`` float32, zero where inactive."""
    from jaxkv.pallas.ragged_attention import KEY_BLOCK, MASKED, _online_step

    R, Hq, D = q_RHD.shape
    K = pool.int4.k.data.shape[2]
    G = Hq // K
    q = q_RHD.astype(jnp.float32).reshape(R, K, G, D) * (1.0 / np.sqrt(D))
    n_tokens = plan.n_tokens_R + (kv_len_R - plan.live0_R)
    state = (jnp.full((R, K, G), MASKED, jnp.float32), jnp.zeros((R, K, G), jnp.float32), jnp.zeros((R, K, G, D), jnp.float32))

    def fold(state, k_REKD, v_REKD, valid_RE):
        s = jnp.einsum("rkgd,rekd->rkge", q, k_REKD)
        s = jnp.where((valid_RE & active_R[:, None])[:, None, None, :], s, MASKED)
        return _online_step(state, s, v_REKD, "rkge,rekd->rkgd")

    if geo.pages > 1:
        kp, vp = pool.int2.k, pool.int2.v

        def page_block(j, state):
            ids = jax.lax.dynamic_slice_in_dim(plan.pages_RQ, j * PAGE_BLOCK, PAGE_BLOCK, axis=1)  # [R, B]
            listed = (j * PAGE_BLOCK + jnp.arange(PAGE_BLOCK))[None, :] < plan.n_pages_R[:, None]
            ids = jnp.where(listed, ids, 0)
            k = dequantize_int2_tokens(kp.data[i, ids], kp.scale[i, ids][..., None, :], kp.zero[i, ids][..., None, :], kp.bits)  # [R, B, K, 32, D]
            v = dequantize_rows(PackedRows(vp.data[i, ids], vp.scale[i, ids], vp.zero[i, ids], vp.bits))
            bits = jax.lax.dynamic_slice_in_dim(plan.mask_RQ, j * PAGE_BLOCK, PAGE_BLOCK, axis=1)
            held = ((bits[..., None] >> jnp.arange(PAGE, dtype=jnp.uint32)) & 1).astype(bool) & listed[..., None]  # [R, B, 32]
            to_rows = lambda x: jnp.transpose(x, (0, 1, 3, 2, 4)).reshape(R, PAGE_BLOCK * PAGE, K, D)  # noqa: E731
            return fold(state, to_rows(k), to_rows(v), held.reshape(R, PAGE_BLOCK * PAGE))

        state = jax.lax.fori_loop(0, (jnp.max(jnp.where(active_R, plan.n_pages_R, 0)) + PAGE_BLOCK - 1) // PAGE_BLOCK, page_block, state)

    E = KEY_BLOCK

    def token_block(j, state):
        slots = jax.lax.dynamic_slice_in_dim(plan.tokens_RN, j * E, E, axis=1)  # [R, E]
        valid = (j * E + jnp.arange(E))[None, :] < n_tokens[:, None]
        if token_kind == FLOAT:
            f = jnp.clip(slots - geo.off_float, 0, max(geo.float_slots - 1, 0))
            k, v = pool.flt_k[i, f].astype(jnp.float32), pool.flt_v[i, f].astype(jnp.float32)
        else:
            i4 = jnp.clip(slots - geo.off4, 0, geo.int4_slots - 1)
            row4 = lambda r: PackedRows(r.data[i, i4], r.scale[i, i4], r.zero[i, i4], r.bits)  # noqa: E731
            k, v = dequantize_rows(row4(pool.int4.k)), dequantize_rows(row4(pool.int4.v))
        return fold(state, k, v, valid)

    state = jax.lax.fori_loop(0, (jnp.max(jnp.where(active_R, n_tokens, 0)) + E - 1) // E, token_block, state)
    _, l, acc = state
    out = acc / jnp.maximum(l, 1e-30)[..., None]
    return jnp.where(active_R[:, None, None], out.reshape(R, Hq, D), 0.0)


# ============================================================================ the CPU decode loop's window
@struct.dataclass
class WindowPart:
    """One kind of the rows' quantized entries in a ``QuantWindow``: token-major per
    KV head (``[R, K, W, ...]``, each key block a contiguous slice), per layer
    (tuples of ``L`` arrays), codes unpacked to one uint8 per element and their
    parameters in float32, so a step dequantizes each block with the pool's
    arithmetic (``dequantize_codes``): the values a read of the pool gives, bit
    for bit.

    Attributes:
      k, v: key and value codes ``[R, K, W, D]``; v_scale / v_zero ``[R, K, W, D/32]``
        (per-token groups of channels); k_scale / k_zero: one entry per 32 along
        ``key_axis`` (-1: per-token groups, as the values; -2: an INT2 page's
        per-channel parameters over its 32 tokens, ``[R, K, W/32, D]``).
      valid_RW: the entries that count; span_R: entries up to the row's last one
        (the block loop's bound).
    """

    k: tuple
    k_scale: tuple
    k_zero: tuple
    v: tuple
    v_scale: tuple
    v_zero: tuple
    valid_RW: jax.Array
    span_R: jax.Array
    key_axis: int = struct.field(pytree_node=False)

    def fold(self, i: int, q_RKGD, state, active_R):
        """Layer ``i``'s entries folded, block by block, into the online softmax
        ``state`` of the scaled queries ``q_RKGD``."""
        from jaxkv.pallas.ragged_attention import KEY_BLOCK, MASKED, _online_step

        E = min(KEY_BLOCK, self.k[i].shape[2])  # the window's width: a power of two (``jaxkv.buckets.window_width``)
        per_key = E // GROUP if self.key_axis == -2 else E  # key parameters per block along W

        def block(j, state):
            cut = lambda a, at, n: jax.lax.dynamic_slice_in_dim(a, at, n, axis=a.ndim - 2)  # noqa: E731  (along W)
            e0 = j * E
            k = dequantize_codes(cut(self.k[i], e0, E), cut(self.k_scale[i], j * per_key, per_key), cut(self.k_zero[i], j * per_key, per_key), self.key_axis)
            v = dequantize_codes(cut(self.v[i], e0, E), cut(self.v_scale[i], e0, E), cut(self.v_zero[i], e0, E))
            s = jnp.einsum("rkgd,rked->rkge", q_RKGD, k)
            seen = jax.lax.dynamic_slice_in_dim(self.valid_RW, e0, E, axis=1) & active_R[:, None]
            return _online_step(state, jnp.where(seen[:, None, None, :], s, MASKED), v, "rkge,rked->rkgd")

        return jax.lax.fori_loop(0, (jnp.max(jnp.where(active_R, self.span_R, 0)) + E - 1) // E, block, state)


@struct.dataclass
class QuantWindow:
    """The CPU decode loop's copy of its rows' quantized entries
    (``gather_quant_window``), the quantized pool's ``jaxkv.cache.window.DecodeWindow``:
    taken once per ``run_decode`` call, read contiguously by every step instead of
    gathering packed rows from the pool by slot (``decode_parts_attention``).

    Attributes:
      tokens: the token part (``WindowPart``, INT4 per token): the entries of
        ``DecodeParts.tokens_RN`` before the call, in its order.
      pages: the INT2 pages of ``DecodeParts.pages_RQ``, whole, their tokens the
        row holds valid (None: an ``int4`` pool has no page region).
      k_new, v_new: ``[R, S, K, D]`` float32 per layer: the call's new tokens as a
        read of the pool gives them back (INT4, quantized then dequantized), step
        ``s`` of row ``r`` at ``kv_len - 1 - live0_R[r]``.
      live0_R: each row's live length before the call.
    """

    tokens: WindowPart
    pages: WindowPart | None
    k_new: tuple
    v_new: tuple
    live0_R: jax.Array

    def append(self, i: int, k_RKD, v_RKD, kv_len_R, active_R) -> "QuantWindow":
        """Layer ``i`` with each active row's new token written, as it reads back from the pool."""
        R, S = self.k_new[i].shape[:2]
        at = jnp.where(active_R, kv_len_R - 1 - self.live0_R, S)  # out of range: dropped
        rows = jnp.arange(R)
        stored = lambda x: dequantize_rows(quantize_rows(x, 4))  # noqa: E731  (write_tokens' INT4 rows, read back)
        put = lambda parts, x: parts[:i] + (parts[i].at[rows, at].set(stored(x), mode="drop"),) + parts[i + 1:]  # noqa: E731
        return self.replace(k_new=put(self.k_new, k_RKD), v_new=put(self.v_new, v_RKD))

    def attend(self, i: int, q_RHD, kv_len_R, active_R):
        """Layer ``i``'s attention of one query per row: the page part and the
        token part block by block, then the call's new tokens, in one online
        softmax (``jaxkv.pallas.ragged_attention``'s). Returns ``[R, Hq, D]``
        float32, zero where inactive."""
        from jaxkv.pallas.ragged_attention import MASKED, _online_step

        R, Hq, D = q_RHD.shape
        K = self.k_new[i].shape[2]
        q = q_RHD.astype(jnp.float32).reshape(R, K, Hq // K, D) * (1.0 / np.sqrt(D))
        state = (jnp.full((R, K, Hq // K), MASKED, jnp.float32), jnp.zeros((R, K, Hq // K), jnp.float32), jnp.zeros((R, K, Hq // K, D), jnp.float32))
        for part in (self.pages, self.tokens):
            if part is not None:
                state = part.fold(i, q, state, active_R)
        S = self.k_new[i].shape[1]
        s = jnp.einsum("rkgd,rskd->rkgs", q, self.k_new[i])
        seen = (jnp.arange(S)[None, :] < (kv_len_R - self.live0_R)[:, None]) & active_R[:, None]
        _, l, acc = _online_step(state, jnp.where(seen[:, None, None, :], s, MASKED), self.v_new[i], "rkgs,rskd->rkgd")
        out = acc / jnp.maximum(l, 1e-30)[..., None]
        return jnp.where(active_R[:, None, None], out.reshape(R, Hq, D), 0.0)


def _widened(a_RX, width: int):
    """``a_RX`` cut or zero-padded to ``width`` columns."""
    return a_RX[:, :width] if a_RX.shape[1] >= width else jnp.pad(a_RX, ((0, 0), (0, width - a_RX.shape[1])))


@functools.partial(jax.jit, static_argnames=("width", "n_steps"))
def gather_quant_window(cache: QuantizedKVCache, plan: DecodeParts, *, width: int, n_steps: int) -> QuantWindow:
    """The CPU decode loop's window of a decode call (``QuantWindow``): every
    layer's copy of each row's token part (entries ``[0, width)`` of the plan's
    token slots) and of its INT2 pages (``width / 32`` of them: the caller's width
    covers ``32 x`` the row's pages), and room for ``n_steps`` new tokens. A jit of
    its own, as ``jaxkv.cache.window.gather_window`` and for its reason (a pool read before
    the loop writes it made XLA:CPU copy the whole pool every call)."""
    geo, pool = cache.geometry, cache.pool
    L, _, K, _ = pool.int4.k.data.shape
    D = pool.int4.k.head_dim
    R = plan.tokens_RN.shape[0]
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    head_major = lambda a: jnp.transpose(a, (0, 2, 1, 3))  # noqa: E731  [R, W, K, X] -> [R, K, W, X]
    i4 = jnp.clip(_widened(plan.tokens_RN, width) - geo.off4, 0, geo.int4_slots - 1)  # [R, W]
    rows = lambda r, field: tuple(head_major(field(r, i)) for i in range(L))  # noqa: E731
    codes4 = lambda r, i: unpack(r.data[i, i4], 4)  # noqa: E731
    scale4, zero4 = (lambda r, i: f32(r.scale[i, i4])), (lambda r, i: f32(r.zero[i, i4]))
    k4, v4 = pool.int4.k, pool.int4.v
    tokens = WindowPart(
        rows(k4, codes4), rows(k4, scale4), rows(k4, zero4), rows(v4, codes4), rows(v4, scale4), rows(v4, zero4),
        jnp.arange(width)[None, :] < plan.n_tokens_R[:, None], plan.n_tokens_R, key_axis=-1,
    )
    pages = None
    if geo.pages > 1 and width >= PAGE:  # (a narrower window holds no whole page, so its rows have none)
        Wp = width // PAGE
        listed = jnp.arange(Wp)[None, :] < plan.n_pages_R[:, None]
        ids = jnp.where(listed, _widened(plan.pages_RQ, Wp), 0)  # [R, Wp]
        bits = _widened(plan.mask_RQ, Wp)
        held = ((bits[..., None] >> jnp.arange(PAGE, dtype=jnp.uint32)) & 1).astype(bool) & listed[..., None]
        kp, vp = pool.int2.k, pool.int2.v
        tokens_of = lambda a: jnp.transpose(a, (0, 2, 1, 3, 4)).reshape(R, K, width, a.shape[-1])  # noqa: E731  [R, Wp, K, 32, X]
        paged = lambda r, field: tuple(tokens_of(field(r, i)) for i in range(L))  # noqa: E731
        codes2 = lambda r, i: unpack(r.data[i, ids], r.bits)  # noqa: E731
        page_keys = lambda a: tuple(head_major(f32(a[i, ids])) for i in range(L))  # noqa: E731  [R, K, Wp, D]
        pages = WindowPart(
            paged(kp, codes2), page_keys(kp.scale), page_keys(kp.zero),
            paged(vp, codes2), paged(vp, lambda r, i: f32(r.scale[i, ids])), paged(vp, lambda r, i: f32(r.zero[i, ids])),
            held.reshape(R, width), PAGE * plan.n_pages_R, key_axis=-2,
        )
    new = tuple(jnp.zeros((R, n_steps, K, D), jnp.float32) for _ in range(L))
    return QuantWindow(tokens, pages, new, new, plan.live0_R)


@dataclasses.dataclass(frozen=True)
class QuantLayers:
    """One layer's writes and reads of a ``DualPool`` (the interface of
    ``jaxkv.cache.pools.FloatLayers``; hashable, a static argument of the steps).

    ``write`` stores float rows at their slots' precision: INT4 quantized per
    token, float as they are, INT2 pages whole by the step's page plan
    ``(page_src [Q, 32] flat token indices, page_ids [Q])`` (the INT2 slots in
    ``slots_T`` are not used; page id ``geometry.pages`` is padding). Reads
    dequantize: ``reader`` one key block at a time, ``read`` rows at slots (the
    spliced prefill), ``read_pool`` the whole layer (the reference backend). No
    kernel reads the dual pool inside a step yet (``kernel_pool`` is None): the
    blocked attention runs on every platform."""

    geometry: Geometry
    token_kind: int = INT4

    def write(self, pool: DualPool, i, k_TKD, v_TKD, slots_T, plan=None) -> DualPool:
        page_src, page_ids = plan if isinstance(plan, tuple) else (None, None)  # a step's INT2 page plan; decode writes by slot
        return write_tokens(pool, self.geometry, i, k_TKD, v_TKD, slots_T, page_src, page_ids)

    def reader(self, pool: DualPool, i, lists_RN, fresh: StepTokens | None = None) -> QuantReader:
        from jaxkv.pallas.ragged_attention import pad_lists

        return QuantReader(pool, pad_lists(lists_RN), fresh, i, self.geometry)

    def read(self, pool: DualPool, i, slots_N):
        return dequantize_at(pool, self.geometry, i, slots_N)

    def read_pool(self, pool: DualPool, i):
        return dequantize_at(pool, self.geometry, i, jnp.arange(self.geometry.num_slots, dtype=jnp.int32))

    def kernel_pool(self, pool: DualPool, i):
        return None

    def decode_rows(self, pool: DualPool, i, q_RHD, plan: DecodeParts, kv_len_R, active_R):
        """The decode fast path's attention (one query per row): by kind, from the
        packed pool (``decode_parts_attention``)."""
        return decode_parts_attention(pool, self.geometry, i, q_RHD, plan, kv_len_R, active_R, self.token_kind)


# ============================================================================ moving rows
@functools.partial(jax.jit, static_argnames=("rope",), donate_argnames=("cache",))
def rewrite_rows(cache: QuantizedKVCache, src_M, dst_M, delta_M, page_src_QG, page_ids_Q, *, rope=None):
    """Re-encode rows: dequantize the rows at ``src_M`` (every layer), rotate their
    keys by ``delta_M`` positions when ``rope`` is given (a compact layout), and
    write them at ``dst_M`` with the page plan (``write_tokens``). Used to settle
    KIVI's aged residual into INT2 pages and to compact a quantized request."""
    geo = cache.geometry
    pool = cache.pool
    L = pool.flt_k.shape[0]
    for i in range(L):
        k, v = dequantize_slots(pool.layer(i), geo, src_M)
        if rope is not None:
            k = apply_rope(k, delta_M, rope)
        pool = write_tokens(pool, geo, i, k, v, dst_M, page_src_QG, page_ids_Q)
    return cache.with_kv(pool)


def _gather_layer(pool: DualPool, geo: Geometry, slots_M):
    """Packed fields of one layer at ``slots_M`` (every format; the host keeps the
    one each slot's kind names)."""
    i4 = jnp.clip(slots_M - geo.off4, 0, geo.int4_slots - 1)
    page, t = jnp.clip(slots_M // PAGE, 0, geo.pages - 1), slots_M % PAGE
    f = jnp.clip(slots_M - geo.off_float, 0, max(geo.float_slots - 1, 0))
    k2, v2 = pool.int2.k, pool.int2.v
    out = {
        "k4_data": pool.int4.k.data[i4], "k4_scale": pool.int4.k.scale[i4], "k4_zero": pool.int4.k.zero[i4],
        "v4_data": pool.int4.v.data[i4], "v4_scale": pool.int4.v.scale[i4], "v4_zero": pool.int4.v.zero[i4],
        "k2_data": k2.data[page, :, t], "k2_scale": k2.scale[page], "k2_zero": k2.zero[page],
        "v2_data": v2.data[page, :, t], "v2_scale": v2.scale[page, :, t], "v2_zero": v2.zero[page, :, t],
    }
    if geo.float_slots:
        out["f_k"], out["f_v"] = pool.flt_k[f], pool.flt_v[f]
    return out


@jax.jit
def gather_keys(cache: QuantizedKVCache, slots_N):
    """Dequantized keys of every layer at ``slots_N``: ``[L, N, K, D]`` float32."""
    return jax.vmap(lambda layer: dequantize_slots(layer, cache.geometry, slots_N)[0])(cache.pool)


@jax.jit
def gather_dequantized(cache: QuantizedKVCache, slots_M):
    """Dequantized keys and values of every layer at ``slots_M``: two ``[L, M, K, D]`` float32."""
    return jax.vmap(lambda layer: dequantize_slots(layer, cache.geometry, slots_M))(cache.pool)


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
    tokens: page and token index). Out-of-range indices (padding) are dropped."""
    geo = cache.geometry

    def one(layer: DualPool, r):
        at = lambda a, idx, b: a.at[idx].set(b, mode="drop")
        int4 = Int4Pool(
            PackedRows(at(layer.int4.k.data, r["i4"], r["k4_data"]), at(layer.int4.k.scale, r["i4"], r["k4_scale"]), at(layer.int4.k.zero, r["i4"], r["k4_zero"]), 4),
            PackedRows(at(layer.int4.v.data, r["i4"], r["v4_data"]), at(layer.int4.v.scale, r["i4"], r["v4_scale"]), at(layer.int4.v.zero, r["i4"], r["v4_zero"]), 4),
        )
        k2, v2 = layer.int2.k, layer.int2.v
        pt = (r["p2"], slice(None), r["t2"])
        int2 = Int2Pool(
            PackedKeyPages(k2.data.at[pt].set(r["k2_data"], mode="drop"), at(k2.scale, r["page"], r["k2_scale"]), at(k2.zero, r["page"], r["k2_zero"]), k2.bits),
            PackedRows(v2.data.at[pt].set(r["v2_data"], mode="drop"), v2.scale.at[pt].set(r["v2_scale"], mode="drop"), v2.zero.at[pt].set(r["v2_zero"], mode="drop"), v2.bits),
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
