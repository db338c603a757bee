"""What the planner calls: SMT for a model (or block) under a size threshold.

    d = smt_decide_block(graph, train, inf, feeds, threshold, eps=0.0)
    d.verdict   # proved | refuted | unknown | skipped (too large, or outside the encoding)
    d.node      # proved: a ready ``smt-block`` proof node (linf_drift per sample <= threshold)

Use it for a graph with at most ``max_neurons`` Gemm/MatMul outputs and ``max_unstable``
unstable ReLUs (per sample, both kernels counted), or when the bound engine leaves a clause
unknown on such a graph. The node's conclusion is ``{"quantity": "linf_drift", "bounds": [tau per
sample]}``, so ``aggregate`` and ``threshold`` apply on top of it as on linf-from-state.
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import kcverify.certs.smt_rule  # noqa: F401 - registers the smt-block rule
from kcverify.certs.encoding import fx
from kcverify.kernels.spec import KernelSpec
from kcverify.models.ir import Graph
from kcverify.smt.decide import decide_problem
from kcverify.smt.encode import NotEncodable, prepare

MAX_NEURONS = 256
MAX_UNSTABLE = 64


@dataclass
class SmtBlockDecision:
    """The SMT verdict of "linf drift <= threshold" on every sample of a batch."""

    verdict: str
    threshold: float
    per_sample: list[str] = field(default_factory=list)
    node: dict[str, Any] | None = None  # the smt-block proof node (proved)
    evidence: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    seconds: float = 0.0
    method: str = "smt-z3"


def smt_block_params(graph: Graph, train: KernelSpec, inf: KernelSpec, xs: np.ndarray, eps: float,
                     claim: list[float], timeout_s: float = 60.0) -> dict[str, Any]:
    """The params of an ``smt-block`` application (kcverify.certs.smt_rule)."""
    onnx_bytes = graph.to_onnx().SerializeToString()
    return {"graph": base64.b64encode(onnx_bytes).decode(), "graph_digest": graph.digest(),
            "kernels": {"train": train.canonical(), "inf": inf.canonical()},
            "inputs": [[fx(float(v)) for v in np.asarray(x, dtype=np.float64).reshape(-1)] for x in xs],
            "eps": fx(eps), "tensor": graph.outputs[0].name,
            "claim": [fx(c) for c in claim], "timeout_s": float(timeout_s)}


def smt_decide_block(graph: Graph, train: KernelSpec, inf: KernelSpec, feeds: Any, threshold: float,
                     eps: float = 0.0, timeout_s: float = 30.0, max_neurons: int = MAX_NEURONS,
                     max_unstable: int = MAX_UNSTABLE, programs: int = 8) -> SmtBlockDecision:
    """Decide max_j |drift_j| <= threshold for every sample of ``feeds`` (region: L-inf ball of
    radius eps around each); ``timeout_s`` per sample. See the module doc."""
    t0 = time.perf_counter()
    if len(graph.inputs) != 1 or len(graph.outputs) != 1:
        return SmtBlockDecision("skipped", threshold, note="SMT takes one input and one output")
    name = graph.inputs[0].name
    xs = np.asarray(feeds[name] if isinstance(feeds, dict) else feeds, dtype=np.float64)
    if xs.ndim == 1:
        xs = xs[None]
    verdicts: list[str] = []
    evidence: dict[str, Any] = {"samples": []}
    for i in range(xs.shape[0]):
        try:
            p = prepare(graph, train, inf, xs[i:i + 1], eps)
        except NotEncodable as e:
            return SmtBlockDecision("skipped", threshold, note=str(e), seconds=time.perf_counter() - t0)
        if p.neurons() > max_neurons or p.unstable_relus() > max_unstable:
            return SmtBlockDecision("skipped", threshold, seconds=time.perf_counter() - t0,
                                    note=f"sample {i}: {p.neurons()} neurons, {p.unstable_relus()} "
                                         f"unstable ReLUs (limits {max_neurons}, {max_unstable})")
        v = decide_problem(p, threshold, timeout_s=timeout_s, programs=programs)
        verdicts.append(v.verdict)
        evidence["samples"].append({"verdict": v.verdict, "seconds": round(v.seconds, 3),
                                    **v.stats, **({"witness": v.witness} if v.witness else {})})
        if v.verdict == "refuted":
            evidence["counterexample"] = {"sample": i, **(v.witness or {})}
            return SmtBlockDecision("refuted", threshold, verdicts, None, evidence, v.note,
                                    time.perf_counter() - t0)
    dt = time.perf_counter() - t0
    if all(v == "proved" for v in verdicts):
        params = smt_block_params(graph, train, inf, xs, eps, [threshold] * xs.shape[0],
                                  timeout_s=max(60.0, 4 * timeout_s))
        node = {"rule": "smt-block", "premises": [], "params": params,
                "conclusion": {"quantity": "linf_drift", "direction": "upper",
                               "tensor": graph.outputs[0].name,
                               "bounds": [fx(threshold)] * xs.shape[0]}}
        return SmtBlockDecision("proved", threshold, verdicts, node, evidence, "", dt)
    return SmtBlockDecision("unknown", threshold, verdicts, None, evidence,
                            "z3 left a sample undecided", dt)
