"""One small single-node graph per registered bound rule (the soundness suite refuses a rule with
no case here). Each case: inputs are graph inputs (float, bounded as a box around a random
point) or initializers (weights, exact); the point is drawn per test."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from kcverify.models.ir import Graph, from_onnx

R = np.random.default_rng(7)


@dataclass
class Case:
    op: str
    inputs: list[tuple[str, Any]]  # (name, shape tuple) graph input | (name, ndarray) initializer
    attrs: dict[str, Any] = field(default_factory=dict)
    n_out: int = 1
    opset: int = 20
    scale: float = 1.0  # input magnitude
    positive: bool = False
    name: str = ""
    # kernel specs (tests/soundness/_helpers.SPECS) whose semantics the op does not define
    # (Conv: per-token activation scales); the suite skips those pairs
    skip_specs: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        return self.name or self.op

    def graph(self) -> Graph:
        ins, inits = [], []
        for nm, v in self.inputs:
            if isinstance(v, np.ndarray):
                inits.append(numpy_helper.from_array(v, nm))
            else:
                ins.append(helper.make_tensor_value_info(nm, TensorProto.FLOAT, list(v)))
        outs = [helper.make_tensor_value_info(f"y{k}", TensorProto.FLOAT, None) for k in range(self.n_out)]
        node = helper.make_node(self.op, [nm for nm, _ in self.inputs],
                                [f"y{k}" for k in range(self.n_out)], name="n0", **self.attrs)
        g = helper.make_graph([node], self.id, ins, outs, inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", self.opset)])
        return from_onnx(m, self.id)

    def point(self, rng: np.random.Generator, batch: int) -> dict[str, np.ndarray]:
        feeds = {}
        for nm, v in self.inputs:
            if not isinstance(v, np.ndarray):
                x = rng.normal(size=(batch, *v[1:])) * self.scale
                feeds[nm] = np.abs(x) + 0.05 if self.positive else x
        return feeds


def _w(*shape: int, s: float = 0.5) -> np.ndarray:
    return (R.normal(size=shape) * s).astype(np.float32)


def _i(*vals: int) -> np.ndarray:
    return np.array(vals, dtype=np.int64)


X = ("x", (2, 3, 8))
CASES: list[Case] = [
    Case("Add", [X, ("b", _w(8))]), Case("Add", [X, ("z", (2, 3, 8))], name="Add2"),
    Case("Sub", [X, ("b", _w(8))]), Case("Mul", [X, ("z", (2, 3, 8))]),
    Case("Div", [X, ("z", (2, 3, 8))], positive=True), Case("Neg", [X]),
    Case("Reciprocal", [X], positive=True), Case("Exp", [X]), Case("Tanh", [X], scale=2.0),
    Case("Erf", [X]), Case("Sigmoid", [X], scale=3.0), Case("Sqrt", [X], positive=True),
    Case("Log", [X], positive=True), Case("Pow", [X, ("p", np.array(2.0, np.float32))]),
    Case("Relu", [X]), Case("LeakyRelu", [X], {"alpha": 0.1}),
    Case("Gelu", [X], {"approximate": "none"}, scale=2.0),
    Case("Gelu", [X], {"approximate": "tanh"}, scale=2.0, name="GeluTanh"),
    Case("Softmax", [X], {"axis": -1}, scale=3.0),
    Case("Softmax", [X], {"axis": 1}, scale=3.0, name="SoftmaxAxis1"),
    Case("LayerNormalization", [X, ("g", (1 + _w(8, s=0.1))), ("beta", _w(8, s=0.1))],
         {"axis": -1, "epsilon": 1e-5}),
    Case("MatMul", [X, ("w", _w(8, 5))]),
    Case("MatMul", [("a", (2, 3, 8)), ("bb", (2, 8, 4))], name="MatMulBilinear"),
    Case("Gemm", [("x", (2, 8)), ("w", _w(5, 8)), ("c", _w(5))], {"transB": 1}),
    Case("Gemm", [("x", (2, 8)), ("w", _w(8, 5)), ("c", _w(5))], {"alpha": 0.5, "beta": 2.0},
         name="GemmAlphaBeta"),
    Case("ReduceSum", [X, ("ax", _i(-1))]), Case("ReduceMean", [X, ("ax", _i(1, 2))]),
    Case("ReduceMax", [X, ("ax", _i(-1))]), Case("ReduceMin", [X, ("ax", _i(-1))]),
    Case("Reshape", [X, ("s", _i(2, 24))]), Case("Transpose", [X], {"perm": [0, 2, 1]}),
    Case("Unsqueeze", [X, ("ax", _i(1))]), Case("Squeeze", [("x", (2, 1, 8)), ("ax", _i(1))]),
    Case("Flatten", [X], {"axis": 1}), Case("Identity", [X]), Case("Dropout", [X]),
    Case("Expand", [("x", (2, 1, 8)), ("s", _i(2, 3, 8))]),
    Case("Slice", [X, ("st", _i(1)), ("en", _i(7)), ("ax", _i(2))]),
    Case("Split", [X], {"axis": 2, "num_outputs": 2}, n_out=2),
    Case("Trilu", [("x", (2, 4, 4))], {"upper": 0}), Case("Cast", [X], {"to": 1}),
    Case("Gather", [X, ("idx", _i(0, 2, 2))], {"axis": 1}),
    Case("Concat", [X, ("z", (2, 3, 4))], {"axis": 2}),
    Case("Where", [("c", np.array([True, False] * 4)), X, ("z", (2, 3, 8))]),
    Case("Max", [X, ("z", (2, 3, 8))]), Case("Min", [X, ("b", _w(8))]),
    Case("CastLike", [X, ("z", (2, 3, 8))]),
    Case("Softplus", [X], name="Softplus"),
    Case("HardSigmoid", [X], {"alpha": 0.3}, scale=3.0, name="HardSigmoid(decomposed)"),
    Case("Conv", [("x", (2, 2, 6, 6)), ("w", _w(3, 2, 3, 3)), ("cb", _w(3, s=0.1))],
         {"strides": [2, 1], "pads": [1, 0, 0, 1]}, skip_specs=("fp8_fp32",)),
]
