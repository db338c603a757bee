"""Print a Contract back to YAML in normal form: ``parse_contract(contract_to_yaml(c))`` equals
``c`` up to its path and digest. Expressions print through kcverify.dsl.ast.to_text; short-form
clauses stay short (metric, slices, threshold), explicit ones print their condition.
"""

from __future__ import annotations

from typing import Any

import yaml

from kcverify.dsl.ast import to_text
from kcverify.dsl.model import Clause, Contract
from kcverify.kernels.spec import CastSpec, KernelSpec


def _cast(c: CastSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"format": c.format.name, "scale": c.scale}
    if c.block_size is not None:
        out["block_size"] = list(c.block_size) if isinstance(c.block_size, tuple) else c.block_size
    if c.value is not None:
        out["value"] = c.value
    if c.saturate is not None:
        out["saturate"] = c.saturate
    if c.ftz:
        out["ftz"] = True
    return out


def _kernel(k: KernelSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"compute": k.compute.name, "accumulate": k.accumulate.name}
    if not k.accumulation.is_default:  # the family, in the form parse_kernel_spec reads
        fam = k.accumulation
        acc: dict[str, Any] = {"format": k.accumulate.name}
        if fam.mma is not None:
            acc["mma"] = fam.mma
            if fam.promote is not None:
                acc["promote"] = fam.promote
        else:
            acc["order"] = {"tile_k": fam.tile_k} if fam.order == "tile_k" else fam.order
        if fam.split_k != (1,):
            acc["split_k"] = list(fam.split_k)
        out["accumulate"] = acc
    if k.weights is not None:
        out["weights"] = _cast(k.weights)
    if k.activations is not None:
        out["activations"] = _cast(k.activations)
    out["rounding"] = k.rounding
    out["moments"] = k.moments  # LayerNorm's moments family (sums, welford or any)
    out["ulps"] = {p: float(v) for p, v in k.ulps.items()}
    if k.onnx is not None:
        out["onnx"] = k.onnx
    return out


def _clause(c: Clause, temperature: float) -> dict[str, Any]:
    out: dict[str, Any] = {"id": c.id, "family": c.family}
    if c.description is not None:
        out["description"] = c.description
    if c.form == "metric":
        out["metric"] = c.metric
        out["slices"] = list(c.slices)
        out["threshold"] = c.threshold
    else:
        out["assert"] = to_text(c.expr)
    if c.budget is not None:
        out["budget"] = c.budget
    out["hard"] = c.hard
    out["level"] = c.level
    out["action"] = c.action
    if c.temperature != temperature:
        out["temperature"] = c.temperature
    return out


def contract_to_data(c: Contract) -> dict[str, Any]:
    """The contract as plain YAML-able data, in normal form."""
    out: dict[str, Any] = {"contract": c.name, "version": c.version}
    if c.description is not None:
        out["description"] = c.description
    out["model"] = {"sha256": c.model.sha256}
    if c.model.onnx is not None:
        out["model"]["onnx"] = c.model.onnx
    out["temperature"] = c.temperature
    out["kernels"] = {name: _kernel(k) for name, k in c.kernels.items()}
    slices: dict[str, Any] = {}
    for name, s in c.slices.items():
        entry: dict[str, Any] = {"inputs": s.inputs} if s.inputs or not s.traces else {}
        if s.traces is not None:
            entry["traces"] = s.traces
        if s.where is not None:
            entry["where"] = to_text(s.where)
        if s.region is not None:
            entry["region"] = {"space": s.region.space, "norm": s.region.norm,
                               "eps": s.region.eps}
        slices[name] = entry
    out["slices"] = slices
    out["clauses"] = [_clause(cl, c.temperature) for cl in c.clauses]
    out["escalation"] = dict(c.escalation)
    return out


def contract_to_yaml(c: Contract) -> str:
    """The contract as YAML text in normal form."""
    return yaml.safe_dump(contract_to_data(c), sort_keys=False, allow_unicode=True, width=100)
