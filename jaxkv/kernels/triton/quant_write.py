"""GPU quantizing KV write: launch description and glue of ``kernels.quantize_int4_rows``.

``write_int4_rows(rows, slots_T, x_TKD, launcher=...)`` quantizes ``T`` new float
rows ``[T, Hkv, D]`` to INT4 per token and writes their codes, scales and zeros at
``slots_T`` of an INT4 ``PackedRows`` (``[S, Hkv, D/2]`` uint8, ``[S, Hkv, D/32]``
float16 twice), in place: the three buffers are aliased to the outputs, and no
other slot is written. Bit-identical to ``jaxkv.kernels.quant.quantize_rows``.

Launch: grid ``(ceil(T / ROW_BLOCK), Hkv)``, ``ROW_BLOCK = 32`` rows of one head per
program, each row handled as its two bit-planes (channels ``[0, D/2)`` and
``[D/2, D)``, whole 32-channel groups each), so ``D`` must be a power of two >= 64.
Cost: reads ``T * Hkv * D * itemsize``, writes ``T * Hkv * (D/2 + 4 * D/32)`` bytes.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxkv.kernels.triton import kernels
from jaxkv.kernels.triton.decode import check_quantized_head_dim
from jaxkv.kernels.triton.launch import Launch, Launcher, abstract
from jaxkv.kernels.quant import PackedRows

ROW_BLOCK = 32
NUM_WARPS = 4


def write_int4_launch(x_TKD, rows: PackedRows) -> Launch:
    T, K, D = x_TKD.shape
    check_quantized_head_dim(D)
    buffers = abstract(rows.data, rows.scale, rows.zero)
    return Launch(
        kernels.quantize_int4_rows,
        grid=(max(1, math.ceil(T / ROW_BLOCK)), K),
        inputs=abstract(x_TKD) + (jax.ShapeDtypeStruct((T,), jnp.int32),) + buffers,
        outputs=buffers,
        constexprs=(("T", T), ("K", K), ("D", D), ("BLOCK", ROW_BLOCK)),
        num_warps=NUM_WARPS,
        num_stages=1,
        aliases=((2, 0), (3, 1), (4, 2)),
    )


def write_int4_rows(rows: PackedRows, slots_T, x_TKD, *, launcher: Launcher) -> PackedRows:
    """Quantize ``x_TKD`` to INT4 and write it at ``slots_T`` of ``rows``."""
    launch = write_int4_launch(x_TKD, rows)
    data, scale, zero = launcher(launch, x_TKD, slots_T.astype(jnp.int32), rows.data, rows.scale, rows.zero)
    return PackedRows(data, scale, zero, 4)
