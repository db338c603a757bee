"""The executor's op table: one function per ONNX op, registered with ``@register_op``.

An op function receives an :class:`OpContext` (the node, its opset, the arithmetic hook, the
executor's float dtype and device), then the node's input tensors (``None`` for an omitted
optional input), then the ONNX attributes as keyword arguments. It returns one tensor or a tuple
(one per output; surplus entries are dropped when the node asks for fewer outputs).

Opset-dependent behaviour is data: ``@register_op("Softmax", since_opset=13)`` next to
``@register_op("Softmax", since_opset=1)``; the executor picks, for a graph's opset, the entry
with the largest ``since_opset`` not above it. Importing this package fills the table from the
family modules listed at the bottom (explicit imports, no lookup by name).

Value-computing ops pass each result through ``ctx.round(primitive, value)`` (a no-op for integer
and boolean tensors), so a kernel realization can round it to its compute format; MatMul, Gemm and
Conv go through ``ctx.arithmetic.matmul`` / ``.conv`` with the operands' roles.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kcverify.models.arith import Arithmetic
from kcverify.models.ir import Node

OpFn = Callable[..., Any]


@dataclass(frozen=True)
class OpImpl:
    """One registered implementation of an op from ``since_opset`` on."""

    op_type: str
    domain: str
    since_opset: int
    fn: OpFn
    attrs: frozenset[str]  # the keyword arguments (ONNX attributes) the function accepts


_TABLE: dict[tuple[str, str], list[OpImpl]] = {}


def register_op(op_type: str, since_opset: int = 1, domain: str = "") -> Callable[[OpFn], OpFn]:
    """Register ``fn`` as the implementation of ``domain::op_type`` from ``since_opset`` on."""

    def deco(fn: OpFn) -> OpFn:
        params = inspect.signature(fn).parameters.values()
        attrs = frozenset(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)
        impls = _TABLE.setdefault((domain, op_type), [])
        if any(i.since_opset == since_opset for i in impls):
            raise ValueError(f"{op_type} since opset {since_opset} is registered twice")
        impls.append(OpImpl(op_type, domain, since_opset, fn, attrs))
        impls.sort(key=lambda i: i.since_opset)
        return fn

    return deco


def lookup(op_type: str, domain: str, opset: int) -> OpImpl | None:
    """The implementation of an op for a graph importing ``domain`` at ``opset``, if any."""
    impls = _TABLE.get((domain if domain != "ai.onnx" else "", op_type), [])
    best = None
    for impl in impls:
        if impl.since_opset <= opset:
            best = impl
    return best


def registered() -> list[str]:
    """Every registered op, as ``op`` or ``domain::op``."""
    return sorted(op if not d else f"{d}::{op}" for d, op in _TABLE)


@dataclass
class OpContext:
    """What an op function may know beyond its inputs and attributes."""

    node: Node
    opset: int
    arithmetic: Arithmetic
    dtype: torch.dtype  # the executor's float dtype: every float tensor is held in it
    device: torch.device
    roles: tuple[str, ...]  # per input: "weights" (constant in the graph) or "activations"
    exact: bool = True  # the arithmetic is Exact: fused torch functions may be used
    input_dtypes: tuple[str | None, ...] = ()  # per input: the graph's element type (numpy name)
    extra: dict[str, Any] = field(default_factory=dict)

    def round(self, primitive: str, value: torch.Tensor) -> torch.Tensor:
        """Hand a freshly computed float value to the arithmetic hook (see arith.py)."""
        if not value.is_floating_point():
            return value
        return self.arithmetic.round(self.node, primitive, value)

    def row_sum(self, x: torch.Tensor, dims: tuple[int, ...], keepdim: bool = True) -> torch.Tensor:
        """A sum over ``dims`` that a kernel accumulates in its own format and order (the row sums
        of Softmax, LayerNormalization, ReduceSum): handed to the arithmetic's ``reduce_sum``
        when it has one (a realization chooses the order), else summed and tagged "reduce"."""
        fn = getattr(self.arithmetic, "reduce_sum", None)
        if fn is None or not x.is_floating_point():
            return self.round("reduce", x.sum(dim=dims, keepdim=keepdim))
        return fn(self.node, x, dims, keepdim)

    def input_dtype(self, index: int) -> str | None:
        """The element type the graph declares for input ``index`` (e.g. 'float8_e4m3fn')."""
        return self.input_dtypes[index] if index < len(self.input_dtypes) else None

    def role(self, index: int) -> str:
        return self.roles[index] if index < len(self.roles) else "activations"


# The families: importing them fills the table.
from kcverify.models.ops import (  # noqa: E402,F401  (registration side effects)
    activation,
    attention,
    conv,
    elementwise,
    linear,
    normalization,
    quant,
    reduce,
    shape,
)
