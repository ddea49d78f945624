"""StreamingLLM (Xiao et al., 2024): attention sinks plus a sliding recent window.

Rule (ALGORITHMS.md §2): always keep the first ``n_sink`` positions (the sinks);
fill the rest of the budget with the most recent positions. There is no attention
score: ``score_i = position_i``, so ``select``'s top-k over candidates is exactly
the most recent ``B − |F|`` of them.

Defaults: ``n_sink = 4``; compress after prefill only (``decode_interval=None``).
Shapes: ``positions_N`` int32 ``[N]`` in, ``forced_N`` / ``scores_N`` ``[N]`` out.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxkv.policies.base import Needs, Policy, register


@dataclasses.dataclass(frozen=True)
class StreamingLLMConfig:
    """Attributes:
    n_sink: positions ``< n_sink`` are always kept (attention sinks); default 4.
    decode_interval: compress every this many decoded tokens; None (default): after
      prefill only.
    """

    n_sink: int = 4
    decode_interval: int | None = None


def keep(cfg: StreamingLLMConfig, feats):
    return feats.positions_N < cfg.n_sink


def score(cfg: StreamingLLMConfig, state, feats, candidates_N):
    return feats.positions_N.astype(jnp.float32), state


def needs(cfg: StreamingLLMConfig) -> Needs:
    return Needs(decode_interval=cfg.decode_interval)


POLICY = register(
    Policy(
        name="streaming_llm",
        config=StreamingLLMConfig,
        score=score,
        needs=needs,
        keep=keep,
        doc="StreamingLLM: n_sink attention sinks + the most recent positions.",
    )
)
