"""Clopper-Pearson bounds against closed forms and known values; the decision rules."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kcverify.empirical.stats import (
    OUTWARD,
    binom_cdf,
    bootstrap_interval,
    clopper_pearson_lower,
    clopper_pearson_upper,
    decide_exceedance,
    decide_statistic,
)


def test_binom_cdf_by_explicit_sum() -> None:
    for n, k, p in [(10, 3, 0.2), (30, 20, 0.7), (7, 0, 0.5), (50, 49, 0.99)]:
        want = sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k + 1))
        assert binom_cdf(k, n, p) == pytest.approx(want, rel=1e-10, abs=1e-15)


def test_upper_with_no_violation_is_closed_form() -> None:
    # P(X <= 0) = (1-p)^n = alpha  ->  p = 1 - alpha^(1/n)
    assert clopper_pearson_upper(0, 100, 0.95) == pytest.approx(1 - 0.05 ** (1 / 100), rel=1e-12)
    assert clopper_pearson_upper(0, 100, 0.95) == pytest.approx(0.0295, abs=1e-4)
    assert clopper_pearson_upper(0, 10, 0.99) == pytest.approx(1 - 0.01 ** (1 / 10), rel=1e-12)


def test_lower_with_all_violations_is_closed_form() -> None:
    assert clopper_pearson_lower(20, 20, 0.95) == pytest.approx(0.05 ** (1 / 20), rel=1e-12)
    assert clopper_pearson_upper(20, 20) == 1.0
    assert clopper_pearson_lower(0, 20) == 0.0


def test_known_interval_values() -> None:
    # Two one-sided 95% bounds = the two-sided 90% Clopper-Pearson interval (published tables,
    # e.g. R's binom.test(3, 50, conf.level = 0.90)): [0.01655, 0.14784].
    assert clopper_pearson_lower(3, 50) == pytest.approx(0.016552, abs=2e-6)
    assert clopper_pearson_upper(3, 50) == pytest.approx(0.147837, abs=2e-6)
    # binom.test(5, 10, conf.level = 0.95): [0.187086, 0.812914] -> one-sided at 97.5%
    assert clopper_pearson_lower(5, 10, 0.975) == pytest.approx(0.187086, abs=2e-6)
    assert clopper_pearson_upper(5, 10, 0.975) == pytest.approx(0.812914, abs=2e-6)


def test_bounds_are_conservative_roots() -> None:
    for k, n in [(0, 7), (2, 40), (17, 300), (150, 300)]:
        up = clopper_pearson_upper(k, n)
        assert binom_cdf(k, n, up) <= 0.05 + 1e-12
        assert binom_cdf(k, n, up - 1e-9) > 0.05 - 1e-9
        lo = clopper_pearson_lower(k, n)
        assert lo <= k / n <= up


def test_upper_bound_coverage_by_sampling() -> None:
    """The upper bound covers the true rate in at least ~95% of repeated experiments."""
    rng = np.random.default_rng(0)
    p, n, trials = 0.03, 200, 400
    ks = rng.binomial(n, p, size=trials)
    covered = np.mean([clopper_pearson_upper(int(k), n) >= p for k in ks])
    assert covered >= 0.93


def test_hard_clause() -> None:
    d = decide_exceedance(0, 100, None)
    assert d.outcome == "passed" and d.n == 100 and d.violations == 0
    assert d.upper == pytest.approx(0.0295, abs=1e-4) and d.confidence == 0.95
    assert "no violation in 100" in d.note
    assert decide_exceedance(1, 1000, 0.0).outcome == "failed"


def test_soft_clause_three_outcomes() -> None:
    assert decide_exceedance(0, 400, 0.01).outcome == "passed"  # upper 0.0075
    assert decide_exceedance(30, 400, 0.01).outcome == "failed"  # lower well above 1%
    d = decide_exceedance(4, 400, 0.01)  # rate exactly at budget
    assert d.outcome == "unknown" and "inconclusive at this sample size" in d.note
    assert d.lower < 0.01 < d.upper and d.method == "clopper-pearson"
    assert decide_exceedance(0, 100, 0.01).outcome == "unknown"  # 100 inputs cannot show 1%


def test_empty_slice_is_unknown() -> None:
    assert decide_exceedance(0, 0, 0.1).outcome == "unknown"


def test_bootstrap_decision() -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(loc=1.0, scale=0.1, size=200)
    lo, hi = bootstrap_interval(lambda idx: float(np.mean(x[idx])), len(x))
    assert lo < 1.0 < hi and hi - lo < 0.05
    assert decide_statistic(float(x.mean()), lo, hi, 1.2, "<=", 200).outcome == "passed"
    assert decide_statistic(float(x.mean()), lo, hi, 0.8, "<=", 200).outcome == "failed"
    assert decide_statistic(float(x.mean()), lo, hi, 1.0, "<=", 200).outcome == "unknown"
    assert decide_statistic(float(x.mean()), lo, hi, 0.8, ">=", 200).outcome == "passed"


@pytest.mark.parametrize("budget, n", [(0.05, 200), (0.01, 1000)])
def test_decisions_err_at_most_alpha_by_sampling(budget: float, n: int) -> None:
    """At a true rate just above the budget, 'passed' comes out in <= ~5% of experiments;
    just below it, 'failed' does. (The guarantee the verdict states, checked by sampling.)"""
    rng = np.random.default_rng(42)
    trials = 300
    above = rng.binomial(n, budget * 1.02, size=trials)
    below = rng.binomial(n, budget * 0.98, size=trials)
    wrong_pass = np.mean([decide_exceedance(int(k), n, budget).outcome == "passed" for k in above])
    wrong_fail = np.mean([decide_exceedance(int(k), n, budget).outcome == "failed" for k in below])
    assert wrong_pass <= 0.07 and wrong_fail <= 0.07


EXTREME = [(k, n, c) for n in (10**5, 10**6) for c in (0.95, 0.999999)
           for k in (0, 1, 10, 1000, n // 2, n // 2 + 1, n - 10, n - 1)]


@pytest.mark.parametrize("k, n, c", EXTREME)
def test_bounds_are_scipy_beta_quantiles_pushed_outward(k: int, n: int, c: float) -> None:
    """At n = 10^5..10^6 and c up to 0.999999 the bounds are scipy's beta quantiles pushed
    outward: never tighter, looser by at most OUTWARD (1e-12) relative and an ulp. (The
    hand-summed tails were up to 2.5e-5 relative too tight at n = 10^5, c = 0.999999.)"""
    from scipy.stats import beta

    up, lo = clopper_pearson_upper(k, n, c), clopper_pearson_lower(k, n, c)
    want_up = beta.ppf(c, k + 1, n - k)
    assert want_up < up <= np.nextafter(want_up * (1 + 2 * OUTWARD), 2.0)
    if k == 0:
        assert lo == 0.0
    else:
        want_lo = beta.ppf(1 - c, k, n - k + 1)
        assert np.nextafter(want_lo * (1 - 2 * OUTWARD), -1.0) <= lo < want_lo
    assert lo <= k / n <= up


def _binom_tail(ctx: object, n: int, p: object, lo: int, hi: int) -> object:
    """sum_{i=lo..hi} C(n, i) p^i (1 - p)^(n - i) in ctx's precision."""
    return ctx.fsum(ctx.binomial(n, i) * p**i * (1 - p) ** (n - i) for i in range(lo, hi + 1))


@pytest.mark.parametrize("k, n, c", [(0, 10**5, 0.999999), (10, 10**5, 0.999999),
                                     (1000, 10**5, 0.999999), (3, 50, 0.95),
                                     (99990, 10**5, 0.95), (10, 10**5, 0.95)])
def test_bounds_hold_exactly(k: int, n: int, c: float) -> None:
    """60-digit check of the definition: P(X <= k; upper) <= 1 - c and P(X >= k; lower) <= 1 - c.
    At k = 10, n = 10^5, c = 0.999999 scipy's quantile itself is 1.3 ulps too tight for the lower
    bound, so pushing it out by one ulp would fail here."""
    mpmath = pytest.importorskip("mpmath")
    ctx = mpmath.mp.clone() if hasattr(mpmath.mp, "clone") else mpmath.MPContext()
    ctx.dps = 60
    alpha = 1 - ctx.mpf(c)
    up = ctx.mpf(clopper_pearson_upper(k, n, c))
    # P(X <= k; up), summing the shorter tail
    cdf = (_binom_tail(ctx, n, up, 0, k) if k < n / 2
           else 1 - _binom_tail(ctx, n, up, k + 1, n))
    assert cdf <= alpha
    if k > 0:
        lo = ctx.mpf(clopper_pearson_lower(k, n, c))
        sf = (1 - _binom_tail(ctx, n, lo, 0, k - 1) if k < n / 2
              else _binom_tail(ctx, n, lo, k, n))
        assert sf <= alpha
