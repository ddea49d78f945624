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

Kernels: on TPU and in interpret mode the Pallas kernel below, grid
``(L, M / 64)``: a program copies its 64 slot ids into SMEM, gathers the 64 rows
``[Hkv, D]`` of its layer by DMA into VMEM, rotates them in float32 and writes them
back by DMA (all gathers finish before any write starts). On NVIDIA GPUs the
Triton kernel of ``jaxkv.kernels.triton.rope`` does the same with pointer gathers. The
slot list is padded to a multiple of 64 by repeating its last entry: the copies sit
in the same block as the original, read the same old row and write the same new
row, so the padding is harmless.

Cost model: ``2 * L * M * Hkv * D * itemsize`` bytes (each moved row read and
written once) plus ``8 * M`` bytes of slots and deltas; ``~6`` flops per element.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxkv.config import RopeConfig
from jaxkv.rope import apply_rope, inv_frequencies
from jaxkv.kernels._dispatch import resolve_backend
from jaxkv.kernels._options import pallas_options

SLOT_BLOCK = 64


def rope_delta_reference(k_pool_LSKD, slots_M, delta_M, rope: RopeConfig):
    """``apply_rope`` with positions = deltas on the gathered rows, scattered back."""
    rows = k_pool_LSKD[:, slots_M]
    positions = jnp.broadcast_to(delta_M, rows.shape[:2])
    return k_pool_LSKD.at[:, slots_M].set(apply_rope(rows, positions, rope))


def _kernel(slots_hbm, delta_ref, inv_freq_ref, pool_in_hbm, pool_hbm, ids_smem, buf, sems):
    del pool_in_hbm  # aliased to pool_hbm
    layer, blk = pl.program_id(0), pl.program_id(1)
    half = inv_freq_ref.shape[1]
    pltpu.sync_copy(slots_hbm.at[pl.ds(blk * SLOT_BLOCK, SLOT_BLOCK)], ids_smem)

    def copy(j, gather: bool):
        row = pool_hbm.at[layer, ids_smem[j]]
        return pltpu.make_async_copy(row, buf.at[j], sems.at[0]) if gather else pltpu.make_async_copy(buf.at[j], row, sems.at[1])

    def start_all(gather):
        jax.lax.fori_loop(0, SLOT_BLOCK, lambda j, c: (copy(j, gather).start(), c)[1], 0)

    start_all(gather=True)
    pltpu.make_async_copy(buf, buf, sems.at[0]).wait()
    angles = delta_ref[...].astype(jnp.float32) * inv_freq_ref[...]  # [64, D/2]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x = buf[...]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    buf[:, :, pl.ds(0, half)] = (x1 * cos - x2 * sin).astype(x.dtype)
    buf[:, :, pl.ds(half, half)] = (x2 * cos + x1 * sin).astype(x.dtype)
    start_all(gather=False)
    pltpu.make_async_copy(buf, buf, sems.at[1]).wait()


def _rope_delta_kernel(k_pool_LSKD, slots_M, delta_M, rope, backend):
    L, _, K, D = k_pool_LSKD.shape
    M = slots_M.shape[0]
    pad = -M % SLOT_BLOCK
    slots = jnp.concatenate([slots_M, jnp.repeat(slots_M[-1:], pad)]).astype(jnp.int32)
    delta = jnp.concatenate([delta_M, jnp.repeat(delta_M[-1:], pad)]).astype(jnp.int32)[:, None]
    inv_freq = jnp.asarray(inv_frequencies(rope, D))[None, :]
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        _kernel,
        grid=(L, (M + pad) // SLOT_BLOCK),
        in_specs=[hbm, pl.BlockSpec((SLOT_BLOCK, 1), lambda layer, i: (i, 0)), pl.BlockSpec((1, D // 2), lambda layer, i: (0, 0)), hbm],
        out_specs=hbm,
        out_shape=jax.ShapeDtypeStruct(k_pool_LSKD.shape, k_pool_LSKD.dtype),
        scratch_shapes=[
            pltpu.SMEM((SLOT_BLOCK,), jnp.int32),
            pltpu.VMEM((SLOT_BLOCK, K, D), k_pool_LSKD.dtype),
            pltpu.SemaphoreType.DMA((2,)),
        ],
        input_output_aliases={3: 0},
        name="rope_delta",
        **pallas_options(backend == "interpret"),
    )(slots, delta, inv_freq, k_pool_LSKD)


@functools.partial(jax.jit, static_argnames=("rope", "backend"), donate_argnums=0)
def rope_delta(k_pool, slots_M, delta_M, rope: RopeConfig, *, backend=None):
    """Rotate the post-RoPE keys at ``slots_M`` by ``delta_M`` positions, in place.

    Args:
      k_pool: ``[S, Hkv, D]`` or ``[L, S, Hkv, D]`` float keys (donated).
      slots_M: ``[M]`` int32 distinct slot ids (S axis).
      delta_M: ``[M]`` int32 position deltas ``p_new - p_old`` (any sign).
      rope: the model's ``RopeConfig`` (static).
      backend: see ``jaxkv.kernels._dispatch``.

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
    elif backend == "gpu":
        from jaxkv.kernels.triton import rope as gpu_rope
        from jaxkv.kernels.triton.launch import triton_call

        out = gpu_rope.rope_delta(pool, slots_M, delta_M, rope, launcher=triton_call)
    else:
        out = _rope_delta_kernel(pool, slots_M, delta_M, rope, backend)
    return out if k_pool.ndim == 4 else out[0]
