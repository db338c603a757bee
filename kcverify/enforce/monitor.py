"""The online routing loop over logged traces: per time window, every clause's value and
deviation, the health score H and the recommended action.

Windows are aligned to the first record's time t0: window k is [t0 + k w, t0 + (k + 1) w). A
window is closed when a record at or after its end arrives (or the traces end); windows with no
record are reported with n = 0, no health and action ``none``.

Health. With d_c = kcverify.empirical.escalation.deviation(v_c, tau_c) (0 when clause c's
window value v_c meets its threshold tau_c, the relative excess otherwise, capped at 1) and
w_c the clause level's weight (L0 0.5, L1 1, L2 2, L3 3),

    H = sum_c w_c d_c / sum_c w_c          (over clauses with a value in the window)

H is 0 while every clause meets its threshold and rises towards 1 as clauses miss theirs; it is
the same H as the ``health`` of ``kcverify prove``'s report (escalation.health_score). Static clauses are not in H (they do not change between
windows). The action is the escalation policy's: the most severe action prescribed by a clause
violated in the window (L1 log, L2 guard, L3 fallback by default; a clause's own action wins);
``none`` when no clause is violated. ``health_threshold`` (default 0.1) is the H a window may
reach and still count as compliant for ``promote --stage full``; it is drawn on the plot.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from kcverify.empirical.escalation import LEVEL_WEIGHTS, most_severe
from kcverify.empirical.stats import DEFAULT_CONFIDENCE
from kcverify.enforce.clauses import ClauseOutcome, evaluate_contract
from kcverify.enforce.traces import TraceRecord, format_time, window_bounds, window_index

DEFAULT_WINDOW_S = 300.0
DEFAULT_HEALTH_THRESHOLD = 0.1
MAX_FLAGGED = 5


def health(outcomes: Sequence[ClauseOutcome]) -> float | None:
    """H = sum_c w_c d_c / sum_c w_c over the non-static outcomes with a deviation (module
    docstring); None when no clause has a value. The same H as escalation.health_score (the
    ``health`` of ``kcverify prove``'s report) on the same values; a NaN measurement counts as
    d = 1."""
    num = den = 0.0
    for o in outcomes:
        if o.method == "static" or o.deviation is None:
            continue
        w = LEVEL_WEIGHTS.get(o.level or "", 1.0)
        num += w * o.deviation
        den += w
    return None if den == 0 else num / den


def routing(outcomes: Sequence[ClauseOutcome]) -> str:
    """The most severe action prescribed by a violated clause; ``none`` if none is violated."""
    return most_severe(o.action for o in outcomes if o.violated)


@dataclass
class WindowResult:
    """One time window: its records' clause outcomes, H and the routing action."""

    index: int
    start: datetime
    end: datetime
    n: int
    builds: list[str]
    clauses: list[ClauseOutcome]
    health: float | None
    action: str
    skipped: int = 0
    complete: bool = True
    flagged: list[dict[str, Any]] = field(default_factory=list)

    @property
    def violated(self) -> list[ClauseOutcome]:
        return [c for c in self.clauses if c.violated]

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index, "start": format_time(self.start), "end": format_time(self.end),
            "n": self.n, "builds": self.builds, "health": self.health,
            "action": self.action, "violated": [c.id for c in self.violated],
            "clauses": [c.to_json() for c in self.clauses], "flagged": self.flagged,
            "skipped": self.skipped, "complete": self.complete,
        }


def evaluate_window(contract: Any, records: Sequence[TraceRecord], index: int, start: datetime,
                    end: datetime, confidence: float = DEFAULT_CONFIDENCE, skipped: int = 0,
                    complete: bool = True) -> WindowResult:
    """The clauses, H and action of one window's records."""
    if not records:
        return WindowResult(index, start, end, 0, [], [], None, "none", skipped, complete)
    outcomes = evaluate_contract(contract, records, confidence, include_static=False)
    flagged = [{"clause": o.id, **o.worst.to_json()} for o in outcomes
               if o.violated and o.worst is not None][:MAX_FLAGGED]
    builds = list(dict.fromkeys(r.build for r in records))
    return WindowResult(index, start, end, len(records), builds, outcomes, health(outcomes),
                        routing(outcomes), skipped, complete, flagged)


def monitor(contract: Any, records: Iterable[TraceRecord], window_s: float = DEFAULT_WINDOW_S,
            confidence: float = DEFAULT_CONFIDENCE,
            skipped: Callable[[], int] | None = None) -> Iterator[WindowResult]:
    """Window results as the records arrive (a generator: it works on a growing file).

    ``skipped()`` (optional) returns how many lines the reader has skipped so far; each window
    reports the lines skipped while it was open.
    """
    t0: datetime | None = None
    current: list[TraceRecord] = []
    k = 0
    skipped_before = 0

    def close(idx: int, recs: list[TraceRecord], complete: bool) -> WindowResult:
        nonlocal skipped_before
        assert t0 is not None
        start, end = window_bounds(t0, window_s, idx)
        now = skipped() if skipped is not None else 0
        res = evaluate_window(contract, recs, idx, start, end, confidence,
                              now - skipped_before, complete)
        skipped_before = now
        return res

    for rec in records:
        if t0 is None:
            t0 = rec.time
        j = window_index(rec.time, t0, window_s)
        while j > k:
            yield close(k, current, True)
            current = []
            k += 1
        current.append(rec)
    if t0 is not None:
        yield close(k, current, False)


@dataclass
class BuildSpan:
    build: str
    first: datetime
    last: datetime
    records: int
    first_line: str

    def to_json(self) -> dict[str, Any]:
        return {"build": self.build, "first": format_time(self.first),
                "last": format_time(self.last), "records": self.records,
                "first_record": self.first_line}


class Summary:
    """Running totals over the windows: builds, build changes, detection lag."""

    def __init__(self) -> None:
        self.builds: dict[str, BuildSpan] = {}
        self.windows: list[WindowResult] = []

    def add_records(self, records: Iterable[TraceRecord]) -> None:
        for r in records:
            span = self.builds.get(r.build)
            if span is None:
                self.builds[r.build] = BuildSpan(r.build, r.time, r.time, 1, r.where)
            else:
                span.last, span.records = r.time, span.records + 1

    def add_window(self, w: WindowResult) -> None:
        self.windows.append(w)

    def changes(self) -> list[dict[str, Any]]:
        """Each build after the first: when it appeared and how long until a window acted.

        detection_lag_s: from the new build's first record to the end of the first window (at
        or after it) whose action is not ``none`` (when the monitor can act); None if none did.
        """
        spans = sorted(self.builds.values(), key=lambda s: s.first)
        out = []
        for prev, span in zip(spans, spans[1:]):
            hit = next((w for w in self.windows if w.end > span.first and w.action != "none"),
                       None)
            out.append({"from": prev.build, "to": span.build, "at": format_time(span.first),
                        "first_record": span.first_line,
                        "detected_window": None if hit is None else hit.index,
                        "detection_lag_s": None if hit is None
                        else (hit.end - span.first).total_seconds(),
                        "action": None if hit is None else hit.action})
        return out

    def to_json(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for w in self.windows:
            counts[w.action] = counts.get(w.action, 0) + 1
        hs = [w.health for w in self.windows if w.health is not None]
        return {"windows": len(self.windows), "actions": counts,
                "max_health": max(hs) if hs else None,
                "builds": [s.to_json() for s in sorted(self.builds.values(),
                                                       key=lambda s: s.first)],
                "build_changes": self.changes()}


def tracking(records: Iterable[TraceRecord], summary: Summary) -> Iterator[TraceRecord]:
    """Pass records through, recording their builds in ``summary``."""
    for r in records:
        summary.add_records((r,))
        yield r
