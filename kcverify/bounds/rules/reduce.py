"""ReduceSum / ReduceMean / ReduceMax / ReduceMin, and the row-sum error model.

Every sum a conforming program forms over a tensor's elements (a standalone ReduceSum, and the
row sums inside Softmax and LayerNormalization) is accumulated in the spec's ``accumulate``
format in any order (any evaluation tree), then stored in the compute format with
ulps("reduce"). ``row_sum_factor`` is that model's one formula: with the terms values of the
accumulator (the compute format is no finer than it), |fl(sum) - sum| <= (n - 1) u_acc sum |x|
(Jeannerod & Rump 2013, any order, any n); otherwise gamma_n(u_acc) sum |x| + n eta_acc (every
term rounded on entry). Every partial sum is bounded the same way (``partial_overflow``): where
one may exceed the accumulator's range the sum has no bound (inf), even if the exact sum is in
range (fp16: 40000 + 40000 = inf before - 40000). The sum is then stored in the compute format,
where it may overflow too (fp16: a row summing to 90000 is inf, and so its mean), and a mean
divides that stored sum by n (one more rounding). Drift: sum of drifts plus both kernels'
errors. Max/min are monotone selections (1-Lipschitz in L-inf): drift within [min dl, max dh]
of the reduced group.
"""

from __future__ import annotations

import math

import torch

from kcverify.bounds.box import Box, Concrete, fsum, mag
from kcverify.bounds.registry import Interval, RuleCtx, bound_rule
from kcverify.kernels.formats import sum_error
from kcverify.kernels.spec import KernelSpec
from kcverify.models.ops._util import norm_axis


def terms_exact(spec: KernelSpec) -> bool:
    """Whether every compute-format value is a value of the accumulator format."""
    c, a = spec.compute, spec.accumulate
    return a.mantissa_bits >= c.mantissa_bits and a.exponent_bits >= c.exponent_bits


def row_sum_factor(spec: KernelSpec, n: int) -> tuple[float, float]:
    """(k, a): a sum of n terms accumulated by ``spec`` in any order is within
    k * sum |x| + a of the exact sum (before it is stored in the compute format)."""
    acc = spec.accumulate
    exact = terms_exact(spec)
    k = sum_error(n, acc.u, exact)
    return k * (1 + 1e-12), (0.0 if exact else n * acc.eta)


def partial_overflow(spec: KernelSpec, n: int, pos: torch.Tensor, neg: torch.Tensor
                     ) -> torch.Tensor:
    """Whether some partial sum of a row accumulated by ``spec`` may overflow the accumulator.

    Every partial sum (any order, any tree) is a sum over a subset of the terms, so its exact
    value lies in [-neg, pos] (pos: the sum of the positive parts, neg: of the negative parts'
    magnitudes), and its computed value within (1 + k) max(pos, neg) + a of 0 (row_sum_factor,
    which bounds every subtree as it bounds the root). Beyond the accumulator's max_finite it
    may be +-inf, and the sum then inf or NaN although the exact sum is in range."""
    k, a = row_sum_factor(spec, n)
    big = torch.maximum(pos, neg) * (1 + k) * (1 + (n + 4) * 2.0**-52) + a
    return big > spec.accumulate.max_finite


# axes as an attribute (before opsets 13 / 18) or an input; keepdims; noop_with_empty_axes
# keepdims / noop_with_empty_axes are 0 or 1 (onnxruntime reads keepdims = 2 as 0: refused)
REDUCE_ATTRS = {"axes": None, "keepdims": (0, 1), "noop_with_empty_axes": (0, 1)}


def _axes(ctx: RuleCtx, x: Box, axes) -> tuple[int, ...]:
    if isinstance(axes, Concrete):
        ax = [int(a) for a in axes.value.reshape(-1).tolist()]
    else:
        ax = ctx.attr("axes")
    if not ax:
        if int(ctx.attr("noop_with_empty_axes", 0)):
            return ()
        return tuple(range(len(x.shape)))
    # an axis outside [-r, r) is refused (ValueError: one located line), never read as axis % r
    return tuple(sorted({norm_axis(int(a), len(x.shape)) for a in ax}))


def _reduce_sum(ctx: RuleCtx, x: Box, dims: tuple[int, ...], keep: bool, mean: bool) -> Box:
    n = 1
    for d in dims:
        n *= x.shape[d]
    vals, errs = [], []
    for spec, lo, hi in ((ctx.train, x.tl, x.th), (ctx.inf, x.il, x.ih)):
        s_lo, s_hi = fsum(lo, hi, dims, keepdim=keep)
        k, a = row_sum_factor(spec, n)  # any order in the accumulator; ctx.round adds the rest
        acc = k * mag(lo, hi).sum(dims, keepdim=keep) * (1 + (n + 4) * 2.0**-52) + a
        s_lo, s_hi = s_lo - acc, s_hi + acc
        # the sum is stored in the compute format (it may overflow there: inf, and so the mean)
        lo2, hi2, r = ctx.round(spec, "reduce", s_lo, s_hi)
        if mean:  # then one division of the stored sum: |m - S/n| <= r_div + (acc + r) / n
            lo2, hi2, r_div = ctx.round(spec, "div", lo2 / n, hi2 / n)
            acc, r = acc / n, r / n + r_div
        pos = hi.clamp_min(0.0).sum(dims, keepdim=keep)
        neg = (-lo).clamp_min(0.0).sum(dims, keepdim=keep)
        over = partial_overflow(spec, n, pos, neg)
        if bool(over.any()):  # a partial sum may be +-inf: no bound
            lo2 = torch.where(over, -math.inf, lo2)
            hi2 = torch.where(over, math.inf, hi2)
            r = torch.where(over, math.inf, r)
        vals += [lo2, hi2]
        errs.append(acc + r)
    d_lo, d_hi = fsum(x.dl, x.dh, dims, keepdim=keep)
    if mean:
        d_lo, d_hi = d_lo / n, d_hi / n
    return Box.make(*vals, d_lo - errs[0] - errs[1], d_hi + errs[0] + errs[1])


@bound_rule("ReduceSum", domain=Interval, attrs=REDUCE_ATTRS)
def reduce_sum(ctx: RuleCtx, x, axes=None) -> Box:
    b = ctx.lift(x)
    dims = _axes(ctx, b, axes)
    return _reduce_sum(ctx, b, dims, bool(int(ctx.attr("keepdims", 1))), mean=False) if dims else b


@bound_rule("ReduceMean", domain=Interval, attrs=REDUCE_ATTRS)
def reduce_mean(ctx: RuleCtx, x, axes=None) -> Box:
    b = ctx.lift(x)
    dims = _axes(ctx, b, axes)
    return _reduce_sum(ctx, b, dims, bool(int(ctx.attr("keepdims", 1))), mean=True) if dims else b


def _reduce_sel(ctx: RuleCtx, x, axes, fn) -> Box:
    b = ctx.lift(x)
    dims = _axes(ctx, b, axes)
    keep = bool(int(ctx.attr("keepdims", 1)))
    if not dims:
        return b
    parts = [fn(p, dims, keep) for p in b.parts()[:4]]
    dl = b.dl.amin(dim=dims, keepdim=keep)
    dh = b.dh.amax(dim=dims, keepdim=keep)
    return Box.make(*parts, dl, dh)


@bound_rule("ReduceMax", domain=Interval, attrs=REDUCE_ATTRS)
def reduce_max(ctx: RuleCtx, x, axes=None) -> Box:
    return _reduce_sel(ctx, x, axes, lambda t, d, k: torch.amax(t, dim=d, keepdim=k))


@bound_rule("ReduceMin", domain=Interval, attrs=REDUCE_ATTRS)
def reduce_min(ctx: RuleCtx, x, axes=None) -> Box:
    return _reduce_sel(ctx, x, axes, lambda t, d, k: torch.amin(t, dim=d, keepdim=k))
