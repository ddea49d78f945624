"""Attention and KV-cache kernels and the backend dispatch in front of them.

Each kernel sits beside a plain-jnp reference (the CPU path and the test oracle),
and one public function per kernel picks the backend with the rule in
``_dispatch.resolve_backend``: ``None`` -> reference on CPU, Triton (``gpu/``,
through jax-triton) on NVIDIA GPU, Pallas through Mosaic on TPU; or
``"reference"``, ``"interpret"`` (the Pallas TPU kernel in the TPU interpreter),
``"gpu"``, ``"tpu"``.

* ``ragged_attention``: the engine's one attention per step: a flat batch of
  prefill chunks and decode tokens from many rows, each over its own live list
  (``ragged_attention`` module; kernels: ``ragged_tpu`` (Pallas), ``gpu/ragged``
  (Triton), the tiles they share in ``_ragged_tiles``; the CPU runs a blocked XLA
  implementation).
* ``decode_attention``: float KV pool, per-request live-index lists, GQA, split-K.
* ``quantized_decode_attention``: INT2 pages then INT4 tokens (TriAxialKV formats,
  packing in ``quant``), dequantized on the fly, merged by log-sum-exp.
* ``rope_delta``: rotate stored post-RoPE keys by position deltas, in place.
* ``write_int4_rows``: quantize new K or V rows to INT4 and write them at slots.

``cost`` is the static cost model of these kernels (bytes and flops per call).
"""

from __future__ import annotations

from jaxkv.pallas._dispatch import BACKENDS, resolve_backend
from jaxkv.pallas.decode_attention import decode_attention
from jaxkv.pallas.kv_write import write_int4_rows
from jaxkv.pallas.quant import (
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
from jaxkv.pallas.quantized_attention import quantized_decode_attention, quantized_decode_attention_reference
from jaxkv.pallas.ragged_attention import ragged_attention
from jaxkv.pallas.rope_delta import rope_delta, rope_delta_reference

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
