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
P(X >= k; p) = 1 - c (0 when k = 0). Through the beta-binomial identity
P(X <= k; p) = 1 - I_p(k + 1, n - k), these are beta quantiles (Clopper and Pearson 1934):
upper(k) = Beta(k + 1, n - k).ppf(c) and lower(k) = Beta(k, n - k + 1).ppf(1 - c), computed by
scipy (boost's incomplete-beta inverse, accurate to a few ulps), then pushed outward by a relative
``OUTWARD`` = 1e-12 and one more ulp (np.nextafter toward 1 for the upper bound, toward 0 for the
lower), so a bound is never tighter than the exact one. One ulp alone is not enough: against a
60-digit evaluation, scipy's quantile was 1.3 ulps on the tight side of the exact lower bound at
k = 10, n = 10^5, c = 0.999999 (tests/empirical/test_stats.py checks the definition exactly).
1e-12 relative changes no decision that matters and covers the inverse's error many times over.
(Summing the binomial tails by hand and bisecting, as kcverify once did, lost up to 2.5e-5
relative in the lower bound at n = 10^5, c = 0.999999: 1 - tail cancels.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

DEFAULT_CONFIDENCE = 0.95
OUTWARD = 1e-12  # relative widening of scipy's beta quantiles (see the module docstring)
OUTCOMES = ("passed", "failed", "unknown")


def binom_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p) (scipy)."""
    from scipy.stats import binom

    return float(binom.cdf(k, n, p))


def binom_sf(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p) (scipy's survival function, no 1 - cdf cancellation)."""
    from scipy.stats import binom

    return float(binom.sf(k - 1, n, p)) if k > 0 else 1.0


def _check(k: int, n: int, confidence: float) -> None:
    if n <= 0:
        raise ValueError(f"Clopper-Pearson needs n >= 1 units, got n = {n}")
    if not 0 <= k <= n:
        raise ValueError(f"Clopper-Pearson needs 0 <= k <= n, got k = {k}, n = {n}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence is in (0, 1), not {confidence}")


def clopper_pearson_upper(k: int, n: int, confidence: float = DEFAULT_CONFIDENCE) -> float:
    """One-sided upper bound on p at ``confidence``: P(X <= k; p) = 1 - confidence, i.e. the
    ``confidence`` quantile of Beta(k + 1, n - k), pushed up (1 when k = n)."""
    from scipy.stats import beta

    _check(k, n, confidence)
    if k == n:
        return 1.0
    q = float(beta.ppf(confidence, k + 1, n - k))
    return min(1.0, float(np.nextafter(q * (1.0 + OUTWARD), 2.0)))


def clopper_pearson_lower(k: int, n: int, confidence: float = DEFAULT_CONFIDENCE) -> float:
    """One-sided lower bound on p at ``confidence``: P(X >= k; p) = 1 - confidence, i.e. the
    ``1 - confidence`` quantile of Beta(k, n - k + 1), pushed down (0 when k = 0)."""
    from scipy.stats import beta

    _check(k, n, confidence)
    if k == 0:
        return 0.0
    q = float(beta.ppf(1.0 - confidence, k, n - k + 1))
    return max(0.0, float(np.nextafter(q * (1.0 - OUTWARD), -1.0)))


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
