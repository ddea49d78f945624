"""Reference attention in plain jnp: the CPU path and the oracle for every kernel.

Shape letters: B batch, T chunk tokens, N live-index list length, S pool slots,
Hq query heads, Hkv KV heads, G = Hq/Hkv, D head dim.

Three entry points:

* ``causal_attention``: dense causal self-attention over one chunk, no cache, in
  query blocks that skip the keys above the diagonal. It backs ``score_logits`` and
  training, and is independent of the paged cache on purpose.
* ``prefill_attention``: a new chunk attends to the request's cached live slots
  (all earlier positions, no mask beyond the list length) and to itself (causal).
* ``decode_attention_reference``: one query row per request attends to the slots in
  its live-index list. The cost follows ``live_len``, not positions: evicted
  positions are simply absent from the list.

Invariants: scores and softmax are float32 whatever the input dtype; masked entries
get a large finite negative score, so a row with nothing to read yields finite
garbage instead of NaN (such rows are padding and are never consumed).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_MASKED = -1e30


def _grouped(q_BTHD: jnp.ndarray, num_kv_heads: int) -> jnp.ndarray:
    B, T, Hq, D = q_BTHD.shape
    return q_BTHD.reshape(B, T, num_kv_heads, Hq // num_kv_heads, D)


def _attend(q_BTKGD, k_BNKD, v_BNKD, mask_BTN):
    """Softmax attention with GQA; returns (out [B,T,Hq,D] f32, probs [B,K,G,T,N])."""
    D = q_BTKGD.shape[-1]
    scores = jnp.einsum(
        "btkgd,bnkd->bkgtn", q_BTKGD.astype(jnp.float32), k_BNKD.astype(jnp.float32)
    ) / jnp.sqrt(jnp.float32(D))
    scores = jnp.where(mask_BTN[:, None, None], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgtn,bnkd->btkgd", probs, v_BNKD.astype(jnp.float32))
    B, T, K, G, _ = out.shape
    return out.reshape(B, T, K * G, D), probs


CAUSAL_BLOCK = 256


def causal_attention(q_BTHD, k_BTKD, v_BTKD, block: int = CAUSAL_BLOCK):
    """Dense causal attention within one chunk (no cache).

    Query rows go in blocks of ``block``; block ``i`` reads keys ``[0, end_i)`` only,
    so the work above the diagonal is skipped (about half of it at long ``T``) and
    each block's score matrix stays small. Same math as one masked softmax: rows are
    independent, and every key a block leaves out is one the causal mask removes.
    """
    B, T = q_BTHD.shape[:2]
    q = _grouped(q_BTHD, k_BTKD.shape[2])
    outs = []
    for start in range(0, T, block):
        end = min(start + block, T)
        mask = (jnp.arange(start, end)[:, None] >= jnp.arange(end)[None, :])[None]  # [1, Tb, end]
        out, _ = _attend(q[:, start:end], k_BTKD[:, :end], v_BTKD[:, :end], mask)
        outs.append(out)
    return (outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)).astype(q_BTHD.dtype)


def prefill_attention(
    q_BTHD,
    k_new_BTKD,
    v_new_BTKD,
    k_pool_SKD,
    v_pool_SKD,
    live_idx_BN,
    live_len_B,
    chunk_len_B,
    *,
    return_mass: bool = False,
):
    """Chunk attention over cached live slots plus the chunk itself (causal).

    Args:
      q_BTHD, k_new_BTKD, v_new_BTKD: the chunk's post-RoPE queries / keys / values.
      k_pool_SKD, v_pool_SKD: one layer of the pool.
      live_idx_BN: slots of the request's cached live positions (before this chunk).
      live_len_B: how many entries of ``live_idx_BN`` are real.
      chunk_len_B: how many chunk tokens are real (the rest is padding).
      return_mass: also return per-key attention mass.

    Returns:
      ``out [B,T,Hq,D]`` and, when asked, ``mass [B,Hq,N+T]`` float32: the sum over
      the chunk's real query rows of the softmax probability each key receives,
      keys ordered as ``[live_idx_BN..., chunk tokens...]``.
    """
    B, T = q_BTHD.shape[:2]
    N = live_idx_BN.shape[1]
    k_all = jnp.concatenate([k_pool_SKD[live_idx_BN], k_new_BTKD.astype(k_pool_SKD.dtype)], axis=1)
    v_all = jnp.concatenate([v_pool_SKD[live_idx_BN], v_new_BTKD.astype(v_pool_SKD.dtype)], axis=1)
    t = jnp.arange(T)
    cached_ok = jnp.arange(N)[None, :] < live_len_B[:, None]  # [B,N]
    chunk_ok = (t[None, :, None] >= t[None, None, :]) & (t[None, None, :] < chunk_len_B[:, None, None])
    mask = jnp.concatenate([jnp.broadcast_to(cached_ok[:, None, :], (B, T, N)), chunk_ok], axis=-1)
    out, probs = _attend(_grouped(q_BTHD, k_new_BTKD.shape[2]), k_all, v_all, mask)
    out = out.astype(q_BTHD.dtype)
    if not return_mass:
        return out, None
    row_ok = (t[None, :] < chunk_len_B[:, None]).astype(jnp.float32)  # [B,T]
    mass = jnp.einsum("bkgtn,bt->bkgn", probs, row_ok)
    return out, mass.reshape(B, -1, N + T)


def decode_attention_reference(q_BHD, k_pool_SKD, v_pool_SKD, live_idx_BN, live_len_B, *, return_probs=False):
    """One query row per request over its live-index list.

    ``live_idx_BN`` holds slot ids (any order; entries at or past ``live_len_B``
    are ignored). Returns ``out [B,Hq,D]`` in ``q_BHD.dtype`` and, with
    ``return_probs``, the float32 attention probabilities ``[B,Hq,N]``.
    """
    B, Hq, D = q_BHD.shape
    K = k_pool_SKD.shape[1]
    mask = (jnp.arange(live_idx_BN.shape[1])[None, :] < live_len_B[:, None])[:, None, :]
    out, probs = _attend(
        q_BHD.reshape(B, 1, K, Hq // K, D),
        k_pool_SKD[live_idx_BN],
        v_pool_SKD[live_idx_BN],
        mask,
    )
    out = out.reshape(B, Hq, D).astype(q_BHD.dtype)
    if return_probs:
        return out, probs.reshape(B, Hq, -1)
    return out
