"""Small ONNX test models built in code, shared by the tests and bench/ (which puts the repository
root on sys.path and imports ``tests.helpers``)."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from kcverify.models.ir import Graph, from_onnx


def matmul_model(w: np.ndarray) -> Graph:
    """One MatMul ``y = x @ W`` with ``W`` (K, N) stored as an fp32 initializer and ``x`` a float
    input of shape (batch, K), batch symbolic; opset 17."""
    k, n = w.shape
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])], "mm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n])],
        [numpy_helper.from_array(w.astype(np.float32), "W")])
    return from_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
