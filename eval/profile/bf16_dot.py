"""The matrix product behind `jaxkv serve --dtype bfloat16` on the CPU: one
SmolLM2 MLP projection (576 -> 1536) in float32, in bfloat16, and stored in
bfloat16 but computed in float32, at the decode shape (1 row) and a prefill
chunk (512 rows). Medians of 5 after a compile; load average printed before
and after (run it on an idle machine).

    python -m eval.profile.bf16_dot
"""

import os, time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax, jax.numpy as jnp, numpy as np

print("load before", round(os.getloadavg()[0], 2))
for M in (1, 512):
    for dt in (jnp.float32, jnp.bfloat16):
        x = jnp.asarray(np.random.rand(M, 576), dt)
        w = jnp.asarray(np.random.rand(576, 1536), dt)
        f = jax.jit(lambda a, b: a @ b)
        f(x, w).block_until_ready()
        ts = []
        for _ in range(5):
            t = time.perf_counter()
            f(x, w).block_until_ready()
            ts.append(time.perf_counter() - t)
        print(f"x[{M},576] @ w[576,1536] {jnp.dtype(dt).name}: {np.median(ts) * 1e3:.3f} ms")
    # bf16 storage, f32 compute
    x = jnp.asarray(np.random.rand(M, 576), jnp.bfloat16)
    w = jnp.asarray(np.random.rand(576, 1536), jnp.bfloat16)
    g = jax.jit(lambda a, b: a.astype(jnp.float32) @ b.astype(jnp.float32))
    g(x, w).block_until_ready()
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        g(x, w).block_until_ready()
        ts.append(time.perf_counter() - t)
    print(f"x[{M},576] @ w[576,1536] bf16 stored, upcast to f32: {np.median(ts) * 1e3:.3f} ms")
print("load after", round(os.getloadavg()[0], 2))
