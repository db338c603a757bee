"""Accumulation families (docs/kernels.md): pinned schedules are sharp at points.

The conforming programs here are written apart from kcverify/kernels/realize.py, from the spec
text alone: Python ``fractions`` for every exact value, one round-to-nearest-even into float32
per addition (left to right), ml_dtypes' e4m3 casts of the float64 quotient x / s with
s = fl32(amax / 448). The certified drift of the interval domain at points, with both kernels
``order: sequential``, must be within 1% of the drift of that independent program.
"""

from __future__ import annotations

from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

from kcverify.bounds import certify_drift
from kcverify.kernels.spec import parse_kernel_spec
from kcverify.models.ir import load_onnx

E4M3 = ml_dtypes.float8_e4m3fn
SEQ = {"format": "fp32", "order": "sequential"}


def rn32(v: Fraction) -> float:
    """Round a rational to the nearest float32, ties to even (normal range)."""
    if v == 0:
        return 0.0
    sign = -1 if v < 0 else 1
    a = abs(v)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    e = max(e, -126)
    q = Fraction(2) ** (e - 23)
    n, r = divmod(a, q)
    if r > q / 2 or (r == q / 2 and n % 2 == 1):
        n += 1
    return sign * float(n * q)


def _gemm_seq(x: np.ndarray, w: np.ndarray, b: np.ndarray, cast: bool) -> np.ndarray:
    """y = x W^T + b for one sample x (K,), W (N, K): sequential fp32 accumulation."""
    if cast:
        sx = float(np.float32(np.float32(np.abs(x).max()) / np.float32(448.0)))
        qx = (x / sx).astype(E4M3).astype(np.float64)
        sw = (np.abs(w).max(axis=1).astype(np.float32) / np.float32(448.0)).astype(np.float64)
        qw = (w / sw[:, None]).astype(E4M3).astype(np.float64)
    else:
        sx, qx, sw, qw = 1.0, x, np.ones(w.shape[0]), w
    out = np.empty(w.shape[0])
    for j in range(w.shape[0]):
        acc = rn32(Fraction(qx[0]) * Fraction(qw[j, 0]))
        for i in range(1, len(x)):
            acc = rn32(Fraction(acc) + Fraction(qx[i]) * Fraction(qw[j, i]))
        y = rn32(Fraction(sx) * Fraction(float(sw[j])) * Fraction(acc))
        out[j] = rn32(Fraction(y) + Fraction(float(b[j])))
    return out


def _mlp(graph, x: np.ndarray, cast: bool) -> np.ndarray:
    init = {k: np.asarray(v, dtype=np.float64) for k, v in graph.initializers.items()}
    h = x.astype(np.float64)
    gemms = [n for n in graph.nodes if n.op_type == "Gemm"]
    for i, node in enumerate(gemms):
        w, b = init[node.inputs[1]], init[node.inputs[2]]
        assert int(node.attrs.get("transB", 0)) == 1
        h = _gemm_seq(h, w, b, cast)
        if i < len(gemms) - 1:
            h = np.maximum(h, 0.0)
    return h


@pytest.mark.parametrize("inf_cfg", [
    {"compute": "fp32", "accumulate": SEQ,
     "weights": {"format": "fp8_e4m3", "scale": "per_channel"},
     "activations": {"format": "fp8_e4m3", "scale": "dynamic_per_tensor"}},
    {"compute": "fp32", "accumulate": SEQ},  # the same kernel: drift 0 exactly
], ids=["fp8", "same"])
def test_pinned_schedule_is_sharp_at_points(inf_cfg: dict) -> None:
    graph = load_onnx("models/mlp_tiny.onnx")
    xs = np.load("examples/data/mlp_points.npz")["x"].astype(np.float32)[:12]
    train = parse_kernel_spec("train", {"compute": "fp32", "accumulate": SEQ})
    inf = parse_kernel_spec("inf", inf_cfg)
    res = certify_drift(graph, train, inf, {"x": xs}, domain="interval")
    cast = "weights" in inf_cfg
    for i, x in enumerate(xs.astype(np.float64)):
        drift = float(np.max(np.abs(_mlp(graph, x, cast) - _mlp(graph, x, False))))
        cert = float(res.linf[i])
        if not cast:
            assert drift == 0.0 and cert <= 1e-12, (i, cert)
            continue
        assert drift > 0
        assert 1.0 <= cert / drift <= 1.01, (i, cert, drift)


def test_any_order_is_not_sharp_where_rounding_is_the_drift() -> None:
    """The control: fp64 training against fp32 serving, where the drift is the accumulation's
    own rounding. Any order pays gamma_n for every order; a pinned order pays nothing."""
    graph = load_onnx("models/mlp_tiny.onnx")
    xs = np.load("examples/data/mlp_points.npz")["x"].astype(np.float32)[:6]
    train = parse_kernel_spec("train", {"compute": "fp64", "accumulate": {"format": "fp64",
                                                                          "order": "sequential"}})
    pinned = parse_kernel_spec("inf", {"compute": "fp32", "accumulate": SEQ})
    anyorder = parse_kernel_spec("inf", {"compute": "fp32", "accumulate": "fp32"})
    sharp = certify_drift(graph, train, pinned, {"x": xs}, domain="interval").linf
    wide = certify_drift(graph, train, anyorder, {"x": xs}, domain="interval").linf
    assert np.all(wide >= sharp)
    assert float(np.median(wide / np.maximum(sharp, 1e-300))) > 1.5
