"""Softmax in the differential interval domain.

Exact softmax over a box (per row): p_j is increasing in x_j and decreasing in every other x_k,
so p_j in [a_j / (a_j + sum_{k!=j} b_k), b_j / (b_j + sum_{k!=j} a_k)] with a = exp(lo - M),
b = exp(hi - M), M = max hi (any common shift).

A conforming program (kcverify/kernels/spec.py) subtracts its own row max m (rounded: add),
evaluates exp (k ulps), adds the n terms in any order in the accumulator format (the row-sum model
of reduce.py: relative sigma = (n - 1) u_acc for terms of the accumulator, since all are >= 0),
may store the sum in the compute format (ulps("reduce")), and divides (ulps("div")) or multiplies
by the rounded reciprocal (ulps("div") then ulps("mul"): torch's and onnxruntime's CPU kernels).
Rescaled to the frame M, each e_k carries relative error rho = (1 + k u) exp(k_add u |x_k - m|) - 1
(+ eta); since sum_k p_k (1 + theta_k) lies in [1 - rho, 1 + rho], the realised p_j is within
relative tau = (1 + rho)(1 + out)/((1 - rho)(1 - sigma')) - 1 of the exact softmax at the same
input (sigma' the sum's total relative error, out the output's), plus
((n + 2) eta + a_sum) / (exp(max lo - M)(1 - rho)) absolute. At n = 4096 in fp32 sigma is
2.4e-4: torch.softmax realises errors of ~20 u there, which a 1-ulp row sum did not cover.

Drift (mean-value theorem per component): dp_j = p_j(xi) (dx_j - sum_k p_k(xi) dx_k) for some xi
in the hull, and sum_k p_k dx_k lies in [min_k dl_k, max_k dh_k] (p is in the simplex) and in
sum_k P_k * [dl_k, dh_k]. Masked entries (-inf in both kernels) give exactly 0. No bound
(``nan_rows``) on a row that may be masked throughout ((-inf) - (-inf) = NaN in every program
that subtracts its row max), on a row holding an element that may be +inf (its row max is +inf:
inf - inf = NaN; fp16 storage of 70000, or attention logits overflowing an fp16 MatMul), and
where the sum of exps (n terms of at most 1 + rho) may overflow.
"""

from __future__ import annotations

import torch

from kcverify.bounds.box import U64, Box, imul, meet_hi, meet_lo, nan_to, pad_hi, pad_lo
from kcverify.bounds.registry import Interval, RuleCtx, bound_rule
from kcverify.kernels.spec import KernelSpec

INF = float("inf")


def softmax_range(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact softmax enclosure along the last axis; also returns exp(max lo - max hi)."""
    n = lo.shape[-1]
    big = hi.amax(-1, keepdim=True)
    big = torch.where(torch.isfinite(big), big, torch.zeros_like(big))
    a = pad_lo(torch.exp(lo - big), 8 * U64).clamp_min(0.0)
    b = pad_hi(torch.exp(hi - big), 8 * U64)
    ta, tb = a.sum(-1, keepdim=True), b.sum(-1, keepdim=True)
    ea, eb = (n + 2) * U64 * ta, (n + 2) * U64 * tb
    rest_b = (tb - b) + eb + 2 * U64 * tb  # >= sum_{k!=j} b_k
    rest_a = ((ta - a) - ea - 2 * U64 * ta).clamp_min(0.0)  # <= sum_{k!=j} a_k
    p_lo = a / (a + rest_b)
    p_hi = b / (b + rest_a)
    p_lo = nan_to(pad_lo(p_lo, 8 * U64), 0.0).clamp_min(0.0)
    p_hi = nan_to(pad_hi(p_hi, 8 * U64), 1.0).clamp_max(1.0)
    d_min = torch.exp(lo.amax(-1, keepdim=True) - big)
    return p_lo, p_hi, d_min


def realized_error(spec: KernelSpec, lo: torch.Tensor, hi: torch.Tensor, p_hi: torch.Tensor,
                   d_min: torch.Tensor) -> torch.Tensor:
    """|p_realized - softmax(x)| bound for x in [lo, hi] (see module doc)."""
    from kcverify.bounds.rules.reduce import row_sum_factor

    n = lo.shape[-1]
    u, eta = spec.compute.u, spec.compute.eta
    k_exp = spec.ulp("exp")
    m_lo = lo.amax(-1, keepdim=True)
    m_hi = hi.amax(-1, keepdim=True)
    fin = torch.isfinite(lo)
    z = torch.maximum((m_hi - lo).abs(), (hi - m_lo).abs())
    z = torch.where(fin, z, torch.zeros_like(z))
    rho = ((1 + k_exp * u) * torch.exp(spec.ulp("add") * u * z.amax(-1, keepdim=True)) - 1) * (1 + 1e-6)
    # the row sum: any order in the accumulator (reduce.row_sum_factor), maybe stored in compute
    k_sum, a_sum = row_sum_factor(spec, n)
    sigma = (1 + k_sum) * (1 + spec.ulp("reduce") * u) - 1
    # the output: one division, or the reciprocal of the sum times each term
    out = max(spec.ulp("div") * u, (1 + spec.ulp("div") * u) * (1 + spec.ulp("mul") * u) - 1)
    tau = (1 + rho) * (1 + out) / ((1 - rho) * (1 - sigma)) - 1
    absd = ((n + 2) * eta + a_sum) / (d_min * (1 - rho) * (1 - sigma)) + 2 * eta
    err = pad_hi(tau * p_hi + absd, 1e-6)
    ok = (rho < 0.5) & (sigma < 0.5)
    return torch.where(ok, err, torch.ones_like(err))


def nan_rows(spec: KernelSpec, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Rows (keepdim) whose softmax may be NaN in a program conforming to ``spec`` (module doc):
    every element may be -inf, or one may be +inf, or the row sum may overflow."""
    from kcverify.bounds.rules.reduce import row_sum_factor

    n = lo.shape[-1]
    lim = min(spec.accumulate.max_finite, spec.compute.max_finite)
    k_sum, a_sum = row_sum_factor(spec, n)
    big = n * (1 + spec.ulp("exp") * spec.compute.u) * (1 + k_sum) * 1.01 + a_sum
    rows = (lo == -INF).all(-1, keepdim=True) | (hi == INF).any(-1, keepdim=True)
    return rows | (big > lim)


def softmax_box(ctx: RuleCtx, x: Box) -> Box:
    parts = []
    exact = []
    errs = []
    for spec, lo, hi in ((ctx.train, x.tl, x.th), (ctx.inf, x.il, x.ih)):
        p_lo, p_hi, d_min = softmax_range(lo, hi)
        err = realized_error(spec, lo, hi, p_hi, d_min)
        exact.append((p_lo, p_hi))
        errs.append(err)
        parts += [(p_lo - err).clamp_min(-spec.compute.eta), (p_hi + err).clamp_max(1 + err)]
    # drift: mean-value theorem over the hull
    h_lo, h_hi = x.hull()
    P_lo, P_hi, _ = softmax_range(h_lo, h_hi)
    fin = torch.isfinite(h_lo) | torch.isfinite(h_hi)
    dl = torch.where(fin, x.dl, torch.zeros_like(x.dl))
    dh = torch.where(fin, x.dh, torch.zeros_like(x.dh))
    s1_lo = dl.amin(-1, keepdim=True)
    s1_hi = dh.amax(-1, keepdim=True)
    w_lo, w_hi = imul(P_lo, P_hi, dl, dh)
    n = dl.shape[-1]
    s2_lo = w_lo.sum(-1, keepdim=True)
    s2_hi = w_hi.sum(-1, keepdim=True)
    s2_lo = s2_lo - (n + 2) * U64 * w_lo.abs().sum(-1, keepdim=True)
    s2_hi = s2_hi + (n + 2) * U64 * w_hi.abs().sum(-1, keepdim=True)
    s_lo, s_hi = torch.maximum(s1_lo, s2_lo), torch.minimum(s1_hi, s2_hi)
    q_lo, q_hi = pad_lo(dl - s_hi), pad_hi(dh - s_lo)
    g_lo, g_hi = imul(P_lo, P_hi, q_lo, q_hi)
    masked = ~fin
    zero = torch.zeros_like(g_lo)
    g_lo = torch.where(masked, zero, g_lo)
    g_hi = torch.where(masked, zero, g_hi)
    vd_lo = exact[1][0] - exact[0][1]
    vd_hi = exact[1][1] - exact[0][0]
    d_lo = meet_lo(g_lo, vd_lo) - errs[0] - errs[1]
    d_hi = meet_hi(g_hi, vd_hi) + errs[0] + errs[1]
    # no bound on a row that may be NaN in a conforming program: one that may be -inf
    # throughout (fully masked: (-inf) - (-inf) in every program that subtracts its row max,
    # torch and onnxruntime), one holding an element that may be +inf (fp16 storage, logits
    # overflowing in an fp16 MatMul: its row max is +inf and inf - inf = NaN), and one whose sum
    # of exps may overflow the accumulator or the compute format (each term is <= 1 + rho)
    full_t = nan_rows(ctx.train, x.tl, x.th).expand(d_lo.shape)
    full_i = nan_rows(ctx.inf, x.il, x.ih).expand(d_lo.shape)
    if bool((full_t | full_i).any()):
        full = full_t | full_i
        parts = [torch.where(f, v, p) for f, v, p in zip(
            (full_t, full_t, full_i, full_i), (-INF, INF, -INF, INF), parts)]
        d_lo, d_hi = torch.where(full, -INF, d_lo), torch.where(full, INF, d_hi)
    return Box.make(*parts, d_lo, d_hi)


def _axis(ctx: RuleCtx, rank: int) -> tuple[int, bool]:
    """(axis, coerce2d): opset < 13 flattens [axis:] into one axis (default 1)."""
    if ctx.opset < 13:
        return int(ctx.attr("axis", 1)) % rank, True
    return int(ctx.attr("axis", -1)) % rank, False


@bound_rule("Softmax", domain=Interval, attrs=("axis",))
def softmax(ctx: RuleCtx, a) -> Box:
    """Softmax along ``axis``."""
    x = ctx.lift(a)
    shape = x.shape
    axis, coerce = _axis(ctx, len(shape))
    if coerce:
        lead = 1
        for s in shape[:axis]:
            lead *= s
        y = softmax_box(ctx, x.map(lambda t: t.reshape(lead, -1)))
        return y.map(lambda t: t.reshape(shape))
    if axis != len(shape) - 1:
        y = softmax_box(ctx, x.map(lambda t: t.movedim(axis, -1)))
        return y.map(lambda t: t.movedim(-1, axis).contiguous())
    return softmax_box(ctx, x)
