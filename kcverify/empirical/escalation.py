"""Escalation: from a clause's verdict and level to an action, the health score H, and routing.

* Policy: the contract's ``escalation`` map, level -> action (default {L1: log, L2: guard,
  L3: fallback}); a clause's own ``action`` overrides its level's. The action *applies* when the
  clause is violated (refuted or failed); otherwise the action taken is "none".
* Health score (the paper's H over the recent window), defined here as

      H = sum_c w_c * d_c / sum_c w_c,   d_c = min(1, max(0, (v_c - tau_c) / |tau_c|))

  for a "<=" clause (for ">=": (tau_c - v_c) / |tau_c|), where v_c is the clause's observed value
  (over a window of recent observations: the mean of d_c over the last ``window`` values), tau_c its
  threshold, and w_c its level's weight (L0 = 0.5, L1 = 1, L2 = 2, L3 = 3). With tau_c = 0, d_c is 1 when
  violated, else 0. So H is in [0, 1]: 0 when every clause meets its threshold (healthy), 1 when
  every clause misses it by 100 % or more; it rises as the kernel drifts (the paper's H, the same
  number `kcverify monitor` reports per window). Clauses with no finite observed value (none
  measured, or a vacuous bound) are left out; with none, H = 0.
* Routing: the most severe action among violated clauses
  (block > fallback > guard > warn > log > none).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kcverify.report.model import ClauseResult, Report, Verdict

DEFAULT_POLICY: dict[str, str] = {"L0": "log", "L1": "log", "L2": "guard", "L3": "fallback"}
# Routing severity; "block" (refuse to serve) outranks "fallback" (serve with the training kernel).
SEVERITY: dict[str, int] = {"none": 0, "log": 1, "warn": 2, "guard": 3, "fallback": 4, "block": 5}
LEVEL_WEIGHTS: dict[str, float] = {"L0": 0.5, "L1": 1.0, "L2": 2.0, "L3": 3.0}


def prescribed_action(level: str | None, clause_action: str | None = None,
                      policy: Mapping[str, str] | None = None) -> str:
    """The action a clause prescribes when violated: its own, else its level's under the policy."""
    if clause_action:
        return clause_action
    table = {**DEFAULT_POLICY, **(policy or {})}
    return table.get(level or "", "log")


def action_taken(verdict: Verdict | str, level: str | None, clause_action: str | None = None,
                 policy: Mapping[str, str] | None = None) -> str:
    """The action that applies now: the prescribed one when the verdict is a violation."""
    return prescribed_action(level, clause_action, policy) if Verdict(verdict).violated else "none"


def most_severe(actions: Iterable[str]) -> str:
    """block > fallback > guard > warn > log > none (an unknown action name ranks as log)."""
    best = "none"
    for a in actions:
        if SEVERITY.get(a, 1) > SEVERITY.get(best, 0):
            best = a
    return best


def routing_action(results: Sequence[ClauseResult]) -> str:
    """The recommended routing action: the most severe action among violated clauses."""
    return most_severe(r.action or "log" for r in results if r.violated)


@dataclass(frozen=True)
class HealthTerm:
    """One clause's contribution to H: its level, threshold, direction and recent values."""

    level: str | None
    threshold: float
    direction: str
    values: Sequence[float]


def deviation(value: float, threshold: float, direction: str) -> float:
    """d = min(1, max(0, relative excess of value over threshold in the failing direction))."""
    excess = value - threshold if direction == "<=" else threshold - value
    if threshold == 0:
        return 1.0 if excess > 0 else 0.0
    return min(1.0, max(0.0, excess / abs(threshold)))


def health_score(terms: Sequence[HealthTerm], window: int | None = None) -> float:
    """H = sum w_c d_c / sum w_c, d_c averaged over the last ``window`` values (all if None)."""
    num = den = 0.0
    for t in terms:
        vals = [float(v) for v in t.values if v is not None and math.isfinite(v)]
        if window is not None:
            vals = vals[-window:]
        if not vals:
            continue
        w = LEVEL_WEIGHTS.get(t.level or "", 1.0)
        d = sum(deviation(v, t.threshold, t.direction) for v in vals) / len(vals)
        num += w * d
        den += w
    return 0.0 if den == 0 else num / den


def health_terms(results: Sequence[ClauseResult],
                 history: Mapping[str, Sequence[float]] | None = None) -> list[HealthTerm]:
    """One term per clause with a threshold and an observed value (plus its earlier values)."""
    terms = []
    for r in results:
        if r.threshold is None:
            continue
        past = list((history or {}).get(r.id, []))
        value = r.value
        if value is None and r.family == "numerical":
            value = r.bound  # a certified bound on the clause's quantity
        vals = past + ([value] if value is not None else [])
        terms.append(HealthTerm(r.level, float(r.threshold), r.direction, vals))
    return terms


def history_from_reports(reports: Iterable[Mapping[str, Any]]) -> dict[str, list[float]]:
    """Clause id -> its values in earlier JSON reports (oldest first), for H's recent window."""
    out: dict[str, list[float]] = {}
    for body in reports:
        for c in body.get("clauses", []):
            v = c.get("value")
            if isinstance(v, int | float):
                out.setdefault(str(c.get("id")), []).append(float(v))
    return out


def escalate(report: Report, policy: Mapping[str, str] | None = None,
             history: Mapping[str, Sequence[float]] | None = None,
             window: int | None = None) -> Report:
    """Fill every clause's action (policy), the report's health H and routing action, in place."""
    table = {**DEFAULT_POLICY, **(policy or report.escalation or {})}
    for r in report.clauses:
        r.action = prescribed_action(r.level, r.action, table)
    report.escalation = table
    report.health = health_score(health_terms(report.clauses, history), window)
    report.action = routing_action(report.clauses)
    return report
