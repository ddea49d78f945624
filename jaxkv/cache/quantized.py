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

Decode reads the request's *page table* (``DecodeTables``): its INT2 pages first
(page ids, with a bitmask of the page's tokens the request still holds), then its
INT4 slots, then its float slots, through ``jaxkv.pallas.quantized_decode_attention``;
tokens a decode step writes are appended to the INT4 part (the float part for
``kivi2``/``kivi4``). Prefill attends over the dequantized prefix plus its own chunk in full
precision, then stores the chunk quantized (``QuantPrefill``).

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

from jaxkv.attention import decode_attention_rows, prefill_attention
from jaxkv.pallas import quantized_decode_attention
from jaxkv.pallas.quant import (
    PAGE,
    Int2Pool,
    Int4Pool,
    PackedKeyPages,
    PackedRows,
    dequantize_rows,
    quantize_int2_pool,
    quantize_rows,
    unpack,
)
from jaxkv.rope import apply_rope

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
      pool: the ``DualPool``. slot_map ``[R, P]``, live_idx ``[R, P]``,
      live_len ``[R]``, seq_len ``[R]``: as in ``PagedKVCache``.
      geometry: the ``Geometry`` (static).
    """

    pool: DualPool
    slot_map: jax.Array
    live_idx: jax.Array
    live_len: jax.Array
    seq_len: jax.Array
    geometry: Geometry = struct.field(pytree_node=False)

    @classmethod
    def create(cls, geo: Geometry, *, num_layers, num_kv_heads, head_dim, rows, positions, dtype, page_bits: int = 2):
        pool = DualPool.create(geo, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                               page_bits=page_bits)
        z = lambda *shape: jnp.zeros(shape, jnp.int32)
        return cls(pool, z(rows, positions), z(rows, positions), z(rows), z(rows), geo)

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


def _flat_plan(page_src_BQG, page_ids_BQ, T):
    """Per-row page plans ``[B, Q, 32]`` (chunk indices) -> indices into ``B*T``."""
    B, Q = page_ids_BQ.shape
    src = page_src_BQG + (jnp.arange(B, dtype=jnp.int32) * T)[:, None, None]
    return src.reshape(B * Q, PAGE), page_ids_BQ.reshape(B * Q)


# ============================================================================ prefill
@dataclasses.dataclass(frozen=True)
class QuantPrefill:
    """One prefill chunk over a ``DualPool`` (hashable: a static argument of
    ``jaxkv.engine.prefill_step``; ``kv_args`` is the chunk's page plan
    ``(page_src [B, Q, 32], page_ids [B, Q])``): each layer stores the chunk
    quantized (INT2 pages by the page plan, the rest by slot), then attends over
    the row's dequantized live entries plus the chunk in full precision."""

    geometry: Geometry

    def __call__(self, model, batch, tables, positions, pool: DualPool, kv_args, n_read, features):
        geo = self.geometry
        page_src_BQG, page_ids_BQ = kv_args
        chunk_len_B, slots_BT, q_idx_BX = batch.chunk_len_B, batch.slots_BT, batch.q_idx_BX
        B, T = batch.tokens_BT.shape
        live = tables.live_idx[:, :n_read]
        src, ids = _flat_plan(page_src_BQG, page_ids_BQ, T)
        state = {"pool": pool}
        aux = {"q_rows": [], "attn_mass": []}

        def attend(i, q, k, v):
            # write first, then read (``write_tokens``): the chunk's slots and pages are
            # not among the live entries, so the read sees the same values
            K, D = k.shape[2:]
            state["pool"] = write_tokens(state["pool"], geo, i, k.reshape(B * T, K, D), v.reshape(B * T, K, D), slots_BT.reshape(-1), src, ids)
            k_cached, v_cached = dequantize_slots(state["pool"].layer(i), geo, live)
            o, mass = prefill_attention(q, k, v, k_cached, v_cached, tables.live_len, chunk_len_B, return_mass=features.attn_mass)
            if features.query_rows:
                aux["q_rows"].append(jnp.take_along_axis(q, q_idx_BX[:, :, None, None], axis=1))
            if features.attn_mass:
                aux["attn_mass"].append(mass)
            return o

        x = model.run_layers(model.embed_tokens(batch.tokens_BT), positions, attend)
        logits = model.logits(jnp.take_along_axis(x, batch.logit_idx_BY[:, :, None], axis=1))
        return logits, state["pool"], {name: jnp.stack(rows) for name, rows in aux.items() if rows}


@dataclasses.dataclass(frozen=True)
class QuantImport:
    """One chunk of an *imported* prefill over a ``DualPool``: float K/V computed
    elsewhere (``kv_args``: ``(page plan, k [L, B, T, K, D], v)``) stored exactly as
    ``QuantPrefill`` stores a chunk (INT2 pages by the plan, the rest by slot), with
    no forward. Placeholder logits ``[B, Y, 1]`` (``pools.FloatImport``)."""

    geometry: Geometry

    def __call__(self, model, batch, tables, positions, pool: DualPool, kv_args, n_read, features):
        (page_src_BQG, page_ids_BQ), k_LBTKD, v_LBTKD = kv_args
        L, B, T, K, D = k_LBTKD.shape
        src, ids = _flat_plan(page_src_BQG, page_ids_BQ, T)
        slots = batch.slots_BT.reshape(-1)
        for i in range(L):
            pool = write_tokens(pool, self.geometry, i, k_LBTKD[i].reshape(B * T, K, D), v_LBTKD[i].reshape(B * T, K, D), slots, src, ids)
        return jnp.zeros((B, batch.logit_idx_BY.shape[1], 1), jnp.float32), pool, {}


@dataclasses.dataclass(frozen=True)
class QuantLayerIO:
    """One layer's write and read of a ``DualPool`` in float (``jaxkv.splice``):
    rows written at their slots' precision (INT4 quantized per token, float as
    they are; INT2 slots, the sentinel among them, are not written), read back
    dequantized."""

    geometry: Geometry

    def write(self, pool: DualPool, i, k_XKD, v_XKD, slots_X) -> DualPool:
        return write_tokens(pool, self.geometry, i, k_XKD, v_XKD, slots_X)

    def read(self, pool: DualPool, i, slots_N):
        return dequantize_slots(pool.layer(i), self.geometry, slots_N)


# ============================================================================ decode
@struct.dataclass
class DecodeTables:
    """The page tables of a decode batch (host-built per ``step_decode`` call).

    Attributes:
      entries_BE: per row, its INT2 page ids (``n2`` of them), then its INT4
        slots (``n4``), then its float slots (``nf``), then the slots the loop's
        steps will write (appended to the decode kind's part), then padding.
      mask_BP: uint32 bitmask of the row's tokens in each listed page.
      n2_B, n4_B, nf_B: part lengths before the loop; live_len0_B: live-list
        length before the loop (tokens appended so far = live_len - live_len0).
      pages, int4, floats: static widths of the three parts.
    """

    entries_BE: jax.Array
    mask_BP: jax.Array
    n2_B: jax.Array
    n4_B: jax.Array
    nf_B: jax.Array
    live_len0_B: jax.Array
    pages: int = struct.field(pytree_node=False)
    int4: int = struct.field(pytree_node=False)
    floats: int = struct.field(pytree_node=False)


@dataclasses.dataclass(frozen=True)
class QuantDecodeStep:
    """One decode step over a ``DualPool`` (hashable: a static argument of
    ``jaxkv.engine.decode_loop``). The new token is written (INT4, or float for
    ``decode_kind == FLOAT``), then attention reads the page table through
    ``quantized_decode_attention``; with ``features.attn_mass`` it reads the
    dequantized live list through the reference instead (probabilities per
    live entry, as the float path reports them)."""

    geometry: Geometry
    decode_kind: int = INT4
    backend: str | None = None

    def __call__(self, model, tokens_B, positions_B, pool: DualPool, ops: DecodeTables, tables, write_slots_B, n_read, features, *, attend=None, window=None):
        # ``attend`` / ``window`` are the float pool's (a kernel backend, a gathered
        # window): this step reads the page tables with its own attention
        geo = self.geometry
        appended = tables.live_len - ops.live_len0_B
        n4 = ops.n4_B + (appended if self.decode_kind == INT4 else 0)
        nf = ops.nf_B + (appended if self.decode_kind == FLOAT else 0)
        take = lambda start, width: jnp.take_along_axis(ops.entries_BE, start[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :], axis=1)
        pages = ops.entries_BE[:, : ops.pages]
        idx4 = jnp.clip(take(ops.n2_B, ops.int4) - geo.off4, 0, geo.int4_slots - 1)
        idxf = jnp.clip(take(ops.n2_B + ops.n4_B, ops.floats) - geo.off_float, 0, max(geo.float_slots - 1, 0))
        live = tables.live_idx[:, :n_read]
        state = {"pool": pool}
        aux = {"q_rows": [], "attn_mass": []}

        def read_pages(i, q, k, v):
            state["pool"] = write_tokens(state["pool"], geo, i, k[:, 0], v[:, 0], write_slots_B)
            layer = state["pool"].layer(i)
            if features.attn_mass:
                kd, vd = dequantize_slots(layer, geo, live)
                o, probs = decode_attention_rows(q[:, 0], kd, vd, tables.live_len, return_probs=True)
                aux["attn_mass"].append(probs)
            else:
                o = quantized_decode_attention(
                    q[:, 0], layer.int2 if ops.pages else None, pages, ops.n2_B, layer.int4, idx4, n4,
                    int2_mask_BP=ops.mask_BP if ops.pages else None,
                    float_pool=(layer.flt_k, layer.flt_v) if ops.floats else None,
                    float_idx_BN=idxf if ops.floats else None, float_len_B=nf if ops.floats else None,
                    backend=self.backend,
                )
            if features.query_rows:
                aux["q_rows"].append(q)
            return o[:, None]

        x = model.run_layers(model.embed_tokens(tokens_B[:, None]), positions_B[:, None], read_pages)
        logits = model.logits(x)[:, 0]
        return logits, state["pool"], {name: jnp.stack(rows) for name, rows in aux.items() if rows}


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
