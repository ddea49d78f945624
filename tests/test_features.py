"""The forward pass returns policy features on request: post-RoPE query rows at
chosen positions and per-key attention mass, equal to a dense recomputation."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import jaxkv
from jaxkv import attention


def _dense_q_and_probs(model, tokens):
    """Per-layer post-RoPE queries and causal attention probabilities, no cache."""

    def capture(i, q, k, v, carry):
        T = q.shape[1]
        mask = jnp.tril(jnp.ones((T, T), bool))[None]
        out, p = attention._attend(attention.group_heads(q, k.shape[2]), k, v, mask)
        return out.astype(q.dtype), carry, (q[0], p[0].reshape(-1, T, T))  # probs [Hq, T(query), T(key)]

    T = len(tokens)
    module = model.module
    _, _, (qs, probs) = module.run_layers(module.embed_tokens(jnp.asarray([tokens])), jnp.arange(T)[None], capture)
    return np.asarray(qs), np.asarray(probs)


def test_prefill_features_match_dense_recomputation(hf_checkpoint):
    model = jaxkv.load_model(hf_checkpoint("qwen3")[0])
    tokens = np.random.default_rng(0).integers(0, 1024, 48).tolist()
    q_ref, p_ref = _dense_q_and_probs(model, tokens)
    engine = jaxkv.Engine(model, rows=1, max_positions=64, prefill_chunk=64)
    row = engine.open_row()
    engine.prefill([row], [tokens[:30]])  # cached part
    _, aux = engine.prefill([row], [tokens[30:]], attn_mass=True, q_row_positions=[[5, 17]])
    # Query rows of new-token indices 5 and 17 = positions 35 and 47.
    np.testing.assert_allclose(aux["q_rows"][:, 0], q_ref[:, [35, 47]], rtol=1e-5, atol=1e-5)
    # Mass per position, summed over the 18 new query rows (positions 30..47),
    # mean over layers and query heads.
    mass = aux["attn_mass"][0]  # [48]
    expected = p_ref[:, :, 30:48, :48].sum(axis=2).mean(axis=(0, 1))
    assert mass.shape == expected.shape
    np.testing.assert_allclose(mass, expected, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(mass.sum(-1), 18.0, rtol=1e-5)


def test_mass_across_chunks_and_holes(hf_checkpoint):
    """Several prefill chunks accumulate; holes receive nothing."""
    from jaxkv.cache.allocator import SENTINEL_SLOT

    model = jaxkv.load_model(hf_checkpoint("qwen3")[0])
    tokens = np.random.default_rng(1).integers(0, 1024, 40).tolist()
    engine = jaxkv.Engine(model, rows=2, max_positions=64, prefill_chunk=8)
    a = engine.open_row()
    engine.prefill([a], [tokens[:20]])
    holed = [SENTINEL_SLOT if p in (3, 4, 9) else s for p, s in enumerate(engine.row_state[a].slots)]
    b = engine.open_row(holed)
    _, aux = engine.prefill([b], [tokens[20:40]], attn_mass=True)
    mass = aux["attn_mass"][0]
    assert mass.shape[-1] == 40
    assert (mass[..., [3, 4, 9]] == 0).all() and (mass[..., 10:] > 0).all()
    np.testing.assert_allclose(mass.sum(-1), 20.0, rtol=1e-5)  # 20 query rows, 3 chunks


def test_decode_features_match_dense_recomputation(hf_checkpoint):
    model = jaxkv.load_model(hf_checkpoint("llama")[0])
    tokens = np.random.default_rng(2).integers(0, 1024, 36).tolist()
    q_ref, p_ref = _dense_q_and_probs(model, tokens)
    engine = jaxkv.Engine(model, rows=2, max_positions=64)
    other = engine.open_row()
    engine.prefill([other], [tokens[:5]])  # a second row must not disturb the first
    row = engine.open_row()
    engine.prefill([row], [tokens[:30]])
    _, _, aux = engine.decode([row], [tokens[30]], 5, forced_tokens=[tokens[31:36]], query_rows=True, attn_mass=True)
    q = aux["q_rows"][0]  # [5 fed tokens, L, Hq, D] at positions 30..34
    np.testing.assert_allclose(q, q_ref[:, 30:35].transpose(1, 0, 2, 3), rtol=1e-5, atol=1e-5)
    mass = aux["attn_mass"][0]  # [35 positions]
    expected = p_ref[:, :, 30:35, :35].sum(axis=2).mean(axis=(0, 1))
    np.testing.assert_allclose(mass, expected, rtol=1e-4, atol=1e-6)
