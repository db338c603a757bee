"""Every registered metric against a hand computation (explicit loops, small arrays)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kcverify.empirical.metrics import (
    METRICS,
    MetricError,
    MetricInputs,
    compute_metric,
    expected_calibration_error,
    get_metric,
    register_metric,
)

REQUIRED = ["p50_logit_l2", "p95_logit_l2", "p99_logit_l2", "mean_kl", "p99_kl", "top1_overlap",
            "top5_overlap", "top10_overlap", "mean_abs_log_ratio", "mean_w_log_w", "ece_gap",
            "p95_latency_ms", "p99_latency_ms", "peak_memory_mb"]


def _softmax(z: list[float], t: float = 1.0) -> list[float]:
    m = max(z)
    e = [math.exp((v - m) / t) for v in z]
    s = sum(e)
    return [v / s for v in e]


def _pairs(zt: np.ndarray, zi: np.ndarray):
    """Yield (train row, inf row) for every position, as python lists."""
    v = zt.shape[-1]
    for a, b in zip(zt.reshape(-1, v), zi.reshape(-1, v)):
        yield list(map(float, a)), list(map(float, b))


@pytest.fixture
def logits() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    zt = rng.normal(size=(4, 3, 12))
    zi = zt + rng.normal(scale=0.3, size=zt.shape)
    return zt, zi


def test_required_metrics_registered() -> None:
    assert set(REQUIRED) <= set(METRICS)
    assert get_metric("top1_overlap").direction == ">="
    assert get_metric("p95_latency_ms").family == "runtime"
    assert get_metric("p99_kl").quantile == 0.99


def test_unknown_metric_lists_registered() -> None:
    with pytest.raises(MetricError, match="unknown metric 'nope'; registered: .*mean_kl"):
        get_metric("nope")


def test_duplicate_registration_refused() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_metric("mean_kl")(lambda x: x)


def test_logit_l2_percentiles(logits) -> None:
    zt, zi = logits
    d = [math.sqrt(sum((b - a) ** 2 for a, b in zip(r, s))) for r, s in _pairs(zt, zi)]
    d.sort()
    n = len(d)
    for name, q in [("p50_logit_l2", 0.5), ("p95_logit_l2", 0.95), ("p99_logit_l2", 0.99)]:
        h = (n - 1) * q  # linear interpolation between order statistics
        lo = math.floor(h)
        want = d[lo] + (h - lo) * (d[min(lo + 1, n - 1)] - d[lo])
        assert compute_metric(name, MetricInputs(zt, zi)) == pytest.approx(want, rel=1e-12)


def test_logit_l2_two_by_two_by_hand() -> None:
    zt = np.array([[0.0, 0.0], [1.0, 1.0]])
    zi = np.array([[3.0, 4.0], [1.0, 1.0]])  # distances 5 and 0
    x = MetricInputs(zt, zi)
    assert compute_metric("p50_logit_l2", x) == pytest.approx(2.5)
    assert get_metric("p99_logit_l2").per_unit(x).tolist() == [5.0, 0.0]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_kl_and_ratio_metrics(logits, temperature: float) -> None:
    zt, zi = logits
    kl, kl_rev, alr = [], [], []
    for r, s in _pairs(zt, zi):
        p, q = _softmax(r, temperature), _softmax(s, temperature)
        kl.append(sum(pi * math.log(pi / qi) for pi, qi in zip(p, q)))
        kl_rev.append(sum(pi * (qi / pi) * math.log(qi / pi) for pi, qi in zip(p, q)))
        alr.append(sum(pi * abs(math.log(qi) - math.log(pi)) for pi, qi in zip(p, q)))
    x = MetricInputs(zt, zi, temperature=temperature)
    assert compute_metric("mean_kl", x) == pytest.approx(sum(kl) / len(kl), rel=1e-10)
    assert compute_metric("p99_kl", x) == pytest.approx(float(np.quantile(kl, 0.99)), rel=1e-10)
    assert compute_metric("mean_w_log_w", x) == pytest.approx(sum(kl_rev) / len(kl_rev), rel=1e-10)
    assert compute_metric("mean_abs_log_ratio", x) == pytest.approx(sum(alr) / len(alr), rel=1e-10)


def test_kl_is_zero_for_shifted_logits() -> None:
    zt = np.array([[1.0, 2.0, 3.0]])
    x = MetricInputs(zt, zt + 5.0)  # softmax is shift invariant
    for name in ("mean_kl", "mean_w_log_w", "mean_abs_log_ratio"):
        assert compute_metric(name, x) == pytest.approx(0.0, abs=1e-15)


def test_kl_two_tokens_by_hand() -> None:
    # p = (1/2, 1/2); q = softmax(0, log 3) = (1/4, 3/4)
    x = MetricInputs(np.array([[0.0, 0.0]]), np.array([[0.0, math.log(3.0)]]))
    want = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert compute_metric("mean_kl", x) == pytest.approx(want, rel=1e-12)
    # E_p |log q - log p| = 1/2 log 2 + 1/2 log(3/2)
    assert compute_metric("mean_abs_log_ratio", x) == pytest.approx(
        0.5 * math.log(2) + 0.5 * math.log(1.5), rel=1e-12)
    # E_p[w log w] = 1/4 log(1/2) + 3/4 log(3/2) = KL(q || p)
    assert compute_metric("mean_w_log_w", x) == pytest.approx(
        0.25 * math.log(0.5) + 0.75 * math.log(1.5), rel=1e-12)


def test_topk_overlap(logits) -> None:
    zt, zi = logits
    for k, name in [(1, "top1_overlap"), (5, "top5_overlap"), (10, "top10_overlap")]:
        fr = []
        for r, s in _pairs(zt, zi):
            a = set(sorted(range(len(r)), key=lambda i: -r[i])[:k])
            b = set(sorted(range(len(s)), key=lambda i: -s[i])[:k])
            fr.append(len(a & b) / k)
        assert compute_metric(name, MetricInputs(zt, zi)) == pytest.approx(sum(fr) / len(fr))


def test_top1_overlap_counts_disagreements() -> None:
    zt = np.array([[[3.0, 1.0, 0.0], [0.0, 1.0, 2.0]], [[1.0, 0.0, 0.0], [0.0, 5.0, 1.0]]])
    zi = zt.copy()
    zi[0, 1] = [3.0, 1.0, 2.0]  # top-1 moves from token 2 to token 0
    x = MetricInputs(zt, zi)
    assert compute_metric("top1_overlap", x) == pytest.approx(0.75)
    assert get_metric("top1_overlap").per_unit(x).tolist() == [0.5, 1.0]
    assert get_metric("top1_overlap").violates(np.array([0.5, 1.0]), 0.99).tolist() == [True, False]


def _ece_by_hand(z: np.ndarray, y: np.ndarray, bins: int = 15) -> float:
    conf, correct = [], []
    for row, label in zip(z, y):
        p = _softmax(list(map(float, row)))
        c = max(p)
        conf.append(c)
        correct.append(1.0 if p.index(c) == label else 0.0)
    total = 0.0
    for b in range(bins):
        lo, hi = b / bins, (b + 1) / bins
        members = [i for i, c in enumerate(conf) if (lo < c <= hi) or (b == 0 and c == 0)]
        if members:
            acc = sum(correct[i] for i in members) / len(members)
            cf = sum(conf[i] for i in members) / len(members)
            total += len(members) / len(conf) * abs(acc - cf)
    return total


def test_ece_gap() -> None:
    rng = np.random.default_rng(7)
    zt = rng.normal(scale=2.0, size=(40, 5))
    zi = zt + rng.normal(scale=0.8, size=zt.shape)
    y = rng.integers(0, 5, size=40)
    want = abs(_ece_by_hand(zi, y) - _ece_by_hand(zt, y))
    got = compute_metric("ece_gap", MetricInputs(zt, zi, labels=y))
    assert got == pytest.approx(want, rel=1e-12)
    assert got > 0


def test_ece_one_sample_by_hand() -> None:
    # one position, p = (0.8, 0.2) predicted class 0; label 1 -> acc 0, conf 0.8 -> ECE 0.8
    z = np.log(np.array([[0.8, 0.2]]))
    assert expected_calibration_error(z, np.array([1])) == pytest.approx(0.8)
    assert expected_calibration_error(z, np.array([0])) == pytest.approx(0.2)
    assert expected_calibration_error(z, np.array([-1])) == 0.0  # ignored label


def test_ece_gap_needs_labels(logits) -> None:
    with pytest.raises(MetricError, match="needs labels"):
        compute_metric("ece_gap", MetricInputs(*logits))


def test_latency_and_memory() -> None:
    lat = np.array([5.0, 1.0, 3.0, 2.0, 4.0, 10.0, 6.0, 7.0, 8.0, 9.0])
    x = MetricInputs(latencies_ms=lat, peak_memory_mb=123.5)
    s = sorted(lat)
    h = 9 * 0.95
    assert compute_metric("p95_latency_ms", x) == pytest.approx(s[8] + (h - 8) * (s[9] - s[8]))
    assert compute_metric("p99_latency_ms", x) == pytest.approx(s[8] + (9 * 0.99 - 8) * (s[9] - s[8]))
    assert compute_metric("peak_memory_mb", x) == 123.5
    with pytest.raises(MetricError, match="needs latency"):
        compute_metric("p95_latency_ms", MetricInputs())


def test_shape_mismatch_is_reported() -> None:
    with pytest.raises(MetricError, match="differ in shape"):
        MetricInputs(np.zeros((2, 3)), np.zeros((2, 4)))


def test_ece_per_position_labels_and_ignored_positions() -> None:
    rng = np.random.default_rng(11)
    zt = rng.normal(scale=2.0, size=(6, 3, 4))
    zi = zt + rng.normal(scale=0.5, size=zt.shape)
    y = rng.integers(0, 4, size=(6, 3))
    y[0, 1] = -100  # ignored position
    keep = y.reshape(-1) >= 0
    flat_t, flat_i, flat_y = zt.reshape(-1, 4)[keep], zi.reshape(-1, 4)[keep], y.reshape(-1)[keep]
    want = abs(_ece_by_hand(flat_i, flat_y) - _ece_by_hand(flat_t, flat_y))
    assert compute_metric("ece_gap", MetricInputs(zt, zi, labels=y)) == pytest.approx(want, rel=1e-12)
    # the bootstrap's resampler agrees with the metric on the identity draw
    m = get_metric("ece_gap")
    x = MetricInputs(zt, zi, labels=y)
    assert m.resampler(x)(np.arange(6)) == pytest.approx(want, rel=1e-12)
    with pytest.raises(MetricError, match="labels have 2 positions per input"):
        compute_metric("ece_gap", MetricInputs(zt, zi, labels=y[:, :2]))
