"""QuantizeLinear / DequantizeLinear of the joint graph (kcverify.bounds.qdq_graph, docs/qdq.md):
the inference kernel executes them exactly as ONNX specifies, the training kernel (which has no
such ops) evaluates a Q -> DQ pair as the identity and a weight DQ as the model's float weight.

What a conforming inference program computes (ONNX QuantizeLinear / DequantizeLinear, opset
10-23, constant scale s > 0 and zero point z, per tensor, per axis or per block):

    Q(x) = sat(round_half_even(t) + z)     (integers: clamp to the type's range)
    Q(x) = cast(t)                          (float8: round to nearest even; ``saturate``: +-max,
                                             else inf / NaN beyond the range)
    t    = x / s, computed exactly or in the scale's float type (onnxruntime: float32)
    D(q) = (q - z) * s, exact or rounded to the scale's type or to the kernel's compute format

Both roundings of t and of D are covered: t lies in [lo / s, hi / s] widened by one rounding of
the scale's type (relative max(2^-23, 2 u), plus its least subnormal), and Q is monotone, so the
image of an interval is [Q(t_lo), Q(t_hi)] - an input at a rounding midpoint gets both
neighbours. D(q) is the hull of the exact product and its roundings.

Differential form. With x_t, x_i the two kernels' inputs (x_i - x_t in [dl, dh]):

* Q: the training value is x_t / s + z (the identity, in quantized units); the inference value
  is Q(x_i); the drift is (Q(x_i) - z - x_i / s) + (x_i - x_t) / s, with the cast error
  e = Q(x_i) - z - x_i / s enclosed by the value sets ([Q(t_lo) - z - hi / s, Q(t_hi) - z -
  lo / s]) and, where no value saturates, by half a step (integers: 1/2; float8: u |t| + eta)
  plus the quotient's rounding;
* D: the training value is (t - z) s = x_t; the inference value is D(q); the drift is
  s (q - t) plus D's rounding;
* a weight DQ (four inputs: q, s, z and the model's float w): the training value is w (stored
  in the training kernel's compute format), the inference value D(q); drift: the difference.

The linear and zonotope domains carry the same affine maps: x / s + z + e with e the interval
above (a fresh error term), (q - z) s plus D's rounding. A Q / DQ outside the joint graph (the
domain ""), a non-constant scale or an attribute form not listed here is refused with the node
named: a QDQ graph is bounded as the ``onnx:`` inference kernel of its float model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kcverify.bounds.box import Box, Concrete, mag, pad_hi, pad_lo
from kcverify.bounds.casts import rne
from kcverify.bounds.qdq_graph import JOINT_DOMAIN
from kcverify.bounds.registry import SYMBOLIC, ZONOTOPE, RuleCtx, rule
from kcverify.errors import BoundError
from kcverify.kernels.formats import Format, get_format

F64 = torch.float64
U64 = 2.0**-53


@dataclass(frozen=True)
class QType:
    """A quantized element type: integer range [lo, hi], or a float8 format."""

    name: str
    lo: float = 0.0
    hi: float = 0.0
    fmt: Format | None = None


# the attributes a joint Q / DQ node carries (qdq_graph._attrs: ONNX's, defaults written out,
# plus the quantized and scale types)
QDQ_ATTRS = ("axis", "block_size", "saturate", "qtype", "stype")
QTYPES: dict[int, QType] = {
    2: QType("uint8", 0, 255), 3: QType("int8", -128, 127), 4: QType("uint16", 0, 65535),
    5: QType("int16", -32768, 32767), 6: QType("int32", -(2.0**31), 2.0**31 - 1),
    21: QType("uint4", 0, 15), 22: QType("int4", -8, 7),
    17: QType("float8_e4m3fn", fmt=get_format("fp8_e4m3")),
    19: QType("float8_e5m2", fmt=get_format("fp8_e5m2")),
}
STYPES: dict[int, Format] = {1: get_format("fp32"), 10: get_format("fp16"),
                             16: get_format("bf16"), 11: get_format("fp64")}


@dataclass
class QParams:
    s: torch.Tensor  # the scale, broadcast to the operand (float64, > 0)
    z: torch.Tensor  # the zero point, broadcast likewise (0 for float8)
    qt: QType
    sfmt: Format  # the scale's float type (the type D(q) is stored in)
    saturate: bool


def _where(ctx: RuleCtx) -> str:
    return f"{ctx.node.op_type} node {ctx.node.name!r}"


def _bcast(v: torch.Tensor, shape: tuple[int, ...], axis: int, block: int, ctx: RuleCtx
           ) -> torch.Tensor:
    """A scale or zero point shaped for an operand of ``shape``: scalar, per axis or blocked."""
    if v.dim() == 0 or (v.numel() == 1 and block == 0):
        return v.reshape(())
    rank = len(shape)
    a = axis + rank if axis < 0 else axis
    if not 0 <= a < rank:
        raise BoundError(f"{_where(ctx)}: axis {axis} outside an operand of rank {rank}")
    if block:
        if v.dim() != rank or -(-shape[a] // block) != v.shape[a]:
            raise BoundError(f"{_where(ctx)}: block scale of shape {tuple(v.shape)} does not fit "
                             f"an operand of shape {shape} with block_size {block} on axis {axis}")
        return v.repeat_interleave(block, dim=a).narrow(a, 0, shape[a])
    if v.dim() != 1 or v.numel() != shape[a]:
        raise BoundError(f"{_where(ctx)}: per-axis scale of shape {tuple(v.shape)} does not fit "
                         f"axis {axis} of an operand of shape {shape}")
    out = [1] * rank
    out[a] = v.numel()
    return v.reshape(out)


def _params(ctx: RuleCtx, shape: tuple[int, ...], scale: object, zp: object) -> QParams:
    node = ctx.node
    if node.domain != JOINT_DOMAIN:
        raise BoundError(f"{_where(ctx)}: a QDQ graph is bounded as the inference kernel of its "
                         "float model (the contract's kernels.inf.onnx: docs/qdq.md), not as a "
                         "model of its own")
    if not isinstance(scale, Concrete) or (zp is not None and not isinstance(zp, Concrete)):
        raise BoundError(f"{_where(ctx)}: only constant scales and zero points are supported")
    qtype, stype = int(ctx.attr("qtype", 0)), int(ctx.attr("stype", 0))
    if qtype not in QTYPES or stype not in STYPES:
        raise BoundError(f"{_where(ctx)}: quantized type {qtype} / scale type {stype} is not "
                         "supported")
    axis, block = int(ctx.attr("axis", 1)), int(ctx.attr("block_size", 0))
    s = scale.value.to(ctx.device, F64)
    if not bool((torch.isfinite(s) & (s > 0)).all()):
        raise BoundError(f"{_where(ctx)}: every scale must be a positive finite number")
    z = (zp.value.to(ctx.device, F64) if zp is not None
         else torch.zeros((), dtype=F64, device=ctx.device))
    qt = QTYPES[qtype]
    if qt.fmt is not None and bool((z != 0).any()):
        raise BoundError(f"{_where(ctx)}: a float8 zero point must be 0")
    return QParams(_bcast(s, shape, axis, block, ctx), _bcast(z, shape, axis, block, ctx)
                   if z.dim() else z, qt, STYPES[stype], bool(int(ctx.attr("saturate", 1))))


def quantize(t: torch.Tensor, p: QParams) -> torch.Tensor:
    """Q at quotient t (float64), exactly as ONNX specifies (a monotone step function of t)."""
    if p.qt.fmt is None:
        return (torch.round(t) + p.z).clamp(p.qt.lo, p.qt.hi)
    fmt = p.qt.fmt
    if p.saturate:
        t = t.clamp(-fmt.max_finite, fmt.max_finite)
    return rne(t, fmt)  # beyond the range without saturation: +-inf (inf / NaN: no bound)


def _slack(p: QParams) -> tuple[float, float]:
    """Relative and absolute widening of a quotient x / s computed in the scale's type."""
    return max(2.0**-23, 2 * p.sfmt.u), 2 * p.sfmt.eta + 2.0**-1070


def quotient(lo: torch.Tensor, hi: torch.Tensor, p: QParams) -> tuple[torch.Tensor, torch.Tensor]:
    """An enclosure of every quotient x / s a conforming program computes, x in [lo, hi]."""
    rel, ab = _slack(p)
    a, b = lo / p.s, hi / p.s
    return a - a.abs() * rel - ab, b + b.abs() * rel + ab


def cast_error(lo: torch.Tensor, hi: torch.Tensor, p: QParams
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q_lo, q_hi, e_lo, e_hi): the image of Q over x in [lo, hi] and an enclosure of
    e = Q(x) - z - x / s there (module doc)."""
    t_lo, t_hi = quotient(lo, hi, p)
    q_lo, q_hi = quantize(t_lo, p), quantize(t_hi, p)
    e_lo = pad_lo(q_lo - p.z - hi / p.s, 4 * U64)
    e_hi = pad_hi(q_hi - p.z - lo / p.s, 4 * U64)
    rel, ab = _slack(p)
    m = mag(t_lo, t_hi)
    if p.qt.fmt is None:
        ok = (t_lo + p.z >= p.qt.lo - 0.5) & (t_hi + p.z <= p.qt.hi + 0.5)
        half = 0.5 + rel * m + ab
    else:
        fmt = p.qt.fmt
        ok = m <= fmt.max_finite
        half = (fmt.u + rel) * m + fmt.eta + ab
    half = torch.where(ok, pad_hi(half, 2.0**-40), torch.full_like(half, math.inf))
    e_lo = torch.where(torch.isnan(e_lo), -half, torch.maximum(e_lo, -half))
    e_hi = torch.where(torch.isnan(e_hi), half, torch.minimum(e_hi, half))
    return q_lo, q_hi, e_lo, e_hi


def stored(v_lo: torch.Tensor, v_hi: torch.Tensor, p: QParams, compute: Format
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """D's value set: the hull of the exact products and their roundings to the scale's type
    and to the compute format; and the bound on |stored - exact|."""
    lo, hi = v_lo, v_hi
    err = torch.zeros_like(v_lo)
    for fmt in (p.sfmt, compute):
        lo = torch.minimum(lo, rne(v_lo, fmt))
        hi = torch.maximum(hi, rne(v_hi, fmt))
        err = torch.maximum(err, fmt.u * mag(v_lo, v_hi) + fmt.eta)
    over = ~torch.isfinite(lo) | ~torch.isfinite(hi)
    err = torch.where(over & torch.isfinite(v_lo) & torch.isfinite(v_hi),
                      torch.full_like(err, math.inf), pad_hi(err, 2.0**-40))
    return lo, hi, err


def _box(ctx: RuleCtx, x: object) -> Box:
    if isinstance(x, Box):
        return x
    if isinstance(x, Concrete) and x.value.is_floating_point():
        return ctx.lift(x)
    raise BoundError(f"{_where(ctx)}: its input is not a float tensor")


@rule("QuantizeLinear", attrs=QDQ_ATTRS)
def quantize_linear(ctx: RuleCtx, x, scale, zero_point=None) -> Box:
    """Joint Q: training x_t / s + z, inference Q(x_i), drift e + (x_i - x_t) / s."""
    xb = _box(ctx, x)
    p = _params(ctx, tuple(xb.tl.shape), scale, zero_point)
    q_lo, q_hi, e_lo, e_hi = cast_error(xb.il, xb.ih, p)
    tl, th = xb.tl / p.s + p.z, xb.th / p.s + p.z
    return Box.make(tl, th, q_lo, q_hi, xb.dl / p.s + e_lo, xb.dh / p.s + e_hi)


@rule("DequantizeLinear", attrs=QDQ_ATTRS)
def dequantize_linear(ctx: RuleCtx, q, scale, zero_point=None, weight=None) -> Box:
    """Joint DQ: of a pair, training (t - z) s = x_t and inference D(q); of a weight, training
    the model's float weight and inference D(q)."""
    if weight is not None:
        return _weight(ctx, q, scale, zero_point, weight)
    qb = _box(ctx, q)
    p = _params(ctx, tuple(qb.tl.shape), scale, zero_point)
    tl, th = (qb.tl - p.z) * p.s, (qb.th - p.z) * p.s
    il, ih, err = stored((qb.il - p.z) * p.s, (qb.ih - p.z) * p.s, p, ctx.inf.compute)
    return Box.make(tl, th, il, ih, qb.dl * p.s - err, qb.dh * p.s + err)


def _weight(ctx: RuleCtx, q, scale, zero_point, weight) -> Box:
    if not isinstance(q, Concrete) or not isinstance(weight, Concrete):
        raise BoundError(f"{_where(ctx)}: a weight DequantizeLinear needs constant inputs")
    qv = q.value.to(ctx.device, F64)
    p = _params(ctx, tuple(qv.shape), scale, zero_point)
    v = (qv - p.z) * p.s
    il, ih, _ = stored(pad_lo(v, 2 * U64), pad_hi(v, 2 * U64), p, ctx.inf.compute)
    w = weight.value.to(ctx.device, F64)
    if tuple(w.shape) != tuple(v.shape):
        raise BoundError(f"{_where(ctx)}: the float weight has shape {tuple(w.shape)}, its "
                         f"quantized form {tuple(v.shape)}")
    wr = rne(w, ctx.train.compute)
    return Box.make(torch.minimum(w, wr), torch.maximum(w, wr), il, ih)


# --- the linear (symbolic) domain -------------------------------------------------------------
def _register_linear() -> None:
    from kcverify.bounds.linear import Form, LinState, _as_state, _err, _scale, _widen

    def shift(f: Form, c: torch.Tensor) -> Form:
        c = c.expand_as(f.b)
        e = _err(f.b, c)
        return Form(f.A, f.b + c, f.el - e, f.eh + e)

    @rule("QuantizeLinear", domain=SYMBOLIC, attrs=QDQ_ATTRS)
    def _q(ctx: RuleCtx, ins: list, out: Box, m: int) -> LinState | None:
        """x / s + z (+ the cast error e for the inference kernel); exact 1/s is not assumed."""
        (_, xb, _), (so, _, _) = ins[0], ins[1]
        xs = _as_state(ins[0], m)
        if xs is None or xb is None or ctx.node.domain != JOINT_DOMAIN:
            return None
        zo = ins[2][0] if len(ins) > 2 else None
        p = _params(ctx, tuple(xb.tl.shape), so, zo)
        inv = (1.0 / p.s).expand_as(xb.tl)
        _, _, e_lo, e_hi = cast_error(xb.il, xb.ih, p)
        if not bool(torch.isfinite(e_lo).all() & torch.isfinite(e_hi).all()):
            return None
        r_t = 4 * U64 * mag(out.tl, out.th) + 2.0**-1000
        r_i = 4 * U64 * mag(xb.il * inv, xb.ih * inv) + 2.0**-1000
        t = _widen(shift(_scale(xs.t, inv), p.z), -r_t, r_t)
        i = _widen(shift(_scale(xs.i, inv), p.z), pad_lo(e_lo) - r_i, pad_hi(e_hi) + r_i)
        d = _widen(_scale(xs.d, inv), pad_lo(e_lo) - r_t - r_i, pad_hi(e_hi) + r_t + r_i)
        return LinState(t, i, d)

    @rule("DequantizeLinear", domain=SYMBOLIC, attrs=QDQ_ATTRS)
    def _dq(ctx: RuleCtx, ins: list, out: Box, m: int) -> LinState | None:
        """(q - z) s for both kernels, plus D's rounding for the inference kernel."""
        (_, qb, _), (so, _, _) = ins[0], ins[1]
        qs = _as_state(ins[0], m)
        if qs is None or qb is None or len(ins) > 3 or ctx.node.domain != JOINT_DOMAIN:
            return None
        zo = ins[2][0] if len(ins) > 2 else None
        p = _params(ctx, tuple(qb.tl.shape), so, zo)
        s = p.s.expand_as(qb.tl)
        _, _, err = stored((qb.il - p.z) * p.s, (qb.ih - p.z) * p.s, p, ctx.inf.compute)
        if not bool(torch.isfinite(err).all()):
            return None
        t = _scale(shift(qs.t, -p.z), s)
        i = _widen(_scale(shift(qs.i, -p.z), s), -err, err)
        d = _widen(_scale(qs.d, s), -err, err)
        return LinState(t, i, d)


_register_linear()


# --- the zonotope -------------------------------------------------------------------------------
def _register_zonotope() -> None:
    from kcverify.bounds.zonotope import (
        ZState,
        _add_err,
        f_scale,
        f_shift,
        fp_err,
        in_bounds,
    )

    @rule("QuantizeLinear", domain=ZONOTOPE, attrs=QDQ_ATTRS)
    def _zq(zt, ctx, states, boxes, results):
        """x / s + z for both kernels; the inference kernel's cast error e as an error term
        (its centre moves the form, its radius is fresh noise)."""
        x = states[0]
        if not isinstance(x, ZState) or ctx.node.domain != JOINT_DOMAIN:
            return None
        p = _params(ctx, tuple(x.t.shape), zt.raw[1], zt.raw[2] if len(zt.raw) > 2 else None)
        il, ih = in_bounds(x, boxes[0], 1)
        _, _, e_lo, e_hi = cast_error(il, ih, p)
        inv = 1.0 / p.s
        t = fp_err(f_shift(f_scale(x.t, inv), p.z), 8)
        mid = 0.5 * e_lo + 0.5 * e_hi
        rad = pad_hi(torch.maximum(e_hi - mid, mid - e_lo))
        i = fp_err(f_shift(f_scale(x.i, inv), p.z + mid), 8)
        return ZState(t, _add_err(i, rad.expand(i.shape)))

    @rule("DequantizeLinear", domain=ZONOTOPE, attrs=QDQ_ATTRS)
    def _zdq(zt, ctx, states, boxes, results):
        """(q - z) s for both kernels, plus D's rounding for the inference kernel."""
        x = states[0]
        if not isinstance(x, ZState) or len(states) > 3 or ctx.node.domain != JOINT_DOMAIN:
            return None
        p = _params(ctx, tuple(x.t.shape), zt.raw[1], zt.raw[2] if len(zt.raw) > 2 else None)
        il, ih = in_bounds(x, boxes[0], 1)
        _, _, err = stored((il - p.z) * p.s, (ih - p.z) * p.s, p, ctx.inf.compute)
        t = f_scale(f_shift(x.t, -p.z), p.s)
        i = f_scale(f_shift(x.i, -p.z), p.s)
        return ZState(t, _add_err(i, err.expand(i.shape)))


_register_zonotope()
