"""Backend resolution shared by every kernel in ``jaxkv.kernels``.

One rule for all kernels, so the engine can pass a single ``backend`` value through:

* ``None``: pick from the default JAX device. CPU -> ``"reference"`` (the plain
  jnp path, fast under XLA:CPU); NVIDIA GPU -> ``"gpu"`` when ``jax-triton`` is
  installed, else ``"reference"`` with a warning; TPU -> ``"tpu"``.
* ``"reference"``: the jnp reference beside the kernel (the test oracle).
* ``"interpret"``: the Pallas (TPU) kernel under the TPU interpreter
  (``pltpu.InterpretParams``); runs anywhere and simulates the DMAs, semaphores
  and memory spaces the TPU kernel uses. Outputs and scratch start as NaN, so a
  program that forgets to write its output block is caught.
* ``"gpu"``: the Triton kernels of ``jaxkv.kernels.triton`` through
  ``jax_triton.triton_call``. Needs an NVIDIA GPU, a CUDA jaxlib, ``triton`` and
  ``jax-triton`` (``pip install 'jaxkv[cuda]'``); without them it raises
  ``BackendUnavailableError`` before anything is traced.
* ``"tpu"``: the Pallas kernel compiled by Mosaic. It also lowers on a CPU host
  under an abstract TPU mesh (``jax.export(..., platforms=["tpu"])``).

Anything else raises ``ConfigError`` naming the accepted values.
"""

from __future__ import annotations

import warnings

import jax

from jaxkv.errors import BackendUnavailableError, ConfigError

BACKENDS = (None, "reference", "interpret", "gpu", "tpu")


def resolve_backend(backend: str | None) -> str:
    """Return the concrete backend (never ``None``) for ``backend``.

    ``"gpu"`` is checked here, eagerly: a process that cannot launch Triton kernels
    gets a ``BackendUnavailableError`` that says what to install.
    """
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    from jaxkv.kernels.triton.launch import check_triton_call

    if backend is None:
        platform = jax.default_backend()
        if platform == "tpu":
            return "tpu"
        if platform not in ("gpu", "cuda"):
            return "reference"
        try:
            check_triton_call()
        except BackendUnavailableError as e:
            warnings.warn(f"{e}; decode kernels fall back to the jnp reference", stacklevel=3)
            return "reference"
        return "gpu"
    if backend == "gpu":
        check_triton_call()
    return backend


__all__ = ["BACKENDS", "BackendUnavailableError", "resolve_backend"]
