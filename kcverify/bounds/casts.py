"""Sound images of the casts of semantics §1.1, on intervals, in float64.

* ``rne(t, fmt)``: round-to-nearest-even into a float format, computed exactly in float64 (the
  quantum is a power of two, so t/quantum and the product are exact); saturates values within
  half a quantum of max_finite, returns +-inf beyond (an overflow a conforming program may turn
  into inf/NaN: the bound then says so);
* ``cast_image(lo, hi, s_lo, s_hi, fmt, rounding)``: an enclosure of {s * Q(a / s)} over
  a in [lo, hi], s in [s_lo, s_hi]. Round to nearest is a monotone step function, so for a fixed
  s the image is exactly [s*Q(lo/s), s*Q(hi/s)]; over an interval of scales we enclose
  s*Q(t) with t in hull(a/s) by the interval product. This is intersected with the relative model
  |s*Q(a/s) - a| <= u*|a| + eta*s (the only model when ``rounding == "any"``).
* the scale a program computes, fl32(max(amax, floor) / max_finite) (the spec's floor keeps it a
  normal float32 number: kcverify/kernels/spec.py), and the quotient a / s may be computed in
  fp32: ``SCALE_SLACK`` widens both so that a quotient landing on the other side of a rounding
  boundary is covered; the dequantised value s*q may be rounded to the accumulator (``deq_u``).
* the group of a ``dynamic_per_tensor`` scale is one *sample*: all axes but the operand's sample
  axis, which the engine tracks from the model's inputs (kcverify.models.blocks.sample_axes).
  An operand without a sample axis (the same for every sample) is one group; one whose sample
  axis is unknown (merged by a reshape) is one group when the batch has one sample, and
  otherwise gets every scale between its own element's magnitude and the operand's amax.

Integer formats (weights only): Q(a) = clip(round(a / s), -qmax, qmax) * s, |err| <= s/2.
"""

from __future__ import annotations

import math

import torch

from kcverify.bounds.box import imul, mag, mig, pad_hi, pad_lo
from kcverify.kernels.cast import round_to_format
from kcverify.kernels.formats import Format
from kcverify.kernels.scales import kind_of
from kcverify.kernels.spec import CastSpec

INF = float("inf")

SCALE_SLACK = 2.0**-21  # relative: fp32 rounding of amax/max_finite and of a/s, with margin
_EXP_MASK = 0x7FF0000000000000  # float64 exponent bits


def rne(t: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Exact round-to-nearest-even of float64 ``t`` into ``fmt`` (see module doc for overflow)."""
    if fmt.kind == "int":
        q = torch.round(t)
        return torch.where(q.abs() > fmt.qmax, torch.sign(q) * float("inf"), q)
    if fmt.name == "fp64":
        return t.clone()
    emin = int(round(math.log2(fmt.min_normal)))
    a = t.abs()
    # quantum = 2^(max(floor(log2 a), emin) - mantissa_bits): the exponent bits of a (zero
    # mantissa) are 2^floor(log2 a) for a normal double, 0 for zero and subnormals
    if t.dtype == torch.float64:
        top = (a.view(torch.int64) & _EXP_MASK).view(torch.float64)
        quantum = (top * 2.0 ** -fmt.mantissa_bits).clamp_min_(2.0 ** (emin - fmt.mantissa_bits))
    else:
        _, e = torch.frexp(a)  # a = m * 2^e, m in [0.5, 1)
        exp = torch.clamp(e.to(torch.float64) - 1, min=emin)
        quantum = torch.exp2(exp - fmt.mantissa_bits)
    q = torch.round(t / quantum) * quantum  # +-0 stays itself (quantum > 0)
    top_quantum = 2.0 ** (math.floor(math.log2(fmt.max_finite)) - fmt.mantissa_bits)
    limit = fmt.max_finite + top_quantum / 2
    m = float(a.amax()) if a.numel() else 0.0
    if m <= fmt.max_finite:
        return q  # finite and within range: no saturation, no overflow
    if m < limit:  # finite, and every value beyond max_finite saturates
        return q.clamp_(-fmt.max_finite, fmt.max_finite)
    q = torch.where(a == 0, t, q)
    sat = torch.sign(t) * fmt.max_finite
    over = torch.sign(t) * float("inf")
    q = torch.where(q.abs() > fmt.max_finite, torch.where(a < limit, sat, over), q)
    return torch.where(torch.isfinite(t), q, t)


def _qmax(fmt: Format) -> float:
    return float(fmt.qmax) if fmt.kind == "int" else fmt.max_finite


def scale_of(amax_lo: torch.Tensor, amax_hi: torch.Tensor, cs: CastSpec
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Interval of s = fl32(max(amax, floor) / max_finite), with fp32 slack; s_lo > 0."""
    m = _qmax(cs.format)
    floor = cs.floor
    s_lo = pad_lo(amax_lo.clamp_min(floor) / m, SCALE_SLACK)
    s_hi = pad_hi(amax_hi.clamp_min(floor) / m, SCALE_SLACK)
    return s_lo.clamp_min(floor / m * (1 - 2 * SCALE_SLACK)), s_hi


def cast_image(lo: torch.Tensor, hi: torch.Tensor, s_lo: torch.Tensor | float,
               s_hi: torch.Tensor | float, fmt: Format, rounding: str, deq_u: float,
               dynamic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Enclosure of {s * Q(a / s) : a in [lo, hi], s in [s_lo, s_hi]} (see module doc).

    ``dynamic``: s = amax / max_finite over a group containing a, so |a / s| <= max_finite
    (up to the fp32 slack): the quotient is clamped there and overflow is impossible."""
    s_lo_t = torch.as_tensor(s_lo, dtype=lo.dtype, device=lo.device)
    s_hi_t = torch.as_tensor(s_hi, dtype=lo.dtype, device=lo.device)
    # relative model: |Q(a) - a| <= u|a| + eta*s (int: s/2); any rounding direction
    if fmt.kind == "int":
        absd = s_hi_t / 2
        rel_lo, rel_hi = lo - absd, hi + absd
    else:
        # nearest: half a spacing, u|a| + eta*s; any neighbour: a full spacing, 2u|a| + 2eta*s
        k = 1.0 if rounding == "nearest" else 2.0
        e_abs = k * fmt.eta * s_hi_t
        rel_lo = lo - k * fmt.u * lo.abs() - e_abs
        rel_hi = hi + k * fmt.u * hi.abs() + e_abs
        rel_lo = pad_lo(rel_lo, 1e-12)
        rel_hi = pad_hi(rel_hi, 1e-12)
    if rounding == "nearest":
        pos = s_lo_t > 0
        all_pos = bool(pos.all())
        s_div_lo = s_lo_t if all_pos else torch.where(pos, s_lo_t, torch.ones_like(s_lo_t))
        # t = a / s over a in [lo, hi], s in [s_lo, s_hi] (s > 0)
        inv_lo, inv_hi = 1.0 / s_hi_t.clamp_min(1e-300), 1.0 / s_div_lo
        t_lo, t_hi = imul(lo, hi, inv_lo, inv_hi)
        t_lo, t_hi = pad_lo(t_lo, SCALE_SLACK), pad_hi(t_hi, SCALE_SLACK)
        if dynamic:
            lim = _qmax(fmt) * (1 + 2 * SCALE_SLACK)
            t_lo, t_hi = t_lo.clamp(-lim, lim), t_hi.clamp(-lim, lim)
        q_lo, q_hi = rne(t_lo, fmt), rne(t_hi, fmt)
        if fmt.kind == "int":
            q_lo, q_hi = q_lo.clamp(min=-fmt.qmax), q_hi.clamp(max=fmt.qmax)
        e_lo, e_hi = imul(q_lo, q_hi, s_lo_t, s_hi_t)
        e_lo, e_hi = pad_lo(e_lo, 2 * deq_u + 1e-15), pad_hi(e_hi, 2 * deq_u + 1e-15)
        if not all_pos:
            e_lo = torch.where(pos, e_lo, rel_lo)
            e_hi = torch.where(pos, e_hi, rel_hi)
        out_lo, out_hi = torch.maximum(e_lo, rel_lo), torch.minimum(e_hi, rel_hi)
        if fmt.kind == "int":
            out_lo, out_hi = e_lo, e_hi  # clipping makes the relative model invalid
    else:
        out_lo, out_hi = rel_lo, rel_hi
        if fmt.kind == "int":
            raise ValueError("integer casts are round-to-nearest")
    # overflow possible: |a/s| beyond the format (static scales) -> no bound. A dynamic scale
    # fl32(amax / max_finite) may round down, so the amax element's quotient may exceed
    # max_finite (by < 2^-23 relative): to nearest it saturates back, but rounded in any
    # direction its upper neighbour is +-inf (IEEE's overflow) or NaN
    if fmt.kind == "float" and (not dynamic or rounding != "nearest"):
        s_min = torch.where(s_lo_t > 0, s_lo_t, torch.full_like(s_lo_t, 1e-300))
        top_quantum = 2.0 ** (math.floor(math.log2(fmt.max_finite)) - fmt.mantissa_bits)
        limit = fmt.max_finite + (top_quantum / 2 if rounding == "nearest" else 0.0)
        t_max = mag(lo, hi) / s_min * (1 + SCALE_SLACK)
        over = t_max >= limit if rounding == "nearest" else t_max > limit
        out_lo = torch.where(over, torch.full_like(out_lo, -float("inf")), out_lo)
        out_hi = torch.where(over, torch.full_like(out_hi, float("inf")), out_hi)
    return torch.minimum(out_lo, out_hi), torch.maximum(out_lo, out_hi)


def _group_amax(lo: torch.Tensor, hi: torch.Tensor, dims: tuple[int, ...]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    a_lo, a_hi = mig(lo, hi), mag(lo, hi)
    return a_lo.amax(dim=dims, keepdim=True), a_hi.amax(dim=dims, keepdim=True)


UNKNOWN = "unknown"  # a sample axis the engine cannot tell (kcverify.models.blocks.sample_axes)


def sample_amax(lo: torch.Tensor, hi: torch.Tensor, sample_axis: int | str | None = 0,
                batch: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[amax_lo, amax_hi] of each element's per-sample group (broadcastable to lo): all axes but
    ``sample_axis`` (see the module doc: an axis, None for no sample axis, UNKNOWN)."""
    everything = tuple(range(lo.dim())) if lo.dim() else ()
    if isinstance(sample_axis, int) and not isinstance(sample_axis, bool) and lo.dim() > 1:
        a = sample_axis % lo.dim()
        return _group_amax(lo, hi, tuple(d for d in range(lo.dim()) if d != a))
    if sample_axis is None or batch == 1 or lo.dim() <= 1:
        return _group_amax(lo, hi, everything)
    # unknown sample axis with several samples: the element's group holds the element and lies
    # inside the operand
    _, a_hi = _group_amax(lo, hi, everything)
    return mig(lo, hi), a_hi.expand_as(lo)


def activation_scale_bounds(lo: torch.Tensor, hi: torch.Tensor, cs: CastSpec, side: str,
                            sample_axis: int | str | None = 0, batch: int | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """[s_lo, s_hi] of the activation scale of every element (broadcastable to lo): the scale
    kind's own enclosure (kcverify.kernels.scales; Unsupported for a weight-only kind)."""
    return kind_of(cs).interval(lo, hi, cs, side, sample_axis, batch)


def activation_cast(lo: torch.Tensor, hi: torch.Tensor, cs: CastSpec, rounding: str,
                    side: str, deq_u: float, sample_axis: int | str | None = 0,
                    batch: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast an activation operand of a MatMul. ``side``: "left" (..., M, K) or "right" (..., K, N).

    dynamic_per_tensor: one scale per sample (all axes but ``sample_axis``; see the module doc);
    dynamic_per_token: one per row (left) / column (right) over the reduction axis K;
    dynamic_per_block: blocks of ``block_size`` along K. static: the given scale; none: 1.
    mx / nv: the kind's scale enclosure and a saturating cast (no relative model). ``ftz``: a
    result that may be subnormal may be 0.
    """
    fmt = cs.format
    kind = kind_of(cs)
    if kind.name == "dynamic_per_block":
        kdim = lo.dim() - 1 if side == "left" else lo.dim() - 2
        out = _blocked(lo, hi, kdim, kind.k_block(cs),
                       lambda x_lo, x_hi, d: cast_image(
                           x_lo, x_hi, *scale_of(*_group_amax(x_lo, x_hi, (d,)), cs), fmt,
                           rounding, deq_u, dynamic=True))
        s_hi = block_scale_bounds(lo, hi, cs, side)[1] if cs.ftz else None
    else:
        s_lo, s_hi = kind.interval(lo, hi, cs, side, sample_axis, batch)
        if kind.saturating:
            out = saturating_image(lo, hi, s_lo, s_hi, fmt, rounding, deq_u)
        else:
            out = cast_image(lo, hi, s_lo, s_hi, fmt, rounding, deq_u,
                             dynamic=kind.dynamic and kind.amax_based)
    if cs.ftz:  # a value whose quotient may be subnormal may become 0
        near = mig(lo, hi) < fmt.min_normal * s_hi * (1 + 4 * SCALE_SLACK)
        out = (torch.where(near, out[0].clamp_max(0), out[0]),
               torch.where(near, out[1].clamp_min(0), out[1]))
    return out


def saturating_image(lo: torch.Tensor, hi: torch.Tensor, s_lo: torch.Tensor, s_hi: torch.Tensor,
                     fmt: Format, rounding: str, deq_u: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Enclosure of {s * sat(Q(a / s))} over a in [lo, hi], s in [s_lo, s_hi] (s >= 0; s = 0
    gives 0) for a cast that saturates at +-max_finite (the MX / NVFP4 kinds: |a / s| may exceed
    max_finite). For a fixed s the map is monotone in a, so the hull over t in hull(a / s) of the
    rounded, clamped t times [s_lo, s_hi] encloses it. ``rounding: any``: both neighbours."""
    s_lo = torch.as_tensor(s_lo, dtype=lo.dtype, device=lo.device).clamp_min(0)
    s_hi = torch.as_tensor(s_hi, dtype=lo.dtype, device=lo.device)
    inv_hi = torch.where(s_lo > 0, 1.0 / s_lo.clamp_min(1e-300), torch.full_like(s_lo, INF))
    inv_lo = 1.0 / s_hi.clamp_min(1e-300)
    t_lo, t_hi = imul(lo, hi, inv_lo, inv_hi)
    t_lo = torch.nan_to_num(pad_lo(t_lo, SCALE_SLACK), nan=-INF)
    t_hi = torch.nan_to_num(pad_hi(t_hi, SCALE_SLACK), nan=INF)
    m = fmt.max_finite
    t_lo, t_hi = t_lo.clamp(-m, m), t_hi.clamp(-m, m)
    if rounding == "nearest":
        q_lo, q_hi = rne(t_lo, fmt), rne(t_hi, fmt)
    else:
        q_lo, q_hi = round_to_format(t_lo, fmt, "down"), round_to_format(t_hi, fmt, "up")
    e_lo, e_hi = imul(q_lo, q_hi, s_lo, s_hi)
    return pad_lo(e_lo, 2 * deq_u + 1e-15), pad_hi(e_hi, 2 * deq_u + 1e-15)


def block_scale_bounds(lo: torch.Tensor, hi: torch.Tensor, cs: CastSpec, side: str
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """[s_lo, s_hi] of a dynamic_per_block activation scale, per element (full shape)."""
    kdim = lo.dim() - 1 if side == "left" else lo.dim() - 2
    return _blocked(lo, hi, kdim, kind_of(cs).k_block(cs) or 32,
                    lambda x_lo, x_hi, d: tuple(
                        t.expand_as(x_lo) for t in scale_of(*_group_amax(x_lo, x_hi, (d,)), cs)))


def _blocked(lo: torch.Tensor, hi: torch.Tensor, dim: int, block: int, fn) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply fn(lo_blk, hi_blk, dim) on blocks of ``block`` along ``dim`` (last block shorter)."""
    outs_lo, outs_hi = [], []
    for lo_b, hi_b in zip(torch.split(lo, block, dim=dim), torch.split(hi, block, dim=dim)):
        a, b = fn(lo_b, hi_b, dim)
        outs_lo.append(a)
        outs_hi.append(b)
    return torch.cat(outs_lo, dim=dim), torch.cat(outs_hi, dim=dim)


def weight_cast(w: torch.Tensor, cs: CastSpec, rounding: str, out_axis: int, k_axis: int,
                deq_u: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Q(W), exactly as every conforming program computes it (semantics §1.1: weights are cast
    exactly, round to nearest, with the scales of kcverify.kernels.scale): a point."""
    from kcverify.kernels.scale import quantize_weight

    q, _ = quantize_weight(w.to(torch.float64), cs, out_axis, k_axis)
    return q, q.clone()
