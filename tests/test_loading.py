"""Checkpoint loading: sharded files, repo ids via the local HF cache, bad input."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import jaxkv
from jaxkv.models.loading import read_safetensors, write_safetensors


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _rel(a, b):
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


def test_sharded_checkpoint_loads_identically(hf_checkpoint, tmp_path):
    folder, torch_model = hf_checkpoint("llama")
    sharded = tmp_path / "sharded"
    torch_model.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    ids = np.arange(40)[None] % 1000
    a = jaxkv.score_logits(jaxkv.load_model(folder), ids)
    b = jaxkv.score_logits(jaxkv.load_model(sharded), ids)
    assert np.array_equal(np.asarray(a), np.asarray(b))


def test_repo_id_resolves_through_local_hf_cache(hf_checkpoint, tmp_path, monkeypatch):
    folder, _ = hf_checkpoint("qwen2")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    snap = tmp_path / "hub" / "models--tiny--qwen2" / "snapshots" / ("a" * 40)
    _copy(folder, snap)
    (tmp_path / "hub" / "models--tiny--qwen2" / "refs").mkdir()
    (tmp_path / "hub" / "models--tiny--qwen2" / "refs" / "main").write_text("a" * 40)
    model = jaxkv.load_model("tiny/qwen2")
    assert model.path == snap and model.config.model_type == "qwen2"
    with pytest.raises(jaxkv.CheckpointNotFoundError, match="not-cached/repo"):
        jaxkv.load_model("not-cached/repo")


def test_unsupported_model_type_lists_supported(hf_checkpoint, tmp_path):
    bad = _copy(hf_checkpoint("qwen2")[0], tmp_path / "m")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(jaxkv.UnsupportedModelError, match="llama, qwen2, qwen3"):
        jaxkv.load_model(bad)


def test_missing_tensor_is_named(hf_checkpoint, tmp_path):
    bad = _copy(hf_checkpoint("qwen3")[0], tmp_path / "m")
    tensors = {k: np.array(v) for k, v in read_safetensors(bad).items()}
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    write_safetensors(bad / "model.safetensors", tensors)
    with pytest.raises(jaxkv.CheckpointError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight"):
        jaxkv.load_model(bad)


def test_wrong_shape_names_tensor_and_both_shapes(hf_checkpoint, tmp_path):
    bad = _copy(hf_checkpoint("qwen2")[0], tmp_path / "m")
    tensors = {k: np.array(v) for k, v in read_safetensors(bad).items()}
    tensors["model.layers.0.mlp.up_proj.weight"] = np.zeros((150, 64), np.float32)
    write_safetensors(bad / "model.safetensors", tensors)
    with pytest.raises(jaxkv.CheckpointError, match=r"up_proj\.weight.*\(150, 64\).*\(160, 64\)"):
        jaxkv.load_model(bad)


def test_missing_and_corrupt_files(hf_checkpoint, tmp_path):
    src = hf_checkpoint("qwen2")[0]
    with pytest.raises(jaxkv.CheckpointNotFoundError):
        jaxkv.load_model(tmp_path / "nowhere")
    no_weights = _copy(src, tmp_path / "a")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(jaxkv.CheckpointNotFoundError, match="safetensors"):
        jaxkv.load_model(no_weights)
    no_config = _copy(src, tmp_path / "b")
    (no_config / "config.json").unlink()
    with pytest.raises(jaxkv.CheckpointNotFoundError, match="config.json"):
        jaxkv.load_model(no_config)
    bad_json = _copy(src, tmp_path / "c")
    (bad_json / "config.json").write_text("{not json")
    with pytest.raises(jaxkv.CheckpointError, match="not valid JSON"):
        jaxkv.load_model(bad_json)
    truncated = _copy(src, tmp_path / "d")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(jaxkv.CheckpointError, match="corrupt"):
        jaxkv.load_model(truncated)
    garbage = _copy(src, tmp_path / "e")
    (garbage / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not-a-json-hdr!!")
    with pytest.raises(jaxkv.CheckpointError, match="corrupt"):
        jaxkv.load_model(garbage)
    with pytest.raises(ValueError, match="dtype"):
        jaxkv.load_model(src, dtype="float16")


def test_save_pretrained_round_trip(hf_checkpoint, tmp_path):
    import torch
    import transformers

    model = jaxkv.load_model(hf_checkpoint("llama")[0])
    out = jaxkv.save_pretrained(model, tmp_path / "export")
    again = jaxkv.load_model(out)
    ids = np.arange(30)[None]
    assert np.array_equal(np.asarray(jaxkv.score_logits(model, ids)), np.asarray(jaxkv.score_logits(again, ids)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    assert _rel(jaxkv.score_logits(model, ids), ref) <= 1e-4
