"""A JSON-able summary of a contract: what `kcverify lint --json` prints."""

from __future__ import annotations

import dataclasses
from typing import Any

from kcverify.dsl.analysis import numerical_queries
from kcverify.dsl.ast import to_text
from kcverify.dsl.model import Clause, Contract


def describe_clause(c: Clause) -> dict[str, Any]:
    queries = numerical_queries(c)
    return {
        "id": c.id, "family": c.family, "class": c.klass, "level": c.level, "action": c.action,
        "hard": c.hard, "budget": c.budget, "metric": c.metric, "threshold": c.threshold,
        "slices": list(c.slices), "temperature": c.temperature, "form": c.form,
        "condition": to_text(c.expr), "line": c.line,
        "queries": [dataclasses.asdict(q) for q in queries] if queries else [],
    }


def describe(contract: Contract) -> dict[str, Any]:
    """Everything lint validated, in normal form (sorted, stable keys)."""
    return {
        "contract": contract.name, "version": contract.version, "path": str(contract.path),
        "sha256": contract.sha256,
        "model": {"onnx": contract.model.onnx, "sha256": contract.model.sha256},
        "kernels": {k: spec.canonical() for k, spec in contract.kernels.items()},
        "slices": {
            name: {"inputs": s.inputs, "where": to_text(s.where) if s.where else None,
                   "region": dataclasses.asdict(s.region) if s.region else None}
            for name, s in contract.slices.items()
        },
        "temperature": contract.temperature,
        "escalation": dict(contract.escalation),
        "clauses": [describe_clause(c) for c in contract.clauses],
    }
