"""The CPU's attention over the dual quantized pool (``jaxkv.cache.quantized``):
the blocked XLA implementation dequantizing one key block at a time, and the
decode loop's window of unpacked codes as the backend's private state.

* **Steps** read every row's live list through ``QuantReader``, which gathers the
  packed rows of one key block and dequantizes them in the block loop: a step
  never holds a float copy of a live set. A step attends to its own tokens in
  full precision (``StepTokens``: the papers' protocol, attention in full
  precision while a prompt is prefilled); later steps read them quantized.
* **The decode loop** reads by kind instead (the pool's ``DecodeParts`` plan: the
  pages, INT2 and INT3 alike as 3-bit rows where the pool has INT3 pages
  (``jaxkv.cache.quantized.page_rows``), then the token part): through the packed pool every step
  (``decode_parts_attention``), or through a per-call copy of the rows' entries
  (``QuantWindow``, taken once by ``take_quant_window``: codes unpacked to uint8
  with float32 parameters, token-major per KV head, dequantized block by block
  with the pool's arithmetic: contiguous blocks instead of a gather by slot per
  step, at 160 bytes per entry, head and layer for D = 64 against the pool's 80
  and the float window's 512; ``eval/bench/quant_decode.py`` times both paths).

``QuantReader`` and ``StepTokens`` also serve ``QuantKernelBackend``'s steps of
several tokens per row (the fused kernels are decode kernels).

Invariants: every read dequantizes with the pool's own arithmetic
(``jaxkv.kernels.quant``), so the window, the packed reads and a kernel see the
same float32 values; a window is taken per call (its new tokens are not folded
back, unlike the float window).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxkv.backends.base import AttentionBackend, AttentionMetadata
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
from jaxkv.kernels.quant import PAGE, GROUP, PackedRows, dequantize_codes, dequantize_rows, quantize_rows, unpack
from jaxkv.kernels.attention.ragged import KEY_BLOCK, MASKED, _online_step, pad_lists


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
            take = lambda a, p=ids: a[i, p]  # noqa: E731
            (kd, bits), (vd, _) = page_rows(pool, geo, 0, take, ids), page_rows(pool, geo, 1, take, ids)
            ks, kz = page_params(pool, geo, 0, take, ids)
            vs, vz = page_params(pool, geo, 1, take, ids)
            k = dequantize_int2_tokens(kd, ks[..., None, :], kz[..., None, :], bits)  # [R, B, K, 32, D]
            v = dequantize_codes(unpack(vd, bits), vs, vz)
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
        E = min(KEY_BLOCK, self.k[i].shape[2])  # the window's width: a power of two (``jaxkv.buckets.window_width``)
        per_key = E // GROUP if self.key_axis == -2 else E  # key parameters per block along W

        def block(j, state):
            cut = lambda a, at, n: jax.lax.dynamic_slice_in_dim(a, at, n, axis=a.ndim - 2)  # noqa: E731  (along W)
            e0 = j * E
            k = dequantize_codes(
                cut(self.k[i], e0, E), cut(self.k_scale[i], j * per_key, per_key), cut(self.k_zero[i], j * per_key, per_key), self.key_axis
            )
            v = dequantize_codes(cut(self.v[i], e0, E), cut(self.v_scale[i], e0, E), cut(self.v_zero[i], e0, E))
            s = jnp.einsum("rkgd,rked->rkge", q_RKGD, k)
            seen = jax.lax.dynamic_slice_in_dim(self.valid_RW, e0, E, axis=1) & active_R[:, None]
            return _online_step(state, jnp.where(seen[:, None, None, :], s, MASKED), v, "rkge,rked->rkgd")

        return jax.lax.fori_loop(0, (jnp.max(jnp.where(active_R, self.span_R, 0)) + E - 1) // E, block, state)


@struct.dataclass
class QuantWindow:
    """The CPU decode loop's copy of its rows' quantized entries
    (``take_quant_window``), the quantized pool's ``jaxkv.backends.cpu_float.DecodeWindow``:
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
        put = lambda parts, x: parts[:i] + (parts[i].at[rows, at].set(stored(x), mode="drop"),) + parts[i + 1 :]  # noqa: E731
        return self.replace(k_new=put(self.k_new, k_RKD), v_new=put(self.v_new, v_RKD))

    def attend(self, i: int, q_RHD, kv_len_R, active_R):
        """Layer ``i``'s attention of one query per row: the page part and the
        token part block by block, then the call's new tokens, in one online
        softmax (``jaxkv.kernels.attention.ragged``'s). Returns ``[R, Hq, D]``
        float32, zero where inactive."""
        R, Hq, D = q_RHD.shape
        K = self.k_new[i].shape[2]
        q = q_RHD.astype(jnp.float32).reshape(R, K, Hq // K, D) * (1.0 / np.sqrt(D))
        state = (
            jnp.full((R, K, Hq // K), MASKED, jnp.float32),
            jnp.zeros((R, K, Hq // K), jnp.float32),
            jnp.zeros((R, K, Hq // K, D), jnp.float32),
        )
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


def take_quant_window(cache: QuantizedKVCache, plan: DecodeParts, *, width: int, n_steps: int) -> QuantWindow:
    """The CPU decode loop's window of a decode call (``QuantWindow``): every
    layer's copy of each row's token part (entries ``[0, width)`` of the plan's
    token slots) and of its INT2 pages (``width / 32`` of them: the caller's width
    covers ``32 x`` the row's pages), and room for ``n_steps`` new tokens. Traced at
    the start of the decode program, as ``jaxkv.backends.cpu_float.take_window``."""
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
        rows(k4, codes4),
        rows(k4, scale4),
        rows(k4, zero4),
        rows(v4, codes4),
        rows(v4, scale4),
        rows(v4, zero4),
        jnp.arange(width)[None, :] < plan.n_tokens_R[:, None],
        plan.n_tokens_R,
        key_axis=-1,
    )
    pages = None
    if geo.pages > 1 and width >= PAGE:  # (a narrower window holds no whole page, so its rows have none)
        Wp = width // PAGE
        listed = jnp.arange(Wp)[None, :] < plan.n_pages_R[:, None]
        ids = jnp.where(listed, _widened(plan.pages_RQ, Wp), 0)  # [R, Wp]
        bits = _widened(plan.mask_RQ, Wp)
        held = ((bits[..., None] >> jnp.arange(PAGE, dtype=jnp.uint32)) & 1).astype(bool) & listed[..., None]
        tokens_of = lambda a: jnp.transpose(a, (0, 2, 1, 3, 4)).reshape(R, K, width, a.shape[-1])  # noqa: E731  [R, Wp, K, 32, X]
        paged = lambda r, field: tuple(tokens_of(field(r, i)) for i in range(L))  # noqa: E731
        codes2 = lambda which, i: unpack(*page_rows(pool, geo, which, lambda a, p=ids: a[i, p], ids))  # noqa: E731  (INT2 and INT3 pages)
        params = lambda which, i: page_params(pool, geo, which, lambda a, p=ids: a[i, p], ids)  # noqa: E731  (the one page reader)
        page_keys = lambda at: tuple(head_major(params(0, i)[at]) for i in range(L))  # noqa: E731  [R, K, Wp, D]
        pages = WindowPart(
            paged(0, codes2),
            page_keys(0),
            page_keys(1),
            paged(1, codes2),
            paged(1, lambda which, i: params(which, i)[0]),
            paged(1, lambda which, i: params(which, i)[1]),
            held.reshape(R, width),
            PAGE * plan.n_pages_R,
            key_axis=-2,
        )
    new = tuple(jnp.zeros((R, n_steps, K, D), jnp.float32) for _ in range(L))
    return QuantWindow(tokens, pages, new, new, plan.live0_R)


@dataclasses.dataclass(frozen=True)
class CpuQuantBackend(AttentionBackend):
    """Blocked attention over the dual pool; the decode loop reads its plan by kind,
    through a ``QuantWindow`` where one is taken (module docstring)."""

    name = "cpu-quant"
    keeps_window = False  # taken per call: its new tokens are not folded into its token part

    @property
    def geometry(self) -> Geometry:
        return self.layers.geometry

    @property
    def uses_window(self) -> bool:
        """INT4 tokens and INT2 pages; KIVI's float residual decodes through the packed pool."""
        return self.layers.token_kind == INT4

    def reader(self, kv, i, lists_RN, k_TKD=None, v_TKD=None, meta=None) -> QuantReader:
        fresh = None
        if k_TKD is not None and meta is not None:
            _, kv_len = meta.layer_list(i)
            fresh = StepTokens(k_TKD, v_TKD, kv_len, meta.q_len_R, meta.q_start_R)
        return QuantReader(kv, pad_lists(lists_RN), fresh, i, self.geometry)

    def attend_listed(self, kv, i, q_THD, k_TKD, v_TKD, meta: AttentionMetadata, loop_state=None):
        _, kv_len = meta.layer_list(i)
        if loop_state is not None:
            window = loop_state.append(i, k_TKD, v_TKD, kv_len, meta.active_R)
            return window.attend(i, q_THD, kv_len, meta.active_R).astype(q_THD.dtype), window
        if meta.decode and meta.read_plan is not None:
            o = decode_parts_attention(kv, self.geometry, i, q_THD, meta.read_plan, kv_len, meta.active_R, self.layers.token_kind)
            return o.astype(q_THD.dtype), None
        return self.attend_blocked(kv, i, q_THD, k_TKD, v_TKD, meta), None

    # -- host half ---------------------------------------------------------------------
    def window_entries(self, states, plan: DecodeParts | None) -> int:
        """Entries the window must hold: the longest token part or ``32 x`` the most
        INT2 pages, whichever is more (a page partly held still takes 32 entries).
        The float window's widths (``jaxkv.buckets.window_widths``), so the same
        programs serve."""
        longest = max(len(s.live) for s in states)
        return longest if plan is None else max(longest, PAGE * int(np.max(plan.n_pages_R)))

    def window_fits(self, plan: DecodeParts | None, width: int) -> bool:
        """Whether the call reads a window: not when it has no plan (rows with
        per-layer sets read through their live lists) or a row's pages do not fit
        the width (``window_entries`` past the positions' cap)."""
        return plan is not None and PAGE * int(np.max(plan.n_pages_R)) <= (width if width >= PAGE else 0)

    def take_window(self, cache, rows_R, plan: DecodeParts, *, width: int, n_steps: int) -> QuantWindow:
        return take_quant_window(cache, plan, width=width, n_steps=n_steps)
