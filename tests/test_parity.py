"""Parity of the Flax ports with transformers (torch, CPU) on tiny random models."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import jaxkv

# qwen2: biases, untied; qwen3: q/k norm, head_dim != hidden/heads, tied;
# llama: llama3 rope scaling, untied, GQA 4. Plus a tied Llama and an untied Qwen3.
CASES = [("qwen2", {}), ("qwen3", {}), ("llama", {}), ("llama", {"tie_word_embeddings": True}), ("qwen3", {"tie_word_embeddings": False})]


def _rel(got, ref):
    return float(np.abs(np.asarray(got, np.float64) - ref).max() / np.abs(ref).max())


def _ids(seed, shape):
    return np.random.default_rng(seed).integers(0, 1024, shape)


@pytest.mark.parametrize("family,overrides", CASES)
def test_full_sequence_logits_float32(hf_checkpoint, family, overrides):
    folder, torch_model = hf_checkpoint(family, **overrides)
    model = jaxkv.load_model(folder, dtype="float32")
    assert model.config.tie_word_embeddings == torch_model.config.tie_word_embeddings
    ids = _ids(1, (2, 96))
    with torch.no_grad():
        ref = torch_model(torch.tensor(ids)).logits.double().numpy()
    got = jaxkv.score_logits(model, ids)
    assert got.shape == (2, 96, 1024) and got.dtype == np.float32
    assert _rel(got, ref) <= 1e-4


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_full_sequence_logits_bfloat16(hf_checkpoint, family):
    folder, torch_model = hf_checkpoint(family)
    model = jaxkv.load_model(folder, dtype="bfloat16")
    assert model.dtype == jax_bf16()
    ids = _ids(2, (1, 64))
    with torch.no_grad():
        ref = torch_model(torch.tensor(ids)).logits.double().numpy()
    assert _rel(jaxkv.score_logits(model, ids), ref) <= 2e-2


def jax_bf16():
    import jax.numpy as jnp

    return jnp.bfloat16


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_greedy_generate_matches_hf(hf_checkpoint, family):
    folder, torch_model = hf_checkpoint(family)
    model = jaxkv.load_model(folder)
    prompts = [_ids(3, 17).tolist(), _ids(4, 40).tolist()]
    ours = jaxkv.generate(model, prompts, 32)
    assert [len(o) for o in ours] == [32, 32]
    # HF batch of two prompts of different lengths: left padding + attention mask.
    width = max(map(len, prompts))
    pad = 0
    batch = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        hf = torch_model.generate(batch, attention_mask=mask, max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=pad)[
            :, width:
        ].tolist()
    assert ours == hf
