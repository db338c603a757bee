"""Session 9 (round 6): torch's fp32 Gelu (erf form) is outside the training value set.

Semantics §1: torch's own fp32 kernels must conform to the default training spec. torch 2.13's
CPU Gelu (approximate = none) evaluates erf with its own vectorised approximation on every tensor
of two or more elements (a one-element tensor takes the scalar path, std::erf, accurate). Its
absolute error reaches 8.8e-7 at x = -2.9662 (gelu = -0.0044716, torch -0.0044725): 1.43x the
Gelu rule's allowance (0.5 (5 + k) |x| + 1.1 |f|) u + ... there (167 of 80,001 grid points of
[-8, 0] are outside the set; torch.erf alone is within 3e-8, onnxruntime's Gelu within 0.2x).

A false certificate from it (finding F9 of session 9): logits = Log(Gelu(x) - c), x = -2.9662
(two elements), c = -0.0044723, both kernels fp32. The engine's set of Gelu(x) - c is
[7.1e-8, 1.3e-6] (positive), so Log's drift is certified +-2.91 (interval and best); torch's
fp32 program computes Gelu(x) - c = -1.9e-7 and Log of it NaN, onnxruntime (and torch on one
element) -14.18: the pair's drift is NaN. Through a contract (linf <= 5) prove proves and a fresh
check accepts. Measured on this machine (2-core CPU sandbox, torch 2.13 CPU, AVX2 path); a test
whose premise (torch's vectorised value) does not reproduce skips.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

from kcverify.bounds import certify_drift
from kcverify.errors import BoundError
from tests.soundness.adversarial.harness import TRAIN, chain_model, graph_of

N = helper.make_node
X = np.float32(-2.9662001)
C = np.float32(-0.0044723)
XS = np.full((1, 2), X, np.float32)


def _torch_gelu(x: np.ndarray) -> np.ndarray:
    return torch.nn.functional.gelu(torch.from_numpy(x)).double().numpy()


def _premise() -> None:
    if not (_torch_gelu(XS) < float(C)).all():
        pytest.skip("torch's vectorised fp32 Gelu is accurate at x = -2.9662 on this CPU")


def _holds(lo, hi, v) -> np.ndarray:
    lo, hi = np.asarray(lo), np.asarray(hi)
    return np.where(np.isnan(v), (lo == -np.inf) & (hi == np.inf), (lo <= v) & (v <= hi))


def log_model():
    nodes = [N("Gelu", ["x"], ["g"], name="g"), N("Sub", ["g", "c"], ["z"], name="s"),
             N("Log", ["z"], ["logits"], name="p")]
    m = chain_model(nodes, [("x", XS.shape), ("c", np.array(C))], ["logits"], opset=20)
    del m.graph.output[:]
    m.graph.output.append(helper.make_tensor_value_info("logits", TensorProto.FLOAT, XS.shape))
    return m


def _torch_log(x: np.ndarray) -> np.ndarray:
    g = torch.nn.functional.gelu(torch.from_numpy(x))
    return torch.log(g - torch.tensor(C)).double().numpy()


@pytest.mark.parametrize("dom", ["interval", "best"])
def test_torch_fp32_gelu_in_the_training_value_set(dom: str) -> None:
    _premise()
    m = chain_model([N("Gelu", ["x"], ["logits"], name="g")], [("x", XS.shape)], ["logits"],
                    opset=20)
    b = certify_drift(graph_of(m), TRAIN, TRAIN, {"x": XS}, domain=dom).outputs["logits"]
    t = _torch_gelu(XS)
    assert _holds(b.train_lo, b.train_hi, t).all(), (
        f"{dom}: training set [{b.train_lo.ravel()}, {b.train_hi.ravel()}], torch fp32 {t.ravel()}")


@pytest.mark.parametrize("dom", ["interval", "best"])
def test_log_drift_holds_the_torch_pair(dom: str) -> None:
    _premise()
    m = log_model()
    try:
        b = certify_drift(graph_of(m), TRAIN, TRAIN, {"x": XS}, domain=dom).outputs["logits"]
    except BoundError as e:  # the fix: Gelu(x) - c may be negative, so Log is refused
        assert "may be negative" in str(e)
        return
    t = _torch_log(XS)               # torch fp32, vectorised Gelu: NaN
    s = _torch_log(XS[:, :1])        # torch fp32 on one element (scalar erf): finite
    d = np.broadcast_to(s, t.shape) - t
    assert _holds(b.drift_lo, b.drift_hi, d).all(), (
        f"{dom}: certified drift [{b.drift_lo.ravel()}, {b.drift_hi.ravel()}]; torch one element "
        f"{s.ravel()} - torch two elements {t.ravel()} = {d.ravel()}")


def test_prove_and_check_refuse_the_log_bound(tmp_path) -> None:
    from tests.soundness.adversarial.test_s6_contracts import prove_and_check

    _premise()
    try:
        per, checked = prove_and_check(tmp_path, log_model(), XS, "gelu",
                                       "{compute: fp32, accumulate: fp32}", 5.0)
    except BoundError as e:  # the fix: Gelu(x) - c may be negative, so Log is refused
        assert "may be negative" in str(e)
        return
    d = np.abs(_torch_log(XS[:, :1]) - _torch_log(XS))
    if per is None:
        return  # not proved
    assert not (checked and (np.isnan(d).any() or float(d.max()) > float(np.max(per)))), (
        f"prove proves linf <= 5 (leaf {float(np.max(per))!r}) and check accepts; the torch pair "
        f"drifts {d.ravel()}")


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_runtimes_fp32_gelu_on_a_grid_in_the_training_value_set(approximate: str) -> None:
    """Every point of a 2,000,001-point grid over [-10, 10], one tensor (torch's vectorised
    path): torch's and onnxruntime's fp32 Gelu lie in the training kernel's value set."""
    import onnxruntime as ort

    x = np.linspace(-10, 10, 2000001).astype(np.float32).reshape(1, -1)
    m = chain_model([N("Gelu", ["x"], ["logits"], name="g", approximate=approximate)],
                    [("x", x.shape)], ["logits"], opset=20)
    b = certify_drift(graph_of(m), TRAIN, TRAIN, {"x": x}, domain="interval").outputs["logits"]
    t = torch.nn.functional.gelu(torch.from_numpy(x), approximate=approximate).double().numpy()
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    o = sess.run(None, {"x": x})[0].astype(np.float64)
    for who, y in (("torch", t), ("onnxruntime", o)):
        ok = _holds(b.train_lo, b.train_hi, y).reshape(-1)
        k = int(np.argmin(ok))
        assert ok.all(), (f"{who} Gelu({float(x.reshape(-1)[k])!r}, {approximate}) = "
                          f"{float(y.reshape(-1)[k])!r} outside "
                          f"[{float(np.asarray(b.train_lo).reshape(-1)[k])!r}, "
                          f"{float(np.asarray(b.train_hi).reshape(-1)[k])!r}]")
