"""IntentKV Phase 2 policies: the rule score plus the learned residual head, and ablations.

``intentkv`` scores an event's candidates with ``z_i = s_i + α·r_i`` (ALGORITHMS.md
§4; the head is ``jaxkv.policies.intentkv_head``):

* ``s`` is the Phase-1 memory rule exactly as ``intentkv_memory`` computes it
  (``intentkv.scoring_memory`` + ``intentkv.score_with``), with the same
  QueryMemory state and update (``intentkv.observe``, ``β = 0.7``);
* ``r`` is the residual head on ``k̄`` (mean live keys), ``m̄`` (mean memory) and
  the keys at the live positions of the actionable query span
  (``EventFeatures.query_span_N``; ``None`` reads no span key: ``c_i = 0``);
* ``α`` is the head's learned scalar clipped to ``[0, alpha_max]``.

Ablations (the same head and state; ALGORITHMS.md §4):

* ``intentkv_no_memory``: ``m := q̄_t`` for both the rule score and the head's
  ``m̄``, projected to unit norm like every memory (the memory with ``β = 0``:
  the head was trained on unit-norm memories, and ``intentkv_memory`` scores
  its first turn with exactly this vector);
* ``intentkv_no_xattn``: ``c_i := 0``;
* ``intentkv_no_residual``: ``α := 0``, so ``z = s`` bit for bit and the kept set
  is exactly ``intentkv_memory``'s (the head is not evaluated).

The head's parameters live in the policy **state** (``IntentKVHeadState``), loaded
by ``init_state`` from ``IntentKVConfig.head`` (a folder with ``head.safetensors``
+ ``head.json``; None: the head shipped for the embedded model); the config holds
only the path, so it stays hashable and static under jit, and ``score`` stays a
pure function of (state, features). ``init_state`` raises ``jaxkv.ConfigError``
for a head trained for another ``head_dim``. None of these policies forces
anything of its own; events run after prefill only.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax.numpy as jnp
from flax import struct

from jaxkv.policies import intentkv
from jaxkv.policies.base import Needs, Policy, register
from jaxkv.policies.common import unit_norm
from jaxkv.policies.intentkv_head import HeadConfig, alpha_of, check_head_model, combine, load_head, mean_keys, mean_query, residual_scores

MODES = ("full", "no_memory", "no_xattn", "no_residual")


@dataclasses.dataclass(frozen=True)
class IntentKVConfig:
    """Attributes:
    head: folder holding ``head.safetensors`` + ``head.json`` (a ``str``; None: the
      head shipped for the embedded model, ``jaxkv/assets/embedded-agent/intentkv-head``).
    beta: memory decay in ``m_t = β·m_{t−1} + (1−β)·q̄_t``; 0.7 (as ``intentkv_memory``).
    """

    head: str | None = None
    beta: float = 0.7

    def __post_init__(self):
        if self.head is not None:
            object.__setattr__(self, "head", str(self.head))


@struct.dataclass
class IntentKVHeadState:
    """Per-session state of the learned policies.

    Attributes:
      memory: the session's ``intentkv.QueryMemory`` (``m [L, Hq, D]``).
      params: the head's float32 parameters (an ``nnx.State`` pytree).
      graphdef: the head's module structure (static).
      head_cfg: its ``HeadConfig`` (static).
    """

    memory: intentkv.QueryMemory
    params: Any
    graphdef: Any = struct.field(pytree_node=False)
    head_cfg: HeadConfig = struct.field(pytree_node=False)


def init_state(cfg: IntentKVConfig, model_cfg) -> IntentKVHeadState:
    head = load_head(cfg.head)
    check_head_model(head, model_cfg, f"at {cfg.head}" if cfg.head else "shipped for the embedded model")
    return IntentKVHeadState(intentkv.init_state(cfg, model_cfg), head.params, head.graphdef, head.cfg)


def observe(cfg: IntentKVConfig, state: IntentKVHeadState, obs) -> IntentKVHeadState:
    return state.replace(memory=intentkv.observe(cfg, state.memory, obs))


def score(cfg: IntentKVConfig, state: IntentKVHeadState, feats, candidates_N, *, mode: str = "full"):
    if mode == "no_memory":
        m_LHD = unit_norm(feats.query_mean_LHD)
    else:
        m_LHD = intentkv.scoring_memory(state.memory, feats)
    s_N = intentkv.score_with(m_LHD, feats, candidates_N)
    if mode == "no_residual":
        return s_N, state
    r_N = residual_scores(
        state.graphdef, state.params, mean_keys(feats.keys_LNKD), mean_query(m_LHD), feats.query_span_N, xattn=mode != "no_xattn"
    )
    z_N = combine(s_N, r_N, alpha_of(state.params, state.head_cfg.alpha_max))
    return jnp.where(jnp.asarray(candidates_N, bool), z_N, 0.0), state


def needs(cfg: IntentKVConfig) -> Needs:
    return Needs(query_mean=True, query_span=True)


def _register(name: str, mode: str, doc: str) -> Policy:
    return register(
        Policy(
            name=name,
            config=IntentKVConfig,
            score=functools.partial(score, mode=mode),
            needs=needs,
            init_state=init_state,
            observe=observe,
            doc=doc,
            one_set_only="its learned head reads keys averaged over layers and was trained to rank one set for the model",
        )
    )


LEARNED = _register("intentkv", "full", "IntentKV Phase 2: memory rule score + learned residual head.")
NO_MEMORY = _register("intentkv_no_memory", "no_memory", "IntentKV Phase 2 with m := unit-norm q̄_t (no cross-turn memory).")
NO_XATTN = _register("intentkv_no_xattn", "no_xattn", "IntentKV Phase 2 without the query-span cross-attention (c := 0).")
NO_RESIDUAL = _register("intentkv_no_residual", "no_residual", "IntentKV Phase 2 with α := 0: the memory rule score.")
