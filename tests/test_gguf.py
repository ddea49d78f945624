"""GGUF checkpoints: jaxkv's load against transformers' own GGUF load of the same file.

Real model: SmolLM2-135M-Instruct (Q4_1, llama architecture, so its Q/K rows are
stored permuted) -- logits on real text, 64 greedy tokens, tokenizer ids and chat
template. Tiny random files written here the way llama.cpp's converter writes them
(``gguf.GGUFWriter``, its tensor-name map, its Q/K permutation for llama): qwen2
(q/k/v biases, untied head), qwen3 (q/k norms) and llama, with F16 and Q8_0
weights. Bad files (truncated, unknown architecture, a tensor type ``gguf`` cannot
dequantize, a missing tensor) raise their typed errors before anything is built.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import jax.numpy as jnp

import jaxkv
from jaxkv.models import loading
from jaxkv.models.gguf import dequantizable, read_gguf

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

F16, Q8_0, F32 = gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F32
REAL_TEXT = json.__doc__  # prose, code and digits (the tests take its first 256 tokens)


def max_rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(np.asarray(ids)[None])).logits[0].numpy()


def hf_from_gguf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


# --------------------------------------------------------------------------- writing tiny files
TINY = {  # qwen3 keeps head_dim 128: transformers' GGUF loader does not read key_length for qwen3
    "llama": dict(hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=96, layers=2, vocab=256, tied=True),
    "qwen2": dict(hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=96, layers=2, vocab=256, tied=False),
    "qwen3": dict(hidden=64, heads=2, kv_heads=1, head_dim=128, ffn=96, layers=2, vocab=256, tied=False),
}


def converter_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` (convert_hf_to_gguf.py), applied to q/k rows of llama."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_hf_tensors(arch: str, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 tensors of a tiny ``arch`` model under their HF names."""
    d = TINY[arch]
    rng = np.random.default_rng(seed)
    H, D, Nq, Nk = d["hidden"], d["head_dim"], d["heads"], d["kv_heads"]

    def w(*shape):
        return (rng.normal(size=shape) * 0.1).astype(np.float32)

    def norm(n):
        return (1 + rng.normal(size=n) * 0.1).astype(np.float32)

    t = {"model.embed_tokens.weight": w(d["vocab"], H), "model.norm.weight": norm(H)}
    if not d["tied"]:
        t["lm_head.weight"] = w(d["vocab"], H)
    for i in range(d["layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(H)
        t[p + "post_attention_layernorm.weight"] = norm(H)
        t[p + "self_attn.q_proj.weight"] = w(Nq * D, H)
        t[p + "self_attn.k_proj.weight"] = w(Nk * D, H)
        t[p + "self_attn.v_proj.weight"] = w(Nk * D, H)
        t[p + "self_attn.o_proj.weight"] = w(H, Nq * D)
        if arch == "qwen2":
            t[p + "self_attn.q_proj.bias"] = w(Nq * D)
            t[p + "self_attn.k_proj.bias"] = w(Nk * D)
            t[p + "self_attn.v_proj.bias"] = w(Nk * D)
        if arch == "qwen3":
            t[p + "self_attn.q_norm.weight"] = norm(D)
            t[p + "self_attn.k_norm.weight"] = norm(D)
        t[p + "mlp.gate_proj.weight"] = w(d["ffn"], H)
        t[p + "mlp.up_proj.weight"] = w(d["ffn"], H)
        t[p + "mlp.down_proj.weight"] = w(H, d["ffn"])
    return t


def tiny_qtype(hf_name: str, arr: np.ndarray):
    """The type a converter + quantizer would pick: 1-D (norms, biases) F32,
    attention and head Q8_0, embeddings and MLP F16."""
    if arr.ndim == 1:
        return F32
    return Q8_0 if ("self_attn" in hf_name or hf_name == "lm_head.weight") else F16


def write_tiny_gguf(
    path, arch: str, tensors: dict[str, np.ndarray], *, arch_name: str | None = None, qtype=tiny_qtype, skip=(), raw_override=None
):
    """Write ``tensors`` (HF names) as llama.cpp's converter would: GGUF names from
    ``gguf``'s tensor-name map, llama's q/k rows permuted, the architecture's metadata.
    ``raw_override``: GGUF name -> (bytes array, type) stored instead."""
    d = TINY[arch]
    writer = gguf.GGUFWriter(str(path), arch_name or arch)
    writer.add_context_length(512)
    writer.add_embedding_length(d["hidden"])
    writer.add_block_count(d["layers"])
    writer.add_feed_forward_length(d["ffn"])
    writer.add_head_count(d["heads"])
    writer.add_head_count_kv(d["kv_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(d["vocab"])
    if arch == "llama":
        writer.add_rope_dimension_count(d["head_dim"])
    else:
        writer.add_key_length(d["head_dim"])
        writer.add_value_length(d["head_dim"])
    model_arch = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}[arch]
    names = gguf.get_tensor_name_map(model_arch, d["layers"])
    for hf_name, arr in tensors.items():
        base, suffix = hf_name.rsplit(".", 1)
        name = f"{names.get_name(base)}.{suffix}"
        if name in skip:
            continue
        if arch == "llama" and ".q_proj." in hf_name:
            arr = converter_permute(arr, d["heads"])
        elif arch == "llama" and ".k_proj." in hf_name:
            arr = converter_permute(arr, d["kv_heads"])
        if raw_override and name in raw_override:
            raw, raw_type = raw_override[name]
            writer.add_tensor(name, raw, raw_dtype=raw_type)
            continue
        q = qtype(hf_name, arr)
        writer.add_tensor(name, gguf.quants.quantize(arr, q), raw_dtype=q)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    out = {}
    for arch in TINY:
        tensors = tiny_hf_tensors(arch)
        out[arch] = (write_tiny_gguf(folder / f"{arch}.gguf", arch, tensors), tensors)
    return out


# --------------------------------------------------------------------------- tiny files
@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_tiny_gguf_logits_match_transformers(tiny_files, arch):
    path, original = tiny_files[arch]
    ours = jaxkv.load_model(path)
    cfg = ours.config
    assert (cfg.model_type, cfg.qkv_bias, cfg.qk_norm, cfg.tie_word_embeddings) == (
        arch,
        arch == "qwen2",
        arch == "qwen3",
        TINY[arch]["tied"],
    )
    # The tensors are the original ones back (Q8_0 / F16 round-off aside): names, layout, q/k rows.
    ckpt = read_gguf(path, load_tokenizer=False)
    assert set(ckpt.tensors) == set(original)
    for name, arr in original.items():
        q = tiny_qtype(name, arr)
        assert np.array_equal(ckpt.tensors[name], gguf.quants.dequantize(gguf.quants.quantize(arr, q), q)), name
    ids = np.random.default_rng(1).integers(0, TINY[arch]["vocab"], size=48)
    ref = hf_logits(hf_from_gguf(path), ids)
    err = max_rel_err(jaxkv.score_logits(ours, ids[None])[0], ref)
    print(f"{arch}: max relative logit error {err:.2e}")
    assert err < 1e-4
    half = jaxkv.load_model(path, dtype="bfloat16")
    assert half.dtype == jnp.bfloat16 and max_rel_err(jaxkv.score_logits(half, ids[None])[0], ref) < 5e-2


def test_gguf_folder_and_mesh(tiny_files, tmp_path):
    """A folder holding one .gguf loads it (with a mesh too); two make it ambiguous."""
    from jaxkv.models.sharding import make_mesh

    path, _ = tiny_files["qwen2"]
    folder = tmp_path / "one"
    folder.mkdir()
    (folder / path.name).write_bytes(path.read_bytes())
    ids = np.arange(20)[None]
    a = jaxkv.score_logits(jaxkv.load_model(path), ids)
    b = jaxkv.score_logits(jaxkv.load_model(folder, mesh=make_mesh(1, 1)), ids)
    assert np.array_equal(np.asarray(a), np.asarray(b))
    (folder / "other.gguf").write_bytes(path.read_bytes())
    with pytest.raises(jaxkv.CheckpointError, match="2 GGUF files"):
        jaxkv.load_model(folder)


# --------------------------------------------------------------------------- bad files
@pytest.fixture
def nothing_built(monkeypatch):
    """Fails the test if a module is built."""

    def refuse(*args, **kwargs):
        raise AssertionError("build_module was called")

    monkeypatch.setattr(loading, "build_module", refuse)


def test_truncated_gguf_raises_checkpoint_error(tiny_files, tmp_path, nothing_built):
    data = tiny_files["qwen2"][0].read_bytes()
    for keep in (len(data) * 3 // 4, 200):  # inside the tensor data, inside the metadata
        cut = tmp_path / f"cut{keep}.gguf"
        cut.write_bytes(data[:keep])
        with pytest.raises(jaxkv.CheckpointError, match="truncated or corrupt"):
            jaxkv.load_model(cut)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(jaxkv.CheckpointError, match="truncated or corrupt"):
        jaxkv.load_model(garbage)


def test_unknown_architecture_raises_unsupported_model(tmp_path, nothing_built):
    path = write_tiny_gguf(tmp_path / "x.gguf", "qwen2", tiny_hf_tensors("qwen2"), arch_name="gpt2")
    with pytest.raises(jaxkv.UnsupportedModelError, match="'gpt2'.*llama, qwen2, qwen3"):
        jaxkv.load_model(path)


def test_unsupported_tensor_type_raises_typed_error(tmp_path, nothing_built):
    # Q8_1 is a ggml type the gguf package stores but does not dequantize.
    assert not dequantizable(gguf.GGMLQuantizationType.Q8_1)
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
    raw = np.zeros((96, 64 // block * size), np.uint8)  # ffn_up: 96 rows of 64
    path = write_tiny_gguf(
        tmp_path / "x.gguf", "qwen2", tiny_hf_tensors("qwen2"), raw_override={"blk.1.ffn_up.weight": (raw, gguf.GGMLQuantizationType.Q8_1)}
    )
    with pytest.raises(jaxkv.UnsupportedTensorTypeError, match=r"blk\.1\.ffn_up\.weight \(Q8_1\).*supported:.*Q4_K"):
        jaxkv.load_model(path)


def test_missing_tensor_is_named(tmp_path, nothing_built):
    path = write_tiny_gguf(tmp_path / "x.gguf", "qwen3", tiny_hf_tensors("qwen3"), skip={"blk.1.attn_k_norm.weight"})
    with pytest.raises(jaxkv.CheckpointError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight \(blk\.1\.attn_k_norm\.weight\)"):
        jaxkv.load_model(path)


# --------------------------------------------------------------------------- SmolLM2
@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    """(jaxkv model, transformers model, transformers tokenizer) of the same GGUF file, loaded once."""
    ours = jaxkv.load_model(smollm2_gguf)
    ref = hf_from_gguf(smollm2_gguf)
    tok = transformers.AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    return ours, ref, tok


def test_smollm2_config_from_metadata(smollm2, smollm2_gguf):
    cfg = smollm2[0].config
    assert (cfg.model_type, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == ("llama", 30, 9, 3, 64)
    assert (cfg.rope.theta, cfg.tie_word_embeddings, cfg.max_position_embeddings) == (1e5, True, 8192)
    theirs = smollm2[1].config.to_dict()
    ours = read_gguf(smollm2_gguf, load_tokenizer=False, lazy=True).hf_config
    for key in (
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert ours[key] == theirs[key], key
    assert ours["rope_parameters"]["rope_theta"] == theirs["rope_parameters"]["rope_theta"]


def test_smollm2_logits_match_transformers(smollm2):
    ours, ref, tok = smollm2
    ids = np.asarray(tok(REAL_TEXT)["input_ids"][:256])
    err = max_rel_err(jaxkv.score_logits(ours, ids[None])[0], hf_logits(ref, ids))
    print(f"SmolLM2 Q4_1: max relative logit error {err:.2e} over {ids.size} tokens")
    assert err < 1e-4


def test_smollm2_greedy_64_tokens_match_transformers(smollm2):
    """jaxkv's 64 greedy tokens are transformers' greedy tokens. Checked with one
    teacher-forced transformers forward over prompt + jaxkv's tokens: if its argmax
    after the prompt and after each of the first i tokens is jaxkv's token i, then
    transformers' own greedy decoding emits exactly these 64 tokens (by induction on
    i), at the cost of one forward instead of 64 decode steps on a 2-core CPU."""
    ours, ref, tok = smollm2
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Write a short poem about the sea."}], add_generation_prompt=True, tokenize=False
    )
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    mine = jaxkv.generate(ours, [ids], max_new_tokens=64)[0]
    assert len(mine) == 64
    theirs = hf_logits(ref, ids + mine[:-1])[len(ids) - 1 :].argmax(-1).tolist()
    assert mine == theirs


def test_smollm2_tokenizer_and_chat_template(smollm2):
    ours, _, tok = smollm2
    mine = ours.tokenizer
    text = "<|im_start|>user\nCompute 12345 * 678 in Python: `def f(x):\n    return x ** 2  # 3.14`<|im_end|>\n"
    ids = mine(text)["input_ids"]
    assert ids == tok(text)["input_ids"]
    assert ids[0] == mine.convert_tokens_to_ids("<|im_start|>") == 1  # one token each, not split
    assert mine.convert_tokens_to_ids("<|im_end|>") in ids
    assert [mine.decode([i]) for i in mine("12345", add_special_tokens=False)["input_ids"]] == list("12345")  # digits split one by one
    assert mine.decode(ids) == text
    assert mine.chat_template == tok.chat_template and "<|im_start|>" in mine.chat_template
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 42"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Why?"},
    ]
    from jaxkv.chat.render import render

    rendered = render(mine, messages)
    assert rendered.text == tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered.text.endswith("<|im_start|>assistant\n")
    assert ours.config.eos_token_ids == (mine.convert_tokens_to_ids("<|im_end|>"),)


def test_a_converted_tokenizer_is_cached_per_file_and_converter(tmp_path, monkeypatch):
    """The first read of a file's tokenizer converts it and saves the result in the
    user cache; the next read loads that copy (same ids, template from the file, no
    conversion); a changed file (new mtime) is converted again."""
    from types import SimpleNamespace

    from conftest import tiny_chat_model
    from jaxkv.models import gguf as jaxkv_gguf

    monkeypatch.setenv("JAXKV_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    path.write_bytes(b"not read: the reader below stands in for the file's metadata")
    fields = {
        gguf.Keys.Tokenizer.MODEL: SimpleNamespace(contents=lambda: "gpt2"),
        gguf.Keys.Tokenizer.CHAT_TEMPLATE: SimpleNamespace(contents=lambda: "{{ messages[0]['content'] }}"),
    }
    reader = SimpleNamespace(get_field=fields.get)
    converted = tiny_chat_model().tokenizer
    conversions = []
    real_from_pretrained = transformers.AutoTokenizer.from_pretrained

    def from_pretrained(folder, **kwargs):
        if "gguf_file" in kwargs:
            conversions.append(kwargs["gguf_file"])
            return converted
        return real_from_pretrained(folder, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    text = "what is the weather in paris"
    first = jaxkv_gguf.read_tokenizer(reader, path)
    assert conversions == ["model.gguf"] and jaxkv_gguf.tokenizer_cache_dir(path).is_dir()
    second = jaxkv_gguf.read_tokenizer(reader, path)
    assert conversions == ["model.gguf"]  # read from the cache
    assert second is not converted and second(text)["input_ids"] == first(text)["input_ids"] == converted(text)["input_ids"]
    assert second.chat_template == "{{ messages[0]['content'] }}"
    assert not [p for p in jaxkv_gguf.tokenizer_cache_dir(path).parent.iterdir() if p.name.startswith(".partial")]
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    jaxkv_gguf.read_tokenizer(reader, path)
    assert conversions == ["model.gguf"] * 2  # a changed file is converted afresh


def test_the_shipped_intentkv_head_is_smollm2s(smollm2):
    """The head in ``jaxkv/assets/smollm2-135m-instruct`` passes the model check for
    SmolLM2 (head_dim and signature) and is refused for the embedded model."""
    from jaxkv.errors import ConfigError
    from jaxkv.models import registry
    from jaxkv.models.loading import EMBEDDED_DIR, read_config
    from jaxkv.policies import intentkv_head as ih

    head = ih.load_head(registry.SHIPPED_ASSETS / "smollm2-135m-instruct" / ih.HEAD_FOLDER)
    ih.check_head_model(head, smollm2[0].config)
    with pytest.raises(ConfigError):
        ih.check_head_model(head, read_config(EMBEDDED_DIR))  # the embedded model's config, as load_model reads it
