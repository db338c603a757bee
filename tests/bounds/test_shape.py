"""Movement and concrete ops are bounded by the executor's own op functions (rules/shape.py):
on random inputs and attributes, a rule's bounds are the executor's outputs on each bound, and
an all-concrete node evaluates to the executor's value; negative Slice steps, Mod of constants,
schema defaults and unknown attributes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from kcverify.bounds import certify_drift
from kcverify.bounds.box import Box, Concrete
from kcverify.bounds.engine import load_rules
from kcverify.bounds.registry import CONCRETE_OPS, RULES, RuleCtx
from kcverify.errors import BoundError
from kcverify.kernels.spec import parse_kernel_spec
from kcverify.models.executor import Executor
from kcverify.models.ir import from_onnx

TRAIN = parse_kernel_spec("train", {"compute": "fp32", "accumulate": "fp32"})
INF = parse_kernel_spec("inf", {"compute": "bf16", "accumulate": "fp32"})
F64 = torch.float64


def _graph(op: str, inputs: list, attrs: dict, n_out: int = 1, opset: int = 18):
    """One node; inputs: (name, ndarray, is_constant) -- constants are initializers."""
    ins, inits = [], []
    for name, arr, const in inputs:
        if arr is None:
            continue
        if const:
            inits.append(numpy_helper.from_array(arr, name))
        else:
            ins.append(helper.make_tensor_value_info(name, TensorProto.DOUBLE, list(arr.shape)))
    outs = [helper.make_tensor_value_info(f"y{k}", TensorProto.UNDEFINED, None) for k in range(n_out)]
    node = helper.make_node(op, [n if a is not None else "" for n, a, _ in inputs],
                            [f"y{k}" for k in range(n_out)], name="n0", **attrs)
    g = helper.make_graph([node], op, ins, outs, inits)
    return from_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]), op)


def _reference(g, inputs) -> list[torch.Tensor]:
    ex = Executor(g, dtype=F64)
    feeds = {n: a for n, a, c in inputs if a is not None and not c}
    out = ex.run(feeds)
    return [out[v.name] for v in g.outputs]


def _rule_on_box(g, inputs, lo: np.ndarray, hi: np.ndarray) -> list[Box]:
    """The interval rule of the graph's node on the box [lo, hi] of its first float input (the
    other inputs exact), called the way the engine calls it."""
    load_rules()
    n = g.nodes[0]
    ctx = RuleCtx(n, TRAIN, INF, set(g.constant_names()), g.opset)
    args = []
    first = True
    for _name, arr, const in inputs:
        if arr is None:
            args.append(None)
        elif not const and first and arr.dtype.kind == "f":
            t_lo, t_hi = torch.as_tensor(lo, dtype=F64), torch.as_tensor(hi, dtype=F64)
            args.append(Box(t_lo, t_hi, t_lo - 1, t_hi + 1, t_lo - t_hi, t_hi - t_lo))
            first = False
        else:
            args.append(Concrete(torch.as_tensor(arr)))
    out = RULES[(n.op_type, "interval")](ctx, *args)
    return list(out) if isinstance(out, tuple) else [out]


def _slice_case(rng):
    x = rng.normal(size=(4, 5, 6))
    k = int(rng.integers(1, 4))
    axes = rng.choice(3, size=k, replace=False)
    starts, ends, steps = [], [], []
    for a in axes:
        d = x.shape[a]
        step = int(rng.choice([-3, -2, -1, 1, 2, 3]))
        starts.append(int(rng.integers(-d - 2, d + 2)))
        ends.append(int(rng.choice([rng.integers(-d - 2, d + 2), -2**62, 2**62])))
        steps.append(step)
    return "Slice", [("x", x, False), ("st", np.array(starts), True), ("en", np.array(ends), True),
                     ("ax", np.array(axes, np.int64), True), ("sp", np.array(steps), True)], {}, 1


def _cases(rng):
    x = rng.normal(size=(2, 3, 4))
    perm = [int(p) for p in rng.permutation(3)]
    idx = rng.integers(-3, 3, size=(2, 2)).astype(np.int64)
    yield "Transpose", [("x", x, False)], {"perm": perm}, 1
    yield "Reshape", [("x", x, False), ("s", np.array([0, -1, 2]), True)], {}, 1
    yield "Gather", [("x", x, False), ("i", idx, True)], {"axis": 1}, 1
    yield "Gather", [("x", x, False), ("i", rng.integers(-2, 2, size=(3,)).astype(np.int64), True)], {}, 1
    yield "Concat", [("x", x, False), ("z", rng.normal(size=(2, 3, 2)).astype(np.float32), True)],\
        {"axis": -1}, 1
    yield "Split", [("x", x, False), ("s", np.array([1, 3]), True)], {"axis": 2}, 2
    yield "Split", [("x", rng.normal(size=(2, 7)), False)], {"axis": 1, "num_outputs": 3}, 3
    yield "Squeeze", [("x", rng.normal(size=(2, 1, 4, 1)), False), ("a", np.array([-1]), True)], {}, 1
    yield "Unsqueeze", [("x", x, False), ("a", np.array([0, -1]), True)], {}, 1
    yield "Expand", [("x", rng.normal(size=(3, 1)), False), ("s", np.array([2, 1, 4]), True)], {}, 1
    yield "Flatten", [("x", x, False)], {"axis": int(rng.integers(-3, 4))}, 1
    yield "Trilu", [("x", rng.normal(size=(2, 4, 5)), False), ("k", np.array(int(rng.integers(-2, 3))), True)],\
        {"upper": int(rng.integers(0, 2))}, 1
    yield "Where", [("c", rng.random(size=(3, 4)) < 0.5, True), ("x", x, False),
                    ("z", rng.normal(size=(4,)).astype(np.float32), True)], {}, 1
    yield _slice_case(rng)


@pytest.mark.parametrize("seed", range(12))
def test_movement_rule_is_the_executor_on_each_bound(seed: int) -> None:
    """Bound k of the rule's result is the executor's op on bound k of the input (and a point
    in the box maps into the result): the two semantics disagree nowhere."""
    rng = np.random.default_rng(seed)
    for op, inputs, attrs, n_out in _cases(rng):
        g = _graph(op, inputs, attrs, n_out)
        fl = next(a for _, a, c in inputs if not c)
        lo = fl - rng.random(size=fl.shape)
        hi = fl + rng.random(size=fl.shape)
        boxes = _rule_on_box(g, inputs, lo, hi)
        # a float constant is exact in the fp32 training kernel, widened (stored in bf16) in the
        # inference kernel: compare the inference bounds only without one
        pairs = [(0, lo), (1, hi)]
        if not any(c and a.dtype.kind == "f" for _, a, c in inputs):
            pairs += [(2, lo - 1), (3, hi + 1)]
        for bound, arr in pairs:
            ref = _reference(g, [(n, arr if a is fl else a, c) for n, a, c in inputs])
            assert len(boxes) == len(ref) == n_out, op
            for b, r in zip(boxes, ref):
                got = b.parts()[bound]
                assert got.shape == r.shape, (op, attrs, got.shape, r.shape)
                assert torch.equal(got, r.to(F64)), (op, attrs, bound)
        ref = _reference(g, inputs)
        for b, r in zip(boxes, ref):
            assert bool(((b.tl <= r) & (r <= b.th)).all()), op


def _concrete_cases(rng):
    a = rng.integers(-20, 20, size=(3, 4)).astype(np.int64)
    b = rng.integers(1, 7, size=(4,)).astype(np.int64) * rng.choice([-1, 1], size=(4,))
    f = rng.normal(size=(3, 4)) * 5
    yield "Mod", [("a", a, True), ("b", b, True)], {}, 1
    yield "Mod", [("a", f, True), ("b", np.abs(f[0]) + 0.5, True)], {"fmod": 1}, 1
    yield "Floor", [("a", f, True)], {}, 1
    yield "Ceil", [("a", f, True)], {}, 1
    yield "Range", [("s", np.array(int(rng.integers(-5, 5))), True), ("l", np.array(9), True),
                    ("d", np.array(int(rng.choice([1, 2, 3]))), True)], {}, 1
    yield "Cast", [("a", f, True)], {"to": TensorProto.INT64}, 1
    yield "Cast", [("a", f, True)], {"to": TensorProto.FLOAT16}, 1
    yield "Shape", [("a", f, True)], {"start": -1}, 1
    yield "ConstantOfShape", [("s", np.array([2, 3]), True)], \
        {"value": numpy_helper.from_array(np.array([7], np.int64))}, 1
    yield "Div", [("a", a, True), ("b", b, True)], {}, 1
    yield "Equal", [("a", a, True), ("b", b, True)], {}, 1
    yield _slice_case(rng)[0], [(n, arr, True) for n, arr, _ in _slice_case(rng)[1]], {}, 1


@pytest.mark.parametrize("seed", range(6))
def test_concrete_evaluation_is_the_executor(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    for op, inputs, attrs, n_out in _concrete_cases(rng):
        g = _graph(op, inputs, attrs, n_out)
        n = g.nodes[0]
        vals = [torch.as_tensor(a) if a is not None else None for _, a, _ in inputs]
        got = CONCRETE_OPS[op](n, g.opset, *vals)
        ref = Executor(g, dtype=F64).constants
        for name, v in zip(n.outputs, got):
            r = ref[name]
            assert v.shape == r.shape, op
            if r.is_floating_point():
                assert torch.equal(v.to(F64), r.to(F64)), (op, attrs)
            else:
                assert torch.equal(v, r), (op, attrs)


def test_negative_slice_step() -> None:
    """x[4:0:-2] on the last axis, through the engine: the reversed elements, bounds moved."""
    x = np.arange(12, dtype=np.float64).reshape(2, 6) / 8
    g = _graph("Slice", [("x", x, False), ("st", np.array([4]), True), ("en", np.array([0]), True),
                         ("ax", np.array([1]), True), ("sp", np.array([-2]), True)], {})
    res = certify_drift(g, TRAIN, TRAIN, x.astype(np.float32), domain="interval")
    out = res.outputs["y0"]
    np.testing.assert_array_equal(out.train_lo, x[:, 4:0:-2])
    np.testing.assert_array_equal(out.train_hi, x[:, 4:0:-2])


def test_mod_of_constants_feeds_a_reshape() -> None:
    """A torch legacy export computes head sizes with Mod of constants: evaluated exactly."""
    x = np.random.default_rng(0).normal(size=(2, 8)).astype(np.float32)
    nodes = [helper.make_node("Mod", ["a", "b"], ["m"], name="mod"),
             helper.make_node("Concat", ["two", "m"], ["shape"], axis=0, name="cat"),
             helper.make_node("Reshape", ["x", "shape"], ["y0"], name="rs")]
    inits = [numpy_helper.from_array(np.array([12], np.int64), "a"),
             numpy_helper.from_array(np.array([-4], np.int64), "b"),
             numpy_helper.from_array(np.array([2], np.int64), "two")]
    g = helper.make_graph(nodes, "mod", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                          [helper.make_tensor_value_info("y0", TensorProto.FLOAT, None)], inits)
    graph = from_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), "mod")
    # 12 mod -4 = 0 (sign of the divisor): a 0 copies the input's dim
    res = certify_drift(graph, TRAIN, TRAIN, x, domain="interval")
    np.testing.assert_array_equal(res.outputs["y0"].train_lo, x.astype(np.float64))


def test_unknown_attribute_is_refused_by_name() -> None:
    x = np.zeros((2, 3), np.float32)
    g = _graph("Transpose", [("x", x.astype(np.float64), False)], {"perm": [1, 0], "fancy": 1})
    with pytest.raises(BoundError, match=r"Transpose node 'n0'.*attribute 'fancy'.*handled: perm"):
        certify_drift(g, TRAIN, TRAIN, x, domain="interval")


def test_attribute_defaults_come_from_the_schema(monkeypatch) -> None:
    """Split without ``axis``: the schema's default (0), not a default written in a rule."""
    from kcverify.bounds.rules import shape

    x = np.arange(8, dtype=np.float64).reshape(4, 2)
    g = _graph("Split", [("x", x, False)], {"num_outputs": 2}, n_out=2)
    assert shape.schema_defaults("Split", 18)["axis"] == 0
    boxes = _rule_on_box(g, [("x", x, False)], x, x)
    assert [tuple(b.shape) for b in boxes] == [(2, 2), (2, 2)]
    monkeypatch.setitem(shape.schema_defaults("Split", 18), "axis", 1)  # the cached dict
    boxes = _rule_on_box(g, [("x", x, False)], x, x)
    assert [tuple(b.shape) for b in boxes] == [(4, 1), (4, 1)]


@pytest.mark.parametrize("seed", range(4))
def test_slice_matches_onnxruntime(seed: int) -> None:
    """The one Slice semantics (the executor's) against onnxruntime, negative steps, clamped
    starts (the spec's [0, dim - 1] for negative steps; onnx.reference's numpy slicing differs
    there) and empty results included."""
    import onnxruntime as ort

    rng = np.random.default_rng(200 + seed)
    for _ in range(25):
        _, inputs, _, _ = _slice_case(rng)
        ins = [helper.make_tensor_value_info(n, TensorProto.DOUBLE if a.dtype.kind == "f"
                                             else TensorProto.INT64, list(a.shape))
               for n, a, _ in inputs]
        node = helper.make_node("Slice", [n for n, _, _ in inputs], ["y0"])
        m = helper.make_model(helper.make_graph([node], "s", ins, [helper.make_tensor_value_info(
            "y0", TensorProto.DOUBLE, None)]), opset_imports=[helper.make_opsetid("", 18)])
        m.ir_version = 9
        sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        want = sess.run(None, {n: a for n, a, _ in inputs})[0]
        got = _reference(_graph("Slice", inputs, {}), inputs)[0].numpy()
        assert got.shape == want.shape and np.array_equal(got, want)
