"""GPU RoPE delta rotation: the launch description and glue of ``kernels.rope_delta_rows``.

Same contract as ``jaxkv.kernels.rope_delta`` on a ``[L, S, Hkv, D]`` pool: rows at
``slots_M`` (distinct) of every layer are rotated by ``delta_M`` positions in
float32 and stored back in the pool dtype; the pool is aliased to the output
(``input_output_aliases``), so under a donating jit the update is in place and no
other byte is written. Frequencies come from ``jaxkv.rope.inv_frequencies``, the
one place they are computed.

Launch: grid ``(L, ceil(M / rows))``, a program rotates ``rows`` slots of all heads
(a ``[rows, Hkv, D/2]`` tile per half of about ``TILE = 1024`` elements: 2 rows for
Hkv 8, D 128), 8 warps; sin/cos are libdevice's accurate ``__nv_sinf``/``__nv_cosf``
(angles reach ``|delta| * inv_freq[0]``, far beyond where fast approximations hold). Cost: each moved row is
read and written once, ``2 * L * M * Hkv * D * itemsize`` bytes, ~6 flops per
element plus one sin/cos per (row, pair).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxkv.config import RopeConfig
from jaxkv.kernels.triton import kernels
from jaxkv.kernels.triton.decode import next_pow2
from jaxkv.kernels.triton.launch import Launch, Launcher, abstract
from jaxkv.rope import inv_frequencies

TILE = 1024  # elements of one half-row tile [rows, Hkv, D/2] per program
NUM_WARPS = 8


def slot_block(kv_heads: int, head_dim: int) -> int:
    """Rows per program: a ``[rows, Hkv, D/2]`` tile of about ``TILE`` elements."""
    return max(1, TILE // (next_pow2(kv_heads) * next_pow2(head_dim // 2)))


def rope_delta_launch(pool_LSKD, num_slots: int) -> Launch:
    L, S, K, D = pool_LSKD.shape
    i32 = jnp.int32
    block = slot_block(K, D)
    return Launch(
        kernels.rope_delta_rows,
        grid=(L, math.ceil(num_slots / block)),
        inputs=(
            jax.ShapeDtypeStruct((num_slots,), i32),
            jax.ShapeDtypeStruct((num_slots,), i32),
            jax.ShapeDtypeStruct((D // 2,), jnp.float32),
        )
        + abstract(pool_LSKD),
        outputs=abstract(pool_LSKD),
        constexprs=(
            ("M", num_slots),
            ("S", S),
            ("K", K),
            ("KP", next_pow2(K)),
            ("HALF", D // 2),
            ("HP", next_pow2(D // 2)),
            ("BLOCK", block),
        ),  # fmt: skip
        num_warps=NUM_WARPS,
        num_stages=1,
        aliases=((3, 0),),
    )


def rope_delta(pool_LSKD, slots_M, delta_M, rope: RopeConfig, *, launcher: Launcher):
    """Rotate rows ``slots_M`` of every layer by ``delta_M`` positions (``M >= 1``)."""
    launch = rope_delta_launch(pool_LSKD, slots_M.shape[0])
    inv_freq = jnp.asarray(inv_frequencies(rope, pool_LSKD.shape[-1]))
    (out,) = launcher(launch, slots_M.astype(jnp.int32), delta_M.astype(jnp.int32), inv_freq, pool_LSKD)
    return out
