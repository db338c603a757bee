"""The zonotope's second-order remainders (docs/bounds.md, "Second-order remainders"), by
sampling against mpmath (tests/bounds/test_zonotope.py's ``_check``: the residual of the exact op
against the output form for the same symbols must be within r_out, 1e-40 relative slack only).

* smooth functions with the Lagrange remainder (``d2_range``: an enclosure of f'' over the
  hull), met with the mean-value one and centred (``zonotope._first_order``): exp, 1/x, rsqrt,
  sqrt, erf, tanh, sigmoid, GELU; forms narrow to huge, boxes narrower than the form (the centre
  may lie outside them), and the f'' enclosures themselves on a fine grid;
* products of two forms by polarization (``zonotope._product_remainder``): shared symbols with
  either sign, disjoint symbols, unbalanced radii, one form squared, large centres;
* that the checks can fail: the centred Lagrange radius without its centre shift, and the
  polarization bound without the noise parts, are caught; and the tightness of the new bounds
  (the worst residual / r_out close to 1 on a square and on exp).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kcverify.bounds import zonotope as Z
from kcverify.bounds.rules.elementwise import _sig_d, _sqrt_d
from kcverify.bounds.zonotope import F64, Form, f_mul, f_smooth
from tests.bounds.test_zonotope import MP, SMOOTH, WIDTHS, _check, _form, _ids, _smooth_form

D2 = {
    "exp": Z._d2_exp, "inv": Z._d2_inv, "rsqrt": Z._d2_rsqrt, "gelu": Z._d2_gelu,
    "erf": Z._d2_erf, "tanh": Z._d2_tanh,
}
EXTRA = {  # name: (f, df, df_range, exact f, positive domain, d2_range)
    "sqrt": (torch.sqrt, lambda t: 0.5 / torch.sqrt(t), _sqrt_d, MP.sqrt, True, Z._d2_sqrt),
    "sigmoid": (torch.sigmoid, lambda t: torch.sigmoid(t) * torch.sigmoid(-t), _sig_d,
                lambda v: 1 / (1 + MP.exp(-v)), False, Z._d2_sigmoid),
}
ALL = {**{k: (*v, D2[k]) for k, v in SMOOTH.items() if k in D2}, **EXTRA}
# exact second derivatives (mpmath) for the enclosure check
EXACT_D2 = {
    "exp": MP.exp, "inv": lambda v: 2 / v ** 3, "rsqrt": lambda v: MP.mpf(3) / 4 * v ** MP.mpf(-2.5),
    "sqrt": lambda v: -v ** MP.mpf(-1.5) / 4,
    "erf": lambda v: -4 / MP.sqrt(MP.pi) * v * MP.exp(-v * v),
    "tanh": lambda v: -2 * MP.tanh(v) / MP.cosh(v) ** 2,
    "sigmoid": lambda v: (lambda s: s * (1 - s) * (1 - 2 * s))(1 / (1 + MP.exp(-v))),
    "gelu": lambda v: MP.exp(-v * v / 2) / MP.sqrt(2 * MP.pi) * (2 - v * v),
}


def _form_for(rng: np.random.Generator, name: str, width: str) -> Form:
    if name in SMOOTH:
        return _smooth_form(rng, name, width)
    c, g, r = WIDTHS[width]
    f = _form(rng, (3, 4), _ids(rng, 6, 4), c=c, g=g, r=r)
    if ALL[name][4]:
        rad = f.G.abs().sum(0) + f.r
        span = {"narrow": 3.0, "wide": 1.05, "huge": 1.001}[width]
        f = f.like(rad * span + 1e-4, f.G, f.r)
    return f


@pytest.mark.parametrize("seed", [1, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("width", sorted(WIDTHS))
@pytest.mark.parametrize("name", sorted(ALL))
def test_smooth_second_order(name: str, width: str, seed: int) -> None:
    f, df, drange, exact, _, d2 = ALL[name]
    rng = np.random.default_rng(seed)
    a = _form_for(rng, name, width)
    lo, hi = a.bounds()
    out = f_smooth(a, lo, hi, f, df, drange, d2)
    assert out is not None, f"{name}/{width}: no form"
    op = np.frompyfunc(exact, 1, 1)
    _check(out, [a], op, rng, n=100 if seed == 1 else 300)
    old = f_smooth(a, lo, hi, f, df, drange)  # the mean-value rule alone
    assert bool((out.r <= old.r * (1 + 1e-9) + 1e-300).all()), name  # never wider
    t = torch.tensor(rng.uniform(0, 0.45, size=(2, *a.shape)), dtype=F64)
    blo, bhi = lo + (hi - lo) * t[0], hi - (hi - lo) * t[1]
    out = f_smooth(a, blo, bhi, f, df, drange, d2)
    assert out is not None
    _check(out, [a], op, rng, n=100 if seed == 1 else 300, box=(blo, bhi))


@pytest.mark.parametrize("name", sorted(EXACT_D2))
def test_d2_ranges_enclose(name: str) -> None:
    """Each f'' enclosure holds on a fine grid of sub-intervals (extremes inside included)."""
    d2 = ALL[name][5]
    rng = np.random.default_rng(7)
    pos = ALL[name][4]
    lo = rng.uniform(1e-3, 5, 400) if pos else rng.uniform(-6, 6, 400)
    w = rng.uniform(0, 3, 400) * (rng.uniform(size=400) > 0.1)
    hi = lo + w
    if name == "inv":  # both signs of 1/x
        neg = rng.uniform(size=400) < 0.5
        lo, hi = np.where(neg, -hi, lo), np.where(neg, -lo, hi)
    m_lo, m_hi = d2(torch.tensor(lo, dtype=F64), torch.tensor(hi, dtype=F64))
    m_lo = Z.pad_lo(m_lo, 1e-12) - Z.TINY
    m_hi = Z.pad_hi(m_hi, 1e-12) + Z.TINY
    ex = EXACT_D2[name]
    for j in range(400):
        xs = [MP.mpf(float(lo[j])) + (MP.mpf(float(hi[j])) - MP.mpf(float(lo[j]))) * i / 64
              for i in range(65)]
        for x0 in (-2, -1.3169578969248166, -0.7071067811865476, -0.6584789484624084, 0,
                   0.6584789484624084, 0.7071067811865476, 1.3169578969248166, 2):
            if lo[j] <= x0 <= hi[j]:
                xs.append(MP.mpf(x0))
        vals = [ex(x) for x in xs]
        assert float(min(vals)) >= float(m_lo[j]) - 1e-300, (name, lo[j], hi[j])
        assert float(max(vals)) <= float(m_hi[j]) + 1e-300, (name, lo[j], hi[j])


def _pair(rng: np.random.Generator, kind: str) -> tuple[Form, Form]:
    shape = (3, 5)
    if kind == "shared":
        ids = _ids(rng, 8, 6)
        a = _form(rng, shape, ids, g=0.4, r=0.05)
        # b correlated with a (either sign per element) plus its own symbols
        sgn = torch.tensor(rng.choice([-1.0, 1.0], size=shape), dtype=F64)
        b = Form(torch.tensor(rng.normal(size=shape), dtype=F64), a.G * sgn * 0.7,
                 torch.tensor(rng.uniform(0, 0.05, size=shape), dtype=F64), a.ids)
        return a, b
    if kind == "disjoint":
        return (_form(rng, shape, list(range(0, 5)), g=0.3),
                _form(rng, shape, list(range(5, 9)), g=0.3))
    if kind == "unbalanced":
        ids = _ids(rng, 8, 5)
        return _form(rng, shape, ids, g=1e-4, r=1e-5), _form(rng, shape, ids, g=30.0, r=2.0)
    if kind == "big":
        ids = _ids(rng, 8, 5)
        return (_form(rng, shape, ids, c=1e4, g=1e-3, r=1e-6, c_mean=-3e4),
                _form(rng, shape, ids, c=1e3, g=2e-3, r=0.0, c_mean=5e3))
    raise ValueError(kind)


@pytest.mark.parametrize("seed", [1, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind", ["shared", "disjoint", "unbalanced", "big"])
def test_product_polarization(kind: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    a, b = _pair(rng, kind)
    out = f_mul(a, b)
    _check(out, [a, b], lambda x, y: x * y, rng, n=150 if seed == 1 else 400)
    _check(f_mul(a, a), [a], lambda x: x * x, rng, n=150 if seed == 1 else 400)
    Z.PRODUCT_SECOND_ORDER = False
    try:
        old = f_mul(a, b)
    finally:
        Z.PRODUCT_SECOND_ORDER = True
    assert bool((out.r <= old.r * (1 + 1e-9) + 1e-300).all())  # never wider
    if kind == "shared":
        assert float(out.r.sum()) < 0.9 * float(old.r.sum())  # and sharper where symbols shared


def test_square_and_exp_are_tight() -> None:
    """The checks are sharp: a square's residual reaches its r (the corners where every symbol
    has the sign of its coefficient), and exp's Lagrange radius is nearly attained."""
    rng = np.random.default_rng(3)
    a = Form(torch.tensor([[0.3, -1.0]], dtype=F64), torch.tensor([[[0.5, 0.2]], [[0.25, -0.1]]],
                                                                  dtype=F64),
             torch.zeros((1, 2), dtype=F64), torch.tensor([0, 1]))
    sq = f_mul(a, a)
    worst = _check(sq, [a], lambda x: x * x, rng, n=400)
    assert worst > 0.97
    lo, hi = a.bounds()
    e = f_smooth(a, lo, hi, torch.exp, torch.exp, SMOOTH["exp"][2], Z._d2_exp)
    worst = _check(e, [a], np.frompyfunc(MP.exp, 1, 1), rng, n=400)
    assert worst > 0.5


def test_broken_variants_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Lagrange interval used without moving the centre (f(c) +- (h - l)/2), and the
    polarization without the noise parts, are each caught by the sampling check."""
    rng = np.random.default_rng(5)
    a = Form(torch.tensor([[0.3, -1.0, 2.0]], dtype=F64),
             torch.tensor([[[0.5, 0.2, 0.4]], [[0.25, -0.1, 0.3]]], dtype=F64),
             torch.zeros((1, 3), dtype=F64), torch.tensor([0, 1]))
    lo, hi = a.bounds()
    orig = Z._first_order

    def unshifted(c, lo, hi, f, df, df_range, d2_range=None):
        cen, lam, rad = orig(c, lo, hi, f, df, df_range, d2_range)
        return f(c), lam, rad

    monkeypatch.setattr(Z, "_first_order", unshifted)
    bad = f_smooth(a, lo, hi, torch.exp, torch.exp, SMOOTH["exp"][2], Z._d2_exp)
    with pytest.raises(AssertionError, match="unsound"):
        _check(bad, [a], np.frompyfunc(MP.exp, 1, 1), rng, n=400)
    monkeypatch.setattr(Z, "_first_order", orig)
    b = a.with_r(torch.full_like(a.r, 0.3))
    a2 = a.with_r(torch.full_like(a.r, 0.3))
    orig_rem = Z._product_remainder

    def no_noise(a, b, ga, gb, loc, same):
        return orig_rem(a.with_r(torch.zeros_like(a.r)), b.with_r(torch.zeros_like(b.r)), ga, gb,
                        loc, same)

    monkeypatch.setattr(Z, "_product_remainder", no_noise)
    bad = f_mul(a2, b)
    with pytest.raises(AssertionError, match="unsound"):
        _check(bad, [a2, b], lambda x, y: x * y, rng, n=600)
    assert math.isfinite(float(bad.r.max()))


@pytest.mark.parametrize("rows", [2, 1024])
@pytest.mark.parametrize("kind", ["shared", "disjoint", "unbalanced"])
def test_matmul_polarization(kind: str, rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """f_matmul of two forms with the per-term polarization (zonotope._matmul_remainder): all
    symbols paired, or two (the rest by the triangle inequality); attention-like shapes."""
    monkeypatch.setattr(Z, "MATMUL_POLAR_ROWS", rows)
    rng = np.random.default_rng(11)
    ids = list(range(7))
    if kind == "shared":
        a = _form(rng, (2, 3, 4), ids, g=0.3, r=0.02)
        w = torch.tensor(rng.normal(size=(4, 4)), dtype=F64)
        b = Form(torch.tensor(rng.normal(size=(2, 4, 3)), dtype=F64),
                 (a.G @ w).transpose(-1, -2)[:, :, :4, :3] * 0.5,
                 torch.tensor(rng.uniform(0, 0.02, size=(2, 4, 3)), dtype=F64), a.ids)
    elif kind == "disjoint":
        a = _form(rng, (2, 3, 4), ids[:4], g=0.3)
        b = _form(rng, (2, 4, 3), ids[4:], g=0.3)
    else:
        a = _form(rng, (2, 3, 4), ids, g=1e-4, r=1e-5)
        b = _form(rng, (1, 4, 3), ids[2:], g=20.0, r=1.0)
    out = Z.f_matmul(a, b)
    _check(out, [a, b], np.matmul, rng, n=120)
    monkeypatch.setattr(Z, "PRODUCT_SECOND_ORDER", False)
    old = Z.f_matmul(a, b)
    assert bool((out.r <= old.r * (1 + 1e-9) + 1e-300).all())
    if kind == "shared":
        assert float(out.r.sum()) < 0.95 * float(old.r.sum())


@pytest.mark.parametrize("seed", [1, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("spread", [0.1, 0.3])
@pytest.mark.parametrize("peaked", [False, True])
def test_softmax_pivot_pipeline(seed: int, spread: float, peaked: bool) -> None:
    """The softmax rule's pipeline with the pivot shift (zonotope._softmax_pivot: z = x - x_p,
    z_p = 0 exactly) and the second-order remainders, on correlated rows (a common shift
    symbol), one entry masked, peaked and flat rows."""
    from tests.bounds.test_zonotope import _mp_rows

    rng = np.random.default_rng(seed)
    x = _form(rng, (3, 6), _ids(rng, 10, 7), c=3.0 if peaked else 0.2, g=0.3 * spread,
              r=0.05 * spread)
    G = x.G.clone()
    G[0] += 0.5 * spread  # a symbol shared by every entry of every row: cancels in z
    x = x.like(x.c, G, x.r)
    masked = torch.zeros(x.shape, dtype=torch.bool)
    masked[1, 2] = True
    lo, hi = x.bounds()
    z, z_lo, z_hi = Z._softmax_pivot(x, masked, lo, hi)
    e = f_smooth(z, Z.pad_lo(z_lo), Z.pad_hi(z_hi), torch.exp, torch.exp,
                 lambda a, b: (torch.exp(a), torch.exp(b)), Z._d2_exp)
    e = Z.f_select(~masked, e, Z.const_form(torch.zeros_like(x.c)))
    s = Z.f_sum(e, -1)
    s_lo, s_hi = s.bounds()
    assert bool((s_lo > 0).all())
    inv = f_smooth(s, s_lo, s_hi, lambda t: 1.0 / t, lambda t: -1.0 / (t * t), Z._inv_drange,
                   Z._d2_inv)
    p = f_mul(e, inv)
    mk = masked.numpy()

    def sm(row: np.ndarray, i: int) -> np.ndarray:
        ex = np.array([MP.mpf(0) if mk[i, j] else MP.exp(v) for j, v in enumerate(row)],
                      dtype=object)
        return ex / ex.sum()

    def rows(a: np.ndarray) -> np.ndarray:
        out = np.empty_like(a)
        for n in range(a.shape[0]):
            for i in range(a.shape[1]):
                out[n, i] = sm(a[n, i], i)
        return out

    assert _mp_rows is not None
    worst = _check(p, [x], rows, rng, n=60 if seed == 1 else 200)
    assert worst <= 1.0


@pytest.mark.parametrize("name", ["inv", "rsqrt", "exp"])
def test_centre_outside_the_box(name: str) -> None:
    """F10 s9: a centre moved by an upstream remainder may lie outside the box (here across
    1/x's and rsqrt's pole); the expansion point is the centre clamped into the box, the hull
    the box: values of the box are enclosed, and the rule never reads f beyond it."""
    f, df, drange, exact, _, d2 = ALL[name]
    rng = np.random.default_rng(4)
    a = _form(rng, (3, 4), _ids(rng, 6, 4), g=0.05, r=0.01)
    a = a.like(torch.full(a.shape, -0.1, dtype=F64), a.G, a.r)  # centre below 0
    lo = torch.full(a.shape, 0.01, dtype=F64)
    hi = torch.full(a.shape, 0.12, dtype=F64)
    out = f_smooth(a, lo, hi, f, df, drange, d2)
    assert out is not None and bool(torch.isfinite(out.r).all())
    shifted = a.like(a.c + 0.15, a.G, a.r)  # the same values moved into the box: the centre in
    out2 = f_smooth(shifted, lo, hi, f, df, drange, d2)
    op = np.frompyfunc(exact, 1, 1)
    # samples of the form that fall in the box (the realizable ones) must be enclosed
    _check(out2, [shifted], op, rng, n=200, box=(lo, hi))
    _check(out, [a], op, rng, n=400, box=(lo, hi))
