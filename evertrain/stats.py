"""The statistics the gate, the report and the benchmarks share, on scipy.stats.

- :func:`bootstrap_means`: the bootstrap distribution of a mean, stratified when given strata
  (``scipy.stats.bootstrap``, each stratum resampled on its own), from which :func:`mean_interval` takes a
  percentile interval and the gate its probabilities that a gain is above (or at least) zero.
- :func:`nested_bootstrap_means`: the bootstrap of a mean over seeds, resampling seeds and then the problems
  within each (the benchmarks' comparisons over several seeds).
- :func:`percentile_interval` and :func:`percentile`: an interval from bootstrap draws; a nearest-rank percentile.
- :func:`paired_bootstrap` and :func:`z_statistic`: the gate's paired, stratified comparison of a challenger with
  the champion (its gain, the probability it is better, its z statistic).
- :func:`sequential_boundaries`: one-sided group-sequential z boundaries for a given alpha-spending
  function, computed from the multivariate normal distribution of the z statistics at the looks;
  :func:`alpha_spent` (O'Brien-Fleming-type Lan-DeMets spending) and :func:`efficacy_boundaries`, the gate's.
- :func:`min_detectable_gain`: the gate's power, as the smallest gain a paired test detects.
- :func:`wilson`: the Wilson score interval of a pass rate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import lru_cache
from statistics import NormalDist

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


def nested_bootstrap_means(groups: Sequence[np.ndarray], samples: int = 2000, seed: int = 0) -> np.ndarray:
    """``samples`` bootstrap draws of the mean over ``groups`` (one array of values per seed): resample the groups,
    then the values within each group, and average the groups' means."""
    rng = np.random.default_rng(seed)
    draws = np.empty(samples)
    for i in range(samples):
        chosen = rng.integers(0, len(groups), size=len(groups))
        draws[i] = np.mean([groups[k][rng.integers(0, len(groups[k]), size=len(groups[k]))].mean() for k in chosen])
    return draws


def percentile_interval(draws: Sequence[float] | np.ndarray, low: float = 0.025,
                        high: float = 0.975) -> tuple[float, float]:
    """The percentile interval of bootstrap ``draws`` (95% by default): their ``low`` and ``high`` quantiles."""
    return float(np.quantile(draws, low)), float(np.quantile(draws, high))


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (0 to 100) of ``values`` (a latency's p50, p90, p99)."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile: no values")
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def paired_bootstrap(challenger: np.ndarray, champion: np.ndarray, strata: np.ndarray, samples: int,
                     seed: int) -> dict[str, float]:
    """Gain of challenger over champion on paired per-problem scores, with a bootstrap stratified by ``strata``
    (:func:`bootstrap_means`)."""
    diff = challenger.astype(float) - champion.astype(float)
    means = bootstrap_means(diff, strata, samples, seed)
    low, high = percentile_interval(means)
    return {
        "gain": float(diff.mean()), "p_better": float((means > 0).mean()),
        "p_not_worse": float((means >= 0).mean()), "gain_low": low, "gain_high": high,
    }


Z_CAP = 50.0  # beyond any boundary; keeps z finite for JSON and MLflow


def z_statistic(challenger: np.ndarray, champion: np.ndarray, strata: np.ndarray) -> float:
    """The paired, stratified z statistic of the challenger's gain: mean difference over its standard error."""
    diff = challenger.astype(float) - champion.astype(float)
    total = len(diff)
    if not total:
        return 0.0
    variance = sum(len(part) * (part.var(ddof=1) if len(part) > 1 else 0.0)
                   for part in (diff[strata == s] for s in np.unique(strata))) / total ** 2
    mean = float(diff.mean())
    if variance <= 0:  # every difference the same: no noise to weigh it against (capped: stored as JSON)
        return math.copysign(Z_CAP, mean) if mean else 0.0
    return max(-Z_CAP, min(Z_CAP, mean / math.sqrt(variance)))


def alpha_spent(fraction: float, alpha: float) -> float:
    """O'Brien-Fleming-type spending (Lan and DeMets): the share of the one-sided error ``alpha`` that may be
    spent by information fraction t, 2 - 2 Phi(z_{1-alpha/2} / sqrt(t)): almost nothing early, alpha at t = 1."""
    if fraction <= 0:
        return 0.0
    normal = NormalDist()
    return min(alpha, 2 - 2 * normal.cdf(normal.inv_cdf(1 - alpha / 2) / math.sqrt(min(fraction, 1.0))))


@lru_cache(maxsize=64)
def efficacy_boundaries(fractions: tuple[float, ...], alpha: float) -> tuple[float, ...]:
    """One-sided z boundaries at looks taken at ``fractions`` (increasing, the last 1) that together promote
    a challenger no better than the champion with probability at most ``alpha``, spending
    :func:`alpha_spent` of it by each look (:func:`sequential_boundaries`: the cumulative z statistics at the
    looks are those of a Brownian motion observed at the fractions)."""
    return sequential_boundaries(fractions, alpha, alpha_spent)


def min_detectable_gain(problems: int, alpha: float, power: float, discordant: float) -> float | None:
    """The smallest true gain in pass@1 that a one-sided paired test on ``problems`` problems at level
    ``alpha`` detects with probability ``power``, when a share ``discordant`` of problems is answered right by
    exactly one of the two models (McNemar's normal approximation, Connor 1987):

        n = (z_alpha sqrt(d) + z_power sqrt(d - gain^2))^2 / gain^2

    solved for the gain. None when no gain up to ``discordant`` is detectable."""
    if problems <= 0 or not 0 < discordant <= 1 or not 0 < alpha < 1 or not 0 < power < 1:
        return None
    z_a, z_b = NormalDist().inv_cdf(1 - alpha), NormalDist().inv_cdf(power)

    def needed(gain: float) -> float:
        return (z_a * discordant ** 0.5 + z_b * max(discordant - gain * gain, 0.0) ** 0.5) ** 2 / gain ** 2

    if needed(discordant) > problems:
        return None
    low, high = 1e-6, discordant
    for _ in range(60):  # needed() falls as the gain grows: bisect
        mid = (low + high) / 2
        low, high = (mid, high) if needed(mid) > problems else (low, mid)
    return high


def discordant_share(first: Sequence[bool] | np.ndarray, second: Sequence[bool] | np.ndarray) -> float:
    """The share of problems answered right by exactly one of two models (paired answers, same order)."""
    a, b = np.asarray(first, dtype=bool), np.asarray(second, dtype=bool)
    return float((a != b).mean()) if len(a) else 0.0


def independent_discordance(pass1: float | None, problems: int) -> float:
    """The discordant share two models would have if their answers were independent at pass@1 ``pass1``
    (0.5 when unknown): 2p(1-p), at least one problem in ``problems``."""
    p = 0.5 if pass1 is None else pass1
    return max(2 * p * (1 - p), 1.0 / max(problems, 1))


def gate_power(problems: int, alpha: float, power: float, discordant: float) -> dict[str, float | None]:
    """The smallest gain a paired gate of ``problems`` problems detects (:func:`min_detectable_gain`), also at
    2x and 4x the problems."""
    return {"min_gain": min_detectable_gain(problems, alpha, power, discordant),
            "min_gain_2x": min_detectable_gain(2 * problems, alpha, power, discordant),
            "min_gain_4x": min_detectable_gain(4 * problems, alpha, power, discordant)}


def wilson(passed: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The 95% Wilson score interval of a pass rate (sound at 0 and 1 passes, unlike the normal one)."""
    if n == 0:
        return 0.0, 1.0
    p = passed / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)
