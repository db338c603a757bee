"""The fallback for ops without a bound rule: bound them through their ONNX function body (the
decomposition the ONNX schema defines, e.g. Softplus = Log(Exp(x) + 1), HardSwish, Selu, Mish),
as onnx's reference evaluator runs an op it does not implement (STYLE.md).

``expand(graph, has_rule)`` replaces every node that has no rule but whose schema (at the graph's
opset) has a plain function body by the body's nodes: tensors renamed under the node's name,
attribute references substituted by the node's attributes or the schema's defaults. Nested
function ops are expanded in turn (depth-limited). The expanded graph computes the same function;
its rules then bound each primitive, so the result is sound for programs that evaluate the
decomposition (and, each primitive carrying its own error, for a fused kernel whose error is no
larger than the decomposition's).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import replace
from typing import Any

import onnx
from onnx import defs

from kcverify.models.ir import Graph, Namer, Node, _attr_value

MAX_DEPTH = 4


def _body(op: str, domain: str, opset: int) -> onnx.FunctionProto | None:
    try:
        schema = defs.get_schema(op, opset, domain or "")
    except Exception:  # noqa: BLE001 - onnx raises its own SchemaError
        return None
    if not schema.has_function:
        return None
    return schema.function_body


def _defaults(op: str, domain: str, opset: int) -> dict[str, Any]:
    schema = defs.get_schema(op, opset, domain or "")
    out = {}
    for name, a in schema.attributes.items():
        if a.default_value is not None and a.default_value.type != 0:
            out[name] = _attr_value(a.default_value)
    return out


def _instantiate(node: Node, fn: onnx.FunctionProto, opset: int, namer: Namer) -> list[Node]:
    attrs = {**_defaults(node.op_type, node.domain, opset), **node.attrs}
    rename: dict[str, str] = {"": ""}
    for formal, actual in zip(fn.input, node.inputs):
        rename[formal] = actual
    for formal in fn.input[len(node.inputs):]:
        rename[formal] = ""
    for formal, actual in zip(fn.output, node.outputs):
        rename[formal] = actual
    prefix = f"{node.name}/"
    nodes = []
    for k, n in enumerate(fn.node):
        new_attrs: dict[str, Any] = {}
        for a in n.attribute:
            if a.ref_attr_name:
                if a.ref_attr_name not in attrs:
                    continue  # an optional attribute the node does not set
                v = attrs[a.ref_attr_name]
                new_attrs[a.name] = v
            else:
                new_attrs[a.name] = _attr_value(a)
        # the body's own tensors and nodes under the node's name, fresh against every name the
        # graph (and earlier expansions) use: a model tensor named "sp/exp_x" must not be
        # overwritten by Softplus sp's body (F3 of session 9)
        for t in (*n.input, *n.output):
            if t not in rename:
                rename[t] = namer.fresh(prefix + t)
        ins = tuple(rename[i] for i in n.input)
        outs = tuple(rename[o] for o in n.output)
        nodes.append(Node(namer.fresh(f"{prefix}{k}_{n.op_type}"), n.op_type, ins, outs, new_attrs,
                          n.domain or ""))
    return nodes


def expand(graph: Graph, has_rule: Callable[[Node], bool]) -> Graph:
    """The graph with every rule-less node that has an ONNX function body expanded."""
    nodes: list[Node] = []
    changed = False
    namer = Namer(graph.names())
    for node in graph.nodes:
        n = _cast_like_as_cast(graph, node)
        # a function body's CastLike (Softplus, HardSigmoid) too, where its like is declared
        nodes.extend(_cast_like_as_cast(graph, m)
                     for m in _expand_node(n, graph.opset, has_rule, 0, namer))
        changed = changed or nodes[-1] is not node  # rewritten or expanded
    if not changed:
        return graph
    return replace(graph, nodes=nodes)


# ONNX element types of the float dtypes a graph declares (numpy / ml_dtypes names)
_FLOAT_TYPES = {"float16": 10, "float32": 1, "float64": 11, "bfloat16": 16}


def _cast_like_as_cast(graph: Graph, n: Node) -> Node:
    """CastLike(x, like) where like's element type is declared (an input, output, value_info
    or initializer): the Cast to that type, which its ONNX definition is. Other nodes as they
    are (a CastLike of undeclared type is left to its rule, which refuses a computed like)."""
    if n.op_type != "CastLike" or n.domain not in ("", "ai.onnx") or len(n.inputs) < 2:
        return n
    to = _FLOAT_TYPES.get(graph.info(n.inputs[1]).dtype or "")
    if to is None:
        return n
    return Node(n.name, "Cast", n.inputs[:1], n.outputs, {**n.attrs, "to": to}, n.domain)


def _expand_node(n: Node, opset: int, has_rule: Callable[[Node], bool], depth: int,
                 namer: Namer) -> list[Node]:
    if has_rule(n) or depth >= MAX_DEPTH:
        return [n]
    fn = _body(n.op_type, n.domain, opset)
    if fn is None:
        return [n]
    body = _instantiate(n, fn, opset, namer)
    out: list[Node] = []
    for m in body:
        out.extend(_expand_node(m, opset, has_rule, depth + 1, namer))
    return out



# --- per-graph memo ------------------------------------------------------------------------
# Expansion and the rule check are per graph object: a block's graph is checked, then expanded,
# then run. The memo is keyed by the graph's identity (a weak reference: a dead graph never
# matches) and holds its node list; an entry is valid only while the graph has exactly those
# node objects, opset and initializer names. (A content digest would cost more than the
# expansion: sha256 over the weights.)
MEMO_SIZE = 64
_MEMO: OrderedDict[tuple, tuple] = OrderedDict()


def memo(graph: Graph, tag: Hashable, compute: Callable[[], Any]) -> Any:
    """``compute()`` for (graph, tag), remembered while the graph is unchanged."""
    key = (id(graph), tag)
    nodes = graph.nodes
    hit = _MEMO.get(key)
    if (hit is not None and hit[0]() is graph and hit[2] == graph.opset
            and len(hit[1]) == len(nodes) and all(a is b for a, b in zip(hit[1], nodes))
            and hit[3] == tuple(graph.initializers)):
        _MEMO.move_to_end(key)
        return hit[4]
    value = compute()
    _MEMO[key] = (weakref.ref(graph), tuple(nodes), graph.opset, tuple(graph.initializers), value)
    while len(_MEMO) > MEMO_SIZE:
        _MEMO.popitem(last=False)
    return value
