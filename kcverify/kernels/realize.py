"""Concrete realizations of a kernel spec: one conforming program each (semantics §1.1).

``Realization(spec, seed, order, chunk, rounding)`` is an ``Arithmetic`` for the executor
(kcverify.models.arith). What it executes, exactly (all in float64 with error-free
transformations, so every rounding below is a single correct rounding):

* MatMul / Gemm / Conv operands are cast by role: constant operands by ``spec.weights``
  (round-to-nearest-even, scales as in kcverify.kernels.scale, cached per node), the others by
  ``spec.activations``; a role without an entry is stored in the compute format. Activation casts
  use the realization's ``rounding`` only when the spec says ``rounding: any``.
* Products of the cast values are exact (at most 2*24 significant bits). They are accumulated in
  the accumulator format, every addition rounded to nearest-even, in the realization's order:
  ``sequential``, ``reverse``, ``pairwise`` (balanced tree), ``chunked`` (split-K: chunks of
  ``chunk`` terms summed left to right, partial sums then left to right) or ``random`` (a seeded
  permutation, a random chunk size, partial sums sequential or pairwise) or ``sorted`` (an
  adversarial order chosen per output element, as the spec allows any order per accumulation:
  the terms of the sign of their sum first, then the others, each run by descending magnitude,
  added left to right: the partial sum reaches its largest magnitude first, so every later term
  is rounded against it and small terms are absorbed). Each product passes
  through at most n roundings, so |acc - sum| <= gamma_n * sum |a_i b_i|. (When every term is
  already a value of an fp32 / bf16 / fp16 accumulator, torch's own additions in that dtype do
  the same correctly rounded sums faster; the tests check the two paths agree bit for bit.)
* The accumulator receives the *unscaled* products q_a q_b (kcverify/kernels/spec.py; what FP8
  GEMMs do): scales constant along the reduction axis factor out and the result is
  fl_compute(s_a s_b * acc), one rounding of the exact product (so an fp16 accumulator overflows
  where the unscaled sum passes 65504). With per-block scales each block's partial sum is
  promoted as fl_acc(s_a s_b * p_block) and the blocks are summed in the accumulator format
  (still at most n roundings per product), then rounded to the compute format.
* A dynamic per-sample (``dynamic_per_tensor``) scale groups each operand by its sample axis:
  ``sample_axes`` (tensor name -> axis, kcverify.models.blocks.sample_axes; ``bind(graph)`` or
  ``run_kernel`` computes it), so a per-sample scale is realized on any layout (seq-first
  attention included); without it, axis 0. An operand whose sample axis is unknown is one group
  (exact when the batch holds one sample).
* ``reduce_sum(node, x, dims)``: the row sums inside Softmax, LayerNormalization and ReduceSum
  (the executor's OpContext.row_sum) are accumulated like a dot product's terms, in the
  accumulator format in the realization's order, then stored in the compute format ("reduce").
  With ``moments`` other than "sums" (a spec that admits them), a LayerNormalization's mean and
  variance come from a Welford / Chan tree instead (``welford_moments``: torch's, chunked or
  balanced); ``random_realization`` draws the tree from its seed.
* ``round(node, primitive, value)`` (every other op's result) rounds to the compute format: to
  nearest, or with ``rounding`` up / down / random to the largest / smallest / either grid point
  within ulps(primitive) * u * |value| of the value (never beyond what the spec admits; nearest
  when that is the only one). QuantizeLinear / DequantizeLinear results are left as they are:
  explicit casts run exactly.
* Conv (1-D, 2-D) is the same dot product per output over im2col columns: the input is cast
  before padding, the weight per output channel (axis 0); the bias is added after, in the
  compute format.
* ``graph_input`` stores float inputs in the compute format (nearest). Infinities (attention
  masks) and NaN pass through every rounding unchanged.

The realization trusts the value it is given to be the op's exact result: run the executor in
float64 (``run_kernel`` does) so its own error (<= 2^-52 relative) stays far below any format's.
With an fp64 compute format and no casts, products of 53-bit operands are rounded once in float64.
Seeded: every random choice is drawn from a generator keyed by (seed, node name), so the same
seed gives the same program (and a sample's result never depends on the rest of its batch).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import random as _random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from kcverify.errors import KcverifyError, KernelSpecError
from kcverify.kernels.cast import (
    add_nearest,
    mul_nearest,
    round_to_format,
)
from kcverify.kernels.formats import Format
from kcverify.kernels.scale import activation_scale, cast_values, weight_scale
from kcverify.kernels.spec import MMA_GROUP, CastSpec, KernelSpec
from kcverify.models.ir import Graph, Node

ORDERS = ("sequential", "reverse", "pairwise", "chunked", "random", "sorted")
ROUNDINGS = ("nearest", "up", "down", "random")
IEEE_OPS = frozenset({"add", "mul", "div", "sqrt"})  # correctly rounded in a pinned kernel
EXPLICIT_CAST_OPS = frozenset({"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"})
_F64 = torch.float64
_TILE_ELEMS = 1 << 22  # products materialised at once (float64): 32 MiB


@dataclasses.dataclass
class _Operand:
    q: torch.Tensor  # cast values cast(x / s), float64
    s: torch.Tensor  # scales, broadcastable to q, float64
    block: int | None  # block size along the reduction axis when s varies along it
    emin: int | None = None  # the cast format's least normal exponent (tensor-core alignment)


def _seeded(seed: int, *key: str) -> torch.Generator:
    h = hashlib.sha256("/".join((str(seed), *key)).encode()).digest()
    g = torch.Generator(device="cpu")
    g.manual_seed(int.from_bytes(h[:8], "little") & ((1 << 63) - 1))
    return g


class Realization:
    """One concrete program conforming to ``spec`` (an Arithmetic; see the module doc)."""

    def __init__(self, spec: KernelSpec, seed: int = 0, order: str = "sequential",
                 chunk: int | None = None, rounding: str = "nearest", native: bool = True,
                 sample_axes: Mapping[str, Any] | None = None, split: int | None = None,
                 moments: str = "sums") -> None:
        if order not in ORDERS:
            raise KernelSpecError(f"unknown accumulation order {order!r}; expected one of {', '.join(ORDERS)}")
        if rounding not in ROUNDINGS:
            raise KernelSpecError(f"unknown rounding {rounding!r}; expected one of {', '.join(ROUNDINGS)}")
        if chunk is not None and (not isinstance(chunk, int) or chunk < 1):
            raise KernelSpecError(f"chunk must be a positive integer, not {chunk!r}")
        if moments not in MOMENT_TREES:
            raise KernelSpecError(f"unknown moments tree {moments!r}; expected one of "
                                  f"{', '.join(MOMENT_TREES)}")
        if moments != "sums" and spec.moments == "sums":
            raise KernelSpecError(f"moments tree {moments!r}: the spec admits two-pass sums only")
        self.moments = moments  # LayerNorm's moments: two-pass sums or a Welford / Chan tree
        self._ln_var: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
        self.spec = spec
        self.seed = int(seed)
        self.order = order
        self.chunk = chunk
        self.rounding = rounding
        self.native = native  # use torch's own fp32/bf16/fp16 additions where they are exact
        self._weights: dict[tuple[str, int], tuple[torch.Tensor, _Operand]] = {}
        self.sample_axes = sample_axes
        fam = spec.accumulation
        if split is not None and split not in fam.split_k:
            raise KernelSpecError(f"split {split} is not one of the spec's split_k {list(fam.split_k)}")
        # one split-K configuration of the spec's set (seeded when not given)
        self.split = split if split is not None else fam.split_k[
            int(torch.randint(len(fam.split_k), (1,), generator=_seeded(self.seed, "split-k")))]

    def bind(self, graph: Graph) -> Realization:
        """Take the sample axis of every tensor of ``graph`` (per-sample scales on any layout)."""
        from kcverify.models.blocks import sample_axes

        self.sample_axes = sample_axes(graph)
        return self

    def _sample_axis(self, node: Node, idx: int) -> Any:
        if self.sample_axes is None:
            return 0
        name = node.inputs[idx] if idx < len(node.inputs) else ""
        a = self.sample_axes.get(name, "unknown")
        if node.op_type == "Gemm" and isinstance(a, int) and not isinstance(a, bool) \
                and int(node.attrs.get("transA" if idx == 0 else "transB", 0)):
            a = 1 - a  # the executor hands the transposed operand
        return a

    def __repr__(self) -> str:
        return (f"Realization({self.spec.name!r}, seed={self.seed}, order={self.order!r}, "
                f"chunk={self.chunk}, rounding={self.rounding!r}, split={self.split}"
                + (f", moments={self.moments!r})" if self.moments != "sums" else ")"))

    # --- operands ------------------------------------------------------------------------
    def _operand(self, node: Node, idx: int, x: torch.Tensor, role: str, side: str) -> _Operand:
        """Cast a MatMul operand by role; side 'left' (A: reduce -1, out -2) or 'right' (B)."""
        reduce_axis, out_axis = (-1, -2) if side == "left" else (-2, -1)
        if role == "weights":
            hit = self._weights.get((node.name, idx))
            if hit is not None and hit[0].shape == x.shape and torch.equal(hit[0], x):
                return hit[1]
            op = self._cast_weight(x, self.spec.weights, out_axis, reduce_axis)
            self._weights[(node.name, idx)] = (x, op)
            return op
        return self._cast_activation(node, x, self.spec.activations, reduce_axis,
                                     self._sample_axis(node, 0 if side == "left" else 1))

    def _cast_weight(self, w: torch.Tensor, cast: CastSpec | None, out_axis: int,
                     reduce_axis: int) -> _Operand:
        if cast is None:
            return _Operand(round_to_format(w, self.spec.compute), _ones(w), None)
        s = weight_scale(w, cast, out_axis, reduce_axis)
        return _Operand(cast_values(w, cast, s), s, _block(cast), _emin(cast))

    def _cast_activation(self, node: Node, x: torch.Tensor, cast: CastSpec | None,
                         reduce_axis: int, sample_axis: Any = 0) -> _Operand:
        if cast is None:
            return _Operand(round_to_format(x, self.spec.compute), _ones(x), None)
        s = activation_scale(x, cast, reduce_axis, sample_axis)
        mode = self.rounding if self.spec.rounding == "any" else "nearest"
        gen = _seeded(self.seed, node.name, "cast", str(reduce_axis)) if mode == "random" else None
        return _Operand(cast_values(x, cast, s, mode, gen), s, _block(cast), _emin(cast))

    # --- the Arithmetic protocol -----------------------------------------------------------
    def matmul(self, node: Node, a: torch.Tensor, b: torch.Tensor, a_role: str, b_role: str) -> torch.Tensor:
        out_dtype = torch.promote_types(a.dtype, b.dtype)
        va, vb = a.dim() == 1, b.dim() == 1
        a2 = a.unsqueeze(0) if va else a
        b2 = b.unsqueeze(-1) if vb else b
        A = self._operand(node, 0, a2, a_role, "left")
        B = self._operand(node, 1, b2, b_role, "right")
        out = self._dot(node, A, B)
        if va:
            out = out.squeeze(-2)
        if vb:
            out = out.squeeze(-1)
        return out.to(out_dtype)

    def conv(self, node: Node, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
             stride: list[int], padding: list[int], dilation: list[int], groups: int,
             x_role: str, w_role: str) -> torch.Tensor:
        out_dtype = x.dtype
        nd = x.dim() - 2
        if nd not in (1, 2):
            raise KcverifyError(f"Conv node {node.name!r}: the realization supports 1-D and 2-D convolutions, not {nd}-D")
        if nd == 1:
            x, w = x.unsqueeze(-2), w.unsqueeze(-2)
            stride, dilation = [1, *stride], [1, *dilation]
            padding = [0, padding[0], 0, padding[1]]
        acts = self.spec.activations if x_role == "activations" else self.spec.weights
        if acts is not None and not acts.kind.conv_input:
            raise KernelSpecError(f"Conv node {node.name!r}: {acts.scale} scaling of the convolution input "
                                  "is not defined; use per_tensor, dynamic_per_tensor or static")
        # the input is cast before padding and unfolding (its zero padding is exact)
        if x_role == "weights":
            X = self._cast_weight(x, acts, 0, 1)
        else:
            X = self._cast_activation(node, x, acts, -1)
        o, cg, kh, kw = w.shape
        r = cg * kh * kw
        W = self._conv_weight(node, w.reshape(o, r), w_role)
        qx = F.pad(X.q, (padding[1], padding[3], padding[0], padding[2]))
        h_out = (qx.shape[-2] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
        w_out = (qx.shape[-1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
        cols = F.unfold(qx, (kh, kw), dilation=dilation, stride=stride)  # (B, C*kh*kw, L)
        nb = cols.shape[0]
        g = groups
        cols = cols.reshape(nb, g, r, -1)
        sx = X.s.reshape(X.s.shape[0], 1, 1, 1) if X.s.numel() > 1 else X.s.reshape(1, 1, 1, 1)
        Wq = W.q.reshape(1, g, o // g, r)
        Ws = W.s.reshape(1, g, o // g, -1) if W.s.numel() > 1 else W.s.reshape(1, 1, 1, 1)
        out = self._dot(node, _Operand(Wq, Ws, W.block), _Operand(cols, sx, None))
        out = out.reshape(nb, o, h_out, w_out)
        if bias is not None:
            bq = round_to_format(bias, self.spec.compute).reshape(1, o, 1, 1)
            out = add_nearest(out, bq, self.spec.compute)
        if nd == 1:
            out = out.squeeze(-2)
        return out.to(out_dtype)

    def _conv_weight(self, node: Node, w2: torch.Tensor, role: str) -> _Operand:
        if role != "weights":
            return self._cast_activation(node, w2, self.spec.activations, -1)
        hit = self._weights.get((node.name, 1))
        if hit is not None and hit[0].shape == w2.shape and torch.equal(hit[0], w2):
            return hit[1]
        op = self._cast_weight(w2, self.spec.weights, 0, 1)
        self._weights[(node.name, 1)] = (w2, op)
        return op

    def round(self, node: Node, primitive: str, value: torch.Tensor) -> torch.Tensor:
        if not value.is_floating_point() or node.op_type in EXPLICIT_CAST_OPS:
            return value
        v = value.to(_F64)
        rn = round_to_format(v, self.spec.compute)
        if self.rounding == "nearest" or (self.spec.accumulation.pinned and primitive in IEEE_OPS):
            return rn.to(value.dtype)
        up, down = self.neighbours(primitive, v, rn)
        if self.rounding == "up":
            r = up
        elif self.rounding == "down":
            r = down
        else:
            pick = torch.rand(v.shape, generator=_seeded(self.seed, node.name, "round", primitive),
                              dtype=_F64).to(v.device) < 0.5
            r = torch.where(pick, up, down)
        r = torch.where(torch.isfinite(v), r, rn)  # +-inf (masks) and NaN stay as they are
        return r.to(value.dtype)

    def neighbours(self, primitive: str, v: torch.Tensor, rn: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """The largest and the smallest compute-format value a conforming ``primitive`` may
        return for the exact float64 result ``v`` (``rn``: its nearest): within
        ulps(primitive) u |v| of it, and never past the nearest on the other side."""
        fmt = self.spec.compute
        d = self.spec.ulp(primitive) * fmt.u * v.abs()
        up = torch.maximum(round_to_format(torch.nextafter(v + d, torch.full_like(v, -math.inf)),
                                           fmt, "down"), rn)
        down = torch.minimum(round_to_format(torch.nextafter(v - d, torch.full_like(v, math.inf)),
                                             fmt, "up"), rn)
        return up, down

    def reduce_sum(self, node: Node, x: torch.Tensor, dims: tuple[int, ...], keepdim: bool = True
                   ) -> torch.Tensor:
        """A row sum inside an op (Softmax's sum of exps, LayerNormalization's moments,
        ReduceSum): accumulated in the accumulator format in this realization's order, then
        stored in the compute format (``round(node, "reduce", ...)``)."""
        if not x.is_floating_point():
            return x.sum(dim=dims, keepdim=keepdim)
        nd = x.dim()
        ds = sorted({d % max(nd, 1) for d in dims}) if nd else []
        rest = [d for d in range(nd) if d not in ds]
        v = x.to(_F64).permute(*rest, *ds) if nd else x.to(_F64).reshape(1)
        lead = [x.shape[d] for d in rest]
        t = v.reshape(*lead, -1)
        if self.moments != "sums" and node.op_type == "LayerNormalization":
            out = self._welford_sum(node, t, tuple(ds))
            if keepdim:
                out = out.reshape([1 if d in ds else x.shape[d] for d in range(nd)])
            return out.to(x.dtype)
        gen = _seeded(self.seed, node.name, "row-sum", ",".join(map(str, ds)))
        out = self._accumulate(t, {}, gen)
        if keepdim:
            shape = [1 if d in ds else x.shape[d] for d in range(nd)]
            out = out.reshape(shape)
        return self.round(node, "reduce", out).to(x.dtype)

    def _welford_sum(self, node: Node, t: torch.Tensor, ds: tuple[int, ...]) -> torch.Tensor:
        """LayerNormalization's two row sums under a Welford / Chan tree (``moments``): the first
        call (the row of x) returns n mu~ and keeps var~ = fl(M / n); the second (the squares,
        ignored) returns n var~. Both are exact in float64, so the op's divisions by n give mu~
        and var~ back, which it then stores (round "div"), as the family says."""
        n = t.shape[-1]
        key = (node.name, ds)
        if key in self._ln_var:
            return self._ln_var.pop(key) * n
        acc = self.spec.accumulate
        mu, m2 = welford_moments(t, acc, self.moments)
        self._ln_var[key] = round_to_format(m2 / n, acc)
        return mu * n

    def graph_input(self, name: str, value: torch.Tensor) -> torch.Tensor:
        if not value.is_floating_point():
            return value
        return round_to_format(value, self.spec.compute).to(value.dtype)

    # --- the dot product ---------------------------------------------------------------------
    def _dot(self, node: Node, A: _Operand, B: _Operand) -> torch.Tensor:
        """Realize A.q*s_a @ B.q*s_b (numpy.matmul broadcasting), result in compute format."""
        qa, qb = A.q, B.q
        batch = torch.broadcast_shapes(qa.shape[:-2], qb.shape[:-2],
                                       A.s.shape[:-2], B.s.shape[:-2])
        m, k = qa.shape[-2:]
        n = qb.shape[-1]
        if qb.shape[-2] != k:
            raise KcverifyError(f"MatMul node {node.name!r}: inner dimensions differ ({k} vs {qb.shape[-2]})")
        bt = math.prod(batch)
        qa = torch.broadcast_to(qa, (*batch, m, k)).reshape(bt, m, k)
        qbt = torch.broadcast_to(qb, (*batch, k, n)).reshape(bt, k, n).transpose(-1, -2)  # (bt, n, k)
        sa = torch.broadcast_to(A.s, (*batch, *A.s.shape[-2:])).reshape(bt, *A.s.shape[-2:])
        sb = torch.broadcast_to(B.s, (*batch, *B.s.shape[-2:])).reshape(bt, *B.s.shape[-2:])
        bounds = _segments(k, A.block if sa.shape[-1] > 1 else None, B.block if sb.shape[-2] > 1 else None)
        plans: dict[int, Any] = {}
        gen = _seeded(self.seed, node.name, "order")
        out = torch.empty(bt, m, n, dtype=_F64, device=qa.device)
        per_row = max(1, n * k)
        if m * per_row <= _TILE_ELEMS:  # tiles of whole matrices
            tiles = [(b0, min(bt, b0 + max(1, _TILE_ELEMS // (m * per_row))), 0, m)
                     for b0 in range(0, bt, max(1, _TILE_ELEMS // (m * per_row)))]
        else:  # tiles of rows of one matrix
            rows = max(1, _TILE_ELEMS // per_row)
            tiles = [(b0, b0 + 1, m0, min(m, m0 + rows)) for b0 in range(bt) for m0 in range(0, m, rows)]
        mma = self.spec.accumulation.mma is not None
        if mma:
            if A.emin is None or B.emin is None:
                raise KernelSpecError(f"MatMul node {node.name!r}: mma {self.spec.accumulation.mma} "
                                      "needs both operands cast to fp8")
            ea, eb = _exponents(qa, A.emin), _exponents(qbt, B.emin)
        for b0, b1, m0, m1 in tiles:
            terms = qa[b0:b1, m0:m1, None, :] * qbt[b0:b1, None, :, :]  # (nb, rows, n, k), exact
            sa_t = sa[b0:b1, m0:m1] if sa.shape[-2] > 1 else sa[b0:b1]
            exps = (ea[b0:b1, m0:m1, None, :] + eb[b0:b1, None, :, :]) if mma else None
            out[b0:b1, m0:m1] = self._reduce(terms, sa_t, sb[b0:b1], bounds, plans, gen, exps)
        return out.reshape(*batch, m, n)

    def _reduce(self, terms: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
                bounds: list[int], plans: dict[int, Any], gen: torch.Generator,
                exps: torch.Tensor | None = None) -> torch.Tensor:
        """terms (nb, rows, n, k); sa (nb, rows|1, k|1); sb (nb, k|1, n|1) -> (nb, rows, n).
        ``exps``: the products' alignment exponents (an mma accumulator)."""
        comp = self.spec.compute
        fam = self.spec.accumulation
        k = terms.shape[-1]

        def scale_at(k0: int) -> torch.Tensor:  # s_a[m, k0] * s_b[k0, n], exact (48 bits)
            ca = sa[..., :, k0 if sa.shape[-1] > 1 else 0][..., None]
            cb = sb[..., k0 if sb.shape[-2] > 1 else 0, :][..., None, :]
            return ca * cb

        parts = split_parts(k, self.split, MMA_GROUP.get(fam.mma or "", 1))
        if fam.mma is not None:  # tensor-core chunks, promoted into fp32 (any order)
            cuts = chunk_cuts(k, fam.promote, self.split, bounds)
            vals = []
            for k0, k1 in zip(cuts[:-1], cuts[1:]):
                v = sm90_chunk(terms[..., k0:k1], exps[..., k0:k1])
                vals.append(v * scale_at(k0).expand_as(v) if len(bounds) > 2 else v)
            total = self._accumulate(torch.stack(vals, dim=-1), plans, gen)
            if len(bounds) > 2:
                return round_to_format(total, comp)
            return mul_nearest(scale_at(0).expand_as(total), total, comp)
        if len(parts) > 2:  # split-K: each part alone, then the parts' sums
            outs = []
            for p0, p1 in zip(parts[:-1], parts[1:]):
                sub = [b - p0 for b in bounds if p0 < b < p1]
                outs.append(self._reduce_part(terms[..., p0:p1], [0, *sub, p1 - p0],
                                              lambda j, p0=p0: scale_at(p0 + j), plans, gen))
            blocked = len(bounds) > 2
            total = self._sum_parts(torch.stack(outs, dim=-1), plans, gen)
            if blocked:
                return round_to_format(total, comp)
            return mul_nearest(scale_at(0).expand_as(total), total, comp)
        if len(bounds) == 2:  # unscaled products, then one rounding of s_a s_b * acc
            acc = self._accumulate(terms, plans, gen)
            return mul_nearest(scale_at(0).expand_as(acc), acc, comp)
        total = self._reduce_part(terms, bounds, scale_at, plans, gen)
        return round_to_format(total, comp)

    def _reduce_part(self, terms: torch.Tensor, bounds: list[int], scale_at, plans: dict[int, Any],
                     gen: torch.Generator) -> torch.Tensor:
        """One split-K part in the accumulator format: its sum (unscaled when ``bounds`` has no
        block cuts), or the sum of its blocks' promoted partial sums fl_acc(s p_block)."""
        if len(bounds) == 2:
            return self._accumulate(terms, plans, gen)
        parts = []
        for k0, k1 in zip(bounds[:-1], bounds[1:]):
            p = self._accumulate(terms[..., k0:k1], plans, gen)
            parts.append(mul_nearest(scale_at(k0).expand_as(p), p, self.spec.accumulate))
        return self._accumulate(torch.stack(parts, dim=-1), plans, gen)

    def _sum_parts(self, t: torch.Tensor, plans: dict[int, Any], gen: torch.Generator) -> torch.Tensor:
        """The split-K parts' sums: left to right for a pinned schedule, else in this
        realization's order."""
        if self.spec.accumulation.pinned:
            return _sequential(t, _Adder.for_terms(t, self.spec.accumulate, False))
        return self._accumulate(t, plans, gen, family=False)

    def _plan(self, length: int, plans: dict[int, Any], gen: torch.Generator) -> Any:
        if length not in plans:
            if self.order == "random":
                perm = torch.randperm(length, generator=gen)
                chunk = 2 ** int(torch.randint(0, max(1, math.ceil(math.log2(max(length, 2)))) + 1,
                                               (1,), generator=gen))
                across = "pairwise" if torch.rand(1, generator=gen).item() < 0.5 else "sequential"
                plans[length] = (perm, chunk, across)
            else:
                plans[length] = None
        return plans[length]

    def _accumulate(self, t: torch.Tensor, plans: dict[int, Any], gen: torch.Generator,
                    family: bool = True) -> torch.Tensor:
        """Sum t along its last axis in the accumulator format: in the spec's schedule
        (``family``: sequential, pairwise, tile_k blocks) and otherwise in this realization's
        order (the any-order family, tile_k's combination of blocks, promoted mma chunks)."""
        length = t.shape[-1]
        if length == 0:
            return torch.zeros(t.shape[:-1], dtype=_F64, device=t.device)
        ad = _Adder.for_terms(t, self.spec.accumulate, self.native)
        t = ad.load(t)
        fam = self.spec.accumulation
        if family and fam.mma is None and fam.order == "sequential":
            return _sequential(t, ad).to(_F64)
        if family and fam.mma is None and fam.order == "pairwise":
            return _pairwise(t, ad).to(_F64)
        if family and fam.mma is None and fam.order == "tile_k" and length > fam.tile_k:
            n = int(fam.tile_k)
            nc = -(-length // n)
            blocks = [_sequential(t[..., i * n:(i + 1) * n], ad) for i in range(nc)]
            return self._accumulate(torch.stack(blocks, dim=-1).to(_F64), plans, gen, False)
        if family and fam.mma is None and fam.order == "tile_k":
            return _sequential(t, ad).to(_F64)
        if self.order == "sequential":
            out = _sequential(t, ad)
        elif self.order == "reverse":
            out = _sequential(t.flip(-1), ad)
        elif self.order == "pairwise":
            out = _pairwise(t, ad)
        elif self.order == "chunked":
            out = _chunked(t, ad, self.chunk or 32, "sequential")
        elif self.order == "sorted":
            out = _sequential(_sorted_terms(t), ad)
        else:
            perm, chunk, across = self._plan(length, plans, gen)
            out = _chunked(t[..., perm.to(t.device)], ad, chunk, across)
        return out.to(_F64)


# --- Hopper FP8 tensor cores (docs/kernels.md: sm90_fp8) -----------------------------------------
SM90_FRACTION_BITS = 13  # products aligned to the group's largest exponent keep 13 fraction bits
SM90_GROUP = 32  # the K of one fp8 wgmma
_FP32_EMIN = -126


def _exponents(q: torch.Tensor, emin: int) -> torch.Tensor:
    """The exponent a tensor core aligns by: floor(log2 |q|) clamped to the format's least
    normal exponent (a subnormal has that exponent and a significand below 1); -inf for 0."""
    _, e = torch.frexp(q)
    ex = torch.clamp(e.to(_F64) - 1, min=float(emin))
    return torch.where(q == 0, torch.full_like(ex, -math.inf), ex)


def _trunc(y: torch.Tensor) -> torch.Tensor:
    """Round toward zero to an integer (|y| < 2^51)."""
    return torch.where(y >= 0, torch.floor(y), torch.ceil(y))


def sm90_step(c: torch.Tensor, p: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """One fp8 wgmma k-group into a tensor-core accumulator ``c`` (float32 values with 14
    significant bits): every term - c and each product p (exponent e) - is aligned to the
    largest exponent E among them, truncated to multiples of 2^(E - 13), the truncated terms are
    summed exactly, and the sum is rounded toward zero to 13 fraction bits (an e8m13 value).
    (MMA-Sim's Hopper model; DeepSeek-V3 §3.3.2 measures the ~14 retained bits.)"""
    _, fe = torch.frexp(c)
    ec = torch.clamp(fe.to(_F64) - 1, min=float(_FP32_EMIN))
    ec = torch.where(c == 0, torch.full_like(ec, -math.inf), ec)
    big = torch.maximum(e.amax(dim=-1), ec)
    zero = torch.isinf(big)
    tau = torch.exp2(torch.where(zero, torch.zeros_like(big), big) - SM90_FRACTION_BITS)
    s = _trunc(c / tau) + _trunc(p / tau[..., None]).sum(-1)  # exact integers
    s = s * tau
    _, se = torch.frexp(s)
    q = torch.exp2(torch.clamp(se.to(_F64) - 1, min=float(_FP32_EMIN)) - SM90_FRACTION_BITS)
    r = _trunc(s / q) * q
    r = torch.where(r.abs() > float.fromhex("0x1.fffffep+127"), torch.sign(r) * math.inf, r)
    return torch.where(zero, torch.zeros_like(r), r)


def sm90_chunk(terms: torch.Tensor, exps: torch.Tensor) -> torch.Tensor:
    """A tensor-core accumulation of one promotion interval from zero: groups of 32 products
    from the interval's start (the last one shorter), each folded in by sm90_step."""
    c = torch.zeros(terms.shape[:-1], dtype=_F64, device=terms.device)
    for g0 in range(0, terms.shape[-1], SM90_GROUP):
        c = sm90_step(c, terms[..., g0:g0 + SM90_GROUP], exps[..., g0:g0 + SM90_GROUP])
    return c


def chunk_cuts(k: int, promote: int | None, split: int, block_cuts=()) -> list[int]:
    """Where a tensor-core accumulation restarts from zero: each split-K part's start (parts
    aligned to 32), every ``promote`` products from a part's start, and every scale block."""
    parts = split_parts(k, split, SM90_GROUP)
    cuts = set(parts) | {c for c in block_cuts if 0 <= c <= k}
    if promote:
        for p0, p1 in zip(parts[:-1], parts[1:]):
            cuts.update(range(p0, p1, promote))
    return sorted(cuts)


def split_parts(k: int, split: int, align: int = 1) -> list[int]:
    """Cut points of a K of ``k`` into ``split`` contiguous parts of L = ceil(k / split) rounded
    up to a multiple of ``align`` (the mma instruction's K); fewer when the last are empty."""
    if split <= 1 or k <= 1:
        return [0, k]
    step = -(-k // split)
    step = -(-step // align) * align
    return sorted({*range(0, k, step), k})


class _Adder:
    """Correctly rounded addition in the accumulator format.

    Exact path: float64 values, TwoSum and one rounding of the exact sum. Native path, taken when
    every term is already a value of the format and torch has its dtype (fp32, bf16, fp16): the
    dtype's own addition, which is correctly rounded for operands in the format (float32 adds
    are IEEE; bf16 / fp16 adds round the float32 sum, and 24 >= 2p + 2 makes that double rounding
    innocuous). The tests check both paths agree."""

    _NATIVE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

    def __init__(self, fmt: Format, dtype: torch.dtype | None) -> None:
        self.fmt = fmt
        self.dtype = dtype

    @classmethod
    def for_terms(cls, t: torch.Tensor, fmt: Format, native: bool) -> _Adder:
        dt = cls._NATIVE.get(fmt.name) if native else None
        if dt is not None and not torch.equal(t.to(dt).to(_F64), t):
            dt = None
        return cls(fmt, dt)

    def load(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.dtype is None else t.to(self.dtype)

    def first(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.dtype is not None else round_to_format(t, self.fmt, saturate=False)

    def add(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b if self.dtype is not None else add_nearest(a, b, self.fmt)


def _ones(x: torch.Tensor) -> torch.Tensor:
    return torch.ones([1] * max(x.dim(), 2), dtype=_F64, device=x.device)


def _block(cast: CastSpec) -> int | None:
    return cast.kind.k_block(cast)


def _emin(cast: CastSpec) -> int | None:
    f = cast.format
    return round(math.log2(f.min_normal)) if f.kind == "float" else None


def _segments(k: int, block_a: int | None, block_b: int | None) -> list[int]:
    cuts = {0, k}
    for blk in (block_a, block_b):
        if blk:
            cuts.update(range(0, k, blk))
    return sorted(cuts)


def _sorted_terms(t: torch.Tensor) -> torch.Tensor:
    """Per element (last axis): the terms of the sum's sign first, then the others, each run by
    descending magnitude (a permutation of each row: exact)."""
    mag = t.abs().to(_F64)
    lead = torch.sign(t.to(_F64).sum(-1, keepdim=True))
    lead = torch.where(lead == 0, torch.ones_like(lead), lead)
    other = (torch.sign(t.to(_F64)) == -lead).to(_F64)
    top = mag.amax(-1, keepdim=True)
    key = mag / torch.where(top > 0, top, torch.ones_like(top)) + 2.0 * (1.0 - other)
    return t.gather(-1, torch.argsort(key, dim=-1, descending=True, stable=True))


def _sequential(t: torch.Tensor, ad: _Adder) -> torch.Tensor:
    s = ad.first(t[..., 0])
    for i in range(1, t.shape[-1]):
        s = ad.add(s, t[..., i])
    return s


def _pairwise(t: torch.Tensor, ad: _Adder) -> torch.Tensor:
    if t.shape[-1] == 1:
        return ad.first(t[..., 0])
    while t.shape[-1] > 1:
        n = t.shape[-1]
        head = ad.add(t[..., 0:n - 1:2], t[..., 1::2])
        t = torch.cat([head, t[..., n - 1:]], dim=-1) if n % 2 else head
    return t[..., 0]


def _chunked(t: torch.Tensor, ad: _Adder, chunk: int, across: str) -> torch.Tensor:
    n = t.shape[-1]
    chunk = max(1, min(chunk, n))
    nc = -(-n // chunk)
    if nc * chunk != n:
        t = F.pad(t, (0, nc * chunk - n))
    partial = _sequential(t.reshape(*t.shape[:-1], nc, chunk), ad)
    if nc == 1:
        return partial[..., 0]
    return _pairwise(partial, ad) if across == "pairwise" else _sequential(partial, ad)


def point_matmul(spec: KernelSpec, a: torch.Tensor, b: torch.Tensor, a_weight: bool,
                 b_weight: bool, axes: tuple[Any, Any] = (0, 0), split: int | None = None
                 ) -> torch.Tensor:
    """A @ B (numpy.matmul broadcasting, both at least 2-D) as the realization of ``spec``
    computes it - casts by role (``a_weight`` / ``b_weight``: weights, else activations, with
    sample axes ``axes``), accumulation in the spec's family, the final rounding - in order
    ``sequential`` and split-K configuration ``split``: for a pinned spec this is the value of
    every conforming program (the bound engine's point path, bounds/rules/linear.py)."""
    r = Realization(spec, split=split, sample_axes={"a": axes[0], "b": axes[1]})
    node = Node("point", "MatMul", ("a", "b"), ("y",))
    roles = ("weights" if a_weight else "activations", "weights" if b_weight else "activations")
    return r.matmul(node, a.to(_F64), b.to(_F64), *roles).to(_F64)


MOMENT_TREES = ("sums", "torch", "chunks", "pairwise")


def welford_moments(t: torch.Tensor, fmt: Format, tree: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, M2) of each row of ``t`` (float64, (..., n)) by a Welford / Chan tree of the
    ``moments: any`` family (kernels/spec.py; docs/bounds.md "LayerNorm moments"), every
    operation rounded to nearest in ``fmt`` (float64 results of one operation on ``fmt`` values
    rounded once more are correctly rounded: 53 >= 2 p + 2). ``tree``: "torch" (RowwiseMoments of
    torch's x86 build: 8 lanes, Welford chains of 16 with the mean update fused, a binary
    cascade, the stack drained, a scalar tail, the lanes merged into it one by one), "chunks"
    (Welford chains of 16 merged pairwise) or "pairwise" (a balanced Chan tree)."""
    def r(v: torch.Tensor) -> torch.Tensor:
        return round_to_format(v, fmt)

    def fma(a, b, c):  # a, b in fmt: a * b is exact in float64 (fmt has <= 26 bits)
        return add_nearest(a * b, c, fmt) if fmt.u >= 2.0**-26 else r(r(a * b) + c)

    def merge(na, ma, sa, nb, mb, sb, fused=False):  # (nb, mb, sb) added into the accumulator a
        n = na + nb
        if na == 0:
            return nb, mb, sb
        d = r(mb - ma)
        c = r(torch.tensor(nb / n, dtype=_F64))
        if fused:
            return n, fma(c, d, ma), r(sa + fma(r(r(d * d) * c), torch.tensor(float(na), dtype=_F64), sb))
        return n, r(ma + r(c * d)), r(sa + r(sb + r(r(r(d * d) * c) * na)))

    def chain(cols: list[torch.Tensor], fused: bool):
        z = torch.zeros_like(cols[0])
        mu, m2 = z, z
        for k, x in enumerate(cols, start=1):
            d = r(x - mu)
            c = r(torch.tensor(1.0 / k, dtype=_F64))
            mu = fma(d, c, mu) if fused else r(mu + r(d * c))
            m2 = r(m2 + r(d * r(x - mu)))
        return len(cols), mu, m2

    def cascade(parts: list) -> tuple:
        while len(parts) > 1:
            parts = [merge(*parts[i], *parts[i + 1]) if i + 1 < len(parts) else parts[i]
                     for i in range(0, len(parts), 2)]
        return parts[0]

    n = t.shape[-1]
    if tree == "pairwise":
        return cascade([(1, t[..., j], torch.zeros_like(t[..., j])) for j in range(n)])[1:]
    if tree == "chunks":
        return cascade([chain([t[..., j] for j in range(k, min(n, k + 16))], False)
                        for k in range(0, n, 16)])[1:]
    if tree != "torch":
        raise KernelSpecError(f"unknown moments tree {tree!r}")
    lanes, nv = 8, n // 8
    m = -(-nv // 16)
    depth = max(math.ceil(math.log2(m)), 1) if m > 0 else 1
    zero = torch.zeros(*t.shape[:-1], lanes, dtype=_F64)
    stk = [(0, zero, zero) for _ in range(depth)]
    for i in range(m):
        cols = [t[..., (i * 16 + j) * lanes:(i * 16 + j + 1) * lanes]
                for j in range(min(16, nv - i * 16))]
        stk[0] = merge(*stk[0], *chain(cols, True), fused=True)
        mask, j = i + 1, 1
        while j < depth and (mask & 1) == 0:
            stk[j] = merge(*stk[j], *stk[j - 1], fused=True)
            stk[j - 1] = (0, zero, zero)
            mask >>= 1
            j += 1
    for i in range(1, depth):
        stk[0] = merge(*stk[0], *stk[i], fused=True)
    cnt, mu, m2 = 0, torch.zeros_like(t[..., 0]), torch.zeros_like(t[..., 0])
    for i in range(nv * lanes, n):  # the scalar tail: m1 += delta / m0
        cnt += 1
        d = r(t[..., i] - mu)
        mu = r(mu + r(d / cnt))
        m2 = r(m2 + r(d * r(t[..., i] - mu)))
    for ln in range(lanes):
        cnt, mu, m2 = merge(cnt, mu, m2, nv, stk[0][1][..., ln], stk[0][2][..., ln], fused=True)
    return mu, m2


def random_realization(spec: KernelSpec, rng: _random.Random | np.random.Generator | int) -> Realization:
    """A random conforming program: order, chunk size, rounding and seed drawn from ``rng``."""
    if isinstance(rng, int):
        rng = _random.Random(rng)
    if isinstance(rng, np.random.Generator):
        pick = lambda xs: xs[int(rng.integers(len(xs)))]  # noqa: E731
        seed = int(rng.integers(1 << 31))
    else:
        pick = rng.choice
        seed = rng.randrange(1 << 31)
    moments = "sums"
    if spec.moments != "sums":  # drawn from the seed, so the rng's sequence stays as it was
        moments = MOMENT_TREES[int(torch.randint(len(MOMENT_TREES), (1,),
                                                 generator=_seeded(seed, "moments")))]
    return Realization(spec, seed=seed, order=pick(ORDERS), chunk=pick([1, 2, 4, 8, 16, 32, 64]),
                       rounding=pick(ROUNDINGS), moments=moments)


def explicit_cast_spec(spec: KernelSpec) -> KernelSpec:
    """The spec a second ONNX graph (QDQ) runs under: its casts are in the graph, so no
    weights / activations entries; operands are stored in the compute format."""
    return dataclasses.replace(spec, weights=None, activations=None, onnx=None)


def run_kernel(graph: Graph, spec: KernelSpec, feeds: Mapping[str, Any], device: str = "cpu",
               dtype: torch.dtype = torch.float64, base_dir: str | os.PathLike[str] | None = None,
               **choices: Any) -> dict[str, torch.Tensor]:
    """Run ``graph`` as one conforming program of ``spec`` (``choices``: Realization's seed,
    order, chunk, rounding). If ``spec.onnx`` names a second graph (relative to ``base_dir``),
    that graph runs instead, its QuantizeLinear / DequantizeLinear executed exactly."""
    from kcverify.models.executor import Executor  # the executor imports torch-heavy op tables
    from kcverify.models.ir import load_onnx

    if spec.onnx is not None:
        path = spec.onnx if base_dir is None else os.path.join(os.fspath(base_dir), spec.onnx)
        graph = load_onnx(path)
        spec = explicit_cast_spec(spec)
    ex = Executor(graph, device=device, dtype=dtype,
                  arithmetic=Realization(spec, **choices).bind(graph))
    return ex.run(dict(feeds))
