"""Quantizing KV writes: new K or V rows, quantized to INT4 per token, written at
slots of an INT4 pool buffer (TriAxialKV's decode-generated tokens are INT4).

``write_int4_rows(rows, slots_T, x_TKD, backend=None)``: ``rows`` is the
``PackedRows`` of one INT4 pool side (``Int4Pool.k`` or ``.v``, ``[S, Hkv, ...]``),
``x_TKD`` the float rows ``[T, Hkv, D]``, ``slots_T`` distinct slot ids. Returns
``rows`` with those slots replaced by ``quantize_int4(x_TKD)``; every other slot is
unchanged. ``rows`` is donated, so the write is in place.

Backends (``jaxkv.kernels._dispatch``): ``"gpu"`` runs the Triton kernel of
``jaxkv.kernels.triton.quant_write`` (bit-identical to the reference); every other
backend runs the reference, a quantize then one XLA scatter per buffer (there is
no Pallas kernel: on TPU a row scatter is what XLA already does well). The engine
integration comes with the TriAxialKV issue.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxkv.kernels._dispatch import resolve_backend
from jaxkv.kernels.quant import PackedRows, check_head_dim, quantize_rows


def write_int4_rows_reference(rows: PackedRows, slots_T, x_TKD) -> PackedRows:
    q = quantize_rows(x_TKD, 4)
    return PackedRows(rows.data.at[slots_T].set(q.data), rows.scale.at[slots_T].set(q.scale), rows.zero.at[slots_T].set(q.zero), 4)


@functools.partial(jax.jit, static_argnames="backend", donate_argnums=0)
def write_int4_rows(rows: PackedRows, slots_T, x_TKD, *, backend=None) -> PackedRows:
    """Quantize ``x_TKD [T, Hkv, D]`` to INT4 and write it at ``slots_T`` of ``rows``, in place."""
    if not isinstance(rows, PackedRows) or rows.bits != 4:
        raise TypeError(f"rows must be 4-bit PackedRows, got {type(rows).__name__}")
    if x_TKD.ndim != 3 or x_TKD.shape[1:] != (rows.data.shape[1], rows.head_dim):
        raise ValueError(f"x must be [T, Hkv={rows.data.shape[1]}, D={rows.head_dim}], got shape {x_TKD.shape}")
    check_head_dim(x_TKD.shape[-1])
    if slots_T.shape != x_TKD.shape[:1] or not jnp.issubdtype(slots_T.dtype, jnp.integer):
        raise ValueError(f"slots must be [T={x_TKD.shape[0]}] integers, got {slots_T.shape} {slots_T.dtype}")
    if not jnp.issubdtype(x_TKD.dtype, jnp.floating):
        raise TypeError(f"x must be floating, got {x_TKD.dtype}")
    if resolve_backend(backend) == "gpu":
        from jaxkv.kernels.triton import quant_write
        from jaxkv.kernels.triton.launch import triton_call

        return quant_write.write_int4_rows(rows, slots_T, x_TKD, launcher=triton_call)
    return write_int4_rows_reference(rows, slots_T, x_TKD)
