"""The matrix product behind `jaxkv serve --dtype bfloat16` on the CPU: one
SmolLM2 MLP projection (576 -> 1536) at the decode shape (1 row), a small batch of
decode rows (16) and a prefill chunk (512 rows), four ways:

* float32 throughout;
* bfloat16 in and out (what a bfloat16 model's ``nnx.Linear`` computes today);
* stored in bfloat16, upcast to float32 before the product;
* bfloat16 in, float32 accumulated and out (``preferred_element_type``).

Medians of 5 after a compile, in ms and GFLOP/s; the load average printed before
and after (run it on an idle machine). On 2026-12-06, on a 2-core Xeon with AMX
(bf16) and AVX-512, idle, the last form ran 2.8x float32's rate at 512 rows (786
against 282 GFLOP/s) and 1.1x at 16, while bfloat16 in and out ran below float32:
the host's bf16 matrix units are reached only when the product accumulates in
float32; at one row every bf16 form is slower (eval/results/bf16_dot_cpu.md,
docs/benchmarks.md, "The engine in parts").

    python -m eval.profile.bf16_dot
"""

from __future__ import annotations

import os
import time


def _median_ms(f, *args) -> float:
    import numpy as np

    f(*args).block_until_ready()
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        f(*args).block_until_ready()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1e3


def main() -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    import numpy as np

    K, F = 576, 1536
    forms = {
        "float32": (jnp.float32, lambda a, b: a @ b),
        "bf16 in and out": (jnp.bfloat16, lambda a, b: a @ b),
        "bf16 stored, upcast to f32": (jnp.bfloat16, lambda a, b: a.astype(jnp.float32) @ b.astype(jnp.float32)),
        "bf16 in, f32 accumulated": (jnp.bfloat16, lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32)),
    }
    print("load before", round(os.getloadavg()[0], 2))
    for M in (1, 16, 512):
        for name, (dt, fn) in forms.items():
            x = jnp.asarray(np.random.rand(M, K), dt)
            w = jnp.asarray(np.random.rand(K, F), dt)
            ms = _median_ms(jax.jit(fn), x, w)
            print(f"x[{M},{K}] @ w[{K},{F}] {name}: {ms:.3f} ms, {2 * M * K * F / ms / 1e6:.0f} GFLOP/s")
    print("load after", round(os.getloadavg()[0], 2))


if __name__ == "__main__":
    main()
