"""Activations and the softmax family.

With the Exact arithmetic the fused torch functions run; with any other arithmetic composite ops
run as their decomposition into primitives, each result tagged through ``ctx.round``:
softmax(x) = e / sum(e), e = exp(x - max x) ("add", "exp", "reduce", "div");
gelu(x) = x/2 (1 + erf(x / sqrt 2)) or x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kcverify.models.ops import OpContext, register_op
from kcverify.models.ops._util import norm_axis


@register_op("Relu", since_opset=6)
def relu(ctx: OpContext, x: torch.Tensor) -> torch.Tensor:
    """max(x, 0): exact."""
    return torch.relu(x)


@register_op("LeakyRelu", since_opset=6)
def leaky_relu(ctx: OpContext, x: torch.Tensor, *, alpha: float = 0.01) -> torch.Tensor:
    return torch.where(x >= 0, x, ctx.round("mul", x * alpha))


@register_op("PRelu", since_opset=9)
def prelu(ctx: OpContext, x: torch.Tensor, slope: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 0, x, ctx.round("mul", x * slope))


@register_op("HardSigmoid", since_opset=6)
def hard_sigmoid(ctx: OpContext, x: torch.Tensor, *, alpha: float = 0.2,
                 beta: float = 0.5) -> torch.Tensor:
    y = ctx.round("add", ctx.round("mul", x * alpha) + beta)
    return y.clamp(0.0, 1.0)


@register_op("Softplus", since_opset=1)
def softplus(ctx: OpContext, x: torch.Tensor) -> torch.Tensor:
    """log(1 + exp(x))."""
    if ctx.exact:
        return F.softplus(x)
    e = ctx.round("exp", torch.exp(x))
    return ctx.round("log", torch.log1p(e))


@register_op("Gelu", since_opset=20)
def gelu(ctx: OpContext, x: torch.Tensor, *, approximate: str = "none") -> torch.Tensor:
    if ctx.exact:
        return F.gelu(x, approximate="tanh" if approximate == "tanh" else "none")
    if approximate == "tanh":
        x3 = ctx.round("mul", ctx.round("mul", x * x) * x)
        inner = ctx.round("add", x + ctx.round("mul", 0.044715 * x3))
        t = ctx.round("tanh", torch.tanh(ctx.round("mul", math.sqrt(2.0 / math.pi) * inner)))
    else:
        t = ctx.round("erf", torch.erf(ctx.round("mul", x * (1.0 / math.sqrt(2.0)))))
    return ctx.round("mul", ctx.round("mul", 0.5 * x) * ctx.round("add", 1.0 + t))


def _softmax_parts(ctx: OpContext, x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x - max x, sum exp(x - max x)), each step tagged."""
    d = ctx.round("add", x - x.amax(dim=dim, keepdim=True))
    s = ctx.row_sum(ctx.round("exp", torch.exp(d)), (dim,))
    return d, s


def _softmax(ctx: OpContext, x: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    if ctx.exact:
        return torch.log_softmax(x, dim) if log else torch.softmax(x, dim)
    d, s = _softmax_parts(ctx, x, dim)
    if log:
        return ctx.round("add", d - ctx.round("log", torch.log(s)))
    return ctx.round("div", ctx.round("exp", torch.exp(d)) / s)


def _coerced(ctx: OpContext, x: torch.Tensor, axis: int, log: bool) -> torch.Tensor:
    """Opsets < 13: x flattened to 2-D at ``axis``, normalised over the whole second axis."""
    a = norm_axis(axis, x.dim())
    flat = x.reshape(math.prod(x.shape[:a]), -1)
    return _softmax(ctx, flat, 1, log).reshape(x.shape)


@register_op("Softmax", since_opset=1)
def softmax_v1(ctx: OpContext, x: torch.Tensor, *, axis: int = 1) -> torch.Tensor:
    return _coerced(ctx, x, axis, log=False)


@register_op("Softmax", since_opset=13)
def softmax(ctx: OpContext, x: torch.Tensor, *, axis: int = -1) -> torch.Tensor:
    return _softmax(ctx, x, axis, log=False)


@register_op("LogSoftmax", since_opset=1)
def log_softmax_v1(ctx: OpContext, x: torch.Tensor, *, axis: int = 1) -> torch.Tensor:
    return _coerced(ctx, x, axis, log=True)


@register_op("LogSoftmax", since_opset=13)
def log_softmax(ctx: OpContext, x: torch.Tensor, *, axis: int = -1) -> torch.Tensor:
    return _softmax(ctx, x, axis, log=True)
