"""Human-readable proof trees: one line per rule application, indented by depth."""

from __future__ import annotations

from typing import Any

from kcverify.certs.encoding import unfx


def _num(v: Any) -> str:
    try:
        return f"{unfx(v):.6g}"
    except Exception:  # noqa: BLE001 - display only
        return str(v)


def _summary(node: dict[str, Any]) -> str:
    c = node.get("conclusion", {})
    rule = node.get("rule", "?")
    if c.get("kind") == "block":
        return f"block {c.get('ref')}"
    if c.get("kind") == "state":
        chain = " → ".join(str(p.get("conclusion", {}).get("ref")) for p in node.get("premises", []))
        return f"sequential over {c.get('slice', '?')}: {chain}"
    if c.get("holds") is True and "parts" in c:
        return f"all: {len(c['parts'])} conjuncts hold"
    if c.get("holds") is True:
        return (f"threshold: {c.get('quantity')} {_num(c['bound'][0])} {c.get('op')} "
                f"{_num(c.get('threshold'))}")
    bounds = c.get("bounds", [])
    vals = [unfx(b) for b in bounds] if bounds else []
    worst = (max(vals) if c.get("direction") == "upper" else min(vals)) if vals else None
    extra = f" {c['stat']}" if "stat" in c else ""
    where = f" of {c['tensor']}" if "tensor" in c else ""
    t = f" at T={_num(c['temperature'])}" if "temperature" in c else ""
    w = f", worst {worst:.6g}" if worst is not None else ""
    return f"{rule}: {c.get('quantity')}{extra}{where}{t} ({len(vals)} bounds{w})"


def describe_proof(node: dict[str, Any] | None, indent: str = "") -> list[str]:
    """The proof tree as lines: root first, premises indented below it."""
    if node is None:
        return [f"{indent}(no proof)"]
    lines = [f"{indent}{_summary(node)}"]
    if node.get("conclusion", {}).get("kind") == "state":
        return lines  # its premises (the blocks) are listed on the line itself
    for p in node.get("premises", []):
        lines += describe_proof(p, indent + "  ")
    return lines


def describe_certificate(statement: dict[str, Any]) -> list[str]:
    pred = statement["predicate"]
    lines = [f"contract {pred['contract']['name']}@{pred['contract']['version']}, "
             f"{len(pred['clauses'])} clauses, {len(pred['blocks'])} block certificates"]
    for c in pred["clauses"]:
        b = f" bound {_num(c['bound'])}" if c.get("bound") is not None else ""
        lines.append(f"{c['id']} ({'hard' if c['hard'] else 'soft'}): {c['verdict']}{b}")
        if c.get("proof") is not None:
            lines += describe_proof(c["proof"], "  ")
    return lines
