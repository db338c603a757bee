"""Violations found by the session-2 adversary (the new enclosures of issues 11-13), each a
minimal reproducer marked ``xfail(strict=True)`` until its fix lands (then the mark goes and it
stays as a regression test). Numbering continues test_findings.py's.

14. ``unstable_casts`` is 0 under ``dynamic_per_block`` activation scales: the count is taken
    only on the MatMul grid path (rules/linear._grid_operand), which per-block scales never
    take, so an input whose block casts conforming programs round apart (a value one fp32 ulp
    off an fp8 midpoint: the fp32 quotient ties to even, the exact one does not) is reported
    as having every cast stable.
15. ``unstable_casts`` is 0 for the activation of MatMul(W, x) when the left operand W is off
    the grid path (int8 weights, per-block weights, weights without a cast): ``_grid_pair``
    returns before it looks at the right operand, so its casts are never counted.
16. ``unstable_casts`` is 0 under ``rounding: any``: every cast whose quotient is not a format
    value may go to either neighbour, but ``_grid_operand`` returns None before counting.

14-16 are fixed since the count moved to the cast itself (rules/linear._operand: every
activation cast of the interval MatMul rule, any scale kind, either rounding; an over-count
where a kind gives no per-element scale interval): regression tests now.

Each test builds the smallest MatMul that shows it and checks the claim against conforming
programs (test_stable_casts.stable_claims: an input the engine calls stable on which two
programs cast an element apart).
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from tests.soundness.adversarial.arith import next_up, rnd
from tests.soundness.adversarial.harness import SESSION, Ledger, chain_model, node_model, spec
from tests.soundness.adversarial.test_stable_casts import E4M3_PC, cast_programs, stable_claims


def _block_row(K: int) -> np.ndarray:
    """Blocks of 4 whose amax is 3 (every dynamic scale, per block, per token or per tensor, is
    s = fl32(3 / 448), not a power of two), the other entries fl32(M s) for e4m3 midpoints M,
    one fp32 ulp up in odd blocks: x / s exact and x / s rounded to fp32 (a tie, to even) fall
    on different sides of a midpoint for some of them (test_constructions_split)."""
    s = float(rnd(3.0 / 448.0, "fp32"))
    m = rnd(np.array([1.0625, 1.1875, 1.3125]) * s, "fp32")
    x = np.zeros((1, K))
    for j in range(K):
        b, r = divmod(j, 4)
        x[0, j] = 3.0 if r == 0 else float(next_up(m[r - 1], "fp32") if b % 2 else m[r - 1])
    return x.astype(np.float32)


def _check(model, sp, feeds) -> list[str]:
    led = Ledger()
    found = stable_claims(led, "findings2", model, sp, feeds, cast_programs(sp))
    SESSION.merge(led)
    return found


def test_14_per_block_activation_casts_are_counted() -> None:
    sp = spec(weights=E4M3_PC, activations={"format": "fp8_e4m3", "scale": "dynamic_per_block",
                                            "block_size": 4},
              accumulate="fp32", compute="fp32")
    x = _block_row(8)
    w = np.ones((8, 1), np.float32)
    model = node_model("MatMul", [("x", (1, 8)), ("w", w)])
    found = _check(model, sp, {"x": x})
    assert not found, found[0]


def _left_weight_model(w: np.ndarray, K: int):
    nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0]),
             helper.make_node("MatMul", ["w", "xt"], ["yt"]),
             helper.make_node("Transpose", ["yt"], ["y"], perm=[1, 0])]
    return chain_model(nodes, [("x", (1, K)), ("w", w)], ["y"])


@pytest.mark.parametrize("weights", [{"format": "int8", "scale": "per_channel"},
                                     {"format": "fp8_e4m3", "scale": "per_block",
                                      "block_size": 4},
                                     None])
def test_15_right_activation_casts_are_counted(weights) -> None:
    sp = spec(activations={"format": "fp8_e4m3", "scale": "dynamic_per_token"},
              accumulate="fp32", compute="fp32",
              **({} if weights is None else {"weights": weights}))
    x = _block_row(8)
    model = _left_weight_model(np.ones((1, 8), np.float32), 8)
    found = _check(model, sp, {"x": x})
    assert not found, found[0]


def test_16_rounding_any_casts_are_counted() -> None:
    sp = spec(weights=E4M3_PC, activations={"format": "fp8_e4m3", "scale": "static",
                                            "value": 1.0},
              accumulate="fp32", compute="fp32", rounding="any")
    x = np.array([[1.0625, 1.5, 3.1]], np.float32)  # 1.5 is e4m3: exact; the others are not
    w = np.ones((3, 1), np.float32)
    model = node_model("MatMul", [("x", (1, 3)), ("w", w)])
    found = _check(model, sp, {"x": x})
    assert not found, found[0]


def test_constructions_split() -> None:
    """The reproducers' inputs do split conforming programs' casts (so the xfails above fail
    for the claim, not for a construction that never straddles): the same rows as the *left*
    operand of MatMul(x, W) with fp8 weights are counted (the control), and programs differ."""
    from tests.soundness.adversarial.test_stable_casts import _differing, traces

    x = _block_row(8)
    for acts in ({"format": "fp8_e4m3", "scale": "dynamic_per_block", "block_size": 4},
                 {"format": "fp8_e4m3", "scale": "dynamic_per_token"}):
        sp = spec(weights=E4M3_PC, activations=acts, accumulate="fp32", compute="fp32")
        model = node_model("MatMul", [("x", (1, 8)), ("w", np.ones((8, 1), np.float32))])
        tr = traces(model, cast_programs(sp), {"x": x}, 0)
        assert max(_differing(tr[0], t) for t in tr[1:]) >= 1, acts
    sp = spec(weights=E4M3_PC, activations={"format": "fp8_e4m3", "scale": "dynamic_per_token"},
              accumulate="fp32", compute="fp32")
    model = node_model("MatMul", [("x", (1, 8)), ("w", np.ones((8, 1), np.float32))])
    assert not _check(model, sp, {"x": x})  # counted on the grid path
    sp = spec(weights=E4M3_PC, activations={"format": "fp8_e4m3", "scale": "static",
                                            "value": 1.0},
              accumulate="fp32", compute="fp32", rounding="any")
    model = node_model("MatMul", [("x", (1, 3)), ("w", np.ones((3, 1), np.float32))])
    tr = traces(model, cast_programs(sp), {"x": np.array([[1.0625, 1.5, 3.1]], np.float32)}, 0)
    assert max(_differing(tr[0], t) for t in tr[1:]) >= 1
