"""The dense causal attention of ``score_logits`` and training: query blocks that
skip the keys above the diagonal give the same result as one masked softmax, and
the block width chosen per backend stays within its score budget. (The engine's
ragged paged attention has its own tests, ``tests/test_ragged_attention.py``.)"""

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
    np.testing.assert_allclose(got, _oracle(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64)), rtol=1e-5, atol=1e-5)
    # float32 sums in another order: agreement to float32 rounding, not bit for bit
    np.testing.assert_allclose(got, np.asarray(attention.causal_attention(q, k, v, block=T)), rtol=1e-5, atol=1e-5)


def test_query_block_is_128_rows_on_the_cpu_and_the_chunk_on_a_gpu_within_its_score_budget():
    assert attention.query_block(1, 9, 512, 8192, backend="cpu") == attention.CAUSAL_BLOCK
    assert attention.query_block(1, 9, 512, 8192, backend="tpu") == attention.CAUSAL_BLOCK
    # SmolLM2 (9 query heads), one row, a 512-token chunk over 8k keys: 151 MiB of scores
    assert attention.query_block(1, 9, 512, 8192, backend="gpu") == 512
    assert attention.query_block(1, 9, 37, 37, backend="gpu") == 37
    for B, Hq, T, keys in [(1, 9, 8192, 16384), (2, 32, 4096, 8192), (8, 32, 512, 32768), (64, 64, 4096, 131072)]:
        block = attention.query_block(B, Hq, T, keys, backend="gpu")
        assert block % attention.CAUSAL_BLOCK == 0 and attention.CAUSAL_BLOCK <= block < T
        assert 4 * B * Hq * keys * block <= attention.GPU_SCORE_BYTES or block == attention.CAUSAL_BLOCK
        # and no wider multiple of CAUSAL_BLOCK would have fit
        assert 4 * B * Hq * keys * (block + attention.CAUSAL_BLOCK) > attention.GPU_SCORE_BYTES
