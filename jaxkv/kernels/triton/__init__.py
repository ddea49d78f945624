"""The Triton family: every kernel for NVIDIA GPUs (the ``backend="gpu"`` path of
every function in ``jaxkv.kernels``: ragged and decode attention, RoPE delta, the
INT4 quantizing write).

Layout:

* ``kernels``: all ``@triton.jit`` code (decode over float / INT4 / INT2 entries,
  the ragged step's query tiles, RoPE delta, INT4 quantizing write) and the
  pieces they share (split bounds, online softmax, partials store, group
  dequantization).
* ``launch``: ``Launch``, the one description of a kernel launch, and
  ``triton_call``, the thin lazily-imported jax-triton adapter.
* ``decode``, ``ragged``, ``rope``, ``quant_write``: launch descriptions at
  production parameters plus the jnp glue around them (query dtype, tile list,
  partials merge), each taking a *launcher*.
* ``interpret``: the CPU launcher (Triton interpreter on torch tensors) the tests use.
* ``aot``: ``python -m jaxkv.kernels.triton.aot`` compiles every kernel for sm_80 and
  sm_90 without a GPU and reports registers, spills and shared memory.

Importing this package imports nothing heavy; ``kernels`` (and everything that
builds launches) needs ``triton``, ``triton_call`` needs ``jax-triton`` and a CUDA
jaxlib, ``interpret`` needs ``torch``. ``jaxkv.kernels`` imports these lazily, only
when ``backend="gpu"`` is used. (``import triton`` in these modules is the Triton
library: imports are absolute.)

Invariants: each launch has the contract of its function in ``jaxkv.kernels`` and
leaves the same split-K partials for the same merge (``jaxkv.kernels._splitk``);
the CPU tests run this exact source under the Triton interpreter; at production
parameters no kernel spills registers on sm_80 or sm_90 (``aot``,
``tests/test_gpu_aot.py``). This package imports the shared pieces of
``jaxkv.kernels`` (split-K, tiles, quantization codes, cost model), never the
dispatching modules that call it.
"""
