"""The report's input: plain dataclasses the planner fills, one ClauseResult per clause.

Verdicts are semantics §4's: proved / refuted / unknown (formal) and passed / failed (empirically:
measured, with the evidence recorded). A clause is *violated* when refuted or failed; its
action (through the escalation policy, kcverify.empirical.escalation) then applies.

Every clause also says what decided it (``decided_by``, docs/contract.md "What decided a
clause"): ``proof`` (a certificate's proof tree), ``counterexample`` (a replayed violation),
``evidence`` (measurements or sampled programs, with the sample size and confidence stated),
``static`` (a check of the model artifact) or ``undecided``. A certifiable clause decided on
evidence passes or fails, it is never *proved*, and every rendering says so: the headline of a
run whose certifiable clauses are not all proved reads "holds on evidence", not "holds".
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
        """docs/semantics.md's long names are accepted: passed-empirically, failed-empirically."""
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


DECIDED_BY = ("proof", "counterexample", "evidence", "static", "undecided")
CLASSES = ("certifiable", "empirical", "static")


def decided_by_default(verdict: Verdict | str, method: str) -> str:
    """What decided a verdict when the producer did not say: proved -> proof, refuted ->
    counterexample, passed / failed -> static (method "static") or evidence, unknown -> undecided."""
    v = Verdict(verdict)
    if v is Verdict.PROVED:
        return "proof"
    if v is Verdict.REFUTED:
        return "counterexample"
    if v is Verdict.UNKNOWN:
        return "undecided"
    return "static" if method == "static" else "evidence"


def class_default(family: str) -> str:
    """A clause's class when the producer did not say (older reports): by its family."""
    return {"numerical": "certifiable", "observability": "static"}.get(family, "empirical")


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
    clause); bound: the *certified* bound on the clause's quantity (in its units, like value and
    threshold; None when none was computed, inf when the bound engine's is vacuous);
    rate_upper: the upper confidence bound on the violation rate of a soft clause
    (Clopper-Pearson at ``confidence``); threshold / direction: the clause's condition ``value
    direction threshold``; sample_size / confidence: the evidence behind an empirical verdict;
    level and action: the escalation level and the action the policy prescribes when violated;
    klass: the clause's class (certifiable, empirical, static); decided_by: what decided the
    verdict (DECIDED_BY).
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
    rate_upper: float | None = None
    klass: str | None = None
    decided_by: str | None = None

    def __post_init__(self) -> None:
        self.verdict = Verdict(self.verdict)
        for s in self.slices:
            s.verdict = Verdict(s.verdict)
        if self.klass is None:
            self.klass = class_default(self.family)
        if self.decided_by is None:
            self.decided_by = decided_by_default(self.verdict, self.method)
        if self.klass not in CLASSES:
            raise ValueError(f"clause {self.id}: class {self.klass!r} is not one of "
                             f"{', '.join(CLASSES)}")
        if self.decided_by not in DECIDED_BY:
            raise ValueError(f"clause {self.id}: decided_by {self.decided_by!r} is not one of "
                             f"{', '.join(DECIDED_BY)}")

    @property
    def on_evidence(self) -> bool:
        """A certifiable clause whose verdict rests on evidence (or nothing), not on a proof."""
        return self.klass == "certifiable" and self.decided_by in ("evidence", "undecided")

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

    def tally(self) -> dict[str, int]:
        """The headline's counts: proved, on evidence (passed on evidence), static (passed
        static checks), undecided (unknown), failed (refuted or failed, however decided)."""
        out = {"proved": 0, "on evidence": 0, "static": 0, "undecided": 0, "failed": 0}
        for c in self.clauses:
            v = Verdict(c.verdict)
            key = ("failed" if v.violated else "proved" if v is Verdict.PROVED else
                   "undecided" if v is Verdict.UNKNOWN else
                   "static" if c.decided_by == "static" else "on evidence")
            out[key] += 1
        return out

    def summary(self) -> str:
        """``3 proved · 4 on evidence · 0 failed`` (static and undecided only when present)."""
        t = self.tally()
        return " · ".join(f"{n} {k}" for k, n in t.items()
                          if n or k in ("proved", "on evidence", "failed"))

    def headline(self) -> tuple[str, str]:
        """(verdict, tone) of the whole run, tone good | warn | bad: "violated" when a clause is
        refuted or failed; "undecided" when one is unknown; "holds on evidence" when a
        certifiable clause passed on evidence only; else "holds" (certifiable clauses proved,
        the others passed their measurements and checks)."""
        if not self.ok:
            return "violated", "bad"
        if any(Verdict(c.verdict) is Verdict.UNKNOWN for c in self.clauses):
            return "undecided", "warn"
        if any(c.on_evidence for c in self.clauses):
            return "holds on evidence", "warn"
        return "holds", "good"

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
        body["tally"] = self.tally()
        body["summary"] = self.summary()
        body["verdict"] = self.headline()[0]
        for c, src in zip(body["clauses"], self.clauses):
            c["action_taken"] = src.action_taken
        return clean(body)
