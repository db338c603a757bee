"""Escalation policy, the health score H (hand-computed), and the routing action."""

from __future__ import annotations

import pytest

from kcverify.empirical.escalation import (
    HealthTerm,
    action_taken,
    deviation,
    escalate,
    health_score,
    most_severe,
    prescribed_action,
)
from kcverify.report.model import ClauseResult, Report


def test_policy_and_override() -> None:
    assert prescribed_action("L1") == "log" and prescribed_action("L3") == "fallback"
    assert prescribed_action("L2", "fallback") == "fallback"
    assert prescribed_action("L2", None, {"L2": "log"}) == "log"
    assert action_taken("failed", "L2") == "guard"
    assert action_taken("refuted", "L3") == "fallback"
    assert action_taken("unknown", "L3") == "none" and action_taken("proved", "L3") == "none"


def test_most_severe() -> None:
    assert most_severe([]) == "none"
    assert most_severe(["log", "fallback", "guard"]) == "fallback"
    assert most_severe(["log", "guard"]) == "guard"
    assert most_severe(["fallback", "block", "warn"]) == "block"
    assert most_severe(["log", "warn"]) == "warn"


def test_deviation() -> None:
    assert deviation(0.06, 0.05, "<=") == pytest.approx(0.2)
    assert deviation(0.04, 0.05, "<=") == 0.0
    assert deviation(0.5, 0.05, "<=") == 1.0
    assert deviation(0.9, 0.99, ">=") == pytest.approx(0.09 / 0.99)
    assert deviation(1.0, 0.0, "<=") == 1.0 and deviation(0.0, 0.0, "<=") == 0.0


def test_health_by_hand() -> None:
    terms = [
        HealthTerm("L1", 40.0, "<=", [50.0]),       # d = 0.25, w = 1
        HealthTerm("L2", 0.99, ">=", [0.999]),      # d = 0,    w = 2
        HealthTerm("L3", 0.05, "<=", [0.04, 0.1]),  # d = (0 + 1) / 2 = 0.5, w = 3
    ]
    assert health_score(terms) == pytest.approx((1 * 0.25 + 3 * 0.5) / 6)
    # window 1: only the last value counts: d_L3 = 1
    assert health_score(terms, window=1) == pytest.approx((0.25 + 3 * 1.0) / 6)
    assert health_score([]) == 0.0
    assert health_score([HealthTerm("L3", 1.0, "<=", [1e9])]) == 1.0


def test_escalate_fills_report() -> None:
    results = [
        ClauseResult("N-1", "numerical", "proved", "interval", bound=0.01, threshold=0.05, level="L2"),
        ClauseResult("S-1", "statistical", "failed", "clopper-pearson", value=0.9,
                     threshold=0.99, direction=">=", level="L2"),
        ClauseResult("R-1", "runtime", "passed", "clopper-pearson", value=30.0,
                     threshold=40.0, level="L1", action="log"),
        ClauseResult("S-2", "statistical", "unknown", "clopper-pearson", level="L3"),
    ]
    r = escalate(Report("c.yaml", "m.onnx", results))
    assert [c.action for c in r.clauses] == ["guard", "guard", "log", "fallback"]
    assert [c.action_taken for c in r.clauses] == ["none", "guard", "none", "none"]
    assert r.action == "guard" and r.exit_code == 1
    d = (0.99 - 0.9) / 0.99
    assert r.health == pytest.approx(2 * d / (2 + 2 + 1))
    r2 = escalate(Report("c", "m", results[:1] + results[2:3]))
    assert r2.action == "none" and r2.health == 0.0 and r2.exit_code == 0


def test_health_ignores_values_that_are_not_finite() -> None:
    terms = [HealthTerm("L3", 1.0, "<=", [float("inf")]), HealthTerm("L1", 1.0, "<=", [float("nan")]),
             HealthTerm("L2", 1.0, "<=", [1.5])]
    assert health_score(terms) == pytest.approx(0.5)


def test_history_window_from_earlier_reports() -> None:
    from kcverify.empirical.escalation import history_from_reports

    old = [{"clauses": [{"id": "R-1", "value": 60.0}, {"id": "S-1", "value": None}]},
           {"clauses": [{"id": "R-1", "value": 50.0}]}]
    hist = history_from_reports(old)
    assert hist == {"R-1": [60.0, 50.0]}
    now = ClauseResult("R-1", "runtime", "passed", "clopper-pearson", value=30.0,
                       threshold=40.0, level="L1")
    # window 2: values 50 (d = 0.25) and 30 (d = 0) -> H = 1 - 0.125
    assert escalate(Report("c", "m", [now]), history=hist, window=2).health == pytest.approx(0.125)
    assert escalate(Report("c", "m", [now]), history=hist).health == pytest.approx(0.75 / 3)
