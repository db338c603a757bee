"""Session 9: a NaN the inference program computes, read by a bounded-range activation.

Semantics §1.1 ("Infinities and NaN"): inf - inf, 0 * inf, 0 / 0 are NaN; the drift of a pair
is NaN where either value is NaN, and a certified drift interval holds NaN only when it is
(-inf, inf) ("a finite linf is never claimed where a value may be infinite"). The engine marks
"NaN possible" by a value set (-inf, inf) and closes each node's *output* under it
(engine.infinite_drift), but the rules of Tanh, Sigmoid, Erf and HardSigmoid map a (-inf, inf)
input to their finite range ([-1, 1], [0, 1]): the NaN is dropped, and the drift comes out finite.

Model (a valid ONNX model, onnx.checker full_check): y = x @ W, m = ReduceMean(y), c = y - m,
logits = Sigmoid(c) (or Tanh / Erf / HardSigmoid). x = [200, 200], W[:, 0] = 200: y0 = 80000,
past fp16's 65504. Inference {compute: fp16, accumulate: fp16}: y0 = inf in every program,
m = inf, c0 = inf - inf = NaN, logits0 = NaN (this suite's interpreter, and torch's float16
ops); training (fp32): logits0 = 1. Certified linf 1.00098 (Sigmoid) / 2.00098 (Tanh, Erf),
interval and best; through a contract (linf <= 1.5, Sigmoid) ``kcverify prove`` proves the
clause and a fresh ``kcverify check`` accepts. Finding F5 of session 9
(/work/notes/s9/adv_findings.md); fixed in the same session by kcverify/bounds/nan.py (the
engine closes every node's outputs under its NaN-possible inputs): these tests assert the fix.

The same with Mul by a constant 0 (box.imul reads 0 * inf as 0): an fp8 tie (tests/bounds/
test_cases' x and w1; y1 casts to 20 or 22) makes d = z - 22 exactly 0 in the sequential
inference program, e = d / d = NaN, out = e * 0 = NaN; certified 1.4e-45 (interval and best).
MatMul by a zero weight keeps (-inf, inf): no violation.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from onnx import TensorProto, helper

from kcverify.bounds import certify_drift
from tests.soundness.adversarial.harness import TRAIN, chain_model, graph_of, spec
from tests.soundness.adversarial.interp import ProgramRunner
from tests.soundness.adversarial.programs import Program

INF16 = spec(compute="fp16", accumulate="fp16")
X = np.array([[200.0, 200.0]], np.float32)
W = np.array([[200.0, 1.0], [200.0, 1.0]], np.float32)  # y = [80000, 400]: y0 overflows fp16
OPS = ("Sigmoid", "Tanh", "Erf", "HardSigmoid")


def nan_model(op: str = "Sigmoid"):
    """logits = op(y - mean(y)), y = x @ W (the last axis centred, as an exported standardisation
    does): NaN at element 0 in every fp16 inference program."""
    nodes = [helper.make_node("MatMul", ["x", "W"], ["y"], name="mm"),
             helper.make_node("ReduceMean", ["y"], ["m"], axes=[-1], keepdims=1, name="mean"),
             helper.make_node("Sub", ["y", "m"], ["c"], name="centre"),
             helper.make_node(op, ["c"], ["logits"], name="act")]
    m = chain_model(nodes, [("x", (1, 2)), ("W", W)], ["logits"], opset=17)
    del m.graph.output[:]
    m.graph.output.append(helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 2]))
    return m


def _programs(model) -> list[tuple[np.ndarray, np.ndarray]]:
    run = ProgramRunner(model)
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # inf - inf in the interpreter
        for order in ("seq", "rev"):
            t = run(Program(TRAIN, order=order), {"x": X})["logits"].astype(np.float64)
            i = run(Program(INF16, order=order), {"x": X})["logits"].astype(np.float64)
            out.append((t, i))
    return out


@pytest.mark.parametrize("op", OPS)
def test_the_inference_programs_compute_nan(op: str) -> None:
    """The premise: this suite's interpreter and torch's float16 ops give NaN at element 0 (the
    training programs 1 or 0.5 .. 1), element 1 finite."""
    import torch

    for t, i in _programs(nan_model(op)):
        assert np.isfinite(t).all() and np.isnan(i[0, 0]) and np.isfinite(i[0, 1])
    y = torch.tensor(X).half() @ torch.tensor(W).half()
    c = y - y.mean(-1, keepdim=True)
    f = {"Sigmoid": torch.sigmoid, "Tanh": torch.tanh, "Erf": torch.erf,
         "HardSigmoid": lambda v: torch.clamp(0.2 * v + 0.5, 0, 1)}[op]
    assert bool(torch.isnan(f(c))[0, 0]) and bool(torch.isfinite(f(c))[0, 1])


@pytest.mark.parametrize("dom", ["interval", "best"])
@pytest.mark.parametrize("op", OPS)
def test_a_nan_input_to_a_bounded_activation_has_no_finite_bound(op: str, dom: str) -> None:
    model = nan_model(op)
    res = certify_drift(graph_of(model), TRAIN, INF16, {"x": X}, domain=dom)
    b = res.outputs["logits"]
    for t, i in _programs(model):
        d = i - t
        nan = np.isnan(d)
        ok = np.where(nan, (b.drift_lo == -np.inf) & (b.drift_hi == np.inf),
                      (b.drift_lo <= d) & (d <= b.drift_hi))
        assert ok.all(), (f"{op} {dom}: certified linf {float(res.linf[0])!r}, drift interval "
                          f"[{b.drift_lo.ravel()}, {b.drift_hi.ravel()}]; a conforming pair's "
                          f"drift {d.ravel()}")


def test_prove_and_check_accept_a_finite_bound_on_a_nan_output(tmp_path) -> None:
    """Through a contract: linf(logits_inf - logits_train) <= 1.5 on the Sigmoid model."""
    from tests.soundness.adversarial.test_s6_contracts import prove_and_check

    model = nan_model("Sigmoid")
    assert any(np.isnan(i).any() for _, i in _programs(model))
    per, checked = prove_and_check(tmp_path, model, X, "nan", "{compute: fp16, accumulate: fp16}",
                                   1.5)  # a valid model (full_check)
    if per is None:
        return  # not proved: the fix
    assert not checked, (f"prove proves linf <= 1.5 (leaf {float(np.max(per))!r}) and check "
                         "accepts; every fp16 inference program outputs NaN at logits[0, 0]")


# fp32 kernels, fp8 activations with a per-tensor scale: tests/bounds/test_cases' tie
FP8 = spec(compute="fp32", accumulate="fp32",
           activations={"format": "fp8_e4m3", "scale": "dynamic_per_tensor"})
TIE_X = np.array([[1.75, 1.0, 1.0, 1.0]], np.float32)
_A = 5 * 2.0**-22
TIE_W1 = np.array([[256, 12, 2], [0, _A, 0], [0, _A, 0], [0, -2 * _A, 0]], np.float32)


def zero_mul_model(zero):
    """y = x @ w1 (y1 = 21 + 2^-19 in order: cast to 22; 21 in reverse: the tie gives 20),
    z = y1 (fp8 cast at mm2), d = z - 22, e = d / d, out = e * zero."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["y"], name="mm1"),
             helper.make_node("MatMul", ["y", "w2"], ["z"], name="mm2"),
             helper.make_node("Sub", ["z", "c"], ["d"], name="sub"),
             helper.make_node("Div", ["d", "d"], ["e"], name="div"),
             helper.make_node("Mul", ["e", "zero"], ["out"], name="mul")]
    return chain_model(nodes, [("x", (1, 4)), ("w1", TIE_W1),
                               ("w2", np.array([[0.0], [1.0], [0.0]], np.float32)),
                               ("c", np.array([[22.0]], np.float32)),
                               ("zero", np.array(zero, np.float32))], ["out"], opset=17)


@pytest.mark.parametrize("dom", ["interval", "best"])
@pytest.mark.parametrize("zero", [0.0, [[0.0]]], ids=["scalar", "matrix"])
def test_mul_by_a_zero_constant_keeps_nan(zero, dom: str) -> None:
    model = zero_mul_model(zero)
    run = ProgramRunner(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        t = run(Program(TRAIN, order="seq"), {"x": TIE_X})["out"].astype(np.float64)
        i = run(Program(FP8, order="seq"), {"x": TIE_X})["out"].astype(np.float64)
    assert np.isfinite(t).all() and np.isnan(i).all()  # the premise: 0 / 0 in inference
    res = certify_drift(graph_of(model), TRAIN, FP8, {"x": TIE_X}, domain=dom)
    b = res.outputs["out"]
    assert bool(((b.drift_lo == -np.inf) & (b.drift_hi == np.inf)).all()), (
        f"{dom}: certified linf {float(res.linf[0])!r}; the sequential pair's drift is NaN")
