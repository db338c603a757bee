"""Casts downstream of straddled roundings, end to end (zonotope._binary_branches,
_scale_branches, _normalized_cast and the Walsh cast of binpoly): the independent programs of
programs.py against the ``best`` domain's sets.

The net: x (1, T, K) at e4m3 midpoints +- one fp32 ulp (the first casts straddle: binary
symbols, which programs flip by their quotient, exact, fp32 or ``mixed`` per element, and by
their order) -> two MatMuls h1, h2 -> a nonlinear op p (h1 * h2: Walsh terms of degree 2;
h1 * h1: b^2 = 1; Relu; h1 + h2) -> Concat(p, pin) -> MatMul, whose activation cast is evaluated
on the branches. ``pin`` is a constant column (a per-token / per-tensor amax the engine knows)
placed so that (``mode``):

* ``tie``: the largest |p| of one program's run sits at an e4m3 midpoint of the second grid,
  exactly or one fp32 ulp off (the second cast's branches must be refused there, not claimed);
* ``sub``: that element sits at a midpoint of the *subnormal* e4m3 grid (2^-9 spacing);
* ``nopin``: no pin (pin 0): the amax is p's own, its scale uncertain (scales at both ends);
* ``free``: pin 1, wherever p lands.

K = 4 (every branch symbol evaluated) and K = 8 (more than BRANCH_SYMBOLS = 5 binary symbols
at one element: the rest in the noise). Every (training, inference) pair is checked elementwise
(train, inference, drift) on p and y; the option the engine chose per element of the last cast
is recorded (zonotope.CAST_TRACE) so that a test cannot pass by never reaching a branch rule.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import numpy as np
import pytest
from onnx import helper

import kcverify.bounds.zonotope as Z
from tests.soundness.adversarial.arith import next_down, next_up, rnd
from tests.soundness.adversarial.attacks import fp8_midpoints
from tests.soundness.adversarial.harness import (
    SESSION,
    TRAIN,
    Ledger,
    attack,
    chain_model,
    ratio_text,
    spec,
)
from tests.soundness.adversarial.interp import ProgramRunner
from tests.soundness.adversarial.programs import Program

E4M3_PC = {"format": "fp8_e4m3", "scale": "per_channel"}
KINDS = ("mul", "sq", "relu", "add")
MODES = ("free", "tie", "sub", "nopin")
ACTS = ("dynamic_per_tensor", "dynamic_per_token")
BRANCH_OPTIONS = (3, 4, 5, 6)  # _cast_operand's options that evaluate a cast on branches


def branch_spec(acts: str):
    return spec(weights=E4M3_PC, activations={"format": "fp8_e4m3", "scale": acts},
                accumulate="fp32", compute="fp32")


def _e4(a: np.ndarray, scale: float = 1.0) -> np.ndarray:
    return (rnd(a, "fp8_e4m3") * scale).astype(np.float32)


def branch_net(T: int, K: int, H: int, N: int, rng: np.random.Generator, kind: str, pin: float,
               wscale: float = 1.0):
    """x -> (W1, W2) -> h1, h2 -> p (``kind``) -> Concat(p, pin) -> W3 -> y; outputs y and p."""
    w1 = _e4(rng.normal(size=(K, H)), wscale)
    w2 = _e4(rng.normal(size=(K, H)), wscale)
    w3 = _e4(rng.normal(size=(H + 1, N)))
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h1"]),
             helper.make_node("MatMul", ["x", "w2"], ["h2"])]
    op, ins = {"mul": ("Mul", ["h1", "h2"]), "sq": ("Mul", ["h1", "h1"]),
               "relu": ("Relu", ["h1"]), "add": ("Add", ["h1", "h2"])}[kind]
    nodes.append(helper.make_node(op, ins, ["p"]))
    nodes.append(helper.make_node("Concat", ["p", "pin"], ["z"], axis=2))
    nodes.append(helper.make_node("MatMul", ["z", "w3"], ["y"]))
    pins = np.full((1, T, 1), pin, np.float32)
    return chain_model(nodes, [("x", (1, T, K)), ("w1", w1), ("w2", w2), ("w3", w3),
                               ("pin", pins)], ["y", "p"])


def branch_programs(sp, n: int = 12, seed: int = 0) -> list[Program]:
    """Inference programs differing in what the casts depend on: the quotient (exact, fp32,
    per element), the order of every sum (flipping the outputs near midpoints)."""
    qs = ("exact", "fp32", "mixed")
    orders = ("seq", "rev", "greedy_up", "greedy_down", "alt", "random")
    return [Program(sp, quotient=qs[k % 3], order=orders[k % 6], seed=seed + k,
                    label=f"q-{qs[k % 3]}/{orders[k % 6]}/{seed + k}") for k in range(n)]


def _train_programs() -> list[Program]:
    return [Program(TRAIN, order=o, seed=j, label=f"train/{o}")
            for j, o in enumerate(("seq", "greedy_up", "greedy_down"))]


def _pin_for(mode: str, v: float, rng: np.random.Generator) -> float:
    """A pin value whose scale fl32(pin / 448) puts |p| = v at a midpoint (+- one fp32 ulp)."""
    if mode == "free":
        return 1.0
    if mode == "nopin":
        return 0.0
    if mode == "tie":
        grid = np.unique(np.abs(rnd(np.linspace(200, 440, 2000), "fp8_e4m3")))
        mids = (grid[:-1] + grid[1:]) / 2
    else:  # subnormal midpoints (k + 1/2) 2^-9, k = 1 .. 6
        mids = (np.arange(1, 7) + 0.5) * 2.0**-9
    mid = float(mids[rng.integers(len(mids))])
    sh = float(rnd(v / mid, "fp32"))
    sh = (float(next_down(sh, "fp32")), sh, float(next_up(sh, "fp32")))[int(rng.integers(3))]
    return float(rnd(448.0 * sh, "fp32"))


def branch_case(kind: str, acts: str, mode: str, seed: int, K: int = 4, T: int = 2, H: int = 6,
                N: int = 3, wscale: float = 1.0):
    """(model, feeds, inference programs) of one attack (module doc)."""
    rng = np.random.default_rng([seed, K, KINDS.index(kind), MODES.index(mode)])
    sp = branch_spec(acts)
    x = fp8_midpoints((1, T, K), "fp8_e4m3", rng, amax=float(rng.uniform(0.5, 3.0)),
                      group_axis=2 if acts == "dynamic_per_token" else None)
    progs = branch_programs(sp, seed=seed)
    state = rng.bit_generator.state
    model = branch_net(T, K, H, N, rng, kind, 1.0, wscale)
    if mode in ("tie", "sub"):
        run = ProgramRunner(model)
        with np.errstate(all="ignore"):
            ps = np.stack([run(p, {"x": x})["p"] for p in progs])
        v = float(np.abs(ps).max())
        pin = _pin_for(mode, v, rng) if v > 0 else 1.0
    else:
        pin = _pin_for(mode, 0.0, rng)
    rng.bit_generator.state = state  # the same weights
    return branch_net(T, K, H, N, rng, kind, pin, wscale), {"x": x}, sp, progs


@contextmanager
def chosen_options():
    """Count, per (node, option), the elements whose inference cast took that option."""
    counts: Counter = Counter()
    old = Z.CAST_TRACE

    def trace(node, side, k, best, noise, f, zt):
        if k == 1:
            vals, n = np.unique(best.cpu().numpy(), return_counts=True)
            for v, c in zip(vals, n):
                counts[(node, int(v))] += int(c)
    Z.CAST_TRACE = trace
    try:
        yield counts
    finally:
        Z.CAST_TRACE = old


def run_case(led: Ledger, cls: str, kind: str, acts: str, mode: str, seed: int, K: int = 4,
             domain: str = "best", **kw) -> tuple[list[str], Counter]:
    model, feeds, sp, progs = branch_case(kind, acts, mode, seed, K, **kw)
    pt = _train_programs()
    prs = [(pt[j % len(pt)], p) for j, p in enumerate(progs)]
    with chosen_options() as counts:
        found = attack(led, cls, model, TRAIN, sp, feeds, prs, domain=domain)
    return found, counts


def _branch_hits(counts: Counter) -> int:
    return sum(c for (node, opt), c in counts.items() if opt in BRANCH_OPTIONS)


# every kind, scheme and mode once, K 4 and 8 in rotation (CI); the rest slow, all in the campaign
ALL = [(kind, acts, mode, K) for K in (4, 8) for kind in KINDS for acts in ACTS
       for mode in MODES if (KINDS.index(kind) + MODES.index(mode) + K // 4) % 2 == 0]
T, K_ = "dynamic_per_tensor", "dynamic_per_token"
FAST = [("mul", T, "tie", 4), ("sq", K_, "sub", 4), ("relu", T, "nopin", 4), ("add", K_, "free", 4),
        ("mul", K_, "nopin", 8), ("sq", T, "tie", 8), ("relu", K_, "sub", 8), ("add", T, "free", 8)]
SLOW = [c for c in ALL if c not in FAST]


def _branches(kind: str, acts: str, mode: str, K: int) -> None:
    led = Ledger()
    cls = f"branches/{kind}/{mode}/K{K}"
    found, _ = run_case(led, cls, kind, acts, mode, 0, K)
    SESSION.merge(led)
    assert led[cls].pairs == 24  # 12 pairs, two outputs (p, y)
    assert not found, ratio_text(led[cls]) + "\n" + "\n".join(found[:3])


@pytest.mark.parametrize(("kind", "acts", "mode", "K"), FAST)
def test_casts_on_branches(kind: str, acts: str, mode: str, K: int) -> None:
    """Programs flipping the upstream straddles every way against the branch-evaluated casts."""
    _branches(kind, acts, mode, K)


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "acts", "mode", "K"), SLOW)
def test_casts_on_branches_slow(kind: str, acts: str, mode: str, K: int) -> None:
    _branches(kind, acts, mode, K)


def test_branch_rules_are_reached() -> None:
    """The attacks reach the rules they attack: over a few cases, the last cast evaluates
    elements on branches (options 3-6), and the midpoint inputs split the programs' casts."""
    hits = 0
    for kind, mode in (("mul", "free"), ("sq", "tie"), ("add", "nopin")):
        _, counts = run_case(Ledger(), "reach", kind, "dynamic_per_tensor", mode, 1)
        hits += _branch_hits(counts)
    assert hits > 0
    model, feeds, sp, progs = branch_case("mul", "dynamic_per_tensor", "free", 1)
    run = ProgramRunner(model)
    ys = [run(p, feeds)["p"] for p in progs]
    assert any(not np.array_equal(ys[0], y) for y in ys[1:]), "the programs must disagree"


def test_mixed_quotient_is_per_element() -> None:
    """``quotient="mixed"`` really mixes: on midpoint inputs it differs from both uniform
    choices somewhere (else it adds nothing to the attack)."""
    sp = branch_spec("dynamic_per_tensor")
    rng = np.random.default_rng(4)
    x = fp8_midpoints((1, 64), "fp8_e4m3", rng, amax=1.7).astype(np.float64)
    s = Program(sp).scale(np.abs(x).max(keepdims=True), sp.activations)
    q = {m: Program(sp, quotient=m, seed=3).cast(x, sp.activations, s, "nearest")
         for m in ("exact", "fp32", "mixed")}
    assert not np.array_equal(q["mixed"], q["exact"])
    assert not np.array_equal(q["mixed"], q["fp32"])
    assert np.all((q["mixed"] == q["exact"]) | (q["mixed"] == q["fp32"]))


@pytest.mark.campaign
@pytest.mark.parametrize("K", [3, 4, 5, 6, 8])
def test_casts_on_branches_campaign(K: int) -> None:
    """Every kind, scheme and mode, seeds 1-6, weights at 1 and at 2^6 (large products)."""
    led = Ledger()
    found = []
    hits = 0
    for seed in range(1, 7):
        for kind in KINDS:
            for acts in ACTS:
                for mode in MODES:
                    cls = f"branches-campaign/{kind}/{mode}"
                    f, counts = run_case(led, cls, kind, acts, mode, seed, K,
                                         wscale=64.0 if seed % 2 else 1.0)
                    found += f
                    hits += _branch_hits(counts)
    SESSION.merge(led)
    assert hits > 0
    assert not found, "\n".join(found[:5])
