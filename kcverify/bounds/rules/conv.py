"""Conv (1-D and 2-D, group 1; strides, pads, dilations, auto_pad) in every domain: the
interval rule, the symbolic-interval (linear) rule and the zonotope rule, registered from here.

A convolution is a dot product per output over im2col columns (what the realizer executes,
kcverify/kernels/realize.py): the input is cast by ``activations`` (its zero padding is exact in
every program), the weight (O, C, kh, kw) per output channel as an (O, C kh kw) matrix by
``weights``, the products accumulated in any order, the result rounded to the compute format, and
the bias added (one rounding). So each domain's rule is

    cols = im2col(x)            exact movement: (N, C, H, W) -> (N, L, C kh kw), padding = 0
    y    = cols @ W^T           the domain's MatMul with a constant right operand
    y    -> (N, O, H', W') + b  movement, then the domain's Add

with the weight's per-channel scale along O and its reduction axis C kh kw (W^T: out_axis -1,
k_axis -2), and the operand's sample axis 0. The geometry (explicit pads, auto_pad resolved) is
the executor's (kcverify/models/ops/conv.py), and the attributes are those its Conv function
takes, defaults from the ONNX schema (rules/shape.attributes): any other is refused by name.

Sharpness: the unfolded operand repeats each input element kh kw times; its cast errors are
bounded per copy (the zonotope gives the copies the input's symbols but a fresh cast symbol per
copy), and the unstable-cast count (diagnostics) counts each copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kcverify.bounds import linear as lin
from kcverify.bounds import zonotope as zono
from kcverify.bounds.box import Box, Concrete
from kcverify.bounds.registry import (
    EXECUTOR,
    SYMBOLIC,
    ZONOTOPE,
    Interval,
    RuleCtx,
    bound_rule,
    rule,
)
from kcverify.bounds.rules import cache
from kcverify.bounds.rules.shape import attributes
from kcverify.errors import BoundError

_SCALES = ("none", "static", "dynamic_per_tensor", "per_tensor")  # the realizer's (realize.py)


@dataclass(frozen=True)
class Geometry:
    """A 2-D convolution's shape: kernel, strides, dilations, explicit pads (top, left,
    bottom, right), output size; ``one_d`` when the node is 1-D (run as H = 1)."""

    kernel: tuple[int, int]
    strides: tuple[int, int]
    dilations: tuple[int, int]
    pads: tuple[int, int, int, int]
    out: tuple[int, int]
    one_d: bool
    unread: tuple[int, ...] = ()  # flat (H W) indices of input elements no window reads


def unread_elements(x_shape: tuple[int, int], kernel: tuple[int, int], strides: tuple[int, int],
                    dilations: tuple[int, int], pads: tuple[int, int, int, int]
                    ) -> tuple[int, ...]:
    """The input positions (flat over H W) that no window reads: a stride past the kernel's
    reach (a 1x1 stride-2 shortcut) or the rows / columns a stride leaves over."""
    h, w = x_shape
    ones = F.pad(torch.ones(1, 1, h, w, dtype=torch.float64), (pads[1], pads[3], pads[0], pads[2]))
    cols = F.unfold(ones, kernel, dilation=dilations, stride=strides)
    reads = F.fold(cols, ones.shape[-2:], kernel, dilation=dilations, stride=strides)
    reads = reads[0, 0, pads[0]:pads[0] + h, pads[1]:pads[1] + w]
    return tuple(int(i) for i in torch.nonzero(reads.reshape(-1) == 0).reshape(-1))


def geometry(ctx: RuleCtx, x_shape: tuple[int, ...], w: torch.Tensor) -> Geometry:
    """The node's geometry from its attributes (the executor's padding rules), or a BoundError
    naming the node for what this rule does not cover."""
    from kcverify.models.ops.conv import _pads

    where = f"Conv node {ctx.node.name!r}"
    kw = attributes(ctx.node, ctx.opset)
    nd = w.dim() - 2
    if nd not in (1, 2) or len(x_shape) != nd + 2:
        raise BoundError(f"{where}: the bound rule covers 1-D and 2-D convolutions, not {nd}-D")
    if int(kw.get("group", 1)) != 1:
        raise BoundError(f"{where}: group {kw['group']} is not supported (group 1 only)")
    kernel = list(kw.get("kernel_shape") or w.shape[2:])
    strides = list(kw.get("strides") or [1] * nd)
    dil = list(kw.get("dilations") or [1] * nd)
    probe = torch.empty(x_shape, device="meta")
    p = _pads(probe, kernel, strides, dil, kw.get("pads"), str(kw.get("auto_pad", "NOTSET")))
    if nd == 1:
        kernel, strides, dil, p = [1, *kernel], [1, *strides], [1, *dil], [0, p[0], 0, p[1]]
        x_shape = (*x_shape[:2], 1, x_shape[2])
    h = (x_shape[2] + p[0] + p[2] - dil[0] * (kernel[0] - 1) - 1) // strides[0] + 1
    wd = (x_shape[3] + p[1] + p[3] - dil[1] * (kernel[1] - 1) - 1) // strides[1] + 1
    k2, s2, d2, p4 = (kernel[0], kernel[1]), (strides[0], strides[1]), (dil[0], dil[1]), \
        (p[0], p[1], p[2], p[3])
    # a dynamic scale is the amax of the whole input: the elements no window reads go into
    # extra columns whose products are dropped (im2col / col2im), so the MatMul rule's amax
    # over its operand is the programs' amax (finding 22)
    dynamic = any(spec.activations is not None and spec.activations.scale != "static"
                  and spec.activations.scale != "none" for spec in ctx.kernels)
    unread = unread_elements((x_shape[2], x_shape[3]), k2, s2, d2, p4) if dynamic else ()
    return Geometry(k2, s2, d2, p4, (h, wd), nd == 1, unread)


def im2col(t: torch.Tensor, g: Geometry, lead: int = 1) -> torch.Tensor:
    """(*lead, C, [H,] W) -> (*lead, L, C kh kw): the columns of every output position, zero
    padded (exact movement; ``lead`` leading axes, e.g. the batch, or symbols and batch)."""
    shape = t.shape[:lead]
    x = t.reshape(-1, *t.shape[lead:])
    if g.one_d:
        x = x.unsqueeze(-2)
    x = F.pad(x, (g.pads[1], g.pads[3], g.pads[0], g.pads[2]))
    cols = F.unfold(x, g.kernel, dilation=g.dilations, stride=g.strides)  # (B, K, L)
    cols = cols.transpose(-1, -2)  # (B, L, K)
    if g.unread:  # extra rows holding the elements no window reads, zero padded (dropped later)
        k = cols.shape[-1]
        flat = t.reshape(cols.shape[0], t.shape[lead], -1)  # (B, C, [H] W), unpadded
        idx = torch.as_tensor(g.unread, device=t.device)
        extra = flat.index_select(-1, idx).reshape(cols.shape[0], -1)
        extra = F.pad(extra, (0, -extra.shape[-1] % k)).reshape(cols.shape[0], -1, k)
        cols = torch.cat([cols, extra], dim=-2)
    return cols.reshape(*shape, cols.shape[-2], cols.shape[-1])


def col2im(t: torch.Tensor, g: Geometry, lead: int = 1) -> torch.Tensor:
    """(*lead, L, O) -> (*lead, O, [H',] W'): the matmul's result as the Conv's output."""
    o = t.shape[-1]
    spatial = (g.out[1],) if g.one_d else g.out
    t = t[..., : spatial[0] * (spatial[1] if len(spatial) > 1 else 1), :]  # the extra rows go
    return t.transpose(-1, -2).reshape(*t.shape[:lead], o, *spatial)


def _weight(ctx: RuleCtx, w) -> Concrete:
    """The constant weight as the matmul's right operand W^T (C kh kw, O)."""
    if not isinstance(w, Concrete) or ctx.node.inputs[1] not in ctx.constants:
        raise BoundError(f"Conv node {ctx.node.name!r}: the weight must be a constant of the "
                         f"graph, not a computed tensor")
    v = w.value
    return Concrete(v.reshape(v.shape[0], -1).transpose(0, 1), w.rounds)


def _check_scales(ctx: RuleCtx) -> None:
    for spec in ctx.kernels:
        cs = spec.activations
        if cs is not None and cs.scale not in _SCALES:
            raise BoundError(f"Conv node {ctx.node.name!r}: {cs.scale} scaling of the convolution "
                             f"input is not defined (kernel {spec.name!r}); use "
                             f"{', '.join(_SCALES)}")


def _sample_axis(ctx: RuleCtx):
    return 0 if ctx.sample_axis(0) == 0 else "unknown"


def _bias_shape(g: Geometry, o: int) -> tuple[int, ...]:
    return (o, 1) if g.one_d else (o, 1, 1)


# --- intervals ------------------------------------------------------------------------------
@bound_rule("Conv", domain=Interval, attrs=EXECUTOR)
def conv(ctx: RuleCtx, x, w, b=None) -> Box:
    """im2col (exact), the MatMul rule's (cast, any-order accumulation, two roundings) with the
    weight per output channel, then the bias (the Add rule: one rounding)."""
    from kcverify.bounds.rules.elementwise import add as add_rule
    from kcverify.bounds.rules.linear import matmul_box

    _check_scales(ctx)
    X = cache.lift(ctx, x)
    g = geometry(ctx, tuple(X.shape), w.value)
    wt = _weight(ctx, w)
    cols = X.map(lambda t: im2col(t, g))
    y = matmul_box(ctx, cols, wt, False, True, -1, -2, axes=(_sample_axis(ctx), None))
    y = y.map(lambda t: col2im(t, g).contiguous())
    if b is None:
        return y
    bias = ctx.lift(b).map(lambda t: t.reshape(_bias_shape(g, t.shape[0])))
    return add_rule(ctx, y, bias)


# --- symbolic intervals (linear.py) ----------------------------------------------------------
@rule("Conv", domain=SYMBOLIC, attrs=EXECUTOR)
def conv_linear(ctx: RuleCtx, ins: list, out: Box, m: int):
    """The Gemm form rule on the unfolded forms (one row per output position), folded back,
    plus the bias as in Gemm."""
    (_, xb, _), (wo, _, _) = ins[0], ins[1]
    xs = lin._as_state(ins[0], m)
    if xs is None or xb is None or not isinstance(wo, Concrete):
        return None
    _check_scales(ctx)
    g = geometry(ctx, tuple(xb.shape), wo.value)

    def unfold(f: lin.Form) -> lin.Form:
        A = im2col(f.A.movedim(-1, 1), g, lead=2).movedim(1, -1)
        return lin.Form(A, im2col(f.b, g), im2col(f.el, g), im2col(f.eh, g))

    def fold(f: lin.Form) -> lin.Form:
        A = col2im(f.A.movedim(-1, 1), g, lead=2).movedim(1, -1)
        return lin.Form(A, col2im(f.b, g), col2im(f.el, g), col2im(f.eh, g))
    cols = xb.map(lambda t: im2col(t, g))
    st = lin.LinState(unfold(xs.t), unfold(xs.i), unfold(xs.d))
    y = lin._gemm(ctx, [(cols, cols, st), (_weight(ctx, wo), None, None)], out, m, max_rank=3)
    if y is None:
        return None
    st = lin.LinState(fold(y.t), fold(y.i), fold(y.d))
    if len(ins) < 3 or ins[2][0] is None:
        return st
    _, bb, _ = ins[2]
    if bb is None:
        return None
    bias = lin.from_box(bb.map(lambda t: t.reshape(_bias_shape(g, t.shape[0]))), m)
    res = []
    for fy, fb, spec, lo, hi in ((st.t, bias.t, ctx.train, out.tl, out.th),
                                 (st.i, bias.i, ctx.inf, out.il, out.ih)):
        _, _, r = ctx.round(spec, "add", lo, hi)
        res.append(lin._widen(lin._add(*lin._bcast_pair(fy, fb)), -r, r))
    rt = res[0].eh - lin._add(*lin._bcast_pair(st.t, bias.t)).eh
    ri = res[1].eh - lin._add(*lin._bcast_pair(st.i, bias.i)).eh
    d = lin._widen(lin._add(*lin._bcast_pair(st.d, bias.d)), -(rt + ri), rt + ri)
    return lin.LinState(res[0], res[1], d)


# --- the differential zonotope (zonotope.py) ---------------------------------------------------
@rule("Conv", domain=ZONOTOPE, attrs=EXECUTOR)
def conv_zonotope(zt, ctx: RuleCtx, states: list, boxes: list, results: tuple):
    """The input's noise becomes symbols before unfolding (every copy of an element keeps the
    element's symbols), then the zonotope's MatMul core with the constant weight, folded back,
    and the bias added and rounded as in Gemm."""
    x = states[0]
    w = zt.raw[1] if len(zt.raw) > 1 else None
    if not isinstance(x, zono.ZState) or not isinstance(w, Concrete) \
            or ctx.node.inputs[1] not in ctx.constants:
        return None
    _check_scales(ctx)
    g = geometry(ctx, tuple(x.t.shape), w.value)
    x = zt.symbolize(x)

    def unfold(f: zono.Form) -> zono.Form:
        G = im2col(f.G, g, lead=2) if f.k else torch.zeros(
            (0, *im2col(f.c, g).shape), dtype=f.c.dtype, device=f.c.device)
        return f.like(im2col(f.c, g), G, im2col(f.r, g))

    def fold(f: zono.Form) -> zono.Form:
        G = col2im(f.G, g, lead=2).contiguous() if f.k else torch.zeros(
            (0, *col2im(f.c, g).shape), dtype=f.c.dtype, device=f.c.device)
        return f.like(col2im(f.c, g).contiguous(), G, col2im(f.r, g).contiguous())
    cols = zono.ZState(unfold(x.t), unfold(x.i))
    box = boxes[0].map(lambda t: im2col(t, g)) if boxes[0] is not None else None
    y = zono._matmul_core(zt, ctx, cols, _weight(ctx, w), box, None, False, True,
                          (_sample_axis(ctx), None))
    if y is None:
        return None
    y = zono.ZState(fold(y.t), fold(y.i))
    bias = states[2] if len(states) > 2 else None
    if bias is None:
        return y
    shape = _bias_shape(g, y.t.shape[1])
    if isinstance(bias, Concrete):
        bias = Concrete(bias.value.reshape(shape), bias.rounds)
    else:
        bias = zono.ZState(*(f.like(f.c.reshape(shape), f.G.reshape(f.k, *shape),
                                    f.r.reshape(shape)) for f in bias.forms()))
    out = []
    for k, spec in enumerate(ctx.kernels):
        fb = zono._as_z(bias, ctx).forms()[k]
        out.append(zono._round(ctx, spec, "add", zono.f_add(y.forms()[k], fb)))
    return zono.ZState(*out)
