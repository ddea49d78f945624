"""SnapKV (Li et al., 2024): score keys by the attention of an observation window.

Rule (ALGORITHMS.md §2): the observation window is the last ``w`` query rows (after
prefill: the last prompt rows). For each layer and KV head,
``a_i = Σ_{window rows} softmax attention to i`` (softmax over all live keys the row
sees, causal by position), averaged over the GQA group; ``a`` is smoothed by a
same-size 1-D pool of width ``kernel`` along the live positions (in position order),
then averaged over layers and KV heads. The window rows' own positions are kept.

Pooling: ``"max"`` (default) pads with −inf; ``"avg"`` averages the in-range
entries only, so an edge is not diluted by padding (torch's ``avg_pool1d`` with
``count_include_pad=True``, used by the reference code, divides by ``kernel``).

Defaults: ``w = 32``, ``kernel = 7``, ``pooling = "max"``, after prefill only.
Shapes: ``window_q_LWHD`` ``[L, W, Hq, D]``, ``keys_LNKD`` ``[L, N, Hkv, D]``;
``pool_1d`` maps ``[..., N]`` to ``[..., N]``; outputs ``[N]``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxkv.errors import ConfigError
from jaxkv.policies.base import Needs, Policy, attention_probs, register
from jaxkv.policies.common import mark_positions

POOLINGS = ("max", "avg")


@dataclasses.dataclass(frozen=True)
class SnapKVConfig:
    """Attributes:
    w: observation-window rows (the last ``w`` prompt queries); default 32.
    kernel: width of the 1-D pooling along positions; default 7 (1: no pooling).
    pooling: ``"max"`` (default) or ``"avg"``.
    """

    w: int = 32
    kernel: int = 7
    pooling: str = "max"

    def __post_init__(self):
        if self.pooling not in POOLINGS:
            raise ConfigError(f"snapkv pooling must be one of {POOLINGS}, got {self.pooling!r}")
        if self.kernel < 1 or self.w < 1:
            raise ConfigError(f"snapkv needs kernel >= 1 and w >= 1, got kernel={self.kernel}, w={self.w}")


def pool_1d(x_N, kernel: int, pooling: str, valid_N=None):
    """Same-size stride-1 pooling of width ``kernel`` along the last axis.

    Entries outside ``valid_N`` (padding) take no part: max ignores them, avg
    divides by the number of valid entries in the window.
    """
    lo = (kernel - 1) // 2
    pad = [(0, 0)] * (x_N.ndim - 1) + [(lo, kernel - 1 - lo)]
    dims = (1,) * (x_N.ndim - 1) + (kernel,)
    strides = (1,) * x_N.ndim
    valid = jnp.ones(x_N.shape[-1], bool) if valid_N is None else jnp.asarray(valid_N, bool)
    if pooling == "max":
        return jax.lax.reduce_window(jnp.where(valid, x_N, -jnp.inf), -jnp.inf, jax.lax.max, dims, strides, pad)
    ones = jnp.broadcast_to(valid, x_N.shape).astype(x_N.dtype)
    total = jax.lax.reduce_window(x_N * ones, 0.0, jax.lax.add, dims, strides, pad)
    count = jax.lax.reduce_window(ones, 0.0, jax.lax.add, dims, strides, pad)
    return total / jnp.maximum(count, 1.0)


def keep(cfg: SnapKVConfig, feats):
    return mark_positions(feats.positions_N, feats.window_pos_W, feats.window_valid_W)


def score(cfg: SnapKVConfig, state, feats, candidates_N):
    L, N, Hkv, _ = feats.keys_LNKD.shape
    probs_LHWN = attention_probs(feats.window_q_LWHD, feats.keys_LNKD, causal_q_pos=feats.window_pos_W, k_pos_N=feats.positions_N)
    mass_LHN = jnp.einsum("lhwn,w->lhn", probs_LHWN, feats.window_valid_W.astype(jnp.float32))
    mass_LKN = mass_LHN.reshape(L, Hkv, -1, N).mean(axis=2)  # mean over the GQA group
    return pool_1d(mass_LKN, cfg.kernel, cfg.pooling, feats.valid()).mean(axis=(0, 1)), state


def needs(cfg: SnapKVConfig) -> Needs:
    return Needs(window=cfg.w)


POLICY = register(
    Policy(
        name="snapkv",
        config=SnapKVConfig,
        score=score,
        needs=needs,
        keep=keep,
        doc="SnapKV: pooled observation-window attention; window kept.",
    )
)
