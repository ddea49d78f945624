"""XLA:CPU's scatter into a KV-pool-sized array, by dtype: the measurement behind
``jaxkv.cache.state.float_pool_dtype``.

One jit'd call writes two rows into each of the 30 layers of a ``[30, 40000, 3, 64]``
pool (SmolLM2's layers, KV heads and head dim at 40,000 slots), the pool donated, and
is timed (mean of 5 after a warm-up) for float32, float16 and bfloat16. On XLA:CPU the
bfloat16 scatter converts the whole pool to float32 and back around each write.

    python -m eval.profile.bf16_scatter
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

LAYERS, SLOTS, KV_HEADS, HEAD_DIM = 30, 40_000, 3, 64


def main() -> None:
    import jax
    import jax.numpy as jnp

    def write_one_row_pair_per_layer(pool, slots, rows):
        for layer in range(LAYERS):
            pool = pool.at[layer, slots].set(rows)
        return pool

    print(f"load average before: {os.getloadavg()[0]:.2f}")
    for dtype in (jnp.float32, jnp.float16, jnp.bfloat16):
        write = jax.jit(write_one_row_pair_per_layer, donate_argnums=0)
        pool = jnp.zeros((LAYERS, SLOTS, KV_HEADS, HEAD_DIM), dtype)
        slots = jnp.array([5, 7000], jnp.int32)
        rows = jnp.ones((2, KV_HEADS, HEAD_DIM), dtype)
        pool = write(pool, slots, rows).block_until_ready()
        start = time.perf_counter()
        for _ in range(5):
            pool = write(pool, slots, rows)
        pool.block_until_ready()
        print(f"{jnp.dtype(dtype).name:9s} {(time.perf_counter() - start) / 5 * 1e3:10.3f} ms per call")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
