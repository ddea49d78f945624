"""Shared fixtures: tiny random HF checkpoints saved once per test session."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The Triton kernels run under the Triton interpreter in this process; triton reads this
# when it is first imported (jaxkv.pallas.gpu.interpret). AOT compiles run in a subprocess.
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402

import hf_models  # noqa: E402


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """``hf_checkpoint(family, **overrides) -> (folder, torch_model)``, cached."""
    cache = {}

    def make(family, **overrides):
        key = (family, tuple(sorted(overrides.items())))
        if key not in cache:
            folder = tmp_path_factory.mktemp(f"hf_{family}")
            cache[key] = (folder, hf_models.build(family, folder, **overrides))
        return cache[key]

    return make


@pytest.fixture(scope="session")
def task_model_dir(tmp_path_factory):
    """A tiny random Qwen3 with the embedded model's task tokenizer, saved once."""
    import jaxkv
    from jaxkv.config import ModelConfig
    from jaxkv.tasks import embedded_tokenizer

    folder = tmp_path_factory.mktemp("task_model")
    tok = embedded_tokenizer()
    cfg = ModelConfig(
        model_type="qwen3", vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_layers=2,
        num_heads=2, num_kv_heads=1, head_dim=16, qk_norm=True, max_position_embeddings=4096,
        eos_token_ids=(tok.convert_tokens_to_ids("<|im_end|>"),),
    )
    jaxkv.save_pretrained(jaxkv.model_from_config(cfg, seed=0, tokenizer=tok), folder)
    return folder
