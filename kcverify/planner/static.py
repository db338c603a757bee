"""Static (observability) clauses: conditions over the model artifact alone (semantics §1.2).

Facts available to a static clause: ``has_metadata("key")`` (the ONNX metadata_props, plus
``producer_name`` / ``producer_version`` / ``domain`` / ``model_version`` / ``doc_string`` when
set) and ``opset()`` (the default-domain opset).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from kcverify.dsl.ast import BinOp, BoolOp, Call, Compare, Expr, Neg, Not, Num, Str
from kcverify.errors import KcverifyError


@dataclass(frozen=True)
class ModelFacts:
    metadata: dict[str, str]
    opset: int


def model_facts(model_path: str | os.PathLike[str]) -> ModelFacts:
    import onnx

    m = onnx.load(os.fspath(model_path), load_external_data=False)
    meta = {p.key: p.value for p in m.metadata_props}
    for key in ("producer_name", "producer_version", "domain", "doc_string"):
        if getattr(m, key):
            meta[key] = str(getattr(m, key))
    if m.model_version:
        meta["model_version"] = str(m.model_version)
    opset = next((o.version for o in m.opset_import if o.domain in ("", "ai.onnx")), 0)
    return ModelFacts(meta, int(opset))


def evaluate_static(e: Expr, facts: ModelFacts) -> Any:
    """The value of a static expression; raises KcverifyError naming what it cannot evaluate."""
    if isinstance(e, Num | Str):
        return e.value
    if isinstance(e, Neg):
        return -evaluate_static(e.operand, facts)
    if isinstance(e, Not):
        return not evaluate_static(e.operand, facts)
    if isinstance(e, Call) and e.func == "has_metadata":
        return str(evaluate_static(e.args[0], facts)) in facts.metadata
    if isinstance(e, Call) and e.func == "opset":
        return facts.opset
    if isinstance(e, BinOp):
        a, b = evaluate_static(e.left, facts), evaluate_static(e.right, facts)
        return {"+": a + b, "-": a - b, "*": a * b}.get(e.op, a / b if b else float("inf"))
    if isinstance(e, Compare):
        a, b = evaluate_static(e.left, facts), evaluate_static(e.right, facts)
        return {"<=": a <= b, "<": a < b, ">=": a >= b, ">": a > b, "==": a == b, "!=": a != b}[e.op]
    if isinstance(e, BoolOp):
        a = bool(evaluate_static(e.left, facts))
        if e.op == "and":
            return a and bool(evaluate_static(e.right, facts))
        if e.op == "or":
            return a or bool(evaluate_static(e.right, facts))
        return (not a) or bool(evaluate_static(e.right, facts))
    raise KcverifyError(f"static clause: cannot evaluate {type(e).__name__} on the model artifact")
