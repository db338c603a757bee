"""The arithmetic hook between the executor and a kernel realization.

The executor evaluates ops in exact-as-possible torch arithmetic; every place where a kernel spec
admits an error (semantics §1.1) goes through an ``Arithmetic`` object instead:

* ``matmul``: every MatMul (and Gemm after its transposes, before alpha/beta and bias) - both
  operands with their role ("weights" when the tensor is constant in the graph, else
  "activations"); broadcasting as numpy.matmul;
* ``conv``: every Conv, operands with roles, the ONNX attributes normalised;
* ``round``: the output of every other op that computes new values, tagged with the primitive
  that produced it (see kcverify.kernels.spec.DEFAULT_ULPS), so a realization can round it to the
  compute format (with any error allowed by the spec);
* ``graph_input``: each float graph input, so a realization can store it in its compute format;
* ``reduce_sum`` (optional): the row sums of Softmax, LayerNormalization and ReduceSum, so a
  realization can accumulate them in its own format and order (OpContext.row_sum; without it the
  exact sum is tagged "reduce").

``Exact`` is the default: the reference function, computed in the executor's dtype.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from kcverify.models.ir import Node


class Arithmetic(Protocol):
    def matmul(self, node: Node, a: torch.Tensor, b: torch.Tensor, a_role: str, b_role: str) -> torch.Tensor: ...

    def conv(self, node: Node, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
             stride: list[int], padding: list[int], dilation: list[int], groups: int,
             x_role: str, w_role: str) -> torch.Tensor: ...

    def round(self, node: Node, primitive: str, value: torch.Tensor) -> torch.Tensor: ...

    def graph_input(self, name: str, value: torch.Tensor) -> torch.Tensor: ...


def conv_nd(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, stride: list[int],
            padding: list[int], dilation: list[int], groups: int) -> torch.Tensor:
    """Conv with ONNX's explicit (begin..., end...) padding, for 1-D and 2-D convolutions."""
    nd = x.dim() - 2
    begin, end = padding[:nd], padding[nd:]
    if begin == end:
        pad_arg: list[int] | int = list(begin)
    else:
        pads: list[int] = []
        for b_, e_ in zip(reversed(begin), reversed(end)):
            pads += [b_, e_]
        x = F.pad(x, pads)
        pad_arg = 0
    fn = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[nd]
    return fn(x, w, bias, stride, pad_arg, dilation, groups)


class Exact:
    """The reference arithmetic: no casts, no rounding beyond the executor's own dtype."""

    def matmul(self, node: Node, a: torch.Tensor, b: torch.Tensor, a_role: str, b_role: str) -> torch.Tensor:
        return torch.matmul(a, b)

    def conv(self, node: Node, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
             stride: list[int], padding: list[int], dilation: list[int], groups: int,
             x_role: str, w_role: str) -> torch.Tensor:
        return conv_nd(x, w, bias, stride, padding, dilation, groups)

    def round(self, node: Node, primitive: str, value: torch.Tensor) -> torch.Tensor:
        return value

    def graph_input(self, name: str, value: torch.Tensor) -> torch.Tensor:
        return value
