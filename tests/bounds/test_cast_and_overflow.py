"""Cast rounding and overflow in the bound rules (the adversary's findings, issue 11).

* ``Cast`` to fp16 / bf16 rounds (nearest-even, +-inf beyond the range; a neighbour with
  ``rounding: any``) in every domain: the linear and zonotope domains keep the identity only where
  the cast is exact in both kernels.
* A rounding that may overflow the compute format has an infinite error: the drift is unbounded
  in every domain, not only the value set.
* ReduceSum's partial sums, a divisor that may be 0 in the compute format, and LayerNorm's
  stored moments / r~ give no bound where a conforming program may overflow.
Programs are independent of kcverify: numpy float16 / float32 and ml_dtypes bfloat16.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kcverify.bounds import certify_drift
from kcverify.kernels.spec import parse_kernel_spec
from kcverify.models.ir import from_onnx

FP32 = parse_kernel_spec("train", {"compute": "fp32", "accumulate": "fp32"})
FP16 = parse_kernel_spec("inf", {"compute": "fp16", "accumulate": "fp32"})
DOMAINS = ["interval", "linear", "best"]


def _graph(nodes: list, inputs: list[tuple[str, tuple[int, ...]]], out: str,
           inits: list | None = None, opset: int = 17):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s)
                                       for n, s in inputs],
                          [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)],
                          initializer=inits or [])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    return from_onnx(m)


def _cast_chain(to: int):
    return _graph([helper.make_node("Cast", ["x"], ["h"], to=to),
                   helper.make_node("Cast", ["h"], ["y"], to=TensorProto.FLOAT)],
                  [("x", (1, 5))], "y")


@pytest.mark.parametrize("domain", DOMAINS)
@pytest.mark.parametrize(("to", "dtype"), [(TensorProto.FLOAT16, np.float16),
                                           (TensorProto.BFLOAT16, ml_dtypes.bfloat16)])
def test_cast_rounds_to_its_target(domain: str, to: int, dtype) -> None:
    """fp32 kernels: the Cast's image is the target format's rounding (was the identity)."""
    x = np.array([[0.1, 1 / 3, 1000.1, 3e-6, -7.77]], np.float32)
    y = x.astype(dtype).astype(np.float64)
    box = certify_drift(_cast_chain(to), FP32, FP32, {"x": x}, domain=domain).outputs["y"]
    assert np.all(box.train_lo <= y) and np.all(y <= box.train_hi), (box.train_lo, y)
    assert np.all(box.inf_lo <= y) and np.all(y <= box.inf_hi)
    assert np.any(y != x.astype(np.float64))  # the input is not already representable


def test_cast_beyond_fp16_range_is_inf() -> None:
    """70000 in fp16 is inf (onnxruntime's and numpy's cast): no finite bound."""
    x = np.array([[70000.0, 1.0, 1.0, 1.0, 1.0]], np.float32)
    assert np.isinf(x.astype(np.float16)[0, 0])
    box = certify_drift(_cast_chain(TensorProto.FLOAT16), FP32, FP32, {"x": x},
                        domain="best").outputs["y"]
    assert box.train_hi[0, 0] == math.inf and math.isfinite(box.train_hi[0, 1])


def test_cast_with_rounding_any_takes_either_neighbour() -> None:
    """``rounding: any``: both fp16 neighbours of each value are inside."""
    any16 = parse_kernel_spec("inf", {"compute": "fp32", "accumulate": "fp32", "rounding": "any"})
    x = np.array([[0.1, 1 / 3, 1000.1, 3e-6, 65500.0]], np.float32)
    box = certify_drift(_cast_chain(TensorProto.FLOAT16), FP32, any16, {"x": x},
                        domain="best").outputs["y"]
    h = x.astype(np.float16)
    xd, hd = x.astype(np.float64), h.astype(np.float64)
    up = np.nextafter(h, np.float16(np.inf)).astype(np.float64)
    down = np.nextafter(h, np.float16(-np.inf)).astype(np.float64)
    below = np.where(hd <= xd, hd, down)  # the largest fp16 value <= x
    above = np.where(hd >= xd, hd, up)  # the smallest >= x
    for v in (below, above):
        assert np.all(box.inf_lo <= v) and np.all(v <= box.inf_hi), (box.inf_lo, v, box.inf_hi)
    assert np.all(np.isfinite(box.inf_hi))  # 65500's neighbours are 65472 and 65504


@pytest.mark.parametrize("domain", DOMAINS)
def test_fp16_overflow_makes_the_drift_unbounded(domain: str) -> None:
    """40000 + 30000 is inf in fp16: the drift bound is infinite in every domain (the interval
    domain kept [-34, 34], the zonotope a finite value set beyond 65504)."""
    g = _graph([helper.make_node("Add", ["x", "z"], ["y"])], [("x", (1, 2)), ("z", (1, 2))], "y")
    x = np.array([[40000, 1]], np.float32)
    z = np.array([[30000, 2]], np.float32)
    yi = (x.astype(np.float16) + z.astype(np.float16)).astype(np.float64)
    assert np.isinf(yi[0, 0])
    box = certify_drift(g, FP32, FP16, {"x": x, "z": z}, domain=domain).outputs["y"]
    assert box.inf_hi[0, 0] == math.inf and box.drift_hi[0, 0] == math.inf
    assert math.isfinite(box.drift_hi[0, 1])


def test_reduce_sum_partial_sum_overflow() -> None:
    """fp16 accumulation, 40000 + 40000 = inf before -40000 - 30000: no bound although the exact
    sum (10010) is in range."""
    f16 = parse_kernel_spec("inf", {"compute": "fp16", "accumulate": "fp16"})
    axes = numpy_helper.from_array(np.array([1], np.int64), "axes")
    g = _graph([helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0)],
               [("x", (1, 8))], "y", [axes], opset=13)
    x = np.array([[40000, 40000, -40000, -30000, 1, 2, 3, 4]], np.float32)
    acc = np.float16(0)
    for v in x[0].astype(np.float16):
        acc = np.float16(acc + v)
    assert np.isinf(acc)
    box = certify_drift(g, FP32, f16, {"x": x}, domain="best").outputs["y"]
    assert box.inf_hi[0] == math.inf and box.drift_hi[0] == math.inf
    small = np.array([[4, 4, -4, -3, 1, 2, 3, 4]], np.float32)  # far from the range: finite
    box = certify_drift(g, FP32, f16, {"x": small}, domain="best").outputs["y"]
    assert np.all(np.isfinite(box.linf()))


def test_divisor_that_underflows_gives_no_bound() -> None:
    """1e-9 is 0 in fp16: x / y is 0/0 or 1/0 there."""
    g = _graph([helper.make_node("Div", ["x", "z"], ["y"])], [("x", (1, 2)), ("z", (1, 2))], "y")
    x = np.array([[1e-9, 1.0]], np.float32)
    z = np.array([[1e-9, 1e-9]], np.float32)
    box = certify_drift(g, FP32, FP16, {"x": x, "z": z}, domain="best").outputs["y"]
    assert np.all(box.inf_lo == -math.inf) and np.all(box.inf_hi == math.inf)
    assert np.all(np.isfinite(box.train_hi))  # fp32 stores 1e-9: the training side is finite


def _ln(n: int, eps: float = 1e-5):
    inits = [numpy_helper.from_array(np.ones(n, np.float32), "g"),
             numpy_helper.from_array(np.zeros(n, np.float32), "b")]
    return _graph([helper.make_node("LayerNormalization", ["x", "g", "b"], ["y"], axis=-1,
                                    epsilon=eps)], [("x", (1, n))], "y", inits)


def _ln_fp16(x: np.ndarray, eps: float) -> np.ndarray:
    """Two-pass LayerNorm with the row sums accumulated in fp32 and stored in fp16."""
    h = x.astype(np.float16)
    mu = np.float16(h.astype(np.float32).sum() / np.float32(h.size))
    d = (h - mu).astype(np.float16)
    sq = np.float16((d.astype(np.float32) ** 2).sum())
    var = np.float16(sq / np.float16(h.size))
    with np.errstate(all="ignore"):
        r = np.float16(np.float16(1) / np.sqrt(np.float16(var + np.float16(eps))))
        return (d * r).astype(np.float64)


@pytest.mark.parametrize("domain", ["interval", "best"])
def test_layernorm_fp16_moments_and_rstd_overflow(domain: str) -> None:
    """fp16 compute: n sigma^2 > 65504 makes the stored sum of squares inf (y = 0); BERT's eps on
    a constant row makes r~ = 1e6 = inf (0 * inf = NaN). Both: no bound. A row in range stays
    finite."""
    n = 1024
    x = (9.0 * np.random.default_rng(0).normal(size=(1, n))).astype(np.float32)
    assert np.all(_ln_fp16(x, 1e-5) == 0)  # what the program computes
    box = certify_drift(_ln(n), FP32, FP16, {"x": x}, domain=domain).outputs["y"]
    assert np.all(box.inf_hi == math.inf) and np.all(box.drift_hi == math.inf)
    const = np.full((1, 16), 0.5, np.float32)
    assert np.all(np.isnan(_ln_fp16(const, 1e-12)))
    box = certify_drift(_ln(16, 1e-12), FP32, FP16, {"x": const}, domain=domain).outputs["y"]
    assert np.all(box.inf_hi == math.inf)
    ok = (0.5 * np.random.default_rng(1).normal(size=(1, 64))).astype(np.float32)
    box = certify_drift(_ln(64), FP32, FP16, {"x": ok}, domain=domain).outputs["y"]
    y = _ln_fp16(ok, 1e-5)
    assert np.all(np.isfinite(box.linf()))
    assert np.all(box.inf_lo <= y) and np.all(y <= box.inf_hi)


def test_fully_masked_softmax_row_has_no_bound() -> None:
    """A row of -inf: torch and onnxruntime give NaN; the other row keeps its bound."""
    g = _graph([helper.make_node("Softmax", ["x"], ["y"], axis=-1)], [("x", (1, 2, 4))], "y",
               opset=13)
    x = np.array([[[-np.inf] * 4, [0, 1, -np.inf, 2]]], np.float32)
    box = certify_drift(g, FP32, FP32, {"x": x}, domain="best").outputs["y"]
    assert np.all(box.train_lo[0, 0] == -math.inf) and np.all(box.train_hi[0, 0] == math.inf)
    assert np.all(np.isfinite(box.train_hi[0, 1]))


def test_onnx_checker_accepts_the_models() -> None:
    """The hand-built graphs are valid ONNX (a malformed one would test nothing)."""
    m = helper.make_model(helper.make_graph(
        [helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT16)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, (1, 2))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, (1, 2))]),
        opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(m)
