"""A contract's clauses re-evaluated on logged trace records (one window, or one promotion).

Each clause is decided from the records alone, so every verdict can be re-derived post hoc from
the same traces:

* **metric clauses** (the short form, statistical or runtime): the registered metric
  (kcverify.empirical.metrics) on MetricInputs built from the records of each slice: both
  kernels' logits stacked per record (statistical), the records' ``latency_ms`` (runtime
  percentiles) or ``peak_memory_mb``. The decision is kcverify.empirical.evaluate's: a hard
  clause fails on any violating record or a violating aggregate; a soft clause compares the
  exceedance rate with its budget by one-sided Clopper-Pearson bounds; a runtime percentile
  p_q <= tau is the exceedance test with budget 1 - q. Records of unequal length (positions)
  are evaluated per record with the same metric and the same decision rule.
* **certifiable conditions** (numerical clauses; the shapes of kcverify.dsl.numerical_queries):
  the quantity per record by kcverify.empirical.quantities.query_values, aggregated as the
  condition says. ``forall`` (max, or min for an agreement): each record is a unit, k records violate; hard: failed when
  k > 0, soft: Clopper-Pearson against the budget. mean / p50 / p95 / p99: the aggregate over
  every (record, position) compared with the threshold.
* **static clauses** (observability of the artifact, e.g. ``opset() >= 17``): decided on the
  model file when one is given (kcverify.planner.static), else unknown; never per window.
* **trace observability** (the implicit clause ``O-TRACE``, level L2): within one build the
  kernel fingerprint (attention, quantisation, hardware) must not change.

A clause whose slice has no records, or whose quantity the records cannot give (no logits), is
*unknown*: not re-evaluable from these traces. Unknown never triggers an action; a promotion
treats it as no-go.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from kcverify.empirical.escalation import deviation, prescribed_action
from kcverify.empirical.evaluate import (
    MetricOutcome,
    combine_outcomes,
    evaluate_metric,
    min_sample_size,
    violates,
)
from kcverify.empirical.metrics import Metric, MetricError, MetricInputs, get_metric
from kcverify.empirical.quantities import AGREEMENT, aggregate, compare, query_values
from kcverify.empirical.stats import DEFAULT_CONFIDENCE, Decision, decide_exceedance
from kcverify.enforce.traces import TraceRecord

TRACE_CLAUSE = "O-TRACE"
TRACE_LEVEL = "L2"
LOGPROB_QUANTITIES = ("logprob_abs", "ratio_dev")


@dataclass
class Worst:
    """The record that attains a clause's worst per-record value (a flagged request)."""

    request_id: str
    where: str
    value: float
    slice: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ClauseOutcome:
    """One clause on a set of records: verdict, value, deviation and the evidence.

    value: the measured value (the metric's aggregate, or the condition's aggregate); deviation:
    kcverify.empirical.escalation.deviation of value from threshold (0 when it meets it, 1 at
    100 % or more over); n / violations: units (records) and violating units; action: what the
    escalation policy prescribes when the clause is violated.
    """

    id: str
    family: str
    level: str
    action: str
    hard: bool
    verdict: str
    value: float | None = None
    threshold: float | None = None
    direction: str = "<="
    deviation: float | None = None
    n: int = 0
    violations: int = 0
    budget: float | None = None
    upper: float | None = None
    lower: float | None = None
    method: str = ""
    slice: str = ""
    note: str = ""
    worst: Worst | None = None
    parts: list[dict[str, Any]] = field(default_factory=list)

    @property
    def violated(self) -> bool:
        return self.verdict in ("failed", "refuted")

    @property
    def holds(self) -> bool:
        return self.verdict in ("passed", "proved")

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "worst"}
        out["worst"] = None if self.worst is None else self.worst.to_json()
        for k in ("value", "deviation", "upper", "lower"):
            if isinstance(out[k], float) and not math.isfinite(out[k]):
                out[k] = None if math.isnan(out[k]) else str(out[k])
        return out


def _finite(v: float | None) -> float | None:
    return None if v is None or not math.isfinite(v) else float(v)


def _dev(value: float | None, threshold: float | None, direction: str) -> float | None:
    if value is None or threshold is None:
        return None
    if math.isnan(value):
        return 1.0  # a NaN measurement is a violation at full weight
    return deviation(value, threshold, direction)


def records_in(records: Iterable[TraceRecord], slice_name: str) -> list[TraceRecord]:
    return [r for r in records if slice_name in r.slices]


# --------------------------------------------------------------------------------------------
# Metric clauses
# --------------------------------------------------------------------------------------------


def _metric_inputs(recs: Sequence[TraceRecord], temperature: float) -> MetricInputs:
    """Both kernels' logits stacked [n, positions, V] (records of one shape), labels if all
    records carry them."""
    zt = np.stack([r.logits_train for r in recs])
    zi = np.stack([r.logits_inf for r in recs])
    labels = None
    if all(r.labels is not None for r in recs):
        shapes = {r.labels.shape for r in recs}
        if len(shapes) == 1:
            labels = np.stack([r.labels for r in recs])
    return MetricInputs(logits_train=zt, logits_inf=zi, labels=labels, temperature=temperature)


def _ragged_outcome(m: Metric, threshold: float, recs: Sequence[TraceRecord], budget: float | None,
                    confidence: float, direction: str, temperature: float) -> MetricOutcome:
    """evaluate_metric's per-unit rule for records of unequal length: the aggregate over every
    (record, position) value, one per-unit value per record, the same decision."""
    if m.is_statistic:
        raise MetricError(f"metric {m.name!r} is a whole-sample statistic; it needs records of "
                          f"equal length")
    per_record = [m.values(_metric_inputs([r], temperature))[0] for r in recs]
    flat = np.concatenate(per_record)
    value = float(m.aggregate(MetricInputs(
        logits_train=np.concatenate([r.logits_train for r in recs])[None],
        logits_inf=np.concatenate([r.logits_inf for r in recs])[None],
        temperature=temperature))) if flat.size else float("nan")
    per_unit = np.array([float(m.per_unit(_metric_inputs([r], temperature))[0]) for r in recs])
    k = int(np.sum(violates(per_unit, threshold, direction)))
    d = decide_exceedance(k, len(recs), budget, confidence)
    if d.budget is None and bool(violates(np.asarray(value), threshold, direction)) \
            and d.outcome != "failed":
        d = replace(d, outcome="failed", note=f"the slice's {m.name} = {value:.4g} violates "
                    f"{direction} {threshold:g}")
    if d.outcome == "unknown" and budget:
        d = replace(d, note=d.note + f"; with no violation, {min_sample_size(budget, confidence)} "
                    f"inputs would decide it")
    return MetricOutcome(m.name, value, threshold, direction, d, per_unit)


def _metric_slice(m: Metric, clause: Any, recs: list[TraceRecord], confidence: float,
                  ) -> tuple[MetricOutcome | None, list[TraceRecord], str]:
    """The metric on one slice's records: (outcome or None, the records used, a note)."""
    threshold = float(clause.threshold)
    direction = m.direction
    if m.family == "runtime":
        if "memory" in m.needs:
            used = [r for r in recs if r.peak_memory_mb is not None]
            if not used:
                return None, [], "no record carries peak_memory_mb"
            x = MetricInputs(peak_memory_mb=max(r.peak_memory_mb for r in used))
        else:
            used = list(recs)
            x = MetricInputs(latencies_ms=np.array([r.latency_ms for r in used], dtype=np.float64))
        return evaluate_metric(m, threshold, x, clause.budget, confidence, direction), used, ""
    used = [r for r in recs if r.has_logits]
    note = "" if len(used) == len(recs) else (
        f"{len(recs) - len(used)} records without both kernels' logits not evaluated")
    if not used:
        return None, [], "no record carries both kernels' logits"
    temperature = float(clause.temperature or 1.0)
    if len({r.logits_train.shape for r in used}) == 1:
        x = _metric_inputs(used, temperature)
        return (evaluate_metric(m, threshold, x, clause.budget, confidence, direction),
                used, note)
    return (_ragged_outcome(m, threshold, used, clause.budget, confidence, direction, temperature),
            used, note)


def _metric_clause(contract: Any, clause: Any, records: Sequence[TraceRecord],
                   confidence: float, out: ClauseOutcome) -> ClauseOutcome:
    m = get_metric(clause.metric)
    names = list(clause.slices or contract.slices.keys())
    outcomes: list[str] = []
    notes: list[str] = []
    worst_value: float | None = None
    worst_slice = ""
    for name in names:
        recs = records_in(records, name)
        if not recs:
            outcomes.append("unknown")
            notes.append(f"{name}: no records in this slice")
            continue
        try:
            o, used, note = _metric_slice(m, clause, recs, confidence)
        except MetricError as e:
            outcomes.append("unknown")
            notes.append(f"{name}: not re-evaluable from these traces ({e})")
            continue
        if o is None:
            outcomes.append("unknown")
            notes.append(f"{name}: {note}")
            continue
        d = o.decision
        outcomes.append(d.outcome)
        notes.append(f"{name}: {d.note}" + (f"; {note}" if note else ""))
        part = {"slice": name, "metric": m.name, "verdict": d.outcome, "value": _finite(o.value),
                "n": d.n, "violations": d.violations, "upper": d.upper, "lower": d.lower,
                "budget": d.budget, "method": d.method,
                "note": f"{name}: {d.note}" + (f"; {note}" if note else "")}
        out.parts.append(part)
        out.n += d.n
        out.violations += int(d.violations or 0)
        if d.upper is not None:
            out.upper = d.upper if out.upper is None else max(out.upper, d.upper)
        if d.budget is not None:
            out.budget = d.budget
        out.method = "+".join(sorted(set(filter(None, [*out.method.split("+"), d.method]))))
        worse = (worst_value is None or (o.value > worst_value if m.direction == "<="
                                         else o.value < worst_value) or math.isnan(o.value))
        if worse:
            worst_value, worst_slice = o.value, name
        if o.per_unit is not None and len(o.per_unit) == len(used) and used:
            vals = np.asarray(o.per_unit, dtype=np.float64)
            i = int(np.nanargmax(vals) if m.direction == "<=" else np.nanargmin(vals)) \
                if not np.all(np.isnan(vals)) else 0
            cand = Worst(used[i].request_id, used[i].where, float(vals[i]), name)
            if out.worst is None or _worse(cand.value, out.worst.value, m.direction):
                out.worst = cand
    out.verdict = combine_outcomes(outcomes)
    out.value = worst_value
    out.threshold = float(clause.threshold)
    out.direction = m.direction
    out.deviation = _dev(worst_value, out.threshold, out.direction)
    out.slice = worst_slice or ",".join(names)
    out.note = "; ".join(notes)
    return out


def _worse(a: float, b: float, direction: str) -> bool:
    if math.isnan(a):
        return not math.isnan(b)
    return a > b if direction == "<=" else a < b


# --------------------------------------------------------------------------------------------
# Certifiable conditions, per record
# --------------------------------------------------------------------------------------------


def _element_values(q: Any, recs: Sequence[TraceRecord]) -> list[np.ndarray | None]:
    """The query's element values per record (1-D), None where a record cannot give them."""
    out: list[np.ndarray | None] = [None] * len(recs)
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, r in enumerate(recs):
        if r.has_logits:
            toks = r.observed_tokens()
            if q.quantity in LOGPROB_QUANTITIES and (toks is None
                                                     or toks.shape[0] != r.logits_train.shape[0]):
                if r.logprob_train is not None:
                    out[i] = _logprob_values(q, r)
                continue
            groups.setdefault(r.logits_train.shape, []).append(i)
        elif q.quantity in LOGPROB_QUANTITIES and r.logprob_train is not None:
            out[i] = _logprob_values(q, r)
    for idx in groups.values():
        sub = [recs[i] for i in idx]
        x = MetricInputs(logits_train=np.stack([r.logits_train for r in sub]),
                         logits_inf=np.stack([r.logits_inf for r in sub]),
                         temperature=float(q.temperature))
        tokens = None
        if q.quantity in LOGPROB_QUANTITIES:
            tokens = np.stack([r.observed_tokens() for r in sub])
        v = query_values(q, x, tokens)
        for j, i in enumerate(idx):
            out[i] = np.asarray(v[j], dtype=np.float64).reshape(-1)
    return out


def _logprob_values(q: Any, r: TraceRecord) -> np.ndarray:
    """|log q - log p| (logprob_abs) or |q/p - 1| (ratio_dev) of each sampled token."""
    diff = np.asarray(r.logprob_inf) - np.asarray(r.logprob_train)
    v = np.abs(diff) if q.quantity == "logprob_abs" else np.abs(np.exp(diff) - 1.0)
    if q.per_position:
        return v
    return np.array([np.max(v)]) if v.size else v


def _query_part(q: Any, recs: list[TraceRecord], budget: float | None,
                confidence: float) -> tuple[dict[str, Any], Worst | None, Decision | None]:
    vals = _element_values(q, recs)
    used = [(r, v) for r, v in zip(recs, vals) if v is not None and v.size]
    direction = "<=" if q.op in ("<=", "<") else ">="
    part: dict[str, Any] = {"slice": q.slice, "quantity": q.quantity, "aggregate": q.aggregate,
                            "op": q.op, "threshold": q.threshold}
    if not used:
        part.update(verdict="unknown", value=None, n=0,
                    note=f"{q.slice}: no record gives {q.quantity} (needs both kernels' logits"
                         f"{' or log-probabilities' if q.quantity in LOGPROB_QUANTITIES else ''})")
        return part, None, None
    how = q.aggregate
    agreement = q.quantity in AGREEMENT
    if agreement and how == "max":
        how = "min"  # forall: every element agrees <=> the minimum is 1
    flat = np.concatenate([v for _, v in used])
    value = aggregate(flat, how)
    unit = np.array([(np.min(v) if agreement else np.max(v)) for _, v in used])
    bad = np.array([not compare(float(u), q.op, q.threshold) for u in unit])
    i = int(np.argmin(unit) if agreement else np.nanargmax(unit)) \
        if not np.all(np.isnan(unit)) else 0
    worst = Worst(used[i][0].request_id, used[i][0].where, float(unit[i]), q.slice)
    skipped = len(recs) - len(used)
    forall = q.aggregate in ("max", "min")  # every element: each record is a unit
    if forall:
        d = decide_exceedance(int(bad.sum()), len(used), budget, confidence)
    else:
        holds = compare(value, q.op, q.threshold)
        d = Decision("passed" if holds else "failed", len(used), None, None, None, None, None,
                     None, method="aggregate",
                     note=f"{q.aggregate} {q.quantity} = {value:.4g} over {flat.size} elements "
                          f"of {len(used)} records vs {q.op} {q.threshold:g}")
    note = f"{q.slice}: {d.note}" + (f"; {skipped} records without the needed outputs"
                                      if skipped else "")
    if forall and d.violations:
        note += f"; worst {q.quantity} {worst.value:.4g} at {worst.where} ({worst.request_id})"
    part.update(verdict=d.outcome, value=_finite(value), n=d.n, violations=d.violations,
                upper=d.upper, budget=d.budget, method=d.method,
                deviation=_dev(value, q.threshold, direction), note=note)
    return part, worst, d


def _condition_clause(clause: Any, queries: Sequence[Any], records: Sequence[TraceRecord],
                      confidence: float, out: ClauseOutcome) -> ClauseOutcome:
    outcomes = []
    best_dev = -1.0
    flagged: Worst | None = None  # the worst record of the first violated query
    for q in queries:
        recs = records_in(records, q.slice)
        if not recs:
            part = {"slice": q.slice, "quantity": q.quantity, "verdict": "unknown", "value": None,
                    "n": 0, "note": f"{q.slice}: no records in this slice"}
            worst, d = None, None
        else:
            part, worst, d = _query_part(q, recs, clause.budget, confidence)
        out.parts.append(part)
        outcomes.append(part["verdict"])
        if d is not None:
            out.n = max(out.n, d.n)
            out.violations += int(d.violations or 0)
            if d.upper is not None:
                out.upper = d.upper if out.upper is None else max(out.upper, d.upper)
            out.budget = d.budget if d.budget is not None else out.budget
            out.method = "+".join(sorted(set(filter(None, [*out.method.split("+"), d.method]))))
        dev = part.get("deviation")
        if part.get("value") is not None and (dev or 0.0) > best_dev:
            best_dev = dev or 0.0
            out.value, out.threshold = part["value"], float(q.threshold)
            out.direction = "<=" if q.op in ("<=", "<") else ">="
            out.deviation, out.slice = dev, q.slice
            out.worst = worst
        if part["verdict"] == "failed" and flagged is None:
            flagged = worst
    out.worst = flagged or out.worst
    out.verdict = combine_outcomes(outcomes)
    if out.value is None:
        q0 = queries[0]
        out.threshold, out.direction = float(q0.threshold), "<=" if q0.op in ("<=", "<") else ">="
        out.slice = ",".join(dict.fromkeys(q.slice for q in queries))
    out.note = "; ".join(p.get("note", "") for p in out.parts if p.get("note"))
    return out


# --------------------------------------------------------------------------------------------
# Observability
# --------------------------------------------------------------------------------------------


def fingerprint_problems(records: Iterable[TraceRecord]) -> list[str]:
    """Builds whose fingerprint (attention, quantisation, hardware, ...) changes between records."""
    seen: dict[str, dict[tuple[tuple[str, str], ...], TraceRecord]] = {}
    for r in records:
        fp = tuple(sorted(r.fingerprint.items()))
        seen.setdefault(r.build, {}).setdefault(fp, r)
    problems = []
    for build, fps in seen.items():
        if len(fps) > 1:
            desc = "; ".join(f"{dict(k)} first at {r.where}" for k, r in fps.items())
            problems.append(f"build {build!r} has {len(fps)} different fingerprints: {desc}")
    return problems


def trace_observability(records: Sequence[TraceRecord], escalation: Mapping[str, str]
                        ) -> ClauseOutcome:
    """The implicit clause O-TRACE: fingerprints constant within a build (module docstring)."""
    problems = fingerprint_problems(records)
    return ClauseOutcome(
        id=TRACE_CLAUSE, family="observability", level=TRACE_LEVEL,
        action=prescribed_action(TRACE_LEVEL, None, escalation), hard=True,
        verdict="failed" if problems else ("passed" if records else "unknown"),
        value=float(len(problems)), threshold=0.0, direction="<=",
        deviation=1.0 if problems else 0.0, n=len(records), violations=len(problems),
        method="trace-fields", slice="*",
        note="; ".join(problems) or "every record has the required fields; fingerprints are "
                                    "constant within each build")


def static_outcome(clause: Any, out: ClauseOutcome, facts: Any | None) -> ClauseOutcome:
    """A static clause on the model artifact (kcverify.planner.static), unknown without one."""
    if facts is None:
        out.verdict, out.method = "unknown", "static"
        out.note = f"static ({clause.text}): decided on the model artifact, none given"
        return out
    from kcverify.planner.static import evaluate_static

    holds = bool(evaluate_static(clause.expr, facts))
    out.verdict, out.method, out.note = ("passed" if holds else "failed"), "static", clause.text
    out.n = 1
    return out


# --------------------------------------------------------------------------------------------
# A whole contract
# --------------------------------------------------------------------------------------------


def family_of(clause: Any) -> str:
    """The clause's family; behavioral clauses are decided like statistical ones."""
    return "statistical" if clause.family == "behavioral" else clause.family


def evaluate_clause_on_traces(contract: Any, clause: Any, records: Sequence[TraceRecord],
                              confidence: float = DEFAULT_CONFIDENCE,
                              facts: Any | None = None) -> ClauseOutcome:
    """Decide one clause of ``contract`` on ``records`` (the module docstring's rules)."""
    from kcverify.dsl import numerical_queries

    out = ClauseOutcome(id=clause.id, family=clause.family, level=clause.level,
                        action=prescribed_action(clause.level, clause.action, contract.escalation),
                        hard=bool(clause.hard), verdict="unknown", budget=clause.budget)
    if clause.klass == "static":
        return static_outcome(clause, out, facts)
    if clause.metric is not None:
        return _metric_clause(contract, clause, records, confidence, out)
    queries = numerical_queries(clause)
    if queries:
        return _condition_clause(clause, queries, records, confidence, out)
    out.note = (f"not re-evaluable from traces: {clause.text!r} is neither a metric clause nor "
                f"a certifiable shape kcverify.dsl.numerical_queries knows")
    return out


def evaluate_contract(contract: Any, records: Sequence[TraceRecord],
                      confidence: float = DEFAULT_CONFIDENCE, families: Sequence[str] | None = None,
                      facts: Any | None = None, include_static: bool = True,
                      include_trace: bool = True) -> list[ClauseOutcome]:
    """Every clause (of ``families``, all when None) on ``records``, plus O-TRACE."""
    out = []
    for clause in contract.clauses:
        if families is not None and family_of(clause) not in families:
            continue
        if clause.klass == "static" and not include_static:
            continue
        out.append(evaluate_clause_on_traces(contract, clause, records, confidence, facts))
    if include_trace and (families is None or "observability" in families):
        out.append(trace_observability(records, contract.escalation))
    return out
