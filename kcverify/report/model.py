"""The report's input: plain dataclasses the planner fills, one ClauseResult per clause.

Verdicts are DESIGN 4's: proved / refuted / unknown (formal) and passed / failed (empirically:
measured, with the evidence recorded). A clause is *violated* when refuted or failed; its
action (through the escalation policy, kcverify.empirical.escalation) then applies.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any


class Verdict(StrEnum):
    PROVED = "proved"
    REFUTED = "refuted"
    UNKNOWN = "unknown"
    PASSED = "passed"  # passed empirically
    FAILED = "failed"  # failed empirically

    @classmethod
    def _missing_(cls, value: object) -> Verdict | None:
        """DESIGN's long names are accepted: passed-empirically, failed-empirically."""
        return {"passed-empirically": cls.PASSED, "failed-empirically": cls.FAILED}.get(str(value))

    @property
    def violated(self) -> bool:
        return self in (Verdict.REFUTED, Verdict.FAILED)

    @property
    def holds(self) -> bool:
        return self in (Verdict.PROVED, Verdict.PASSED)

    @classmethod
    def from_outcome(cls, outcome: str) -> Verdict:
        """An empirical Decision outcome (passed / failed / unknown) as a verdict."""
        return {"passed": cls.PASSED, "failed": cls.FAILED, "unknown": cls.UNKNOWN}[outcome]


@dataclass
class SliceResult:
    """One clause on one slice: n units, k violations, rate k/n, its upper bound and the budget."""

    slice: str
    verdict: Verdict | str
    n: int
    violations: int | None = None
    rate: float | None = None
    upper: float | None = None
    lower: float | None = None
    budget: float | None = None
    value: float | None = None
    note: str = ""


@dataclass
class BlockDrift:
    """Per block: the certified bound on output drift (L∞) and the largest drift observed.

    ``observed`` <= ``certified`` always holds for a sound certificate (the HTML plot shows both).
    """

    block: str
    certified: float | None
    observed: float | None = None
    kind: str = ""


@dataclass
class ClauseResult:
    """The decision of one clause.

    value: the quantity observed (the metric's aggregate, or the certified bound for a proved
    clause); bound: the bound the verdict rests on (certified drift, or the upper confidence bound
    on the violation rate); threshold / direction: the clause's condition ``value direction
    threshold``; sample_size / confidence: the evidence behind an empirical verdict; level and
    action: the escalation level and the action the policy prescribes when violated.
    """

    id: str
    family: str
    verdict: Verdict | str
    method: str
    value: float | None = None
    bound: float | None = None
    threshold: float | None = None
    direction: str = "<="
    metric: str | None = None
    slice: str | None = None
    sample_size: int | None = None
    violations: int | None = None
    confidence: float | None = None
    budget: float | None = None
    level: str | None = None
    action: str | None = None
    note: str = ""
    slices: list[SliceResult] = field(default_factory=list)
    blocks: list[BlockDrift] = field(default_factory=list)
    evidence: dict[str, Any] = field(default_factory=dict)  # e.g. {"counterexample": {...}}

    def __post_init__(self) -> None:
        self.verdict = Verdict(self.verdict)
        for s in self.slices:
            s.verdict = Verdict(s.verdict)

    @property
    def violated(self) -> bool:
        return Verdict(self.verdict).violated

    @property
    def action_taken(self) -> str:
        """The action that applies now: the prescribed action when violated, else "none"."""
        return (self.action or "none") if self.violated else "none"


@dataclass
class Report:
    """A whole run: the contract, the model, every clause, the health score and routing action."""

    contract: str
    model: str
    clauses: list[ClauseResult]
    health: float | None = None
    action: str = "none"
    blocks: list[BlockDrift] = field(default_factory=list)
    escalation: dict[str, str] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """No clause violated (unknown clauses do not fail the run; they are reported)."""
        return not any(c.violated for c in self.clauses)

    @property
    def exit_code(self) -> int:
        """The CLI's convention: 0 when no clause is violated, 1 otherwise."""
        return 0 if self.ok else 1

    def counts(self) -> dict[str, int]:
        """How many clauses got each verdict."""
        out = {v.value: 0 for v in Verdict}
        for c in self.clauses:
            out[Verdict(c.verdict).value] += 1
        return out

    def to_json(self) -> dict[str, Any]:
        def clean(obj: Any) -> Any:
            if isinstance(obj, Verdict):
                return obj.value
            if isinstance(obj, dict):
                return {k: clean(v) for k, v in obj.items()}
            if isinstance(obj, list | tuple):
                return [clean(v) for v in obj]
            if isinstance(obj, float) and obj != obj:  # NaN is not JSON
                return None
            return obj

        body = asdict(self)
        body["ok"] = self.ok
        body["counts"] = self.counts()
        for c, src in zip(body["clauses"], self.clauses):
            c["action_taken"] = src.action_taken
        return clean(body)
