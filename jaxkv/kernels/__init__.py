"""The kernels: attention over live lists and the KV-cache kernels, each with the
backend dispatch in front of it. Grouped by family:

* ``attention/``: the attention kernels. ``ragged`` is the engine's one attention
  per step (a flat batch of prefill chunks and decode tokens from many rows, each
  over its own live list): the CPU's blocked XLA implementation and the dispatch;
  ``ragged_tpu`` its Pallas TPU kernel; ``decode`` and ``quantized`` the split-K
  decode attention over a float pool and over INT2/INT4 pools (Pallas kernels and
  dispatch).
* ``triton/``: every Triton kernel for NVIDIA GPUs (the ``backend="gpu"`` path of
  every family), imported lazily.
* ``quant``: the INT2/INT4 codes (TriAxialKV formats, packing layout); ``kv_write``:
  the INT4 quantizing write; ``rope_delta``: RoPE delta rotation of stored keys.
* Shared by the families and backends: ``_dispatch`` (the backend rule),
  ``_options`` (``pl.pallas_call`` keywords), ``_splitk`` (split-K partials, their
  log-sum-exp merge, the Pallas split-K skeleton), ``_ragged_tiles`` (a ragged
  step's query tiles), ``cost`` (static cost model: bytes and flops per call),
  ``testing`` (float64 oracles and problems for the tests and benchmarks). These
  sit here rather than in ``attention/`` because ``triton/`` reads them and
  ``attention/`` dispatches to ``triton/``: inside ``attention/`` they would make
  an import circle between the two packages.

Invariants: each kernel sits beside a plain-jnp reference (the CPU path and the
test oracle), and one public function per kernel picks the backend with the rule
in ``_dispatch.resolve_backend``: ``None`` -> reference (or the blocked XLA
implementation) on CPU, Triton through jax-triton on NVIDIA GPU, Pallas through
Mosaic on TPU; or ``"reference"``, ``"interpret"`` (the Pallas TPU kernel in the
TPU interpreter), ``"gpu"``, ``"tpu"``. Every backend of a kernel has the same
contract and is tested against the same oracle. Kernels import only the layers
below them (the references of ``jaxkv.attention``, ``rope``, ``config``,
``errors``), never the cache, the models or the engine; and models import no
kernels (attention reaches them as a function).

Public functions:

* ``ragged_attention`` (``attention.ragged``).
* ``decode_attention`` (``attention.decode``): float KV pool, per-request live-index
  lists, GQA, split-K.
* ``quantized_decode_attention`` (``attention.quantized``): INT2 pages then INT4
  tokens, dequantized on the fly, merged by log-sum-exp.
* ``rope_delta``: rotate stored post-RoPE keys by position deltas, in place.
* ``write_int4_rows``: quantize new K or V rows to INT4 and write them at slots.
"""

from __future__ import annotations

from jaxkv.kernels._dispatch import BACKENDS, resolve_backend
from jaxkv.kernels.attention.decode import decode_attention
from jaxkv.kernels.attention.quantized import quantized_decode_attention, quantized_decode_attention_reference
from jaxkv.kernels.attention.ragged import ragged_attention
from jaxkv.kernels.kv_write import write_int4_rows
from jaxkv.kernels.quant import (
    Int2Pool,
    Int4Pool,
    PackedKeyPages,
    PackedRows,
    dequantize_int2_keys,
    dequantize_int2_pool,
    dequantize_int4_pool,
    dequantize_rows,
    quantize_int2_keys,
    quantize_int2_pool,
    quantize_int2_values,
    quantize_int4,
    quantize_int4_pool,
)
from jaxkv.kernels.rope_delta import rope_delta, rope_delta_reference

dequantize_int4 = dequantize_rows  # INT4 and INT2 per-token rows share one decoder
dequantize_int2_values = dequantize_rows

__all__ = [
    "BACKENDS",
    "Int2Pool",
    "Int4Pool",
    "PackedKeyPages",
    "PackedRows",
    "decode_attention",
    "dequantize_int2_keys",
    "dequantize_int2_pool",
    "dequantize_int2_values",
    "dequantize_int4",
    "dequantize_int4_pool",
    "dequantize_rows",
    "quantize_int2_keys",
    "quantize_int2_pool",
    "quantize_int2_values",
    "quantize_int4",
    "quantize_int4_pool",
    "quantized_decode_attention",
    "quantized_decode_attention_reference",
    "ragged_attention",
    "resolve_backend",
    "rope_delta",
    "rope_delta_reference",
    "write_int4_rows",
]
