"""Tiny random HF checkpoints built with transformers + torch for parity tests.

Nothing is downloaded: each builder makes a random model on the CPU, saves it
with ``save_pretrained`` to a folder, and returns the folder and the torch model.
"""

from __future__ import annotations

import torch
import transformers

VOCAB = 1024

FAMILIES = {
    # Qwen2 with q/k/v biases, untied embeddings.
    "qwen2": lambda: transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        max_position_embeddings=512,
    ),
    # Qwen3: per-head q/k norm, head_dim (24) != hidden / heads (16), tied embeddings.
    "qwen3": lambda: transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        max_position_embeddings=512,
    ),
    # Llama with Llama-3 rope scaling (short original context so scaling matters), GQA 4.
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        rope_theta=500000.0,
    ),
}

_CLASSES = {"qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM, "llama": transformers.LlamaForCausalLM}


def build(family: str, folder, *, seed: int = 0, dtype=torch.float32, **overrides):
    """Random ``family`` model saved to ``folder``; returns the torch model (eval mode)."""
    config = FAMILIES[family]()
    for k, v in overrides.items():
        setattr(config, k, v)
    torch.manual_seed(seed)
    model = _CLASSES[family](config).eval()
    with torch.no_grad():  # larger weights than the 0.02 init: logits with clear winners
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
            elif p.dim() == 1 and not torch.all(p == 1):
                p.normal_(0.0, 0.05)  # biases
            else:
                p.add_(torch.randn_like(p) * 0.1)  # norm weights around 1
    model = model.to(dtype)
    model.save_pretrained(folder, safe_serialization=True)
    return model
