"""ModelConfig: the static description of a decoder, built from a HF ``config.json``.

A ``ModelConfig`` is frozen and hashable so it can be a static argument under
``jax.jit``. One config class covers every supported family; family differences
are flags (``qkv_bias``, ``qk_norm``) rather than subclasses, so the forward pass
is written once.

Supported ``model_type`` values are listed in ``SUPPORTED_MODEL_TYPES``; anything
else raises ``UnsupportedModelError`` naming them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from jaxkv.errors import ConfigError, UnsupportedModelError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (NeoX split-half pairs ``(i, i + d/2)``).

    Attributes:
      theta: base of the inverse frequencies.
      rope_type: ``"default"``, ``"linear"`` or ``"llama3"``.
      factor: frequency scaling factor (``linear`` and ``llama3``).
      low_freq_factor, high_freq_factor, original_max_position_embeddings:
        Llama-3 frequency scaling parameters.
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "RopeConfig":
        # transformers >= 5 writes `rope_parameters`; older checkpoints write
        # `rope_theta` + `rope_scaling`. Accept both.
        params = dict(hf.get("rope_parameters") or {})
        scaling = dict(hf.get("rope_scaling") or {})
        merged = {**scaling, **params}
        theta = float(merged.get("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
        if rope_type not in ("default", "linear", "llama3"):
            raise ConfigError(f"unsupported rope_type {rope_type!r}; supported: default, linear, llama3")
        return cls(
            theta=theta,
            rope_type=rope_type,
            factor=float(merged.get("factor", 1.0)),
            low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
            high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(merged.get("original_max_position_embeddings", 8192)),
        )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static shape and numerics of a Llama / Qwen2 / Qwen3 decoder.

    Attributes:
      model_type: HF family name, one of ``SUPPORTED_MODEL_TYPES``.
      vocab_size: V.
      hidden_size: model width (letter M in shape names).
      intermediate_size: MLP width (F).
      num_layers: L.
      num_heads: Hq, query heads.
      num_kv_heads: Hkv, key/value heads (GQA group G = Hq / Hkv).
      head_dim: D, independent of hidden_size (Qwen3).
      rms_norm_eps: RMSNorm epsilon.
      rope: RopeConfig.
      tie_word_embeddings: LM head shares the embedding matrix.
      qkv_bias: q/k/v projections carry a bias (Qwen2, Llama attention_bias).
      o_bias: output projection carries a bias (Llama attention_bias).
      mlp_bias: MLP projections carry biases (Llama mlp_bias).
      qk_norm: per-head RMSNorm on q and k before RoPE (Qwen3).
      max_position_embeddings: context length the checkpoint was trained for.
      bos_token_id, eos_token_ids: special ids from config.json (may be empty).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(f"unsupported model_type {self.model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def group_size(self) -> int:
        """G = Hq / Hkv."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "ModelConfig":
        """Build from a parsed HF ``config.json`` dict."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if k not in hf]
        if missing:
            raise ConfigError(f"config.json lacks required fields: {', '.join(missing)}")
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"unsupported hidden_act {hf.get('hidden_act')!r}; only silu")
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = hf.get("head_dim") or hidden // num_heads
        attention_bias = bool(hf.get("attention_bias", False))
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return cls(
            model_type=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(hf),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama and Qwen3 only with attention_bias.
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=attention_bias if model_type == "llama" else False,
            mlp_bias=bool(hf.get("mlp_bias", False)) if model_type == "llama" else False,
            qk_norm=model_type == "qwen3",
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
        )
