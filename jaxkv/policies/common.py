"""Helpers shared by several retention policies (no policy logic of its own).

* ``candidate_attention``: the query-centric score of AgentKV and IntentKV,
  ``s_i = mean_{rows, l, h} softmax_i(q · k_i / √d)`` with the softmax over the
  **candidate** axis only (ALGORITHMS.md §3-4). Keys are expanded under GQA by
  ``base.attention_probs``.
* ``mark_positions``: the live-position mask of a set of positions (observation
  window rows, the last query row) for a policy's ``keep``.
* ``unit_norm``: epsilon-safe projection to unit norm along the last axis.

Shape letters as in ``base.py``; R counts query rows (ring entries, one memory
vector...).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.policies.base import attention_probs


def candidate_attention(q_LRHD, keys_LNKD, candidates_N, valid_R=None):
    """Mean over valid rows, layers and query heads of ``softmax_i(q·k_i/√d)`` over candidates.

    ``q_LRHD`` ``[L, R, Hq, D]`` are the scoring queries, ``valid_R`` which rows count
    (default: all). Returns float32 ``[N]``; entries outside ``candidates_N`` are 0.
    With no valid row every score is 0 (``select`` then keeps lower positions).
    """
    cand = jnp.asarray(candidates_N, bool)
    probs_LHRN = attention_probs(q_LRHD, keys_LNKD, valid_N=cand)
    R = q_LRHD.shape[1]
    w_R = jnp.ones((R,), jnp.float32) if valid_R is None else jnp.asarray(valid_R, jnp.float32)
    per_row_N = jnp.einsum("lhrn,r->n", probs_LHRN, w_R) / (probs_LHRN.shape[0] * probs_LHRN.shape[1])
    scores_N = per_row_N / jnp.maximum(w_R.sum(), 1.0)
    return jnp.where(cand, scores_N, 0.0)


def mark_positions(positions_N, pos_W, valid_W):
    """Bool ``[N]``: which live positions appear among the valid entries of ``pos_W``."""
    hit_WN = (positions_N[None, :] == pos_W[:, None]) & jnp.asarray(valid_W, bool)[:, None]
    return hit_WN.any(axis=0)


def unit_norm(x, eps: float = 1e-6):
    """``x / max(‖x‖, eps)`` along the last axis (float32)."""
    x = jnp.asarray(x, jnp.float32)
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), eps)


def last_valid_index(valid_W) -> jax.Array:
    """Index of the last true entry of ``valid_W`` (0 if none)."""
    idx_W = jnp.arange(valid_W.shape[0], dtype=jnp.int32)
    return jnp.max(jnp.where(jnp.asarray(valid_W, bool), idx_W, 0))
