"""Linear ops: MatMul and Gemm. The product itself always goes through the arithmetic hook
(``arithmetic.matmul``, numpy.matmul broadcasting) with each operand's role; Gemm's transposes
come before it, alpha, beta and the bias after it."""

from __future__ import annotations

import torch

from kcverify.models.ops import OpContext, register_op


@register_op("MatMul", since_opset=1)
def matmul(ctx: OpContext, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Y = A @ B with numpy broadcasting over leading axes (1-D operands promoted)."""
    return ctx.arithmetic.matmul(ctx.node, a, b, ctx.role(0), ctx.role(1))


@register_op("Gemm", since_opset=7)
def gemm(ctx: OpContext, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None = None, *,
         alpha: float = 1.0, beta: float = 1.0, transA: int = 0, transB: int = 0) -> torch.Tensor:
    """Y = alpha * op(A) @ op(B) + beta * C, op = optional transpose; C broadcast to Y."""
    if transA:
        a = a.transpose(0, 1)
    if transB:
        b = b.transpose(0, 1)
    y = ctx.arithmetic.matmul(ctx.node, a, b, ctx.role(0), ctx.role(1))
    if alpha != 1.0:
        y = ctx.round("mul", y * alpha)
    if c is not None:
        if beta != 1.0:
            c = ctx.round("mul", c * beta)
        y = ctx.round("add", y + c)
    return y
