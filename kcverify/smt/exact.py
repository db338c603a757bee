"""Exact rational arithmetic of the number formats: what the SMT replay executes.

``round_rational(q, fmt, mode)`` rounds a rational to a format's grid exactly (the same grid as
kcverify.kernels.cast.round_to_format: step 2^(max(floor(log2|q|), emin) - mantissa_bits)), so a
replayed program casts, scales and stores exactly as a realization does, with no float in between.
"""

from __future__ import annotations

import math
from fractions import Fraction

from kcverify.errors import KcverifyError
from kcverify.kernels.formats import Format


def fr(x: float) -> Fraction:
    """The exact rational value of a float (float.as_integer_ratio)."""
    return Fraction(*float(x).as_integer_ratio())


def floor_log2(q: Fraction) -> int:
    """floor(log2 |q|) for q != 0, exactly."""
    n, d = abs(q.numerator), q.denominator
    e = n.bit_length() - d.bit_length()
    # 2^e <= n/d < 2^(e+1) after at most one correction
    if (n << max(0, -e)) < (d << max(0, e)):
        e -= 1
    return e


def grid_step(q: Fraction, fmt: Format) -> Fraction:
    """Spacing of fmt's grid in q's binade (subnormal spacing below the normal range)."""
    emin = int(round(math.log2(fmt.min_normal)))
    e = emin if q == 0 else max(floor_log2(q), emin)
    return Fraction(2) ** (e - fmt.mantissa_bits)


def _rne_int(y: Fraction) -> int:
    f = math.floor(y)
    r = y - f
    if r > Fraction(1, 2) or (r == Fraction(1, 2) and f % 2 == 1):
        return f + 1
    return f


def round_rational(q: Fraction, fmt: Format, mode: str = "nearest", saturate: bool | None = None
                   ) -> Fraction:
    """q rounded to fmt (nearest-even, "up", "down"), exactly; fp64 as a grid too. Beyond the
    largest finite value: saturate (8-bit floats by default, int formats always) or raise."""
    if fmt.kind == "int":
        r = Fraction(_rne_int(q) if mode == "nearest" else (math.ceil(q) if mode == "up" else math.floor(q)))
        m = Fraction(int(fmt.max_finite))
        return max(-m, min(m, r))
    step = grid_step(q, fmt)
    y = q / step
    n = _rne_int(y) if mode == "nearest" else (math.ceil(y) if mode == "up" else math.floor(y))
    r = n * step
    mx = fr(fmt.max_finite)
    if abs(r) > mx:
        if saturate is None:
            saturate = fmt.bits == 8
        if not saturate:
            raise KcverifyError(f"exact replay: {float(q):.6g} overflows {fmt.name}")
        r = mx if r > 0 else -mx
    return r


def scale_from_amax(amax: Fraction, fmt: Format, fp32: Format) -> Fraction:
    """s = fl32(amax / max_finite), 1 for an all-zero group (kcverify.kernels.scale)."""
    if amax == 0:
        return Fraction(1)
    return round_rational(amax / fr(fmt.max_finite), fp32)
