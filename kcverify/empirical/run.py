"""One empirical session over a contract: both kernels run once per slice, shared by all clauses.

The planner's entry point into the empirical fallback:

    run = EmpiricalRun(contract, graph, device="cpu")
    result = run.decide(clause)                    # a statistical / runtime clause (short form)
    result = run.check_numerical(clause, queries)  # a certifiable clause the engines left unknown

Slices are loaded from the contract (paths relative to the contract file); each slice's outputs
of both kernels (one conforming program each, default choices) are computed once and cached; the
inference kernel's runtime is measured once per slice, with enough timed calls for the clause's
percentile to be decidable (kcverify.empirical.evaluate.min_sample_size), on onnxruntime by
default on CPU (see evaluate.kernel_callable for why not the emulation). ``max_inputs`` caps a
slice's size (the first inputs, in file order), for quick runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kcverify.empirical.attacks import Program, kernel_runner, search_programs, search_region
from kcverify.empirical.evaluate import (
    evaluate_clause,
    measure_kernel_runtime,
    min_sample_size,
    run_both_kernels,
    runtime_budget,
    slice_inputs,
)
from kcverify.empirical.metrics import MetricInputs, get_metric
from kcverify.empirical.runtime import RuntimeSample
from kcverify.empirical.slices import SliceData, load_slice
from kcverify.empirical.stats import DEFAULT_CONFIDENCE, clopper_pearson_upper
from kcverify.report.model import ClauseResult, SliceResult, Verdict

TOKEN_INPUTS = ("input_ids", "tokens", "ids")


class EmpiricalRun:
    """Cached slices, kernel outputs and runtime samples for one contract and model."""

    def __init__(self, contract: Any, graph: Any, device: str = "cpu", output: str | None = None,
                 batch_size: int | None = None, confidence: float = DEFAULT_CONFIDENCE,
                 max_inputs: int | None = None, warmup: int = 2, min_repeats: int = 3,
                 program: Program | None = None, budget_means: str = "exceedance",
                 runtime_backend: str | None = None) -> None:
        self.contract = contract
        self.graph = graph
        self.device = device
        self.output = output or graph.outputs[0].name
        self.batch_size = batch_size
        self.confidence = confidence
        self.max_inputs = max_inputs
        self.warmup = warmup
        self.min_repeats = min_repeats
        self.program = program or Program()
        self.budget_means = budget_means
        self.runtime_backend = runtime_backend
        self.base_dir = Path(contract.path).parent
        self._slices: dict[str, SliceData] = {}
        self._outputs: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._runtime: dict[str, RuntimeSample] = {}

    # -- cached data ------------------------------------------------------------------------
    def slice(self, name: str) -> SliceData:
        """The slice's data (filtered by its where, capped at max_inputs)."""
        if name not in self._slices:
            data = load_slice(self.contract.slices[name], base_dir=self.base_dir)
            if self.max_inputs is not None and data.n > self.max_inputs:
                data = data.select(np.arange(self.max_inputs))
            self._slices[name] = data
        return self._slices[name]

    def feeds(self, name: str) -> dict[str, np.ndarray]:
        return self.slice(name).feeds([v.name for v in self.graph.inputs],
                                      {v.name: v.shape for v in self.graph.inputs})

    def tokens(self, name: str) -> np.ndarray | None:
        """The observed tokens of a slice (for next-token quantities), if it has token ids."""
        data = self.slice(name)
        for key in TOKEN_INPUTS:
            if key in data.inputs and np.issubdtype(data.inputs[key].dtype, np.integer):
                return data.inputs[key]
        return None

    def outputs(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """Both kernels' logits on the slice, float64, computed once."""
        if name not in self._outputs:
            kernels = self.contract.kernels
            self._outputs[name] = run_both_kernels(
                self.graph, kernels["train"], kernels["inf"], self.feeds(name), device=self.device,
                output=self.output, base_dir=self.base_dir, batch_size=self.batch_size,
                **self.program.choices())
        return self._outputs[name]

    def runtime(self, name: str, calls: int = 0) -> RuntimeSample:
        """The inference kernel timed per input on the slice, at least ``calls`` timed calls."""
        have = self._runtime.get(name)
        if have is None or have.n < calls:
            n = max(self.slice(name).n, 1)
            repeats = max(self.min_repeats, -(-calls // n))
            self._runtime[name] = measure_kernel_runtime(
                self.graph, self.contract.kernels["inf"], self.feeds(name), device=self.device,
                warmup=self.warmup, repeats=repeats, base_dir=self.base_dir,
                backend=self.runtime_backend, **self.program.choices())
        return self._runtime[name]

    def metric_inputs(self, name: str, metric: str, temperature: float = 1.0,
                      budget: float | None = None) -> MetricInputs:
        """What ``metric`` needs on slice ``name``: outputs, labels and / or a runtime sample."""
        m = get_metric(metric)
        if m.family == "runtime":
            b = runtime_budget(m, budget)
            rt = self.runtime(name, 1 if b is None else min_sample_size(b, self.confidence))
            return MetricInputs(latencies_ms=rt.latencies_ms, peak_memory_mb=rt.peak_memory_mb)
        zt, zi = self.outputs(name)
        return slice_inputs(zt, zi, labels=self.slice(name).labels, temperature=temperature)

    # -- decisions ----------------------------------------------------------------------------
    def decide(self, clause: Any) -> ClauseResult:
        """Decide a clause with a ``metric`` (statistical or runtime) on each of its slices."""
        metric = clause.metric
        names = list(clause.slices or self.contract.slices.keys())
        temp = float(getattr(clause, "temperature", 1.0) or 1.0)
        inputs = {n: self.metric_inputs(n, metric, temp, clause.budget) for n in names}
        return evaluate_clause(clause, inputs, confidence=self.confidence,
                               budget_means=self.budget_means)

    def check_numerical(self, clause: Any, queries: Sequence[Any], pairs: int = 4,
                        region_steps: int = 8) -> ClauseResult:
        """Evidence for a certifiable clause: program search on each query's slice (and a region
        search when the slice has a region and a single float input; a region in an internal
        space, e.g. embeddings of token inputs, is not searched). A replayed violation refutes
        the clause; none found gives passed (evidence for the programs tried, no
        proof)."""
        run = kernel_runner(self.graph, self.output, self.device, self.base_dir)
        kernels = self.contract.kernels
        results: list[SliceResult] = []
        counterexample = None
        worst_value = None
        methods: set[str] = set()
        for q in queries:
            feeds = self.feeds(q.slice)
            tokens = self.tokens(q.slice)
            found = search_programs(q, kernels["train"], kernels["inf"], feeds, run, tokens, pairs)
            methods.add("program-search")
            region = getattr(self.contract.slices[q.slice], "region", None)
            float_inputs = [k for k, v in feeds.items() if np.issubdtype(v.dtype, np.floating)]
            if region is not None and found.counterexample is None and len(float_inputs) == 1 \
                    and q.aggregate == "max":
                found_r = search_region(q, kernels["train"], kernels["inf"], feeds, float_inputs[0],
                                        float(region.eps), run, norm=region.norm, tokens=tokens,
                                        steps=region_steps,
                                        program=(found.train_program, found.inf_program))
                methods.add("region-search")
                if found_r.worst.margin < found.worst.margin:
                    found = found_r
            cx = found.counterexample if found.counterexample and found.counterexample.replayed else None
            if cx is not None and counterexample is None:
                counterexample = cx
            n = found.worst.n
            verdict = Verdict.REFUTED if cx else Verdict.PASSED
            note = (f"replayed counterexample: input {cx.input_index}, position {cx.position}, value "
                    f"{cx.value:.6g}, programs train {cx.train_program.choices()} / inf "
                    f"{cx.inf_program.choices()}" if cx else
                    f"no violation in {found.tried} program pairs on {n} inputs (worst "
                    f"{found.worst.value:.6g}); evidence, not a proof")
            upper = None if cx or n == 0 else clopper_pearson_upper(0, n, self.confidence)
            results.append(SliceResult(q.slice, verdict, n, violations=1 if cx else 0,
                                       value=found.worst.value, upper=upper, note=note))
            v = found.worst.value
            if worst_value is None or (v > worst_value if q.op in ("<=", "<") else v < worst_value):
                worst_value = v
        violated = any(Verdict(r.verdict) is Verdict.REFUTED for r in results)
        evidence = {} if counterexample is None else {"counterexample": counterexample.to_json()}
        q0 = queries[0] if queries else None
        return ClauseResult(
            id=clause.id, family=clause.family,
            verdict=Verdict.REFUTED if violated else (Verdict.PASSED if results else Verdict.UNKNOWN),
            method="+".join(sorted(methods)) or "none", value=worst_value,
            threshold=None if q0 is None else float(q0.threshold),
            direction="<=" if q0 is None or q0.op in ("<=", "<") else ">=",
            slice=",".join(dict.fromkeys(q.slice for q in queries)),
            sample_size=sum(r.n for r in results), violations=sum(r.violations or 0 for r in results),
            confidence=None, level=clause.level, action=clause.action,
            note="; ".join(f"{r.slice}: {r.note}" for r in results), slices=results,
            evidence=evidence)

