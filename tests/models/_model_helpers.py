"""Shared helpers: single-node ONNX graphs, and running a graph on both the executor and
onnxruntime."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

from kcverify.models.arith import Exact
from kcverify.models.executor import Executor
from kcverify.models.ir import Graph, Node, from_onnx

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "models"
SHIPPED = ["tiny_decoder", "tiny_encoder", "mlp_small", "mlp_tiny"]
ACASXU = Path("/work/shared/data/acasxu")  # VNN-COMP ACAS Xu networks, where available


def single_node(op: str, inputs: dict[str, np.ndarray], outputs: Sequence[tuple[str, int]],
                opset: int, consts: dict[str, np.ndarray] | None = None,
                **attrs: Any) -> onnx.ModelProto:
    """A model of one node: ``inputs`` become graph inputs, ``consts`` initializers (a name
    mapped to None is an omitted optional input "")."""
    consts = consts or {}
    order = list(inputs) + list(consts)
    names = [("" if consts.get(k, 0) is None else k) for k in order]
    while names and names[-1] == "":
        names.pop()
    node = helper.make_node(op, names, [o for o, _ in outputs], name=f"the_{op.lower()}", **attrs)
    g = helper.make_graph(
        [node], "single",
        [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
         for k, v in inputs.items()],
        [helper.make_tensor_value_info(o, t, None) for o, t in outputs],
        [numpy_helper.from_array(v, k) for k, v in consts.items() if v is not None])
    ir = 10 if opset >= 21 else 8
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir)


def run_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray],
            optimize: bool = True) -> list[np.ndarray]:
    """onnxruntime's outputs; ``optimize=False`` turns off its graph rewrites (which, e.g., fuse
    DequantizeLinear + MatMul into a kernel that quantizes the activations too)."""
    opts = ort.SessionOptions()
    if not optimize:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def run_ours(model: onnx.ModelProto | Graph, feeds: dict[str, np.ndarray],
             arithmetic: Any = None) -> list[np.ndarray]:
    graph = model if isinstance(model, Graph) else from_onnx(model)
    out = Executor(graph, arithmetic=arithmetic).run(feeds)
    return [out[v.name].numpy() for v in graph.outputs]


def assert_close(ours: np.ndarray, ref: np.ndarray, rtol: float = 1e-5, atol: float = 0.0) -> None:
    """max |ours - ref| <= rtol * max |ref| + atol (NaNs must match); ints and bools exactly."""
    ref = np.asarray(ref)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    if ref.dtype.kind in "iub":
        np.testing.assert_array_equal(ours, ref)
        return
    ref64 = ref.astype(np.float64)
    ours64 = ours.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(ours64), np.isnan(ref64))
    finite = np.isfinite(ref64)
    np.testing.assert_array_equal(ours64[~finite & ~np.isnan(ref64)], ref64[~finite & ~np.isnan(ref64)])
    if finite.any():
        diff = np.max(np.abs(ours64[finite] - ref64[finite]))
        scale = np.max(np.abs(ref64[finite]))
        assert diff <= rtol * scale + atol, f"max|diff| {diff} > {rtol} * {scale} + {atol}"


def two_unknown_ops() -> onnx.ModelProto:
    """Relu, acme::FancyNorm, MatMul, acme::Warp: two ops no executor knows."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="ok_relu"),
             helper.make_node("FancyNorm", ["a"], ["b"], name="fancy_1", domain="acme"),
             helper.make_node("MatMul", ["b", "b"], ["c"], name="mm"),
             helper.make_node("Warp", ["c"], ["y"], name="warp_9", domain="acme")]
    g = helper.make_graph(nodes, "g", [x], [y])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                               helper.make_opsetid("acme", 1)])


class PassThrough(Exact):
    """Exact values, but not the Exact class: the executor takes the decomposed paths."""


class Recorder(Exact):
    """Records every call of the arithmetic hook (and computes exactly)."""

    def __init__(self) -> None:
        self.matmuls: list[tuple[str, str, str]] = []
        self.convs: list[tuple[str, str, str]] = []
        self.rounds: list[tuple[str, str]] = []
        self.inputs: list[str] = []

    def matmul(self, node: Node, a: torch.Tensor, b: torch.Tensor, a_role: str, b_role: str) -> torch.Tensor:
        self.matmuls.append((node.name, a_role, b_role))
        return super().matmul(node, a, b, a_role, b_role)

    def conv(self, node: Node, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
             stride: list[int], padding: list[int], dilation: list[int], groups: int,
             x_role: str, w_role: str) -> torch.Tensor:
        self.convs.append((node.name, x_role, w_role))
        return super().conv(node, x, w, bias, stride, padding, dilation, groups, x_role, w_role)

    def round(self, node: Node, primitive: str, value: torch.Tensor) -> torch.Tensor:
        self.rounds.append((node.op_type, primitive))
        return value

    def graph_input(self, name: str, value: torch.Tensor) -> torch.Tensor:
        self.inputs.append(name)
        return value


F32 = TensorProto.FLOAT
I64 = TensorProto.INT64
BOOL = TensorProto.BOOL
