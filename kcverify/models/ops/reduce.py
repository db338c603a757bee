"""Reductions. Axes are an attribute before the op's input-form opset (ReduceSum 13, the others
18) and an optional input from it on; with no axes every axis is reduced, unless
``noop_with_empty_axes``. Sums are tagged "reduce" (the mean then "div"); max/min are exact."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kcverify.models.ops import OpContext, register_op
from kcverify.models.ops._util import ints, norm_axis

Reducer = Callable[[OpContext, torch.Tensor, tuple[int, ...], bool], torch.Tensor]


def _sum(ctx: OpContext, x: torch.Tensor, dims: tuple[int, ...], keep: bool) -> torch.Tensor:
    return ctx.row_sum(x, dims, keep)


def _mean(ctx: OpContext, x: torch.Tensor, dims: tuple[int, ...], keep: bool) -> torch.Tensor:
    n = 1
    for d in dims:
        n *= x.shape[d]
    if ctx.exact:
        return x.mean(dim=dims, keepdim=keep)
    return ctx.round("div", _sum(ctx, x, dims, keep) / n)


def _max(ctx: OpContext, x: torch.Tensor, dims: tuple[int, ...], keep: bool) -> torch.Tensor:
    return x.amax(dim=dims, keepdim=keep)


def _min(ctx: OpContext, x: torch.Tensor, dims: tuple[int, ...], keep: bool) -> torch.Tensor:
    return x.amin(dim=dims, keepdim=keep)


def _prod(ctx: OpContext, x: torch.Tensor, dims: tuple[int, ...], keep: bool) -> torch.Tensor:
    out = x
    for d in sorted(dims, reverse=True):
        out = ctx.round("mul", out.prod(dim=d, keepdim=keep))
    return out


def _sum_square(ctx: OpContext, x: torch.Tensor, dims: tuple[int, ...], keep: bool) -> torch.Tensor:
    return _sum(ctx, ctx.round("mul", x * x), dims, keep)


def _l2(ctx: OpContext, x: torch.Tensor, dims: tuple[int, ...], keep: bool) -> torch.Tensor:
    return ctx.round("sqrt", torch.sqrt(_sum_square(ctx, x, dims, keep)))


def _reduce(ctx: OpContext, fn: Reducer, x: torch.Tensor, axes: list[int] | None, keepdims: int,
            noop_with_empty_axes: int) -> torch.Tensor:
    if not axes:
        if noop_with_empty_axes:
            return x
        axes = list(range(x.dim()))
    dims = tuple(sorted({norm_axis(a, x.dim()) for a in axes}))
    if x.dim() == 0:
        return x
    return fn(ctx, x, dims, bool(keepdims))


def _register(op: str, fn: Reducer, input_form_since: int) -> None:
    def attr_form(ctx: OpContext, x: torch.Tensor, *, axes: list[int] | None = None,
                  keepdims: int = 1) -> torch.Tensor:
        return _reduce(ctx, fn, x, axes, keepdims, 0)

    def input_form(ctx: OpContext, x: torch.Tensor, axes: torch.Tensor | None = None, *,
                   keepdims: int = 1, noop_with_empty_axes: int = 0) -> torch.Tensor:
        return _reduce(ctx, fn, x, ints(axes), keepdims, noop_with_empty_axes)

    attr_form.__doc__ = f"{op}, axes as an attribute."
    input_form.__doc__ = f"{op}, axes as an optional input."
    register_op(op, since_opset=1)(attr_form)
    register_op(op, since_opset=input_form_since)(input_form)


for _op, _fn, _since in (("ReduceSum", _sum, 13), ("ReduceMean", _mean, 18),
                         ("ReduceMax", _max, 18), ("ReduceMin", _min, 18),
                         ("ReduceProd", _prod, 18), ("ReduceSumSquare", _sum_square, 18),
                         ("ReduceL2", _l2, 18)):
    _register(_op, _fn, _since)


def _arg(x: torch.Tensor, axis: int, keepdims: int, last: int, largest: bool) -> torch.Tensor:
    a = norm_axis(axis, x.dim())
    if last:
        flipped = x.flip(a)
        idx = flipped.argmax(a, keepdim=bool(keepdims)) if largest else flipped.argmin(
            a, keepdim=bool(keepdims))
        return x.shape[a] - 1 - idx
    return x.argmax(a, keepdim=bool(keepdims)) if largest else x.argmin(a, keepdim=bool(keepdims))


@register_op("ArgMax", since_opset=1)
def argmax(ctx: OpContext, x: torch.Tensor, *, axis: int = 0, keepdims: int = 1,
           select_last_index: int = 0) -> torch.Tensor:
    return _arg(x, axis, keepdims, select_last_index, largest=True)


@register_op("ArgMin", since_opset=1)
def argmin(ctx: OpContext, x: torch.Tensor, *, axis: int = 0, keepdims: int = 1,
           select_last_index: int = 0) -> torch.Tensor:
    return _arg(x, axis, keepdims, select_last_index, largest=False)
