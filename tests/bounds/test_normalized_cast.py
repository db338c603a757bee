"""The zonotope's dynamic per-tensor cast relative to its amax element (zonotope._normalized_cast).

Two fp8-activation MatMuls on a box: the first cast's scale is uncertain (the amax moves with the
box), so every element of y carries that uncertainty as a common factor, and the second cast's
scale amax(y) / 448 carries the same factor. The normalised quotient cancels it. Conforming
programs (the adversarial suite's interpreter: orders, quotient roundings, per-sample scales) at
points of the box, at its corners and at fp8-grid-aligned points must lie inside the certified
sets; the option must actually be taken (else this test would prove nothing about it).
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

import kcverify.bounds.zonotope as Z
from kcverify.bounds import Region, certify_drift
from kcverify.kernels.spec import parse_kernel_spec
from tests.soundness.adversarial.attacks import box_points
from tests.soundness.adversarial.harness import Ledger, chain_model, graph_of
from tests.soundness.adversarial.interp import ProgramRunner
from tests.soundness.adversarial.programs import Program

TRAIN = parse_kernel_spec("train", {"compute": "fp32", "accumulate": "fp32"})
INF = parse_kernel_spec("inf", {"compute": "fp32", "accumulate": "fp32",
                                "activations": {"format": "fp8_e4m3",
                                                "scale": "dynamic_per_tensor"}})


def _model(seed: int):
    rng = np.random.default_rng(seed)
    w1 = rng.normal(size=(6, 5)).astype(np.float32)
    w1[:, 0] = 0.0
    w1[0, 0] = 4.0  # y0 = 4 x0 dominates: one certain amax element of y
    w2 = rng.normal(size=(5, 3)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["y"]),
             helper.make_node("MatMul", ["y", "w2"], ["z"])]
    return chain_model(nodes, [("x", (1, 6)), ("w1", w1), ("w2", w2)], ["z"], opset=17)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_normalized_casts_hold_conforming_programs(seed: int, monkeypatch) -> None:
    taken = []
    orig = Z._normalized_cast

    def spy(*a, **k):
        out = orig(*a, **k)
        if out is not None:
            taken.append(int(np.isfinite(out[1].cpu().numpy()).sum()))
        return out
    monkeypatch.setattr(Z, "_normalized_cast", spy)
    model = _model(seed)
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, size=(1, 6)).astype(np.float32)
    x[0, 0] = 3.0
    eps = 1e-3
    res = certify_drift(graph_of(model), TRAIN, INF, {"x": x}, region=Region("input", "linf", eps),
                        domain="best")
    assert sum(taken) > 0, "the normalised cast was never certain: the test shows nothing"
    box = res.outputs["z"]
    run = ProgramRunner(model)
    led = Ledger()
    found = []
    progs = [Program(INF, order=o, quotient=q) for o in ("seq", "rev", "greedy_up")
             for q in ("exact", "fp32")]
    for pt in box_points(rng, x, eps, 12):
        zt = run(Program(TRAIN), {"x": pt})["z"]
        for p in progs:
            zi = run(p, {"x": pt})["z"]
            found += led.check("normalized", box, zt, zi, f"{p} at {pt.tolist()}")
    assert not found, found[:3]
