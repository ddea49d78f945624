"""The attention kernels over live lists, one module per public function and its kernels.

* ``ragged``: ``ragged_attention``, the engine's one attention per step (prefill
  chunks and decode tokens of many rows in one flat batch, each row over its own
  live list, causal within the step): the dispatch and the CPU's blocked XLA
  implementation (``ragged_attention_blocked``: query tiles, then the decode
  section, ``decode_section_attention``, for the rows with one query), the float
  pool's ``PoolReader``, and the CPU decode window's attention
  (``window_decode_attention``).
* ``ragged_tpu``: the Pallas TPU kernel of ``ragged_attention`` (Mosaic on TPU,
  the TPU interpreter anywhere).
* ``decode``: ``decode_attention``, split-K decode over a float pool (Pallas
  kernel, dispatch).
* ``quantized``: ``quantized_decode_attention``, split-K decode over INT2 pages and
  INT4 tokens (Pallas kernel, jnp reference, dispatch).

The Triton kernels of every function are in ``jaxkv.kernels.triton``; the pieces
both backends share (split-K partials and merge, ragged query tiles, the cost
model) are one level up, in ``jaxkv.kernels``.

Invariants: every backend of a function has the same contract and is tested
against a float64 oracle (``jaxkv.kernels.testing``) and the jnp references of
``jaxkv.attention``; the softmax state is float32 whatever the input dtype; entries past a row's length are never seen; a row with nothing to attend to
gets a zero output. Importing this package imports the modules above, no Triton.
"""
