"""CPU launcher of the Triton kernels: the Triton interpreter on torch CPU tensors.

``interpret_call(launch, *arrays)`` runs a ``Launch`` (``jaxkv.kernels.triton.launch``)
exactly as described: same kernel source, grid, argument order, output shapes and
constexprs, so the glue around a kernel is tested together with the kernel. It is
a launcher like ``launch.triton_call`` and works under ``jax.jit`` (through
``jax.pure_callback``). Needs ``triton`` and ``torch`` (the ``test`` extra); no GPU.

How:

* Triton decides when ``@triton.jit`` runs (at import) whether it makes a compiled
  or an interpreted function, for the kernels and for its own ``tl.sum``,
  ``tl.max``, ``tl.zeros``. So the interpreter needs ``TRITON_INTERPRET=1`` in the
  environment before ``triton`` is first imported (``tests/conftest.py`` sets it);
  ``run`` raises ``RuntimeError`` saying so otherwise. Such a process cannot
  compile kernels: ``jaxkv.kernels.triton.aot`` runs in one without the variable.
* Outputs are allocated poisoned (NaN for floats, ``0xA5`` bytes for integers), so
  an element a kernel forgets to write shows; an aliased output is its input's
  buffer, as with ``input_output_aliases`` on the GPU.
* The Triton 3.9 interpreter multiplies the raw bit patterns of bfloat16 operands
  in ``tl.dot`` (triton-lang/triton#11584, closed as not supported yet). While a
  launch runs, its ``create_dot`` sees bfloat16 operands widened to float32 first,
  which is what a tensor core computes (bf16 products are exact in fp32, fp32
  accumulation). Nothing else of the interpreter is changed.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import ml_dtypes
import numpy as np

from jaxkv.kernels.triton.launch import Launch

POISON_BYTE = 0xA5


@contextlib.contextmanager
def _interpreting():
    """Interpreter mode on, and bfloat16 ``tl.dot`` operands widened (see the module docstring)."""
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def widen(x):
        if x.dtype.scalar != tl.bfloat16:
            return x
        f32 = (x.data.astype(np.uint32) << np.uint32(16)).view(np.float32)
        return interpreter.TensorHandle(f32, tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot
    try:
        yield
    finally:
        builder.create_dot = original


def _to_torch(a: np.ndarray):
    import torch

    a = np.array(a, copy=True)  # writable, owned
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.uint16).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _to_numpy(t, dtype) -> np.ndarray:
    import torch

    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy().astype(dtype, copy=False)


def _poisoned(shape, dtype):
    out = np.empty(shape, dtype)
    if np.issubdtype(out.dtype, np.floating) or out.dtype == ml_dtypes.bfloat16:
        out[...] = np.nan
    else:
        out.view(np.uint8)[...] = POISON_BYTE
    return _to_torch(out)


def run(launch: Launch, *arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """Run ``launch`` eagerly in the interpreter on numpy inputs; numpy outputs."""
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(launch.kernel, InterpretedFunction):
        raise RuntimeError(
            f"{launch.name} was compiled, not interpreted: the Triton interpreter needs TRITON_INTERPRET=1 "
            "in the environment before triton is first imported"
        )
    launch.check(arrays)
    inputs = [_to_torch(a) for a in arrays]
    aliased = {o: i for i, o in launch.aliases}
    outputs = [inputs[aliased[o]] if o in aliased else _poisoned(s.shape, s.dtype) for o, s in enumerate(launch.outputs)]
    with _interpreting():
        launch.kernel[launch.grid](*inputs, *outputs, **launch.params)
    return tuple(_to_numpy(t, s.dtype) for t, s in zip(outputs, launch.outputs))


def interpret_call(launch: Launch, *arrays) -> tuple:
    """Launcher for the CPU: ``run`` behind ``jax.pure_callback`` (jit-able)."""
    launch.check(arrays)
    return tuple(jax.pure_callback(functools.partial(run, launch), list(launch.outputs), *arrays))
