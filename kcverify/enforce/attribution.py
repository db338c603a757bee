"""Per-source attribution of a flagged request's drift: which known source, under its certified
bound, could explain the drift the record shows?

The observed drift is the record's max |z_inf - z_train| over positions and vocabulary (or,
for a record with only sampled tokens, max |log q - log p| of those tokens, compared through
the chain |log q - log p| <= 2 delta / T, semantics §1.3). Each source's bound is a certified drift
bound (kcverify.bounds.certify_drift, sound for every conforming program) on the record's own
input between two kernel specs that differ only in that source:

    precision/quantisation  train  vs  train + the inference kernel's weight/activation casts
    operator approximation  train  vs  train with the inference kernel's compute format, ulps
                                       and rounding (the primitives' approximation error)
    batch-shape             inf    vs  inf: two programs of the inference spec, which differ in
                                       exactly what a batch shape changes (summation order,
                                       split-K, tiling)
    routing                 the request was served by a kernel other than the contract's
                            inference kernel (kernel.name, or a ``route`` field): train vs train
                            when routed to the training kernel, unbounded for any other kernel;
                            not applicable otherwise
    all (the contract)      train  vs  inf: every source together

A source *could explain* the drift when the observed drift is at most its bound. The record is
*explained* when the drift is within the whole contract's bound; a drift beyond it is outside
every conforming program's reach: a kernel fault or a build that does not conform to its spec.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kcverify.enforce.traces import TraceRecord

SOURCES = ("precision/quantisation", "operator approximation", "batch-shape", "routing")


@dataclass
class SourceBound:
    source: str
    bound: float | None
    explains: bool
    note: str = ""


@dataclass
class Attribution:
    """The observed drift, each source's bound, and whether the contract's bound covers it."""

    quantity: str
    observed: float
    contract_bound: float
    explained: bool
    sources: list[SourceBound] = field(default_factory=list)
    domain: str = "interval"

    @property
    def could_explain(self) -> list[str]:
        return [s.source for s in self.sources if s.explains]

    def verdict(self) -> str:
        if not self.explained:
            ratio = (self.observed / self.contract_bound if self.contract_bound > 0
                     else math.inf)
            return (f"unexplained: {self.quantity} {self.observed:.6g} exceeds the contract's "
                    f"certified bound {self.contract_bound:.6g} ({ratio:.3g}x); no conforming "
                    f"program reaches it (a kernel fault or a non-conforming build)")
        alone = ", ".join(self.could_explain) or "no single source (only their combination)"
        return (f"explained: {self.quantity} {self.observed:.6g} <= the contract's bound "
                f"{self.contract_bound:.6g}; alone could explain it: {alone}")

    def to_json(self) -> dict[str, Any]:
        def num(v: float | None) -> float | str | None:
            return v if v is None or math.isfinite(v) else str(v)

        return {"quantity": self.quantity, "observed": num(self.observed),
                "contract_bound": num(self.contract_bound), "explained": self.explained,
                "domain": self.domain, "verdict": self.verdict(),
                "sources": [{"source": s.source, "bound": num(s.bound), "explains": s.explains,
                             "note": s.note} for s in self.sources]}


def observed_drift(record: TraceRecord, temperature: float = 1.0) -> tuple[str, float, float]:
    """(quantity, observed value, factor): the bound on the quantity is factor * logit drift."""
    if record.has_logits:
        return ("max |z_inf - z_train|",
                float(np.max(np.abs(record.logits_inf - record.logits_train))), 1.0)
    diff = np.abs(np.asarray(record.logprob_inf) - np.asarray(record.logprob_train))
    return "max |log q - log p|", float(np.max(diff)) if diff.size else 0.0, 2.0 / temperature


def _bound(graph: Any, a: Any, b: Any, feeds: Any, domain: str) -> float:
    from kcverify.bounds import certify_drift

    res = certify_drift(graph, a, b, feeds, domain=domain)
    return float(np.max(res.linf))


def attribute_drift(record: TraceRecord, graph: Any, contract: Any, feeds: Any,
                    domain: str = "interval") -> Attribution:
    """The attribution of ``record``'s drift (module docstring)."""
    train, inf = contract.kernels["train"], contract.kernels["inf"]
    quantity, observed, factor = observed_drift(record, float(contract.temperature or 1.0))
    variants = {
        "precision/quantisation": (train, dataclasses.replace(
            train, name=f"{train.name}+casts", weights=inf.weights, activations=inf.activations,
            onnx=None)),
        "operator approximation": (train, dataclasses.replace(
            train, name=f"{train.name}+ops", compute=inf.compute, ulps=dict(inf.ulps),
            rounding=inf.rounding, weights=None, activations=None, onnx=None)),
        "batch-shape": (inf, inf),
    }
    sources = []
    for name, (a, b) in variants.items():
        if a.onnx is not None or b.onnx is not None:
            sources.append(SourceBound(name, None, False, "a spec with a second ONNX graph: not "
                                                          "decomposed"))
            continue
        bnd = factor * _bound(graph, a, b, feeds, domain)
        sources.append(SourceBound(name, bnd, observed <= bnd))
    route = record.extra.get("route", record.kernel_name)
    if route in ("inf", None):
        sources.append(SourceBound("routing", 0.0, observed <= 0.0,
                                   "served by the contract's inference kernel: no routing "
                                   "difference"))
    elif route == "train":
        bnd = factor * _bound(graph, train, train, feeds, domain)
        sources.append(SourceBound("routing", bnd, observed <= bnd,
                                   "routed to the training kernel"))
    else:
        sources.append(SourceBound("routing", math.inf, True,
                                   f"routed to kernel {route!r}, outside the contract: its "
                                   f"drift is not bounded"))
    total = factor * _bound(graph, train, inf, feeds, domain)
    return Attribution(quantity, observed, total, observed <= total, sources, domain)
