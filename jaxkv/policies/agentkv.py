"""AgentKV (papers/agentkv.md): score keys against per-phase representative queries.

Rule (ALGORITHMS.md §3): every observed query row carries a phase (think, act, tool,
others; ``jaxkv.chat.Phase``). Per phase a FIFO ring holds the ``q/4`` most recent
post-RoPE query vectors (per layer and query head). At an event the filled ring
entries are merged, ``Q = ∪ rings``, and
``score_i = mean_{q∈Q} softmax_i(q·k_i/√d)`` over the candidates, averaged over
layers and GQA-expanded heads (``common.candidate_attention``). The policy forces
nothing of its own: the engine adds the protected prefix and the actionable query.
With every ring empty all scores are 0 (ties: lower positions kept).

State (``AgentKVState``): rings ``[P=4, R=q/4, L, Hq, D]`` float32 and per-phase
push counts; ring slot of the ``n``-th push of a phase is ``n mod R``.
``observe`` is vectorised: a valid row is written iff it is among the last ``R``
valid rows of its phase in the observation, at slot ``(count + rank) mod R``.

Defaults: ``q = 32`` (8 per phase), events after prefill and every
``decode_interval = 128`` decoded tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from jaxkv.chat.tags import Phase
from jaxkv.errors import ConfigError
from jaxkv.policies.base import Needs, Policy, register
from jaxkv.policies.common import candidate_attention

NUM_PHASES = len(Phase)


@dataclasses.dataclass(frozen=True)
class AgentKVConfig:
    """Attributes:
    q: total representative queries, ``q/4`` per phase ring; default 32.
    decode_interval: compress every this many decoded tokens (default 128; None:
      after prefill only).
    """

    q: int = 32
    decode_interval: int | None = 128

    def __post_init__(self):
        if self.q < NUM_PHASES or self.q % NUM_PHASES:
            raise ConfigError(f"agentkv q must be a positive multiple of {NUM_PHASES}, got {self.q}")

    @property
    def ring_size(self) -> int:
        return self.q // NUM_PHASES


@struct.dataclass
class AgentKVState:
    """Per-session phase rings.

    Attributes:
      ring_PRLHD: query vectors ``[4, q/4, L, Hq, D]`` float32, indexed by ``Phase``.
      count_P: rows pushed per phase so far (int32 ``[4]``); ring ``p`` holds
        ``min(count_P[p], q/4)`` entries, the oldest at slot ``count_P[p] mod (q/4)``
        once full.
    """

    ring_PRLHD: jax.Array
    count_P: jax.Array

    @property
    def filled_PR(self) -> jax.Array:
        """Which ring entries hold a query (bool ``[4, q/4]``)."""
        R = self.ring_PRLHD.shape[1]
        return jnp.arange(R)[None, :] < self.count_P[:, None]


def init_state(cfg: AgentKVConfig, model_cfg) -> AgentKVState:
    shape = (NUM_PHASES, cfg.ring_size, model_cfg.num_layers, model_cfg.num_heads, model_cfg.head_dim)
    return AgentKVState(jnp.zeros(shape, jnp.float32), jnp.zeros((NUM_PHASES,), jnp.int32))


def observe(cfg: AgentKVConfig, state: AgentKVState, obs) -> AgentKVState:
    R = cfg.ring_size
    valid_X = jnp.asarray(obs.valid_X, bool)
    onehot_XP = (obs.phase_X[:, None] == jnp.arange(NUM_PHASES)[None, :]) & valid_X[:, None]
    rank_XP = jnp.cumsum(onehot_XP, axis=0, dtype=jnp.int32) - 1  # index among its phase's rows
    total_P = onehot_XP.sum(axis=0, dtype=jnp.int32)
    phase_X = jnp.clip(obs.phase_X, 0, NUM_PHASES - 1)
    rank_X = jnp.take_along_axis(rank_XP, phase_X[:, None], axis=1)[:, 0]
    written_X = valid_X & onehot_XP.any(axis=1) & (rank_X >= total_P[phase_X] - R)
    slot_X = (state.count_P[phase_X] + rank_X) % R
    # rows not written go to an out-of-range phase and are dropped by the scatter
    dest_X = jnp.where(written_X, phase_X, NUM_PHASES)
    rows_XLHD = jnp.moveaxis(obs.q_LXHD, 1, 0).astype(jnp.float32)
    ring = state.ring_PRLHD.at[dest_X, slot_X].set(rows_XLHD, mode="drop")
    return AgentKVState(ring, state.count_P + total_P)


def score(cfg: AgentKVConfig, state: AgentKVState, feats, candidates_N):
    P, R, L, Hq, D = state.ring_PRLHD.shape
    q_LQHD = jnp.moveaxis(state.ring_PRLHD.reshape(P * R, L, Hq, D), 0, 1)
    scores_N = candidate_attention(q_LQHD, feats.keys_LNKD, candidates_N, state.filled_PR.reshape(P * R))
    return scores_N, state


def layer_state(state: AgentKVState, l) -> AgentKVState:
    """The rings of layer ``l`` alone (a one-layer view, ``keep_sets="layer"``)."""
    return AgentKVState(jax.lax.dynamic_slice_in_dim(state.ring_PRLHD, l, 1, axis=2), state.count_P)


def needs(cfg: AgentKVConfig) -> Needs:
    return Needs(observe_rows=True, decode_interval=cfg.decode_interval)


POLICY = register(
    Policy(
        name="agentkv",
        config=AgentKVConfig,
        score=score,
        needs=needs,
        init_state=init_state,
        observe=observe,
        doc="AgentKV: softmax over candidates against per-phase query rings.",
        layer_state=layer_state,
    )
)
