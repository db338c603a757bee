"""Hand-computed small cases per rule, and the dispatcher's checks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from kcverify.bounds import DiffBox, Region, bound_block, certify_drift
from kcverify.bounds.box import Box, check_box
from kcverify.bounds.engine import blocks_of, load_rules
from kcverify.bounds.registry import RuleCtx
from kcverify.errors import BoundError, InternalError
from kcverify.kernels.spec import parse_kernel_spec
from kcverify.models.ir import Node, from_onnx

F64 = torch.float64
EXACT = parse_kernel_spec("t", {"compute": "fp64", "accumulate": "fp64"})
FP32 = parse_kernel_spec("t", {"compute": "fp32", "accumulate": "fp32"})
BF16 = parse_kernel_spec("i", {"compute": "bf16", "accumulate": "fp32"})
FP8 = parse_kernel_spec("i", {"weights": {"format": "fp8_e4m3", "scale": "per_tensor"},
                              "activations": {"format": "fp8_e4m3", "scale": "none"},
                              "compute": "fp64", "accumulate": "fp64"})


def _ctx(op: str, train=EXACT, inf=EXACT, **attrs) -> RuleCtx:
    load_rules()
    return RuleCtx(Node("n", op, ("a",), ("y",), attrs), train, inf, set())


def _box(tl, th, il=None, ih=None) -> Box:
    t = [torch.tensor(v, dtype=F64) for v in (tl, th)]
    i = [torch.tensor(v, dtype=F64) for v in ((tl if il is None else il), (th if ih is None else ih))]
    return Box.make(t[0], t[1], i[0], i[1])


def _rule(op: str):
    from kcverify.bounds.registry import RULES

    load_rules()
    return RULES[(op, "interval")]


def test_relu_hand() -> None:
    y = _rule("Relu")(_ctx("Relu"), _box([-1.0, 1.0, -2.0], [2.0, 3.0, -1.0]))
    assert y.tl.tolist() == [0.0, 1.0, 0.0] and y.th.tolist() == [2.0, 3.0, 0.0]
    # same inputs in both kernels' sets: drift in [lo_i - hi_t, hi_i - lo_t] clipped by relu
    assert abs(y.dl[2].item()) < 1e-300 and abs(y.dh[2].item()) < 1e-300


def test_add_and_mul_hand() -> None:
    a, b = _box([1.0], [2.0]), _box([-1.0], [3.0])
    y = _rule("Add")(_ctx("Add"), a, b)
    assert pytest.approx(0.0, abs=1e-12) == y.tl.item() and pytest.approx(5.0) == y.th.item()
    y = _rule("Mul")(_ctx("Mul"), a, b)
    assert pytest.approx(-2.0) == y.tl.item() and pytest.approx(6.0) == y.th.item()


def test_softmax_two_equal_logits() -> None:
    x = _box([[0.5, 0.5]], [[0.5, 0.5]])
    y = _rule("Softmax")(_ctx("Softmax", axis=-1), x)
    assert pytest.approx(0.5, abs=1e-12) == y.tl[0, 0].item()
    assert pytest.approx(0.5, abs=1e-12) == y.th[0, 1].item()


def test_softmax_box_hand() -> None:
    """x0 in [0, 1], x1 = 0: p0 in [1/2, e/(e+1)]."""
    y = _rule("Softmax")(_ctx("Softmax", axis=-1), _box([[0.0, 0.0]], [[1.0, 0.0]]))
    assert pytest.approx(0.5, abs=1e-9) == y.tl[0, 0].item()
    assert pytest.approx(math.e / (math.e + 1), abs=1e-9) == y.th[0, 0].item()


def test_gelu_contains_minimum() -> None:
    y = _rule("Gelu")(_ctx("Gelu", approximate="none"), _box([-2.0], [1.0]))
    assert y.tl.item() <= -0.16997 and y.tl.item() > -0.171
    assert pytest.approx(0.8413447460685429, rel=1e-9) == y.th.item()


def test_layernorm_point_is_exact_in_fp64() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0, 6.0]], dtype=F64)
    b = Box.make(x, x, x, x)
    y = _rule("LayerNormalization")(_ctx("LayerNormalization", epsilon=0.0), b)
    ref = (x - x.mean()) / x.std(unbiased=False)
    assert torch.allclose(y.tl, ref, atol=1e-12) and torch.allclose(y.th, ref, atol=1e-12)


def test_matmul_fp8_weight_drift_hand() -> None:
    """x = [1, 1] @ W with W = [[0.3], [0.1]]: fp8 per-tensor Q(W) is known exactly, so the
    drift is sum(Q(W)) - sum(W) up to float64 padding."""
    from kcverify.bounds.box import Concrete
    from kcverify.kernels.scale import quantize_weight

    w = torch.tensor([[0.3], [0.1]], dtype=F64)
    q, _ = quantize_weight(w, FP8.weights, -1, -2)
    ctx = _ctx("MatMul", EXACT, FP8)
    ctx.node = Node("n", "MatMul", ("a", "w"), ("y",), {})
    ctx.constants = {"w"}
    x = torch.ones(1, 2, dtype=F64)
    y = _rule("MatMul")(ctx, Box.make(x, x, x, x), Concrete(w))
    expect = float(q.sum() - w.sum())
    assert pytest.approx(expect, abs=1e-12) == y.dl.item()
    assert pytest.approx(expect, abs=1e-12) == y.dh.item()


def test_check_box_rejects_nan_and_empty() -> None:
    """An empty interval or NaN from finite inputs is a soundness bug: InternalError (exit 3,
    a traceback), never BoundError (bad input)."""
    z = torch.zeros(2, dtype=F64)
    bad = Box(z, z, z, z, torch.tensor([1.0, 0.0], dtype=F64), z)
    with pytest.raises(InternalError, match="empty interval"):
        check_box(bad, None, "X node 'n'", False)
    nan = Box(z, torch.tensor([math.nan, 0.0], dtype=F64), z, z, z, z)
    with pytest.raises(InternalError, match="NaN"):
        check_box(nan, None, "X node 'n'", False)
    assert check_box(nan, None, "X node 'n'", True).th[0].item() == math.inf


def _graph(nodes, inputs, outputs, inits=()):
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return from_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)]))


def test_missing_rules_listed_together() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    g = _graph([helper.make_node("Sin", ["x"], ["a"], name="s1"),
                helper.make_node("Cos", ["a"], ["b"], name="c1"),
                helper.make_node("Sin", ["b"], ["y"], name="s2")], [x], [y])
    with pytest.raises(BoundError) as e:
        certify_drift(g, FP32, BF16, np.zeros((1, 4), np.float32))
    msg = str(e.value)
    assert "Cos (nodes: 'c1')" in msg and "Sin (nodes: 's1', 's2')" in msg and "registered:" in msg


def test_diffbox_plain_roundtrip_and_contains() -> None:
    a = np.array([[1.0, -2.0]])
    d = DiffBox(a - 1, a + 1, a - 1, a + 1, a * 0 - 0.5, a * 0 + 0.5)
    e = DiffBox.from_plain(d.to_plain())
    assert d.contains(e) and e.contains(d)
    assert d.contains(DiffBox.point(a)) and not DiffBox.point(a).contains(d)
    assert d.linf().tolist() == [0.5]


def test_bound_block_recomputes_the_record() -> None:
    g = from_onnx(__import__("onnx").load("models/mlp_tiny.onnx"))
    x = np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32)
    res = certify_drift(g, FP32, BF16, x, region=Region("input", "linf", 0.01))
    assert len(res.blocks) == len(blocks_of(g))
    for rec, blk in zip(res.blocks, blocks_of(g)):
        again = bound_block(blk, FP32, BF16, rec.in_state, rec.method)
        assert all(rec.out_state[k].contains(again[k]) for k in again)
    assert res.linf.shape == (3,) and np.all(np.isfinite(res.linf)) and np.all(res.linf > 0)


def test_identical_kernels_point_drift_is_tiny_and_region_bigger() -> None:
    g = from_onnx(__import__("onnx").load("models/mlp_tiny.onnx"))
    x = np.random.default_rng(0).normal(size=(2, 4)).astype(np.float32)
    p = certify_drift(g, FP32, FP32, x).linf
    r = certify_drift(g, FP32, FP32, x, region=Region("input", "linf", 0.1)).linf
    assert np.all(p < 1e-4) and np.all(r >= p)


def test_gemm_with_initializers_runs() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 1])
    w = numpy_helper.from_array(np.array([[1.0, 2.0]], np.float32), "w")
    c = numpy_helper.from_array(np.array([0.5], np.float32), "c")
    g = _graph([helper.make_node("Gemm", ["x", "w", "c"], ["y"], transB=1)], [x], [y], [w, c])
    res = certify_drift(g, EXACT, EXACT, np.array([[1.0, 1.0]], np.float32))
    assert pytest.approx(3.5, abs=1e-9) == res.outputs["y"].train_lo.item()
