"""Elementwise arithmetic, comparisons and logic (numpy multidirectional broadcasting).

Each float result is tagged with its primitive: Add/Sub/Sum -> "add", Mul -> "mul",
Div/Reciprocal -> "div", Sqrt -> "sqrt", Pow -> "pow", Exp -> "exp", Log -> "log", Sin/Cos ->
"exp" (a transcendental with the same default ulps). Ops whose result is one of their inputs
(Neg, Abs, Max, Min, Relu, Clip, comparisons, Where) are exact and not tagged."""

from __future__ import annotations

import torch

from kcverify.models.ops import OpContext, register_op


@register_op("Add", since_opset=7)
def add(ctx: OpContext, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return ctx.round("add", a + b)


@register_op("Sub", since_opset=7)
def sub(ctx: OpContext, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return ctx.round("add", a - b)


@register_op("Mul", since_opset=7)
def mul(ctx: OpContext, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return ctx.round("mul", a * b)


@register_op("Div", since_opset=7)
def div(ctx: OpContext, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a / b; integer division truncates toward zero (as onnxruntime does)."""
    if a.is_floating_point() or b.is_floating_point():
        return ctx.round("div", a / b)
    return torch.div(a, b, rounding_mode="trunc")


@register_op("Mod", since_opset=10)
def mod(ctx: OpContext, a: torch.Tensor, b: torch.Tensor, *, fmod: int = 0) -> torch.Tensor:
    """Integer modulus with the sign of the divisor (fmod=0) or of the dividend (fmod=1)."""
    return torch.fmod(a, b) if fmod else torch.remainder(a, b)


@register_op("Sum", since_opset=8)
def sum_(ctx: OpContext, *xs: torch.Tensor) -> torch.Tensor:
    out = xs[0]
    for x in xs[1:]:
        out = ctx.round("add", out + x)
    return out


@register_op("Pow", since_opset=7)
def pow_(ctx: OpContext, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a ** b; the result has a's type."""
    out = torch.pow(a, b)
    if out.dtype != a.dtype:
        out = out.to(a.dtype)
    return ctx.round("pow", out)


@register_op("Neg", since_opset=6)
def neg(ctx: OpContext, x: torch.Tensor) -> torch.Tensor:
    return -x


@register_op("Abs", since_opset=6)
def abs_(ctx: OpContext, x: torch.Tensor) -> torch.Tensor:
    return x.abs()


@register_op("Sign", since_opset=9)
def sign(ctx: OpContext, x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x)


@register_op("Floor", since_opset=6)
def floor(ctx: OpContext, x: torch.Tensor) -> torch.Tensor:
    return torch.floor(x)


@register_op("Ceil", since_opset=6)
def ceil(ctx: OpContext, x: torch.Tensor) -> torch.Tensor:
    return torch.ceil(x)


@register_op("Round", since_opset=11)
def round_(ctx: OpContext, x: torch.Tensor) -> torch.Tensor:
    """Round half to even."""
    return torch.round(x)


def _fold(fn, xs: tuple[torch.Tensor, ...]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    out = xs[0]
    for x in xs[1:]:
        out = fn(out, x)
    return out


@register_op("Max", since_opset=8)
def max_(ctx: OpContext, *xs: torch.Tensor) -> torch.Tensor:
    return _fold(torch.maximum, xs)


@register_op("Min", since_opset=8)
def min_(ctx: OpContext, *xs: torch.Tensor) -> torch.Tensor:
    return _fold(torch.minimum, xs)


@register_op("Clip", since_opset=11)
def clip(ctx: OpContext, x: torch.Tensor, lo: torch.Tensor | None = None,
         hi: torch.Tensor | None = None) -> torch.Tensor:
    """min(max(x, lo), hi) with optional scalar bounds as inputs."""
    if lo is not None:
        x = torch.maximum(x, lo.to(x.dtype))
    if hi is not None:
        x = torch.minimum(x, hi.to(x.dtype))
    return x


@register_op("Clip", since_opset=6)
def clip_attr(ctx: OpContext, x: torch.Tensor, *, min: float = -3.4028234663852886e38,  # noqa: A002
              max: float = 3.4028234663852886e38) -> torch.Tensor:  # noqa: A002
    return x.clamp(min, max)


@register_op("Not", since_opset=1)
def not_(ctx: OpContext, x: torch.Tensor) -> torch.Tensor:
    return torch.logical_not(x)


@register_op("And", since_opset=7)
def and_(ctx: OpContext, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.logical_and(a, b)


@register_op("Or", since_opset=7)
def or_(ctx: OpContext, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.logical_or(a, b)


@register_op("Xor", since_opset=7)
def xor(ctx: OpContext, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.logical_xor(a, b)


@register_op("IsNaN", since_opset=9)
def isnan(ctx: OpContext, x: torch.Tensor) -> torch.Tensor:
    return torch.isnan(x)


@register_op("IsInf", since_opset=10)
def isinf(ctx: OpContext, x: torch.Tensor, *, detect_negative: int = 1,
          detect_positive: int = 1) -> torch.Tensor:
    return (torch.isposinf(x) & bool(detect_positive)) | (torch.isneginf(x) & bool(detect_negative))


@register_op("Where", since_opset=9)
def where(ctx: OpContext, cond: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.where(cond.to(torch.bool), a, b)


# Unary ops whose result is one primitive of the compute format (DEFAULT_ULPS): op type ->
# (since opset, torch function, primitive). Sin / Cos count as transcendental like exp.
UNARY: dict[str, tuple[int, object, str]] = {
    "Sqrt": (6, torch.sqrt, "sqrt"), "Reciprocal": (6, torch.reciprocal, "div"),
    "Exp": (6, torch.exp, "exp"), "Log": (6, torch.log, "log"), "Sin": (7, torch.sin, "exp"),
    "Cos": (7, torch.cos, "exp"), "Erf": (9, torch.erf, "erf"), "Tanh": (6, torch.tanh, "tanh"),
    "Sigmoid": (6, torch.sigmoid, "sigmoid"),
}


def _unary(fn: object, primitive: str) -> object:
    def op(ctx: OpContext, x: torch.Tensor) -> torch.Tensor:
        return ctx.round(primitive, fn(x))  # type: ignore[operator]

    return op


for _name, (_since, _fn, _prim) in UNARY.items():
    register_op(_name, since_opset=_since)(_unary(_fn, _prim))  # type: ignore[arg-type]


# Comparisons: exact, no rounding. op type -> (since opset, torch function).
COMPARISONS: dict[str, tuple[int, object]] = {
    "Equal": (7, torch.eq), "Less": (7, torch.lt), "LessOrEqual": (12, torch.le),
    "Greater": (7, torch.gt), "GreaterOrEqual": (12, torch.ge),
}


def _comparison(fn: object) -> object:
    def op(ctx: OpContext, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return fn(a, b)  # type: ignore[operator]

    return op


for _name, (_since, _fn) in COMPARISONS.items():
    register_op(_name, since_opset=_since)(_comparison(_fn))  # type: ignore[arg-type]
