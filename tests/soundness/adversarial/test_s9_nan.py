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
(/work/notes/s9/adv_findings.md); xfail(strict) until a rule's (-inf, inf) input gives a
(-inf, inf) output (or the dispatcher closes every float op under NaN inputs).
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


@pytest.mark.xfail(strict=True, reason="F5 s9: a bounded-range activation drops a NaN input")
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


@pytest.mark.xfail(strict=True, reason="F5 s9: prove proves and check accepts a NaN output")
def test_prove_and_check_accept_a_finite_bound_on_a_nan_output(tmp_path) -> None:
    """Through a contract: linf(logits_inf - logits_train) <= 1.5 on the Sigmoid model."""
    import onnx

    from tests.soundness.adversarial.test_s6_contracts import check_fresh, mlp_contract
    from tests.soundness.adversarial.test_s6_util import leaf_bounds, prove_cert

    model = nan_model("Sigmoid")
    onnx.checker.check_model(model, full_check=True)  # a valid model
    assert any(np.isnan(i).any() for _, i in _programs(model))
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    np.save(tmp_path / "x.npy", X)
    st = prove_cert(tmp_path, mlp_contract("nan", "{compute: fp16, accumulate: fp16}",
                                           tmp_path / "x.npy", threshold=1.5), path)
    per = leaf_bounds(st, "N-1")
    if per is None:
        return  # not proved: the fix
    checked = check_fresh(st, path).returncode == 0
    assert not checked, (f"prove proves linf <= 1.5 (leaf {float(np.max(per))!r}) and check "
                         "accepts; every fp16 inference program outputs NaN at logits[0, 0]")
