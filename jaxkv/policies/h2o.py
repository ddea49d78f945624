"""H2O (Zhang et al., 2023): heavy hitters by accumulated attention mass.

Rule (ALGORITHMS.md §2): ``score_i`` = attention mass position ``i`` received over
every query row seen so far (prefill rows and decode steps), averaged over layers
and query heads; the engine accumulates it (``Needs.attn_mass``) and hands it in as
``feats.acc_mass_N``. A recent floor of the ``recent`` most recent live positions is
always kept.

Defaults: ``recent = 32``, compress after prefill and every ``decode_interval = 128``
decoded tokens. Shapes: ``acc_mass_N`` float32 ``[N]``; outputs ``[N]``.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxkv.policies.base import Needs, Policy, register


@dataclasses.dataclass(frozen=True)
class H2OConfig:
    """Attributes:
    recent: the ``recent`` most recent live positions are always kept; default 32.
    decode_interval: compress every this many decoded tokens (default 128; None:
      after prefill only).
    """

    recent: int = 32
    decode_interval: int | None = 128


def keep(cfg: H2OConfig, feats):
    valid = feats.valid()  # real entries come first, in position order
    return valid & (jnp.arange(valid.shape[0]) >= valid.sum() - cfg.recent)


def score(cfg: H2OConfig, state, feats, candidates_N):
    return jnp.asarray(feats.acc_mass_N, jnp.float32), state


def needs(cfg: H2OConfig) -> Needs:
    return Needs(attn_mass=True, decode_interval=cfg.decode_interval)


POLICY = register(
    Policy(
        name="h2o",
        config=H2OConfig,
        score=score,
        needs=needs,
        keep=keep,
        doc="H2O: accumulated attention mass, with a recent floor.",
        one_set_only="the engine accumulates attention mass averaged over layers, so a per-layer H2O score does not exist yet",
    )
)
