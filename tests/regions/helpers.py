"""Helpers for the region tests: the ACAS Xu data directory and small MLPs as real ONNX."""

from __future__ import annotations

from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def acas_dir() -> Path | None:
    """shared/data/acasxu beside the checkout (CI), else /work/shared; None when absent."""
    for p in (ROOT / ".." / "shared" / "data" / "acasxu", Path("/work/shared/data/acasxu")):
        if p.is_dir():
            return p.resolve()
    return None


def mlp_onnx(path: Path, seed: int = 0, sizes: tuple[int, ...] = (3, 8, 8, 2),
             gemm: bool = True, normalize: bool = True, act: str = "Relu") -> Path:
    """A ReLU MLP as ONNX: Sub/Div input normalisation, Gemm (transB) or MatMul+Add layers."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    cur = "x"
    if normalize:
        inits += [numpy_helper.from_array(rng.normal(size=(1, sizes[0])).astype(np.float32) * .1,
                                          "mean"),
                  numpy_helper.from_array(np.full((1, sizes[0]), 3.0, np.float32), "std")]
        nodes += [helper.make_node("Sub", ["x", "mean"], ["xs"]),
                  helper.make_node("Div", ["xs", "std"], ["xn"])]
        cur = "xn"
    for k, (a, b) in enumerate(zip(sizes, sizes[1:])):
        W = (rng.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32)
        bias = (rng.normal(size=b) * 0.1).astype(np.float32)
        out = f"h{k}"
        if gemm:
            inits += [numpy_helper.from_array(np.ascontiguousarray(W.T), f"W{k}"),
                      numpy_helper.from_array(bias, f"b{k}")]
            nodes.append(helper.make_node("Gemm", [cur, f"W{k}", f"b{k}"], [out], transB=1))
        else:
            inits += [numpy_helper.from_array(W, f"W{k}"), numpy_helper.from_array(bias, f"b{k}")]
            nodes += [helper.make_node("MatMul", [cur, f"W{k}"], [out + "m"]),
                      helper.make_node("Add", [out + "m", f"b{k}"], [out])]
        cur = out
        if k < len(sizes) - 2:
            nodes.append(helper.make_node(act, [cur], [cur + "r"]))
            cur = cur + "r"
    nodes.append(helper.make_node("Identity", [cur], ["y"]))
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                         [None, sizes[0]])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, sizes[-1]])],
                          inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    onnx.save(m, path)
    return path
