"""Reference attention in plain jnp: the CPU path and the oracle for every kernel.

Shape letters: B batch, T chunk (or flat step) tokens, N live-index list length,
S pool slots, Hq query heads, Hkv KV heads, G = Hq/Hkv, D head dim, R rows.

Entry points:

* ``causal_attention``: dense causal self-attention over one chunk, no cache, in
  query blocks that skip the keys above the diagonal (``query_block``: 128 rows on
  the CPU, the whole chunk on a GPU where it fits). It backs ``score_logits`` and
  training, and is independent of the paged cache on purpose.
* ``ragged_attention_reference``: the oracle of the engine's one attention
  (``jaxkv.kernels.attention.ragged``): a flat batch of queries from many rows,
  each over its row's live-index list, causal within the step's own tokens.
* ``decode_attention_reference``: one query row per request attends to the slots in
  its live-index list. The cost follows ``live_len``, not positions: evicted
  positions are simply absent from the list. ``decode_attention_rows`` is the same
  attention over rows already gathered in list order (the quantized kernels'
  references dequantize first).
* ``positional_attention``: queries over keys listed with explicit positions, each
  reading the keys at or before its own (segment reuse's spliced step, through
  ``AttentionBackend.attend_positional``).

``gqa_scores`` and ``masked_softmax`` are the one GQA-grouped, scaled, masked
softmax of the project: the references, the retention scorers
(``jaxkv.policies``) and RepairKV build on them; the blocked implementation and
the kernels form the same sums block by block (online softmax).

Invariants: scores and softmax are float32 whatever the input dtype; masked entries
get a large finite negative score, so a row with nothing to read yields finite
garbage instead of NaN (such rows are padding and are never consumed).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MASKED = -1e30


def group_heads(q_XHD, num_kv_heads: int):
    """``[..., Hq, D] -> [..., Hkv, G, D]``: query head ``h`` is in group ``h // G``,
    the layout GQA checkpoints use (KV head ``k`` serves query heads ``kG .. kG+G-1``)."""
    *lead, Hq, D = q_XHD.shape
    return q_XHD.reshape(*lead, num_kv_heads, Hq // num_kv_heads, D)


SMALL_X = 4  # query rows per head group up to which ``gqa_scores``/``gqa_values`` use one plain GEMM


def gqa_scores(q_XKGD, k_NKD):
    """Scaled float32 logits ``q·k/√D`` of grouped queries against keys.

    ``q_XKGD [..., X, Hkv, G, D]``, ``k_NKD [..., N, Hkv, D]`` with the same leading
    dims (batch, layer or none). Returns ``[..., Hkv, G, X, N]``. The one place GQA
    expansion and scaling happen: attention, retention scorers and RepairKV all
    call it.

    Two arrangements of the same sums: for many query rows, a dot batched over
    (leading dims, KV head); for few (decode: X = 1), one plain GEMM of every query
    head against every (key, KV head) pair, keeping each query head's own KV head.
    XLA:CPU runs the batched dot of a 1-row query as many tiny products; the plain
    GEMM does Hkv times the multiplies but is several times faster at decode
    shapes, and its sums are the same dot products.
    """
    *lead, X, K, G, D = q_XKGD.shape
    N = k_NKD.shape[-3]
    q = q_XKGD.astype(jnp.float32)
    k = k_NKD.astype(jnp.float32)
    scale = jnp.sqrt(jnp.float32(D))
    if X > SMALL_X:
        return jnp.einsum("...xkgd,...nkd->...kgxn", q, k) / scale
    s = jnp.einsum("...xhd,...md->...xhm", q.reshape(*lead, X, K * G, D), k.reshape(*lead, N * K, D))
    s = jnp.diagonal(s.reshape(*lead, X, K, G, N, K), axis1=-4, axis2=-1)  # [..., X, G, N, K]
    return jnp.moveaxis(s, (-1, -3, -4), (-4, -3, -2)) / scale  # [..., K, G, X, N]


def gqa_values(probs_KGXN, v_NKD):
    """``probs @ V`` under GQA: ``probs [..., Hkv, G, X, N]``, ``v [..., N, Hkv, D]``
    -> float32 ``[..., X, Hkv, G, D]``, arranged like ``gqa_scores``."""
    *lead, K, G, X, N = probs_KGXN.shape
    D = v_NKD.shape[-1]
    v = v_NKD.astype(jnp.float32)
    if X > SMALL_X:
        return jnp.einsum("...kgxn,...nkd->...xkgd", probs_KGXN, v)
    p = jnp.moveaxis(probs_KGXN, -2, -4).reshape(*lead, X, K * G, N)  # [..., X, Hq, N]
    o = jnp.einsum("...xhn,...nm->...xhm", p, v.reshape(*lead, N, K * D)).reshape(*lead, X, K, G, K, D)
    o = jnp.diagonal(o, axis1=-4, axis2=-2)  # [..., X, G, D, K]
    return jnp.moveaxis(o, -1, -3)  # [..., X, K, G, D]


def masked_softmax(scores, mask):
    """Softmax over the last axis where ``mask`` (broadcast to ``scores``) is true.

    Masked entries get ``MASKED`` (large, finite), so a row with nothing visible
    yields finite garbage instead of NaN; such rows are padding and never consumed.
    """
    return jax.nn.softmax(jnp.where(mask, scores, MASKED), axis=-1)


def _attend(q_BTKGD, k_BNKD, v_BNKD, mask_BTN):
    """Softmax attention with GQA; returns (out [B,T,Hq,D] f32, probs [B,K,G,T,N])."""
    probs = masked_softmax(gqa_scores(q_BTKGD, k_BNKD), mask_BTN[:, None, None])
    out = gqa_values(probs, v_BNKD)
    B, T, K, G, D = out.shape
    return out.reshape(B, T, K * G, D), probs


# Query rows per block on the CPU. On XLA:CPU the softmax passes over a block's
# [Hq, block, keys] scores are memory-bound, so a narrower block that stays in cache
# is faster: a 2,048-token SmolLM2 prefill through the engine (512-token chunks, one
# core) took 10.5 s at 256 and 7.6 s at 128 (7.3 s at 64, whose programs took 40%
# longer to compile). Rows are independent, so the width changes no result beyond
# rounding.
CAUSAL_BLOCK = 128

# On a GPU each block is its own small set of kernels, unrolled per layer, and that
# costs compile time and run time alike. Measured on an H200 in bf16
# (``eval/prefill_probe.py``, since removed; ``eval/results/device_NVIDIA_H200_logs/run4``): SmolLM2's
# dense forward of 2,048 tokens compiled in 36.1 s and ran in 20.7 ms at 128 rows,
# 5.4 s and 16.8 ms as one block; the engine's 2,048-token prefill in 512-token
# chunks took 46.8 s to compile and 56 ms warm at 128 rows, 24.3 s and 44 ms at 512.
# So on a GPU a chunk is one block, unless its float32 scores would pass this many
# bytes; then blocks as wide as fit (never narrower than ``CAUSAL_BLOCK``).
GPU_SCORE_BYTES = 1 << 30


def query_block(B: int, Hq: int, T: int, keys: int, backend: str | None = None) -> int:
    """Query rows per block for ``T`` query rows against ``keys`` keys, ``B`` rows and
    ``Hq`` heads: ``CAUSAL_BLOCK`` off the GPU; on a GPU (``backend`` or
    ``jax.default_backend()``) all ``T`` rows when their scores fit in
    ``GPU_SCORE_BYTES``, else the widest multiple of ``CAUSAL_BLOCK`` that fits (at
    least ``CAUSAL_BLOCK``). A trace-time constant of the shapes and the default
    backend: a step exported on a CPU host for a GPU (``jax.export``,
    ``tests/test_engine_export.py``) keeps 128-row blocks."""
    backend = jax.default_backend() if backend is None else backend
    if backend != "gpu":
        return CAUSAL_BLOCK
    fits = GPU_SCORE_BYTES // (4 * B * Hq * max(keys, 1))
    if fits >= T:
        return max(T, 1)
    return max(CAUSAL_BLOCK, fits // CAUSAL_BLOCK * CAUSAL_BLOCK)


def causal_attention(q_BTHD, k_BTKD, v_BTKD, block: int | None = None):
    """Dense causal attention within one chunk (no cache).

    Query rows go in blocks of ``block`` (default ``query_block``: 128 rows on the
    CPU, the whole chunk on a GPU); block ``i`` reads keys ``[0, end_i)`` only,
    so the work above the diagonal is skipped (about half of it at long ``T``) and
    each block's score matrix stays small. Same math as one masked softmax: rows are
    independent, and every key a block leaves out is one the causal mask removes.
    """
    B, T = q_BTHD.shape[:2]
    block = query_block(B, q_BTHD.shape[2], T, T) if block is None else block
    q = group_heads(q_BTHD, k_BTKD.shape[2])
    outs = []
    for start in range(0, T, block):
        end = min(start + block, T)
        mask = (jnp.arange(start, end)[:, None] >= jnp.arange(end)[None, :])[None]  # [1, Tb, end]
        out, _ = _attend(q[:, start:end], k_BTKD[:, :end], v_BTKD[:, :end], mask)
        outs.append(out)
    return (outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)).astype(q_BTHD.dtype)


def positional_attention(q_CHD, q_pos_C, k_NKD, v_NKD, k_pos_N, block: int = CAUSAL_BLOCK):
    """Each query row attends to the keys whose position is ``<=`` its own.

    ``q_CHD`` post-RoPE queries at positions ``q_pos_C``; ``k_NKD`` / ``v_NKD`` keys
    and values at ``k_pos_N`` (any order; padding at a position after every query). Queries go in
    blocks of ``block`` rows. The spliced step of segment reuse reads through it
    (``AttentionBackend.attend_positional``).
    Returns ``[C, Hq, D]`` in ``q_CHD.dtype``.
    """
    C, Hq, D = q_CHD.shape
    K = k_NKD.shape[1]
    q = group_heads(q_CHD, K)  # [C, K, G, D]
    v = v_NKD.astype(jnp.float32)
    outs = []
    for s in range(0, C, block):
        e = min(s + block, C)
        mask = k_pos_N[None, :] <= q_pos_C[s:e, None]  # [Cb, N]
        probs = masked_softmax(gqa_scores(q[s:e], k_NKD), mask[None, None])  # [K, G, Cb, N]
        outs.append(jnp.einsum("kgcn,nkd->ckgd", probs, v).reshape(e - s, Hq, D))
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)
    return out.astype(q_CHD.dtype)


def decode_attention_rows(q_BHD, k_BNKD, v_BNKD, live_len_B, *, return_probs=False):
    """One query row per request over its own K/V rows, already in live-list order.

    ``k_BNKD``/``v_BNKD`` hold each request's live rows (entries at or past
    ``live_len_B`` are ignored). The reference gathers the rows from the pool and
    calls this; the quantized references dequantize them first. Returns
    ``out [B,Hq,D]`` in ``q_BHD.dtype`` and, with ``return_probs``, the float32
    probabilities ``[B,Hq,N]``.
    """
    B, Hq, D = q_BHD.shape
    K = k_BNKD.shape[2]
    mask = (jnp.arange(k_BNKD.shape[1])[None, :] < live_len_B[:, None])[:, None, :]
    out, probs = _attend(q_BHD.reshape(B, 1, K, Hq // K, D), k_BNKD, v_BNKD, mask)
    out = out.reshape(B, Hq, D).astype(q_BHD.dtype)
    if return_probs:
        return out, probs.reshape(B, Hq, -1)
    return out


def decode_attention_reference(q_BHD, k_pool_SKD, v_pool_SKD, live_idx_BN, live_len_B, *, return_probs=False):
    """One query row per request over its live-index list.

    ``live_idx_BN`` holds slot ids (any order; entries at or past ``live_len_B``
    are ignored). Returns ``out [B,Hq,D]`` in ``q_BHD.dtype`` and, with
    ``return_probs``, the float32 attention probabilities ``[B,Hq,N]``.
    """
    return decode_attention_rows(q_BHD, k_pool_SKD[live_idx_BN], v_pool_SKD[live_idx_BN], live_len_B, return_probs=return_probs)


def ragged_rows(T: int, q_start_R, q_len_R):
    """For each of ``T`` flat tokens: its row (``[T]``; 0 for padding), its index
    within the row's queries, and whether a row owns it."""
    t = jnp.arange(T, dtype=jnp.int32)
    owns_RT = (t[None, :] >= q_start_R[:, None]) & (t[None, :] < (q_start_R + q_len_R)[:, None])
    row_T = jnp.argmax(owns_RT, axis=0).astype(jnp.int32)
    return row_T, t - q_start_R[row_T], owns_RT.any(axis=0)


def ragged_attention_reference(q_THD, k_SKD, v_SKD, live_RN, kv_len_R, q_start_R, q_len_R):
    """The oracle of ``jaxkv.kernels.attention.ragged``: each flat token's row list
    gathered whole, one masked softmax per token (query ``j`` of row ``r`` sees
    list entries ``[0, kv_len - q_len + j + 1)``). Padding tokens give zero.
    Materialises ``[T, N]`` keys: for tests and small steps only."""
    T = q_THD.shape[0]
    row_T, j_T, owned_T = ragged_rows(T, q_start_R, q_len_R)
    sees_T = jnp.where(owned_T, kv_len_R[row_T] - q_len_R[row_T] + j_T + 1, 0)
    live_TN = live_RN[row_T]
    out = decode_attention_rows(q_THD, k_SKD[live_TN], v_SKD[live_TN], sees_T)
    return jnp.where(owned_T[:, None, None], out, 0).astype(q_THD.dtype)
