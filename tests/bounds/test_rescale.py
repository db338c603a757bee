"""The rescale y = s_a s_b acc of a MatMul of cast operands (rules/linear.rescale_error).

The scales are fp32 values and the rescale multiplies in the wider of fp32 and the compute
format (either association, two roundings, or one), the result then rounded to the compute
format. A program may form
S = fl32(s_a s_b) first: where s_a s_b is an fp32 subnormal (static activation scale 1.3e-20,
weight scale 2^-67) S is off by ~1e-5 relative and that error multiplies the whole unscaled sum,
which the two relative roundings do not cover (the adversary's F1, session 8). The programs are numpy /
ml_dtypes only: operands on the fp8 grid, so every cast is exact and the sum exact; only the
rescale and the final rounding round.
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
# (static activation scale, weight scale = a power of two): a subnormal and an ordinary product
SCALES = {"subnormal": (float(np.float32(1.3e-20)), 2.0**-67),
          "ordinary": (float(np.float32(1.3e-3)), 2.0**-12)}
FMT = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16, "fp32": np.float32, "fp64": np.float64}


def _spec(compute: str, s_a: float):
    return parse_kernel_spec("inf", {
        # the floor below the subnormal case's weight amax 448 * 2^-67 (default 1e-12)
        "weights": {"format": "fp8_e4m3", "scale": "per_channel", "amax_floor": 1e-30},
        "activations": {"format": "fp8_e4m3", "scale": "static", "value": s_a},
        "accumulate": "fp32", "compute": compute})


def _case(seed: int, s_a: float, s_b: float):
    rng = np.random.default_rng(seed)
    grid = np.array([-448.0, -104.0, -13.0, -2.5, -0.375, 0.0, 0.5, 3.0, 11.0, 96.0, 448.0])
    qa = rng.choice(grid[1:-1], size=(2, 8))
    qb = rng.choice(grid, size=(8, 3))
    qb[0] = 448.0  # every column's amax 448 s_b: the per-channel scale is s_b exactly
    x = (qa * s_a).astype(np.float32)
    W = (qb * s_b).astype(np.float32)
    assert np.array_equal(W.astype(np.float64), qb * s_b)
    assert np.array_equal(np.asarray(x / np.float32(s_a), ml_dtypes.float8_e4m3fn), qa)
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(W, "W")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    return from_onnx(model), x, qa, qb


def _programs(qa: np.ndarray, qb: np.ndarray, s_a: float, s_b: float, fmt) -> list[np.ndarray]:
    """The rescale's associations in the wider of fp32 and the compute format ``fmt`` (fp64:
    every product of fp32 scales and the exact sum is exact there), then one rounding to
    ``fmt``."""
    acc = qa @ qb  # exact: products of fp8 values, far below 2^24 of their grain
    wide = np.float64 if fmt is np.float64 else np.float32
    r = lambda v: np.asarray(v, wide).astype(np.float64)  # noqa: E731
    out = lambda v: np.asarray(v, fmt).astype(np.float64)  # noqa: E731
    return [out(r(r(s_a * s_b) * acc)),   # S first: an fp32 subnormal in the first case
            out(r(r(acc * s_a) * s_b)), out(r(r(acc * s_b) * s_a)),
            out(r(acc * (s_a * s_b)))]


@pytest.mark.parametrize("scales,compute", [("subnormal", "fp32"), ("subnormal", "bf16"),
                                            ("ordinary", "fp16"), ("ordinary", "bf16"),
                                            ("ordinary", "fp64"), ("subnormal", "fp64")])
@pytest.mark.parametrize("domain", ["interval", "linear", "best"])
def test_rescale_orders_inside(scales: str, compute: str, domain: str) -> None:
    s_a, s_b = SCALES[scales]
    g, x, qa, qb = _case(0, s_a, s_b)
    box = certify_drift(g, FP32, _spec(compute, s_a), {"x": x}, domain=domain).outputs["y"]
    il, ih = box.arrays()[2:4]
    for y in _programs(qa, qb, s_a, s_b, FMT[compute]):
        assert np.all((il <= y) & (y <= ih)), (scales, compute, domain, il, y, ih)


def test_the_subnormal_case_reaches_the_term() -> None:
    """fl32(s_a s_b) is off by more than the two relative roundings allow (so the fp32 case
    above fails without rescale_error)."""
    s_a, s_b = SCALES["subnormal"]
    s = s_a * s_b
    assert s < 2.0**-126
    assert abs(float(np.float32(s)) - s) > 4 * 2.0**-24 * s
