"""IntentKV rule score (papers/intentkv.txt, ALGORITHMS.md §4, Phase 1).

QueryMemory: one vector per layer and query head, ``m [L, Hq, D]``, kept per
session. At the first observation of a turn (``obs.new_turn``) with ``q̄_t`` the
mean post-RoPE query over the turn's actionable query span:
``m_1 = q̄_1``; ``m_t = β·m_{t−1} + (1−β)·q̄_t``; then ``m_t`` is projected to unit
norm along ``D`` (epsilon-safe), so its norm does not grow with the turn count.

Score: ``s_i = mean_{l,h} softmax_i(m^{l,h}·k_i^{l,h}/√d)`` over the candidates
(K expanded under GQA; ``common.candidate_attention``). Two registered modes share
``score_with`` and differ only in the vector passed:
* ``intentkv_memory``: ``m`` (if no turn was observed yet, the unit-normalised
  ``q̄_t`` of the event, which is what the first update would store);
* ``intentkv_query``: the current turn's ``q̄_t`` (``feats.query_mean_LHD``),
  stateless (the paper's ``no-memory`` ablation of the rule score).

Neither forces anything of its own. Defaults: ``β = 0.7`` (this project's choice:
the paper's value was lost), events after prefill only.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from jaxkv.policies.base import Needs, Policy, register
from jaxkv.policies.common import candidate_attention, unit_norm


@dataclasses.dataclass(frozen=True)
class IntentKVMemoryConfig:
    """Attributes:
    beta: weight of the previous memory in ``m_t = β·m_{t−1} + (1−β)·q̄_t``; 0.7.
    """

    beta: float = 0.7


@dataclasses.dataclass(frozen=True)
class IntentKVQueryConfig:
    """No options: scores with the current turn's actionable-query mean."""


@struct.dataclass
class QueryMemory:
    """Per-session IntentKV state.

    Attributes:
      m_LHD: unit-norm memory ``[L, Hq, D]`` float32 (zeros until initialized).
      initialized: whether a turn has been folded in (bool scalar).
    """

    m_LHD: jax.Array
    initialized: jax.Array


def init_state(cfg: IntentKVMemoryConfig, model_cfg) -> QueryMemory:
    shape = (model_cfg.num_layers, model_cfg.num_heads, model_cfg.head_dim)
    return QueryMemory(jnp.zeros(shape, jnp.float32), jnp.zeros((), bool))


def blend_memory(beta: float, state: QueryMemory, q_mean_LHD):
    """The memory update before its unit-norm projection: ``β·m_{t−1} + (1−β)·q̄_t``
    (``q̄_1`` on the first turn)."""
    q = jnp.asarray(q_mean_LHD, jnp.float32)
    return jnp.where(state.initialized, beta * state.m_LHD + (1.0 - beta) * q, q)


def update_memory(beta: float, state: QueryMemory, q_mean_LHD) -> QueryMemory:
    """Fold one turn's ``q̄_t`` into the memory (unconditionally)."""
    return QueryMemory(unit_norm(blend_memory(beta, state, q_mean_LHD)), jnp.ones((), bool))


def observe(cfg: IntentKVMemoryConfig, state: QueryMemory, obs) -> QueryMemory:
    updated = update_memory(cfg.beta, state, obs.query_mean_LHD)
    return jax.tree.map(lambda new, old: jnp.where(obs.new_turn, new, old), updated, state)


def score_with(m_LHD, feats, candidates_N):
    """``s_i = mean_{l,h} softmax_i(m·k_i/√d)`` over candidates, for ``m_LHD [L, Hq, D]``."""
    return candidate_attention(m_LHD[:, None], feats.keys_LNKD, candidates_N)


def scoring_memory(state: QueryMemory, feats):
    """The ``m [L, Hq, D]`` an event scores with: the memory, or before any turn was
    observed the unit-normalised ``q̄_t`` of the event (what the first update stores)."""
    return jnp.where(state.initialized, state.m_LHD, unit_norm(feats.query_mean_LHD))


def memory_score(cfg: IntentKVMemoryConfig, state: QueryMemory, feats, candidates_N):
    return score_with(scoring_memory(state, feats), feats, candidates_N), state


def query_score(cfg: IntentKVQueryConfig, state, feats, candidates_N):
    return score_with(feats.query_mean_LHD, feats, candidates_N), state


def layer_state(state: QueryMemory, l) -> QueryMemory:
    """The memory of layer ``l`` alone (a one-layer view, ``keep_sets="layer"``)."""
    return QueryMemory(jax.lax.dynamic_slice_in_dim(state.m_LHD, l, 1, axis=0), state.initialized)


def needs(cfg) -> Needs:
    return Needs(query_mean=True)


MEMORY = register(
    Policy(
        name="intentkv_memory",
        config=IntentKVMemoryConfig,
        score=memory_score,
        needs=needs,
        init_state=init_state,
        observe=observe,
        doc="IntentKV rule score against the session's unit-norm QueryMemory.",
        layer_state=layer_state,
    )
)
QUERY = register(
    Policy(
        name="intentkv_query",
        config=IntentKVQueryConfig,
        score=query_score,
        needs=needs,
        doc="IntentKV rule score against the current turn's query mean (no memory).",
    )
)
