"""A cast evaluated on the branches of several binary symbols (zonotope._binary_branches).

A straddled fp8 rounding upstream is a binary symbol b in {-1, +1}. A cast downstream of k
such symbols is evaluated on all 2^k sign vectors; where every branch rounds to one value, the
cast is written as the affine part of its Walsh expansion over the b's plus noise (higher-order
terms, the scale's interval, dequantisation). Checked here against the exact cast of every
point of the form: all binary assignments (ones beyond the k evaluated included), continuous
symbols and r at random and at their corners, the scale at both ends and inside, the program's
quotient rounded either way by one fp32 unit; and adversarially: branches placed on an fp8
midpoint and +- 1 fp32 ulp off it must be refused (noise inf), never claimed.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import kcverify.bounds.zonotope as Z
from kcverify.bounds.box import imul, pad_hi, pad_lo
from kcverify.bounds.casts import SCALE_SLACK, rne
from kcverify.kernels.formats import get_format

F64 = torch.float64
FMT = get_format("fp8_e4m3")
U32 = 2.0**-24


def _q_of(s_lo: float, s_hi: float):
    """The quotient enclosure of a dynamic scale in [s_lo, s_hi], as zonotope._cast_plan has it."""
    inv_lo, inv_hi = torch.tensor(1.0 / s_hi, dtype=F64), torch.tensor(1.0 / s_lo, dtype=F64)

    def q_of(x_lo: torch.Tensor, x_hi: torch.Tensor):
        t_lo, t_hi = imul(x_lo, x_hi, inv_lo, inv_hi)
        t_lo, t_hi = pad_lo(t_lo, SCALE_SLACK), pad_hi(t_hi, SCALE_SLACK)
        lim = FMT.max_finite * (1 + 2 * SCALE_SLACK)
        return rne(t_lo.clamp(-lim, lim), FMT), rne(t_hi.clamp(-lim, lim), FMT)
    return q_of


def _form(rng: np.random.Generator, n: int, nb: int, nc: int, s: float, tie: bool):
    """n elements; nb binary rows (ids 0 .. nb-1), nc continuous rows; quotients of c near
    format values (or, ``tie``, one branch of each element on a midpoint +- 0 / 1 fp32 ulp)."""
    grid = rne(torch.tensor(rng.uniform(-300, 300, size=n), dtype=F64), FMT)
    Gb = torch.tensor(rng.normal(size=(nb, n)) * rng.uniform(0, 3, size=(nb, 1)), dtype=F64)
    Gb[:, rng.uniform(size=n) < 0.3] = 0.0  # some elements depend on fewer symbols
    Gc = torch.tensor(rng.normal(size=(nc, n)) * 1e-4, dtype=F64)
    r = torch.tensor(rng.uniform(0, 1e-4, size=n), dtype=F64)
    c = grid * s
    if tie:  # put branch (+1, .., +1) of each element on a midpoint, nudged by 0 / +-1 ulp
        up = Z.next_up(grid, FMT)
        mid = 0.5 * (grid + up) * s
        nudge = torch.tensor(rng.integers(-1, 2, size=n), dtype=F64) * mid.abs() * U32
        c = mid + nudge - (Gb * s * 4).sum(0)
        Gc = Gc * 0.0
        r = r * 0.0
    G = torch.cat([Gb * s * 4, Gc * s])
    ids = torch.arange(nb + nc, dtype=torch.int64)
    return Z.Form(c, G, r, ids), torch.arange(nb)


def _values(f: Z.Form, nb: int, rng: np.random.Generator, s_lo: float, s_hi: float, deq: float):
    """Exact casts of points of the form: every binary assignment, continuous symbols and r
    at corners and random, s at both ends and inside, the quotient rounded by +-1 fp32 unit,
    the dequantised value within deq. Yields (sigma, value)."""
    nc = f.k - nb
    for sig in itertools.product((-1.0, 1.0), repeat=nb):
        for trial in range(4):
            if trial < 2:
                eps = torch.full((nc,), 1.0 if trial == 0 else -1.0, dtype=F64)
                e = f.r * (1.0 if trial == 0 else -1.0)
            else:
                eps = torch.tensor(rng.uniform(-1, 1, size=nc), dtype=F64)
                e = f.r * torch.tensor(rng.uniform(-1, 1, size=f.r.shape), dtype=F64)
            sym = torch.cat([torch.tensor(sig, dtype=F64), eps])
            x = f.c + torch.tensordot(sym, f.G, dims=1) + e
            for s in (s_lo, s_hi, 0.5 * (s_lo + s_hi)):
                for qr in (-U32, 0.0, U32):
                    q = rne(x / s * (1 + qr), FMT)
                    for d in (-deq, 0.0, deq):
                        yield sig, s * q * (1 + d)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("nb", [1, 3, 7])
def test_branches_hold_every_point(seed: int, nb: int) -> None:
    rng = np.random.default_rng(seed * 31 + nb)
    s = 2.0**-7
    s_lo, s_hi = s * (1 - 3e-6), s * (1 + 3e-6)
    deq = 2.0**-24
    f, brow = _form(rng, 64, nb, 5, s, tie=False)
    centre, G, noise = Z._binary_branches(f, brow, _q_of(s_lo, s_hi), torch.tensor(s_lo, dtype=F64),
                                          torch.tensor(s_hi, dtype=F64), deq)
    claimed = torch.isfinite(noise)
    assert int(claimed.sum()) > 10, "no element's branches were all single: shows nothing"
    Gbin = G[:nb]
    assert float(G[nb:].abs().max()) == 0.0, "only the binary rows carry the cast"
    worst = 0.0
    for sig, v in _values(f, nb, rng, s_lo, s_hi, deq):
        pred = centre + torch.tensordot(torch.tensor(sig, dtype=F64), Gbin, dims=1)
        dev = (v - pred).abs()
        bad = claimed & (dev > noise)
        assert not bool(bad.any()), (
            f"sigma {sig}: value {float(v[bad][0])!r} off the form by {float(dev[bad][0])!r} "
            f"> noise {float(noise[bad][0])!r}")
        worst = max(worst, float((dev / noise)[claimed].max()))
    print(f"nb {nb}: {int(claimed.sum())}/64 claimed, worst |v - form| / noise {worst:.3f}")


@pytest.mark.parametrize("seed", range(3))
def test_branches_on_midpoints_are_refused(seed: int) -> None:
    """A branch whose quotient lies on an fp8 midpoint (or 1 fp32 ulp off it) may round either
    way: that element's cast is no function of the binary symbols and must not be claimed."""
    rng = np.random.default_rng(100 + seed)
    s = 2.0**-6
    f, brow = _form(rng, 64, 3, 0, s, tie=True)
    # the scale is exact: the quotient's own fp32 rounding (SCALE_SLACK) still straddles
    centre, G, noise = Z._binary_branches(f, brow, _q_of(s, s), torch.tensor(s, dtype=F64),
                                          torch.tensor(s, dtype=F64), 2.0**-24)
    on = f.G[:3].abs().sum(0) >= 0  # every element has its (+1, +1, +1) branch on a midpoint
    assert not bool(torch.isfinite(noise)[on].any()), "a branch on a midpoint was claimed"


def test_branches_are_affine_in_one_symbol() -> None:
    """One binary symbol: the cast is exactly mid + b * half-difference (no higher terms)."""
    s = 2.0**-7
    c = torch.tensor([100.0 * s, -37.0 * s], dtype=F64)
    G = torch.tensor([[4.0 * s, 2.0 * s]], dtype=F64)
    f = Z.Form(c, G, torch.zeros(2, dtype=F64), torch.tensor([0]))
    centre, Gout, noise = Z._binary_branches(f, torch.tensor([0]), _q_of(s, s),
                                             torch.tensor(s, dtype=F64), torch.tensor(s, dtype=F64),
                                             0.0)
    # branches: 104 / 96 and -35 -> -36 (e4m3: spacing 2 in [32, 64)) / -39 -> -40
    assert torch.equal(centre, torch.tensor([100.0 * s, -38.0 * s], dtype=F64))
    assert torch.equal(Gout[0], torch.tensor([4.0 * s, 2.0 * s], dtype=F64))
    assert bool((noise < 1e-12).all())


# --- end to end: flips at fp8 midpoints, a cast downstream of several of them -----------------
def _tie_model(seed: int, n: int = 8, h: int = 6):
    from onnx import helper

    from tests.soundness.adversarial.harness import chain_model

    rng = np.random.default_rng(seed)
    w1 = (rng.normal(size=(n, h)) * 0.5).astype(np.float32)
    w1[:, 0] = 0.0
    w1[0, 0] = 4.0  # y0 = 4 x0: y's amax, whatever the flips (its scale is certain)
    w2 = rng.normal(size=(h, 3)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["y"]),
             helper.make_node("MatMul", ["y", "w2"], ["z"])]
    return chain_model(nodes, [("x", (1, n)), ("w1", w1), ("w2", w2)], ["z"], opset=17)


def _tie_input(rng: np.random.Generator, n: int = 8) -> np.ndarray:
    """x[0] = 3 sets the scale s = fl32(3 / 448) (no power of two); the others are fl32(m s) for
    e4m3 midpoints m (three of them) or values q, moved by -1, 0 or +1 fp32 ulp: the exact
    quotient and its fp32 rounding (ties to even) round the midpoints apart, so those casts are
    genuine flips, and y depends on three of them."""
    s = np.float32(np.float32(3.0) / np.float32(448.0))
    x = np.zeros((1, n), np.float32)
    x[0, 0] = 3.0
    for j in range(1, n):
        q = float(rne(torch.tensor(rng.uniform(8, 300), dtype=F64), FMT))
        m = 0.5 * (q + float(Z.next_up(torch.tensor(q, dtype=F64), FMT))) if j <= 3 else q
        v = np.float32(m * float(s)) * np.float32(rng.choice([-1, 1]))
        x[0, j] = np.nextafter(v, np.float32(rng.choice([-np.inf, np.inf]))) if rng.random() < 0.6 else v
    return x


@pytest.mark.parametrize("seed", range(6))
def test_flips_then_a_cast_hold_conforming_programs(seed: int, monkeypatch) -> None:
    """The first cast's elements straddle (binary symbols); y depends on several of them; the
    second cast may be evaluated on their branches. Conforming programs (the adversarial
    suite's interpreter: orders, the quotient exact or in fp32, rescalings) lie inside."""
    from kcverify.bounds import certify_drift
    from kcverify.kernels.spec import parse_kernel_spec
    from tests.soundness.adversarial.harness import Ledger, graph_of
    from tests.soundness.adversarial.interp import ProgramRunner
    from tests.soundness.adversarial.programs import Program

    train = parse_kernel_spec("train", {"compute": "fp32", "accumulate": "fp32"})
    inf = parse_kernel_spec("inf", {"compute": "fp32", "accumulate": "fp32",
                                    "activations": {"format": "fp8_e4m3",
                                                    "scale": "dynamic_per_tensor"}})
    taken = []
    orig = Z._binary_branches

    def spy(*a, **k):
        out = orig(*a, **k)
        taken.append(int(torch.isfinite(out[2]).sum()))
        return out
    monkeypatch.setattr(Z, "_binary_branches", spy)
    model = _tie_model(seed)
    rng = np.random.default_rng(seed)
    x = _tie_input(rng)
    res = certify_drift(graph_of(model), train, inf, {"x": x}, domain="linear")
    box = res.outputs["z"]
    run = ProgramRunner(model)
    led = Ledger()
    found = []
    zt = run(Program(train), {"x": x})["z"]
    seen = set()
    for o in ("seq", "rev", "greedy_up", "greedy_down"):
        for q in ("exact", "fp32"):
            for rescale in ("one", "two", "exact"):
                p = Program(inf, order=o, quotient=q, rescale=rescale)
                zi = run(p, {"x": x})["z"]
                seen.add(zi.tobytes())
                found += led.check("branches", box, zt, zi, f"{p}")
    assert not found, found[:3]
    assert len(seen) > 1, "the programs never rounded a tie apart: the input shows nothing"
    print(f"seed {seed}: branch elements claimed {sum(taken)}, distinct programs {len(seen)}, "
          f"bound {float(res.linf[0]):.4g}")
    assert sum(taken) > 0, "the branch option was never claimed: the test shows nothing"
