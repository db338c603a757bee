"""The rule cache of constants (kcverify.bounds.rules.cache) and the expanded-graph cache:
a hit gives exactly what a fresh computation gives, and a different graph or different weights
never read a stale entry."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from kcverify.bounds import certify_drift
from kcverify.bounds.box import Concrete
from kcverify.bounds.engine import check_rules, expanded, load_rules
from kcverify.bounds.registry import RULES, RuleCtx
from kcverify.bounds.rules import cache
from kcverify.errors import BoundError
from kcverify.kernels.spec import parse_kernel_spec
from kcverify.models.ir import Node, from_onnx

FP32 = parse_kernel_spec("t", {"compute": "fp32", "accumulate": "fp32"})
FP8 = parse_kernel_spec("i", {"weights": {"format": "fp8_e4m3", "scale": "per_channel"},
                              "activations": {"format": "fp8_e4m3", "scale": "dynamic_per_tensor"},
                              "compute": "fp32", "accumulate": "fp32"})


def _mlp(w: np.ndarray, b: np.ndarray):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", w.shape[0]])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", w.shape[1]])
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
             helper.make_node("Add", ["h", "B"], ["y"], name="add")]
    g = helper.make_graph(nodes, "mlp", [x], [y],
                          [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "B")])
    return from_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


def _arrays(res) -> list[np.ndarray]:
    return [a for d in res.outputs.values() for a in d.arrays()]


def _same(r1, r2) -> bool:
    return all(np.array_equal(a, b, equal_nan=True) for a, b in zip(_arrays(r1), _arrays(r2)))


def test_cached_result_equals_fresh_and_weights_change_invalidate() -> None:
    rng = np.random.default_rng(0)
    w = rng.normal(size=(8, 4)).astype(np.float32)
    b = rng.normal(size=(4,)).astype(np.float32)
    x = rng.normal(size=(2, 8)).astype(np.float32)
    cache.clear()
    fresh = certify_drift(_mlp(w, b), FP32, FP8, x, domain="interval")
    assert cache.size()[0] > 0
    again = certify_drift(_mlp(w, b), FP32, FP8, x, domain="interval")  # a new graph, same values
    assert _same(fresh, again)
    # the same shapes, other weights: not the cached entry
    w2 = w.copy()
    w2[3, 1] *= 4.0
    other = certify_drift(_mlp(w2, b), FP32, FP8, x, domain="interval")
    cache.clear()
    other_fresh = certify_drift(_mlp(w2, b), FP32, FP8, x, domain="interval")
    assert _same(other, other_fresh) and not _same(other, fresh)


def test_checksum_collision_is_caught(monkeypatch) -> None:
    """A hit is confirmed by comparing the values: even with every checksum equal, different
    constants get their own results."""
    load_rules()
    monkeypatch.setattr(cache.zlib, "crc32", lambda data: 0)
    cache.clear()
    ctx = RuleCtx(Node("n", "Add", ("a", "b"), ("y",), {}), FP32, FP8, {"b"})
    c1 = Concrete(torch.tensor([1.0, 2.0], dtype=torch.float32))
    c2 = Concrete(torch.tensor([1.0, 3.0], dtype=torch.float32))
    b1, b2 = cache.lift(ctx, c1), cache.lift(ctx, c2)
    assert b1.th.tolist() == [1.0, 2.0] and b2.th.tolist() == [1.0, 3.0]
    assert cache.lift(ctx, c1).th.tolist() == [1.0, 2.0]
    # other specs: not the entry of the first pair
    ctx2 = RuleCtx(ctx.node, FP8, FP32, {"b"})
    assert cache.lift(ctx2, c1) is not b1
    y = RULES[("Add", "interval")](ctx, c1, c2)
    assert y.th.tolist()[1] >= 5.0


def test_expanded_and_checked_memo_follow_the_graph() -> None:
    rng = np.random.default_rng(1)
    w = rng.normal(size=(8, 4)).astype(np.float32)
    g1 = _mlp(w, np.zeros(4, np.float32))
    g2 = _mlp(w, np.ones(4, np.float32))
    e1 = expanded(g1, "interval")
    assert expanded(g1, "interval") is e1
    e2 = expanded(g2, "interval")
    assert e2 is not e1 and np.array_equal(np.asarray(e2.initializers["B"]), np.ones(4))
    # a graph whose nodes change is checked again, and expanded again
    check_rules(g1, "interval", set())
    n = g1.nodes[1]
    g1.nodes[1] = Node(n.name, "NoSuchOp", n.inputs, n.outputs, {})
    with pytest.raises(BoundError, match="NoSuchOp"):
        check_rules(g1, "interval", set())
    assert expanded(g1, "interval").nodes[1].op_type == "NoSuchOp"
    # an op without a rule but with a function body is expanded (and re-expanded when its
    # rule disappears)
    g1.nodes[1] = Node(n.name, "HardSwish", ("h",), n.outputs, {})
    ops = [m.op_type for m in expanded(g1, "interval").nodes]
    assert "HardSwish" not in ops and "Mul" in ops
    check_rules(g1, "interval", set())
