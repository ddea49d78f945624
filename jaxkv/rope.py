"""Rotary position embeddings (NeoX split-half layout) and exact delta rotation.

Pairs are ``(i, i + D/2)``, the layout Qwen and Llama use. The rotation angle of pair
``i`` at position ``p`` is ``p * inv_freq[i]``: linear in ``p``, so rotating a
post-RoPE key by ``delta`` moves it from ``p`` to ``p + delta`` (ALGORITHMS.md §8).
Llama-3 scaling changes only ``inv_freq``, never this linearity. ``mean_rotation``
applies the average of the rotations over a span of positions (Expected Attention's
query "averaged over the next positions"); it and ``apply_rope`` share one pair
rotation (``_rotate_pairs``).

Frequencies are computed in float32 exactly as transformers computes them, so
logits match the reference implementation bit-for-bit up to matmul order.
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import numpy as np

from jaxkv.config import RopeConfig


@functools.lru_cache(maxsize=64)
def _inv_frequencies_cached(rope: RopeConfig, head_dim: int) -> np.ndarray:
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / (np.float32(rope.theta) ** exponents)).astype(np.float32)
    if rope.rope_type == "linear":
        inv_freq = inv_freq / np.float32(rope.factor)
    elif rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = np.float32(2 * math.pi) / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / np.float32(rope.factor), inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / np.float32(rope.factor) + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = np.where(is_medium, smoothed, scaled).astype(np.float32)
    inv_freq.setflags(write=False)
    return inv_freq


def inv_frequencies(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Per-pair inverse frequencies ``[D/2]`` (float32)."""
    return _inv_frequencies_cached(rope, head_dim)


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, rope: RopeConfig) -> jnp.ndarray:
    """Rotate ``x[..., H, D]`` by angles ``positions[...] * inv_freq``.

    ``positions`` has the shape of ``x`` without the last two axes (one position
    per token, shared by all heads). Computed in float32, returned in ``x.dtype``.
    With ``positions`` replaced by position *deltas* this is the delta rotation.
    """
    head_dim = x.shape[-1]
    inv_freq = jnp.asarray(inv_frequencies(rope, head_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., D/2]
    cos = jnp.cos(angles)[..., None, :]  # broadcast over heads
    sin = jnp.sin(angles)[..., None, :]
    return _rotate_pairs(x, cos, sin)


def mean_rotation(x: jnp.ndarray, start, count: int, rope: RopeConfig) -> jnp.ndarray:
    """Apply to ``x[..., D]`` the mean of the RoPE rotations at positions
    ``start .. start + count − 1``: ``R̄ x`` with ``R̄ = (1/count) Σ_t R(t)``.

    ``R̄`` keeps the pair structure: pair ``i`` is scaled and turned by the mean of
    ``cos``/``sin`` of ``t * inv_freq[i]`` (not a rotation: its norm shrinks where the
    angle sweeps a wide arc over the ``count`` positions). Expected Attention's
    "query averaged over the next positions" (``jaxkv.policies.expected_attention``).
    ``start`` may be traced, ``count`` is static. Computed in float32, returned in
    ``x.dtype``.
    """
    inv_freq = jnp.asarray(inv_frequencies(rope, x.shape[-1]))
    t = jnp.asarray(start, jnp.float32) + jnp.arange(count, dtype=jnp.float32)
    angles = t[:, None] * inv_freq  # [count, D/2]
    return _rotate_pairs(x, jnp.cos(angles).mean(axis=0), jnp.sin(angles).mean(axis=0))


def _rotate_pairs(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """``(x1, x2) -> (x1·cos − x2·sin, x2·cos + x1·sin)`` on the NeoX pairs ``(i, i + D/2)``;
    ``cos``/``sin`` broadcast to ``x[..., : D/2]``."""
    head_dim = x.shape[-1]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : head_dim // 2], xf[..., head_dim // 2 :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
