"""The one bootstrap and the group-sequential boundaries (evertrain.stats, on scipy.stats)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as scipy_stats

from evertrain.stats import bootstrap_means, mean_interval, sequential_boundaries


def test_stratified_bootstrap_resamples_within_each_stratum():
    values = np.array([1.0] * 10 + [0.0] * 30)
    strata = np.array(["a"] * 10 + ["b"] * 30)
    # each stratum is constant and keeps its size: every draw's mean is the sample's mean
    assert np.allclose(bootstrap_means(values, strata, samples=500, seed=1), 0.25)
    pooled = bootstrap_means(values, samples=500, seed=1)
    assert pooled.std() > 0.03 and abs(pooled.mean() - 0.25) < 0.02
    # a stratum of one value is a constant of every draw
    assert np.allclose(bootstrap_means([1.0, 0.0, 0.0], ["a", "b", "b"], samples=50), 1 / 3)
    with pytest.raises(ValueError, match="2 strata for 3 values"):
        bootstrap_means([1.0, 0.0, 0.0], ["a", "b"])


def test_mean_interval_covers_the_mean_and_is_seeded():
    rng = np.random.default_rng(0)
    values = rng.normal(0.3, 1.0, size=200)
    low, high = mean_interval(values, samples=2000, seed=3)
    assert low < values.mean() < high
    half = 1.96 * values.std(ddof=1) / math.sqrt(len(values))  # the normal interval's half-width
    assert abs((high - low) / 2 - half) < 0.25 * half
    assert mean_interval(values, samples=2000, seed=3) == (low, high)


def test_sequential_boundaries_spend_alpha_look_by_look():
    def pocock_like(t: float, alpha: float) -> float:
        return alpha * t  # linear spending

    bounds = sequential_boundaries((0.5, 1.0), 0.05, pocock_like)
    # the first look spends 0.025 alone: its boundary is the one-sided normal quantile
    assert bounds[0] == pytest.approx(scipy_stats.norm.isf(0.025), abs=1e-3)
    correlation = math.sqrt(0.5)
    crossed = 1 - scipy_stats.multivariate_normal.cdf(bounds, mean=[0, 0], cov=[[1, correlation], [correlation, 1]])
    assert crossed == pytest.approx(0.05, abs=2e-4)
    assert sequential_boundaries((1.0,), 0.2, pocock_like) == pytest.approx((scipy_stats.norm.isf(0.2),), abs=1e-3)
    assert sequential_boundaries((0.5, 1.0), 0.05, lambda t, a: 0.0)[0] == math.inf  # nothing spent: never stops
    with pytest.raises(ValueError, match="fractions must increase"):
        sequential_boundaries((0.5, 0.5, 1.0), 0.05, pocock_like)
