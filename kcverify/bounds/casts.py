"""Sound images of the casts of DESIGN 1.1, on intervals, in float64.

* ``rne(t, fmt)``: round-to-nearest-even into a float format, computed exactly in float64 (the
  quantum is a power of two, so t/quantum and the product are exact); saturates values within
  half a quantum of max_finite, returns +-inf beyond (an overflow a conforming program may turn
  into inf/NaN: the bound then says so);
* ``cast_image(lo, hi, s_lo, s_hi, fmt, rounding)``: an enclosure of {s * Q(a / s)} over
  a in [lo, hi], s in [s_lo, s_hi]. Round to nearest is a monotone step function, so for a fixed
  s the image is exactly [s*Q(lo/s), s*Q(hi/s)]; over an interval of scales we enclose
  s*Q(t) with t in hull(a/s) by the interval product. This is intersected with the relative model
  |s*Q(a/s) - a| <= u*|a| + eta*s (the only model when ``rounding == "any"``).
* the scale a realization computes (amax / max_finite) and the quotient a / s may be computed in
  fp32: ``SCALE_SLACK`` widens both so that a quotient landing on the other side of a rounding
  boundary is covered; the dequantised value s*q may be rounded to the accumulator (``deq_u``).

Integer formats (weights only): Q(a) = clip(round(a / s), -qmax, qmax) * s, |err| <= s/2.
"""

from __future__ import annotations

import math

import torch

from kcverify.bounds.box import imul, mag, mig, pad_hi, pad_lo
from kcverify.kernels.formats import Format
from kcverify.kernels.spec import CastSpec

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


def scale_of(amax_lo: torch.Tensor, amax_hi: torch.Tensor, fmt: Format
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Interval of s = amax / max_finite (all-zero group -> 1), with fp32 slack."""
    m = _qmax(fmt)
    s_lo = pad_lo(amax_lo / m, SCALE_SLACK)
    s_hi = pad_hi(amax_hi / m, SCALE_SLACK)
    zero_possible = amax_lo <= 0
    if not bool(zero_possible.any()):
        return s_lo.clamp_min(0.0), s_hi
    one = torch.ones_like(s_lo)
    s_lo = torch.where(zero_possible, torch.minimum(s_lo, one), s_lo).clamp_min(0.0)
    s_hi = torch.where(zero_possible, torch.maximum(s_hi, one), s_hi)
    return s_lo, s_hi


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
    # overflow possible: |a/s| beyond the format (static scales) -> no bound
    if fmt.kind == "float" and not dynamic:
        s_min = torch.where(s_lo_t > 0, s_lo_t, torch.full_like(s_lo_t, 1e-300))
        top_quantum = 2.0 ** (math.floor(math.log2(fmt.max_finite)) - fmt.mantissa_bits)
        over = mag(lo, hi) / s_min * (1 + SCALE_SLACK) >= fmt.max_finite + top_quantum / 2
        out_lo = torch.where(over, torch.full_like(out_lo, -float("inf")), out_lo)
        out_hi = torch.where(over, torch.full_like(out_hi, float("inf")), out_hi)
    return torch.minimum(out_lo, out_hi), torch.maximum(out_lo, out_hi)


def _group_amax(lo: torch.Tensor, hi: torch.Tensor, dims: tuple[int, ...]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    a_lo, a_hi = mig(lo, hi), mag(lo, hi)
    return a_lo.amax(dim=dims, keepdim=True), a_hi.amax(dim=dims, keepdim=True)


def activation_cast(lo: torch.Tensor, hi: torch.Tensor, cs: CastSpec, rounding: str,
                    side: str, deq_u: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast an activation operand of a MatMul. ``side``: "left" (..., M, K) or "right" (..., K, N).

    dynamic_per_tensor: one scale per sample (axis 0) over all other axes; dynamic_per_token: one
    per row (left) / column (right) over the reduction axis K; dynamic_per_block: blocks of
    ``block_size`` along K. static: the given scale; none: scale 1.
    """
    fmt = cs.format
    if cs.scale == "none":
        return cast_image(lo, hi, 1.0, 1.0, fmt, rounding, deq_u)
    if cs.scale == "static":
        v = float(cs.value or 1.0)
        return cast_image(lo, hi, v, v, fmt, rounding, deq_u)
    kdim = lo.dim() - 1 if side == "left" else lo.dim() - 2
    if cs.scale == "dynamic_per_tensor":
        dims = tuple(range(1, lo.dim())) if lo.dim() > 1 else (0,)
        a_lo, a_hi = _group_amax(lo, hi, dims)
        s_lo, s_hi = scale_of(a_lo, a_hi, fmt)
        return cast_image(lo, hi, s_lo, s_hi, fmt, rounding, deq_u, dynamic=True)
    if cs.scale == "dynamic_per_token":
        a_lo, a_hi = _group_amax(lo, hi, (kdim,))
        s_lo, s_hi = scale_of(a_lo, a_hi, fmt)
        return cast_image(lo, hi, s_lo, s_hi, fmt, rounding, deq_u, dynamic=True)
    if cs.scale == "dynamic_per_block":
        return _blocked(lo, hi, kdim, int(cs.block_size or 32),
                        lambda x_lo, x_hi, d: cast_image(
                            x_lo, x_hi, *scale_of(*_group_amax(x_lo, x_hi, (d,)), fmt), fmt,
                            rounding, deq_u, dynamic=True))
    raise ValueError(f"unknown activation scale {cs.scale!r}")


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
    """Q(W), exactly as every conforming program computes it (DESIGN 1.1: weights are cast
    exactly, round to nearest, with the scales of kcverify.kernels.scale): a point."""
    from kcverify.kernels.scale import quantize_weight

    q, _ = quantize_weight(w.to(torch.float64), cs, out_axis, k_axis)
    return q, q.clone()
