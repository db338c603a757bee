"""GELU's value and derivative enclosures are padded relative to the magnitudes involved (the
float64 evaluation error), not absolutely: a point stays a narrow interval (fp64 kernels keep
fp64-sized widths), and the enclosures still hold the exact values (mpmath) near the located
extremes and where 1 + erf cancels."""

from __future__ import annotations

import mpmath as mp
import torch

from kcverify.bounds.box import U64
from kcverify.bounds.rules.activation import D_AT, X_STAR, gelu_drange, gelu_range

C = mp.sqrt(2 / mp.pi)


def _f(x: float, form: str) -> mp.mpf:
    x = mp.mpf(x)
    if form == "tanh":
        return 0.5 * x * (1 + mp.tanh(C * (x + mp.mpf(0.044715) * x ** 3)))
    return 0.5 * x * (1 + mp.erf(x / mp.sqrt(2)))


def _points(form: str) -> list[float]:
    xs, at = X_STAR[form], D_AT[form]
    return [xs, xs + 3e-13, xs - 3e-13, at, -at, at + 1e-13, -at - 1e-13, -9.5, -30.0, -2.0, 0.3,
            1.7, 6.0, 0.0]


def test_gelu_point_enclosures_are_narrow_and_sound() -> None:
    mp.mp.dps = 40
    for form in ("none", "tanh"):
        pts = _points(form)
        x = torch.tensor(pts, dtype=torch.float64)
        lo, hi = gelu_range(x, x, form)
        g_lo, g_hi = gelu_drange(x, x, form)
        for k, p in enumerate(pts):
            v = _f(p, form)
            d = mp.diff(lambda t, form=form: _f(t, form), mp.mpf(p))
            assert mp.mpf(float(lo[k])) <= v <= mp.mpf(float(hi[k])), (form, p)
            assert mp.mpf(float(g_lo[k])) <= d <= mp.mpf(float(g_hi[k])), (form, p)
            # width: a few dozen float64 ulps of the magnitudes (was up to 2e-6 near x*)
            assert float(hi[k] - lo[k]) <= 64 * U64 * (abs(p) + abs(float(v))) + 1e-299, (form, p)
            if abs(p) < 3:
                assert float(g_hi[k] - g_lo[k]) <= 64 * U64 * (2 + abs(p) ** 3), (form, p)
