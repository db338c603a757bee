"""The terminal table: one aligned row per clause, then per-slice rows, then a summary line.

Columns: VERDICT and what decided it (BY: proof, cex for a replayed counterexample, evidence,
static, -); CERTIFIED is the certified bound on the clause's quantity (its units, like VALUE and
COND), RATE<= the upper confidence bound on a soft clause's violation rate (at CONF).
"""

from __future__ import annotations

from kcverify.report.model import ClauseResult, Report, Verdict
from kcverify.report.svg import fmt

COLUMNS = ("CLAUSE", "FAMILY", "VERDICT", "BY", "VALUE", "COND", "CERTIFIED", "RATE<=", "SLICE",
           "N", "CONF", "LEVEL", "ACTION")
BY = {"proof": "proof", "counterexample": "cex", "evidence": "evidence", "static": "static",
      "undecided": "-"}


def _cond(c: ClauseResult) -> str:
    return "-" if c.threshold is None else f"{c.direction} {fmt(c.threshold)}"


def _row(c: ClauseResult) -> list[str]:
    action = c.action_taken if c.violated else (f"({c.action})" if c.action else "-")
    return [c.id, c.family, Verdict(c.verdict).value, BY.get(c.decided_by or "", "-"),
            fmt(c.value), _cond(c), fmt(c.bound), fmt(c.rate_upper, 3), c.slice or "-",
            "-" if c.sample_size is None else str(c.sample_size),
            "-" if c.confidence is None else f"{c.confidence:.0%}", c.level or "-", action]


def _slice_rows(c: ClauseResult) -> list[list[str]]:
    rows = []
    for s in c.slices:
        rate = "-" if s.upper is None else fmt(s.upper, 3)
        value = fmt(s.value) if s.rate is None else f"{fmt(s.value)} ({s.violations}/{s.n})"
        budget = "-" if s.budget is None else f"budget {fmt(s.budget)}"
        rows.append(["  └ " + s.slice, "", Verdict(s.verdict).value, "", value, budget, "", rate,
                     "", str(s.n), "", "", ""])
    return rows if len(rows) > 1 or any(s.rate is not None for s in c.slices) else []


def render_table(report: Report, slices: bool = True) -> str:
    """Plain text, columns aligned; an action in parentheses is prescribed but not triggered."""
    rows: list[list[str]] = [list(COLUMNS)]
    for c in report.clauses:
        rows.append(_row(c))
        if slices:
            rows.extend(_slice_rows(c))
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    health = "-" if report.health is None else f"{report.health:.3f}"
    lines.append("")
    lines.append(f"{len(report.clauses)} clauses: {report.summary()}; verdict: "
                 f"{report.headline()[0]}; health H = {health}; recommended action: "
                 f"{report.action}")
    open_ = [f"{c.id} ({c.decided_by})" for c in report.clauses if c.on_evidence]
    if open_:
        lines.append(f"certifiable, not proved: {', '.join(open_)}")
    unstable = report.meta.get("unstable_casts") or {}
    if unstable:
        parts = [f"{name} {sum(v)} (max {max(v)} per input)" for name, v in unstable.items() if v]
        lines.append("unstable casts (fp8 roundings conforming programs may take either way): "
                     + "; ".join(parts))
    return "\n".join(lines)
