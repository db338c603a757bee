"""Session 7: the fp8 helper's sharpness changes (issue 12; zonotope.py) attacked:

* the softmax row sum met with the sum of exp's value bounds (rows with masked entries, -inf
  and a finite -1e4; sharp rows where the box sum binds: logits scaled up);
* ``box_where_looser`` (an element's form replaced by its box's form with fresh symbols:
  elements whose box binds, the drift side included);
* cast option 6 restricted by the drift radius, ``_smooth_walsh`` remainders over
  [x_sigma +- w] met with [lo, hi];

on attention graphs whose scores carry both per-tensor scales and whose P is cast again (PV),
at inputs tied at e4m3 midpoints +-1 fp32 ulp (test_binpoly_attack.tied_input), with the
activation amax at the ends of its range (1e-3 .. 3e3, the scale s = amax / 448 from 2e-6 to 7).
Per case: certify (best; zonotope in the campaign), the directed tie search of test_s6_fp8 on
the probabilities p and the output y, and seeded program pairs (attacks.pairs): containment
per element for train, inf and drift.

``lever_report`` certifies the same case with each of the patch's switches off (the B1_A /
B1_B / B1_C environment switches of zonotope.py, while they exist) and says which changed the
bound, so that a passing run is known to have reached the new code.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import onnx
import pytest
from onnx import helper

from kcverify.bounds import certify_drift
from tests.soundness.adversarial import test_s6_fp8 as s6
from tests.soundness.adversarial.attacks import pairs
from tests.soundness.adversarial.harness import (
    SESSION,
    TRAIN,
    Ledger,
    attack,
    chain_model,
    graph_of,
    ratio_text,
)
from tests.soundness.adversarial.programs import Program
from tests.soundness.adversarial.test_binpoly_attack import SP, SP_TOKEN, _w, tied_input


@dataclass(frozen=True)
class ActTieProgram(s6.TieProgram):
    """test_s6_fp8.TieProgram whose weights are cast as every conforming program casts them
    (docs/bounds.md: Q(W) to nearest-even with the exact quotient, a point): only activation
    casts are numbered and may take the fp32 quotient. (TieProgram numbers and flips weight
    casts too: harmless while every weight quotient is exact, as with the power-of-two weight
    scales of test_s6_fp8's nets; a weight at a tie is a false alarm.)"""

    def operand(self, x, const, side):
        if const:
            return Program(self.spec, per_sample=self.per_sample).operand(x, const, side)
        return Program.operand(self, x, const, side)


def act_tie_prog(sp, masks: dict, order: str, rescale: str, record: dict | None = None,
                 label: str = "") -> ActTieProgram:
    return ActTieProgram(sp, order=order, row_order=order, rescale=rescale, masks=masks,
                         record=record, calls=[], label=label or f"tie/{order}/{rescale}")


def tie_search(*args, **kw):
    """test_s6_fp8.tie_search with ActTieProgram's programs."""
    old = s6.tie_prog
    s6.tie_prog = act_tie_prog
    try:
        return s6.tie_search(*args, **kw)
    finally:
        s6.tie_prog = old


def attn_net(rng: np.random.Generator, T: int = 5, K: int = 6, D: int = 4, sharp: float = 1.0,
             mask: str | None = None, amax: float = 1.7) -> tuple[onnx.ModelProto, dict]:
    """x (1, T, K) -> q, k, v = x W (activation casts of x), S = q k^T * sharp / 2 [+ causal
    mask], p = softmax(S), y = p v (the p cast). ``mask``: "inf" (-inf above the diagonal),
    "finite" (-1e4), or None."""
    Wq, Wk, Wv = (_w(rng, (K, D), 2.0 / amax) for _ in range(3))
    nodes = [helper.make_node("MatMul", ["x", "Wq"], ["q"], name="mq"),
             helper.make_node("MatMul", ["x", "Wk"], ["k"], name="mk"),
             helper.make_node("MatMul", ["x", "Wv"], ["v"], name="mv"),
             helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["q", "kt"], ["s0"], name="qk"),
             helper.make_node("Mul", ["s0", "half"], ["s1"])]
    inits: list = [("x", (1, T, K)), ("Wq", Wq), ("Wk", Wk), ("Wv", Wv),
                   ("half", np.array(0.5 * sharp, np.float32))]
    src = "s1"
    if mask is not None:
        m = np.triu(np.ones((T, T), bool), 1)
        val = -np.inf if mask == "inf" else -1e4
        inits.append(("mask", np.where(m, val, 0.0).astype(np.float32)[None]))
        nodes.append(helper.make_node("Add", ["s1", "mask"], ["s2"]))
        src = "s2"
    nodes += [helper.make_node("Softmax", [src], ["p"], axis=-1),
              helper.make_node("MatMul", ["p", "v"], ["y"], name="pv")]
    model = chain_model(nodes, inits, ["p", "y"], opset=17)
    return model, {"x": tied_input((1, T, K), rng, amax=amax)}


# (id, kwargs): masked rows, sharp rows (the box sum binds), amax at the range's ends
CASES = {
    "plain": {},
    "mask-inf": {"mask": "inf"},
    "mask-finite": {"mask": "finite"},
    "sharp4": {"sharp": 4.0},
    "sharp16-mask": {"sharp": 16.0, "mask": "inf"},
    "amax-small": {"amax": 1.7 * 2.0**-10},  # the tie structure of 1.7, scaled
    "amax-large": {"amax": 1.7 * 2.0**11, "sharp": 2.0},
    "amax-odd": {"amax": 1e-3},
}

SWITCHES = ("B1_A", "B1_B", "B1_C")


def lever_report(model: onnx.ModelProto, feeds: dict, sp, domain: str = "best") -> dict:
    """{switch: max relative change of the certified drift half-width of y when it is off}."""
    def half(**env) -> np.ndarray:
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            a = certify_drift(graph_of(model), TRAIN, sp, feeds, domain=domain).outputs["y"]
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        arr = a.arrays()
        return np.maximum(np.abs(arr[4]), np.abs(arr[5]))
    base = half()
    out = {}
    for s in SWITCHES:
        off = half(**{s: "0"})
        with np.errstate(divide="ignore", invalid="ignore"):
            out[s] = float(np.nanmax(np.where(base > 0, off / base - 1, 0)))
    return out


def run_case(name: str, seed: int, sp, domain: str = "best", budget: int = 120
             ) -> tuple[list[str], float, Ledger]:
    rng = np.random.default_rng([seed, len(name), 7])
    model, feeds = attn_net(rng, **CASES[name])
    with np.errstate(all="ignore"):
        boxes = certify_drift(graph_of(model), TRAIN, sp, feeds, domain=domain).outputs
    found: list[str] = []
    worst = 0.0
    for out in ("p", "y"):
        f, w, _ = tie_search(model, sp, feeds, boxes, out, n_targets=2, passes=2,
                             budget_runs=budget, seed=seed)
        found += f
        worst = max(worst, w)
    led = Ledger()
    found += attack(led, f"s7/fp8/{name}", model, TRAIN, sp, feeds, pairs(TRAIN, sp, 6, seed),
                    outputs=boxes)
    SESSION.merge(led)
    return found, worst, led


# a seed whose bound every switch moves (lever_report, a927a6a + the b1 patch): off, B1_A (the
# row sum) widens y's drift by 12 %, B1_B (the box's form) by 14 %, B1_C by 1.2 %
@pytest.mark.parametrize("name,seed", [("amax-small", 2)])
def test_b1_attention_fast(name: str, seed: int) -> None:
    found, worst, led = run_case(name, seed, SP, budget=40)
    assert not found, "\n".join(found[:3]) + "\n" + ratio_text(led[f"s7/fp8/{name}"])


@pytest.mark.campaign
@pytest.mark.parametrize("domain", ["best", "zonotope"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_b1_attention_campaign(name: str, domain: str) -> None:
    found: list[str] = []
    worst = 0.0
    for seed in range(2, 8):
        for sp in (SP, SP_TOKEN):
            f, w, _ = run_case(name, seed, sp, domain)
            found += f
            worst = max(worst, w)
    print(f"s7/fp8/{name}/{domain}: worst target obs/cert {worst:.4g}")
    assert not found, "\n".join(found[:3])
