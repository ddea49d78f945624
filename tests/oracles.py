"""Independent oracles for cache edits: attention computed directly over kept positions.

``logits_over_kept`` runs the prefix densely (no pool, no slots), captures every
layer's post-RoPE K/V, keeps only ``keep`` positions, then runs the new tokens
attending to those kept rows plus themselves (causal). Any eviction layout that
is correct must reproduce these logits.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxkv import attention


def logits_over_kept(model, prefix_tokens, keep, new_tokens, *, renumber=False):
    """With ``renumber`` (compact layout) the kept rows move to positions
    ``0..K-1`` (keys re-rotated from the dense run's keys) and the new tokens
    follow at ``K, K+1, ...``; otherwise everything keeps its position."""
    from jaxkv.rope import apply_rope

    module = model.module
    prefix = jnp.asarray([prefix_tokens], jnp.int32)
    P = prefix.shape[1]

    def capture(i, q, k, v, carry):
        return attention.causal_attention(q, k, v), carry, (k, v)

    _, _, (k_LPKD, v_LPKD) = module.run_layers(module.embed_tokens(prefix), jnp.arange(P, dtype=jnp.int32)[None], capture)
    keep = np.asarray(sorted(keep))
    new = jnp.asarray([new_tokens], jnp.int32)
    T = new.shape[1]

    def attend_kept(i, q, k, v, carry):
        k_kept = k_LPKD[i][:, keep]
        if renumber:
            delta = jnp.asarray(np.arange(len(keep)) - keep)[None]
            k_kept = apply_rope(k_kept, delta, model.config.rope)
        k_all = jnp.concatenate([k_kept, k], axis=1)
        v_all = jnp.concatenate([v_LPKD[i][:, keep], v], axis=1)
        causal = np.tril(np.ones((T, T), bool))
        mask = np.concatenate([np.ones((T, len(keep)), bool), causal], axis=1)[None]
        out, _ = attention._attend(attention.group_heads(q, k.shape[2]), k_all, v_all, jnp.asarray(mask))
        return out.astype(q.dtype), carry, None

    first = len(keep) if renumber else P
    x, _, _ = module.run_layers(module.embed_tokens(new), (first + jnp.arange(T, dtype=jnp.int32))[None], attend_kept)
    return np.asarray(module._logits(x), np.float64)[0]


def logits_over_layer_kept(model, prefix_tokens, keep_LP, new_tokens, *, renumber=False):
    """Per-layer keep sets: layer ``l`` of the new tokens attends to the prefix
    positions where ``keep_LP[l]`` (bool ``[L, P]``) is true, plus the new tokens
    (causal), every position where it was: each layer's dropped keys masked out
    of a dense run, with no pool and no live list. With ``renumber`` (compact
    layout) the union of the sets moves to positions ``0..U-1`` (keys re-rotated)
    and the new tokens follow at ``U, U+1, ...``."""
    from jaxkv.rope import apply_rope

    module = model.module
    prefix = jnp.asarray([prefix_tokens], jnp.int32)
    P = prefix.shape[1]

    def capture(i, q, k, v, carry):
        return attention.causal_attention(q, k, v), carry, (k, v)

    _, _, (k_LPKD, v_LPKD) = module.run_layers(module.embed_tokens(prefix), jnp.arange(P, dtype=jnp.int32)[None], capture)
    keep_LP = np.asarray(keep_LP, bool)
    cols = np.flatnonzero(keep_LP.any(axis=0)) if renumber else np.arange(P)
    keep = jnp.asarray(keep_LP[:, cols])
    new = jnp.asarray([new_tokens], jnp.int32)
    T, U = new.shape[1], cols.size
    causal = jnp.asarray(np.tril(np.ones((T, T), bool)))

    def attend_kept(i, q, k, v, carry):
        k_kept = k_LPKD[i][:, cols]
        if renumber:
            k_kept = apply_rope(k_kept, jnp.asarray(np.arange(U) - cols)[None], model.config.rope)
        k_all = jnp.concatenate([k_kept, k], axis=1)
        v_all = jnp.concatenate([v_LPKD[i][:, cols], v], axis=1)
        mask = jnp.concatenate([jnp.broadcast_to(keep[i][None, :], (T, U)), causal], axis=1)[None]
        out, _ = attention._attend(attention.group_heads(q, k.shape[2]), k_all, v_all, mask)
        return out.astype(q.dtype), carry, None

    first = U if renumber else P
    x, _, _ = module.run_layers(module.embed_tokens(new), (first + jnp.arange(T, dtype=jnp.int32))[None], attend_kept)
    return np.asarray(module._logits(x), np.float64)[0]
