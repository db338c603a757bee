"""Random small ReLU networks as ONNX graphs, for the SMT tests and bench/smt.py."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kcverify.kernels.spec import KernelSpec, parse_kernel_spec
from kcverify.models.ir import Graph, from_onnx


def random_mlp_model(sizes: tuple[int, ...] = (3, 8, 8, 2), seed: int = 0, scale: float = 1.0
                     ) -> onnx.ModelProto:
    """Gemm(transB=1) + Relu layers (no Relu after the last), weights N(0, scale^2 / fan_in),
    biases N(0, 0.1^2), float32: the shape of models/mlp_tiny.onnx."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    prev = "x"
    for k, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        w = (rng.standard_normal((b, a)) * scale / np.sqrt(a)).astype(np.float32)
        c = (rng.standard_normal(b) * 0.1).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{k}"), numpy_helper.from_array(c, f"b{k}")]
        out = "y" if k == len(sizes) - 2 else f"h{k}"
        nodes.append(helper.make_node("Gemm", [prev, f"w{k}", f"b{k}"], [out], name=f"gemm{k}",
                                      transB=1))
        prev = out
        if k < len(sizes) - 2:
            nodes.append(helper.make_node("Relu", [out], [f"r{k}"], name=f"relu{k}"))
            prev = f"r{k}"
    g = helper.make_graph(nodes, "mlp",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", sizes[0]])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", sizes[-1]])],
                          inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def random_mlp(sizes: tuple[int, ...] = (3, 8, 8, 2), seed: int = 0, scale: float = 1.0) -> Graph:
    return from_onnx(random_mlp_model(sizes, seed, scale), name=f"mlp{sizes}-{seed}")


def fp8_specs(act_scale: str = "dynamic_per_tensor", fmt: str = "fp8_e4m3"
              ) -> tuple[KernelSpec, KernelSpec]:
    """fp32 training vs FP8 inference (per-channel weights, activations by ``act_scale``)."""
    train = parse_kernel_spec("train", {"compute": "fp32", "accumulate": "fp32"})
    acts = {"format": fmt, "scale": act_scale}
    if act_scale == "static":
        acts["value"] = 1.0 / 64
    inf = parse_kernel_spec("inf", {"compute": "fp32", "accumulate": "fp32",
                                    "weights": {"format": fmt, "scale": "per_channel"},
                                    "activations": acts})
    return train, inf
