"""A sample report exercising every verdict, slices and blocks (shared by the report tests)."""

from __future__ import annotations

from kcverify.empirical.escalation import escalate
from kcverify.report.model import BlockDrift, ClauseResult, Report, SliceResult


def sample_report() -> Report:
    blocks = [BlockDrift("embedding", 0.0021, 0.0019, "embedding"),
              BlockDrift("layer0", 0.052, 0.011, "layer"),
              BlockDrift("layer1", 0.31, 0.027, "layer"),
              BlockDrift("head", 0.83, 0.041, "head")]
    clauses = [
        ClauseResult("N-FP8-1", "numerical", "proved", "interval", value=0.83, bound=0.83,
                     threshold=1.0, slice="all", sample_size=8, level="L2", action="guard",
                     note="certified per input, 8 inputs", blocks=blocks),
        ClauseResult("N-FP8-2", "numerical", "refuted", "counterexample", value=2.7, bound=None,
                     threshold=2.0, slice="all", level="L3", action="fallback",
                     note="replayed counterexample at input 3, position 7"),
        ClauseResult("S-FP8-1", "statistical", "failed", "clopper-pearson", value=0.031,
                     rate_upper=0.21, threshold=0.02, metric="mean_kl", slice="all,safety",
                     sample_size=500, violations=63, confidence=0.95, budget=0.05, level="L2",
                     slices=[SliceResult("all", "failed", 400, 60, 0.15, 0.18, 0.124,
                                         0.05, 0.031),
                             SliceResult("safety", "unknown", 100, 3, 0.03, 0.0757, 0.0081, 0.05,
                                         0.012)]),
        ClauseResult("S-FP8-2", "statistical", "passed", "clopper-pearson", value=0.997,
                     rate_upper=0.0075, threshold=0.99, direction=">=", metric="top1_overlap",
                     slice="all", sample_size=400, violations=0, confidence=0.95, budget=0.01,
                     level="L1",
                     slices=[SliceResult("all", "passed", 400, 0, 0.0, 0.0075, 0.0,
                                         0.01, 0.997)]),
        ClauseResult("R-FP8-1", "runtime", "passed", "clopper-pearson", value=31.5,
                     rate_upper=0.0148, threshold=50.0, metric="p95_latency_ms", slice="all",
                     sample_size=200, violations=0, confidence=0.95, budget=0.05, level="L1",
                     action="log"),
        ClauseResult("S-FP8-3", "statistical", "unknown", "bootstrap", value=0.012, threshold=0.01,
                     metric="ece_gap", slice="all", sample_size=400, confidence=0.95, level="L3",
                     note="inconclusive at this sample size"),
    ]
    return escalate(Report("examples/contracts/fp8-deploy.yaml", "models/tiny_decoder.onnx",
                           clauses, escalation={"L1": "log", "L2": "guard", "L3": "fallback"}))
