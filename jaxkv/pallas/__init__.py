"""Pallas kernels and the dispatch that picks a backend.

(Placeholder until the kernels land: every backend resolves to the jnp reference.)
"""

from __future__ import annotations

from jaxkv.attention import decode_attention_reference

BACKENDS = (None, "reference", "interpret", "gpu", "tpu")


def decode_attention(q, k_pool, v_pool, live_idx, live_len, *, backend=None):
    """Decode attention over live-index lists; see ``jaxkv.attention``."""
    return decode_attention_reference(q, k_pool, v_pool, live_idx, live_len)
