"""The dense causal attention of ``score_logits`` and training, and a chunk's prefill
attention over cached rows: query blocks that skip the keys above the diagonal give the
same result as one masked softmax, and the block width chosen per backend stays within
its score budget."""

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


def _prefill_oracle(q, k_new, v_new, k_cached, v_cached, live_len, chunk_len):
    """float64 chunk attention: the first ``live_len`` cached rows, then the chunk's
    first ``chunk_len`` keys causally; also the mass each key receives from real rows."""
    B, T, Hq, D = q.shape
    N, G = k_cached.shape[1], Hq // k_cached.shape[2]
    out, mass = np.zeros((B, T, Hq, D)), np.zeros((B, Hq, N + T))
    for b in range(B):
        keys = np.concatenate([k_cached[b], k_new[b]])
        values = np.concatenate([v_cached[b], v_new[b]])
        ok = np.zeros((T, N + T), bool)
        ok[:, : live_len[b]] = True
        ok[:, N:] = np.tril(np.ones((T, T), bool)) & (np.arange(T) < chunk_len[b])[None, :]
        for h in range(Hq):
            s = np.where(ok, q[b, :, h] @ keys[:, h // G].T / np.sqrt(D), -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            out[b, :, h] = p @ values[:, h // G]
            mass[b, h] = p[: chunk_len[b]].sum(0)
    return out, mass


@pytest.mark.parametrize("block", [16, 48, None])
def test_prefill_attention_in_blocks_matches_the_oracle(block):
    rng = np.random.default_rng(7)
    B, T, N, Hq, Hkv, D = 2, 40, 24, 6, 2, 16
    q = rng.normal(size=(B, T, Hq, D)).astype(np.float32)
    k_new, v_new = (rng.normal(size=(B, T, Hkv, D)).astype(np.float32) for _ in range(2))
    k_cached, v_cached = (rng.normal(size=(B, N, Hkv, D)).astype(np.float32) for _ in range(2))
    live_len, chunk_len = np.array([24, 9]), np.array([40, 31])
    out, mass = attention.prefill_attention(q, k_new, v_new, k_cached, v_cached, live_len, chunk_len,
                                            return_mass=True, block=block)
    want_out, want_mass = _prefill_oracle(*(x.astype(np.float64) for x in (q, k_new, v_new, k_cached, v_cached)),
                                          live_len, chunk_len)
    real = np.arange(T)[None, :] < chunk_len[:, None]  # padding rows' outputs are never read
    np.testing.assert_allclose(np.asarray(out)[real], want_out[real], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(mass), want_mass, rtol=1e-5, atol=1e-5)


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
