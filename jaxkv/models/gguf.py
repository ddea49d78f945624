"""GGUF checkpoints (llama.cpp's format) read into HF-named float32 tensors.

``read_gguf(path)`` opens a ``.gguf`` file with the ``gguf`` package's reader
(``gguf.GGUFReader``, which memory-maps it), builds the HF-style config dict from
the file's metadata, checks every tensor against that config, dequantizes each with
``gguf.quants.dequantize`` (F32, F16, BF16, Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, the K-quants
and whatever else that function implements) and returns a ``GGUFCheckpoint``:
the ``ModelConfig``, the config dict, the tensors under the names
``jaxkv.models.weights.hf_parameter_map`` uses, and the tokenizer. No part of the
format is parsed here by hand. With ``lazy=True`` (what ``load_model`` uses) each
tensor is dequantized only when read, so loading holds one float32 tensor at a
time beside the model rather than a float32 copy of the whole file.

Conventions undone on the way (so the tensors are exactly the HF checkpoint's):

* Names: the GGUF name of each HF parameter comes from ``gguf``'s own tensor-name
  map for the architecture (``gguf.get_tensor_name_map``).
* Shapes: GGUF lists dimensions fastest-first; the reader and the dequantizer give
  numpy (row-major) arrays, which are HF's ``[out, in]`` layout.
* Q/K rows (``llama`` only): llama.cpp's converter permutes the rows of
  ``q_proj`` / ``k_proj`` weights and biases of Llama-family checkpoints (its
  ``LlamaModel.permute``: within each head, the HF split-half rotary pairs
  ``(i, i + D/2)`` become adjacent rows ``(2i, 2i + 1)``, the layout llama.cpp's
  "normal" RoPE expects). ``unpermute_qk`` inverts it. ``qwen2`` and ``qwen3`` are
  converted without it (llama.cpp runs them with NeoX RoPE), so nothing is undone.

Config from metadata (keys per ``gguf.Keys``): ``{arch}.block_count``,
``embedding_length``, ``feed_forward_length``, ``attention.head_count`` /
``head_count_kv``, ``attention.key_length`` (head_dim; else ``rope.dimension_count``,
else hidden / heads; rotary dimensions must equal head_dim), ``attention.layer_norm_rms_epsilon``, ``context_length``, ``rope.freq_base``,
``rope.scaling.type`` / ``factor`` (``linear`` only), ``vocab_size`` (else the
embedding's rows); tied head when there is no ``output.weight``; attention biases
when the file has ``attn_q.bias`` (always for ``qwen2``); q/k norms for ``qwen3``;
bos / eos (+ eot, eom) ids from ``tokenizer.ggml.*``.

Tokenizer: transformers' own GGUF conversion
(``AutoTokenizer.from_pretrained(folder, gguf_file=name)``), with the chat template
from ``tokenizer.chat_template``; None when the file has no tokenizer metadata. The
conversion re-reads the file's metadata and rebuilds the vocabulary and merges
(~12 s for SmolLM2's 49k tokens on a 2-core CPU), so its result is saved once per
file in the user cache (``tokenizers/<key>/``, ``save_pretrained``'s files) and read
from there on later loads (``jaxkv.models.tokenizer.folder_tokenizer``: no torch import). The key is the file's resolved path, size and mtime and
the transformers version: a changed file or a new converter is converted afresh, and
a copy is written to a temporary folder and renamed into place, so a killed or
concurrent load never leaves a half-written copy that another would read.

Errors, all raised before any tensor is dequantized:

* unreadable, truncated or corrupt file     -> ``CheckpointError`` (missing: ``CheckpointNotFoundError``)
* architecture other than llama/qwen2/qwen3 -> ``UnsupportedModelError``
* metadata missing or inconsistent          -> ``ConfigError`` / ``CheckpointError``
* a tensor type ``gguf`` cannot dequantize  -> ``UnsupportedTensorTypeError`` (names tensor and type)
* a missing, misshapen or unexpected tensor -> ``CheckpointError`` naming it
* per-dimension RoPE factors (``rope_freqs.weight``, Llama-3.1 style) -> ``UnsupportedModelError``
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from jaxkv.config import SUPPORTED_MODEL_TYPES, ModelConfig
from jaxkv.errors import CheckpointError, CheckpointNotFoundError, ConfigError, UnsupportedModelError, UnsupportedTensorTypeError
from jaxkv.models.tokenizer import folder_tokenizer
from jaxkv.models.weights import check_tensor_shapes, hf_parameter_map

HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# The architectures llama.cpp's converter stores with Q/K rows permuted (LlamaModel.permute).
QK_PERMUTED_ARCHITECTURES = frozenset({"llama"})


@dataclasses.dataclass
class GGUFCheckpoint:
    """A GGUF file read into HF form.

    Attributes:
      config: the ``ModelConfig``.
      hf_config: the ``config.json`` dict transformers would write for it
        (``ModelConfig.from_hf(hf_config) == config``).
      tensors: HF tensor name -> float32 numpy array (``GGUFTensor`` when read
        with ``lazy=True``), HF layout, every name of ``hf_parameter_map(config)``
        and nothing else.
      tokenizer: a transformers tokenizer with the file's chat template, or None
        (not asked for, or the file has no tokenizer metadata).
      path: the ``.gguf`` file.
    """

    config: ModelConfig
    hf_config: dict
    tensors: dict[str, np.ndarray]
    tokenizer: Any
    path: Path


# --------------------------------------------------------------------------- file
def open_reader(path: Path) -> gguf.GGUFReader:
    """``gguf.GGUFReader`` of ``path``; a bad file becomes a typed error."""
    if not path.is_file():
        raise CheckpointNotFoundError(f"GGUF file {path} is missing")
    try:
        return gguf.GGUFReader(path, "r")
    except (ValueError, IndexError, KeyError, TypeError, OverflowError, UnicodeDecodeError, AssertionError) as err:
        # The reader raises these for a bad magic, an unknown value type, or offsets
        # and sizes that run past the end of a truncated file.
        raise CheckpointError(f"{path} is not a readable GGUF file (truncated or corrupt): {type(err).__name__}: {err}") from err


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    if field is None:
        return default
    try:
        return field.contents()
    except (ValueError, IndexError, UnicodeDecodeError) as err:
        raise CheckpointError(f"GGUF metadata {key!r} is corrupt: {err}") from err


def architecture(reader: gguf.GGUFReader) -> str:
    arch = _field(reader, gguf.Keys.General.ARCHITECTURE)
    if arch not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return arch


# --------------------------------------------------------------------------- config
def hf_config_from_metadata(reader: gguf.GGUFReader) -> dict:
    """The HF ``config.json`` dict of the file's model (see the module docstring)."""
    arch = architecture(reader)
    tensors = {t.name: t for t in reader.tensors}

    def key(template: str, default: Any = None, required: bool = False) -> Any:
        name = template.format(arch=arch)
        value = _field(reader, name, default)
        if required and value is None:
            raise CheckpointError(f"GGUF metadata lacks {name!r}")
        return value

    if "rope_freqs.weight" in tensors:
        raise UnsupportedModelError(
            "this GGUF stores per-dimension RoPE frequency factors (rope_freqs.weight, Llama-3.1-style "
            "scaling); jaxkv does not read them yet"
        )
    L = gguf.Keys.LLM
    A = gguf.Keys.Attention
    R = gguf.Keys.Rope
    T = gguf.Keys.Tokenizer
    hidden = int(key(L.EMBEDDING_LENGTH, required=True))
    heads = int(key(A.HEAD_COUNT, required=True))
    kv_heads = key(A.HEAD_COUNT_KV, heads)
    if isinstance(kv_heads, list):  # per-layer counts: jaxkv needs one
        if len(set(kv_heads)) != 1:
            raise ConfigError(f"GGUF {arch} has per-layer KV head counts {sorted(set(kv_heads))}; jaxkv needs one count")
        kv_heads = kv_heads[0]
    rotary_dims = key(R.DIMENSION_COUNT)
    head_dim = key(A.KEY_LENGTH) or rotary_dims or hidden // heads
    value_dim = key(A.VALUE_LENGTH) or head_dim
    if value_dim != head_dim:
        raise ConfigError(f"GGUF key length {head_dim} != value length {value_dim}; jaxkv needs them equal")
    if rotary_dims not in (None, head_dim):
        raise ConfigError(f"GGUF rotary dimensions {rotary_dims} != head_dim {head_dim}; jaxkv rotates whole heads only")
    vocab = key(L.VOCAB_SIZE)
    if vocab is None and "token_embd.weight" in tensors:
        vocab = int(tensors["token_embd.weight"].shape[-1])  # GGUF shape: [hidden, vocab]
    rope: dict[str, Any] = {"rope_theta": float(key(R.FREQ_BASE, 10000.0)), "rope_type": "default"}
    scaling = key(R.SCALING_TYPE)
    if scaling not in (None, "none"):
        rope.update(rope_type=scaling, factor=float(key(R.SCALING_FACTOR, 1.0)))
    has_bias = "blk.0.attn_q.bias" in tensors
    hf: dict[str, Any] = {
        "architectures": [HF_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": None if vocab is None else int(vocab),
        "hidden_size": hidden,
        "intermediate_size": key(L.FEED_FORWARD_LENGTH, required=True),
        "num_hidden_layers": key(L.BLOCK_COUNT, required=True),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(head_dim),
        "hidden_act": "silu",
        "rms_norm_eps": float(key(A.LAYERNORM_RMS_EPS, 1e-6)),
        "rope_theta": rope["rope_theta"],
        "rope_parameters": rope,
        "max_position_embeddings": key(L.CONTEXT_LENGTH, 4096),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": has_bias and arch != "qwen2",  # qwen2's q/k/v biases are implied by its type
        "torch_dtype": "float32",
    }
    if arch == "llama":
        hf["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    bos = key(T.BOS_ID)
    if bos is not None:
        hf["bos_token_id"] = int(bos)
    eos = [int(i) for i in dict.fromkeys(key(k) for k in (T.EOS_ID, T.EOT_ID, T.EOM_ID)) if i is not None]
    if eos:
        hf["eos_token_id"] = eos if len(eos) > 1 else eos[0]
    missing = [k for k, v in hf.items() if v is None]
    if missing:
        raise CheckpointError(f"GGUF metadata does not give {', '.join(missing)}")
    for k in ("intermediate_size", "num_hidden_layers", "max_position_embeddings"):
        hf[k] = int(hf[k])
    return hf


# --------------------------------------------------------------------------- tensors
@functools.cache
def dequantizable(qtype: gguf.GGMLQuantizationType) -> bool:
    """Whether ``gguf.quants.dequantize`` implements ``qtype`` (probed on one zero block)."""
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        gguf.quants.dequantize(np.zeros((1, type_size), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def supported_tensor_types() -> list[str]:
    return [q.name for q in gguf.GGMLQuantizationType if q in gguf.GGML_QUANT_SIZES and dequantizable(q)]


def gguf_tensor_names(cfg: ModelConfig) -> dict[str, str]:
    """HF tensor name -> GGUF tensor name, for every parameter of ``cfg``."""
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == cfg.model_type)
    name_map = gguf.get_tensor_name_map(arch, cfg.num_layers)
    out = {}
    for hf_name in hf_parameter_map(cfg):
        base, suffix = hf_name.rsplit(".", 1)
        gguf_base = name_map.get_name(base)
        if gguf_base is None:  # every jaxkv parameter has a GGUF name; a gguf upgrade that drops one lands here
            raise CheckpointError(f"the gguf package has no GGUF name for {hf_name!r} ({cfg.model_type})")
        out[hf_name] = f"{gguf_base}.{suffix}"
    return out


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert llama.cpp's ``LlamaModel.permute`` of a q/k weight ``[H*D, in]`` or bias ``[H*D]``:
    within each head, rows ``(2i, 2i + 1)`` go back to ``(i, i + D/2)``."""
    rows = w.shape[0]
    per_head = w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
    return per_head.swapaxes(1, 2).reshape(w.shape)


class GGUFTensor:
    """One tensor of an open GGUF file under its HF name: ``shape`` (HF layout) known
    up front, dequantized to float32 (and, for llama's q/k, un-permuted) on
    ``np.asarray(t)``, a fresh array each time."""

    def __init__(self, tensor, shape: tuple[int, ...], qk_heads: int | None, path: Path):
        self._tensor, self.shape, self._qk_heads, self.path = tensor, shape, qk_heads, path

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def type_name(self) -> str:
        return self._tensor.tensor_type.name

    def __array__(self, dtype=None, copy=None):
        t = self._tensor
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        except (ValueError, TypeError) as err:
            raise CheckpointError(f"{self.path}: tensor {t.name} ({t.tensor_type.name}) is corrupt: {err}") from err
        arr = np.asarray(arr, np.float32).reshape(self.shape)
        if self._qk_heads is not None:
            arr = unpermute_qk(arr, self._qk_heads)
        return arr if dtype is None else arr.astype(dtype, copy=False)


def read_gguf(path, *, load_tokenizer: bool = True, lazy: bool = False) -> GGUFCheckpoint:
    """Read a ``.gguf`` file (see the module docstring); every check runs here.

    ``lazy=False``: ``tensors`` holds dequantized float32 arrays. ``lazy=True``: it
    holds ``GGUFTensor`` s that dequantize when read (``np.asarray``), so a loader
    holds one float32 tensor at a time instead of the whole model (``load_model``)."""
    path = Path(path).expanduser()
    reader = open_reader(path)
    hf = hf_config_from_metadata(reader)
    cfg = ModelConfig.from_hf(hf)
    by_name = {t.name: t for t in reader.tensors}
    names = gguf_tensor_names(cfg)

    bad_types = [
        f"{g} ({by_name[g].tensor_type.name})" for g in names.values() if g in by_name and not dequantizable(by_name[g].tensor_type)
    ]
    if bad_types:
        raise UnsupportedTensorTypeError(
            f"{path}: tensor type(s) the gguf package cannot dequantize: {', '.join(bad_types[:5])}; "
            f"supported: {', '.join(supported_tensor_types())}"
        )
    unexpected = sorted(set(by_name) - set(names.values()))
    if unexpected:
        raise CheckpointError(f"{path} holds tensor(s) a {cfg.model_type} with this config does not have: {', '.join(unexpected[:5])}")
    shapes = {hf_name: tuple(int(n) for n in reversed(by_name[g].shape)) for hf_name, g in names.items() if g in by_name}
    check_tensor_shapes(cfg, shapes, str(path), file_names=names)

    def qk_heads(hf_name: str) -> int | None:
        if cfg.model_type not in QK_PERMUTED_ARCHITECTURES:
            return None
        if ".self_attn.q_proj." in hf_name:
            return cfg.num_heads
        if ".self_attn.k_proj." in hf_name:
            return cfg.num_kv_heads
        return None

    tensors = {hf_name: GGUFTensor(by_name[g], shapes[hf_name], qk_heads(hf_name), path) for hf_name, g in names.items()}
    if not lazy:
        tensors = {name: np.asarray(t) for name, t in tensors.items()}
    tokenizer = read_tokenizer(reader, path) if load_tokenizer else None
    return GGUFCheckpoint(cfg, hf, tensors, tokenizer, path)


# --------------------------------------------------------------------------- tokenizer
def read_tokenizer(reader: gguf.GGUFReader, path: Path):
    """transformers' tokenizer of the file, with its chat template; None without tokenizer metadata."""
    if reader.get_field(gguf.Keys.Tokenizer.MODEL) is None:
        return None
    cached = tokenizer_cache_dir(path)
    if cached.is_dir():
        tokenizer = folder_tokenizer(cached)
    else:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        except (ValueError, KeyError, TypeError, OSError) as err:
            raise CheckpointError(f"{path}: transformers cannot build a tokenizer from its metadata: {err}") from err
        _save_converted_tokenizer(tokenizer, cached)
    template = _field(reader, gguf.Keys.Tokenizer.CHAT_TEMPLATE)
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


def tokenizer_cache_dir(path: Path) -> Path:
    """Where the converted tokenizer of the GGUF file ``path`` is kept: one folder per
    (resolved path, size, mtime, transformers version)."""
    import hashlib

    import transformers

    from jaxkv.models.registry import user_cache_dir

    path = Path(path).resolve()
    stat = path.stat()
    key = f"{path}|{stat.st_size}|{stat.st_mtime_ns}|transformers {transformers.__version__}"
    return user_cache_dir() / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:20]


def _save_converted_tokenizer(tokenizer, folder: Path) -> None:
    """Write ``tokenizer`` to ``folder`` through a temporary sibling renamed into place.
    A cache that cannot be written (read-only home) only costs the next load a conversion."""
    import shutil
    import tempfile

    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".partial-"))
    except OSError:
        return
    try:
        tokenizer.save_pretrained(str(tmp))
        tmp.rename(folder)  # atomic; fails if a concurrent load renamed its copy first
    except OSError:
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
