"""Differential boxes: the abstract state of one tensor, and the verifier's own sound arithmetic.

A tensor's state in the interval domain is ``Box(tl, th, il, ih, dl, dh)``: for every input in the
set and every pair of conforming programs, the training value lies in [tl, th], the inference
value in [il, ih], and the drift (inference - training) in [dl, dh]. All six are float64 torch
tensors of the tensor's ONNX shape (axis 0 is the batch for tensors derived from graph inputs).

Tensors that are the same in every program (shapes, indices, masks, weights) are ``Concrete``:
an exact value, plus the number of rounding steps a realization may have applied when it computed
the value from constants (0 for initializers and pure data movement).

Soundness of float64: every bound a rule returns is widened outward by ``REL_PAD`` relative plus
``ABS_PAD`` absolute (``pad_lo``/``pad_hi``), which covers the few correctly rounded float64
operations (and libm's few-ulp exp/erf/tanh) between exact maths and a rule's returned value;
long sums carry their own ``n * 2^-53 * sum|terms|`` term (``fsum``, ``matmul``).

``DiffBox`` is the public, numpy form of a Box (architecture.md): what block records and
certificates store.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np
import torch

from kcverify import boxes
from kcverify.errors import InternalError

U64 = 2.0**-53
REL_PAD = 16 * U64  # relative outward widening applied to every rule result
ABS_PAD = 2.0**-1000  # absolute widening: far above float64 underflow error, far below any eta
F64 = torch.float64


@functools.lru_cache(maxsize=64)
def _factors(rel: float) -> tuple[float, float] | None:
    """(1 - rel, 1 + rel) when both are exact in float64 (rel a power of two: the common
    paddings), else None."""
    lo, hi = 1.0 - rel, 1.0 + rel
    if Fraction(lo) != 1 - Fraction(rel) or Fraction(hi) != 1 + Fraction(rel):
        return None
    return lo, hi


def pad_lo(x: torch.Tensor, rel: float = REL_PAD) -> torch.Tensor:
    """Round a lower bound outward: x - rel*|x| - ABS_PAD (infinities and NaN unchanged).

    With exact factors, min(x (1 - rel), x (1 + rel)) is x - rel|x| for either sign (the same
    single rounding) and keeps infinities without a finiteness test; otherwise |x| is capped
    at the largest double, so an infinite x stays itself (no inf - inf)."""
    f = _factors(rel)
    if f is not None:
        return torch.minimum(x * f[0], x * f[1]).sub_(ABS_PAD)
    return x - _cap(x.abs()) * rel - ABS_PAD


def pad_hi(x: torch.Tensor, rel: float = REL_PAD) -> torch.Tensor:
    """Round an upper bound outward: x + rel*|x| + ABS_PAD (infinities and NaN unchanged)."""
    f = _factors(rel)
    if f is not None:
        return torch.maximum(x * f[0], x * f[1]).add_(ABS_PAD)
    return x + _cap(x.abs()) * rel + ABS_PAD


_DBL_MAX = float(torch.finfo(torch.float64).max)


def _cap(a: torch.Tensor) -> torch.Tensor:
    """min(a, largest double) in place on a fresh tensor (NaN stays NaN)."""
    return a.clamp_max_(_DBL_MAX)


def round_bounds(lo: torch.Tensor, hi: torch.Tensor, r: float, eta: float, max_finite: float,
                 rel: float = 1e-15) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rounding model of RuleCtx.round on tensors: [lo, hi] widened by e(v) = r|v| + eta
    (each end then padded by ``rel``), an infinite end unchanged, an end beyond +-max_finite
    made infinite; and the error bound pad(r * mag + eta), 0 where an end is already infinite,
    inf where a finite end may round beyond max_finite (overflow: the drift is then unbounded).

    Magnitudes capped at the largest double keep an infinite end itself (no inf - inf) without
    a finiteness test."""
    y_lo = lo - r * _cap(lo.abs()) - eta
    y_hi = hi + r * _cap(hi.abs()) + eta
    lo2 = y_lo - _cap(y_lo.abs()) * rel - ABS_PAD
    hi2 = y_hi + _cap(y_hi.abs()) * rel + ABS_PAD
    lo2 = torch.where(lo2 < -max_finite, -math.inf, lo2)
    hi2 = torch.where(hi2 > max_finite, math.inf, hi2)
    w = r * mag(lo, hi) + eta
    err = torch.nan_to_num(w + w.abs() * rel + ABS_PAD, nan=0.0, posinf=0.0, neginf=0.0)
    # a finite exact value whose rounding may overflow: the result may be inf, the error too
    over = (torch.isinf(lo2) & torch.isfinite(lo)) | (torch.isinf(hi2) & torch.isfinite(hi))
    if bool(over.any()):
        err = torch.where(over, math.inf, err)
    return lo2, hi2, err


def nan_to(x: torch.Tensor, v: float) -> torch.Tensor:
    """Replace NaN (no information) by v; infinities stay (unlike torch.nan_to_num's default)."""
    return torch.nan_to_num(x, nan=v, posinf=math.inf, neginf=-math.inf)


_nan_to = nan_to


def meet_lo(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Intersection of two lower bounds, each rounded outward; NaN reads as no information."""
    return torch.maximum(nan_to(pad_lo(a), -float("inf")), nan_to(pad_lo(b), -float("inf")))


def meet_hi(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.minimum(nan_to(pad_hi(a), float("inf")), nan_to(pad_hi(b), float("inf")))


def sub_lo(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Lower bound of a - b for a >= a_lo, b <= b_hi, with inf - inf (same point) read as no
    information (-inf)."""
    d = a - b
    return _nan_to(d, -float("inf"))


def sub_hi(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    d = a - b
    return _nan_to(d, float("inf"))


def imul(al: torch.Tensor, ah: torch.Tensor, bl: torch.Tensor, bh: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Interval product [al, ah] * [bl, bh] (0 * inf read as 0: bounds are of finite values).
    A point given as one tensor for both ends (``bl is bh``) needs two products, not four."""
    if bl is bh:
        c = torch.stack([al * bl, ah * bl])
    elif al is ah:
        c = torch.stack([al * bl, al * bh])
    else:
        c = torch.stack([al * bl, al * bh, ah * bl, ah * bh])
    c = torch.nan_to_num(c, nan=0.0, posinf=math.inf, neginf=-math.inf)
    return c.amin(0), c.amax(0)


def mag(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """max |x| over [lo, hi]."""
    if lo is hi:
        return lo.abs()
    return torch.maximum(lo.abs(), hi.abs())


def mig(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """min |x| over [lo, hi] (lo <= hi): max(lo, -hi) is lo, |hi| or negative (0 inside)."""
    if lo is hi:
        return lo.abs()
    return torch.maximum(lo, -hi).clamp_min_(0.0)


def fsum(lo: torch.Tensor, hi: torch.Tensor, dim: int | tuple[int, ...], keepdim: bool = False
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sound enclosure of sum(x) over ``dim`` for x in [lo, hi], float64 summation error included."""
    n = _numel(lo, dim)
    s_lo, s_hi = lo.sum(dim, keepdim=keepdim), hi.sum(dim, keepdim=keepdim)
    err = (n + 2) * U64 * mag(lo, hi).sum(dim, keepdim=keepdim)
    return s_lo - err, s_hi + err


def _numel(t: torch.Tensor, dim: int | tuple[int, ...]) -> int:
    dims = (dim,) if isinstance(dim, int) else dim
    n = 1
    for d in dims:
        n *= t.shape[d]
    return n


def midrad(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Midpoint and an upward-rounded radius with [m - r, m + r] containing [lo, hi]."""
    m = 0.5 * lo + 0.5 * hi
    r = torch.maximum(hi - m, m - lo)
    return m, pad_hi(r.clamp_min(0.0), 4 * U64)


def imatmul(al: torch.Tensor, ah: torch.Tensor, bl: torch.Tensor, bh: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Interval matmul (numpy broadcasting) in midpoint-radius form, float64 error included.

    Returns (lo, hi, M) with M = |A| @ |B| (magnitudes), which callers reuse for gamma_n terms.
    A point operand (lo == hi: weights, exact data) has radius 0 and skips its radius products.
    """
    point_a, point_b = _is_point(al, ah), _is_point(bl, bh)
    am, ar = (al, None) if point_a else midrad(al, ah)
    bm, br = (bl, None) if point_b else midrad(bl, bh)
    c = torch.matmul(am, bm)
    a_abs, b_abs = am.abs(), bm.abs()
    if ar is None and br is None:
        rad = torch.zeros_like(c)
        magn = torch.matmul(a_abs, b_abs)
    elif br is None:
        rad = torch.matmul(ar, b_abs)
        magn = torch.matmul(a_abs + ar, b_abs)
    elif ar is None:
        rad = torch.matmul(a_abs, br)
        magn = torch.matmul(a_abs, b_abs + br)
    else:
        rad = torch.matmul(a_abs, br) + torch.matmul(ar, b_abs) + torch.matmul(ar, br)
        magn = torch.matmul(a_abs + ar, b_abs + br)
    n = al.shape[-1]
    err = (n + 4) * U64 * magn * 1.01 + rad * (8 * U64)  # = rad * 8 * U64 (powers of two)
    return c - rad - err, c + rad + err, magn


def _is_point(lo: torch.Tensor, hi: torch.Tensor) -> bool:
    """lo == hi everywhere (the same tensor, or equal values; NaN is never a point)."""
    return lo is hi or (lo.shape == hi.shape and torch.equal(lo, hi))


@dataclass
class Concrete:
    """An exact value shared by both kernels; ``rounds`` = rounding steps a realization may have
    applied when computing it from constants (0: initializer, Constant or data movement)."""

    value: torch.Tensor
    rounds: int = 0

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.value.shape)


@dataclass
class Box:
    """Differential interval state of one float tensor (float64 torch tensors, ONNX shape)."""

    tl: torch.Tensor
    th: torch.Tensor
    il: torch.Tensor
    ih: torch.Tensor
    dl: torch.Tensor
    dh: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tl.shape)

    def parts(self) -> tuple[torch.Tensor, ...]:
        return (self.tl, self.th, self.il, self.ih, self.dl, self.dh)

    def map(self, fn: Any) -> Box:
        """Apply a data-movement function (reshape, transpose, gather...) to all six bounds
        (once per distinct tensor: bounds given as one tensor stay one tensor)."""
        done: dict[int, torch.Tensor] = {}
        out = []
        for p in self.parts():
            if id(p) not in done:
                done[id(p)] = fn(p)
            out.append(done[id(p)])
        return Box(*out)

    @staticmethod
    def make(tl: torch.Tensor, th: torch.Tensor, il: torch.Tensor, ih: torch.Tensor,
             dl: torch.Tensor | None = None, dh: torch.Tensor | None = None) -> Box:
        """A box whose drift is [dl, dh] intersected with the difference of the value sets."""
        if dl is None or dh is None:
            return Box(tl, th, il, ih, sub_lo(il, th), sub_hi(ih, tl))
        if dl.shape == dh.shape == tl.shape == th.shape == il.shape == ih.shape:
            # meet_lo(dl, sub_lo(il, th)) with the two rows stacked (NaN -> no information)
            lo = nan_to(pad_lo(torch.stack([dl, il - th])), -math.inf).amax(0)
            hi = nan_to(pad_hi(torch.stack([dh, ih - tl])), math.inf).amin(0)
            return Box(tl, th, il, ih, lo, hi)
        vdl, vdh = sub_lo(il, th), sub_hi(ih, tl)
        lo, hi = meet_lo(dl, vdl), meet_hi(dh, vdh)
        if lo.shape != vdl.shape or hi.shape != vdl.shape:
            shape = torch.broadcast_shapes(lo.shape, hi.shape, vdl.shape)
            lo, hi = lo.expand(shape), hi.expand(shape)
        return Box(tl, th, il, ih, lo, hi)

    def padded(self) -> Box:
        return Box(pad_lo(self.tl), pad_hi(self.th), pad_lo(self.il), pad_hi(self.ih),
                   pad_lo(self.dl), pad_hi(self.dh))

    def hull(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Enclosure of both kernels' values."""
        return torch.minimum(self.tl, self.il), torch.maximum(self.th, self.ih)

    def to_diffbox(self) -> DiffBox:
        # views: DiffBox.__post_init__ builds fresh arrays (np.where), so nothing is shared
        a = [p.detach().to("cpu", F64).numpy() for p in self.parts()]
        return DiffBox(*a)


HadInf = bool | Callable[[], bool]
_FACTORS = _factors(REL_PAD) or (0.0, 0.0)


def _check_shapes(parts: tuple[torch.Tensor, ...], shape: tuple[int, ...] | None, where: str
                  ) -> None:
    s0 = parts[0].shape
    if any(p.shape != s0 for p in parts[1:]):
        raise InternalError(f"{where}: rule returned bounds of different shapes "
                         f"{[tuple(p.shape) for p in parts]}")
    if shape is not None and tuple(s0) != tuple(shape):
        raise InternalError(f"{where}: rule returned shape {tuple(s0)}, expected {tuple(shape)}")


def _ordered(lows: torch.Tensor, highs: torch.Tensor) -> bool:
    """One fused test of a stacked box: no NaN and lo <= hi everywhere. The difference's
    minimum (NaN if any bound is NaN) decides at once unless an interval is one infinity
    (inf - inf), which the comparison then settles."""
    if lows.numel() == 0 or float((highs - lows).amin()) >= 0:
        return True
    return bool((lows <= highs).all())


def check_box(b: Box, shape: tuple[int, ...] | None, where: str, had_inf: HadInf) -> Box:
    """The dispatcher's check of a rule's result: shapes agree, no NaN, lo <= hi.
    ``had_inf`` (or a function computing it, called only when a NaN is found): whether an input
    of the rule was infinite, which makes NaN (inf - inf) legitimate: it then reads as no
    information."""
    parts = list(b.parts())
    _check_shapes(b.parts(), shape, where)
    if _ordered(torch.stack(parts[0::2]), torch.stack(parts[1::2])):
        return b
    return _check_slow(parts, where, had_inf)


def pad_check(b: Box, where: str, had_inf: HadInf) -> Box:
    """``check_box(b.padded(), None, where, had_inf)`` on the six bounds stacked: a few fused
    ops per rule output instead of a few per bound."""
    parts = b.parts()
    _check_shapes(parts, None, where)
    f_lo, f_hi = _FACTORS
    lo, hi = torch.stack(parts[0::2]), torch.stack(parts[1::2])
    lo = torch.minimum(lo * f_lo, lo * f_hi).sub_(ABS_PAD)
    hi = torch.maximum(hi * f_lo, hi * f_hi).add_(ABS_PAD)
    los, his = lo.unbind(0), hi.unbind(0)
    out = [los[0], his[0], los[1], his[1], los[2], his[2]]
    if _ordered(lo, hi):
        return Box(*out)
    return _check_slow(out, where, had_inf)


def _check_slow(parts: list[torch.Tensor], where: str, had_inf: HadInf) -> Box:
    for k in range(0, 6, 2):
        lo, hi = parts[k], parts[k + 1]
        nan = torch.isnan(lo) | torch.isnan(hi)
        if bool(nan.any()):
            if callable(had_inf):
                had_inf = had_inf()
            if not had_inf:
                raise InternalError(f"{where}: rule returned NaN bounds from finite inputs")
            parts[k] = torch.where(nan, torch.full_like(lo, -float("inf")), lo)
            parts[k + 1] = torch.where(nan, torch.full_like(hi, float("inf")), hi)
            lo, hi = parts[k], parts[k + 1]
        if bool((lo > hi).any()):
            bad = (lo > hi).nonzero()[0].tolist()
            raise InternalError(f"{where}: rule returned an empty interval at index {bad} "
                             f"([{float(lo[tuple(bad)])!r}, {float(hi[tuple(bad)])!r}]): "
                             f"two enclosures disagree, a soundness bug")
    return Box(*parts)


class DiffBox(boxes.DiffBox):
    """The public numpy box (kcverify.boxes.DiffBox: six float64 arrays, NaN widened to the whole
    line, containment, linf, exact JSON) plus the conversion to this engine's torch Box."""

    def to_box(self, device: str | torch.device = "cpu") -> Box:
        return Box(*(torch.as_tensor(np.asarray(a, dtype=np.float64), device=device)
                     for a in self.arrays()))
