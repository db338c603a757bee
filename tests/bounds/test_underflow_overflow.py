"""Underflow and overflow in the kernel model (issue 11, violations 2 and 4).

* A dynamic scale is fl32(max(amax, floor) / max_finite) with the spec's floor (default 1e-12):
  an input like [[1e-44, 0, 0, 0]] no longer makes fl32(amax / 448) = 0 and 0/0 = NaN in a
  conforming program while the bound certified 0.0078 on mlp_tiny.
* Accumulation carries an absolute eta_acc per term: fp32 products of subnormal inputs round on
  the subnormal grid (the relative gamma_n model alone was exceeded 6.9x at K = 64).
* The accumulator receives the unscaled products q_a q_b: in fp16 they overflow (448^2 > 65504),
  so the bound is infinite (it certified 0.53).
Programs here are independent of kcverify's realizer: numpy float32 / float16 arithmetic and
ml_dtypes' fp8 casts.
"""

from __future__ import annotations

import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from kcverify.bounds import certify_drift
from kcverify.kernels.realize import run_kernel
from kcverify.kernels.spec import parse_kernel_spec
from kcverify.models.ir import from_onnx, load_onnx

ROOT = Path(__file__).resolve().parents[2]
FP32 = parse_kernel_spec("train", {"compute": "fp32", "accumulate": "fp32"})
FP8 = {"weights": {"format": "fp8_e4m3", "scale": "per_channel"},
       "activations": {"format": "fp8_e4m3", "scale": "dynamic_per_tensor"}}


def _inside(lo: np.ndarray, hi: np.ndarray, y: np.ndarray, what: str) -> None:
    assert np.all(np.isfinite(y)) or np.all(~np.isfinite(y) & (hi == math.inf)), what
    assert np.all(lo <= y) and np.all(y <= hi), (what, lo, y, hi)


def test_subnormal_input_scale_is_floored_on_mlp_tiny() -> None:
    """The issue's input: every conforming program's scale is the floor's, finite results,
    inside the certified sets."""
    g = load_onnx(ROOT / "models" / "mlp_tiny.onnx")
    inf = parse_kernel_spec("inf", {**FP8, "accumulate": "fp32", "compute": "fp32"})
    x = np.array([[1e-44, 0, 0, 0]], dtype=np.float32)
    res = certify_drift(g, FP32, inf, {"x": x}, domain="interval")
    out = g.outputs[0].name
    box = res.outputs[out]
    for order in ("sequential", "pairwise", "reverse"):
        yt = run_kernel(g, FP32, {"x": x}, order=order)[out].numpy()
        yi = run_kernel(g, inf, {"x": x}, order=order)[out].numpy()
        _inside(box.train_lo, box.train_hi, yt, "train")
        _inside(box.inf_lo, box.inf_hi, yi, "inf")
        _inside(box.drift_lo, box.drift_hi, yi - yt, "drift")


def _fp8(t: np.ndarray) -> np.ndarray:
    return t.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def _matmul_model(w: np.ndarray, k: int):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, w.shape[1]])
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "mm", [x], [y],
                              [numpy_helper.from_array(w.astype(np.float32), "w")])
    return from_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def test_dynamic_scale_of_a_subnormal_row_is_a_normal_float32() -> None:
    """An fp32 program computing s = max(amax, 1e-12) / 448 in float32, x / s in float32 and
    fp8 casts (ml_dtypes) on a row of amax 1e-40 (fl32(amax / 448) would be subnormal, off by
    ~7e-3 relative): inside the certified inference interval."""
    k = 16
    rng = np.random.default_rng(2)
    w = rng.standard_normal((k, 3)).astype(np.float32)
    g = _matmul_model(w, k)
    inf = parse_kernel_spec("inf", {**FP8, "accumulate": "fp32", "compute": "fp32"})
    x = (rng.standard_normal((1, k)) * 1e-40).astype(np.float32)
    box = certify_drift(g, FP32, inf, {"x": x}, domain="interval").outputs["y"]
    s = np.float32(max(np.abs(x).max(), np.float32(1e-12))) / np.float32(448)
    assert s >= 2.0**-126
    qx = _fp8((x / s).astype(np.float32))
    sw = (np.abs(w).max(axis=0) / np.float32(448)).astype(np.float32)
    qw = _fp8((w / sw).astype(np.float32))
    acc = np.zeros((1, 3), np.float32)
    for j in range(k):  # unscaled products (exact in fp32), sequential fp32 sum
        acc = (acc + (qx[:, j:j + 1] * qw[j:j + 1, :]).astype(np.float32)).astype(np.float32)
    y = (acc.astype(np.float64) * (np.float64(s) * sw.astype(np.float64))).astype(np.float32)
    _inside(box.inf_lo, box.inf_hi, y.astype(np.float64), "inf")


@pytest.mark.parametrize("scale", [4e-43, 1e-40])
def test_products_underflowing_in_fp32_inside(scale: float) -> None:
    """K = 64 bias-free fp32 MatMul on subnormal inputs: float32 products round on the
    subnormal grid (absolute error up to 2^-150 each), a sequential float32 sum: inside the
    certified training interval (the relative model alone was exceeded 6.9x)."""
    k = 64
    rng = np.random.default_rng(5)
    w = rng.uniform(0.5, 1.5, (k, 4)).astype(np.float32)
    x = (rng.uniform(0.5, 1.5, (1, k)) * scale).astype(np.float32)
    g = _matmul_model(w, k)
    box = certify_drift(g, FP32, FP32, {"x": x}, domain="interval").outputs["y"]
    acc = np.zeros((1, 4), np.float32)
    for j in range(k):
        acc = (acc + (x[:, j:j + 1] * w[j:j + 1, :]).astype(np.float32)).astype(np.float32)
    exact = x.astype(np.float64) @ w.astype(np.float64)
    assert np.any(acc.astype(np.float64) != exact.astype(np.float32))  # the products did round
    _inside(box.train_lo, box.train_hi, acc.astype(np.float64), "train")


def test_fp16_accumulation_of_unscaled_fp8_products_is_unbounded() -> None:
    """The accumulator sees q_a q_b (up to 448^2 = 200704 > 65504): an fp16 accumulator
    overflows, and the bound says so (inf) on mlp_tiny and on one MatMul."""
    inf = parse_kernel_spec("inf", {**FP8, "accumulate": "fp16", "compute": "fp32"})
    g = load_onnx(ROOT / "models" / "mlp_tiny.onnx")
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    res = certify_drift(g, FP32, inf, {"x": x}, domain="interval")
    assert np.all(np.isinf(res.linf))
    # an independent program: fp8 casts, unscaled products summed in float16
    k = 8
    rng = np.random.default_rng(1)
    w = rng.standard_normal((k, 2)).astype(np.float32)
    xm = rng.standard_normal((1, k)).astype(np.float32)
    s = np.float32(np.abs(xm).max()) / np.float32(448)
    sw = (np.abs(w).max(axis=0) / np.float32(448)).astype(np.float32)
    qx, qw = _fp8((xm / s).astype(np.float32)), _fp8((w / sw).astype(np.float32))
    acc = np.zeros((1, 2), np.float16)
    with np.errstate(over="ignore"):
        for j in range(k):
            acc = (acc + (qx[:, j:j + 1] * qw[j:j + 1, :]).astype(np.float16)).astype(np.float16)
    box = certify_drift(_matmul_model(w, k), FP32, inf, {"x": xm}, domain="interval").outputs["y"]
    assert np.all(box.inf_hi == math.inf) or np.all(np.isfinite(acc))
    assert np.all(np.isinf(box.linf()))


def test_amax_floor_in_the_spec() -> None:
    """``amax_floor`` is part of the spec and of its canonical form (the default written out, so
    a certificate's digest names the floor; a static scale has none)."""
    sp = parse_kernel_spec("inf", {"activations": {"format": "fp8_e4m3",
                                                   "scale": "dynamic_per_tensor",
                                                   "amax_floor": 2.0**-30}})
    assert sp.activations.floor == 2.0**-30
    assert sp.canonical()["activations"]["amax_floor"] == (2.0**-30).hex()
    from kcverify.kernels.spec import DEFAULT_AMAX_FLOOR, _fl32

    default = parse_kernel_spec("inf", FP8).canonical()["activations"]
    assert default["amax_floor"] == _fl32(DEFAULT_AMAX_FLOOR).hex()
    assert default != sp.canonical()["activations"]
    static = parse_kernel_spec("inf", {"activations": {"format": "fp8_e4m3", "scale": "static",
                                                       "value": 0.5}})
    assert "amax_floor" not in static.canonical()["activations"]
    from kcverify.errors import KernelSpecError

    with pytest.raises(KernelSpecError, match="normal float32"):
        parse_kernel_spec("inf", {"activations": {"format": "fp8_e4m3",
                                                  "scale": "dynamic_per_tensor",
                                                  "amax_floor": 1e-40}})
    with pytest.raises(KernelSpecError, match="amax_floor"):
        parse_kernel_spec("inf", {"activations": {"format": "fp8_e4m3", "scale": "static",
                                                  "value": 1.0, "amax_floor": 1e-6}})


def test_static_scale_overflow_gives_no_bound_not_an_error() -> None:
    """A static activation scale small enough that x / s passes the format's range: the cast
    image is infinite (a program may produce inf / NaN), so the bound is infinite - not NaN
    bounds (an InternalError) and not the bias alone."""
    k = 4
    w = np.ones((k, 2), np.float32)
    g = _matmul_model(w, k)
    inf = parse_kernel_spec("inf", {"activations": {"format": "fp8_e4m3", "scale": "static",
                                                    "value": 1e-3},
                                    "accumulate": "fp32", "compute": "fp32"})
    x = np.array([[1.0, -1.0, 2.0, 0.5]], np.float32)  # x / s up to 2000 > 448
    res = certify_drift(g, FP32, inf, {"x": x}, domain="interval")
    assert np.all(np.isinf(res.linf))
