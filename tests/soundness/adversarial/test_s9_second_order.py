"""Session 9 (round 7): the zonotope's centred second-order expansion of 1/x (branch s9-minilm).

Finding F10 of session 9. ``_first_order`` expands f at the form's centre c over the hull of
[lo, hi] (the form's range met with the box) and c. The centring of the Lagrange remainder (b7e4381)
moves a smooth function's centre (Erf's, concave on x > 0, moves down), so a later form's centre
can lie outside its box: y = Erf(x) - 0.83955, x in [1, 4], has the box [0.0031, 0.160] and the
form -0.150 +- 0.31 (3.97x the box: just under BOX_LOOSER). Reciprocal's domain check reads only
[lo, hi] > 0; the hull [-0.150, 0.160] crosses the pole, _inv_drange is finite on it and _d2_inv
returns an inverted range (2 / hi^3 > 2 / lo^3), so the Lagrange remainder is [0, 0]: 1/y is
taken as linear from -0.150, R = 5e-14. Zonotope and best certify the training set [6.23, 7.29]
(exact range [6.23, 317.9]) and, against {compute: fp16, accumulate: fp32}, the drift
[-1.12, 1.14]; torch fp32 at x = 1 gives 317.38, torch fp16 292.5: drift -24.9 (21.8x). main
(before the branch) and the interval domain: [6.23, 317.4], drift [-311, 377] (sound).
Fix suggestion: the domain check on the hull (or expand at c clamped into [lo, hi]); _inv_drange
/ _d2_inv unbounded on an interval holding 0. kcverify is imported from the path (the tests run
on main after the merge).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import helper

from kcverify.bounds import certify_drift
from tests.soundness.adversarial.harness import TRAIN, chain_model, graph_of, spec

N = helper.make_node
K = np.float32(0.83955)
SHP = (1, 1)
FP16 = spec(compute="fp16", accumulate="fp32")


def _bounds(dom: str, op: str = "Reciprocal"):
    if op == "Reciprocal":
        tail = [N("Reciprocal", ["y"], ["z"], name="c")]
    else:  # Div(1, y): the binary rule's own f_smooth
        tail = [N("Div", ["one", "y"], ["z"], name="c")]
    nodes = [N("Erf", ["x"], ["t"], name="a"), N("Sub", ["t", "k"], ["y"], name="b")] + tail
    ins = [("x", SHP), ("k", np.array(K))]
    if op != "Reciprocal":
        ins.append(("one", np.array(np.float32(1.0))))
    m = chain_model(nodes, ins, ["z"], opset=20)
    box = {"x": (np.full(SHP, 1.0), np.full(SHP, 4.0))}
    r = certify_drift(graph_of(m), TRAIN, FP16, {"x": np.full(SHP, np.float32(2.5))},
                      input_bounds=box, domain=dom)
    return r.outputs["z"]


def _torch_pair(xv: float = 1.0) -> tuple[float, float]:
    x = torch.tensor([xv], dtype=torch.float32)
    z32 = (1 / (torch.erf(x) - torch.tensor(K))).item()
    xh = x.half()
    z16 = (1 / (torch.erf(xh) - torch.tensor(K).half())).item()
    return z32, z16


@pytest.mark.parametrize("dom", ["interval", "zonotope", "best"])
@pytest.mark.parametrize("op", ["Reciprocal", "Div"])
def test_reciprocal_after_erf_holds_the_torch_pair(dom: str, op: str) -> None:
    b = _bounds(dom, op)
    z32, z16 = _torch_pair()
    assert 300 < z32 < 320 and 280 < z16 < 300  # the premise: torch's values at x = 1
    d = z16 - z32
    tl, th = float(b.train_lo.min()), float(b.train_hi.max())
    dl, dh = float(b.drift_lo.min()), float(b.drift_hi.max())
    assert tl <= z32 <= th, f"{dom}/{op}: training set [{tl}, {th}], torch fp32 {z32}"
    assert dl <= d <= dh, f"{dom}/{op}: drift [{dl}, {dh}], torch fp32 / fp16 pair {d}"
