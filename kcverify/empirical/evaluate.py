"""Deciding statistical and runtime clauses from both kernels' concrete outputs.

The planner runs both kernels on each slice (``run_both_kernels``), times the inference kernel
(``measure_kernel_runtime``), wraps the outputs in MetricInputs, and calls ``evaluate_clause``.

Decision rules (the statistics are in kcverify.empirical.stats):

* **statistical metric with per-input values**: each input's value (the metric over that
  input's positions) is compared with the threshold; k = inputs that violate it, n = inputs.
  Hard clause (no budget): failed on any violation, or when the slice's aggregate violates.
  Soft clause: the exceedance rate k/n against the budget through one-sided Clopper-Pearson
  bounds at the stated confidence (passed / failed / unknown = inconclusive at this sample size).
* **whole-sample statistic** (ece_gap): a percentile-bootstrap bound at the confidence, over
  resampled inputs, against the threshold.
* **runtime percentile** (p95_latency_ms ...): "p_q <= tau" means P(latency > tau) <= 1 - q; each
  timed call is a unit, k = calls slower than tau, and the exceedance test runs with budget
  1 - q (or the clause's own budget when it gives one).
* **peak_memory_mb**: one measurement, compared with the threshold (method "measured").

Runtime is measured on onnxruntime running the model (or the spec's QDQ graph) on CPU, and on
kcverify's torch executor on CUDA; the bit-exact emulation of a spec is far too slow to time.

``budget_means="alpha"`` selects the other reading of a budget: the aggregate itself must meet the
threshold at confidence 1 - budget (a bootstrap bound on the aggregate).

A clause over several slices is decided per slice; the clause fails when any slice fails, is
unknown when none fails and some is unknown, and passes when all pass.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kcverify.empirical.metrics import Metric, MetricInputs, get_metric
from kcverify.empirical.runtime import RuntimeSample, measure_runtime
from kcverify.empirical.stats import (
    DEFAULT_CONFIDENCE,
    Decision,
    bootstrap_interval,
    decide_exceedance,
    decide_statistic,
)
from kcverify.report.model import ClauseResult, SliceResult, Verdict


def min_sample_size(budget: float, confidence: float = DEFAULT_CONFIDENCE) -> int:
    """The fewest units that can pass a soft clause: with k = 0, 1 - (1-c)^(1/n) <= budget."""
    if not 0 < budget < 1:
        return 1
    return math.ceil(math.log(1.0 - confidence) / math.log(1.0 - budget))


def runtime_budget(metric: Metric, budget: float | None) -> float | None:
    """The exceedance budget of a runtime percentile clause: its own, else 1 - q for a p_q metric."""
    if metric.family != "runtime" or metric.quantile is None:
        return None
    return budget if budget else 1.0 - metric.quantile


@dataclass(frozen=True)
class MetricOutcome:
    """One metric on one slice: the aggregate value and the decision with its evidence."""

    metric: str
    value: float
    threshold: float
    direction: str
    decision: Decision
    per_unit: np.ndarray | None = None

    def slice_result(self, slice_name: str) -> SliceResult:
        d = self.decision
        return SliceResult(slice=slice_name, verdict=Verdict.from_outcome(d.outcome), n=d.n,
                           violations=d.violations, rate=d.rate, upper=d.upper, lower=d.lower,
                           budget=d.budget, value=self.value, note=d.note)


def evaluate_metric(metric: str | Metric, threshold: float, x: MetricInputs,
                    budget: float | None = None, confidence: float = DEFAULT_CONFIDENCE,
                    direction: str | None = None, budget_means: str = "exceedance",
                    resamples: int = 400, seed: int = 0) -> MetricOutcome:
    """Decide ``metric(x) <direction> threshold`` on one slice (see the module docstring)."""
    m = metric if isinstance(metric, Metric) else get_metric(metric)
    direction = direction or m.direction
    if budget_means not in ("exceedance", "alpha"):
        raise ValueError(f"budget_means is 'exceedance' or 'alpha', not {budget_means!r}")
    value = m.aggregate(x)

    def bootstrap(conf: float) -> Decision:
        lo, hi = bootstrap_interval(m.resampler(x), x.n, conf, resamples, seed)
        return decide_statistic(value, lo, hi, threshold, direction, x.n, conf)

    if x.n == 0:
        return MetricOutcome(m.name, value, threshold, direction,
                             decide_exceedance(0, 0, budget, confidence))
    if m.is_statistic:
        return MetricOutcome(m.name, value, threshold, direction, bootstrap(confidence))
    if budget_means == "alpha" and budget and m.family != "runtime":
        return MetricOutcome(m.name, value, threshold, direction, bootstrap(1.0 - budget))
    per_unit = m.per_unit(x)
    assert per_unit is not None
    k = int(np.sum(violates(per_unit, threshold, direction)))
    if m.family == "runtime" and m.quantile is None:
        outcome = "failed" if k else "passed"
        d = Decision(outcome, int(per_unit.size), k, k / per_unit.size, None, None, None, None,
                     method="measured", note=f"measured {value:.4g} {m.unit} vs threshold {threshold:g}")
        return MetricOutcome(m.name, value, threshold, direction, d, per_unit)
    if m.family == "runtime":
        b = runtime_budget(m, budget)
        assert b is not None
        d = decide_exceedance(k, int(per_unit.size), b, confidence)
        d = replace(d, note=f"{k} of {per_unit.size} calls over {threshold:g} {m.unit}; " + d.note)
        if d.outcome == "unknown":
            d = replace(d, note=d.note + f"; with none over, {min_sample_size(b, confidence)} "
                        f"calls would decide it")
        return MetricOutcome(m.name, value, threshold, direction, d, per_unit)
    d = decide_exceedance(k, x.n, budget, confidence)
    aggregate_bad = bool(violates(np.asarray(value), threshold, direction))
    if d.budget is None and aggregate_bad and d.outcome != "failed":
        d = replace(d, outcome="failed", note=f"the slice's {m.name} = {value:.4g} violates "
                    f"{direction} {threshold:g}")
    if d.outcome == "unknown" and budget:
        d = replace(d, note=d.note + f"; with no violation, {min_sample_size(budget, confidence)} "
                    f"inputs would decide it")
    return MetricOutcome(m.name, value, threshold, direction, d, per_unit)


def violates(values: np.ndarray, threshold: float, direction: str) -> np.ndarray:
    """Elementwise: does a value break ``value <direction> threshold``? (NaN always does.)"""
    v = np.asarray(values, dtype=np.float64)
    return ~(v <= threshold) if direction == "<=" else ~(v >= threshold)


def _get(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def combine_outcomes(outcomes: Sequence[str]) -> str:
    """failed if any failed; else unknown if any unknown; else passed (no slices: unknown)."""
    if not outcomes:
        return "unknown"
    if "failed" in outcomes:
        return "failed"
    return "unknown" if "unknown" in outcomes else "passed"


def evaluate_clause(clause: Any, inputs: Mapping[str, MetricInputs],
                    confidence: float = DEFAULT_CONFIDENCE, budget_means: str = "exceedance",
                    action: str | None = None) -> ClauseResult:
    """Decide a statistical / runtime clause on each of its slices and combine (module docstring).

    ``clause``: a DSL Clause (or any object / mapping with id, family, metric, threshold, budget,
    level, action, slices, temperature, and optionally direction / confidence); ``inputs``: the
    MetricInputs of each slice the clause names (a missing slice is reported as unknown).
    """
    metric = get_metric(_get(clause, "metric"))
    threshold = float(_get(clause, "threshold"))
    budget = _get(clause, "budget")
    confidence = float(_get(clause, "confidence") or confidence)
    direction = _get(clause, "direction") or metric.direction
    temperature = _get(clause, "temperature")
    names = list(_get(clause, "slices") or inputs.keys())
    results: list[SliceResult] = []
    outs: list[MetricOutcome] = []
    for name in names:
        if name not in inputs:
            results.append(SliceResult(name, Verdict.UNKNOWN, 0, note="no data for this slice"))
            continue
        x = inputs[name]
        if temperature and metric.family == "statistical":
            x = replace(x, temperature=float(temperature))
        o = evaluate_metric(metric, threshold, x, budget, confidence, direction, budget_means)
        outs.append(o)
        results.append(o.slice_result(name))
    verdict = Verdict.from_outcome(combine_outcomes(
        [{Verdict.PASSED: "passed", Verdict.FAILED: "failed"}.get(Verdict(r.verdict), "unknown")
         for r in results]))
    worst = None
    if outs:
        key = (lambda o: o.value) if direction == "<=" else (lambda o: -o.value)
        worst = max(outs, key=key)
    methods = sorted({o.decision.method for o in outs}) or ["none"]
    uppers = [r.upper for r in results if r.upper is not None]
    notes = [f"{r.slice}: {r.note}" for r in results if r.note]
    return ClauseResult(
        id=str(_get(clause, "id")), family=str(_get(clause, "family") or metric.family),
        verdict=verdict, method="+".join(methods), value=None if worst is None else worst.value,
        bound=max(uppers) if uppers else None, threshold=threshold, direction=direction,
        metric=metric.name, slice=",".join(names),
        sample_size=sum(r.n for r in results),
        violations=sum(r.violations or 0 for r in results),
        confidence=confidence if any(o.decision.confidence for o in outs) else None,
        budget=budget if budget is not None else (
            outs[0].decision.budget if outs else None),
        level=_get(clause, "level"), action=action or _get(clause, "action"),
        note="; ".join(notes), slices=results)


# --------------------------------------------------------------------------------------------
# Running the kernels
# --------------------------------------------------------------------------------------------


def _output_name(graph: Any, output: str | None) -> str:
    if output is not None:
        return output
    return graph.outputs[0].name


def run_both_kernels(graph: Any, train_spec: Any, inf_spec: Any, feeds: Mapping[str, Any],
                     device: str = "cpu", output: str | None = None, base_dir: Any = None,
                     batch_size: int | None = None, **choices: Any) -> tuple[np.ndarray, np.ndarray]:
    """Both kernels' ``output`` (default: the graph's first) on ``feeds``, float64 numpy arrays.

    The training kernel is a concrete realization of ``train_spec`` (it is a spec too, never
    assumed exact; with ``train_spec=None``, the exact executor in fp32); the inference kernel is
    a realization of ``inf_spec`` (or its second ONNX graph), with ``choices`` (seed, order,
    rounding ...). ``batch_size`` splits the inputs along axis 0.
    """
    from kcverify.kernels.realize import run_kernel  # lazily: torch-heavy

    name = _output_name(graph, output)
    n = int(next(iter(np.asarray(v).shape[0] for v in feeds.values())))
    step = batch_size or n or 1
    train_parts, inf_parts = [], []
    for start in range(0, n, step):
        part = {k: np.asarray(v)[start:start + step] for k, v in feeds.items()}
        if train_spec is None:
            import torch

            from kcverify.models.executor import Executor

            zt = Executor(graph, device=device, dtype=torch.float32).run(part)[name]
        else:
            zt = run_kernel(graph, train_spec, part, device=device, base_dir=base_dir)[name]
        zi = run_kernel(graph, inf_spec, part, device=device, base_dir=base_dir, **choices)[name]
        train_parts.append(zt.detach().cpu().double().numpy())
        inf_parts.append(zi.detach().cpu().double().numpy())
    return np.concatenate(train_parts), np.concatenate(inf_parts)


RUNTIME_BACKENDS = ("onnxruntime", "executor", "realization")


def kernel_callable(graph: Any, spec: Any, device: str = "cpu", backend: str = "onnxruntime",
                    base_dir: Any = None, **choices: Any) -> Any:
    """A function feeds -> outputs that runs the inference kernel for timing.

    ``onnxruntime`` (default on CPU): the model (or the spec's second, e.g. QDQ, ONNX graph) in an
    onnxruntime session, the closest executable stand-in for a serving kernel on this machine;
    ``executor``: kcverify's torch executor in fp32 on ``device`` (the default on CUDA);
    ``realization``: the bit-exact emulation of the spec (kcverify.kernels.realize), which
    rounds every operation in float64 and is orders of magnitude slower than a real kernel.
    """
    if backend not in RUNTIME_BACKENDS:
        raise ValueError(f"unknown runtime backend {backend!r}; expected one of {RUNTIME_BACKENDS}")
    if backend == "onnxruntime":
        import os

        import onnxruntime as ort

        if getattr(spec, "onnx", None):
            path = spec.onnx if base_dir is None else os.path.join(os.fspath(base_dir), spec.onnx)
            model_bytes = open(path, "rb").read()
        else:
            model_bytes = graph.to_onnx().SerializeToString()
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        sess = ort.InferenceSession(model_bytes, opts, providers=["CPUExecutionProvider"])
        names = [i.name for i in sess.get_inputs()]
        return lambda f: sess.run(None, {k: np.asarray(f[k]) for k in names})
    if backend == "executor":
        import torch

        from kcverify.models.executor import Executor

        ex = Executor(graph, device=device, dtype=torch.float32)

        def run_executor(f: Mapping[str, Any]) -> Any:
            out = ex.run(f)
            if str(device).startswith("cuda"):
                torch.cuda.synchronize(device)
            return out

        return run_executor
    from kcverify.kernels.realize import run_kernel

    return lambda f: run_kernel(graph, spec, f, device=device, base_dir=base_dir, **choices)


def measure_kernel_runtime(graph: Any, spec: Any, feeds: Mapping[str, Any], device: str = "cpu",
                           warmup: int = 2, repeats: int = 5, base_dir: Any = None,
                           per_input: bool = True, backend: str | None = None,
                           **choices: Any) -> RuntimeSample:
    """Latency and peak memory of the inference kernel: one call per input (batch 1) when
    ``per_input``, else one call on the whole batch; ``warmup`` untimed rounds first. ``backend``
    (see kernel_callable) defaults to onnxruntime on CPU and the executor on CUDA."""
    if backend is None:
        backend = "executor" if str(device).startswith("cuda") else "onnxruntime"
    arrays = {k: np.asarray(v) for k, v in feeds.items()}
    n = int(next(iter(a.shape[0] for a in arrays.values())))
    if per_input:
        args = [{k: a[i:i + 1] for k, a in arrays.items()} for i in range(n)]
    else:
        args = [arrays]
    call = kernel_callable(graph, spec, device, backend, base_dir, **choices)
    sample = measure_runtime(call, args, warmup=warmup, repeats=repeats, device=device)
    return replace(sample, backend=backend)


def slice_inputs(logits_train: np.ndarray, logits_inf: np.ndarray, labels: np.ndarray | None = None,
                 temperature: float = 1.0, runtime: RuntimeSample | None = None) -> MetricInputs:
    """MetricInputs for one slice from both kernels' logits, labels and a runtime sample."""
    return MetricInputs(
        logits_train=logits_train, logits_inf=logits_inf, labels=labels, temperature=temperature,
        latencies_ms=None if runtime is None else runtime.latencies_ms,
        peak_memory_mb=None if runtime is None else runtime.peak_memory_mb)
