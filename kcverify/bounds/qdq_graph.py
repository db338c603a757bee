"""The joint graph of a model G and its QDQ graph G' (an inference kernel given as a second ONNX
graph, docs/qdq.md): one graph the bound engine walks with both kernels.

    graph, train, inf = bound_problem(G, train_spec, inf_spec, base_dir)

G' must be G with QuantizeLinear -> DequantizeLinear pairs inserted on tensors and
DequantizeLinear(quantized constant) in place of float initializers (what onnxruntime's static
quantizer in QDQ format, kcverify.kernels.qdq.make_qdq_model and NVIDIA ModelOpt write). The
check: G' with its Q/DQ removed is G - every other node of G' has a counterpart in G with the same
op, attributes and inputs (a graph input of the same name, the counterpart of an earlier node's
output, an equal constant, or for a weight DQ a float initializer of G of the same shape), every
node of G has one, and the outputs correspond. Anything else is a ModelImportError naming the
first node of G' that does not match (bad input, exit 2).

The joint graph J is G (its node names, tensor names, outputs) with, for every Q/DQ chain that
G' applies to a tensor, nodes of domain ``JOINT_DOMAIN``:

* ``QuantizeLinear(x, scale, zero_point)`` -> ``DequantizeLinear(q, scale, zero_point)``: the
  training kernel (which has no such ops) evaluates the pair as the identity, the inference
  kernel executes it exactly as ONNX specifies (kcverify.bounds.rules.qdq);
* ``DequantizeLinear(q, scale, zero_point, w)`` for a weight: w is G's float initializer (the
  training kernel's weight), q, scale, zero_point are G's constants (the inference kernel's).

Every constant of a joint node is stored as float64 (exact: integer, float8, float16 and
float32 values), its ONNX element type in the attribute ``qtype`` (the quantized type) and
``stype`` (the scale's float type); the attributes are written out with ONNX's defaults. Only
constant scales and zero points (initializers) are accepted; DynamicQuantizeLinear and the
operator-oriented format (QLinearMatMul, MatMulInteger, ...) are refused.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from onnx import TensorProto

from kcverify.errors import KernelSpecError, ModelImportError
from kcverify.kernels.spec import KernelSpec
from kcverify.models.ir import Graph, Namer, Node, ValueInfo

JOINT_DOMAIN = "kcverify.qdq"
Q_OPS = ("QuantizeLinear", "DequantizeLinear")
_REFUSED = {
    "DynamicQuantizeLinear": "dynamic QDQ (scales computed from the data) is not supported; "
                             "constant scales only",
    "QLinearMatMul": "the operator-oriented format (QOperator) is not supported; write QDQ",
    "QLinearConv": "the operator-oriented format (QOperator) is not supported; write QDQ",
    "MatMulInteger": "integer matmuls are not supported; write QDQ",
    "ConvInteger": "integer convolutions are not supported; write QDQ",
    "QGemm": "the operator-oriented format (QOperator) is not supported; write QDQ",
}
# ONNX element types a Q/DQ may quantize to (by TensorProto id), and their names
QTYPES = {TensorProto.INT8: "int8", TensorProto.UINT8: "uint8", TensorProto.INT16: "int16",
          TensorProto.UINT16: "uint16", TensorProto.INT32: "int32", TensorProto.INT4: "int4",
          TensorProto.UINT4: "uint4", TensorProto.FLOAT8E4M3FN: "float8_e4m3fn",
          TensorProto.FLOAT8E5M2: "float8_e5m2"}
_NP_QTYPE = {"int8": TensorProto.INT8, "uint8": TensorProto.UINT8, "int16": TensorProto.INT16,
             "uint16": TensorProto.UINT16, "int32": TensorProto.INT32, "int4": TensorProto.INT4,
             "uint4": TensorProto.UINT4, "float8_e4m3fn": TensorProto.FLOAT8E4M3FN,
             "float8_e5m2": TensorProto.FLOAT8E5M2}
_NP_STYPE = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16,
             "bfloat16": TensorProto.BFLOAT16, "float64": TensorProto.DOUBLE}


def bound_problem(graph: Graph, train: KernelSpec, inf: KernelSpec,
                  base_dir: str | os.PathLike[str] | None = None
                  ) -> tuple[Graph, KernelSpec, KernelSpec]:
    """The graph and kernel specs the bound engine walks for a contract's two kernels: the model
    and the specs themselves, or - when ``inf.onnx`` names a QDQ graph (relative to
    ``base_dir``, the contract's folder) - the joint graph and the inference spec without its
    graph (its casts are the graph's). A training kernel given as a graph is refused."""
    from kcverify.kernels.realize import explicit_cast_spec
    from kcverify.models.ir import load_onnx

    if train.onnx is not None:
        raise KernelSpecError(f"kernel {train.name!r}: a training kernel given as a second ONNX "
                              f"graph ({train.onnx}) is not supported; give its spec")
    if inf.onnx is None:
        return graph, train, inf
    roles = [r for r in ("weights", "activations") if getattr(inf, r) is not None]
    if roles:
        raise KernelSpecError(f"kernel {inf.name!r}: 'onnx: {inf.onnx}' gives the casts as the "
                              f"graph's QuantizeLinear / DequantizeLinear nodes; it must not also "
                              f"declare {' and '.join(roles)} casts (they would be applied twice)")
    path = inf.onnx if base_dir is None else os.path.join(os.fspath(base_dir), inf.onnx)
    return joint_graph(graph, load_onnx(path)), train, explicit_cast_spec(inf)


@dataclass(frozen=True)
class _Cast:
    """One Q -> DQ pair of G' (its nodes), applied to a tensor."""

    q: Node
    dq: Node


@dataclass(frozen=True)
class _Ref:
    """What a tensor of G' is in terms of G: ``kind`` "tensor" (G's tensor ``name``), "const"
    (G''s initializer ``name``, to be matched by value) or "weight" (a weight DQ node ``dq``),
    with the chain of Q -> DQ pairs applied to it."""

    kind: str
    name: str
    chain: tuple[_Cast, ...] = ()
    dq: Node | None = None


class _Mismatch(Exception):
    pass


def joint_graph(model: Graph, qdq: Graph) -> Graph:
    """The joint graph of ``model`` (G) and ``qdq`` (G'); see the module doc."""
    return _Joiner(model, qdq).build()


class _Joiner:
    def __init__(self, g: Graph, gq: Graph) -> None:
        self.g, self.gq = g, gq
        self.where = f"QDQ graph {gq.name}"
        self.producer = gq.producers()
        self.consumers = gq.consumers()
        self.g_inputs = {v.name for v in g.inputs}
        self.g_const = g.constant_names()
        self.matched: dict[str, Node] = {}  # G' node name -> G node
        self.taken: set[str] = set()  # G node names matched
        self.out_map: dict[str, str] = {}  # G' tensor -> G tensor (outputs of matched nodes)
        self.refs: dict[str, _Ref] = {}

    def fail(self, node: Node | None, msg: str) -> ModelImportError:
        at = f" node {node.name!r} ({node.op_type})" if node is not None else ""
        return ModelImportError(f"{self.where}:{at}: {msg}")

    # --- what a tensor of G' is -----------------------------------------------------------
    def ref(self, name: str, user: Node) -> _Ref:
        if name in self.refs:
            return self.refs[name]
        r = self._ref(name, user)
        self.refs[name] = r
        return r

    def _ref(self, name: str, user: Node) -> _Ref:
        gq = self.gq
        if name in gq.initializers:
            return _Ref("const", name)
        if name in {v.name for v in gq.inputs}:
            if name not in self.g_inputs:
                raise self.fail(user, f"reads graph input {name!r}, which the model does not have "
                                      f"(model inputs: {', '.join(sorted(self.g_inputs))})")
            return _Ref("tensor", name)
        p = self.producer.get(name)
        if p is None:
            raise self.fail(user, f"reads {name!r}, which nothing produces")
        if p.op_type in _REFUSED:
            raise self.fail(p, _REFUSED[p.op_type])
        if p.op_type == "DequantizeLinear" and p.domain in ("", "ai.onnx"):
            src = p.inputs[0]
            self._constant_params(p)
            sp = self.producer.get(src)
            if src in gq.initializers:
                return _Ref("weight", name, dq=p)
            if sp is not None and sp.op_type == "QuantizeLinear" and sp.domain in ("", "ai.onnx"):
                self._constant_params(sp)
                for c in self.consumers.get(src, []):
                    if c.op_type != "DequantizeLinear":
                        raise self.fail(sp, f"its output {src!r} also feeds {c.op_type} node "
                                            f"{c.name!r}: only QuantizeLinear -> DequantizeLinear "
                                            "pairs are understood (QDQ format)")
                base = self.ref(sp.inputs[0], sp)
                if base.kind == "weight":
                    raise self.fail(sp, "re-quantizes a dequantized weight; not supported")
                return replace(base, chain=(*base.chain, _Cast(sp, p)))
            raise self.fail(p, f"dequantizes {src!r}, which is neither a constant nor the output "
                               "of a QuantizeLinear")
        if p.op_type == "QuantizeLinear" and p.domain in ("", "ai.onnx"):
            raise self.fail(user, f"reads the quantized tensor {name!r} of {p.name!r}: only "
                                  "QuantizeLinear -> DequantizeLinear pairs are understood")
        if p.name not in self.matched:
            raise self.fail(user, f"reads {name!r} before its producer {p.name!r} was matched")
        return _Ref("tensor", self.out_map[name])

    def _constant_params(self, n: Node) -> None:
        for k, i in enumerate(n.inputs[1:3], start=1):
            if i and i not in self.gq.initializers:
                what = "scale" if k == 1 else "zero point"
                raise self.fail(n, f"its {what} {i!r} is not a constant initializer: only constant "
                                   "scales are supported (dynamic QDQ is not)")
        if n.domain not in ("", "ai.onnx"):
            raise self.fail(n, f"domain {n.domain!r}: only ONNX's own QuantizeLinear / "
                               "DequantizeLinear are understood")

    # --- matching the other nodes -----------------------------------------------------------
    def match(self, m: Node) -> Node:
        refs = [self.ref(i, m) if i else None for i in m.inputs]
        first_why = None
        for n in self.g.nodes:
            if n.name in self.taken or n.op_type != m.op_type:
                continue
            try:
                self._compare(m, refs, n)
            except _Mismatch as e:
                if first_why is None or n.name == m.name:
                    first_why = f"closest model node {n.name!r}: {e}"
                continue
            return n
        raise self.fail(m, "has no counterpart in the model: G' with its Q/DQ removed must be "
                           f"the model ({first_why or f'the model has no unmatched {m.op_type}'})")

    def _compare(self, m: Node, refs: list[_Ref | None], n: Node) -> None:
        if (m.domain or "") != (n.domain or ""):
            raise _Mismatch(f"domain {n.domain!r} vs {m.domain!r}")
        if _canon(m.attrs) != _canon(n.attrs):
            raise _Mismatch("different attributes")
        if len(m.inputs) != len(n.inputs) or len(m.outputs) != len(n.outputs):
            raise _Mismatch("a different number of inputs or outputs")
        for k, (r, gi) in enumerate(zip(refs, n.inputs)):
            if r is None:
                if gi:
                    raise _Mismatch(f"input {k} is omitted in G', {gi!r} in the model")
                continue
            if r.kind == "tensor":
                if r.name != gi:
                    raise _Mismatch(f"input {k} is {r.name!r} in G' (after its Q/DQ), {gi!r} in "
                                    "the model")
            elif r.kind == "const":
                if gi not in self.g.initializers or not _same(self.g.initializers[gi],
                                                              self.gq.initializers[r.name]):
                    raise _Mismatch(f"input {k}: constant {r.name!r} of G' differs from the "
                                    f"model's {gi!r}")
            else:  # a weight DQ: in place of a float initializer of the same shape
                w = self.g.initializers.get(gi)
                q = self.gq.initializers[r.dq.inputs[0]]  # type: ignore[union-attr]
                if w is None or np.asarray(w).dtype.kind != "f":
                    raise _Mismatch(f"input {k}: G' dequantizes a weight where the model reads "
                                    f"{gi!r}, not a float initializer")
                if tuple(np.shape(w)) != tuple(np.shape(q)):
                    raise _Mismatch(f"input {k}: weight {gi!r} has shape {np.shape(w)}, its "
                                    f"quantized form {r.dq.inputs[0]!r} {np.shape(q)}")  # type: ignore[union-attr]

    # --- the joint graph -------------------------------------------------------------------
    def build(self) -> Graph:
        g, gq = self.g, self.gq
        for m in gq.nodes:
            if m.op_type in _REFUSED:
                raise self.fail(m, _REFUSED[m.op_type])
            if m.op_type in Q_OPS and m.domain in ("", "ai.onnx"):
                continue
            n = self.match(m)
            self.matched[m.name] = n
            self.taken.add(n.name)
            for a, b in zip(m.outputs, n.outputs):
                if a:
                    self.out_map[a] = b
        missing = [n for n in g.nodes if n.name not in self.taken]
        if missing:
            n = missing[0]
            raise ModelImportError(f"{self.where}: model node {n.name!r} ({n.op_type}) has no "
                                   "counterpart in G' (G' with its Q/DQ removed must be the model)")
        if len(gq.outputs) != len(g.outputs):
            raise ModelImportError(f"{self.where}: {len(gq.outputs)} outputs, the model has "
                                   f"{len(g.outputs)}")
        out_chains: dict[str, tuple[_Cast, ...]] = {}
        for k, (vo, wo) in enumerate(zip(gq.outputs, g.outputs)):
            r = self.ref(vo.name, Node(f"output {k}", "output", (), ()))
            if r.kind != "tensor" or r.name != wo.name:
                raise ModelImportError(f"{self.where}: output {k} ({vo.name!r}) is not the "
                                       f"model's output {wo.name!r} (after its Q/DQ)")
            if r.chain:
                out_chains[wo.name] = r.chain
        return self._assemble(out_chains)

    def _assemble(self, out_chains: dict[str, tuple[_Cast, ...]]) -> Graph:
        g = self.g
        inits: dict[str, np.ndarray] = dict(g.initializers)
        value_info = dict(g.value_info)
        made: dict[tuple[str, tuple[str, ...]], str] = {}  # (tensor, chain's DQ names) -> J name
        weights: dict[tuple[str, str], str] = {}  # (G initializer, DQ name) -> J name
        pre: list[Node] = []  # weight DQs (constants) first
        after: dict[str, list[Node]] = {}  # G tensor -> joint nodes right after it is produced
        # every name J adds is fresh against G's (a model tensor named like a generated one,
        # "x::qdq0.0", would be overwritten by the joint node or overwrite it: F4 of session 9)
        namer = Namer(g.names())
        renamed_out = {name: namer.fresh(f"{name}::pre_qdq") for name in out_chains}
        consts: dict[str, str] = {}

        def const(src: str) -> str:
            """G''s constant ``src`` as a float64 initializer of J (exact)."""
            if src not in consts:
                jn = consts[src] = namer.fresh(f"qdq::{src}")
                inits[jn] = np.asarray(self.gq.initializers[src]).astype(np.float64)
            return consts[src]

        def params(n: Node) -> list[str]:
            ins = [*n.inputs[1:3], ""][:2]  # scale, zero point ("" when omitted)
            return [const(i) if i else "" for i in ins]

        def info_of(t: str) -> ValueInfo:
            v = g.info(t)
            return ValueInfo("", v.dtype if v.dtype and v.dtype.startswith("float") else "float32",
                             v.shape)

        def cast_chain(base: str, chain: tuple[_Cast, ...], final: str | None = None) -> str:
            key = (base, tuple(c.dq.name for c in chain))
            if key in made:
                return made[key]
            cur = renamed_out.get(base, base)
            for k, c in enumerate(chain):
                last = k == len(chain) - 1
                qn = namer.fresh(f"{base}::q{len(made)}.{k}")
                dn = final if (last and final is not None) else namer.fresh(f"{base}::qdq{len(made)}.{k}")
                q_attrs, d_attrs = _attrs(self, c.q, "q"), _attrs(self, c.dq, "dq")
                q_ins, d_ins = [cur, *params(c.q)], [qn, *params(c.dq)]
                where = pre if base in g.initializers else after.setdefault(base, [])
                where.extend([
                    Node(namer.fresh(f"qdq/{c.q.name}"), "QuantizeLinear", tuple(q_ins), (qn,),
                         q_attrs, JOINT_DOMAIN),
                    Node(namer.fresh(f"qdq/{c.dq.name}#{base}"), "DequantizeLinear",
                         tuple(d_ins), (dn,), d_attrs, JOINT_DOMAIN)])
                value_info[qn] = replace(info_of(base), name=qn)
                value_info[dn] = replace(info_of(base), name=dn)
                cur = dn
            made[key] = cur
            return cur

        def weight(gi: str, dq: Node) -> str:
            key = (gi, dq.name)
            if key in weights:
                return weights[key]
            jn = namer.fresh(f"{gi}::dq")
            ins = [const(dq.inputs[0]), *params(dq)]
            pre.append(Node(namer.fresh(f"qdq/{dq.name}"), "DequantizeLinear", (*ins, gi), (jn,),
                            _attrs(self, dq, "dq"), JOINT_DOMAIN))
            value_info[jn] = ValueInfo(jn, "float32", tuple(np.shape(g.initializers[gi])))
            weights[key] = jn
            return jn

        for name, chain in out_chains.items():  # first: their last DQ writes the output's name
            cast_chain(name, chain, final=name)
            value_info[renamed_out[name]] = replace(info_of(name), name=renamed_out[name])
        rewired: dict[str, Node] = {}
        for m_name, n in self.matched.items():
            m = self.gq.node(m_name)
            ins = list(n.inputs)
            for k, i in enumerate(m.inputs):
                if not i:
                    continue
                r = self.refs.get(i) or self.ref(i, m)
                if r.kind == "weight":
                    ins[k] = weight(n.inputs[k], r.dq)  # type: ignore[arg-type]
                elif r.chain:
                    ins[k] = cast_chain(n.inputs[k], r.chain)
                elif n.inputs[k] in renamed_out:
                    ins[k] = renamed_out[n.inputs[k]]
            outs = tuple(renamed_out.get(o, o) for o in n.outputs)
            rewired[n.name] = replace(n, inputs=tuple(ins), outputs=outs)
        nodes: list[Node] = list(pre)
        for v in g.inputs:
            nodes += after.get(v.name, [])
        for n in g.nodes:
            nodes.append(rewired[n.name])
            for o in n.outputs:
                nodes += after.get(o, [])
        used = {i for n in nodes for i in n.inputs if i}
        inits = {k: v for k, v in inits.items() if k in used}
        return Graph(f"{g.name}+{self.gq.name}", nodes, list(g.inputs), list(g.outputs), inits,
                     value_info, g.opset, dict(g.opsets), g.ir_version)


def _attrs(j: _Joiner, n: Node, kind: str) -> dict[str, Any]:
    """The attributes a joint node carries: ONNX's, with defaults written out, plus the
    quantized type (``qtype``) and the scale's type (``stype``)."""
    known = {"q": ("axis", "saturate", "block_size", "output_dtype", "precision"),
             "dq": ("axis", "block_size", "output_dtype")}[kind]
    for a in n.attrs:
        if a not in known:
            raise j.fail(n, f"attribute {a!r} is not understood (known: {', '.join(known)})")
    gq = j.gq
    scale = gq.initializers[n.inputs[1]]
    stype = _etype(scale, "scale")
    if kind == "q":
        zp = n.inputs[2] if len(n.inputs) > 2 and n.inputs[2] else ""
        od = int(n.attrs.get("output_dtype", 0))
        if zp:
            qtype = _etype(gq.initializers[zp], "zp")
            if od and od != qtype:
                raise j.fail(n, "output_dtype differs from the zero point's type")
        else:
            qtype = od or TensorProto.UINT8
        if int(n.attrs.get("precision", 0)) not in (0, stype):
            raise j.fail(n, "a 'precision' other than the scale's type is not supported")
    else:
        src = gq.initializers.get(n.inputs[0])
        if src is not None:
            qtype = _etype(src, "q")
        else:
            q = j.producer[n.inputs[0]]
            qtype = _attrs(j, q, "q")["qtype"]
        if int(n.attrs.get("output_dtype", 0)) not in (0, stype):
            raise j.fail(n, "an output_dtype other than the scale's type is not supported")
    if qtype not in QTYPES:
        raise j.fail(n, f"quantized element type {qtype} is not supported "
                        f"(supported: {', '.join(QTYPES.values())})")
    out = {"axis": int(n.attrs.get("axis", 1)), "block_size": int(n.attrs.get("block_size", 0)),
           "qtype": int(qtype), "stype": int(stype)}
    if kind == "q":
        out["saturate"] = int(n.attrs.get("saturate", 1))
    return out


def _etype(arr: Any, kind: str) -> int:
    a = np.asarray(arr)
    name = a.dtype.name
    if kind == "scale":
        if name not in _NP_STYPE:
            raise ModelImportError(f"a scale of type {name}: expected float32, float16 or bfloat16")
        return _NP_STYPE[name]
    if kind == "zp" or kind == "q":
        if name not in _NP_QTYPE:
            raise ModelImportError(f"a quantized tensor of type {name}: expected one of "
                                   f"{', '.join(_NP_QTYPE)}")
        return _NP_QTYPE[name]
    return 0


def _same(a: Any, b: Any) -> bool:
    x, y = np.asarray(a), np.asarray(b)
    return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


def _canon(attrs: Mapping[str, Any]) -> Any:
    from kcverify.models.ir import _canon_attr

    return sorted((k, _canon_attr(v)) for k, v in attrs.items())
