"""The empirical fallback: clauses that are not certified are still decided, with stated confidence.

    metrics      @register_metric registry: logit drift, KL, top-k overlap, ratios, ECE, runtime
    slices       slices from .npz / .npy / .jsonl with ``where`` filters
    stats        exact one-sided Clopper-Pearson bounds; hard / soft decisions; bootstrap
    runtime      latency per call and peak memory (CPU and CUDA)
    evaluate     metric clauses on both kernels' outputs; running the kernels
    quantities   concrete values of the DSL's certifiable quantities
    attacks      counterexample search over programs and regions, replayed before reporting
    blocks       per-block certified and observed drift
    escalation   policy -> action, the health score H, the routing action
    run          EmpiricalRun: the planner's entry point (cached slices, outputs, runtime)

Importing this package does not import torch or onnxruntime; running kernels does.
"""

from __future__ import annotations

from kcverify.empirical.escalation import escalate, health_score, routing_action
from kcverify.empirical.evaluate import evaluate_clause, evaluate_metric, run_both_kernels
from kcverify.empirical.metrics import METRICS, MetricInputs, get_metric, register_metric
from kcverify.empirical.run import EmpiricalRun
from kcverify.empirical.slices import SliceData, load_slice
from kcverify.empirical.stats import clopper_pearson_lower, clopper_pearson_upper, decide_exceedance

__all__ = [
    "METRICS", "EmpiricalRun", "MetricInputs", "SliceData", "clopper_pearson_lower",
    "clopper_pearson_upper", "decide_exceedance", "escalate", "evaluate_clause", "evaluate_metric",
    "get_metric", "health_score", "load_slice", "register_metric", "routing_action",
    "run_both_kernels",
]
