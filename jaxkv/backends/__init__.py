"""Attention backends: one attention entry for the engine's forward, one backend
per pool kind and platform, chosen once (``select_backend``; ``base`` documents
the interface).

| pool \\ platform | CPU | TPU, GPU, interpret |
|---|---|---|
| float | ``CpuFloatBackend`` (blocked, decode window) | ``FloatKernelBackend`` (ragged kernels) |
| INT2/INT4 | ``CpuQuantBackend`` (blocked, quantized window) | ``QuantKernelBackend`` (fused decode kernels) |

``ReferenceBackend`` (the dense oracle) serves ``backend="reference"`` for either pool.
"""

from __future__ import annotations

from jaxkv.backends.base import AttentionBackend, AttentionMetadata
from jaxkv.backends.cpu_float import CpuFloatBackend
from jaxkv.backends.cpu_quant import CpuQuantBackend
from jaxkv.backends.kernel_float import FloatKernelBackend
from jaxkv.backends.kernel_quant import QuantKernelBackend
from jaxkv.backends.reference import ReferenceBackend
from jaxkv.cache.quantized import QuantLayers
from jaxkv.kernels.attention.ragged import ragged_backend


def select_backend(layers, backend: str | None = None) -> AttentionBackend:
    """The backend of a pool (its device ``layers``) under ``backend`` (``None``:
    the platform's own: the blocked implementation on the CPU, the kernels on TPUs
    and NVIDIA GPUs; ``"reference"``, ``"interpret"``, ``"gpu"``, ``"tpu"`` as in
    ``jaxkv.kernels._dispatch``)."""
    platform = ragged_backend(backend)
    quantized = isinstance(layers, QuantLayers)
    blocked = CpuQuantBackend(layers) if quantized else CpuFloatBackend(layers)
    if platform == "blocked":
        return blocked
    if platform == "reference":
        return ReferenceBackend(layers, blocked)
    return QuantKernelBackend(layers, platform) if quantized else FloatKernelBackend(layers, platform)


__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "CpuFloatBackend",
    "CpuQuantBackend",
    "FloatKernelBackend",
    "QuantKernelBackend",
    "ReferenceBackend",
    "select_backend",
]
