"""Empirical decisions with stated confidence: exact Clopper-Pearson bounds and the bootstrap.

A clause decided empirically counts, over the n units of its slice (inputs, or timed
repetitions), the k units that violate its threshold.

* **Hard clause** (budget None or 0): *failed* on any violation (k > 0), *passed* when k = 0. The
  verdict still records the one-sided upper confidence bound on the violation rate (with k = 0,
  1 - (1 - c)^(1/n): "no violation in 100 inputs; rate <= 2.95% at 95%").
* **Soft clause** (budget b > 0): the exceedance rate k/n is compared with b through one-sided
  Clopper-Pearson bounds at confidence c (default 0.95): *passed* when the upper bound <= b,
  *failed* when the lower bound > b, otherwise *unknown*: inconclusive at this sample size (more
  inputs would decide it). Each bound alone holds with probability >= c for i.i.d. units.

Clopper-Pearson, one-sided at confidence c (X ~ Binomial(n, p)):
upper(k) = the p with P(X <= k; p) = 1 - c (1 when k = n); lower(k) = the p with
P(X >= k; p) = 1 - c (0 when k = 0). The binomial tails are computed exactly in log space
(math.lgamma) and inverted by bisection; the bracket end returned is the conservative one, so the
bounds are never tighter than the exact ones by more than 2^-60.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

DEFAULT_CONFIDENCE = 0.95
OUTCOMES = ("passed", "failed", "unknown")


def _log_comb(n: int, i: np.ndarray) -> np.ndarray:
    """log C(n, i) elementwise, through lgamma (exact to a few ulps)."""
    lg = np.vectorize(math.lgamma, otypes=[np.float64])
    return lg(n + 1.0) - lg(i + 1.0) - lg(n - i + 1.0)


class _Binomial:
    """Binomial(n, p) tail sums for one (k, n), with the log C(n, i) terms computed once."""

    def __init__(self, k: int, n: int) -> None:
        self.k, self.n = k, n
        # sum the shorter tail: P(X <= k) directly, or 1 - P(X >= k + 1)
        self.lower_tail = k < n / 2
        lo, hi = (0, k) if self.lower_tail else (k + 1, n)
        self.i = np.arange(lo, hi + 1, dtype=np.float64)
        self.log_comb = _log_comb(n, self.i)

    def cdf(self, p: float) -> float:
        """P(X <= k)."""
        if self.k < 0:
            return 0.0
        if self.k >= self.n or p <= 0.0:
            return 1.0
        if p >= 1.0:
            return 0.0
        terms = self.log_comb + self.i * math.log(p) + (self.n - self.i) * math.log1p(-p)
        m = float(np.max(terms))
        tail = math.exp(m + math.log(float(np.sum(np.exp(terms - m)))))
        return min(1.0, tail) if self.lower_tail else max(0.0, 1.0 - tail)


def binom_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p), summed exactly term by term in log space."""
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    return _Binomial(k, n).cdf(p)


def binom_sf(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p)."""
    return 1.0 - binom_cdf(k - 1, n, p) if k > 0 else 1.0


def _check(k: int, n: int, confidence: float) -> None:
    if n <= 0:
        raise ValueError(f"Clopper-Pearson needs n >= 1 units, got n = {n}")
    if not 0 <= k <= n:
        raise ValueError(f"Clopper-Pearson needs 0 <= k <= n, got k = {k}, n = {n}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence is in (0, 1), not {confidence}")


def _bisect(f: Callable[[float], bool], iters: int = 60) -> tuple[float, float]:
    """[lo, hi] around the switch point of a predicate that is False then True on [0, 1]."""
    lo, hi = 0.0, 1.0
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if f(mid):
            hi = mid
        else:
            lo = mid
    return lo, hi


def clopper_pearson_upper(k: int, n: int, confidence: float = DEFAULT_CONFIDENCE) -> float:
    """One-sided upper bound on p at ``confidence``: P(X <= k; p) = 1 - confidence."""
    _check(k, n, confidence)
    if k == n:
        return 1.0
    alpha = 1.0 - confidence
    # P(X <= k; p) decreases in p: find the first p where it drops to alpha; return the high end.
    b = _Binomial(k, n)
    _, hi = _bisect(lambda p: b.cdf(p) <= alpha)
    return hi


def clopper_pearson_lower(k: int, n: int, confidence: float = DEFAULT_CONFIDENCE) -> float:
    """One-sided lower bound on p at ``confidence``: P(X >= k; p) = 1 - confidence."""
    _check(k, n, confidence)
    if k == 0:
        return 0.0
    alpha = 1.0 - confidence
    # P(X >= k; p) increases in p: find where it rises past alpha; return the low end.
    b = _Binomial(k - 1, n)  # P(X >= k) = 1 - P(X <= k - 1)
    lo, _ = _bisect(lambda p: 1.0 - b.cdf(p) > alpha)
    return lo


@dataclass(frozen=True)
class Decision:
    """An empirical verdict with its evidence.

    outcome: passed | failed | unknown; n: units; violations: k; rate: k/n; upper/lower: the
    one-sided confidence bounds on the violation rate (or on the metric, for the bootstrap);
    budget: the allowed rate (None for a hard clause); method names the test.
    """

    outcome: str
    n: int
    violations: int | None
    rate: float | None
    upper: float | None
    lower: float | None
    confidence: float | None
    budget: float | None
    method: str
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def decide_exceedance(violations: int, n: int, budget: float | None,
                      confidence: float = DEFAULT_CONFIDENCE) -> Decision:
    """Decide a clause from k violations among n units (see the module docstring)."""
    if n <= 0:
        return Decision("unknown", 0, 0, None, None, None, confidence, budget,
                        method="no-data", note="the slice is empty: nothing to decide on")
    k = int(violations)
    upper = clopper_pearson_upper(k, n, confidence)
    lower = clopper_pearson_lower(k, n, confidence)
    rate = k / n
    if budget is None or budget <= 0:
        outcome = "failed" if k > 0 else "passed"
        note = (f"{k} of {n} violate (hard clause)" if k else
                f"no violation in {n}; violation rate <= {upper:.4g} at {confidence:.0%}")
        return Decision(outcome, n, k, rate, upper, lower, confidence, None,
                        method="exhaustive", note=note)
    if upper <= budget:
        outcome, note = "passed", f"rate <= {upper:.4g} <= budget {budget:g} at {confidence:.0%}"
    elif lower > budget:
        outcome, note = "failed", f"rate >= {lower:.4g} > budget {budget:g} at {confidence:.0%}"
    else:
        outcome = "unknown"
        note = (f"inconclusive at this sample size: rate in [{lower:.4g}, {upper:.4g}] "
                f"straddles budget {budget:g} at {confidence:.0%}")
    return Decision(outcome, n, k, rate, upper, lower, confidence, float(budget),
                    method="clopper-pearson", note=note)


def bootstrap_interval(statistic: Callable[[np.ndarray], float], n: int,
                       confidence: float = DEFAULT_CONFIDENCE, resamples: int = 400,
                       seed: int = 0) -> tuple[float, float]:
    """One-sided percentile-bootstrap bounds (lower, upper) of a statistic of n i.i.d. units.

    ``statistic(idx)`` evaluates the statistic on the units ``idx`` (drawn with replacement);
    lower is the (1 - c) quantile and upper the c quantile of the resampled statistics. The
    bootstrap is approximate (asymptotically valid), unlike Clopper-Pearson.
    """
    if n <= 0:
        raise ValueError("the bootstrap needs at least one unit")
    rng = np.random.default_rng(seed)
    stats = np.array([statistic(rng.integers(0, n, size=n)) for _ in range(resamples)])
    return float(np.quantile(stats, 1.0 - confidence)), float(np.quantile(stats, confidence))


def decide_statistic(value: float, lower: float, upper: float, threshold: float, direction: str,
                     n: int, confidence: float = DEFAULT_CONFIDENCE) -> Decision:
    """Decide ``value <direction> threshold`` from one-sided bounds on the statistic.

    "<=": passed when upper <= threshold, failed when lower > threshold, else unknown; ">=" the
    mirror image.
    """
    if direction == "<=":
        passed, failed = upper <= threshold, lower > threshold
    else:
        passed, failed = lower >= threshold, upper < threshold
    outcome = "passed" if passed else "failed" if failed else "unknown"
    note = (f"value {value:.4g}, bootstrap bounds [{lower:.4g}, {upper:.4g}] at {confidence:.0%} "
            f"vs threshold {threshold:g}")
    if outcome == "unknown":
        note = "inconclusive at this sample size: " + note
    return Decision(outcome, n, None, None, upper, lower, confidence, None,
                    method="bootstrap", note=note)
