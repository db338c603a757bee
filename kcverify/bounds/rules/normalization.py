"""LayerNormalization: y = (x - mu) / sqrt(var + eps) * g + b over the axes [axis:].

Exact enclosure over a box: c_j = x_j - mu = (1 - 1/n) x_j - (1/n) sum_{k!=j} x_k (no dependency
loss), var = mean(c^2) in [mean(mig(c)^2), mean(mag(c)^2)], r = (var + eps)^-1/2, and the
normalised x_hat = c r also lies in [-sqrt(n - 1), sqrt(n - 1)] (sum x_hat = 0, sum x_hat^2 <= n).

A conforming program computes it two-pass (mean, centre, mean of squares, rsqrt, scale, shift;
torch and ONNX's function body do) or fused, each primitive within the spec's error (a sum is a
primitive: relative error ulps("reduce") * u, DESIGN 1.1's row for normalising ops). With the mean
off by e_mu <= ((1 + k_r u)(1 + k_d u) - 1)|mu| + 2 eta, sum_j (c_j + e)^2 = sum c_j^2 + n e^2 (the cross term
vanishes), so the computed r is within relative rho_r of the exact one and the realised y_j within
|g_j| r (e_mu + |c_j| rho) + u_out |y_j| + eta-terms of the exact value at the same input.
Drift: the Jacobian (g/sigma)(I - 11^T/n - x_hat x_hat^T/n) over the hull (mean-value theorem),
plus both kernels' errors, intersected with the value-set difference.
"""

from __future__ import annotations

import math

import torch

from kcverify.bounds.box import (
    U64,
    Box,
    Concrete,
    fsum,
    imul,
    mag,
    meet_hi,
    meet_lo,
    mig,
    pad_hi,
    pad_lo,
)
from kcverify.bounds.registry import Interval, RuleCtx, bound_rule
from kcverify.bounds.rules import cache
from kcverify.kernels.spec import KernelSpec


def _norm_parts(lo: torch.Tensor, hi: torch.Tensor, eps: float):
    """Exact enclosures of c, r, x_hat along the last axis."""
    n = lo.shape[-1]
    s_lo, s_hi = fsum(lo, hi, -1, keepdim=True)
    c_lo = pad_lo((1 - 1 / n) * lo - (s_hi - hi) / n - 4 * U64 * (s_hi.abs() + hi.abs()) / n)
    c_hi = pad_hi((1 - 1 / n) * hi - (s_lo - lo) / n + 4 * U64 * (s_lo.abs() + lo.abs()) / n)
    # fsum of the squares (>= 0, so the error term's magnitude sum is the sum itself)
    k = (n + 2) * U64
    sq_lo = (mig(c_lo, c_hi) ** 2).sum(-1, keepdim=True)
    sq_hi = (mag(c_lo, c_hi) ** 2).sum(-1, keepdim=True)
    v_lo = pad_lo((sq_lo - k * sq_lo) / n)
    v_hi = pad_hi((sq_hi + k * sq_hi) / n)
    v_lo = v_lo.clamp_min(0.0)
    r_lo = pad_lo(1.0 / torch.sqrt(pad_hi(v_hi + eps)))
    r_hi = pad_hi(1.0 / torch.sqrt(pad_lo(v_lo + eps)))
    xh_lo, xh_hi = imul(c_lo, c_hi, r_lo, r_hi)
    lim = math.sqrt(max(n - 1, 0)) * (1 + 1e-12)
    xh_lo, xh_hi = pad_lo(xh_lo).clamp_min(-lim), pad_hi(xh_hi).clamp_max(lim)
    return (c_lo, c_hi), (r_lo, r_hi), (v_lo, v_hi), (xh_lo, xh_hi)


def _realized_err(spec: KernelSpec, lo, hi, c, r, v, eps, g_mag, y_mag) -> torch.Tensor:
    n = lo.shape[-1]
    u, eta = spec.compute.u, spec.compute.eta
    k_r = max(spec.ulp("rsqrt"), spec.ulp("sqrt") + spec.ulp("div"))
    # the sums inside a normalising op are primitives (DESIGN 1.1, last row): the exact sum
    # with relative error <= ulps("reduce") * u, then the division by n
    gn = spec.ulp("reduce") * u
    s_lo, s_hi = fsum(lo, hi, -1, keepdim=True)
    mean_abs = mag(s_lo, s_hi) / n * (1 + 4 * U64)
    e_mu = ((1 + gn) * (1 + spec.ulp("div") * u) - 1) * mean_abs + 2 * eta
    rho_v = (1 + u) ** 3 * (1 + gn) - 1 + n * eta / (v[0] + eps)
    rho_r = (math.sqrt(1 + 4 * u) * torch.sqrt((1 + rho_v) * (1 + e_mu ** 2 / (v[0] + eps)))
             * (1 + k_r * u) - 1)
    rho = (1 + u) ** 3 * (1 + rho_r) - 1
    c_mag = mag(*c)
    err = g_mag * r[1] * (e_mu * (1 + u) + c_mag * rho) * (1 + 1e-6)
    err = err + 2.01 * u * y_mag + 4 * eta
    return pad_hi(err, 1e-6)


def layernorm_box(ctx: RuleCtx, x: Box, g: Box | None, b: Box | None, eps: float) -> Box:
    parts, exact, errs, xhs = [], [], [], []
    for k, (spec, lo, hi) in enumerate(((ctx.train, x.tl, x.th), (ctx.inf, x.il, x.ih))):
        c, r, v, xh = _norm_parts(lo, hi, eps)
        xhs.append(xh)
        if g is not None:
            gl, gh = (g.tl, g.th) if k == 0 else (g.il, g.ih)
            y_lo, y_hi = imul(*xh, gl, gh)
            g_mag = mag(gl, gh)
        else:
            y_lo, y_hi = xh
            g_mag = torch.ones_like(lo)
        if b is not None:
            bl, bh = (b.tl, b.th) if k == 0 else (b.il, b.ih)
            y_lo, y_hi = y_lo + bl, y_hi + bh
        y_lo, y_hi = pad_lo(y_lo), pad_hi(y_hi)
        err = _realized_err(spec, lo, hi, c, r, v, eps, g_mag, mag(y_lo, y_hi))
        exact.append((y_lo, y_hi))
        errs.append(err)
        parts += [y_lo - err, y_hi + err]
    # drift: Jacobian over the hull; gain/bias drift (compute-format storage) added separately
    n = x.shape[-1]
    h_lo, h_hi = x.hull()
    _, r, _, xh = _norm_parts(h_lo, h_hi, eps)
    dm_lo, dm_hi = fsum(x.dl, x.dh, -1, keepdim=True)
    dm_lo, dm_hi = dm_lo / n, dm_hi / n
    w_lo, w_hi = imul(*xh, x.dl, x.dh)
    q_lo, q_hi = fsum(w_lo, w_hi, -1, keepdim=True)
    t_lo, t_hi = imul(*xh, q_lo / n, q_hi / n)
    inner_lo = pad_lo(x.dl - dm_hi - t_hi)
    inner_hi = pad_hi(x.dh - dm_lo - t_lo)
    j_lo, j_hi = imul(*r, inner_lo, inner_hi)  # d x_hat
    if g is not None:
        gh_lo, gh_hi = torch.minimum(g.tl, g.il), torch.maximum(g.th, g.ih)
        j_lo, j_hi = imul(j_lo, j_hi, gh_lo, gh_hi)
        xi_lo, xi_hi = xhs[1]
        e_lo, e_hi = imul(xi_lo, xi_hi, g.dl, g.dh)  # x_hat_i (g_i - g_t)
        j_lo, j_hi = j_lo + e_lo, j_hi + e_hi
    if b is not None:
        j_lo, j_hi = j_lo + b.dl, j_hi + b.dh
    vd_lo = exact[1][0] - exact[0][1]
    vd_hi = exact[1][1] - exact[0][0]
    d_lo = meet_lo(j_lo, vd_lo) - errs[0] - errs[1]
    d_hi = meet_hi(j_hi, vd_hi) + errs[0] + errs[1]
    return Box.make(*parts, d_lo, d_hi)


def _affine(ctx: RuleCtx, x, shape: tuple[int, ...]) -> Box | None:
    """The gain or bias lifted and flattened over the normalised axes (cached for constants)."""
    if x is None:
        return None
    build = lambda: ctx.lift(x).map(lambda t: t.expand(shape).reshape(-1))  # noqa: E731
    return cache.cached(ctx, x, ("ln-affine", tuple(shape)), build) if isinstance(x, Concrete) else build()


@bound_rule("LayerNormalization", domain=Interval)
def layer_norm(ctx: RuleCtx, x, scale=None, bias=None) -> Box:
    """LayerNormalization (opset 17): normalise over axes [axis:], then * scale + bias."""
    xb = ctx.lift(x)
    shape = xb.shape
    axis = int(ctx.attr("axis", -1)) % len(shape)
    eps = float(ctx.attr("epsilon", 1e-5))
    lead = shape[:axis]
    flat = xb.map(lambda t: t.reshape(*lead, -1))
    g = _affine(ctx, scale, shape[axis:])
    b = _affine(ctx, bias, shape[axis:])
    y = layernorm_box(ctx, flat, g, b, eps)
    return y.map(lambda t: t.reshape(shape))
