"""Backend resolution shared by every kernel in ``jaxkv.pallas``.

One rule for all kernels, so the engine can pass a single ``backend`` value through:

* ``None``: pick from the default JAX device. CPU -> ``"reference"`` (the plain
  jnp path, fast under XLA:CPU); NVIDIA GPU -> ``"gpu"`` (Pallas lowered through
  Triton); TPU -> ``"tpu"`` (Pallas lowered through Mosaic).
* ``"reference"``: the jnp reference beside the kernel (the test oracle).
* ``"interpret"``: the Pallas kernel in interpret mode; runs anywhere, used by
  the CPU tests. Interpret mode fills kernel outputs with NaN before the kernel
  runs, so a program that forgets to write its output block is caught.
* ``"gpu"`` / ``"tpu"``: the Pallas kernel compiled for that platform.

Anything else raises ``ValueError`` naming the accepted values.
"""

from __future__ import annotations

import jax

BACKENDS = (None, "reference", "interpret", "gpu", "tpu")


def resolve_backend(backend: str | None) -> str:
    """Return the concrete backend (never ``None``) for ``backend``."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    if backend is not None:
        return backend
    platform = jax.default_backend()
    if platform == "gpu" or platform == "cuda":
        return "gpu"
    if platform == "tpu":
        return "tpu"
    return "reference"


def pallas_options(backend: str) -> dict:
    """Keyword arguments for ``pl.pallas_call`` on a kernel backend."""
    if backend == "interpret":
        return {"interpret": True}
    if backend == "gpu":
        from jax.experimental.pallas import triton as pltriton

        return {"compiler_params": pltriton.CompilerParams(num_warps=4, num_stages=2)}
    if backend == "tpu":
        return {}
    raise ValueError(f"backend {backend!r} has no Pallas kernel (use the reference)")


def min_rows(backend: str) -> int:
    """Smallest row count of a matmul operand the backend lowers (Triton: 16)."""
    return 16 if backend == "gpu" else 1
