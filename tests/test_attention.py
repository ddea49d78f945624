"""The dense causal attention of ``score_logits`` and training: query blocks that skip
the keys above the diagonal give the same result as one masked softmax."""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv import attention


def _oracle(q, k, v):
    """float64 causal softmax attention with GQA, written out."""
    B, T, Hq, D = q.shape
    G = Hq // k.shape[2]
    out = np.zeros((B, T, Hq, D))
    for h in range(Hq):
        s = np.einsum("btd,bnd->btn", q[:, :, h], k[:, :, h // G]) / np.sqrt(D)
        s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[:, :, h] = np.einsum("btn,bnd->btd", p / p.sum(-1, keepdims=True), v[:, :, h // G])
    return out


@pytest.mark.parametrize("T,block", [(300, 64), (97, 32), (5, 256)])
@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (6, 1)])
def test_blocked_causal_attention_matches_the_oracle(T, block, Hq, Hkv):
    rng = np.random.default_rng(T + Hq)
    q = rng.normal(size=(2, T, Hq, 16)).astype(np.float32)
    k = rng.normal(size=(2, T, Hkv, 16)).astype(np.float32) * 2
    v = rng.normal(size=(2, T, Hkv, 16)).astype(np.float32)
    got = np.asarray(attention.causal_attention(q, k, v, block=block))
    np.testing.assert_allclose(got, _oracle(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64)),
                               rtol=1e-5, atol=1e-5)
    # float32 sums in another order: agreement to float32 rounding, not bit for bit
    np.testing.assert_allclose(got, np.asarray(attention.causal_attention(q, k, v, block=T)), rtol=1e-5, atol=1e-5)
