"""Row sums inside normalising ops (issue 11, violation 1): Softmax's sum of exps and
LayerNormalization's moments are reductions in any order, never a 1-ulp primitive.

The reference kernels the training spec must cover - torch's and onnxruntime's own fp32 Softmax
and LayerNormalization on CPU - and kcverify's realizations summing the rows in sequential,
reverse, pairwise and sorted orders must all lie inside the certified training value interval at
n = 4096 (and at row means up to 1e4 for LayerNorm). On the 1-ulp row-sum model torch.softmax at
n = 4096 fell outside, and a sequential fp32 LayerNorm at row mean 1e4 exceeded the bound 238x.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from kcverify.bounds import certify_drift
from kcverify.kernels.realize import run_kernel
from kcverify.kernels.spec import parse_kernel_spec
from kcverify.models.ir import from_onnx

FP32 = parse_kernel_spec("train", {"compute": "fp32", "accumulate": "fp32"})
ORDERS = ("sequential", "reverse", "pairwise")


def _model(op: str, n: int, rows: int):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, n])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, n])
    inits, ins, attrs = [], ["x"], {"axis": -1}
    if op == "LayerNormalization":
        inits = [helper.make_tensor("g", TensorProto.FLOAT, [n], np.ones(n, np.float32)),
                 helper.make_tensor("b", TensorProto.FLOAT, [n], np.zeros(n, np.float32))]
        ins, attrs["epsilon"] = ["x", "g", "b"], 1e-5
    graph = helper.make_graph([helper.make_node(op, ins, ["y"], **attrs)], "g", [x], [y], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _ort(model, x: np.ndarray) -> np.ndarray:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0].astype(np.float64)


def _inside(box, y: np.ndarray) -> float:
    """max over elements of |y - mid| / halfwidth (<= 1 inside); inf for a point outside."""
    lo, hi = box.train_lo, box.train_hi
    assert np.all(lo <= y) and np.all(y <= hi), (
        f"{int(np.sum((y < lo) | (y > hi)))} values outside the training interval, worst by "
        f"{float(np.max(np.maximum(lo - y, y - hi))):.3g}")
    mid, hw = (lo + hi) / 2, (hi - lo) / 2
    return float(np.max(np.abs(y - mid) / np.maximum(hw, 1e-300)))


def _rows(op: str, n: int, mean: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if op == "Softmax":
        return (rng.standard_normal((2, n)) * 3).astype(np.float32)
    return (mean + rng.standard_normal((2, n))).astype(np.float32)


@pytest.mark.parametrize(("op", "n", "mean"), [
    ("Softmax", 256, 0.0), ("Softmax", 4096, 0.0),
    ("LayerNormalization", 256, 0.0), ("LayerNormalization", 4096, 0.0),
    ("LayerNormalization", 4096, 1e3), ("LayerNormalization", 4096, 1e4)])
def test_reference_kernels_inside_the_training_interval(op: str, n: int, mean: float) -> None:
    """torch's and onnxruntime's own fp32 kernels conform to the fp32 training spec."""
    model = _model(op, n, 2)
    x = _rows(op, n, mean, seed=n)
    box = certify_drift(from_onnx(model), FP32, FP32, {"x": x}, domain="interval").outputs["y"]
    t = torch.from_numpy(x)
    ref = (torch.softmax(t, -1) if op == "Softmax"
           else torch.nn.functional.layer_norm(t, (n,), eps=1e-5)).numpy().astype(np.float64)
    _inside(box, ref)
    _inside(box, _ort(model, x))


def _sorted_rows(x: np.ndarray, descending: bool) -> np.ndarray:
    """The row in the order that makes a sequential sum worst: large terms first then small
    ones rounded away (descending), or the reverse."""
    order = np.argsort(np.abs(x), axis=-1)
    if descending:
        order = order[..., ::-1]
    return np.take_along_axis(x, order, -1)


@pytest.mark.parametrize(("op", "n", "mean"), [
    ("Softmax", 4096, 0.0), ("LayerNormalization", 256, 0.0),
    ("LayerNormalization", 4096, 1e4)])
def test_realized_row_sum_orders_inside(op: str, n: int, mean: float) -> None:
    """Programs that sum each row in a chosen order (the realizer's reduce_sum) stay inside,
    value and drift, against a program with another order."""
    model = _model(op, n, 2)
    g = from_onnx(model)
    for descending in (False, True):
        x = _sorted_rows(_rows(op, n, mean, seed=7), descending)
        box = certify_drift(g, FP32, FP32, {"x": x}, domain="interval").outputs["y"]
        ys = {o: run_kernel(g, FP32, {"x": x}, order=o)["y"].numpy() for o in ORDERS}
        for o, y in ys.items():
            _inside(box, y)
            other = ys["pairwise" if o != "pairwise" else "sequential"]
            d = y - other
            assert np.all(box.drift_lo <= d) and np.all(d <= box.drift_hi), o


def test_zonotope_rules_use_the_row_sum_model() -> None:
    """The zonotope's Softmax and LayerNorm rules (domain linear) take the same error model:
    a sequential fp32 sum of a sorted row stays inside."""
    for op, mean in (("Softmax", 0.0), ("LayerNormalization", 1e3)):
        n = 512
        model = _model(op, n, 1)
        g = from_onnx(model)
        x = _sorted_rows(_rows(op, n, mean, seed=3)[:1], descending=True)
        box = certify_drift(g, FP32, FP32, {"x": x}, domain="linear").outputs["y"]
        for o in ORDERS:
            _inside(box, run_kernel(g, FP32, {"x": x}, order=o)["y"].numpy())
        t = torch.from_numpy(x)
        ref = (torch.softmax(t, -1) if op == "Softmax"
               else torch.nn.functional.layer_norm(t, (n,), eps=1e-5)).numpy().astype(np.float64)
        _inside(box, ref)


def _seq_sum(t: np.ndarray) -> np.ndarray:
    """Left-to-right float32 sum of each row (np.add.accumulate is sequential)."""
    return np.add.accumulate(t.astype(np.float32), axis=-1, dtype=np.float32)[..., -1:]


def _softmax_seq(x: np.ndarray) -> np.ndarray:
    """An independent fp32 softmax: correctly rounded subtraction and exp (float64 then one
    rounding: within the spec's 2 ulps), a sequential row sum, one division."""
    d = (x - x.max(-1, keepdims=True)).astype(np.float32)
    e = np.exp(d.astype(np.float64)).astype(np.float32)
    return (e / _seq_sum(e)).astype(np.float64)


def _layernorm_seq(x: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    """An independent fp32 two-pass LayerNorm with sequential row sums."""
    n = np.float32(x.shape[-1])
    mean = (_seq_sum(x) / n).astype(np.float32)
    d = (x - mean).astype(np.float32)
    var = (_seq_sum(d * d) / n).astype(np.float32)
    r = (np.float32(1) / np.sqrt(var + np.float32(eps))).astype(np.float32)
    return (d * r).astype(np.float64)


def _adversarial_softmax_row(n: int) -> np.ndarray:
    """One dominant logit and n - 1 terms just below half an ulp of the running sum: a
    sequential fp32 sum drops every one of them (relative error ~ (n - 1) u)."""
    x = np.full((1, n), np.log(0.99 * 2.0**-24), dtype=np.float64)
    x[0, 0] = 0.0
    return x.astype(np.float32)


@pytest.mark.parametrize("n", [256, 4096])
def test_sequential_row_sums_inside(n: int) -> None:
    """Independent programs (numpy, no kcverify code) with a sequential fp32 row sum on rows
    built to make it lose the most: inside the certified training interval. On the 1-ulp
    row-sum model these fell outside (softmax ~ (n - 1) / 2 times the bound, LayerNorm at row
    mean 1e4 by orders of magnitude)."""
    x = _adversarial_softmax_row(n)
    box = certify_drift(from_onnx(_model("Softmax", n, 1)), FP32, FP32, {"x": x},
                        domain="interval").outputs["y"]
    _inside(box, _softmax_seq(x))
    x = (1e4 + np.random.default_rng(n).standard_normal((2, n))).astype(np.float32)
    box = certify_drift(from_onnx(_model("LayerNormalization", n, 2)), FP32, FP32, {"x": x},
                        domain="interval").outputs["y"]
    _inside(box, _layernorm_seq(x))


def test_realizer_sums_rows_in_its_order() -> None:
    """The realizer's row sums really follow the order: a sequential and a pairwise fp32 sum of
    the same row differ (so the tests above exercise distinct programs)."""
    n = 4096
    model = _model("LayerNormalization", n, 1)
    g = from_onnx(model)
    x = (1e4 + np.random.default_rng(0).standard_normal((1, n))).astype(np.float32)
    a = run_kernel(g, FP32, {"x": x}, order="sequential")["y"].numpy()
    b = run_kernel(g, FP32, {"x": x}, order="pairwise")["y"].numpy()
    assert not np.array_equal(a, b)


def _layernorm_welford(x: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    """An independent fp32 LayerNorm whose moments come from sequential Welford updates (the
    family torch's CPU kernel belongs to), then (x - mean) * rstd."""
    x = x.astype(np.float32)
    mean = np.zeros(x.shape[:-1] + (1,), np.float32)
    m2 = np.zeros_like(mean)
    for k in range(x.shape[-1]):
        xk = x[..., k:k + 1]
        delta = (xk - mean).astype(np.float32)
        mean = (mean + (delta * np.float32(1.0 / (k + 1))).astype(np.float32)).astype(np.float32)
        m2 = (m2 + (delta * (xk - mean).astype(np.float32)).astype(np.float32)).astype(np.float32)
    var = (m2 / np.float32(x.shape[-1])).astype(np.float32)
    r = (np.float32(1) / np.sqrt(var + np.float32(eps))).astype(np.float32)
    return ((x - mean).astype(np.float32) * r).astype(np.float64)


def test_welford_moments_widen_the_two_pass_family() -> None:
    """``moments: welford`` (the older name of the default ``any``) admits Welford / Chan trees
    too: a wider bound that holds a sequential fp32 Welford program and contains the bound of
    the two-pass family alone (``moments: sums``)."""
    n = 256
    welford = parse_kernel_spec("train", {"compute": "fp32", "accumulate": "fp32",
                                          "moments": "welford"})
    two_pass = parse_kernel_spec("train", {"compute": "fp32", "accumulate": "fp32",
                                           "moments": "sums"})
    assert welford.canonical()["moments"] == "welford" and FP32.canonical()["moments"] == "any"
    g = from_onnx(_model("LayerNormalization", n, 2))
    x = (1e3 + np.random.default_rng(4).standard_normal((2, n))).astype(np.float32)
    wide = certify_drift(g, welford, welford, {"x": x}, domain="interval").outputs["y"]
    sums = certify_drift(g, two_pass, two_pass, {"x": x}, domain="interval").outputs["y"]
    assert np.all(wide.train_lo <= sums.train_lo) and np.all(sums.train_hi <= wide.train_hi)
    assert np.any(wide.train_hi - wide.train_lo > sums.train_hi - sums.train_lo)
    _inside(wide, _layernorm_welford(x))
