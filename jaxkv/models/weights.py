"""HF parameter names and shapes of a ``Transformer``: the one map every checkpoint format goes through.

``hf_parameter_map(cfg)`` names each parameter of the NNX ``Transformer`` the way a
Hugging Face checkpoint does (``model.layers.3.self_attn.q_proj.weight``) and says
where it lives in the NNX state and whether it is stored transposed (HF linear
weights are ``[out, in]``, NNX kernels ``[in, out]``). A decoder layer's weight
lives at index ``i`` of a stacked leaf (the model's layers are one module with a
leading layer axis): its path is ``("layers", i, ...)``, and ``get_at`` /
``set_at`` / ``leaf_path`` read that index. ``expected_shapes(cfg)`` is
the HF-layout shape ``cfg`` implies for each name, and ``check_tensor_shapes``
holds a checkpoint's shapes against it.

Both readers (``jaxkv.models.loading`` for safetensors folders,
``jaxkv.models.gguf`` for GGUF files) and the writer (``loading.save_pretrained``)
use this module, so a format is only a way to get HF-named tensors in and out.

Invariants:
  * every name points at a leaf of ``Transformer(cfg)``: ``expected_shapes``
    reads each shape from the abstract module, so a name that points nowhere
    fails there, before any checkpoint is read;
  * nothing here reads or allocates weights: shapes come from ``nnx.eval_shape``;
  * this module imports the model, the config and the errors, never a loader,
    so every loader can import it without an import circle.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from jaxkv.config import ModelConfig
from jaxkv.errors import CheckpointError
from jaxkv.models.transformer import Transformer


def hf_parameter_map(cfg: ModelConfig) -> dict[str, tuple[tuple, bool]]:
    """HF tensor name -> (path in the NNX state, transpose?) for every parameter."""
    out: dict[str, tuple[tuple, bool]] = {"model.embed_tokens.weight": (("embed_tokens", "embedding"), False)}
    out["model.norm.weight"] = (("norm", "weight"), False)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (("lm_head", "kernel"), True)
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        base = ("layers", i)
        out[pre + "input_layernorm.weight"] = (base + ("input_layernorm", "weight"), False)
        out[pre + "post_attention_layernorm.weight"] = (base + ("post_attention_layernorm", "weight"), False)
        for proj, bias in (("q_proj", cfg.qkv_bias), ("k_proj", cfg.qkv_bias), ("v_proj", cfg.qkv_bias), ("o_proj", cfg.o_bias)):
            out[pre + f"self_attn.{proj}.weight"] = (base + ("self_attn", proj, "kernel"), True)
            if bias:
                out[pre + f"self_attn.{proj}.bias"] = (base + ("self_attn", proj, "bias"), False)
        if cfg.qk_norm:
            out[pre + "self_attn.q_norm.weight"] = (base + ("self_attn", "q_norm", "weight"), False)
            out[pre + "self_attn.k_norm.weight"] = (base + ("self_attn", "k_norm", "weight"), False)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            out[pre + f"mlp.{proj}.weight"] = (base + ("mlp", proj, "kernel"), True)
            if cfg.mlp_bias:
                out[pre + f"mlp.{proj}.bias"] = (base + ("mlp", proj, "bias"), False)
    return out


def leaf_path(path) -> tuple[tuple, int | None]:
    """``(path of the state leaf, layer index or None)``: a decoder layer's weight
    ``("layers", i, ...)`` is row ``i`` of the stacked leaf ``("layers", ...)``."""
    if len(path) > 1 and path[0] == "layers" and isinstance(path[1], int):
        return ("layers",) + tuple(path[2:]), path[1]
    return tuple(path), None


def get_at(tree, path):
    """The weight at ``path`` in a nested dict (an ``nnx.to_pure_dict`` state): a
    leaf, or one layer's row of a stacked leaf."""
    leaf, layer = leaf_path(path)
    for key in leaf:
        tree = tree[key]
    return tree if layer is None else tree[layer]


def set_at(tree, path, value):
    """Put ``value`` at a leaf ``path`` of a nested dict (a whole leaf: stacked
    layer weights are assembled by the caller, ``stacked_names``)."""
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def stacked_names(cfg: ModelConfig) -> dict[tuple, tuple[list[str], bool]]:
    """Leaf path -> (HF names in leaf order, transpose?) for every leaf: one name for
    a plain leaf, one per layer (index order) for a stacked layer leaf."""
    out: dict[tuple, tuple[list[str], bool]] = {}
    for name, (path, transpose) in hf_parameter_map(cfg).items():
        leaf, _ = leaf_path(path)
        out.setdefault(leaf, ([], transpose))[0].append(name)
    return out


@functools.lru_cache(maxsize=16)
def _abstract_module(cfg: ModelConfig, dt):
    return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, dt, rngs=nnx.Rngs(0))))


def abstract_module(cfg: ModelConfig, dt):
    """``(graphdef, abstract state)`` of a ``Transformer``: shapes only, no memory.

    Building it traces the module's construction (~3.5 s for a 30-layer model, all
    Python), so it is made once per (config, dtype); each call gets its own copy
    of the state, which callers fill in place."""
    graphdef, state = _abstract_module(cfg, dt)
    return graphdef, jax.tree.map(lambda leaf: leaf, state)


@functools.lru_cache(maxsize=16)
def expected_shapes(cfg: ModelConfig) -> Mapping[str, tuple[int, ...]]:
    """HF tensor name -> the HF-layout shape ``cfg`` implies, for every parameter."""
    pure = nnx.to_pure_dict(abstract_module(cfg, jnp.float32)[1])
    out = {}
    for name, (path, transpose) in hf_parameter_map(cfg).items():
        leaf, layer = leaf_path(path)
        shape = tuple(get_at(pure, leaf).shape)[(0 if layer is None else 1) :]  # a layer's row of a stacked leaf
        out[name] = shape[::-1] if transpose else shape
    return types.MappingProxyType(out)


def check_tensor_shapes(cfg: ModelConfig, shapes: Mapping[str, tuple], source: str, file_names: Mapping[str, str] | None = None) -> None:
    """``CheckpointError`` unless ``shapes`` (HF name -> HF shape) has every parameter
    of ``cfg`` in the shape it implies. ``file_names`` (HF name -> the file's own
    name, e.g. GGUF's) adds the file's name to the message."""

    def named(name: str) -> str:
        other = (file_names or {}).get(name)
        return f"{name} ({other})" if other and other != name else name

    expected = expected_shapes(cfg)
    missing = [named(name) for name in expected if name not in shapes]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"checkpoint {source} lacks tensor(s) {', '.join(missing[:5])}{more}")
    for name, want in expected.items():
        got = tuple(int(n) for n in shapes[name])
        if got != want:
            raise CheckpointError(f"tensor {named(name)} has shape {got} but the config implies {want}")
