"""The four-stage promotion pipeline: ci, shadow, canary, full; one stage decided per call.

Each clause family is decided in the venue it needs, and a later stage re-checks the earlier
families on its own traffic (a canary that drifts is a no-go even though CI passed):

    stage   venue                         families decided
    ci      offline (certificate or       observability, numerical
            offline traces)
    shadow  mirrored traffic (traces)     observability, numerical, statistical (behavioral)
    canary  live load (traces)            observability, numerical, statistical, runtime
    full    live load, sustained          canary's, over the stability window, and every window
                                          of it compliant

Observability is the precondition of every stage: the model artifact's static clauses (e.g.
``opset() >= 17``) hold, and on traces the implicit clause O-TRACE (fingerprints constant
within the build) holds; a clause that the traces cannot re-evaluate (no records in its slice,
no logits) is unknown, and unknown is no-go.

Decision rule for the stage's clauses: a hard clause must be passed (proved, for a certificate);
a soft clause must be passed by its budget: the one-sided Clopper-Pearson upper bound on its
exceedance rate at most the budget (kcverify.empirical.stats). Anything else (failed, refuted,
unknown: inconclusive at this sample size) is no-go, and the reasons name the clause and slice.

``full`` additionally needs sustained compliance: the traces cover at least the stability window
(default 30 minutes) and, on its last stretch of that length, every monitor window (default 300
s) has records, no violated clause and H <= the health threshold; the clauses are decided on the
records of that stretch.

Traces of several builds are refused unless ``build`` names the candidate. The decision record
(contract and model digests, the kernel specs' digests, the candidate's fingerprint, the traces'
digests, the stage and every verdict) is appended to the registry's promotion log.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from kcverify.empirical.stats import DEFAULT_CONFIDENCE
from kcverify.enforce.clauses import ClauseOutcome, evaluate_contract, static_outcome
from kcverify.enforce.monitor import (
    DEFAULT_HEALTH_THRESHOLD,
    DEFAULT_WINDOW_S,
    WindowResult,
    monitor,
)
from kcverify.enforce.traces import TraceReader, TraceRecord, format_time
from kcverify.errors import InputFileError, KcverifyError

FORMAT = "kcverify-promotion"
FORMAT_VERSION = 1
STAGES: dict[str, tuple[str, ...]] = {
    "ci": ("observability", "numerical"),
    "shadow": ("observability", "numerical", "statistical"),
    "canary": ("observability", "numerical", "statistical", "runtime"),
    "full": ("observability", "numerical", "statistical", "runtime"),
}
DEFAULT_STABILITY_S = 1800.0


@dataclass
class PromotionOptions:
    traces: Sequence[str] = ()
    build: str | None = None
    model: str | None = None
    cert: str | None = None
    window_s: float = DEFAULT_WINDOW_S
    stability_s: float = DEFAULT_STABILITY_S
    health_threshold: float = DEFAULT_HEALTH_THRESHOLD
    confidence: float = DEFAULT_CONFIDENCE
    skip_bad: bool = False
    warn: Callable[[str], None] | None = None


@dataclass
class Promotion:
    """One stage's decision with its evidence; ``record()`` is what the registry stores."""

    stage: str
    go: bool
    reasons: list[str]
    contract: Any
    model: dict[str, Any]
    kernel: dict[str, Any]
    traces: list[dict[str, Any]]
    clauses: list[ClauseOutcome]
    stability: dict[str, Any] | None = None
    skipped: dict[str, int] = field(default_factory=dict)
    at: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="milliseconds"))

    @property
    def decision(self) -> str:
        return "go" if self.go else "no-go"

    @property
    def exit_code(self) -> int:
        return 0 if self.go else 1

    def record(self) -> dict[str, Any]:
        c = self.contract
        return {
            "format": FORMAT, "format_version": FORMAT_VERSION, "at": self.at,
            "stage": self.stage, "decision": self.decision, "reasons": self.reasons,
            "families": list(STAGES[self.stage]),
            "contract": {"name": c.name, "version": c.version, "path": os.fspath(c.path),
                         "sha256": c.sha256},
            "model": self.model, "kernel": self.kernel, "traces": self.traces,
            "verdicts": [o.to_json() for o in self.clauses],
            "stability": self.stability, "skipped": self.skipped,
        }


def _model_digest(contract: Any, model: str | None) -> dict[str, Any]:
    from kcverify.certs.statement import sha256_file

    path = Path(model) if model else (contract.resolve(contract.model.onnx)
                                      if contract.model.onnx else None)
    if path is None:
        raise KcverifyError(f"{contract.path}: the contract names no model; give --model (the "
                            f"promotion record needs the model's digest)")
    if not path.is_file():
        raise InputFileError(f"{path}: no such model file (the promotion record needs its "
                             f"digest; give --model)")
    sha = sha256_file(path)
    if contract.model.sha256 not in ("auto", None) and sha != contract.model.sha256:
        raise KcverifyError(f"{path}: sha256 {sha} does not match the contract's model.sha256 "
                            f"{contract.model.sha256}")
    return {"path": os.fspath(path), "sha256": sha}


def _kernel_digests(contract: Any) -> dict[str, str]:
    from kcverify.certs.statement import kernel_spec_digest

    return {name: kernel_spec_digest(spec) for name, spec in contract.kernels.items()}


def trace_slices(contract: Any, path: str | os.PathLike[str]) -> tuple[str, ...]:
    """Slices of the contract defined by this trace file (``{traces: FILE}``), if the contract
    language has them; every record of the file belongs to them."""
    target = Path(path).resolve()
    out = []
    for name, sl in contract.slices.items():
        t = getattr(sl, "traces", None)
        if t and contract.resolve(t).resolve() == target:
            out.append(name)
    return tuple(out)


def load_records(contract: Any, paths: Sequence[str], skip_bad: bool = False,
                 warn: Callable[[str], None] | None = None
                 ) -> tuple[list[TraceRecord], list[dict[str, Any]], dict[str, int]]:
    """Every record of the trace files (each in time order), their digests, the skip counts."""
    from kcverify.certs.statement import sha256_file

    records: list[TraceRecord] = []
    info = []
    skipped: dict[str, int] = {}
    for p in paths:
        reader = TraceReader(p, skip_bad=skip_bad, warn=warn)
        extra = trace_slices(contract, p)
        recs = list(reader)
        for r in recs:
            if extra:
                r.slices = tuple(dict.fromkeys((*r.slices, *extra)))
        records += recs
        summary = reader.summary()
        if summary and warn is not None:
            warn(summary)
        for k, v in reader.skipped.items():
            skipped[k] = skipped.get(k, 0) + v
        info.append({"path": os.fspath(p), "sha256": sha256_file(p), "records": len(recs),
                     "skipped": reader.skipped_total,
                     "first": format_time(recs[0].time) if recs else None,
                     "last": format_time(recs[-1].time) if recs else None})
    records.sort(key=lambda r: r.time)
    return records, info, skipped


def _candidate(records: list[TraceRecord], build: str | None) -> tuple[list[TraceRecord],
                                                                        dict[str, Any]]:
    builds = list(dict.fromkeys(r.build for r in records))
    if build is not None:
        chosen = [r for r in records if r.build == build]
        if not chosen:
            raise KcverifyError(f"no trace record of build {build!r}; builds in the traces: "
                                f"{', '.join(builds) or 'none'}")
        return chosen, {"build": build, "fingerprint": chosen[0].fingerprint}
    if len(builds) > 1:
        raise KcverifyError(f"the traces hold {len(builds)} builds ({', '.join(builds)}); name "
                            f"the candidate with --build")
    if not records:
        return records, {"build": None, "fingerprint": None}
    return records, {"build": builds[0], "fingerprint": records[0].fingerprint}


def _certificate_outcomes(contract: Any, model: Path, cert: str | None) -> list[ClauseOutcome]:
    """CI without traces: the numerical clauses' verdicts from a certificate that checks."""
    from kcverify.certs.checker import check_certificate
    from kcverify.empirical.escalation import prescribed_action

    cert_path = Path(cert) if cert else model.with_name(model.name + ".kcert.json")
    if not cert_path.is_file():
        raise InputFileError(f"{cert_path}: no certificate; stage ci needs --traces (offline "
                             f"traces) or a certificate of the model (kcverify prove)")
    report = check_certificate(str(cert_path), model, contract.path)
    stmt = report.statement
    verdicts = {} if stmt is None else {c["id"]: c for c in stmt["predicate"]["clauses"]}
    out = []
    for clause in contract.clauses:
        if clause.family != "numerical":
            continue
        c = verdicts.get(clause.id)
        verdict = "unknown" if c is None else str(c["verdict"]).replace("-empirically", "")
        note = "from the certificate" if c is not None else "not in the certificate"
        if report.problems:
            verdict = "unknown"
            note = "the certificate does not check: " + "; ".join(report.problems[:3])
        out.append(ClauseOutcome(
            id=clause.id, family=clause.family, level=clause.level,
            action=prescribed_action(clause.level, clause.action, contract.escalation),
            hard=bool(clause.hard), verdict=verdict, budget=clause.budget,
            threshold=clause.threshold, method=f"certificate {cert_path.name}", note=note))
    return out


def _reason(o: ClauseOutcome) -> str | None:
    """Why a clause blocks the stage, or None when it allows it."""
    if o.verdict in ("passed", "proved"):
        return None
    kind = "hard" if o.hard else f"soft, budget {o.budget:g}" if o.budget else "soft"
    where = f" on slice {o.slice}" if o.slice else ""
    value = f" (value {o.value:.4g} vs {o.direction} {o.threshold:g})" \
        if o.value is not None and o.threshold is not None else ""
    detail = o.note.split("; ")[0] if o.note else ""
    for part in o.parts:
        if part.get("verdict") == o.verdict and part.get("note"):
            detail = part["note"]
            break
    worst = f"; worst request {o.worst.request_id} at {o.worst.where}" if o.worst and \
        o.verdict == "failed" and o.worst.where not in detail else ""
    return f"{o.id} ({o.family}, {kind}) is {o.verdict}{where}{value}: {detail}{worst}"


def decide(contract_path: str | os.PathLike[str], stage: str,
           options: PromotionOptions | None = None) -> Promotion:
    """Decide one stage (module docstring); nothing is logged here (see ``log_promotion``)."""
    from kcverify.dsl import load_contract
    from kcverify.planner.static import model_facts

    options = options or PromotionOptions()
    if not 0.0 < options.confidence < 1.0:
        raise KcverifyError(f"confidence {options.confidence}: expected a number in (0, 1)")
    if stage not in STAGES:
        raise KcverifyError(f"unknown stage {stage!r}; expected one of {', '.join(STAGES)}")
    families = STAGES[stage]
    contract = load_contract(contract_path)
    model = _model_digest(contract, options.model)
    traces = list(options.traces)
    if not traces:
        traces = [os.fspath(contract.resolve(t)) for t in
                  dict.fromkeys(getattr(sl, "traces", None) for sl in contract.slices.values())
                  if t]
    if not traces and stage != "ci":
        raise KcverifyError(f"stage {stage} is decided on traces: give --traces FILE (or a "
                            f"contract slice {{traces: FILE}})")
    facts = model_facts(model["path"])
    kernel: dict[str, Any] = {"specs": _kernel_digests(contract)}
    outcomes: list[ClauseOutcome] = []
    trace_info: list[dict[str, Any]] = []
    skipped: dict[str, int] = {}
    stability = None
    if traces:
        records, trace_info, skipped = load_records(contract, traces, options.skip_bad,
                                                    options.warn)
        records, cand = _candidate(records, options.build)
        kernel.update(cand)
        if stage == "full":
            records, stability = _stability(contract, records, options)
        outcomes = evaluate_contract(contract, records, options.confidence, families, facts)
    else:
        outcomes = [static_outcome(c, ClauseOutcome(
            id=c.id, family=c.family, level=c.level, action=c.action, hard=bool(c.hard),
            verdict="unknown"), facts) for c in contract.clauses if c.klass == "static"]
        outcomes += _certificate_outcomes(contract, Path(model["path"]), options.cert)
        kernel.update({"build": None, "fingerprint": None})
    reasons = [r for r in (_reason(o) for o in outcomes) if r]
    if stability is not None and not stability["ok"]:
        reasons = stability["reasons"] + reasons
    if skipped:
        reasons.append(f"{sum(skipped.values())} malformed trace lines were skipped "
                       f"({', '.join(f'{k}: {v}' for k, v in sorted(skipped.items()))}); "
                       f"a promotion needs every record")
    return Promotion(stage, not reasons, reasons, contract, model, kernel, trace_info, outcomes,
                     stability, skipped)


def _stability(contract: Any, records: list[TraceRecord], options: PromotionOptions
               ) -> tuple[list[TraceRecord], dict[str, Any]]:
    """The last ``stability_s`` of traffic and whether every window of it was compliant."""
    need = options.stability_s
    if not records:
        return records, {"ok": False, "window_s": options.window_s, "stability_s": need,
                         "reasons": ["full: no trace records"], "windows": []}
    end = records[-1].time
    span = (end - records[0].time).total_seconds()
    reasons: list[str] = []
    if span < need:
        reasons.append(f"full: the traces cover {span:.0f} s of traffic; sustained compliance "
                       f"needs a stability window of {need:.0f} s")
    start = end - timedelta(seconds=need)
    stretch = [r for r in records if r.time > start] if span >= need else list(records)
    windows: list[WindowResult] = list(monitor(contract, stretch, options.window_s,
                                               options.confidence))
    for w in windows:
        if w.n == 0:
            reasons.append(f"full: window {format_time(w.start)} .. {format_time(w.end)} has no "
                           f"traffic")
        elif w.action != "none" or (w.health or 0.0) > options.health_threshold:
            bad = ", ".join(f"{c.id} on {c.slice}" for c in w.violated) or "no clause violated"
            reasons.append(f"full: window {format_time(w.start)} .. {format_time(w.end)} is not "
                           f"compliant (action {w.action}, H {w.health:.3g} vs threshold "
                           f"{options.health_threshold:g}; {bad})")
    return stretch, {
        "ok": not reasons, "window_s": options.window_s, "stability_s": need,
        "health_threshold": options.health_threshold, "reasons": reasons,
        "windows": [{"start": format_time(w.start), "end": format_time(w.end), "n": w.n,
                     "health": w.health, "action": w.action} for w in windows]}


def log_promotion(promotion: Promotion, registry: str | os.PathLike[str] | None = None) -> int:
    """Append the decision record to the registry's promotion log; returns its id."""
    from kcverify.registry import Registry

    return Registry(registry).log_promotion(promotion.record())
