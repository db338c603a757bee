"""The QDQ form of a kernel spec: a second ONNX graph whose casts are explicit
QuantizeLinear / DequantizeLinear nodes (float8 e4m3fn / e5m2 at opset >= 19, or int8), as
deployment tools write it. ``KernelSpec.onnx`` can name such a graph; the executor then runs its
casts exactly and a realization models only its arithmetic (kcverify.kernels.realize.run_kernel).

    model = make_qdq_model(graph, spec, calibration={"x": batch})

* Weights (initializers feeding MatMul / Gemm) are stored quantized, q = cast(W / s) computed
  exactly with kcverify.kernels.scale, followed by DequantizeLinear (per tensor, or per channel
  with ``axis`` on the output-feature axis). So the dequantized weight is exactly Q(W) of the
  realization, up to DequantizeLinear's own float32 product.
* Activations (every other MatMul / Gemm input) get QuantizeLinear -> DequantizeLinear with one
  static per-tensor scale: ``value`` for a static spec, otherwise fl32(amax / max_finite) with amax
  measured by onnxruntime on the calibration inputs (a dynamic spec has no static QDQ form, so its
  QDQ graph is the calibrated static kernel). Float8 QuantizeLinear saturates (ONNX default), as
  kcverify's casts do.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from kcverify.errors import KernelSpecError
from kcverify.kernels.cast import cast_grid
from kcverify.kernels.formats import Format
from kcverify.kernels.scale import scale_from_amax, weight_scale
from kcverify.kernels.spec import CastSpec, KernelSpec
from kcverify.models.ir import Graph, Namer

_QTYPES: dict[str, tuple[Any, int]] = {
    "fp8_e4m3": (ml_dtypes.float8_e4m3fn, TensorProto.FLOAT8E4M3FN),
    "fp8_e5m2": (ml_dtypes.float8_e5m2, TensorProto.FLOAT8E5M2),
    "int8": (np.int8, TensorProto.INT8),
}
QDQ_OPS = ("MatMul", "Gemm")


def _qtype(fmt: Format, role: str) -> tuple[Any, int]:
    if fmt.name not in _QTYPES:
        raise KernelSpecError(f"QDQ export: {role} format {fmt.name!r} has no QuantizeLinear type; "
                              f"expected one of {', '.join(_QTYPES)}")
    return _QTYPES[fmt.name]


def _out_axis(op: str, idx: int, attrs: Mapping[str, Any], rank: int) -> int:
    """The output-feature axis of a constant MatMul / Gemm operand, as a non-negative axis."""
    if op == "Gemm":
        trans = int(attrs.get("transB" if idx == 1 else "transA", 0))
        return (0 if trans else 1) if idx == 1 else (1 if trans else 0)
    return rank - 1 if idx == 1 else rank - 2


def ort_session(model: onnx.ModelProto) -> Any:
    """An onnxruntime CPU session with graph optimizations off: onnxruntime 1.31's QDQ fusions
    (QGemm, MatMulIntegerToFloat) reject or mis-compute float8 QDQ graphs on CPU."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def calibration_amax(graph: Graph, names: list[str], calibration: Mapping[str, Any]) -> dict[str, float]:
    """max |t| of each named tensor over the calibration inputs, measured with onnxruntime."""
    model = graph.to_onnx()
    have = {o.name for o in model.graph.output}
    for n in names:
        if n not in have:
            model.graph.output.append(helper.make_empty_tensor_value_info(n))
    sess = ort_session(model)
    feeds = {v.name: np.asarray(calibration[v.name]) for v in graph.inputs}
    outs = sess.run(names, feeds)
    return {n: float(np.max(np.abs(o))) if o.size else 0.0 for n, o in zip(names, outs)}


def make_qdq_model(graph: Graph, spec: KernelSpec,
                   calibration: Mapping[str, Any] | None = None) -> onnx.ModelProto:
    """The QDQ graph of ``spec`` for ``graph`` (see the module doc)."""
    inits = graph.initializers
    consts = graph.constant_names()
    wq: list[tuple[int, int, str]] = []  # (node index, input index, initializer)
    acts: list[str] = []
    for ni, n in enumerate(graph.nodes):
        if n.op_type not in QDQ_OPS:
            continue
        for idx in (0, 1):
            name = n.inputs[idx]
            if name in consts:
                if spec.weights is not None and name in inits:
                    wq.append((ni, idx, name))
            elif spec.activations is not None and name not in acts:
                acts.append(name)
    uses_fp8 = any(c is not None and c.format.name.startswith("fp8")
                   for c in (spec.weights, spec.activations))
    if uses_fp8 and graph.opset < 19:
        raise KernelSpecError(f"QDQ export: float8 QuantizeLinear needs opset >= 19; the model has {graph.opset}")
    if acts and spec.activations is not None and spec.activations.scale != "static" and calibration is None:
        raise KernelSpecError("QDQ export: dynamic activation scales need calibration inputs for static QDQ scales")

    model = graph.to_onnx()
    g = model.graph
    new_inits: list[onnx.TensorProto] = []
    renames: dict[tuple[int, int], str] = {}
    dq_nodes: list[onnx.NodeProto] = []
    done_w: dict[tuple[str, int], str] = {}
    namer = Namer(graph.names())  # the added tensors and nodes never reuse a model name
    for ni, idx, name in wq:
        n = graph.nodes[ni]
        w = inits[name]
        axis = _out_axis(n.op_type, idx, n.attrs, w.ndim)
        key = (name, axis)
        if key not in done_w:
            done_w[key] = _weight_dq(name, w, spec.weights, axis, new_inits, dq_nodes, namer)
        renames[(ni, idx)] = done_w[key]
    act_out: dict[str, str] = {}
    if acts:
        cast = spec.activations
        assert cast is not None
        if cast.kind.saturating:  # block-scaled (mx / nv): no QuantizeLinear form; says so
            cast.kind.qdq("activations")
        if cast.scale == "static":
            scales = {a: float(np.float32(cast.value)) for a in acts}
        else:
            amax = calibration_amax(graph, acts, calibration or {})
            scales = {a: float(scale_from_amax(torch.tensor(m), cast)) for a, m in amax.items()}
        for a in acts:
            act_out[a] = _activation_qdq(a, scales[a], cast, new_inits, dq_nodes, namer)
    # rewire and insert the new nodes just before their first consumer
    out_nodes: list[onnx.NodeProto] = []
    pending = {nd.output[0]: nd for nd in dq_nodes}
    q_of = {nd.output[0]: nd for nd in dq_nodes if nd.op_type == "QuantizeLinear"}
    emitted: set[str] = set()

    def emit(tensor: str) -> None:
        nd = pending.get(tensor)
        if nd is None or tensor in emitted:
            return
        src = nd.input[0]
        if src in q_of:
            emit(src)
        emitted.add(tensor)
        out_nodes.append(nd)

    for ni, nd in enumerate(g.node):
        if nd.op_type in QDQ_OPS:
            for idx in (0, 1):
                new = renames.get((ni, idx)) or act_out.get(nd.input[idx])
                if new is not None:
                    emit(new)
                    nd.input[idx] = new
        out_nodes.append(nd)
    del g.node[:]
    g.node.extend(out_nodes)
    g.initializer.extend(new_inits)
    used = {i for nd in g.node for i in nd.input}
    keep = [t for t in g.initializer if t.name in used]
    del g.initializer[:]
    g.initializer.extend(keep)
    onnx.checker.check_model(model)
    return model


def _weight_dq(name: str, w: np.ndarray, cast: CastSpec, axis: int,
               inits: list[onnx.TensorProto], nodes: list[onnx.NodeProto], namer: Namer) -> str:
    np_type, _ = _qtype(cast.format, "weights")
    form = cast.kind.qdq("weights")  # Unsupported (a KernelSpecError) for a kind with no QDQ form
    wt = torch.from_numpy(np.asarray(w, dtype=np.float64))
    s = weight_scale(wt, cast, out_axis=axis)
    q = cast_grid(wt, cast.format, s).numpy()
    qname, sname = namer.fresh(f"{name}__q"), namer.fresh(f"{name}__scale")
    inits.append(numpy_helper.from_array(q.astype(np.float32).astype(np_type), qname))
    attrs: dict[str, Any] = {}
    if form == "per_axis" and w.ndim > 0:
        scale = s.numpy().reshape(-1).astype(np.float32)
        attrs["axis"] = axis
    else:
        scale = np.array(s.reshape(-1)[0].item(), dtype=np.float32)
    inits.append(numpy_helper.from_array(scale, sname))
    out = namer.fresh(f"{name}__dq")
    nodes.append(helper.make_node("DequantizeLinear", [qname, sname], [out],
                                  name=namer.fresh(f"{name}/DequantizeLinear"), **attrs))
    return out


def _activation_qdq(name: str, scale: float, cast: CastSpec, inits: list[onnx.TensorProto],
                    nodes: list[onnx.NodeProto], namer: Namer) -> str:
    np_type, _ = _qtype(cast.format, "activations")
    base = name.replace("/", "_")
    sname, zname = namer.fresh(f"{base}__act_scale"), namer.fresh(f"{base}__act_zp")
    inits.append(numpy_helper.from_array(np.array(scale, dtype=np.float32), sname))
    inits.append(numpy_helper.from_array(np.zeros((), dtype=np.float32).astype(np_type), zname))
    qout, dqout = namer.fresh(f"{base}__q"), namer.fresh(f"{base}__dq")
    nodes.append(helper.make_node("QuantizeLinear", [name, sname, zname], [qout],
                                  name=namer.fresh(f"{base}/QuantizeLinear")))
    nodes.append(helper.make_node("DequantizeLinear", [qout, sname, zname], [dqout],
                                  name=namer.fresh(f"{base}/DequantizeLinear")))
    return dqout
