"""Decode attention over live-index lists (float KV pool): kernel and dispatch.

``decode_attention(q, k_pool, v_pool, live_idx, live_len, backend=None)`` is what
the engine calls per layer during decode. Every request reads its own list of
slots from the shared pool (token granular, any order, padded; entries at or past
``live_len`` are ignored). The reference is
``jaxkv.attention.decode_attention_reference``. Kernels:

* TPU / interpret: the Pallas split-K skeleton of ``_splitk`` with a float reader:
  blocks of 64 slot ids, K and V rows of all heads DMA-gathered into VMEM,
  ``q . k`` in the promoted input dtype with float32 accumulation, probabilities
  cast to the value dtype for ``p @ v`` (bf16 on bf16 pools, as flash attention
  does; exact for float32 pools).
* GPU: the Triton kernel ``decode_float_tokens`` (``jaxkv.kernels.triton.decode``), same
  partials and the same ``_splitk.merge``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxkv.attention import decode_attention_reference
from jaxkv.kernels import _splitk
from jaxkv.kernels._dispatch import resolve_backend

TOKEN_BLOCK = 64


@dataclasses.dataclass(frozen=True)
class FloatTokens:
    """Reader of float K/V rows: buffers ``[K, block, D]`` of keys and values."""

    head_dim: int
    block: int = TOKEN_BLOCK

    @property
    def out_chunks(self):
        return ((0, self.head_dim),)

    def scores(self, q_GD, bufs, k):
        keys = bufs[0][k]
        dtype = jnp.promote_types(q_GD.dtype, keys.dtype)
        return [_splitk.dot_nt(q_GD.astype(dtype), keys.astype(dtype))]

    def values(self, bufs, k, probs):
        v = bufs[1][k]
        return [_splitk.dot_nn(probs[0].astype(v.dtype), v)]


def check_decode_inputs(q_BHD, live_idx_BN, live_len_B, kv_heads: int, head_dim: int, what: str) -> None:
    """Shape and dtype checks common to the float and quantized decode paths."""
    if q_BHD.ndim != 3:
        raise ValueError(f"q must be [B, Hq, D], got shape {q_BHD.shape}")
    B, Hq, D = q_BHD.shape
    if not jnp.issubdtype(q_BHD.dtype, jnp.floating):
        raise TypeError(f"q must be floating, got {q_BHD.dtype}")
    if D != head_dim:
        raise ValueError(f"q head_dim {D} (shape {q_BHD.shape}) != {what} head_dim {head_dim}")
    if Hq % kv_heads:
        raise ValueError(f"q heads {Hq} (shape {q_BHD.shape}) not a multiple of {what} KV heads {kv_heads}")
    if live_idx_BN.ndim != 2 or live_idx_BN.shape[0] != B:
        raise ValueError(f"live_idx must be [B={B}, N], got shape {live_idx_BN.shape}")
    if live_len_B.shape != (B,):
        raise ValueError(f"live_len must be [B={B}], got shape {live_len_B.shape}")
    for name, a in (("live_idx", live_idx_BN), ("live_len", live_len_B)):
        if not jnp.issubdtype(a.dtype, jnp.integer):
            raise TypeError(f"{name} must be an integer array, got {a.dtype}")


def decode_attention(q_BHD, k_pool_SKD, v_pool_SKD, live_idx_BN, live_len_B, *, backend=None):
    """One query row per request over its live-index list.

    Args:
      q_BHD: ``[B, Hq, D]`` post-RoPE queries (float).
      k_pool_SKD, v_pool_SKD: ``[S, Hkv, D]`` one layer of the pool (float).
      live_idx_BN: ``[B, N]`` int32 slot ids, any order; padding entries may hold anything
        in ``[0, S)`` and are never read.
      live_len_B: ``[B]`` int32, real entries of each list.
      backend: see ``jaxkv.kernels._dispatch``; ``None`` on CPU is the reference.

    Returns:
      ``[B, Hq, D]`` in ``q_BHD.dtype``: softmax(q k^T / sqrt(D)) v, float32 inside.
    """
    if k_pool_SKD.ndim != 3 or v_pool_SKD.shape != k_pool_SKD.shape:
        raise ValueError(f"k_pool and v_pool must both be [S, Hkv, D], got {k_pool_SKD.shape} and {v_pool_SKD.shape}")
    for name, a in (("k_pool", k_pool_SKD), ("v_pool", v_pool_SKD)):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise TypeError(f"{name} must be floating, got {a.dtype}")
    _, K, D = k_pool_SKD.shape
    check_decode_inputs(q_BHD, live_idx_BN, live_len_B, K, D, "pool")
    return _decode_attention(q_BHD, k_pool_SKD, v_pool_SKD, live_idx_BN, live_len_B, resolve_backend(backend))


@functools.partial(jax.jit, static_argnums=5)
def _decode_attention(q_BHD, k_pool_SKD, v_pool_SKD, live_idx_BN, live_len_B, backend):
    if backend == "reference":
        return decode_attention_reference(q_BHD, k_pool_SKD, v_pool_SKD, live_idx_BN, live_len_B)
    if backend == "gpu":
        from jaxkv.kernels.triton import decode as gpu_decode
        from jaxkv.kernels.triton.launch import triton_call

        return gpu_decode.decode_attention(q_BHD, k_pool_SKD, v_pool_SKD, live_idx_BN, live_len_B, launcher=triton_call)
    part = _splitk.split_k(
        q_BHD, FloatTokens(k_pool_SKD.shape[2]), (k_pool_SKD, v_pool_SKD), live_idx_BN, live_len_B,
        interpret=backend == "interpret",
    )  # fmt: skip
    return _splitk.merge([part], q_BHD.dtype)
