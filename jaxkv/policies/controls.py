"""Control policies: Random-K and Oldest-K (ALGORITHMS.md §2).

* ``random``: uniform scores from ``fold_in(key(seed), event_counter)``; the counter
  is the policy state (int32 scalar), incremented at every ``score`` call, so
  repeated events draw different sets while a run is reproducible from ``seed``.
* ``oldest``: ``score_i = −position_i``, keeping the oldest candidates.

Neither forces anything of its own nor needs features. Defaults: ``seed = 0``;
after prefill only. Shapes: outputs ``[N]``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxkv.policies.base import Needs, Policy, register


@dataclasses.dataclass(frozen=True)
class RandomConfig:
    """Attributes:
    seed: PRNG seed of the scores; default 0.
    decode_interval: compress every this many decoded tokens (default None: after
      prefill only; set it to match the schedule of the method being controlled).
    """

    seed: int = 0
    decode_interval: int | None = None


@dataclasses.dataclass(frozen=True)
class OldestConfig:
    """Attributes:
    decode_interval: compress every this many decoded tokens (default None: after
      prefill only; set it to match the schedule of the method being controlled).
    """

    decode_interval: int | None = None


def random_init_state(cfg: RandomConfig, model_cfg):
    return jnp.zeros((), jnp.int32)  # events scored so far


def random_score(cfg: RandomConfig, counter, feats, candidates_N):
    key = jax.random.fold_in(jax.random.key(cfg.seed), counter)
    return jax.random.uniform(key, feats.positions_N.shape, jnp.float32), counter + 1


def oldest_score(cfg: OldestConfig, state, feats, candidates_N):
    return -feats.positions_N.astype(jnp.float32), state


def _needs(cfg) -> Needs:
    return Needs(decode_interval=cfg.decode_interval)


RANDOM = register(
    Policy(
        name="random",
        config=RandomConfig,
        score=random_score,
        needs=_needs,
        init_state=random_init_state,
        doc="Random-K control: seeded uniform scores, fresh per event.",
    )
)
OLDEST = register(
    Policy(name="oldest", config=OldestConfig, score=oldest_score, needs=_needs, doc="Oldest-K control: keeps the oldest candidates.")
)
