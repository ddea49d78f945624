"""Launch descriptions of the Triton kernels, and the jax-triton adapter.

A ``Launch`` says everything about one kernel launch, once: the kernel, the grid,
the abstract input arrays in argument order, the abstract outputs (whose pointers
follow the inputs, as ``jax_triton.triton_call`` passes them), the constexprs
(every remaining kernel parameter), ``num_warps`` / ``num_stages`` and the
input-to-output aliases of in-place kernels. Three consumers read the same object:

* ``triton_call`` (here): ``jax_triton.triton_call`` on an NVIDIA GPU, under jit;
* ``jaxkv.kernels.triton.interpret.interpret_call``: the Triton interpreter on torch CPU
  tensors (the tests), also under jit through ``jax.pure_callback``;
* ``jaxkv.kernels.triton.aot``: ``triton.compile(ASTSource(kernel, launch.signature(),
  constexprs, launch.attrs()))`` for sm_80 / sm_90, no GPU needed.

A *launcher* is any ``(launch, *arrays) -> tuple of outputs``; the glue modules
(``decode``, ``rope``, ``quant_write``) take one, so the code around a kernel is the
same on the GPU and in the CPU tests.

Invariants: ``Launch`` checks at construction that the kernel's parameters are
exactly the inputs, the outputs and the constexprs in that order, and launchers
check the arrays they are given against ``inputs``. Pointer arguments are assumed
16-byte aligned (``tt.divisibility = 16``), as jax-triton assumes of XLA buffers.

This module imports neither ``triton`` nor ``jax_triton`` at import time: on a
CPU-only install, ``check_triton_call`` raises ``BackendUnavailableError``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.errors import BackendUnavailableError

TRITON_TYPES = {
    np.dtype(jnp.float32): "fp32",
    np.dtype(jnp.bfloat16): "bf16",
    np.dtype(jnp.float16): "fp16",
    np.dtype(jnp.int32): "i32",
    np.dtype(jnp.int64): "i64",
    np.dtype(jnp.uint8): "u8",
}
POINTER_ALIGNMENT = 16  # bytes; what jax-triton tells Triton about every buffer


def abstract(*arrays) -> tuple[jax.ShapeDtypeStruct, ...]:
    """``ShapeDtypeStruct`` of each array (concrete or traced)."""
    return tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays)


@dataclasses.dataclass(frozen=True)
class Launch:
    """One Triton kernel launch (see the module docstring).

    Attributes:
      kernel: the ``@triton.jit`` function of ``jaxkv.kernels.triton.kernels``.
      grid: programs per grid axis (1 to 3 axes).
      inputs: abstract input arrays, in argument order.
      outputs: abstract outputs; their pointers follow the inputs.
      constexprs: ``(name, value)`` of every remaining kernel parameter, in order.
      num_warps, num_stages: Triton compile options.
      aliases: ``(input index, output index)`` pairs sharing one buffer (in place).
    """

    kernel: Any
    grid: tuple[int, ...]
    inputs: tuple[jax.ShapeDtypeStruct, ...]
    outputs: tuple[jax.ShapeDtypeStruct, ...]
    constexprs: tuple[tuple[str, Any], ...]
    num_warps: int = 4
    num_stages: int = 2
    aliases: tuple[tuple[int, int], ...] = ()

    def __post_init__(self):
        names = list(self.kernel.arg_names)
        arrays = len(self.inputs) + len(self.outputs)
        if names[arrays:] != [k for k, _ in self.constexprs]:
            raise TypeError(
                f"launch of {self.name} does not match the kernel: parameters {names}, "
                f"{len(self.inputs)} inputs + {len(self.outputs)} outputs, constexprs {[k for k, _ in self.constexprs]}"
            )
        for i, o in self.aliases:
            if self.inputs[i] != self.outputs[o]:
                raise TypeError(f"{self.name}: aliased input {i} {self.inputs[i]} != output {o} {self.outputs[o]}")
        if not 1 <= len(self.grid) <= 3 or min(self.grid) < 1:
            raise TypeError(f"{self.name}: grid must have 1 to 3 positive axes, got {self.grid}")

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__

    @property
    def params(self) -> dict[str, Any]:
        return dict(self.constexprs)

    def signature(self) -> dict[str, str]:
        """Triton signature: ``*<type>`` per pointer, ``constexpr`` for the rest."""
        names = self.kernel.arg_names
        sig = {n: "*" + TRITON_TYPES[np.dtype(a.dtype)] for n, a in zip(names, self.inputs + self.outputs)}
        sig.update({k: "constexpr" for k, _ in self.constexprs})
        return sig

    def attrs(self) -> dict:
        """Pointer alignment hints, as jax-triton gives them."""
        pointers = len(self.inputs) + len(self.outputs)
        return {(i,): [["tt.divisibility", POINTER_ALIGNMENT]] for i in range(pointers)}

    def check(self, arrays) -> None:
        """Raise ``TypeError`` unless ``arrays`` match ``inputs`` (shapes and dtypes)."""
        got = abstract(*arrays)
        if got != self.inputs:
            raise TypeError(f"{self.name}: launched with {got}, described with {self.inputs}")


Launcher = Callable[..., tuple]


@functools.cache
def _jax_triton():
    """The ``jax_triton`` module, or the reason it cannot be used here (a string)."""
    try:
        import jax_triton  # noqa: F401  (refuses to import without a CUDA jaxlib)
        import triton  # noqa: F401
    except Exception as e:  # ImportError, or jax-triton's own check of the jaxlib
        return f"{type(e).__name__}: {e}"
    return jax_triton


def check_triton_call() -> None:
    """Raise ``BackendUnavailableError`` unless Triton kernels can be launched here."""
    jt = _jax_triton()
    if isinstance(jt, str):
        raise BackendUnavailableError(
            "backend='gpu' runs the Triton kernels through jax-triton, which needs an NVIDIA GPU, "
            "a CUDA jaxlib, triton and jax-triton (pip install 'jaxkv[cuda]'); "
            f"this process has jaxlib for {jax.default_backend()!r} ({jt})"
        )


def triton_call(launch: Launch, *arrays) -> tuple:
    """Launch on the GPU with ``jax_triton.triton_call`` (traceable, jit-able)."""
    check_triton_call()
    jt = _jax_triton()
    launch.check(arrays)
    # jax-triton 0.3 names the outputs ``out_shape``, 0.4 ``out_type``.
    out_kw = "out_type" if "out_type" in inspect.signature(jt.triton_call).parameters else "out_shape"
    outs = jt.triton_call(
        *arrays,
        kernel=launch.kernel,
        grid=launch.grid,
        name=launch.name,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
        input_output_aliases=dict(launch.aliases),
        **{out_kw: list(launch.outputs)},
        **launch.params,
    )
    return tuple(outs)
