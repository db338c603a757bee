"""The accumulation enclosures of kcverify.bounds.accumulate against adversarial summation trees.

The enclosures are stated for any precision p; at small p (4..8 bits) rounding is frequent, so a
wrong enclosure is caught quickly. The programs here are written apart from kernels/realize.py:
exact rationals, round-to-nearest-even to p bits by hand, summation trees chosen to hurt
(sequential with the fine terms first, sorted ascending / descending, alternating signs,
random trees, pairwise).
"""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest
import torch

from kcverify.bounds.accumulate import dot_error, grain_error, grain_lower, pos_neg_sums
from kcverify.kernels.formats import get_format


def rne(x: Fraction, p: int) -> Fraction:
    """x rounded to nearest (ties to even) with p significant bits, unbounded exponent."""
    if x == 0:
        return x
    e = math.floor(math.log2(abs(x)))
    # fix e exactly (log2 of a Fraction may be off by one near powers of two)
    while abs(x) >= Fraction(2) ** (e + 1):
        e += 1
    while abs(x) < Fraction(2) ** e:
        e -= 1
    q = Fraction(2) ** (e - p + 1)
    k = x / q
    fl = math.floor(k)
    r = k - fl
    n = fl + 1 if r > Fraction(1, 2) or (r == Fraction(1, 2) and fl % 2 == 1) else fl
    return n * q


def tree_sum(terms: list[Fraction], p: int, rng: random.Random, how: str) -> Fraction:
    t = list(terms)
    if how == "sequential":
        acc = t[0]
        for x in t[1:]:
            acc = rne(acc + x, p)
        return acc
    if how == "pairwise":
        while len(t) > 1:
            t = [rne(t[i] + t[i + 1], p) if i + 1 < len(t) else t[i] for i in range(0, len(t), 2)]
        return t[0]
    # random tree: repeatedly add two random live values
    while len(t) > 1:
        i, j = sorted(rng.sample(range(len(t)), 2))
        y = t.pop(j)
        x = t.pop(i)
        t.insert(rng.randrange(len(t) + 1), rne(x + y, p))
    return t[0]


def orders(terms: list[Fraction], rng: random.Random, fine_first: list[int]):
    yield "sequential", terms
    yield "sequential", sorted(terms, key=abs)
    yield "sequential", sorted(terms, key=abs, reverse=True)
    yield "sequential", [terms[i] for i in fine_first] + [t for i, t in enumerate(terms) if i not in set(fine_first)]
    pos = sorted((t for t in terms if t > 0), reverse=True)
    neg = sorted(t for t in terms if t <= 0)
    alt = [x for pair in zip(pos, neg) for x in pair] + pos[len(neg):] + neg[len(pos):]
    yield "sequential", alt
    yield "pairwise", terms
    for _ in range(4):
        s = list(terms)
        rng.shuffle(s)
        yield ("random" if rng.random() < 0.5 else "sequential"), s


def small_float(rng: random.Random, bits: int, emin: int, emax: int) -> Fraction:
    """A random value with at most ``bits`` significant bits and exponent in [emin, emax]."""
    m = rng.randrange(1, 2 ** bits)
    e = rng.randint(emin, emax)
    s = -1 if rng.random() < 0.5 else 1
    return s * Fraction(m) * Fraction(2) ** e


def grain(x: Fraction) -> Fraction:
    """The largest power of two dividing x != 0 (x a dyadic rational)."""
    num = abs(x.numerator)
    return Fraction(num & -num, x.denominator)


@pytest.mark.parametrize("p", [4, 5, 6, 8])
def test_grain_enclosure_holds_for_every_tree(p):
    rng = random.Random(1000 + p)
    worst = 0.0
    for trial in range(150):
        n = rng.randint(2, 24)
        # a coarse bulk and a few fine terms, spanning more than p bits
        bits = rng.randint(1, 3)
        terms = [small_float(rng, bits, 0, p + 2) for _ in range(n)]
        fine = rng.sample(range(n), rng.randint(0, min(3, n)))
        for i in fine:
            terms[i] = small_float(rng, bits, -p - 4, -1)
        exact = sum(terms, Fraction(0))
        t = torch.tensor([[float(x) for x in terms]], dtype=torch.float64)
        ones = torch.ones(n, 1, dtype=torch.float64)
        pos, neg = pos_neg_sums(t, t, ones, ones)
        g_terms = torch.tensor([[float(grain(x))] for x in terms], dtype=torch.float64).T
        bound = grain_error(g_terms, torch.ones(n, 1, dtype=torch.float64), torch.maximum(pos, neg), p)
        nu = (n - 1) * 2.0 ** -p
        classic = nu * float(torch.maximum(pos, neg)) / (1 - nu) if nu < 1 else math.inf
        for how, ordered in orders(terms, rng, fine):
            err = abs(float(tree_sum(ordered, p, rng, how) - exact))
            b = float(bound)
            assert err <= b or math.isinf(b), (p, trial, how, err, b, terms)
            assert err <= classic * (1 + 1e-12), (p, trial, how, err, classic)
            if b > 0 and math.isfinite(b):
                worst = max(worst, err / b)
    assert worst > 0.05  # the attack reaches a sizeable fraction of the enclosure: it can fail


def test_grain_lower_on_fp8_grid():
    import ml_dtypes
    import numpy as np

    fmt = get_format("fp8_e4m3")
    codes = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    v = torch.tensor(codes[np.isfinite(codes)])
    g = grain_lower(v, v, fmt)
    for x, gx in zip(v.tolist(), g.tolist()):
        if x == 0:
            assert math.isinf(gx)
        else:
            assert float(grain(Fraction(x))) >= gx  # true grain >= the bound
    # an interval's bound is below every member's grain
    lo, hi = torch.tensor([0.3, -2.0, -0.01]), torch.tensor([3.0, 0.5, 0.02])
    g = grain_lower(lo.double(), hi.double(), fmt)
    for a, b, gb in zip(lo.tolist(), hi.tolist(), g.tolist()):
        members = [x for x in v.tolist() if a <= x <= b and x != 0]
        assert min(float(grain(Fraction(x))) for x in members) >= gb


def test_fp8_rows_are_exact_in_fp32_when_they_span_24_bits():
    # e4m3 x e4m3 products of a row spanning <= 24 bits: the enclosure is zero, and indeed every
    # order gives the exact sum
    fmt, acc = get_format("fp8_e4m3"), get_format("fp32")
    rng = random.Random(7)
    import ml_dtypes
    import numpy as np
    a = np.array([rng.uniform(-448, 448) for _ in range(64)]).astype(ml_dtypes.float8_e4m3fn)
    b = np.array([rng.uniform(-448, 448) for _ in range(64)]).astype(ml_dtypes.float8_e4m3fn)
    a, b = a.astype(np.float64), b.astype(np.float64)
    A = torch.tensor(a)[None, :]
    B = torch.tensor(b)[:, None]
    err = dot_error(A, A, B, B, acc, True, grain_lower(A, A, fmt), grain_lower(B, B, fmt))
    terms = [Fraction(x) * Fraction(y) for x, y in zip(a, b)]
    exact = sum(terms, Fraction(0))
    for how, ordered in orders(terms, rng, []):
        got = tree_sum(ordered, 24, rng, how)
        assert abs(float(got - exact)) <= float(err)
    span = math.log2(sum(abs(t) for t in terms)) - math.log2(min(grain(t) for t in terms if t))
    if span < 23:
        assert float(err) == 0.0


def test_classical_enclosure_for_rounded_products():
    acc = get_format("fp32")
    a = torch.rand(3, 50, dtype=torch.float64)
    b = torch.rand(50, 4, dtype=torch.float64)
    err = dot_error(a, a, b, b, acc, False)
    assert torch.all(err >= 50 * acc.u * (a @ b) * 0.999)
