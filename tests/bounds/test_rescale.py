"""The rescale y = s_a s_b acc of a MatMul of cast operands (rules/linear.rescale_error).

A conforming program may form S = fl(s_a s_b) in the compute format first. With fp16 compute and
scales of ordinary size (1.3e-3 and 2^-12) S ~ 3.2e-7 is an fp16 subnormal (spacing 2^-24): S
is off by ~6%, and that error multiplies the whole unscaled sum. The two relative roundings of
the rescale do not cover it (the bound missed by 25x before session 8). The program here is
written with numpy / ml_dtypes only: operands built on the fp8 grid so that every cast is exact
and every product and partial sum exact in fp32; only the rescale rounds.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from kcverify.bounds import certify_drift
from kcverify.kernels.spec import parse_kernel_spec
from kcverify.models.ir import from_onnx

FP32 = parse_kernel_spec("train", {"compute": "fp32", "accumulate": "fp32"})
S_A = float(np.float32(1.3e-3))
S_B = 2.0**-12


def _spec(compute: str):
    return parse_kernel_spec("inf", {
        "weights": {"format": "fp8_e4m3", "scale": "per_channel"},
        "activations": {"format": "fp8_e4m3", "scale": "static", "value": S_A},
        "accumulate": "fp32", "compute": compute})


def _case(seed: int):
    rng = np.random.default_rng(seed)
    grid = np.array([-448.0, -104.0, -13.0, -2.5, -0.375, 0.0, 0.5, 3.0, 11.0, 96.0, 448.0])
    qa = rng.choice(grid[1:-1], size=(2, 8))
    qb = rng.choice(grid, size=(8, 3))
    qb[0] = 448.0  # every column's amax 448 s_b: the per-channel scale is s_b exactly
    x = (qa * S_A).astype(np.float32)
    W = (qb * S_B).astype(np.float32)
    assert np.array_equal(W.astype(np.float64), qb * S_B)
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(W, "W")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    return from_onnx(model), x, qa, qb


def _programs(qa: np.ndarray, qb: np.ndarray, fmt) -> list[np.ndarray]:
    """The rescale's orders, each rounding in ``fmt`` (the compute format)."""
    acc = qa @ qb  # exact: products of fp8 values, |sum| < 2^24 * their grain
    r = lambda v: np.asarray(v, fmt).astype(np.float64)  # noqa: E731
    return [r(r(S_A * S_B) * acc),           # S first: S an fp16 subnormal
            r(r(acc * S_A) * S_B), r(r(acc * S_B) * S_A),
            r(acc * (S_A * S_B))]


@pytest.mark.parametrize("compute,fmt", [("fp16", np.float16), ("bf16", ml_dtypes.bfloat16),
                                         ("fp32", np.float32)])
@pytest.mark.parametrize("domain", ["interval", "linear", "best"])
def test_rescale_orders_inside(compute: str, fmt, domain: str) -> None:
    g, x, qa, qb = _case(0)
    box = certify_drift(g, FP32, _spec(compute), {"x": x}, domain=domain).outputs["y"]
    il, ih = box.arrays()[2:4]
    for y in _programs(qa, qb, fmt):
        assert np.all((il <= y) & (y <= ih)), (compute, domain, il, y, ih)


def test_fp16_scale_product_is_a_subnormal_here() -> None:
    """The case reaches the term: S = fl16(s_a s_b) differs from s_a s_b by more than the two
    relative roundings allow (so the test above fails without rescale_error)."""
    s = S_A * S_B
    assert s < 2.0**-14
    assert abs(float(np.float16(s)) - s) > 4 * 2.0**-11 * s
