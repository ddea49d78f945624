"""Mixed INT2/INT4 quantized decode attention (TriAxialKV): kernel and reference.

A request's KV entries are its INT2 pages first (``int2_pages_BP``, ``int2_num_pages_B``
pages of 32 tokens, in an ``Int2Pool``) then its INT4 tokens (``int4_idx_BN``,
``int4_len_B`` slots of an ``Int4Pool``); formats and packing are in
``jaxkv.kernels.quant``. Attention is over all of them; the result does not depend
on the order.

Kernels: on TPU and in interpret mode the Pallas split-K skeleton of ``_splitk``
runs once per part with a reader that
loads packed bytes and dequantizes on the fly, and ``_splitk.merge`` combines the
splits of both parts by log-sum-exp, so each split is bitwidth-homogeneous
(TriAxialKV §3.2.3). A request with no INT2 pages (only INT4 tokens) goes through
the same code: its INT2 splits are empty and weigh nothing in the merge. Pass
``int2_pool=None`` to skip the INT2 part entirely.

Dequantization is folded into the dots instead of materialising float K/V:

* per-token groups (INT4 K/V, INT2 V), for channel chunk ``c`` in group ``g``:
  ``q . k = sum_c scale[t,g] (q_c . code_c[t]) + zero[t,g] sum(q_c)`` and
  ``p @ v_c = (p * scale[:,g]) @ code_c + (p . zero[:,g])``;
* per-channel INT2 keys: ``q . k[t] = sum_c (q_c * scale_c) . code_c[t] + q . zero``.

INT2 pages are read one page (32 tokens) per step, INT4 tokens 64 per step. On
NVIDIA GPUs the Triton kernels ``decode_int4_tokens`` and ``decode_int2_pages``
(``jaxkv.kernels.triton.decode``) produce the same partials for the same merge. The
reference dequantizes the gathered entries to float32 and calls
``decode_attention_rows``.

Two optional parts serve the engine's dual pool (``jaxkv.cache.quantized``):

* ``int2_mask_BP``: a uint32 bitmask per listed page (bit ``t`` set: token ``t``
  of the page is read). A request whose eviction dropped some tokens of a page
  still lists the page, with those bits cleared; every listed page must keep at
  least one bit. A page's mask belongs to the request (two requests may share a
  page and keep different tokens), so the Pallas kernel reads entries ``b*P + j``
  of operands gathered per listed page (``masked_page_operands``: a copy of the
  listed INT2 pages plus keep flags, so the split-K skeleton is unchanged); the
  GPU path computes the masked INT2 part with the jnp partials of
  ``triton.decode.masked_int2_partials`` (the Triton INT2 kernel reads no mask yet).
* ``float_pool`` / ``float_idx_BN`` / ``float_len_B``: a third, full-precision
  part (KIVI's residual window of recent tokens), read by the float reader of
  ``decode_attention`` (Triton float kernel on GPU) and merged by the same
  log-sum-exp.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxkv.attention import decode_attention_rows
from jaxkv.kernels import _splitk
from jaxkv.kernels._dispatch import resolve_backend
from jaxkv.kernels.attention.decode import TOKEN_BLOCK, FloatTokens, check_decode_inputs
from jaxkv.kernels.quant import PAGE, Int2Pool, Int4Pool, dequantize_int2_keys, dequantize_rows, plane_chunks


def _codes(data, chunk, bits):
    """Codes of one chunk (``data`` uint8 ``[T, row bytes]``, the whole packed rows)
    as float32: one shift and mask of its bit-plane; at 3 bits the 2-bit low plane
    plus the 1-bit high plane times 4 (``jaxkv.kernels.quant``'s 2 + 1 split)."""
    cut = lambda at: data[:, at : at + chunk.width].astype(jnp.int32)  # noqa: E731
    if bits == 3:
        low = (cut(chunk.byte) >> (2 * chunk.plane)) & 3
        return (low + 4 * ((cut(chunk.hi_byte) >> chunk.hi_plane) & 1)).astype(jnp.float32)
    return ((cut(chunk.byte) >> (chunk.plane * bits)) & ((1 << bits) - 1)).astype(jnp.float32)


def _per_token_scores(q_GD, data_TR, scale_TC, zero_TC, bits):
    """``q . k`` ``[G, T]`` for per-token groups (rows of packed codes, one scale per 32 channels)."""
    s = 0.0
    for c in plane_chunks(q_GD.shape[-1], bits):
        q_c = q_GD[:, c.channel : c.channel + c.width].astype(jnp.float32)
        codes = _codes(data_TR, c, bits)
        scale = scale_TC[:, c.group].astype(jnp.float32)
        zero = zero_TC[:, c.group].astype(jnp.float32)
        s = s + _splitk.dot_nt(q_c, codes) * scale[None, :] + jnp.sum(q_c, axis=1, keepdims=True) * zero[None, :]
    return s


def _per_token_values(p_GT, data_TR, scale_TC, zero_TC, bits, head_dim):
    """``p @ v`` chunks ``[G, width]`` for per-token groups, in ``plane_chunks`` order."""
    out = []
    for c in plane_chunks(head_dim, bits):
        codes = _codes(data_TR, c, bits)
        scale = scale_TC[:, c.group].astype(jnp.float32)
        zero = zero_TC[:, c.group].astype(jnp.float32)
        out.append(_splitk.dot_nn(p_GT * scale[None, :], codes) + jnp.sum(p_GT * zero[None, :], axis=1, keepdims=True))
    return out


@dataclasses.dataclass(frozen=True)
class Int4Tokens:
    """Reader of INT4 K/V rows; buffers: k data/scale/zero, v data/scale/zero, each ``[K, block, ...]``."""

    head_dim: int
    block: int = TOKEN_BLOCK

    @property
    def out_chunks(self):
        return tuple((c.channel, c.width) for c in plane_chunks(self.head_dim, 4))

    def scores(self, q_GD, bufs, k):
        return [_per_token_scores(q_GD, bufs[0][k], bufs[1][k], bufs[2][k], 4)]

    def values(self, bufs, k, probs):
        return _per_token_values(probs[0], bufs[3][k], bufs[4][k], bufs[5][k], 4, self.head_dim)


@dataclasses.dataclass(frozen=True)
class Int2Pages:
    """Reader of one page (32 tokens) per step: per-channel keys, per-token values,
    ``bits``-bit codes (2: INT2; 3: INT3 pages, or a mix of INT2 and INT3 pages as
    3-bit rows; 4: KIVI-4's pages).

    Buffers ``[K, 1, ...]``: key data ``[32, D*bits/8]``, key scale/zero ``[D]``,
    value data ``[32, D*bits/8]``, value scale/zero ``[32, D/32]``.
    """

    head_dim: int
    block: int = 1
    bits: int = 2

    @property
    def out_chunks(self):
        return tuple((c.channel, c.width) for c in plane_chunks(self.head_dim, self.bits))

    def scores(self, q_GD, bufs, k):
        data, scale, zero = bufs[0][k, 0], bufs[1][k, 0], bufs[2][k, 0]
        s = 0.0
        for c in plane_chunks(self.head_dim, self.bits):
            q_c = q_GD[:, c.channel : c.channel + c.width].astype(jnp.float32)
            codes = _codes(data, c, self.bits)  # [32, width]
            scale_c = scale[None, c.channel : c.channel + c.width].astype(jnp.float32)
            zero_c = zero[None, c.channel : c.channel + c.width].astype(jnp.float32)
            s = s + _splitk.dot_nt(q_c * scale_c, codes) + jnp.sum(q_c * zero_c, axis=1, keepdims=True)
        return [s]

    def values(self, bufs, k, probs):
        return _per_token_values(probs[0], bufs[3][k, 0], bufs[4][k, 0], bufs[5][k, 0], self.bits, self.head_dim)


@dataclasses.dataclass(frozen=True)
class MaskedInt2Pages(Int2Pages):
    """``Int2Pages`` over listed pages with a per-token keep flag: a seventh
    buffer ``[K, 1, 32]`` int32 (non-zero: the token is read)."""

    def scores(self, q_GD, bufs, k):
        keep = bufs[6][k, 0]  # [32]
        return [jnp.where(keep[None, :] > 0, s, _splitk.MASKED) for s in super().scores(q_GD, bufs, k)]


def masked_page_operands(int2_pool, int2_pages_BP, int2_mask_BP):
    """Operands and ids of the masked INT2 part: entry ``b*P + j`` is listed page
    ``j`` of request ``b``, its six buffers gathered from the pool (a copy of the
    listed pages) plus its keep flags ``[B*P, K, 32]`` int32."""
    B, P = int2_pages_BP.shape
    pages = int2_pages_BP.reshape(-1).astype(jnp.int32)
    K = int2_pool.k.data.shape[1]
    bits = (int2_mask_BP.reshape(-1).astype(jnp.uint32)[:, None] >> jnp.arange(PAGE, dtype=jnp.uint32)[None, :]) & 1
    keep = jnp.broadcast_to(bits.astype(jnp.int32)[:, None, :], (B * P, K, PAGE))
    operands = tuple(buf[pages] for buf in int2_pool.buffers()) + (keep,)
    return operands, jnp.arange(B * P, dtype=jnp.int32).reshape(B, P)


def _check_pools(int2_pool, int2_pages_BP, int2_num_pages_B, int4_pool):
    for name, pool, cls in (("int2_pool", int2_pool, Int2Pool), ("int4_pool", int4_pool, Int4Pool)):
        if pool is not None and not isinstance(pool, cls):
            raise TypeError(f"{name} must be a {cls.__name__}, got {type(pool).__name__}")
    if int4_pool.k.bits != 4 or int4_pool.v.bits != 4:
        raise ValueError("int4_pool must hold 4-bit keys and values")
    if int2_pool is not None:
        if int2_pool.k.bits not in (2, 3, 4) or int2_pool.v.bits != int2_pool.k.bits:
            raise ValueError(
                f"int2_pool pages must hold keys and values of one width, 2, 3 or 4 bits; got {int2_pool.k.bits} and {int2_pool.v.bits}"
            )
        if int2_pool.k.head_dim != int4_pool.k.head_dim or int2_pool.k.data.shape[1] != int4_pool.k.data.shape[1]:
            raise ValueError(
                f"INT2 and INT4 pools disagree: INT2 keys {int2_pool.k.scale.shape} [P, Hkv, D], "
                f"INT4 keys scale {int4_pool.k.scale.shape} [S, Hkv, D/32]"
            )


def quantized_decode_attention_reference(
    q_BHD,
    int2_pool,
    int2_pages_BP,
    int2_num_pages_B,
    int4_pool,
    int4_idx_BN,
    int4_len_B,
    int2_mask_BP=None,
    float_pool=None,
    float_idx_BN=None,
    float_len_B=None,
):
    """Dequantize every request's entries to float32 and run the float reference.

    Entries of request b: its INT2 tokens (pages before ``int2_num_pages_B[b]``,
    bits of ``int2_mask_BP``), its INT4 tokens, its float tokens; the valid ones
    are moved to the front (attention does not depend on the order).
    """
    B, _, D = q_BHD.shape
    K = int4_pool.k.data.shape[1]
    ks, vs, valid = [], [], []
    if int2_pool is not None:
        P = int2_pages_BP.shape[1]
        k2 = dequantize_int2_keys(int2_pool.k.take(int2_pages_BP))  # [B, P, K, 32, D]
        v2 = dequantize_rows(int2_pool.v.take(int2_pages_BP))
        ks.append(k2.transpose(0, 1, 3, 2, 4).reshape(B, P * PAGE, K, D))
        vs.append(v2.transpose(0, 1, 3, 2, 4).reshape(B, P * PAGE, K, D))
        ok = jnp.arange(P)[None, :, None] < int2_num_pages_B.astype(jnp.int32)[:, None, None]
        if int2_mask_BP is not None:
            bit = (int2_mask_BP.astype(jnp.uint32)[:, :, None] >> jnp.arange(PAGE, dtype=jnp.uint32)) & 1
            ok = ok & (bit > 0)
        valid.append(jnp.broadcast_to(ok, (B, P, PAGE)).reshape(B, P * PAGE))
    N4 = int4_idx_BN.shape[1]
    ks.append(dequantize_rows(int4_pool.k.take(int4_idx_BN)))
    vs.append(dequantize_rows(int4_pool.v.take(int4_idx_BN)))
    valid.append(jnp.arange(N4)[None, :] < int4_len_B.astype(jnp.int32)[:, None])
    if float_pool is not None:
        fk, fv = float_pool
        ks.append(fk[float_idx_BN].astype(jnp.float32))
        vs.append(fv[float_idx_BN].astype(jnp.float32))
        valid.append(jnp.arange(float_idx_BN.shape[1])[None, :] < float_len_B.astype(jnp.int32)[:, None])
    k, v, ok = (jnp.concatenate(x, axis=1) for x in (ks, vs, valid))
    order = jnp.argsort(~ok, axis=1, stable=True)  # valid entries first, in order
    k = jnp.take_along_axis(k, order[..., None, None], axis=1)
    v = jnp.take_along_axis(v, order[..., None, None], axis=1)
    return decode_attention_rows(q_BHD, k, v, ok.sum(axis=1).astype(jnp.int32))


def quantized_decode_attention(
    q_BHD,
    int2_pool: Int2Pool | None,
    int2_pages_BP,
    int2_num_pages_B,
    int4_pool: Int4Pool,
    int4_idx_BN,
    int4_len_B,
    *,
    int2_mask_BP=None,
    float_pool=None,
    float_idx_BN=None,
    float_len_B=None,
    backend=None,
):
    """Decode attention over INT2 pages then INT4 tokens, dequantized on the fly.

    Args:
      q_BHD: ``[B, Hq, D]`` float queries.
      int2_pool: ``Int2Pool`` of ``P2`` pages, or ``None`` (then the INT2 index
        arguments are ignored and may be ``None``).
      int2_pages_BP: ``[B, P]`` int32 page ids; ``int2_num_pages_B``: ``[B]`` real pages.
      int4_pool: ``Int4Pool`` of ``S`` slots.
      int4_idx_BN: ``[B, N]`` int32 slot ids; ``int4_len_B``: ``[B]`` real slots.
      int2_mask_BP: optional ``[B, P]`` uint32, bit ``t``: token ``t`` of the page
        is read (default: all 32); a listed page keeps at least one bit.
      float_pool: optional ``(k [SF, Hkv, D], v [SF, Hkv, D])`` full-precision
        rows, read at ``float_idx_BN [B, NF]`` (``float_len_B [B]`` real).
      backend: see ``jaxkv.kernels._dispatch``.

    Returns:
      ``[B, Hq, D]`` in ``q_BHD.dtype``, float32 inside.
    """
    if not isinstance(int4_pool, Int4Pool):
        raise TypeError(f"int4_pool must be an Int4Pool, got {type(int4_pool).__name__}")
    _check_pools(int2_pool, int2_pages_BP, int2_num_pages_B, int4_pool)
    K, D = int4_pool.k.data.shape[1], int4_pool.k.head_dim
    check_decode_inputs(q_BHD, int4_idx_BN, int4_len_B, K, D, "INT4 pool")
    if int2_pool is not None:
        check_decode_inputs(q_BHD, int2_pages_BP, int2_num_pages_B, K, D, "INT2 pool")
        if int2_mask_BP is not None and int2_mask_BP.shape != int2_pages_BP.shape:
            raise ValueError(f"int2_mask must match int2_pages {int2_pages_BP.shape}, got {int2_mask_BP.shape}")
    if float_pool is not None:
        if float_pool[0].shape[1:] != (K, D):
            raise ValueError(f"float pool rows {float_pool[0].shape[1:]} != INT4 pool [Hkv={K}, D={D}]")
        check_decode_inputs(q_BHD, float_idx_BN, float_len_B, K, D, "float pool")
    args = (
        q_BHD,
        int2_pool,
        int2_pages_BP,
        int2_num_pages_B,
        int4_pool,
        int4_idx_BN,
        int4_len_B,
        int2_mask_BP,
        float_pool,
        float_idx_BN,
        float_len_B,
    )
    return _quantized_decode_attention(*args, resolve_backend(backend))


@functools.partial(jax.jit, static_argnums=11)
def _quantized_decode_attention(
    q_BHD,
    int2_pool,
    int2_pages_BP,
    int2_num_pages_B,
    int4_pool,
    int4_idx_BN,
    int4_len_B,
    int2_mask_BP,
    float_pool,
    float_idx_BN,
    float_len_B,
    backend,
):
    args = (q_BHD, int2_pool, int2_pages_BP, int2_num_pages_B, int4_pool, int4_idx_BN, int4_len_B)
    if backend == "reference":
        return quantized_decode_attention_reference(
            q_BHD,
            int2_pool,
            int2_pages_BP,
            int2_num_pages_B,
            int4_pool,
            int4_idx_BN,
            int4_len_B,
            int2_mask_BP,
            float_pool,
            float_idx_BN,
            float_len_B,
        )
    if backend == "gpu":
        from jaxkv.kernels.triton import decode as gpu_decode
        from jaxkv.kernels.triton.launch import triton_call

        return gpu_decode.quantized_decode_attention(
            *args,
            int2_mask_BP=int2_mask_BP,
            float_pool=float_pool,
            float_idx_BN=float_idx_BN,
            float_len_B=float_len_B,
            launcher=triton_call,
        )
    D = int4_pool.k.head_dim
    run = functools.partial(_splitk.split_k, q_BHD, interpret=backend == "interpret")
    parts = [run(Int4Tokens(D), int4_pool.buffers(), int4_idx_BN, int4_len_B)]
    if int2_pool is not None and int2_mask_BP is None:
        parts.append(run(Int2Pages(D, bits=int2_pool.bits), int2_pool.buffers(), int2_pages_BP, int2_num_pages_B))
    elif int2_pool is not None:
        operands, ids = masked_page_operands(int2_pool, int2_pages_BP, int2_mask_BP)
        parts.append(run(MaskedInt2Pages(D, bits=int2_pool.bits), operands, ids, int2_num_pages_B))
    if float_pool is not None:
        parts.append(run(FloatTokens(D), tuple(float_pool), float_idx_BN, float_len_B))
    return _splitk.merge(parts, q_BHD.dtype)
