"""The CPU's attention over the dual quantized pool (``jaxkv.cache.quantized``):
the blocked XLA implementation dequantizing one key block at a time, and the
decode loop's window of dequantized entries as the backend's private state.

* **Steps** read every row's live list through ``QuantReader``, which gathers the
  packed rows of one key block and dequantizes them in the block loop: a step
  never holds a float copy of a live set. A step attends to its own tokens in
  full precision (``StepTokens``: the papers' protocol, attention in full
  precision while a prompt is prefilled); later steps read them quantized.
* **The decode loop** reads a float window of its rows' lists, the float pool's
  ``DecodeWindow`` (``jaxkv.backends.cpu_float``): every entry dequantized once,
  in list order, with the pool's arithmetic (``dequantize_at``: pages, INT4 rows
  and float slots alike), and the call's new tokens stored as the pool stores
  them (INT4 rows read back). It is kept for the next call over the same rows, as
  the float pool's is, so a long generation dequantizes its rows once and each step
  runs the float window's two GEMMs. Where no window is read (the pool too small
  for one, or KIVI's float residual), the loop reads by kind through the packed
  pool every step (``decode_parts_attention``, the pool's ``DecodeParts`` plan:
  the pages, INT2 and INT3 alike as 3-bit rows, then the token part).

Why a float window and not one of codes: a window of codes unpacked to uint8
(160 bytes per entry, head and layer at D = 64, against the float window's 512)
dequantized each block inside the online softmax every step, and decoded at
0.71-0.83x the float pool at 8,000 tokens on SmolLM2 (issue 74,
``eval/results/real_smollm2_quant/decode_speed_cpu_idle_2026-12-06.md``): the
dequantization, not the bytes, bounds a CPU step. The window is the active rows'
transient copy; the pool, which holds every session, stays quantized.

``QuantReader`` and ``StepTokens`` also serve ``QuantKernelBackend``'s steps of
several tokens per row (the fused kernels are decode kernels).

Invariants: every read dequantizes with the pool's own arithmetic
(``jaxkv.kernels.quant``), so the window, the packed reads and a kernel see the
same float32 values; the window's new part holds what the call's steps write to
the pool, as it reads back.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxkv.backends.base import AttentionBackend, AttentionMetadata
from jaxkv.backends.cpu_float import DecodeWindow, window_of_lists
from jaxkv.cache.quantized import (
    FLOAT,
    INT4,
    PAGE_BLOCK,
    DecodeParts,
    DualPool,
    Geometry,
    QuantizedKVCache,
    dequantize_at,
    dequantize_int2_tokens,
    page_params,
    page_rows,
)
from jaxkv.kernels.attention.ragged import KEY_BLOCK, MASKED, _online_step, pad_lists
from jaxkv.kernels.quant import PAGE, PackedRows, dequantize_codes, dequantize_rows, unpack


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
    ``q_len_R``, ``q_start_R`` ``[R]`` as in ``jaxkv.kernels.attention.ragged``.
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


def decode_parts_attention(pool: DualPool, geo: Geometry, i, q_RHD, plan: DecodeParts, kv_len_R, active_R, token_kind: int):
    """One query per row over its quantized entries, read by kind (``DecodeParts``):
    blocks of ``PAGE_BLOCK`` pages (INT2 or INT3; keys per channel over the page,
    values per token, the row's bits only), then blocks of INT4 tokens (or float ones), each
    block dequantized from the packed pool inside the loop and folded into one
    online softmax (``jaxkv.kernels.attention.ragged``'s). Layer ``i`` (static or
    traced) is read in place. Returns ``[R, Hq, D]`` float32, zero where inactive."""
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

        def page_block(j, state):
            ids = jax.lax.dynamic_slice_in_dim(plan.pages_RQ, j * PAGE_BLOCK, PAGE_BLOCK, axis=1)  # [R, B]
            listed = (j * PAGE_BLOCK + jnp.arange(PAGE_BLOCK))[None, :] < plan.n_pages_R[:, None]
            ids = jnp.where(listed, ids, 0)
            take = lambda a, p=ids: a[i, p]
            (kd, bits), (vd, _) = page_rows(pool, geo, 0, take, ids), page_rows(pool, geo, 1, take, ids)
            ks, kz = page_params(pool, geo, 0, take, ids)
            vs, vz = page_params(pool, geo, 1, take, ids)
            k = dequantize_int2_tokens(kd, ks[..., None, :], kz[..., None, :], bits)  # [R, B, K, 32, D]
            v = dequantize_codes(unpack(vd, bits), vs, vz)
            bits = jax.lax.dynamic_slice_in_dim(plan.mask_RQ, j * PAGE_BLOCK, PAGE_BLOCK, axis=1)
            held = ((bits[..., None] >> jnp.arange(PAGE, dtype=jnp.uint32)) & 1).astype(bool) & listed[..., None]  # [R, B, 32]
            to_rows = lambda x: jnp.transpose(x, (0, 1, 3, 2, 4)).reshape(R, PAGE_BLOCK * PAGE, K, D)
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
            row4 = lambda r: PackedRows(r.data[i, i4], r.scale[i, i4], r.zero[i, i4], r.bits)
            k, v = dequantize_rows(row4(pool.int4.k)), dequantize_rows(row4(pool.int4.v))
        return fold(state, k, v, valid)

    state = jax.lax.fori_loop(0, (jnp.max(jnp.where(active_R, n_tokens, 0)) + E - 1) // E, token_block, state)
    _, l, acc = state
    out = acc / jnp.maximum(l, 1e-30)[..., None]
    return jnp.where(active_R[:, None, None], out.reshape(R, Hq, D), 0.0)


@dataclasses.dataclass(frozen=True)
class CpuQuantBackend(AttentionBackend):
    """Blocked attention over the dual pool; the decode loop reads its plan by kind,
    or a kept float window of its rows' dequantized entries (module docstring)."""

    name = "cpu-quant"

    @property
    def geometry(self) -> Geometry:
        return self.layers.geometry

    @property
    def uses_window(self) -> bool:
        """Pools whose decode tokens are INT4 (``int4``, ``triaxial``); KIVI's float
        residual decodes through the packed pool."""
        return self.layers.token_kind == INT4

    def reader(self, kv, i, lists_RN, k_TKD=None, v_TKD=None, meta=None) -> QuantReader:
        fresh = None
        if k_TKD is not None and meta is not None:
            _, kv_len = meta.layer_list(i)
            fresh = StepTokens(k_TKD, v_TKD, kv_len, meta.q_len_R, meta.q_start_R)
        return QuantReader(kv, pad_lists(lists_RN), fresh, i, self.geometry)

    def attend_listed(self, kv, i, q_THD, k_TKD, v_TKD, meta: AttentionMetadata):
        if meta.decode and meta.read_plan is not None:
            _, kv_len = meta.layer_list(i)
            o = decode_parts_attention(kv, self.geometry, i, q_THD, meta.read_plan, kv_len, meta.active_R, self.layers.token_kind)
            return o.astype(q_THD.dtype)
        return self.attend_blocked(kv, i, q_THD, k_TKD, v_TKD, meta)

    def take_window(self, cache: QuantizedKVCache, rows_R, *, width: int, n_steps: int) -> DecodeWindow:
        """The rows' lists dequantized in list order with the pool's arithmetic
        (``dequantize_at``: pages, INT4 rows and float slots alike), and the call's new
        entries stored INT4, as the pool writes decode tokens."""
        pool, geo = cache.pool, cache.geometry
        def read(i, slots):
            return dequantize_at(pool, geo, i, slots)

        return window_of_lists(cache, rows_R, read, num_layers=pool.int4.k.data.shape[0], width=width, n_steps=n_steps, new_bits=4)
