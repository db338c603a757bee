"""Session 9: 0 * inf, a NaN that arithmetic makes from two non-NaN operands.

Semantics §1.1 ("Infinities and NaN"): 0 * inf is NaN; a pair's drift is NaN where either value
is NaN, and a certified drift interval holds NaN only when it is (-inf, inf). The engine's NaN
closure (kcverify/bounds/nan.py, F5 of session 9) carries a NaN-possible *input* (value set
(-inf, inf)) to the outputs, but a value that may be +inf is not NaN-possible, and box.imul
reads 0 * inf as 0 ("bounds are of finite values"): an overflowed value times a constant 0 gets
the value set [0, 0] and a finite drift, while every program computes NaN.

Model (a valid ONNX model): y = Exp(x), logits = y * mask, mask = [[0, 1]] (a masking multiply;
a scalar 0 the same). x = [89, -1]: exp(89) = 4.49e38 > fp32's 3.40e38, so y0 = inf in every fp32
program and logits0 = inf * 0 = NaN. Training and inference both {compute: fp32, accumulate:
fp32} (the drift of two NaNs is NaN). Certified drift [-1.4e-45, 1.4e-45] at element 0 (interval
and best); through a contract (linf <= 0.01) ``kcverify prove`` proves the clause and a fresh
``kcverify check`` accepts. fp16 / bf16 compute lift the constant 0 to its format neighbours
(+-6e-8): the product's set is (-inf, inf) there, no violation; MatMul / Gemm by a zero weight and
a Relu gate that is exactly 0 keep (-inf, inf) too. Finding F6 of session 9
(/work/notes/s9/adv_findings.md).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from onnx import TensorProto, helper

from kcverify.bounds import certify_drift
from tests.soundness.adversarial.harness import TRAIN, chain_model, graph_of
from tests.soundness.adversarial.interp import ProgramRunner
from tests.soundness.adversarial.programs import Program

X = np.array([[89.0, -1.0]], np.float32)  # exp(89) overflows fp32
MASKS = {"scalar": np.array(0.0, np.float32), "mask": np.array([[0.0, 1.0]], np.float32)}


def inf0_model(mask: np.ndarray, after: str | None = None):
    """logits = Exp(x) * mask (then ``after``, e.g. Sigmoid)."""
    out = "p" if after else "logits"
    nodes = [helper.make_node("Exp", ["x"], ["y"], name="exp"),
             helper.make_node("Mul", ["y", "mask"], [out], name="mask_mul")]
    if after:
        nodes.append(helper.make_node(after, ["p"], ["logits"], name="act"))
    m = chain_model(nodes, [("x", (1, 2)), ("mask", mask)], ["logits"], opset=17)
    del m.graph.output[:]
    m.graph.output.append(helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 2]))
    return m


def _pairs(model) -> list[np.ndarray]:
    run = ProgramRunner(model)
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # inf * 0 in the interpreter
        for ot in ("seq", "rev"):
            for oi in ("seq", "rev"):
                t = run(Program(TRAIN, order=ot), {"x": X})["logits"].astype(np.float64)
                i = run(Program(TRAIN, order=oi), {"x": X})["logits"].astype(np.float64)
                out.append(i - t)
    return out


def test_every_program_computes_nan() -> None:
    """The premise: the suite's interpreter and torch's float32 ops give NaN at element 0."""
    import torch

    for d in _pairs(inf0_model(MASKS["mask"])):
        assert np.isnan(d[0, 0]) and np.isfinite(d[0, 1])
    assert bool(torch.isnan(torch.exp(torch.tensor(X)) * torch.tensor(MASKS["mask"]))[0, 0])


def _assert_contains(model, dom: str) -> None:
    res = certify_drift(graph_of(model), TRAIN, TRAIN, {"x": X}, domain=dom)
    b = res.outputs["logits"]
    for d in _pairs(model):
        ok = np.where(np.isnan(d), (b.drift_lo == -np.inf) & (b.drift_hi == np.inf),
                      (b.drift_lo <= d) & (d <= b.drift_hi))
        assert ok.all(), (f"{dom}: certified drift [{b.drift_lo.ravel()}, {b.drift_hi.ravel()}]"
                          f"; a conforming pair's drift {d.ravel()}")


@pytest.mark.parametrize("dom", ["interval", "best"])
@pytest.mark.parametrize("mask", sorted(MASKS))
def test_an_overflowed_value_times_a_zero_constant_is_nan(mask: str, dom: str) -> None:
    _assert_contains(inf0_model(MASKS[mask]), dom)


def test_the_nan_of_inf_times_zero_read_by_a_sigmoid() -> None:
    _assert_contains(inf0_model(MASKS["scalar"], after="Sigmoid"), "interval")


@pytest.mark.parametrize("op", ["MatMul", "Gemm"])
def test_a_zero_weight_keeps_nan(op: str) -> None:
    """No violation (checked): the MatMul / Gemm rules make inf * 0 (-inf, inf)."""
    nodes = [helper.make_node("Exp", ["x"], ["y"], name="exp"),
             helper.make_node(op, ["y", "Z"], ["logits"], name="mm")]
    m = chain_model(nodes, [("x", (1, 2)), ("Z", np.array([[0.0], [1.0]], np.float32))],
                    ["logits"], opset=17)
    res = certify_drift(graph_of(m), TRAIN, TRAIN, {"x": X}, domain="interval")
    b = res.outputs["logits"]
    assert bool(((b.drift_lo == -np.inf) & (b.drift_hi == np.inf)).all())


def test_prove_and_check_accept_a_finite_bound_on_inf_times_zero(tmp_path) -> None:
    from tests.soundness.adversarial.test_s6_contracts import prove_and_check

    per, checked = prove_and_check(tmp_path, inf0_model(MASKS["mask"]), X, "inf0",
                                   "{compute: fp32, accumulate: fp32}", 0.01)
    if per is None:
        return  # not proved: the fix
    assert not checked, (f"prove proves linf <= 0.01 (leaf {float(np.max(per))!r}) and check "
                         "accepts; every fp32 program outputs NaN at logits[0, 0]")
