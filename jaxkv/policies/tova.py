"""TOVA (Oren et al., 2024): keep the keys the current query attends to most.

Rule (ALGORITHMS.md §2): ``score_i`` = softmax attention of the last query row (the
last valid row of the observation window: the current token) to live key ``i``,
softmax over every live key that row can see (causal by position), averaged over
query heads (GQA-expanded) and layers. The row's own position is always kept when
it is live.

Defaults: one window row, compress after prefill and every ``decode_interval =
128`` decoded tokens. Shapes: ``window_q_LWHD`` ``[L, W, Hq, D]``, ``keys_LNKD``
``[L, N, Hkv, D]``; outputs ``[N]``.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxkv.policies.base import Needs, Policy, attention_probs, register
from jaxkv.policies.common import last_valid_index, mark_positions


@dataclasses.dataclass(frozen=True)
class TOVAConfig:
    """Attributes:
    decode_interval: compress every this many decoded tokens (default 128; None:
      after prefill only).
    """

    decode_interval: int | None = 128


def keep(cfg: TOVAConfig, feats):
    last = last_valid_index(feats.window_valid_W)
    return mark_positions(feats.positions_N, feats.window_pos_W[last][None], feats.window_valid_W[last][None])


def score(cfg: TOVAConfig, state, feats, candidates_N):
    last = last_valid_index(feats.window_valid_W)
    q_L1HD = feats.window_q_LWHD[:, last][:, None]
    probs_LH1N = attention_probs(q_L1HD, feats.keys_LNKD, causal_q_pos=feats.window_pos_W[last][None], k_pos_N=feats.positions_N)
    return probs_LH1N.mean(axis=(0, 1, 2)), state


def needs(cfg: TOVAConfig) -> Needs:
    return Needs(window=1, decode_interval=cfg.decode_interval)


POLICY = register(
    Policy(
        name="tova",
        config=TOVAConfig,
        score=score,
        needs=needs,
        keep=keep,
        doc="TOVA: attention of the last query row, averaged over heads and layers.",
    )
)
