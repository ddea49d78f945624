"""GPU decode attention (float and INT2/INT4 pools): launch descriptions and glue.

Same contracts as ``jaxkv.kernels.attention.decode`` and
``jaxkv.kernels.quantized_decode_attention`` (whose dispatch calls these with
``launcher=launch.triton_call``; the CPU tests pass ``interpret.interpret_call``).
The kernels are in ``kernels``; each call is one ``Launch`` per part plus the
shared log-sum-exp ``merge`` of ``jaxkv.kernels._splitk``.

Production launch parameters (``aot`` compiles them for sm_80 and sm_90 and the
tests require zero register spills):

* entries per step: float tokens ``128 / itemsize`` (64 bf16, 32 fp32), INT4
  tokens 32, INT2 pages 1 (32 tokens; per-channel key scales change per page);
* warps: 4 (float, INT4), 8 (INT2); 2 pipeline stages;
* splits per request: ``_splitk.gpu_splits``, enough for 1024 programs per launch
  (``B * Hkv * P``, eight per SM of an H100), never an empty split by design;
* query tile ``GP = max(16, next_pow2(G))`` rows (``tl.dot`` needs 16); float head
  dims are padded to a power of two ``DP``, quantized ones must be powers of two
  >= 64 (whole 32-channel groups per bit-plane).

Dots run in the query dtype, promoted with the pool dtype for float pools.

Cost model (bytes per call, the decode is memory bound): float ``B * N_live * Hkv
* D * 2 * itemsize`` for K and V, INT4 ``B * N_live * Hkv * 2 * (D/2 + 4 D/32)``,
INT2 pages ``B * pages * Hkv * (2 * 32 * D/4 + 4 D + 4 * 32 * D/32)``, plus
``4 * B * N`` of ids, the queries and the partials ``B * P * Hq * (D + 2) * 4``
written and read by the merge. ``jaxkv.kernels.cost`` evaluates these.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxkv.errors import ConfigError
from jaxkv.kernels._splitk import Partials, gpu_splits, merge, split_size
from jaxkv.kernels.triton import kernels
from jaxkv.kernels.triton.launch import Launch, Launcher, abstract

INT4_BLOCK = 32
PAGE_BLOCK = 1
MIN_DOT_ROWS = 16
NUM_STAGES = 2
NUM_WARPS = {"decode_float_tokens": 4, "decode_int4_tokens": 4, "decode_int2_pages": 8}


def token_block(dtype) -> int:
    """Float token ids per step: 128 bytes of each K/V row column (64 bf16, 32 fp32)."""
    return 128 // jnp.dtype(dtype).itemsize


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def check_quantized_head_dim(head_dim: int) -> None:
    if head_dim < 64 or head_dim != next_pow2(head_dim):
        raise ConfigError(f"the Triton quantized kernels need head_dim a power of two >= 64, got {head_dim}")


def decode_launch(kernel, q_BHD, operands, idx_BN, *, block: int) -> Launch:
    """Launch of one split-K decode kernel over ``operands`` (each ``[entries, Hkv, ...]``)."""
    B, Hq, D = q_BHD.shape
    K = operands[0].shape[1]
    G = Hq // K
    N = idx_BN.shape[1]
    P = gpu_splits(B, K, N, block)
    f32, i32 = jnp.float32, jnp.int32
    return Launch(
        kernel,
        grid=(B, K, P),
        inputs=(jax.ShapeDtypeStruct((B,), i32), jax.ShapeDtypeStruct((B, N), i32)) + abstract(q_BHD, *operands),
        outputs=(jax.ShapeDtypeStruct((B, P, Hq, D), f32), jax.ShapeDtypeStruct((B, P, Hq), f32), jax.ShapeDtypeStruct((B, P, Hq), f32)),
        constexprs=(
            ("N", N),
            ("K", K),
            ("G", G),
            ("GP", max(MIN_DOT_ROWS, next_pow2(G))),
            ("D", D),
            ("DP", next_pow2(D)),
            ("P", P),
            ("SPLIT", split_size(N, P, block)),
            ("BLOCK", block),
            ("SCALE", 1.0 / math.sqrt(D)),
        ),  # fmt: skip
        num_warps=NUM_WARPS[kernel.fn.__name__],
        num_stages=NUM_STAGES,
    )


def _part(launcher: Launcher, kernel, q_BHD, operands, idx_BN, len_B, block: int) -> Partials:
    launch = decode_launch(kernel, q_BHD, operands, idx_BN, block=block)
    return Partials(*launcher(launch, len_B.astype(jnp.int32), idx_BN.astype(jnp.int32), q_BHD, *operands))


def decode_attention(q_BHD, k_pool_SKD, v_pool_SKD, live_idx_BN, live_len_B, *, launcher: Launcher):
    """``jaxkv.kernels.attention.decode`` on the float pool with the Triton kernel."""
    q = q_BHD.astype(jnp.promote_types(q_BHD.dtype, k_pool_SKD.dtype))
    pools = (k_pool_SKD, v_pool_SKD)
    part = _part(launcher, kernels.decode_float_tokens, q, pools, live_idx_BN, live_len_B, token_block(q.dtype))
    return merge([part], q_BHD.dtype)


def quantized_decode_attention(
    q_BHD,
    int2_pool,
    int2_pages_BP,
    int2_num_pages_B,
    int4_pool,
    int4_idx_BN,
    int4_len_B,
    *,
    launcher: Launcher,
    int2_mask_BP=None,
    float_pool=None,
    float_idx_BN=None,
    float_len_B=None,
):
    """``jaxkv.kernels.quantized_decode_attention`` with the Triton kernels (INT4
    part, then INT2 part, then the optional float part). A masked INT2 part (pages
    some of whose tokens the request evicted) is computed by
    ``masked_int2_partials`` in jnp: the Triton INT2 kernel reads no mask yet; so
    are 3-bit pages (a pool with INT3 pages) and 4-bit ones (``kivi4``, a
    baseline): the Triton page kernel reads 2-bit codes only."""
    check_quantized_head_dim(q_BHD.shape[-1])
    parts = [_part(launcher, kernels.decode_int4_tokens, q_BHD, int4_pool.buffers(), int4_idx_BN, int4_len_B, INT4_BLOCK)]
    if int2_pool is not None and int2_mask_BP is None and int2_pool.bits == 2:
        parts.append(_part(launcher, kernels.decode_int2_pages, q_BHD, int2_pool.buffers(), int2_pages_BP, int2_num_pages_B, PAGE_BLOCK))
    elif int2_pool is not None:
        if int2_mask_BP is None:  # 3- or 4-bit pages, every token read
            int2_mask_BP = jnp.full(int2_pages_BP.shape, 0xFFFFFFFF, jnp.uint32)
        parts.append(masked_int2_partials(q_BHD, int2_pool, int2_pages_BP, int2_num_pages_B, int2_mask_BP))
    if float_pool is not None:
        q = q_BHD.astype(jnp.promote_types(q_BHD.dtype, float_pool[0].dtype))
        parts.append(_part(launcher, kernels.decode_float_tokens, q, tuple(float_pool), float_idx_BN, float_len_B, token_block(q.dtype)))
    return merge(parts, q_BHD.dtype)


def masked_int2_partials(q_BHD, int2_pool, int2_pages_BP, int2_num_pages_B, int2_mask_BP) -> Partials:
    """One split (``P = 1``) of the INT2 part with per-page token masks, in jnp:
    the listed pages dequantized to float32, masked scores, running max and sum."""
    from jaxkv.kernels.quant import PAGE, dequantize_int2_keys, dequantize_rows
    from jaxkv.kernels._splitk import MASKED

    B, Hq, D = q_BHD.shape
    P = int2_pages_BP.shape[1]
    K = int2_pool.k.data.shape[1]
    k = dequantize_int2_keys(int2_pool.k.take(int2_pages_BP))  # [B, P, K, 32, D]
    v = dequantize_rows(int2_pool.v.take(int2_pages_BP))
    k = k.transpose(0, 2, 1, 3, 4).reshape(B, K, P * PAGE, D)
    v = v.transpose(0, 2, 1, 3, 4).reshape(B, K, P * PAGE, D)
    bits = (int2_mask_BP.astype(jnp.uint32)[:, :, None] >> jnp.arange(PAGE, dtype=jnp.uint32)) & 1
    ok = (bits > 0) & (jnp.arange(P)[None, :, None] < int2_num_pages_B.astype(jnp.int32)[:, None, None])
    ok = ok.reshape(B, 1, 1, P * PAGE)
    q = q_BHD.astype(jnp.float32).reshape(B, K, Hq // K, D)
    exact = jax.lax.Precision.HIGHEST  # float32 dots as the Triton parts do them (ieee), not TF32
    s = jnp.einsum("bkgd,bktd->bkgt", q, k, precision=exact) / math.sqrt(D)
    s = jnp.where(ok, s, MASKED)
    m = jnp.max(s, axis=-1)
    p = jnp.where(ok, jnp.exp(s - m[..., None]), 0.0)
    acc = jnp.einsum("bkgt,bktd->bkgd", p, v, precision=exact)
    return Partials(acc.reshape(B, 1, Hq, D), m.reshape(B, 1, Hq), p.sum(-1).reshape(B, 1, Hq))
