"""The adversarial programs' own arithmetic against independent references: ml_dtypes' casts
(single roundings from float32), numpy's float32, and exact rational arithmetic (Fraction).
If these fail, no figure of the suite means anything."""

from __future__ import annotations

import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

from tests.soundness.adversarial.arith import (
    FMT,
    fma_sum,
    next_down,
    next_up,
    ordered_sum,
    rnd,
    round3,
    two_prod,
    within,
)
from tests.soundness.adversarial.interp import ProgramRunner, constant_names
from tests.soundness.adversarial.subjects import shipped

_ML = {"fp8_e4m3": ml_dtypes.float8_e4m3fn, "fp8_e5m2": ml_dtypes.float8_e5m2,
       "bf16": ml_dtypes.bfloat16, "fp16": np.float16}


def _rn_exact(t: Fraction, name: str) -> float:
    """Round-half-even of a rational into a format, by integer arithmetic."""
    f = FMT[name]
    if t == 0:
        return 0.0
    a = abs(t)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    while Fraction(2) ** e > a:
        e -= 1
    while Fraction(2) ** (e + 1) <= a:
        e += 1
    q = Fraction(2) ** (max(e, f.emin) - f.p + 1)
    y = t / q
    fl = math.floor(y)
    r = y - fl
    n = fl + (1 if r > Fraction(1, 2) or (r == Fraction(1, 2) and fl % 2) else 0)
    out = n * q
    return math.copysign(math.inf, out) if abs(out) > f.max else float(out)


@pytest.mark.parametrize("name", sorted(_ML))
def test_rnd_matches_ml_dtypes_from_float32(name: str) -> None:
    rng = np.random.default_rng(0)
    x = (rng.normal(size=50000) * np.exp(rng.uniform(-30, 8, 50000))).astype(np.float32)
    ref = x.astype(_ML[name]).astype(np.float64)
    mine = rnd(x.astype(np.float64), name)
    same = (ref == mine) | (np.isnan(ref) & np.isnan(mine))
    assert same.all(), (x[~same][:5], ref[~same][:5], mine[~same][:5])


def test_rnd_fp32_and_saturation() -> None:
    rng = np.random.default_rng(1)
    y = rng.normal(size=20000) * np.exp(rng.uniform(-100, 80, 20000))
    assert np.array_equal(rnd(y, "fp32"), y.astype(np.float32).astype(np.float64))
    assert rnd(np.array([464.0, 465.0, -1e9]), "fp8_e4m3", sat=True).tolist() == [448.0, 448.0, -448.0]
    assert np.isnan(rnd(np.array([465.0]), "fp8_e4m3"))[0]  # e4m3fn has no infinity


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp8_e4m3"])
def test_neighbours(name: str) -> None:
    rng = np.random.default_rng(2)
    v = rnd(np.clip(rng.normal(size=2000) * np.exp(rng.uniform(-20, 5, 2000)), -400, 400), name)
    v = np.concatenate([v, [0.0, 1.0, -1.0, 2.0 ** FMT[name].emin, FMT[name].tiny]])
    up, down = next_up(v, name), next_down(v, name)
    assert np.all(up > v) and np.all(down < v)
    # nothing of the format strictly between: the midpoint rounds to one of the two
    mid = rnd((v + up) / 2, name)
    assert np.all((mid == v) | (mid == up))


def test_round3_is_one_correct_rounding() -> None:
    rng = np.random.default_rng(3)
    for k in range(6000):
        name = ("fp32", "bf16", "fp16")[k % 3]
        a = float(rnd(rng.normal() * 2.0 ** int(rng.integers(-20, 12)), name))
        b = rng.normal() * 2.0 ** int(rng.integers(-40, 12))
        c = rng.normal() * 2.0 ** int(rng.integers(-90, 0))
        if k % 4 == 0:  # a product's exact pair
            p, e = two_prod(np.array(a), np.array(float(rnd(b, name))))
            b, c = float(p), float(e)
        if k % 4 == 1:  # exactly on a midpoint, nudged
            q = 2.0 ** (math.frexp(a)[1] - FMT[name].p)
            b, c = q / 2 * float(rng.choice([-1, 1])), float(rng.choice([-1, 0, 1])) * 2.0**-90
        want = _rn_exact(Fraction(a) + Fraction(b) + Fraction(c), name)
        got = float(round3(np.array(a), np.array(b), np.array(c), FMT[name]))
        assert got == want, (name, a, b, c, want, got)


def test_two_prod_is_exact() -> None:
    rng = np.random.default_rng(4)
    a, b = rng.normal(size=500), rng.normal(size=500)
    p, e = two_prod(a, b)
    assert all(Fraction(p[i]) + Fraction(e[i]) == Fraction(a[i]) * Fraction(b[i]) for i in range(500))


@pytest.mark.parametrize("k", [1.0, 2.0, 4.0])
def test_within_k_ulps(k: float) -> None:
    x = np.random.default_rng(5).normal(size=5000)
    for mode in ("up", "down"):
        y = within(x, "fp32", k, mode)
        assert np.all(rnd(y, "fp32") == y)
        assert np.all(np.abs(y - x) <= k * 2.0**-24 * np.abs(x))
        assert (np.abs(y - x) > 0.75 * (k - 0.5) * 2.0**-24 * np.abs(x)).mean() > 0.3


@pytest.mark.parametrize("order", ["seq", "rev", "asc", "desc", "posneg", "alt", "pairwise",
                                   "chunk8", "greedy_up", "greedy_down", "random"])
def test_ordered_sum_rounds_every_addition(order: str) -> None:
    """Replayed with Fractions: the same order's partial sums, each rounded exactly."""
    rng = np.random.default_rng(6)
    t = rnd(rng.normal(size=(3, 40)) * np.exp(rng.uniform(-3, 3, (3, 40))), "fp32")
    got = ordered_sum(t, "bf16", order, np.random.default_rng(9))
    exact = t.sum(-1)
    err = np.abs(got - exact)
    bound = 39 * 2.0**-8 * np.abs(t).sum(-1)
    assert np.all(err <= bound)
    if order == "seq":
        for r in range(3):
            s = Fraction(0)
            for v in t[r]:
                s = Fraction(_rn_exact(s + Fraction(float(v)), "bf16"))
            assert float(s) == got[r]
    if order == "greedy_up":
        assert np.all(got >= ordered_sum(t, "bf16", "seq"))


def test_fma_sum_matches_fraction_replay() -> None:
    rng = np.random.default_rng(7)
    a = rnd(rng.normal(size=(4, 32)), "fp32")
    b = rnd(rng.normal(size=(4, 32)), "fp32")
    got = fma_sum(a, b, "fp16", "seq")
    for r in range(4):
        s = Fraction(0)
        for x, y in zip(a[r], b[r]):
            s = Fraction(_rn_exact(s + Fraction(float(x)) * Fraction(float(y)), "fp16"))
        assert float(s) == got[r]


def test_interpreter_agrees_with_onnxruntime_on_nearest_programs() -> None:
    """The fp32 nearest program of every shipped model is within fp32 noise of onnxruntime, and
    the constant tensors it reads as weights are the bound engine's."""
    import onnxruntime as ort

    from kcverify.models.ir import from_onnx
    from tests.soundness.adversarial.harness import TRAIN
    from tests.soundness.adversarial.programs import Program

    for name in ("mlp_small", "tiny_encoder"):
        model = shipped(name)
        feeds = ({"x": np.random.default_rng(8).normal(size=(2, 8)).astype(np.float32)}
                 if name == "mlp_small" else
                 {"input_ids": np.random.default_rng(8).integers(0, 256, size=(1, 8))})
        ref = ort.InferenceSession(model.SerializeToString()).run(None, feeds)[0]
        got = next(iter(ProgramRunner(model)(Program(TRAIN), feeds).values()))
        assert np.abs(got - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max())
        g = from_onnx(model, name)
        mm_inputs = {i for n in model.graph.node if n.op_type in ("MatMul", "Gemm")
                     for i in n.input if i}
        assert constant_names(model) & mm_inputs == set(g.constant_names()) & mm_inputs
