"""Triton kernels for NVIDIA GPUs (the ``backend="gpu"`` path of ``jaxkv.pallas``).

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
* ``aot``: ``python -m jaxkv.pallas.gpu.aot`` compiles every kernel for sm_80 and
  sm_90 without a GPU and reports registers, spills and shared memory.

Importing this package imports nothing heavy; ``kernels`` (and everything that
builds launches) needs ``triton``, ``triton_call`` needs ``jax-triton`` and a CUDA
jaxlib, ``interpret`` needs ``torch``. ``jaxkv.pallas`` imports these lazily, only
when ``backend="gpu"`` is used.
"""
