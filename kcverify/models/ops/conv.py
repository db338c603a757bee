"""Convolution and pooling for small vision / VNN-COMP networks. Conv goes through
``arithmetic.conv`` with ONNX's attributes normalised (explicit begin/end pads, auto_pad resolved)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kcverify.models.ops import OpContext, register_op


def _pads(x: torch.Tensor, kernel: list[int], strides: list[int], dilations: list[int],
          pads: list[int] | None, auto_pad: str) -> list[int]:
    """Explicit (begin..., end...) pads; SAME_UPPER/LOWER put the odd pixel at the end/begin."""
    nd = len(kernel)
    if auto_pad in ("", "NOTSET"):
        return list(pads) if pads else [0] * (2 * nd)
    if auto_pad == "VALID":
        return [0] * (2 * nd)
    begin, end = [], []
    for i in range(nd):
        size = x.shape[2 + i]
        out = math.ceil(size / strides[i])
        total = max(0, (out - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1 - size)
        small, big = total // 2, total - total // 2
        if auto_pad == "SAME_UPPER":
            begin.append(small)
            end.append(big)
        else:
            begin.append(big)
            end.append(small)
    return begin + end


@register_op("Conv", since_opset=1)
def conv(ctx: OpContext, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, *,
         auto_pad: str = "NOTSET", dilations: list[int] | None = None, group: int = 1,
         kernel_shape: list[int] | None = None, pads: list[int] | None = None,
         strides: list[int] | None = None) -> torch.Tensor:
    """Y = W * X + B (cross-correlation, as ONNX and torch define it)."""
    nd = w.dim() - 2
    kernel = list(kernel_shape or w.shape[2:])
    strides = list(strides or [1] * nd)
    dilations = list(dilations or [1] * nd)
    p = _pads(x, kernel, strides, dilations, pads, auto_pad)
    return ctx.arithmetic.conv(ctx.node, x, w, b, strides, p, dilations, group,
                               ctx.role(0), ctx.role(1))


def _pad_for_pool(x: torch.Tensor, p: list[int], value: float) -> torch.Tensor:
    nd = len(p) // 2
    flat: list[int] = []
    for i in reversed(range(nd)):
        flat += [p[i], p[nd + i]]
    return F.pad(x, flat, value=value) if any(flat) else x


@register_op("MaxPool", since_opset=1)
def max_pool(ctx: OpContext, x: torch.Tensor, *, auto_pad: str = "NOTSET", ceil_mode: int = 0,
             dilations: list[int] | None = None, kernel_shape: list[int] = (),
             pads: list[int] | None = None, storage_order: int = 0,
             strides: list[int] | None = None) -> torch.Tensor:
    """Max over each window (padding never wins); exact, no rounding."""
    nd = len(kernel_shape)
    strides = list(strides or [1] * nd)
    dilations = list(dilations or [1] * nd)
    p = _pads(x, list(kernel_shape), strides, dilations, pads, auto_pad)
    fn = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[nd]
    xp = _pad_for_pool(x, p, float("-inf"))
    return fn(xp, list(kernel_shape), strides, 0, dilations, ceil_mode=bool(ceil_mode))


@register_op("AveragePool", since_opset=1)
def average_pool(ctx: OpContext, x: torch.Tensor, *, auto_pad: str = "NOTSET", ceil_mode: int = 0,
                 count_include_pad: int = 0, dilations: list[int] | None = None,
                 kernel_shape: list[int] = (), pads: list[int] | None = None,
                 strides: list[int] | None = None) -> torch.Tensor:
    """Mean over each window: a sum ("reduce") then a division ("div")."""
    nd = len(kernel_shape)
    strides = list(strides or [1] * nd)
    p = _pads(x, list(kernel_shape), strides, [1] * nd, pads, auto_pad)
    xp = _pad_for_pool(x, p, 0.0)
    ones = _pad_for_pool(torch.ones_like(x), p, 1.0 if count_include_pad else 0.0)
    fn = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}[nd]
    k = math.prod(kernel_shape)
    sums = ctx.round("reduce", fn(xp, list(kernel_shape), strides, 0, bool(ceil_mode), False) * k)
    counts = torch.round(fn(ones, list(kernel_shape), strides, 0, bool(ceil_mode), False) * k)
    return ctx.round("div", sums / counts)


@register_op("GlobalAveragePool", since_opset=1)
def global_average_pool(ctx: OpContext, x: torch.Tensor) -> torch.Tensor:
    dims = tuple(range(2, x.dim()))
    n = math.prod(x.shape[2:])
    s = ctx.round("reduce", x.sum(dim=dims, keepdim=True))
    return ctx.round("div", s / n)


@register_op("GlobalMaxPool", since_opset=1)
def global_max_pool(ctx: OpContext, x: torch.Tensor) -> torch.Tensor:
    return x.amax(dim=tuple(range(2, x.dim())), keepdim=True)
