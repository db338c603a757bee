"""MatMul and Gemm under the kernel error model (semantics §1.1, kcverify/kernels/spec.py).

Per kernel: constant operands (graph.constant_names) are weights, cast exactly by the spec's
``weights`` (casts.weight_cast; otherwise the hull of W and its compute-format rounding), the
others activations, cast by ``activations`` with the exact round-to-nearest image on intervals
(casts.activation_cast; a dynamic per-sample scale groups by the operand's sample axis,
RuleCtx.sample_axis). Products of the cast values are exact and accumulated *unscaled* in the
accumulator format in any order; ``accumulation_error`` is the one place that encloses that
error: gamma_n(u_acc) * sum |a_i b_i| + n eta_acc max(1, s_a s_b), infinite where the unscaled
partial sums may overflow the accumulator. The result is rescaled and rounded to the compute
format (two roundings allowed). Value sets: interval matmul (midpoint-radius, float64 error
included).

Grid operands (``_grid_operand``): when both operands are values of float formats whose products
are exact in the accumulator (fp8 x fp8, fp8 x bf16 into fp32) and their scales are constant
along K, the rule also works in the unscaled units the accumulator sees: the value set is
(Q_a @ Q_b +- E) * [s_a s_b] with Q the format values' intervals, and E the sharpest enclosure of
kcverify.bounds.accumulate (exact rows have E = 0: every summation order gives the same sum).
Keeping the scale as one factor, instead of a width on every product, stops the scale's own
uncertainty from being amplified by the cancellation inside the sum. Both value sets are sound;
the rule keeps their intersection. Activation casts whose quotient enclosure straddles a
rounding midpoint are counted per input (kcverify.bounds.diagnostics: unstable casts).

Drift: with A_k, B_k the cast operands of kernel k,
A_i B_i - A_t B_t = (A_i - A_t) B_i + A_t (B_i - B_t), where A_i - A_t = dA + e_i - e_t (the input
drift plus both cast errors, each bounded by the cast image minus the operand's value set or the
relative model), which covers (Q_i(W) - Q_t(W)) x for weights; plus both accumulation and
rounding errors; intersected with the value-set difference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kcverify.bounds import cases, diagnostics
from kcverify.bounds.accumulate import (
    dot_error,
    grain_lower,
    sm90_error,
    sm90_error_from_magnitude,
)
from kcverify.bounds.box import (
    Box,
    Concrete,
    imatmul,
    imul,
    mag,
    meet_hi,
    meet_lo,
    nan_to,
    pad_hi,
    pad_lo,
)
from kcverify.bounds.casts import (
    SCALE_SLACK,
    activation_cast,
    activation_scale_bounds,
    block_scale_bounds,
    rne,
    weight_cast,
)
from kcverify.bounds.registry import Interval, RuleCtx, bound_rule
from kcverify.bounds.rules import cache
from kcverify.errors import BoundError
from kcverify.kernels.formats import gamma, get_format
from kcverify.kernels.spec import KernelSpec

INF = float("inf")


def accumulation_error(spec: KernelSpec, n: int, magn: torch.Tensor, s_lo: torch.Tensor,
                       s_hi: torch.Tensor, operands: tuple | None = None) -> torch.Tensor:
    """The accumulation enclosure of one matmul (kcverify/kernels/spec.py): |fl(sum) - sum| for
    the n unscaled products q_a q_b of each output, added in the kernel's accumulation family,
    in output units. ``magn`` = |A| @ |B| of the cast operands (output units); [s_lo, s_hi] the
    product of the two operands' scales (broadcastable to magn; per-block: its range along K).

    Any order (and every pinned schedule, tile_k and split_k, which are members of it):
    gamma_n(u_acc) magn (Higham 3.1: every product and partial sum rounded once per level; the
    products need not be representable) + n eta_acc s_hi (each rounding's underflow, in the
    unscaled units, and the blocks' rescalings) - and infinite where the unscaled sum
    magn / s_lo (1 + gamma_n), a bound on every partial sum, may overflow the accumulator.

    ``mma: sm90_fp8``: kcverify.bounds.accumulate.sm90_error over the spec's promotion interval
    and split-K set, from ``operands`` = (|A|, |B|, s_hi of A's rows, s_hi of B's columns) in
    output units; without them the wide magnitude-only bound."""
    acc = spec.accumulate
    fam = spec.accumulation
    g = gamma(n, acc.u)
    if fam.mma is not None:
        emin = {f: round(math.log2(get_format(f).min_normal)) for f in ("fp8_e4m3", "fp8_e5m2")}
        fa = spec.activations.format.name if spec.activations is not None else "fp8_e4m3"
        fw = spec.weights.format.name if spec.weights is not None else "fp8_e4m3"
        lo_e = 2.0 ** min(emin[fa], emin[fw])
        floor_c = s_hi * 2.0**-126
        if operands is not None:
            a_mag, b_mag, sa_hi, sb_hi = operands
            err = sm90_error(a_mag, b_mag, sa_hi * lo_e, sb_hi * lo_e, floor_c, fam.promote,
                             fam.split_k, _block_cuts(spec, n), acc.u)
        else:
            err = sm90_error_from_magnitude(magn, n, fam.promote, fam.split_k,
                                            s_hi * lo_e * lo_e * 4 + floor_c, acc.u)
        err = err + n * acc.eta * torch.clamp(s_hi, min=1.0)
    else:
        err = g * magn * (1 + (n + 4) * 2.0**-52) + n * acc.eta * torch.clamp(s_hi, min=1.0)
    over = magn * (1 + g) / s_lo.clamp_min(1e-300) >= acc.max_finite * (1 - 2.0**-40)
    if bool(over.any()):
        err = torch.where(over, torch.full_like(err, INF), err)
    return err


def _block_cuts(spec: KernelSpec, k: int) -> tuple[int, ...]:
    """K positions where a blocked scale of either operand changes (chunk cuts)."""
    cuts: set[int] = set()
    for cs in (spec.weights, spec.activations):
        if cs is not None:
            blk = cs.kind.k_block(cs)
            if blk:
                cuts.update(range(0, k, blk))
    return tuple(sorted(cuts))


def operand_scales(ctx: RuleCtx, spec: KernelSpec, x, lo: torch.Tensor, hi: torch.Tensor,
                   weight: bool, side: str, out_axis: int, k_axis: int,
                   sample_axis=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The range [s_lo, s_hi] of kernel ``spec``'s scale of one matmul operand along its
    reduction axis, broadcastable to the output (left (..., M|1, 1), right (..., 1, N|1))."""
    from kcverify.kernels.scale import weight_scale

    k = lo.dim() - 1 if side == "left" else lo.dim() - 2
    one = torch.ones([1] * lo.dim(), dtype=lo.dtype, device=lo.device)
    cs = spec.weights if weight else spec.activations
    if cs is None:
        return one, one
    if weight and isinstance(x, Concrete) and x.rounds == 0:
        s = weight_scale(x.value.to(lo.device, torch.float64), cs, out_axis, k_axis)
        s_lo, s_hi = s, s
    elif "activations" in cs.kind.roles:  # the kind's enclosure (mx / nv: weights too)
        axis = ctx.sample_axis(0 if side == "left" else 1) if sample_axis is None else sample_axis
        s_lo, s_hi = activation_scale_bounds(lo, hi, cs, side, axis, ctx.batch)
    else:  # a weight scale of a computed (rounded) weight: anything from the floor to amax
        m = float(cs.format.max_finite)
        s_lo = one * (cs.floor / m * 0.99)
        s_hi = (mag(lo, hi).amax().clamp_min(cs.floor) / m * 1.01) * one
    if s_lo.dim() < lo.dim():
        s_lo = s_lo.reshape([1] * (lo.dim() - s_lo.dim()) + list(s_lo.shape))
        s_hi = s_hi.reshape([1] * (lo.dim() - s_hi.dim()) + list(s_hi.shape))
    s_lo = s_lo.amin(dim=k, keepdim=True) if s_lo.shape[k] > 1 else s_lo
    s_hi = s_hi.amax(dim=k, keepdim=True) if s_hi.shape[k] > 1 else s_hi
    return s_lo, s_hi


def _operand(ctx: RuleCtx, spec: KernelSpec, x, lo: torch.Tensor, hi: torch.Tensor, weight: bool,
             side: str, out_axis: int, k_axis: int, sample_axis=None, count: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Value set of kernel ``spec``'s cast operand, and an enclosure of cast(x) - x.
    ``sample_axis``: the operand's (default: the node input's on that side)."""
    deq = spec.accumulate.u
    zero = torch.zeros_like(lo)
    if weight and spec.weights is not None and isinstance(x, Concrete) and x.rounds == 0:
        q_lo, q_hi = weight_cast(x.value.to(lo.device), spec.weights, spec.rounding, out_axis,
                                 k_axis, deq)
        w = x.value.to(lo.device, torch.float64)
        return q_lo, q_hi, pad_lo(q_lo - w), pad_hi(q_hi - w)
    cs = spec.weights if weight else spec.activations
    if cs is not None:
        axis = ctx.sample_axis(0 if side == "left" else 1) if sample_axis is None else sample_axis
        c_lo, c_hi = activation_cast(lo, hi, cs, spec.rounding, side, deq, axis, ctx.batch)
        forced = None
        if cases.active() and not weight and spec.rounding == "nearest":  # proof by cases
            c_lo, c_hi, forced = cases.forced_values((ctx.node.name, side, spec.name), lo, hi,
                                                     cs, side, axis, ctx.batch, c_lo, c_hi, deq)
        if count and not weight:
            un = _unstable(ctx, spec, cs, lo, hi, c_lo, c_hi, side, axis)
            _note_unstable(un if forced is None else un & ~forced, axis)
        e_lo, e_hi = c_lo - hi, c_hi - lo
        kind = cs.kind
        rel = kind.relative(cs, spec.rounding)  # None: no relative model (a saturating kind)
        if rel is not None and not cs.ftz and kind.name in ("none", "static"):
            s = 1.0 if cs.scale == "none" else float(cs.value or 1.0)
            r = pad_hi(rel[0] * torch.maximum(lo.abs(), hi.abs()) + rel[1] * s, 1e-9)
            e_lo, e_hi = torch.maximum(e_lo, -r), torch.minimum(e_hi, r)
        elif rel is not None and not cs.ftz and kind.amax_based:
            # s <= max(amax, floor) / max_finite: |a / s| stays within the format
            m = torch.maximum(lo.abs(), hi.abs())
            s_top = torch.clamp(m.amax(), min=cs.floor) / cs.format.max_finite * 1.01
            r = pad_hi(rel[0] * m + rel[1] * s_top, 1e-9)
            e_lo, e_hi = torch.maximum(e_lo, -r), torch.minimum(e_hi, r)
        return c_lo, c_hi, e_lo, e_hi
    if weight and isinstance(x, Concrete):
        # stored in the compute format: W itself or its round-to-nearest neighbour
        w = x.value.to(lo.device, torch.float64)
        q = rne(w, spec.compute)
        q_lo, q_hi = torch.minimum(torch.minimum(w, q), lo), torch.maximum(torch.maximum(w, q), hi)
        return q_lo, q_hi, torch.minimum(q - w, zero), torch.maximum(q - w, zero)
    return lo, hi, zero, zero


_GRID_WEIGHT_SCALES = ("none", "static", "per_tensor", "per_channel")


def _grid_operand(ctx: RuleCtx, spec: KernelSpec, x, lo: torch.Tensor, hi: torch.Tensor,
                  weight: bool, side: str, out_axis: int, k_axis: int, sample_axis,
                  count: bool = True) -> tuple | None:
    """(format, q_lo, q_hi, s_lo, s_hi): the operand as format values q times a scale constant
    along K (q, s broadcastable to the operand), for the grid path of the module doc; None when
    the operand is not of that kind (per-block scales, integer formats, ``rounding: any``, a
    weight kept in its own precision)."""
    cs = spec.weights if weight else spec.activations
    one = torch.ones([1] * lo.dim(), dtype=lo.dtype, device=lo.device)
    if cs is None:
        fmt = spec.compute
        if weight or fmt.kind != "float" or fmt.mantissa_bits >= 52:
            return None
        return fmt, lo, hi, one, one  # stored in the compute format, unscaled
    if cs.format.kind != "float" or spec.rounding != "nearest":
        return None
    if weight:
        if cs.scale not in _GRID_WEIGHT_SCALES or not (isinstance(x, Concrete) and x.rounds == 0):
            return None
        from kcverify.kernels.scale import weight_scale

        c = weight_cast(x.value.to(lo.device), cs, spec.rounding, out_axis, k_axis,
                        spec.accumulate.u)[0]
        sc = weight_scale(x.value.to(lo.device, torch.float64), cs, out_axis, k_axis)
        q = c / sc
        if not torch.equal(q * sc, c):
            return None
        return cs.format, q, q, sc, sc
    enc = cases.cast_enclosure(lo, hi, cs, side, sample_axis, ctx.batch)
    if enc is None:
        return None
    q_lo, q_hi, s_lo, s_hi = enc
    if cases.active():  # proof by cases (bounds/cases.py): the decided elements are forced
        q_lo, q_hi, _ = cases.force_q((ctx.node.name, side, spec.name), q_lo, q_hi,
                                      lambda q: cases.next_up(q, cs.format), sample_axis,
                                      ctx.batch)
    return cs.format, q_lo, q_hi, s_lo, s_hi


def _unstable(ctx: RuleCtx, spec: KernelSpec, cs, lo: torch.Tensor, hi: torch.Tensor,
              c_lo: torch.Tensor, c_hi: torch.Tensor, side: str, axis) -> torch.Tensor:
    """The elements of an activation operand whose cast conforming programs may round apart
    (diagnostics; an over-count where the scale kind gives no per-element interval): the
    quotient's enclosure holds two format values (round to nearest), or is not one format value
    (``rounding: any`` may go to either neighbour)."""
    from kcverify.kernels.scales import Unsupported

    if cs.format.kind != "float":
        return (c_lo != c_hi) | (c_lo != lo) | (c_hi != hi)
    try:
        if cs.scale == "dynamic_per_block":
            s_lo, s_hi = block_scale_bounds(lo, hi, cs, side)
        else:
            s_lo, s_hi = cs.kind.interval(lo, hi, cs, side, axis, ctx.batch)
    except (Unsupported, ValueError):
        return torch.broadcast_to(c_lo != c_hi, lo.shape)
    t_lo, t_hi = imul(lo, hi, 1.0 / s_hi, 1.0 / s_lo)
    if not (cs.scale == "none" or (cs.scale == "static" and bool((s_lo == s_hi).all()))):
        t_lo, t_hi = pad_lo(t_lo, SCALE_SLACK), pad_hi(t_hi, SCALE_SLACK)
    lim = cs.format.max_finite * (1 + 2 * SCALE_SLACK)
    q_lo, q_hi = rne(t_lo.clamp(-lim, lim), cs.format), rne(t_hi.clamp(-lim, lim), cs.format)
    out = q_lo != q_hi
    if spec.rounding != "nearest":
        out = out | (t_lo != q_lo) | (t_hi != q_lo)
    return torch.broadcast_to(out, lo.shape)


def _note_unstable(mask: torch.Tensor, sample_axis) -> None:
    """Count the straddling casts of one operand per sample (diagnostics)."""
    if isinstance(sample_axis, int) and not isinstance(sample_axis, bool) and mask.dim() > 0:
        a = sample_axis % mask.dim()
        dims = [d for d in range(mask.dim()) if d != a]
        per = mask.sum(dim=dims) if dims else mask.to(torch.int64)
        diagnostics.note("unstable_casts", per.cpu().numpy())
    else:
        diagnostics.note("unstable_casts", int(mask.sum()))


def grid_accumulation(spec: KernelSpec, ga: tuple, gb: tuple, n: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The grid path of the module doc for one kernel: (value lo, value hi, |error| in output
    units) of (Q_a s_a) @ (Q_b s_b) accumulated in any order, before the final roundings; None
    when the products are not exact in the accumulator or the sums may overflow it."""
    fa, qa_lo, qa_hi, sa_lo, sa_hi = ga
    fb, qb_lo, qb_hi, sb_lo, sb_hi = gb
    acc = spec.accumulate
    if spec.accumulation.mma is not None:
        return None  # the grain enclosure is for round-to-nearest accumulators
    if fa.mantissa_bits + fb.mantissa_bits + 2 > acc.mantissa_bits + 1:
        return None
    if not all(bool(torch.isfinite(t).all()) for t in (qa_lo, qa_hi, qb_lo, qb_hi)):
        return None
    g_a, g_b = grain_lower(qa_lo, qa_hi, fa), grain_lower(qb_lo, qb_hi, fb)
    # every nonzero product representable: its grain at least the accumulator's least subnormal
    tiny = acc.min_normal * 2.0 ** -acc.mantissa_bits
    if float(g_a.min()) * float(g_b.min()) < tiny:
        return None
    err = dot_error(qa_lo, qa_hi, qb_lo, qb_hi, acc, True, g_a, g_b)
    qa_lo, qa_hi, qb_lo, qb_hi = (torch.broadcast_to(t, t.shape) for t in (qa_lo, qa_hi, qb_lo, qb_hi))
    s_lo, s_hi, magn = imatmul(qa_lo, qa_hi, qb_lo, qb_hi)
    if not bool((magn * (1 + n * acc.u) * 1.01 < acc.max_finite).all()):
        return None  # a partial sum may overflow: the general enclosure says inf
    # one scale per row of A / column of B (constant along K); an element's range may be given
    # per element (an unknown sample axis): the row's common factor lies in their hull
    if sa_lo.dim() and sa_lo.shape[-1] > 1:
        sa_lo, sa_hi = sa_lo.amin(-1, keepdim=True), sa_hi.amax(-1, keepdim=True)
    if sb_lo.dim() > 1 and sb_lo.shape[-2] > 1:
        sb_lo, sb_hi = sb_lo.amin(-2, keepdim=True), sb_hi.amax(-2, keepdim=True)
    # scales are positive; the product of the two ranges, outward
    sc_lo = pad_lo(sa_lo * sb_lo, 2.0**-52)
    sc_hi = pad_hi(sa_hi * sb_hi, 2.0**-52)
    v_lo, v_hi = imul(pad_lo(s_lo - err), pad_hi(s_hi + err), sc_lo, sc_hi)
    return pad_lo(v_lo), pad_hi(v_hi), pad_hi(err * sc_hi, 2.0**-50)


@dataclass
class _WeightSide:
    """What matmul_box derives from a constant right operand alone: its lifted box, each
    kernel's cast operand and cast error, and the cast drift (the same in every call)."""

    box: Box
    ops: tuple[tuple, tuple]
    drift: tuple[torch.Tensor, torch.Tensor]
    scales: tuple[tuple, tuple]
    grids: tuple = (None, None)


def _weight_side(ctx: RuleCtx, b: Concrete, out_axis: int, k_axis: int) -> _WeightSide:
    def build() -> _WeightSide:
        B = ctx.lift(b)
        ops, scales, grids = [], [], []
        for k, spec in enumerate(ctx.kernels):
            lo, hi = (B.tl, B.th) if k == 0 else (B.il, B.ih)
            *cb, eb = _split(_operand(ctx, spec, b, lo, hi, True, "right", out_axis, k_axis))
            ops.append((tuple(cb), eb))
            scales.append(operand_scales(ctx, spec, b, lo, hi, True, "right", out_axis, k_axis))
            grids.append(_grid_operand(ctx, spec, b, lo, hi, True, "right", out_axis, k_axis, None))
        (cb_t, eb_t), (cb_i, eb_i) = ops
        return _WeightSide(B, (ops[0], ops[1]), _cast_drift(B, cb_t, cb_i, eb_t, eb_i),
                           (scales[0], scales[1]), (grids[0], grids[1]))
    return cache.cached(ctx, b, ("matmul-weight", out_axis, k_axis), build)


def _refuse_sample_contraction(ctx: RuleCtx, *sides: tuple) -> None:
    """Refuse a product that contracts over the sample axis of a batched operand under a dynamic
    activation scale: each sample's own scale then multiplies a different term of every dot
    product, which the operand casts (one scale per sample row) do not model. MatMul(W, x) with
    x (batch, k) and Gemm with transA / transB on a batched activation both reach it (F2 s7;
    the enclosures disagreed: InternalError). ``sides``: (sample axis, rank, contracted axis)."""
    if (ctx.batch or 1) <= 1 or not any(
            s.activations is not None and s.activations.scale.startswith("dynamic")
            for s in ctx.kernels):
        return
    for ax, rank, k_axis in sides:
        if isinstance(ax, int) and not isinstance(ax, bool) and rank and ax % rank == k_axis % rank:
            raise BoundError(f"{ctx.node.op_type} node {ctx.node.name!r}: the product contracts "
                             "over the sample axis of a batched activation under a dynamic "
                             "activation scale; not supported")


def rescale_error(spec: KernelSpec, n: int, magn: torch.Tensor, s_lo: torch.Tensor | float,
                  sa_hi: torch.Tensor | float, sb_hi: torch.Tensor | float) -> torch.Tensor:
    """The part of the rescale y = s_a s_b acc that the two relative roundings of
    ``ctx.round(spec, "mul", ..., steps=2)`` do not cover, in output units.

    The scales are fp32 values; the rescale multiplies in the wider of fp32 and the compute
    format F (a GEMM epilogue in fp32 under bf16 / fp16 compute; fp64 compute rescales in fp64),
    two roundings in either association, the result then rounded to the compute format. A
    program may form S = fl_F(s_a s_b) first: below F's min_normal S is off by up to eta_F
    absolutely, and that error multiplies the computed unscaled sum,
    |acc| <= (1 + gamma_n(u_acc)) magn / s_lo (F1 s8: an fp32 scale product below 2^-126
    reached 642x the certified drift). Or it forms fl_F(acc s_a) first: that eta_F is
    multiplied by s_b - covered by the rounding's own eta where s_b <= 1, added here above 1.
    Exactly zero where the scale product is certainly normal in F and no scale exceeds 1 (the
    usual case: bounds and pinned points there are unchanged). ``magn``: |A| @ |B| of the cast
    operands in output units; ``s_lo`` the scale product's lower end; ``sa_hi`` / ``sb_hi``
    the operands' largest scales (all broadcastable to magn). Added after any meet with the
    grid enclosure, which bounds the accumulation alone."""
    f32 = get_format("fp32")
    F = spec.compute if spec.compute.u < f32.u else f32
    t = magn.dtype
    s_lo = torch.as_tensor(s_lo, dtype=t)
    sa_hi, sb_hi = torch.as_tensor(sa_hi, dtype=t), torch.as_tensor(sb_hi, dtype=t)
    # |acc| in output units: any order within gamma_n; a tensor-core family within 2x
    y_mag = magn * (2.0 if spec.accumulation.mma is not None
                    else 1 + gamma(n, spec.accumulate.u))
    unscaled = y_mag / s_lo.clamp_min(1e-300)
    err = torch.where(s_lo < F.min_normal, F.eta * unscaled, torch.zeros_like(unscaled))
    err = err + F.eta * torch.clamp(torch.maximum(sa_hi, sb_hi) - 1.0, min=0.0)
    return torch.where(err > 0, pad_hi(err * (1 + 4 * F.u)), torch.zeros_like(err))


def matmul_box(ctx: RuleCtx, a, b, a_weight: bool, b_weight: bool,
               b_out_axis: int = -1, b_k_axis: int = -2, axes: tuple | None = None) -> Box:
    """(Cast A) @ (cast B) accumulated in any order and rounded, for both kernels, with drift.
    A constant B's lift, casts and cast drift depend on B and the specs alone: cached.
    ``axes``: the operands' sample axes as given (default: the node inputs')."""
    ws = (_weight_side(ctx, b, b_out_axis, b_k_axis)
          if b_weight and isinstance(b, Concrete) else None)
    A = ctx.lift(a)
    B = ws.box if ws is not None else ctx.lift(b)
    n = A.shape[-1]
    ax_a, ax_b = axes if axes is not None else (ctx.sample_axis(0), ctx.sample_axis(1))
    _refuse_sample_contraction(ctx, (ax_a, len(A.shape), -1), (ax_b, len(B.shape), b_k_axis))
    vals, errs, ops = [], [], []
    for k, spec in enumerate(ctx.kernels):
        a_lo, a_hi = (A.tl, A.th) if k == 0 else (A.il, A.ih)
        b_lo, b_hi = (B.tl, B.th) if k == 0 else (B.il, B.ih)
        *ca, ea = _split(_operand(ctx, spec, a, a_lo, a_hi, a_weight, "left", -2, -1, ax_a,
                                  count=True))
        sa = operand_scales(ctx, spec, a, a_lo, a_hi, a_weight, "left", -2, -1, ax_a)
        if ws is not None:
            cb, eb = ws.ops[k]
            sb = ws.scales[k]
        else:
            *cb, eb = _split(_operand(ctx, spec, b, b_lo, b_hi, b_weight, "right", b_out_axis,
                                      b_k_axis, ax_b, count=True))
            sb = operand_scales(ctx, spec, b, b_lo, b_hi, b_weight, "right", b_out_axis,
                                b_k_axis, ax_b)
        ca, cb = tuple(ca), tuple(cb)
        lo, hi, magn = imatmul(*ca, *cb)
        # an infinite cast image (a static scale that may overflow) makes inf - inf: no bound
        lo, hi, magn = nan_to(lo, -INF), nan_to(hi, INF), nan_to(magn, INF)
        mm = ((mag(*ca), mag(*cb), sa[1], sb[1]) if spec.accumulation.mma is not None
              else None)
        acc = accumulation_error(spec, n, magn, sa[0] * sb[0], sa[1] * sb[1], mm)
        lo, hi = lo - acc, hi + acc
        grid = _grid_pair(ctx, spec, k, a, a_lo, a_hi, a_weight, ax_a, ws, b, b_lo, b_hi,
                          b_weight, b_out_axis, b_k_axis, ax_b, n)
        if grid is not None:
            g_lo, g_hi, g_err = grid
            lo, hi = torch.maximum(lo, g_lo), torch.minimum(hi, g_hi)
            acc = torch.minimum(acc, g_err)
        resc = rescale_error(spec, n, magn, sa[0] * sb[0], sa[1], sb[1])
        lo, hi, rnd = ctx.round(spec, "mul", lo - resc, hi + resc, steps=2)
        rnd = rnd + resc
        # a scale product that may be subnormal: the realization's rescale is not the only one
        point = None if bool((resc > 0).any()) else _pinned_point(
            spec, a_lo, a_hi, a_weight, ax_a, b_lo, b_hi, b_weight, ax_b, b_out_axis)
        if point is not None:  # one schedule at a point: the value itself
            lo, hi = point
        vals += [lo, hi]
        errs.append(pad_hi(acc + rnd))
        ops.append((ca, cb, ea, eb))
    # drift: (A_i - A_t) B_i + A_t (B_i - B_t)
    (ca_t, cb_t, ea_t, eb_t), (ca_i, cb_i, ea_i, eb_i) = ops
    da = _cast_drift(A, ca_t, ca_i, ea_t, ea_i)
    db = ws.drift if ws is not None else _cast_drift(B, cb_t, cb_i, eb_t, eb_i)
    d1_lo, d1_hi, _ = imatmul(*da, *cb_i)
    d2_lo, d2_hi, _ = imatmul(*ca_t, *db)
    d1_lo, d2_lo = nan_to(d1_lo, -INF), nan_to(d2_lo, -INF)
    d1_hi, d2_hi = nan_to(d1_hi, INF), nan_to(d2_hi, INF)
    dl = pad_lo(d1_lo + d2_lo) - errs[0] - errs[1]
    dh = pad_hi(d1_hi + d2_hi) + errs[0] + errs[1]
    return Box.make(*vals, dl, dh)


def _stored_point(lo: torch.Tensor, hi: torch.Tensor, spec: KernelSpec) -> torch.Tensor | None:
    """The one compute-format value in [lo, hi] (a tensor is stored in the compute format;
    the dispatcher pads a point outward by float64 ulps), or None when there are several."""
    from kcverify.kernels.cast import round_to_format

    if torch.equal(lo, hi):
        return lo if bool(torch.isfinite(lo).all()) else None
    if not (bool(torch.isfinite(lo).all()) and bool(torch.isfinite(hi).all())):
        return None
    up = round_to_format(lo, spec.compute, "up")
    if not torch.equal(up, round_to_format(hi, spec.compute, "down")):
        return None
    return up if bool(torch.isfinite(up).all()) else None


def _pinned_point(spec: KernelSpec, a_lo: torch.Tensor, a_hi: torch.Tensor, a_weight: bool, ax_a,
                  b_lo: torch.Tensor, b_hi: torch.Tensor, b_weight: bool, ax_b,
                  b_out_axis: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For a pinned accumulation (order sequential / pairwise: one schedule per split-K
    configuration) with point operands, the value every conforming program computes: the
    realization's own cast, accumulation and rounding, hulled over the split-K set. None when
    the operands are not points, the casts may round otherwise (``rounding: any``), or a value
    is not finite (the general rule decides)."""
    fam = spec.accumulation
    if not fam.pinned or spec.rounding != "nearest" or b_out_axis not in (-1, b_lo.dim() - 1):
        return None
    a_pt, b_pt = _stored_point(a_lo, a_hi, spec), _stored_point(b_lo, b_hi, spec)
    if a_pt is None or b_pt is None:
        return None
    a_lo, b_lo = a_pt, b_pt
    from kcverify.kernels.realize import point_matmul

    vals = [point_matmul(spec, a_lo, b_lo, a_weight, b_weight, (ax_a, ax_b), split)
            for split in fam.split_k]
    if not all(bool(torch.isfinite(v).all()) for v in vals):
        return None
    v = torch.stack(vals)
    lo, hi = v.amin(0), v.amax(0)
    if spec.weights is not None or spec.activations is not None:
        # the rescale s_a s_b acc may take two roundings (fl(fl(s_a s_b) acc), fl(fl(acc s_a)
        # s_b), ...): within one spacing of the realization's one-rounding value
        from kcverify.kernels.cast import grid_step

        lo = lo - grid_step(lo, spec.compute)
        hi = hi + grid_step(hi, spec.compute)
    return lo, hi


def _grid_pair(ctx: RuleCtx, spec: KernelSpec, k: int, a, a_lo, a_hi, a_weight: bool, ax_a,
               ws: _WeightSide | None, b, b_lo, b_hi, b_weight: bool, b_out_axis: int,
               b_k_axis: int, ax_b, n: int, count: bool = True):
    """grid_accumulation for kernel k's operands, or None (module doc). ``count``: report the
    unstable casts (the interval rule does; a relational domain beside it does not again)."""
    ga = _grid_operand(ctx, spec, a, a_lo, a_hi, a_weight, "left", -2, -1, ax_a, count)
    if ga is None:
        return None
    gb = (ws.grids[k] if ws is not None else
          _grid_operand(ctx, spec, b, b_lo, b_hi, b_weight, "right", b_out_axis, b_k_axis, ax_b,
                        count))
    if gb is None:
        return None
    return grid_accumulation(spec, ga, gb, n)


def _split(op: tuple) -> tuple:
    return op[0], op[1], (op[2], op[3])


def _cast_drift(X: Box, ct: tuple[torch.Tensor, torch.Tensor], ci: tuple[torch.Tensor, torch.Tensor],
                et: tuple[torch.Tensor, torch.Tensor], ei: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Enclosure of cast_i(x_i) - cast_t(x_t) = drift + e_i - e_t (e_k = cast_k(x) - x),
    intersected with the difference of the two cast images."""
    lo = X.dl + ei[0] - et[1]
    hi = X.dh + ei[1] - et[0]
    lo = meet_lo(lo, ci[0] - ct[1])
    hi = meet_hi(hi, ci[1] - ct[0])
    return nan_to(lo, -float("inf")), nan_to(hi, float("inf"))


@bound_rule("MatMul", domain=Interval)
def matmul(ctx: RuleCtx, a, b) -> Box:
    """numpy.matmul semantics; 1-D operands are promoted and the added axis removed."""
    squeeze = []
    if len(a.shape) == 1:
        a = ctx.lift(a).map(lambda t: t.unsqueeze(0))
        squeeze.append(-2)
    if len(b.shape) == 1:
        b = ctx.lift(b).map(lambda t: t.unsqueeze(-1))
        squeeze.append(-1)
    aw, bw = ctx.node.inputs[0] in ctx.constants, ctx.node.inputs[1] in ctx.constants
    # a promoted 1-D operand's only axis is K: no sample axis to group by
    ax = ("unknown" if -2 in squeeze else ctx.sample_axis(0),
          "unknown" if -1 in squeeze else ctx.sample_axis(1))
    y = matmul_box(ctx, a if isinstance(a, Concrete) and not squeeze else ctx.lift(a),
                   b if isinstance(b, Concrete) and not squeeze else ctx.lift(b), aw, bw,
                   axes=ax)
    for d in squeeze:
        y = y.map(lambda t, d=d: t.squeeze(d))
    return y


@bound_rule("Gemm", domain=Interval, attrs=("transA", "transB", "alpha", "beta"))
def gemm(ctx: RuleCtx, a, b, c=None) -> Box:
    """alpha * A' B' + beta * C (A' = A^T if transA, B' = B^T if transB); the matmul is cast,
    accumulated and rounded as above, alpha/beta/bias each one rounding."""
    from kcverify.bounds.rules.elementwise import add as add_rule
    from kcverify.bounds.rules.elementwise import mul_box

    ta, tb = int(ctx.attr("transA", 0)), int(ctx.attr("transB", 0))
    alpha, beta = float(ctx.attr("alpha", 1.0)), float(ctx.attr("beta", 1.0))

    def tr(x, flag: int):
        if not flag:
            return x
        if isinstance(x, Concrete):
            return Concrete(x.value.transpose(0, 1), x.rounds)
        return x.map(lambda t: t.transpose(0, 1))
    aw, bw = ctx.node.inputs[0] in ctx.constants, ctx.node.inputs[1] in ctx.constants

    def tr_axis(a, flag: int):
        return 1 - a if flag and isinstance(a, int) and not isinstance(a, bool) else a
    ax = (tr_axis(ctx.sample_axis(0), ta), tr_axis(ctx.sample_axis(1), tb))
    # per-channel weights: the output feature is B's axis 0 when transB (before transposing)
    y = matmul_box(ctx, tr(a, ta), tr(b, tb), aw, bw, axes=ax)
    if alpha != 1.0:
        s = torch.full((), alpha, dtype=torch.float64)
        y = mul_box(ctx, y, ctx.lift(Concrete(s)))
    if c is not None and beta != 0.0:
        cb = ctx.lift(c)
        if beta != 1.0:
            s = torch.full((), beta, dtype=torch.float64)
            cb = mul_box(ctx, cb, ctx.lift(Concrete(s)))
        z = add_rule(ctx, y, cb)
        if beta == 1.0:
            z = _pinned_bias(ctx, y, c, cb, z)
        y = z
    return y


def _pinned_bias(ctx: RuleCtx, y: Box, c_raw, c: Box, z: Box) -> Box:
    """A pinned kernel's bias add at a point is one correctly rounded addition (kernels/spec.py:
    + - * / round to nearest in a pinned kernel) of the bias as the graph holds it (a constant
    is used as it is, like the realization does): its value, inside the add rule's set."""
    from kcverify.kernels.cast import add_nearest

    parts = list(z.parts())
    for k, spec in enumerate(ctx.kernels):
        y_lo, y_hi = (y.tl, y.th) if k == 0 else (y.il, y.ih)
        if isinstance(c_raw, Concrete) and c_raw.rounds == 0:
            c_pt = c_raw.value.to(y_lo.device, torch.float64)
            c_pt = c_pt if bool(torch.isfinite(c_pt).all()) else None
        else:
            c_pt = _stored_point(*((c.tl, c.th) if k == 0 else (c.il, c.ih)), spec)
        y_pt = _stored_point(y_lo, y_hi, spec)
        if not spec.accumulation.pinned or y_pt is None or c_pt is None:
            continue
        v = add_nearest(*torch.broadcast_tensors(y_pt, c_pt), spec.compute)
        if bool(torch.isfinite(v).all()):
            parts[2 * k], parts[2 * k + 1] = v, v.clone()
    return Box.make(*parts)
