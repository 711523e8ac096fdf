"""The statistics the gate, the report and the benchmarks share, on scipy.stats.

- :func:`bootstrap_means`: the bootstrap distribution of a mean, stratified when given strata
  (``scipy.stats.bootstrap``, each stratum resampled on its own), from which :func:`mean_interval` takes a
  percentile interval and the gate its probabilities that a gain is above (or at least) zero.
- :func:`sequential_boundaries`: one-sided group-sequential z boundaries for a given alpha-spending
  function, computed from the multivariate normal distribution of the z statistics at the looks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
from scipy import optimize, stats


def bootstrap_means(values: Sequence[float] | np.ndarray, strata: Sequence[object] | np.ndarray | None = None,
                    samples: int = 2000, seed: int = 0) -> np.ndarray:
    """``samples`` bootstrap draws of the mean of ``values``; with ``strata`` (one label per value) each
    stratum is resampled within itself (its size fixed), as a paired, stratified bootstrap needs."""
    values = np.asarray(values, dtype=float)
    if values.size == 0:
        raise ValueError("bootstrap_means: no values")
    labels = np.zeros(len(values)) if strata is None else np.asarray(strata)
    if len(labels) != len(values):
        raise ValueError(f"bootstrap_means: {len(labels)} strata for {len(values)} values")
    parts = [values[labels == label] for label in np.unique(labels)]
    # a stratum of one value resamples to itself: a constant (scipy needs two or more observations a sample)
    fixed = sum(float(part.sum()) for part in parts if len(part) < 2)
    varied = tuple(part for part in parts if len(part) >= 2)
    if not varied:
        return np.full(samples, fixed / len(values))

    def mean(*resampled: np.ndarray, axis: int = -1) -> np.ndarray:
        return (sum(part.sum(axis=axis) for part in resampled) + fixed) / len(values)

    result = stats.bootstrap(varied, mean, n_resamples=samples, vectorized=True, paired=False,
                             method="percentile", rng=np.random.default_rng(seed))
    return np.asarray(result.bootstrap_distribution, dtype=float)


def mean_interval(values: Sequence[float] | np.ndarray, strata: Sequence[object] | np.ndarray | None = None,
                  samples: int = 2000, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """A percentile bootstrap interval (``level``) of the mean of ``values`` (stratified with ``strata``)."""
    means = bootstrap_means(values, strata, samples, seed)
    tail = (1 - level) / 2
    return float(np.quantile(means, tail)), float(np.quantile(means, 1 - tail))


def sequential_boundaries(fractions: Sequence[float], alpha: float,
                          spent: Callable[[float, float], float]) -> tuple[float, ...]:
    """One-sided z boundaries at looks taken at information ``fractions`` (increasing, the last 1) that
    together reject a true null with probability ``alpha``, spending ``spent(t, alpha)`` of it by fraction t
    (all of it at the last look).

    The z statistics at the looks are jointly normal with correlation sqrt(t_i / t_j) (Brownian motion):
    each boundary solves P(no earlier crossing, crossing now) = the look's share of alpha. A look that may
    spend nothing has an infinite boundary (it never stops).
    """
    t = np.asarray(fractions, dtype=float)
    if t.size == 0 or np.any(np.diff(t) <= 0) or t[0] <= 0 or t[-1] > 1:
        raise ValueError(f"sequential_boundaries: fractions must increase within (0, 1], got {list(fractions)}")
    correlation = np.sqrt(np.minimum.outer(t, t) / np.maximum.outer(t, t))
    bounds: list[float] = []
    spent_so_far = 0.0
    for look in range(len(t)):
        target = alpha if look == len(t) - 1 else min(spent(float(t[look]), alpha), alpha)
        if target - spent_so_far <= 1e-12:
            bounds.append(math.inf)
            continue
        finite = [i for i, b in enumerate(bounds) if b < math.inf]

        def crossed_by_now(bound: float, finite: list[int] = finite, look: int = look) -> float:
            """P(some look up to this one crosses), with this look's boundary at ``bound``."""
            index = [*finite, look]
            upper = np.array([*(bounds[i] for i in finite), bound])
            if len(index) == 1:
                return float(stats.norm.sf(bound))
            cov = correlation[np.ix_(index, index)]
            inside = stats.multivariate_normal.cdf(upper, mean=np.zeros(len(index)), cov=cov, abseps=1e-6,
                                                   releps=1e-5, rng=np.random.default_rng(20261130))
            return 1.0 - float(inside)

        if crossed_by_now(40.0) >= target:  # the earlier looks already spent it (to the integration's accuracy)
            bounds.append(math.inf)
            continue
        bound = optimize.brentq(lambda b, target=target: crossed_by_now(b) - target, -10.0, 40.0, xtol=1e-4)
        bounds.append(float(bound))
        spent_so_far = crossed_by_now(bound)
    return tuple(bounds)
