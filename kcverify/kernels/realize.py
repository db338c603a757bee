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
    cast_grid,
    mul_nearest,
    round_to_format,
)
from kcverify.kernels.formats import Format
from kcverify.kernels.scale import activation_scale, weight_scale
from kcverify.kernels.spec import CastSpec, KernelSpec
from kcverify.models.ir import Graph, Node

ORDERS = ("sequential", "reverse", "pairwise", "chunked", "random", "sorted")
ROUNDINGS = ("nearest", "up", "down", "random")
EXPLICIT_CAST_OPS = frozenset({"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"})
_F64 = torch.float64
_TILE_ELEMS = 1 << 22  # products materialised at once (float64): 32 MiB


@dataclasses.dataclass
class _Operand:
    q: torch.Tensor  # cast values cast(x / s), float64
    s: torch.Tensor  # scales, broadcastable to q, float64
    block: int | None  # block size along the reduction axis when s varies along it


def _seeded(seed: int, *key: str) -> torch.Generator:
    h = hashlib.sha256("/".join((str(seed), *key)).encode()).digest()
    g = torch.Generator(device="cpu")
    g.manual_seed(int.from_bytes(h[:8], "little") & ((1 << 63) - 1))
    return g


class Realization:
    """One concrete program conforming to ``spec`` (an Arithmetic; see the module doc)."""

    def __init__(self, spec: KernelSpec, seed: int = 0, order: str = "sequential",
                 chunk: int | None = None, rounding: str = "nearest", native: bool = True,
                 sample_axes: Mapping[str, Any] | None = None) -> None:
        if order not in ORDERS:
            raise KernelSpecError(f"unknown accumulation order {order!r}; expected one of {', '.join(ORDERS)}")
        if rounding not in ROUNDINGS:
            raise KernelSpecError(f"unknown rounding {rounding!r}; expected one of {', '.join(ROUNDINGS)}")
        if chunk is not None and (not isinstance(chunk, int) or chunk < 1):
            raise KernelSpecError(f"chunk must be a positive integer, not {chunk!r}")
        self.spec = spec
        self.seed = int(seed)
        self.order = order
        self.chunk = chunk
        self.rounding = rounding
        self.native = native  # use torch's own fp32/bf16/fp16 additions where they are exact
        self._weights: dict[tuple[str, int], tuple[torch.Tensor, _Operand]] = {}
        self.sample_axes = sample_axes

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
                f"chunk={self.chunk}, rounding={self.rounding!r})")

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
        return _Operand(cast_grid(w, cast.format, s), s, _block(cast))

    def _cast_activation(self, node: Node, x: torch.Tensor, cast: CastSpec | None,
                         reduce_axis: int, sample_axis: Any = 0) -> _Operand:
        if cast is None:
            return _Operand(round_to_format(x, self.spec.compute), _ones(x), None)
        s = activation_scale(x, cast, reduce_axis, sample_axis)
        mode = self.rounding if self.spec.rounding == "any" else "nearest"
        gen = _seeded(self.seed, node.name, "cast", str(reduce_axis)) if mode == "random" else None
        return _Operand(cast_grid(x, cast.format, s, mode, generator=gen), s, _block(cast))

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
        if acts is not None and acts.scale not in ("none", "static", "dynamic_per_tensor", "per_tensor"):
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
        fmt = self.spec.compute
        v = value.to(_F64)
        rn = round_to_format(v, fmt)
        if self.rounding == "nearest":
            return rn.to(value.dtype)
        d = self.spec.ulp(primitive) * fmt.u * v.abs()
        up = torch.maximum(round_to_format(torch.nextafter(v + d, torch.full_like(v, -math.inf)),
                                           fmt, "down"), rn)
        down = torch.minimum(round_to_format(torch.nextafter(v - d, torch.full_like(v, math.inf)),
                                             fmt, "up"), rn)
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
        gen = _seeded(self.seed, node.name, "row-sum", ",".join(map(str, ds)))
        out = self._accumulate(t, {}, gen)
        if keepdim:
            shape = [1 if d in ds else x.shape[d] for d in range(nd)]
            out = out.reshape(shape)
        return self.round(node, "reduce", out).to(x.dtype)

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
        for b0, b1, m0, m1 in tiles:
            terms = qa[b0:b1, m0:m1, None, :] * qbt[b0:b1, None, :, :]  # (nb, rows, n, k), exact
            sa_t = sa[b0:b1, m0:m1] if sa.shape[-2] > 1 else sa[b0:b1]
            out[b0:b1, m0:m1] = self._reduce(terms, sa_t, sb[b0:b1], bounds, plans, gen)
        return out.reshape(*batch, m, n)

    def _reduce(self, terms: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
                bounds: list[int], plans: dict[int, Any], gen: torch.Generator) -> torch.Tensor:
        """terms (nb, rows, n, k); sa (nb, rows|1, k|1); sb (nb, k|1, n|1) -> (nb, rows, n)."""
        acc_fmt, comp = self.spec.accumulate, self.spec.compute

        def scale_at(k0: int) -> torch.Tensor:  # s_a[m, k0] * s_b[k0, n], exact (48 bits)
            ca = sa[..., :, k0 if sa.shape[-1] > 1 else 0][..., None]
            cb = sb[..., k0 if sb.shape[-2] > 1 else 0, :][..., None, :]
            return ca * cb

        if len(bounds) == 2:  # unscaled products, then one rounding of s_a s_b * acc
            acc = self._accumulate(terms, plans, gen)
            return mul_nearest(scale_at(0).expand_as(acc), acc, comp)
        parts = []
        for k0, k1 in zip(bounds[:-1], bounds[1:]):
            p = self._accumulate(terms[..., k0:k1], plans, gen)
            parts.append(mul_nearest(scale_at(k0).expand_as(p), p, acc_fmt))
        total = self._accumulate(torch.stack(parts, dim=-1), plans, gen)
        return round_to_format(total, comp)

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

    def _accumulate(self, t: torch.Tensor, plans: dict[int, Any], gen: torch.Generator) -> torch.Tensor:
        """Sum t along its last axis in the accumulator format, in this realization's order."""
        length = t.shape[-1]
        if length == 0:
            return torch.zeros(t.shape[:-1], dtype=_F64, device=t.device)
        ad = _Adder.for_terms(t, self.spec.accumulate, self.native)
        t = ad.load(t)
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
    return int(cast.block_size or 32) if cast.scale.endswith("per_block") else None


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
    return Realization(spec, seed=seed, order=pick(ORDERS), chunk=pick([1, 2, 4, 8, 16, 32, 64]),
                       rounding=pick(ROUNDINGS))


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
