"""Proof by cases over unstable fp8 casts (kcverify.bounds.cases).

A two-layer chain whose first MatMul lands an element exactly on an fp8 rounding midpoint (a tie
the summation order decides): the interval domain straddles it; the case split bounds each
outcome alone. Conforming programs that push the tie either way (the adversarial suite's
independent interpreter, greedy orders) must lie inside the case bound, and a forged decision
(a value the analysis does not admit, an unknown site) is refused."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from kcverify.bounds import cases, certify_drift
from kcverify.bounds.cases import CaseError, Decision, certify_cases
from kcverify.bounds.engine import whole_graph
from kcverify.kernels.spec import parse_kernel_spec
from tests.soundness.adversarial.harness import chain_model, graph_of
from tests.soundness.adversarial.interp import ProgramRunner
from tests.soundness.adversarial.programs import Program

TRAIN = parse_kernel_spec("train", {"compute": "fp32", "accumulate": "fp32"})
INF = parse_kernel_spec("inf", {"compute": "fp32", "accumulate": "fp32",
                                "activations": {"format": "fp8_e4m3",
                                                "scale": "dynamic_per_tensor"}})


def _model():
    # x = [1.75, 1, 1, 1]: scale 2^-8 exactly, q_x = [448, 256, 256, 256]. y = x @ W1 with
    # unscaled sums 448 W1[0] + 256 (W1[1] + W1[2] + W1[3]): y0 = 448 (the amax: scale 1),
    # y1 = (5376 + b + b - 2b) 2^-8 with b = 256 a = 0.625 ulp(5376): in order the partial sums
    # round up to 5376 + 2^-11 and y1 = 21 + 2^-19 casts to 22; in reverse the small terms cancel
    # exactly, y1 = 21, the e4m3 midpoint of 20 and 22, and the tie gives 20. y2 = 3.5.
    a = 5 * 2.0**-22
    w1 = np.array([[256, 12, 2], [0, a, 0], [0, a, 0], [0, -2 * a, 0]], np.float32)
    w2 = np.array([[0.5, 0.25], [1.0, -1.0], [0.5, 2.0]], np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["y"]),
             helper.make_node("MatMul", ["y", "w2"], ["z"])]
    return chain_model(nodes, [("x", (1, 4)), ("w1", w1), ("w2", w2)], ["z"], opset=17)


X = np.array([[1.75, 1.0, 1.0, 1.0]], np.float32)


def _with_y(model):
    m = type(model)()
    m.CopyFrom(model)
    m.graph.output.append(helper.make_tensor_value_info("y", 1, None))
    return m


def test_a_tie_is_split_and_every_order_lies_in_its_case() -> None:
    model = _model()
    g = graph_of(model)
    plain = certify_drift(g, TRAIN, INF, {"x": X}, domain="interval")
    assert int(plain.unstable_casts[0]) >= 1  # the tie straddles
    res = certify_cases(g, TRAIN, INF, {"x": X}, max_leaves=8)
    assert len(res.leaves[0]) >= 2 and int(res.unstable_left[0]) == 0
    assert res.linf[0] <= plain.linf[0]
    run = ProgramRunner(model)
    seen = set()
    for order in ("seq", "rev", "asc", "desc", "greedy_up", "greedy_down"):
        zt = run(Program(TRAIN, order=order), {"x": X})["z"]
        zi = run(Program(INF, order=order), {"x": X})["z"]
        seen.add(float(zi[0, 0]))
        assert float(np.abs(zi.astype(np.float64) - zt).max()) <= res.linf[0]
    assert len(seen) == 2, "the orders should push the tie both ways"
    # each case alone bounds the programs that cast the tie its way (a case forcing the wrong
    # value would miss them)
    y = ProgramRunner(_with_y(model))
    for leaf in res.leaves[0]:
        (d,) = leaf
        with cases.forcing([leaf]):
            one = certify_drift(g, TRAIN, INF, {"x": X}, domain="interval", blocks=whole_graph(g))
        for order in ("seq", "rev"):
            p = Program(INF, order=order, trace=[])
            out = y(p, {"x": X})
            if float(out["y"][0, 1]) > 21:  # 21 + 2^-19: cast to 22
                got = 22.0
            else:
                got = 20.0
            if got != d.value:
                continue
            box = one.outputs["z"]
            zi = out["z"].astype(np.float64)
            assert np.all(box.inf_lo <= zi) and np.all(zi <= box.inf_hi), (leaf, zi)


def test_a_decision_that_does_not_cover_the_enclosure_is_refused() -> None:
    g = graph_of(_model())
    res = certify_cases(g, TRAIN, INF, {"x": X}, max_leaves=8)
    d = res.leaves[0][0][0]
    bad = Decision(d.site, d.index, d.value, d.value + 64.0)  # not the other neighbour
    with pytest.raises(CaseError, match="covers"):
        with cases.forcing([[bad]]):
            certify_drift(g, TRAIN, INF, {"x": X}, domain="interval", blocks=whole_graph(g))
    ghost = Decision(("no_such_node", "left", "inf"), 0, 16.0, 18.0)
    with pytest.raises(CaseError, match="never cast"):
        with cases.forcing([[ghost]]):
            certify_drift(g, TRAIN, INF, {"x": X}, domain="interval", blocks=whole_graph(g))


def test_decisions_round_trip_and_reject_malformed_json() -> None:
    d = Decision(("n", "left", "inf"), 3, 16.0, 18.0)
    assert Decision.from_json(d.to_json()) == d
    for raw in ([["n", "left"], 3, "0x1p+4", "0x1.2p+4"], [["n", "left", "inf"], -1, "0x1p+4", "0x1.2p+4"],
                [["n", "left", "inf"], 3, "0x1p+4", "0x1p+4"], [["n", "left", "inf"], 3, "x", "y"]):
        with pytest.raises(CaseError):
            Decision.from_json(raw)
