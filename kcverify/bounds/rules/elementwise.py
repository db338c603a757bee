"""Arithmetic elementwise ops (Add, Sub, Mul, Div, Neg, Sqrt, Exp, Log, Tanh, Erf, Sigmoid, Pow,
Reciprocal) in the differential interval domain.

Every kernel's value set is the interval extension of the op, rounded by the spec's model for the
primitive (relative ulps*u + eta). Drift rules (NeuroDiff-style): sums propagate drift directly;
products use x_i y_i - x_t y_t = x_t (y_i - y_t) + (x_i - x_t) y_i; quotients
x_i/y_i - x_t/y_t = dx / y_i - x_t dy / (y_i y_t); unary functions the mean-value theorem
(f(x_i) - f(x_t) in f'(hull) * drift). Each drift is intersected with the value-set difference.
"""

from __future__ import annotations

import math

import torch

from kcverify.bounds.box import Box, imul, mag, mig, pad_hi, pad_lo
from kcverify.bounds.registry import Interval, RuleCtx, bound_rule
from kcverify.bounds.rules import cache
from kcverify.errors import BoundError

INF = float("inf")


def _finish(ctx: RuleCtx, prim: str, ft: tuple, fi: tuple, d: tuple) -> Box:
    tl, th, et = ctx.round(ctx.train, prim, *ft)
    il, ih, ei = ctx.round(ctx.inf, prim, *fi)
    return Box.make(tl, th, il, ih, d[0] - et - ei, d[1] + et + ei)


@bound_rule("Add", domain=Interval)
def add(ctx: RuleCtx, a, b) -> Box:
    """a + b: values add, drifts add (one rounding per kernel)."""
    a, b = cache.lift(ctx, a), cache.lift(ctx, b)
    return _finish(ctx, "add", (a.tl + b.tl, a.th + b.th), (a.il + b.il, a.ih + b.ih),
                   (a.dl + b.dl, a.dh + b.dh))


@bound_rule("Sub", domain=Interval)
def sub(ctx: RuleCtx, a, b) -> Box:
    """a - b."""
    a, b = cache.lift(ctx, a), cache.lift(ctx, b)
    return _finish(ctx, "add", (a.tl - b.th, a.th - b.tl), (a.il - b.ih, a.ih - b.il),
                   (a.dl - b.dh, a.dh - b.dl))


@bound_rule("Neg", domain=Interval)
def neg(ctx: RuleCtx, a) -> Box:
    """-a is exact."""
    a = ctx.lift(a)
    return Box(-a.th, -a.tl, -a.ih, -a.il, -a.dh, -a.dl)


def _zero_times_inf(al: torch.Tensor, ah: torch.Tensor, bl: torch.Tensor, bh: torch.Tensor
                    ) -> torch.Tensor:
    """Where a value of [al, ah] may be 0 and one of [bl, bh] infinite, or the other way: the
    product may be 0 * inf = NaN (imul reads it as 0: its bounds are of finite values)."""
    za, zb = (al <= 0) & (ah >= 0), (bl <= 0) & (bh >= 0)
    ia, ib = (al == -INF) | (ah == INF), (bl == -INF) | (bh == INF)
    return (za & ib) | (zb & ia)


def mul_box(ctx: RuleCtx, a: Box, b: Box, prim: str = "mul") -> Box:
    ft = imul(a.tl, a.th, b.tl, b.th)
    fi = imul(a.il, a.ih, b.il, b.ih)
    d1 = imul(a.tl, a.th, b.dl, b.dh)
    d2 = imul(a.dl, a.dh, b.il, b.ih)
    out = _finish(ctx, prim, ft, fi, (d1[0] + d2[0], d1[1] + d2[1]))
    # 0 * inf = NaN in IEEE arithmetic (an overflowed exp times a 0 mask: F6 of session 9): that
    # kernel's value set there is (-inf, inf), which the engine reads as NaN possible
    n_t = _zero_times_inf(a.tl, a.th, b.tl, b.th)
    n_i = _zero_times_inf(a.il, a.ih, b.il, b.ih)
    if bool(n_t.any()) or bool(n_i.any()):
        n_t, n_i = n_t.expand(out.shape), n_i.expand(out.shape)
        out = Box(torch.where(n_t, -INF, out.tl), torch.where(n_t, INF, out.th),
                  torch.where(n_i, -INF, out.il), torch.where(n_i, INF, out.ih), out.dl, out.dh)
    return out


@bound_rule("Mul", domain=Interval)
def mul(ctx: RuleCtx, a, b) -> Box:
    """a * b: x_i y_i - x_t y_t = x_t dy + dx y_i."""
    return mul_box(ctx, cache.lift(ctx, a), cache.lift(ctx, b))


def inv(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """1/[lo, hi]; the whole line when 0 is inside."""
    zero = (lo <= 0) & (hi >= 0)
    a, b = 1.0 / hi, 1.0 / lo
    a = torch.where(zero, torch.full_like(a, -INF), a)
    b = torch.where(zero, torch.full_like(b, INF), b)
    return pad_lo(a), pad_hi(b)


def div_box(ctx: RuleCtx, a: Box, b: Box) -> Box:
    """a / b. A divisor whose value set holds 0 (e.g. 1e-9 stored in fp16) may make the
    quotient inf or 0/0 = NaN: that kernel's value, and the drift, have no bound there."""
    it, ii = inv(b.tl, b.th), inv(b.il, b.ih)
    ft, fi = imul(a.tl, a.th, *it), imul(a.il, a.ih, *ii)
    d1 = imul(a.dl, a.dh, *ii)
    q = imul(*imul(a.tl, a.th, *it), *ii)
    d2 = imul(*q, -b.dh, -b.dl)
    out = _finish(ctx, "div", ft, fi, (d1[0] + d2[0], d1[1] + d2[1]))
    z_t = (b.tl <= 0) & (b.th >= 0)
    z_i = (b.il <= 0) & (b.ih >= 0)
    if bool((z_t | z_i).any()):
        z_t, z_i = z_t.expand(out.shape), z_i.expand(out.shape)
        z = z_t | z_i
        out = Box(torch.where(z_t, -INF, out.tl), torch.where(z_t, INF, out.th),
                  torch.where(z_i, -INF, out.il), torch.where(z_i, INF, out.ih),
                  torch.where(z, -INF, out.dl), torch.where(z, INF, out.dh))
    return out


@bound_rule("Div", domain=Interval)
def div(ctx: RuleCtx, a, b) -> Box:
    """a / b: dx / y_i - x_t dy / (y_i y_t)."""
    return div_box(ctx, cache.lift(ctx, a), cache.lift(ctx, b))


@bound_rule("Reciprocal", domain=Interval)
def reciprocal(ctx: RuleCtx, a) -> Box:
    b = ctx.lift(a)
    one = torch.ones_like(b.tl)
    return div_box(ctx, Box(one, one, one, one, 0 * one, 0 * one), b)


# --- unary functions: value map and derivative range ------------------------------------
def _mono(fn):
    def f(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return pad_lo(fn(lo), 8 * 2.0**-53), pad_hi(fn(hi), 8 * 2.0**-53)
    return f


def _exp_d(lo, hi):
    return torch.exp(lo), torch.exp(hi)


_D_PAD = 64 * 2.0**-53  # libm's few-ulp cosh / sigmoid and the products, with margin


def _tanh_d(lo, hi):
    """tanh' = 1 / cosh^2 over [lo, hi] (not 1 - tanh^2: it cancels to 0 beyond |x| ~ 19 and
    the upper end would be below the true derivative)."""
    m = mig(lo, hi)
    big = mag(lo, hi)
    return pad_lo(torch.cosh(big) ** -2, _D_PAD), pad_hi(torch.cosh(m) ** -2, _D_PAD)


def _erf_d(lo, hi):
    c = 2 / math.sqrt(math.pi)
    return c * torch.exp(-mag(lo, hi) ** 2), c * torch.exp(-mig(lo, hi) ** 2)


def _sig_d(lo, hi):
    """sigmoid' = s(x) s(-x) over [lo, hi] (not s (1 - s): 1 - s cancels to 0 beyond x ~ 36.7 and
    the upper end would be below the true derivative)."""
    big, small = mag(lo, hi), mig(lo, hi)
    return (pad_lo(torch.sigmoid(big) * torch.sigmoid(-big), _D_PAD),
            pad_hi(torch.sigmoid(small) * torch.sigmoid(-small), _D_PAD))


def _sqrt_f(lo, hi):
    if bool((lo < 0).any()):
        lo = lo.clamp_min(0.0)
    return pad_lo(torch.sqrt(lo)), pad_hi(torch.sqrt(hi.clamp_min(0.0)))


def _sqrt_d(lo, hi):
    lo = lo.clamp_min(0.0)
    return 0.5 / torch.sqrt(hi.clamp_min(0.0)), torch.where(lo > 0, 0.5 / torch.sqrt(lo),
                                                           torch.full_like(lo, INF))


def _log_f(lo, hi):
    return pad_lo(torch.log(lo.clamp_min(0.0))), pad_hi(torch.log(hi.clamp_min(0.0)))


def _log_d(lo, hi):
    return 1.0 / hi.clamp_min(0.0), torch.where(lo > 0, 1.0 / lo, torch.full_like(lo, INF))


def _check_sqrt_domain(ctx: RuleCtx, x: Box) -> None:
    if bool(((x.tl < 0) | (x.il < 0)).any()):
        # sqrt of a possibly negative value: NaN in a conforming program
        raise BoundError(f"{ctx.node.op_type} node {ctx.node.name!r}: argument may be negative; "
                         f"cannot bound sqrt/log of it")


@bound_rule("Exp", domain=Interval)
def exp(ctx: RuleCtx, a) -> Box:
    return ctx.elementwise(ctx.lift(a), _mono(torch.exp), _exp_d, "exp")


@bound_rule("Tanh", domain=Interval)
def tanh(ctx: RuleCtx, a) -> Box:
    return ctx.elementwise(ctx.lift(a), _mono(torch.tanh), _tanh_d, "tanh")


@bound_rule("Erf", domain=Interval)
def erf(ctx: RuleCtx, a) -> Box:
    return ctx.elementwise(ctx.lift(a), _mono(torch.erf), _erf_d, "erf")


@bound_rule("Sigmoid", domain=Interval)
def sigmoid(ctx: RuleCtx, a) -> Box:
    return ctx.elementwise(ctx.lift(a), _mono(torch.sigmoid), _sig_d, "sigmoid")


@bound_rule("Sqrt", domain=Interval)
def sqrt(ctx: RuleCtx, a) -> Box:
    x = ctx.lift(a)
    _check_sqrt_domain(ctx, x)
    return ctx.elementwise(x, _sqrt_f, _sqrt_d, "sqrt")


@bound_rule("Log", domain=Interval)
def log(ctx: RuleCtx, a) -> Box:
    x = ctx.lift(a)
    _check_sqrt_domain(ctx, x)
    return ctx.elementwise(x, _log_f, _log_d, "log")


def _sq_f(lo, hi):
    return pad_lo(mig(lo, hi) ** 2), pad_hi(mag(lo, hi) ** 2)


def _sq_d(lo, hi):
    return 2 * lo, 2 * hi


@bound_rule("Pow", domain=Interval)
def pow_(ctx: RuleCtx, a, p) -> Box:
    """x ** p for a constant p in {1, 2, 0.5, 3}."""
    from kcverify.bounds.box import Concrete

    if not isinstance(p, Concrete) or p.value.numel() != 1:
        raise BoundError(f"Pow node {ctx.node.name!r}: exponent must be a constant scalar")
    e = float(p.value.reshape(()))
    x = ctx.lift(a)
    if e == 1.0:
        return x
    if e == 2.0:
        return ctx.elementwise(x, _sq_f, _sq_d, "pow")
    if e == 0.5:
        _check_sqrt_domain(ctx, x)
        return ctx.elementwise(x, _sqrt_f, _sqrt_d, "pow")
    if e == 3.0:
        return ctx.elementwise(x, _mono(lambda t: t ** 3),
                               lambda lo, hi: (3 * mig(lo, hi) ** 2, 3 * mag(lo, hi) ** 2), "pow")
    raise BoundError(f"Pow node {ctx.node.name!r}: exponent {e} not supported "
                     f"(supported: 0.5, 1, 2, 3)")


def _select(ctx: RuleCtx, xs: list, fn) -> Box:
    boxes = [ctx.lift(x) for x in xs if x is not None]
    out = boxes[0]
    for b in boxes[1:]:
        out = Box(fn(out.tl, b.tl), fn(out.th, b.th), fn(out.il, b.il), fn(out.ih, b.ih),
                  torch.minimum(out.dl, b.dl), torch.maximum(out.dh, b.dh))
    return Box.make(out.tl, out.th, out.il, out.ih, out.dl, out.dh)


@bound_rule("Max", domain=Interval)
def max_(ctx: RuleCtx, *xs) -> Box:
    """Elementwise max: a selection (no rounding), monotone and 1-Lipschitz in L-inf, so its
    drift lies within [min of the drift lows, max of the drift highs]."""
    return _select(ctx, list(xs), torch.maximum)


@bound_rule("Min", domain=Interval)
def min_(ctx: RuleCtx, *xs) -> Box:
    """Elementwise min (as Max)."""
    return _select(ctx, list(xs), torch.minimum)
