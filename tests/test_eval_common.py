"""``eval.common.stats``: the one bootstrap, which gives the
intervals its three former copies published (``repair_protocol.paired_gain``, ``harness.paired_nll_difference``,
``real_model_report.mean_ci``), digit for digit, on fixed data.

The copies are kept here, verbatim but for their names, as the reference."""

import numpy as np
import pytest

from eval.common import stats

B = 2000


def old_paired_gain(a_E, b_E, turns_E, *, seed=0):
    a, b, t = (np.asarray(x, np.float64) for x in (a_E, b_E, turns_E))
    gain = (a.sum() - b.sum()) / t.sum()
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, a.size, size=(B, a.size))
    boot = (a[idx].sum(1) - b[idx].sum(1)) / t[idx].sum(1)
    low, high = np.percentile(boot, [2.5, 97.5])
    return float(gain), float(low), float(high)


def old_paired_nll_difference(a, b, *, seed=0):
    ta, da, tb, db = (np.asarray([f[k] for f in x], np.float64) for x, k in ((a, "tokens"), (a, "dnll"), (b, "tokens"), (b, "dnll")))
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, ta.size, size=(B, ta.size))
    with np.errstate(invalid="ignore", divide="ignore"):
        boot = da[idx].sum(1) / ta[idx].sum(1) - db[idx].sum(1) / tb[idx].sum(1)
    low, high = np.nanpercentile(boot, [2.5, 97.5])
    return float(da.sum() / ta.sum() - db.sum() / tb.sum()), float(low), float(high)


def old_mean_ci(x, seed=0):
    x = np.asarray(x, np.float64)
    if x.size == 0:
        return float("nan"), float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    boot = x[rng.integers(0, x.size, size=(B, x.size))].mean(1)
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return float(x.mean()), float(lo), float(hi)


@pytest.mark.parametrize("n", [1, 7, 100])
@pytest.mark.parametrize("seed", [0, 3])
def test_the_one_bootstrap_reproduces_every_former_copy(n, seed):
    rng = np.random.default_rng(1234 + n)
    turns = rng.integers(1, 6, n)
    a, b = rng.binomial(turns, 0.7), rng.binomial(turns, 0.5)
    assert stats.paired_gain(a, b, turns, seed=seed) == old_paired_gain(a, b, turns, seed=seed)
    assert stats.paired_gain(a, b, np.ones(n), seed=seed) == old_paired_gain(a, b, np.ones(n), seed=seed)

    fa = [{"tokens": int(t), "dnll": float(d)} for t, d in zip(rng.integers(1, 40, n), rng.normal(0.2, 0.5, n))]
    fb = [{"tokens": int(t), "dnll": float(d)} for t, d in zip(rng.integers(1, 40, n), rng.normal(0.1, 0.5, n))]
    got = stats.paired_ratio_difference(
        *(np.asarray([f[k] for f in x], np.float64) for x, k in ((fa, "dnll"), (fa, "tokens"), (fb, "dnll"), (fb, "tokens"))), seed=seed
    )
    np.testing.assert_equal(got, old_paired_nll_difference(fa, fb, seed=seed))

    x = rng.normal(0.0, 1.0, n)
    assert stats.mean_ci(x, seed=seed) == old_mean_ci(x, seed=seed)
    v = rng.integers(0, 2, n)  # 0/1 verdicts, as the accuracy intervals
    assert stats.mean_ci(v, seed=seed) == old_mean_ci(v, seed=seed)


def test_the_callers_use_it():
    from eval.quality import harness, real_model_report, repair_protocol

    fa = [{"tokens": 10, "dnll": 1.0}, {"tokens": 20, "dnll": 4.0}, {"tokens": 5, "dnll": 0.5}]
    fb = [{"tokens": 10, "dnll": 0.5}, {"tokens": 20, "dnll": 1.0}, {"tokens": 5, "dnll": 0.0}]
    assert harness.paired_nll_difference(fa, fb) == old_paired_nll_difference(fa, fb)
    assert repair_protocol.paired_gain is stats.paired_gain
    assert real_model_report.mean_ci is stats.mean_ci


def test_empty_and_mismatched_inputs():
    assert all(v != v for v in stats.mean_ci([]))
    with pytest.raises(ValueError):
        stats.paired_gain([1, 0], [1], [1, 1])
