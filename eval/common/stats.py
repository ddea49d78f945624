"""The one bootstrap of the eval reports: a percentile interval over examples.

Every interval that ``eval/results/`` publishes comes from ``bootstrap_ci``: resample
the examples with replacement ``SAMPLES`` times (``numpy.random.default_rng(seed)``,
one ``integers(0, n, (SAMPLES, n))`` draw), compute the statistic on each resample,
and take the 2.5th and 97.5th percentiles. Paired comparisons resample the same
examples on both sides (one index array for every input). Resamples whose statistic
is undefined (a zero denominator: NaN) are left out of the percentiles.

The statistics are vectorized along the last axis: ``statistic(*arrays)`` gets the
inputs indexed ``[SAMPLES, n]`` (and once ``[1, n]`` for the point estimate) and
returns one value per row. It is this helper rather than ``scipy.stats.bootstrap``
so that the published intervals, made with exactly this draw, reproduce digit for
digit (``tests/test_eval_common.py`` checks it against the copies it replaced).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

SAMPLES = 2000  # resamples of every published interval


def bootstrap_ci(statistic: Callable[..., np.ndarray], *samples_E, seed: int = 0) -> tuple[float, float, float]:
    """``(point, low, high)``: ``statistic`` on the examples and its percentile
    bootstrap 95% interval. ``samples_E``: one value per example each (paired: the
    same examples, resampled together). NaN when there are no examples."""
    arrays = [np.asarray(x, np.float64) for x in samples_E]
    n = arrays[0].size
    if any(a.shape != (n,) for a in arrays):
        raise ValueError(f"bootstrap_ci wants 1-D inputs of one length, got {[a.shape for a in arrays]}")
    if n == 0:
        return float("nan"), float("nan"), float("nan")
    idx = np.random.default_rng(seed).integers(0, n, size=(SAMPLES, n))
    with np.errstate(invalid="ignore", divide="ignore"):
        point = statistic(*(a[None] for a in arrays))[0]
        boot = statistic(*(a[idx] for a in arrays))
    low, high = np.nanpercentile(boot, [2.5, 97.5])
    return float(point), float(low), float(high)


def mean_ci(x_E, seed: int = 0) -> tuple[float, float, float]:
    """The mean of ``x_E`` and its 95% interval."""
    return bootstrap_ci(lambda x: x.mean(-1), x_E, seed=seed)


def paired_gain(a_E, b_E, turns_E, *, seed: int = 0) -> tuple[float, float, float]:
    """Gain of pooled accuracy ``sum(a)/sum(turns) - sum(b)/sum(turns)`` and its
    paired 95% interval over examples (``a_E``, ``b_E``: correct scored turns per
    example, ``turns_E``: scored turns per example)."""
    return bootstrap_ci(lambda a, b, t: (a.sum(-1) - b.sum(-1)) / t.sum(-1), a_E, b_E, turns_E, seed=seed)


def paired_ratio_difference(num_a_E, den_a_E, num_b_E, den_b_E, *, seed: int = 0) -> tuple[float, float, float]:
    """``sum(num_a)/sum(den_a) - sum(num_b)/sum(den_b)`` on the same examples (a
    token-weighted mean of ``a`` minus ``b``'s) and its paired 95% interval."""
    return bootstrap_ci(
        lambda na, da, nb, db: na.sum(-1) / da.sum(-1) - nb.sum(-1) / db.sum(-1), num_a_E, den_a_E, num_b_E, den_b_E, seed=seed
    )
