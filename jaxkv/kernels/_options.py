"""``pl.pallas_call`` keywords shared by the Pallas (TPU) kernels: the TPU interpreter,
or Mosaic with parallel grid axes.

Apart from ``_dispatch`` (which resolves backends and reaches into ``triton/`` to check
that Triton can launch) so that the split-K merge, which the Triton kernels of ``triton/``
use too, imports no backend resolution: ``triton`` -> ``_splitk`` -> ``_dispatch`` ->
``triton`` was an import circle between ``jaxkv.kernels``'s parts.
"""

from __future__ import annotations


def pallas_options(interpret: bool, parallel_axes: int = 2) -> dict:
    """``pl.pallas_call`` keywords: the TPU interpreter, or Mosaic with parallel grid axes."""
    from jax.experimental.pallas import tpu as pltpu

    if interpret:
        return {"interpret": pltpu.InterpretParams()}
    return {"compiler_params": pltpu.CompilerParams(dimension_semantics=("parallel",) * parallel_axes)}


__all__ = ["pallas_options"]
