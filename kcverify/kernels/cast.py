"""Exact casts to the number formats of semantics §1.1: Q(t) = s * cast(t / s).

Every function here works on float64 torch tensors (any device) and is exact:

* ``round_to_format(x, fmt, mode)`` rounds each float64 value to the format's grid. It computes the
  grid step q = 2^(max(E, emin) - mantissa_bits) of x's binade (E = floor(log2|x|)), so x / q is an
  exact power-of-two scaling and rounding it to an integer (half to even / floor / ceil) is
  round-to-nearest-even / toward -inf / toward +inf with a single rounding. (torch's own
  ``float64 -> float8 / bfloat16 / float16`` conversions go through float32 and so round twice,
  and so do ml_dtypes'; the tests show the difference.)
* ``cast_grid(t, fmt, s)`` = cast(t / s) with the quotient taken in float64. For t and s that are
  float32 numbers (the executor's tensors, and every scale kcverify makes: scales are float32)
  the quotient's float64 rounding never moves it across a grid point or midpoint of any format
  up to fp32 (a float32 quotient that is not on a midpoint is at least 2^-49 relative away from
  it), so the result is the cast of the real number t / s.
* ``cast_to`` = s * cast_grid: exact in float64, since s has 24 significant bits and a format
  value at most 24.

Overflow. The OCP MX element formats fp6 (e2m3, e3m2) and fp4 (e2m1) have no infinity and
no NaN: their casts always saturate. Float8 casts saturate by default, as ONNX QuantizeLinear(saturate=1) and most FP8
kernels do: a value rounding beyond the largest finite magnitude (448 for e4m3fn, 57344 for e5m2),
and +-inf, become +-max. With ``saturate=False`` they follow the format: e4m3fn (no infinity)
gives NaN, e5m2 / bf16 / fp16 / fp32 give +-inf under round-to-nearest (IEEE: round toward zero
stops at +-max). Integer formats are symmetric and always clamp to [-qmax, qmax].

Rounding modes: ``nearest`` (ties to even), ``up`` (toward +inf), ``down`` (toward -inf),
``random`` (each non-representable value independently to one of its two neighbours with
probability 1/2: what ``rounding: any`` admits, drawn from ``generator``).
"""

from __future__ import annotations

import math

import torch

from kcverify.errors import KernelSpecError
from kcverify.kernels.formats import Format, get_format

ROUNDING_MODES = ("nearest", "up", "down", "random")
_F64 = torch.float64


def as_format(fmt: Format | str) -> Format:
    return fmt if isinstance(fmt, Format) else get_format(fmt)


def _check_mode(mode: str) -> None:
    if mode not in ROUNDING_MODES:
        raise KernelSpecError(f"unknown rounding mode {mode!r}; expected one of {', '.join(ROUNDING_MODES)}")


def grid_step(x: torch.Tensor, fmt: Format) -> torch.Tensor:
    """q(x) = 2^(max(floor(log2|x|), emin) - mantissa_bits): the format's spacing in x's binade."""
    _, e = torch.frexp(x)  # x = m * 2^e with 0.5 <= |m| < 1, so floor(log2|x|) = e - 1
    emin = int(round(math.log2(fmt.min_normal)))
    ex = torch.clamp(e.to(torch.int64) - 1, min=emin) - fmt.mantissa_bits
    return torch.ldexp(torch.ones_like(x), ex)


_MAGIC = 1.5 * 2.0**52


def _rne(y: torch.Tensor) -> torch.Tensor:
    """Round half to even to an integer, for float64 y. (y + 1.5*2^52) - 1.5*2^52 rounds once,
    to nearest-even, for |y| < 2^51 (the sign of zero kept). On some CPU builds torch.round /
    floor / ceil on non-integral float64 take a slow scalar path (~1000x slower than an add), so
    they serve only the rare larger magnitudes."""
    r = torch.copysign((y + _MAGIC) - _MAGIC, y)
    big = ~(y.abs() < 2.0**51)
    if big.any():
        r = torch.where(big, torch.round(y), r)
    return r


def _floor(y: torch.Tensor) -> torch.Tensor:
    r = _rne(y)
    return torch.where(r > y, r - 1.0, r)


def _ceil(y: torch.Tensor) -> torch.Tensor:
    r = _rne(y)
    return torch.where(r < y, r + 1.0, r)


def _is_fp64(fmt: Format) -> bool:
    return fmt.kind == "float" and fmt.mantissa_bits >= 52


def _directed(x: torch.Tensor, fmt: Format, fn) -> torch.Tensor:  # noqa: ANN001 - torch rounding fn
    if fmt.kind == "int":
        return fn(x)
    q = grid_step(x, fmt)
    return fn(x / q) * q


def round_to_format(x: torch.Tensor, fmt: Format | str, mode: str = "nearest",
                    saturate: bool | None = None,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """Round float64 values to ``fmt`` exactly (see module doc for modes and overflow)."""
    fmt = as_format(fmt)
    _check_mode(mode)
    x = x.to(_F64)
    if _is_fp64(fmt):
        return x.clone()
    if mode == "nearest":
        r = _directed(x, fmt, _rne)
        toward_zero = torch.zeros_like(x, dtype=torch.bool)
    elif mode == "up":
        r = _directed(x, fmt, _ceil)
        toward_zero = r < 0
    elif mode == "down":
        r = _directed(x, fmt, _floor)
        toward_zero = r > 0
    else:
        lo = _directed(x, fmt, _floor)
        hi = _directed(x, fmt, _ceil)
        pick_hi = torch.rand(x.shape, generator=generator, dtype=_F64,
                             device="cpu" if generator is None else generator.device).to(x.device) < 0.5
        r = torch.where(pick_hi, hi, lo)
        toward_zero = torch.where(pick_hi, r < 0, r > 0)
    return _overflow(x, r, fmt, saturate, toward_zero)


def _overflow(x: torch.Tensor, r: torch.Tensor, fmt: Format, saturate: bool | None,
              toward_zero: torch.Tensor) -> torch.Tensor:
    m = fmt.max_finite
    if fmt.kind == "int":
        return torch.clamp(r, -m, m)
    if not (fmt.has_inf or fmt.has_nan):
        saturate = True  # fp6 / fp4: nothing else to become
    elif saturate is None:
        saturate = fmt.bits <= 8
    over = (r.abs() > m) | torch.isinf(x)
    if not over.any():
        return r
    signed_max = torch.copysign(torch.full_like(r, m), x)
    if saturate:
        return torch.where(over, signed_max, r)
    beyond = (torch.copysign(torch.full_like(r, math.inf), x) if fmt.has_inf
              else torch.full_like(r, math.nan))
    # IEEE: rounding toward zero from beyond max stops at max; an infinite input stays infinite.
    stop = toward_zero & ~torch.isinf(x)
    return torch.where(over, torch.where(stop, signed_max, beyond), r)


def flush_subnormals(q: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Flush-to-zero: format values below the smallest normal magnitude become zero (sign kept),
    what a kernel with FTZ casts does after rounding."""
    if fmt.kind != "float":
        return q
    return torch.where(q.abs() < fmt.min_normal, q * 0.0, q)


def cast_grid(t: torch.Tensor, fmt: Format | str, scale: float | torch.Tensor = 1.0,
              rounding: str = "nearest", saturate: bool | None = None,
              generator: torch.Generator | None = None) -> torch.Tensor:
    """cast(t / s) in float64: the format values (integer steps for int formats) before rescaling."""
    x = t.to(_F64)
    s = torch.as_tensor(scale, dtype=_F64, device=x.device)
    return round_to_format(x / s, fmt, rounding, saturate, generator)


def cast_to(t: torch.Tensor, fmt: Format | str, scale: float | torch.Tensor = 1.0,
            rounding: str = "nearest", saturate: bool | None = None,
            generator: torch.Generator | None = None) -> torch.Tensor:
    """Q(t) = s * cast(t / s), exact, as a float64 tensor (see the module doc for the semantics)."""
    s = torch.as_tensor(scale, dtype=_F64, device=t.device)
    return cast_grid(t, fmt, s, rounding, saturate, generator) * s


# --- exact error-free transformations (Knuth / Dekker), used by the realizations --------------

def two_sum(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """hi + lo = a + b exactly, hi = fl64(a + b) (Knuth's TwoSum; exact barring overflow)."""
    hi = a + b
    bb = hi - a
    lo = (a - (hi - bb)) + (b - bb)
    return hi, lo


_SPLIT = 134217729.0  # 2^27 + 1, Veltkamp's splitter for float64


def two_prod(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """hi + lo = a * b exactly, hi = fl64(a * b) (Dekker's TwoProduct; exact barring over/underflow)."""
    hi = a * b
    ca = _SPLIT * a
    ah = ca - (ca - a)
    al = a - ah
    cb = _SPLIT * b
    bh = cb - (cb - b)
    bl = b - bh
    lo = ((ah * bh - hi) + ah * bl + al * bh) + al * bl
    return hi, lo


def round_nearest_dd(hi: torch.Tensor, lo: torch.Tensor, fmt: Format) -> torch.Tensor:
    """RNE of the exact value hi + lo (|lo| <= ulp64(hi)/2) to ``fmt``, overflowing to +-inf.

    Rounding hi alone is correct unless hi is exactly a midpoint of the format and lo != 0: then
    the exact value lies strictly on lo's side. (A midpoint has at most 25 significant bits, so a
    float64 hi that is not one is at least ulp64(hi) away from every midpoint, beyond |lo|.)
    """
    if _is_fp64(fmt):
        return hi
    if fmt.name == "fp32":
        return _round_nearest_dd_fp32(hi, lo)
    return _round_nearest_dd_grid(hi, lo, fmt)


def _round_nearest_dd_fp32(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """round_nearest_dd for fp32 via the hardware float64 -> float32 conversion (one RNE
    rounding, IEEE overflow), with the same midpoint correction."""
    r = hi.to(torch.float32).to(_F64)
    d = hi - r  # exact
    other = r + 2.0 * d  # the other neighbour when hi is a midpoint
    mid = (d != 0) & (other.to(torch.float32).to(_F64) == other) & (lo * d > 0)
    return torch.where(mid & torch.isfinite(hi), other, r)


def _round_nearest_dd_grid(hi: torch.Tensor, lo: torch.Tensor, fmt: Format) -> torch.Tensor:
    q = grid_step(hi, fmt)
    y = hi / q
    fl = _floor(y)
    r = _rne(y)
    mid = ((y - fl) == 0.5) & (lo != 0)
    r = torch.where(mid, torch.where(lo > 0, fl + 1.0, fl), r) * q
    r = torch.where(torch.isfinite(hi), r, hi)
    over = r.abs() > fmt.max_finite
    if over.any():
        r = torch.where(over, torch.copysign(torch.full_like(r, math.inf), r), r)
    return r


def add_nearest(a: torch.Tensor, b: torch.Tensor, fmt: Format) -> torch.Tensor:
    """fl_fmt(a + b), correctly rounded to nearest-even, for any float64 a and b."""
    if _is_fp64(fmt):
        return a + b
    hi, lo = two_sum(a, b)
    return round_nearest_dd(hi, lo, fmt)


def mul_nearest(a: torch.Tensor, b: torch.Tensor, fmt: Format) -> torch.Tensor:
    """fl_fmt(a * b), correctly rounded to nearest-even, for any float64 a and b."""
    if _is_fp64(fmt):
        return a * b
    hi, lo = two_prod(a, b)
    return round_nearest_dd(hi, lo, fmt)
