"""QuantizeLinear / DequantizeLinear (int8, uint8, int4, uint4, float8 e4m3fn / e5m2), per tensor, per axis
or per block. The casts are exact (round half to even, saturating as ONNX says); the division by
the scale is tagged "div" and the multiplication by it "mul".

    Q(x) = saturate(round(x / s) + zp)   (integers)      Q(x) = cast_fp8(x / s)   (float8)
    D(q) = (q - zp) * s
"""

from __future__ import annotations

import torch

from kcverify.models.ops import OpContext, register_op
from kcverify.models.ops._util import norm_axis, round_to

_INT_RANGE = {"int8": (-128, 127, torch.int8), "uint8": (0, 255, torch.uint8),
              "int16": (-32768, 32767, torch.int16), "uint16": (0, 65535, torch.uint16),
              "int32": (-(2**31), 2**31 - 1, torch.int32),
              "int4": (-8, 7, torch.int8), "uint4": (0, 15, torch.uint8)}  # 4-bit: held widened
_FP8 = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
# ONNX element type ids of output_dtype (opset 21)
_OUTPUT_DTYPE = {2: "uint8", 3: "int8", 4: "uint16", 5: "int16", 17: "float8_e4m3fn",
                 19: "float8_e5m2", 21: "uint4", 22: "int4"}


def _broadcast(s: torch.Tensor, x: torch.Tensor, axis: int, block_size: int) -> torch.Tensor:
    """The scale (or zero point) shaped to broadcast against x: scalar, per axis, or per block."""
    if s.dim() == 0 or s.numel() == 1 and block_size == 0:
        return s.reshape(())
    a = norm_axis(axis, x.dim())
    if block_size:
        return s.repeat_interleave(block_size, dim=a).narrow(a, 0, x.shape[a])
    shape = [1] * x.dim()
    shape[a] = s.numel()
    return s.reshape(shape)


def _target(ctx: OpContext, zp_index: int, output_dtype: int) -> str:
    if output_dtype:
        return _OUTPUT_DTYPE[output_dtype]
    if len(ctx.node.inputs) > zp_index and ctx.node.inputs[zp_index]:
        return ctx.input_dtype(zp_index) or "uint8"
    return "uint8"


def _quantize(ctx: OpContext, x: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None,
              axis: int, saturate: int, block_size: int, output_dtype: int) -> torch.Tensor:
    target = _target(ctx, 2, output_dtype)
    s = _broadcast(scale.to(ctx.dtype), x, axis, block_size)
    y = ctx.round("div", x / s)
    if target in _FP8:
        return round_to(y, _FP8[target], saturate=bool(saturate))
    if target not in _INT_RANGE:
        raise ValueError(f"QuantizeLinear to {target} is not supported")
    lo, hi, tdtype = _INT_RANGE[target]
    q = torch.round(y)
    if zp is not None:
        q = q + _broadcast(zp.to(ctx.dtype), x, axis, block_size)
    return q.clamp(lo, hi).to(tdtype)


@register_op("QuantizeLinear", since_opset=10)
def quantize_linear(ctx: OpContext, x: torch.Tensor, scale: torch.Tensor,
                    zero_point: torch.Tensor | None = None, *, axis: int = 1,
                    saturate: int = 1, block_size: int = 0, output_dtype: int = 0,
                    precision: int = 0) -> torch.Tensor:
    return _quantize(ctx, x, scale, zero_point, axis, saturate, block_size, output_dtype)


@register_op("DequantizeLinear", since_opset=10)
def dequantize_linear(ctx: OpContext, q: torch.Tensor, scale: torch.Tensor,
                      zero_point: torch.Tensor | None = None, *, axis: int = 1,
                      block_size: int = 0, output_dtype: int = 0) -> torch.Tensor:
    x = q.to(ctx.dtype)
    if zero_point is not None and not zero_point.is_floating_point():
        x = x - _broadcast(zero_point.to(ctx.dtype), q, axis, block_size)
    s = _broadcast(scale.to(ctx.dtype), q, axis, block_size)
    return ctx.round("mul", x * s)
