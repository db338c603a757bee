"""Normalisation: LayerNormalization (opset 17) and inference-mode BatchNormalization.

layernorm(x) = (x - mu) * rsqrt(var + eps) * gamma + beta over the axes from ``axis`` on, with
mu = sum(x)/n and var = sum((x - mu)^2)/n; decomposed into tagged primitives unless Exact."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kcverify.models.ops import OpContext, register_op
from kcverify.models.ops._util import norm_axis


@register_op("LayerNormalization", since_opset=17)
def layer_norm(ctx: OpContext, x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
               *, axis: int = -1, epsilon: float = 1e-5,
               stash_type: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Outputs Y, Mean and InvStdDev (the last two keep the reduced axes as size 1)."""
    a = norm_axis(axis, x.dim())
    dims = tuple(range(a, x.dim()))
    n = math.prod(x.shape[a:])
    if ctx.exact:
        stats = sum(1 for o in ctx.node.outputs[1:] if o)
        if not stats and scale.shape == x.shape[a:] and (bias is None or bias.shape == x.shape[a:]):
            y = F.layer_norm(x, x.shape[a:], scale, bias, epsilon)
            return y, y.new_empty(0), y.new_empty(0)
        mean = x.mean(dim=dims, keepdim=True)
        var = (x - mean).square().mean(dim=dims, keepdim=True)
        inv = torch.rsqrt(var + epsilon)
        y = (x - mean) * inv * scale
        return (y + bias if bias is not None else y), mean, inv
    mean = ctx.round("div", ctx.row_sum(x, dims) / n)
    d = ctx.round("add", x - mean)
    sq = ctx.round("mul", d * d)
    var = ctx.round("div", ctx.row_sum(sq, dims) / n)
    inv = ctx.round("rsqrt", torch.rsqrt(ctx.round("add", var + epsilon)))
    y = ctx.round("mul", ctx.round("mul", d * inv) * scale)
    if bias is not None:
        y = ctx.round("add", y + bias)
    return y, mean, inv


@register_op("BatchNormalization", since_opset=9)
def batch_norm(ctx: OpContext, x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor,
               mean: torch.Tensor, var: torch.Tensor, *, epsilon: float = 1e-5,
               momentum: float = 0.9, training_mode: int = 0,
               spatial: int = 1) -> torch.Tensor:
    """Inference form: (x - mean) / sqrt(var + eps) * scale + bias, per channel (axis 1)."""
    shape = (1, -1) + (1,) * (x.dim() - 2)
    inv = ctx.round("rsqrt", torch.rsqrt(ctx.round("add", var + epsilon))).reshape(shape)
    d = ctx.round("add", x - mean.reshape(shape))
    y = ctx.round("mul", ctx.round("mul", d * inv) * scale.reshape(shape))
    return ctx.round("add", y + bias.reshape(shape))


@register_op("RMSNormalization", since_opset=23)
def rms_norm(ctx: OpContext, x: torch.Tensor, scale: torch.Tensor, *, axis: int = -1,
             epsilon: float = 1e-5, stash_type: int = 1) -> torch.Tensor:
    """y = x * rsqrt(sum(x^2)/n + eps) * scale over the axes from ``axis`` on."""
    a = norm_axis(axis, x.dim())
    dims = tuple(range(a, x.dim()))
    n = math.prod(x.shape[a:])
    if ctx.exact:
        inv = torch.rsqrt(x.square().mean(dim=dims, keepdim=True) + epsilon)
        return x * inv * scale
    ms = ctx.round("div", ctx.row_sum(ctx.round("mul", x * x), dims) / n)
    inv = ctx.round("rsqrt", torch.rsqrt(ctx.round("add", ms + epsilon)))
    return ctx.round("mul", ctx.round("mul", x * inv) * scale)
