"""RoPE delta rotation of stored post-RoPE keys, in place on the pool.

``rope_delta(k_pool, slots, delta, rope)`` moves the key stored at each slot from
position ``p`` to ``p + delta`` by rotating it by ``delta`` (ALGORITHMS.md §8):
RoPE angles are ``p * inv_freq[i]``, linear in ``p``, so ``R(a) R(b) = R(a + b)``
for every rope_theta and for Llama-3 / linear frequency scaling (which only change
``inv_freq``). NeoX split-half pairs ``(i, i + D/2)``; values are never touched.

Invariants:
* Only rows at ``slots`` change; every other byte of the pool is left as it was
  (the kernel aliases the pool to its output and writes only gathered rows).
* ``slots`` must be distinct (a repeated slot would be rotated once per copy in
  the reference but unpredictably in the kernel).
* Pool ``[S, Hkv, D]`` or ``[L, S, Hkv, D]``: slots index the S axis and every layer
  is rotated. Math in float32, stored back in the pool dtype.
* ``rope_delta`` is jitted with the pool donated, so the update is in place and
  the caller's pool array is consumed.

Kernel: grid ``(L, M / 64)``; a program gathers 64 rows ``[64, Hkv, D/2]`` twice
(both halves), rotates and scatters them back. The slot list is padded to a
multiple of 64 by repeating its last entry: the copies sit in the same block as
the original, read the same old row and write the same new row, so the padding
is harmless.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxkv.config import RopeConfig
from jaxkv.rope import apply_rope, inv_frequencies
from jaxkv.pallas._dispatch import pallas_options, resolve_backend

SLOT_BLOCK = 64


def rope_delta_reference(k_pool_LSKD, slots_M, delta_M, rope: RopeConfig):
    """``apply_rope`` with positions = deltas on the gathered rows, scattered back."""
    rows = k_pool_LSKD[:, slots_M]
    positions = jnp.broadcast_to(delta_M, rows.shape[:2])
    return k_pool_LSKD.at[:, slots_M].set(apply_rope(rows, positions, rope))


def _kernel(slots_ref, delta_ref, inv_freq_ref, pool_in_ref, pool_ref):
    del pool_in_ref  # aliased to pool_ref
    layer, blk = pl.program_id(0), pl.program_id(1)
    half = inv_freq_ref.shape[0]
    ids = slots_ref[pl.ds(blk * SLOT_BLOCK, SLOT_BLOCK)]
    delta = delta_ref[pl.ds(blk * SLOT_BLOCK, SLOT_BLOCK)].astype(jnp.float32)
    angles = delta[:, None] * inv_freq_ref[...][None, :]  # [M, D/2]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1 = pool_ref[layer, ids, :, pl.ds(0, half)]
    x2 = pool_ref[layer, ids, :, pl.ds(half, half)]
    dtype = x1.dtype
    x1, x2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
    pool_ref[layer, ids, :, pl.ds(0, half)] = (x1 * cos - x2 * sin).astype(dtype)
    pool_ref[layer, ids, :, pl.ds(half, half)] = (x2 * cos + x1 * sin).astype(dtype)


def _rope_delta_kernel(k_pool_LSKD, slots_M, delta_M, rope, backend):
    L, _, _, D = k_pool_LSKD.shape
    M = slots_M.shape[0]
    pad = -M % SLOT_BLOCK
    slots = jnp.concatenate([slots_M, jnp.repeat(slots_M[-1:], pad)]).astype(jnp.int32)
    delta = jnp.concatenate([delta_M, jnp.repeat(delta_M[-1:], pad)]).astype(jnp.int32)
    inv_freq = jnp.asarray(inv_frequencies(rope, D))
    whole = pl.BlockSpec(memory_space=pl.ANY) if backend == "tpu" else pl.no_block_spec
    return pl.pallas_call(
        _kernel,
        grid=(L, (M + pad) // SLOT_BLOCK),
        in_specs=[whole] * 4,
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct(k_pool_LSKD.shape, k_pool_LSKD.dtype),
        input_output_aliases={3: 0},
        name="rope_delta",
        **pallas_options(backend),
    )(slots, delta, inv_freq, k_pool_LSKD)


@functools.partial(jax.jit, static_argnames=("rope", "backend"), donate_argnums=0)
def rope_delta(k_pool, slots_M, delta_M, rope: RopeConfig, *, backend=None):
    """Rotate the post-RoPE keys at ``slots_M`` by ``delta_M`` positions, in place.

    Args:
      k_pool: ``[S, Hkv, D]`` or ``[L, S, Hkv, D]`` float keys (donated).
      slots_M: ``[M]`` int32 distinct slot ids (S axis).
      delta_M: ``[M]`` int32 position deltas ``p_new - p_old`` (any sign).
      rope: the model's ``RopeConfig`` (static).
      backend: see ``jaxkv.pallas._dispatch``.

    Returns:
      The pool with those rows rotated, same shape and dtype.
    """
    if k_pool.ndim not in (3, 4):
        raise ValueError(f"k_pool must be [S, Hkv, D] or [L, S, Hkv, D], got shape {k_pool.shape}")
    if not jnp.issubdtype(k_pool.dtype, jnp.floating):
        raise TypeError(f"k_pool must be floating, got {k_pool.dtype}")
    if k_pool.shape[-1] % 2:
        raise ValueError(f"head_dim must be even for RoPE, got shape {k_pool.shape}")
    if slots_M.ndim != 1 or delta_M.shape != slots_M.shape:
        raise ValueError(f"slots and delta must be [M] of one length, got {slots_M.shape} and {delta_M.shape}")
    for name, a in (("slots", slots_M), ("delta", delta_M)):
        if not jnp.issubdtype(a.dtype, jnp.integer):
            raise TypeError(f"{name} must be an integer array, got {a.dtype}")
    if not isinstance(rope, RopeConfig):
        raise TypeError(f"rope must be a RopeConfig, got {type(rope).__name__}")
    backend = resolve_backend(backend)
    pool = k_pool if k_pool.ndim == 4 else k_pool[None]
    if slots_M.shape[0] == 0:
        out = pool
    elif backend == "reference":
        out = rope_delta_reference(pool, slots_M, delta_M, rope)
    else:
        out = _rope_delta_kernel(pool, slots_M, delta_M, rope, backend)
    return out if k_pool.ndim == 4 else out[0]
