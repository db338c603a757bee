"""LayerNormalization: y = (x - mu) / sqrt(var + eps) * g + b over the axes [axis:].

Exact enclosure over a box: c_j = x_j - mu = (1 - 1/n) x_j - (1/n) sum_{k!=j} x_k (no dependency
loss), var = mean(c^2) in [mean(mig(c)^2), mean(mag(c)^2)], r = (var + eps)^-1/2, and the
normalised x_hat = c r also lies in [-sqrt(n - 1), sqrt(n - 1)] (sum x_hat = 0, sum x_hat^2 <= n).

A conforming program (kcverify/kernels/spec.py) computes the row's moments in the accumulator
format by one of two families, and then y = ((x - mu~) r~) g + b in the compute format, each
operation correctly rounded (torch: (x + (-mu~)) * r~ * g + b; onnxruntime, ONNX's function body
and the realizer: the same order):

* sums (two-pass; onnxruntime, ONNX's function body): mu~ = fl(S~ / n) with S~ the row sum in any
  order (reduce.row_sum_factor: (n - 1) u_acc sum |x|), stored with ulps("reduce"); then
  v~ = fl(sum fl((x - mu~)^2) / n). Since sum (x - mu~)^2 / n = v + e_mu^2 exactly (the cross
  term vanishes), |v~ - v| <= rho_2 (v + e_mu^2) + e_mu^2 + eta-terms.
* Welford / Chan trees (torch's CPU RowwiseMoments: Welford chains of <= 16 inside a chunk, a
  binary cascade across chunks, the SIMD lanes and a scalar tail merged one by one; height
  <= 26 + ceil(log2 n) with 16 lanes), admitted unless the spec says ``moments: sums``: any binary
  tree of height <= D' = min(D, n - 1), D = WELFORD_DEPTH + ceil(log2 n), whose node v merges
  (n_a, mu_a, M_a) and (n_b, mu_b, M_b) by delta~ = fl(mu_b - mu_a), mu_v = fl(mu_a + fl(c~
  delta~)) (or fused, or delta~ / n_v), c~ within (1 + u)^3 of n_b / n_v, and M_v = M_a + M_b +
  delta~^2 c~ n_a (Chan, <= 7 relative roundings in the term, two in the sum) or, for n_b = 1,
  M_a + delta~ fl(x - mu_v) (Welford); mu~ and var~ = fl(M / n) stored with ulps("reduce") and
  ulps("div"). Proof (docs/bounds.md, "LayerNorm moments"): every
  rounding of a mean is an exact shift of part of the row (delta~'s of subtree b, the rest of
  the whole subtree), so the root holds the exact moments of x + s plus the M-only roundings T;
  |s_j| <= s_max (a path of <= D' nodes, ``welford_shifts``), |mu~ - mu| = |mean(s)|
  <= D' (u z + k_d (X0 + 2 s_max)) with X0 the row's range, and |M~/n - v| <= 2 sigma s_max
  + s_max^2 + g1 (sigma + s_max)^2 + g2 (sigma + s_max) lz (Cauchy-Schwarz on sum (x - mu)(s -
  s-bar) and on the Welford nodes' delta~ lambda terms; g1 = gamma_7 + gamma_2D'(1 + gamma_7)).
The bound is the larger of the families' the spec admits. The rsqrt (ulps("rsqrt"), or sqrt then div) of
v~ + eps is then within (1 - a)^(-1/2) (1 + k u) - 1 relative of r = (v + eps)^(-1/2), with
a = max |v~ - v| / (v + eps), and the realised y_j within
|g_j| r (e_mu (1 + rho) + |c_j| rho) + u_out |y_j| + eta-terms of the exact value at the same
input. (A 1-ulp row sum, the earlier model, is exceeded 238x by a sequential fp32 sum at n = 4096
and row mean 1e4.)
Drift: the Jacobian (g/sigma)(I - 11^T/n - x_hat x_hat^T/n) over the hull (mean-value theorem),
plus both kernels' errors, intersected with the value-set difference.
"""

from __future__ import annotations

import math
from typing import NamedTuple

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


WELFORD_DEPTH = 32  # the Welford family's tree depth is at most this + ceil(log2 n)


def welford_depth(n: int) -> int:
    """The depth bound D of the Welford / Chan family (module doc)."""
    return WELFORD_DEPTH + math.ceil(math.log2(max(n, 1)))


def admits_welford(spec: KernelSpec) -> bool:
    """Whether the spec's LayerNorm moments include Welford / Chan trees (``moments: any``, the
    default, or its older name ``welford``); ``sums`` is the two-pass family alone."""
    return getattr(spec, "moments", "any") != "sums"


class WelfordShifts(NamedTuple):
    """Per-row bounds of the Welford / Chan family's proof (docs/bounds.md, "LayerNorm
    moments"): every rounding of a mean is an exact shift of part of the row, x' = x + s."""

    s_max: torch.Tensor  # |s_j| <= s_max (a path of <= d nodes)
    lz: torch.Tensor  # |lambda_v| + |zeta_v| <= lz at every node
    r_l: torch.Tensor  # the shifts by the means' own roundings (ell): |s^ell_j| <= r_l
    r_d: torch.Tensor  # the shifts by delta~, c~ and their product: |s^Delta_j| <= r_d
    cs: float  # and in rms: <= cs sigma' + 3 n eta, sigma' = rms(x + s - mean) (Cauchy-Schwarz)
    d: int  # D' = min(D, n - 1), the tree height
    k_d: float  # psi_v + zeta_v <= k_d |Delta_v| (+ eta)
    k_t: int  # relative roundings of a Chan term delta~^2 c~ n_a


def welford_shifts(acc, n: int, m_x: torch.Tensor, x_rng: torch.Tensor) -> WelfordShifts:
    """The shift bounds for rows with max |x| <= ``m_x`` and max x - min x <= ``x_rng`` (per
    row, keepdim), moments accumulated in the format ``acc``."""
    u, eta = acc.u, acc.eta
    d = min(welford_depth(n), max(n - 1, 0))
    k_c = 1 if n <= 1 / u else 3  # c~ = fl(n_b / n_v): the counts are exact below 1 / u
    k_psi = (1 + u) * ((1 + u) ** (k_c + 1) - 1)  # c~ and the product, on delta~ = Delta (1 + u)
    k_d = (k_psi + u) * (1 + 1e-12)
    alpha = u * m_x + (1 + u) * k_d * x_rng + 3 * eta
    beta = u + 2 * (1 + u) * k_d
    grow = math.expm1(d * math.log1p(beta)) / beta if d > 0 else 0.0
    s_max = pad_hi(alpha * grow * (1 + 1e-9))
    lz = pad_hi((alpha + beta * s_max) * (1 + 1e-9))
    big = x_rng + 2 * s_max  # |Delta_v|: two means of the shifted row
    r_l = pad_hi(d * (u * (m_x + s_max + k_d * big) + eta) * (1 + 1e-9))
    r_d = pad_hi(d * (k_d * big + 2 * eta) * (1 + 1e-9))
    cs = k_d * math.sqrt(n * d) / (1 - u) * (1 + 1e-9)
    return WelfordShifts(s_max, lz, r_l, r_d, cs, d, k_d, 4 if k_c == 1 else 7)


def _shift_rms(w: WelfordShifts, sigma: torch.Tensor, n: int, eta: float) -> torch.Tensor:
    """rms(s - mean(s)) <= this, for rows whose exact standard deviation is <= ``sigma``."""
    r = torch.minimum(w.s_max, w.r_l + w.r_d)
    if w.cs < 1:
        r = torch.minimum(r, pad_hi((w.r_l + 3 * n * eta + w.cs * sigma) / (1 - w.cs)))
    return r


def _mean_errors(spec: KernelSpec, lo: torch.Tensor, hi: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """Bounds on |mu~ - mu| for the two families of the module doc (sums, Welford trees), and
    the sums' (k_sum, a_sum) row-sum factors."""
    from kcverify.bounds.rules.reduce import row_sum_factor

    n = lo.shape[-1]
    u, eta = spec.compute.u, spec.compute.eta
    acc = spec.accumulate
    k_sum, a_sum = row_sum_factor(spec, n)
    m_abs = mag(lo, hi)
    s_abs = m_abs.sum(-1, keepdim=True) * (1 + (n + 4) * U64)
    m_x = m_abs.amax(-1, keepdim=True)
    store = (1 + spec.ulp("reduce") * u) * (1 + spec.ulp("div") * u)
    e_sums = ((1 + k_sum) * store - 1) * s_abs / n + a_sum / n + 2 * eta
    # Welford / Chan trees: mu~ - mu = mean(s) = sum_v p_v (psi_v + ell_v) + sum_v p_b zeta_v
    x_rng = pad_hi(hi.amax(-1, keepdim=True) - lo.amin(-1, keepdim=True))
    w = welford_shifts(acc, n, m_x, x_rng)
    sigma = pad_hi(torch.sqrt(_norm_parts(lo, hi, 1.0)[2][1].clamp_min(0.0)))
    sig_x = sigma + _shift_rms(w, sigma, n, acc.eta)  # sigma' of the shifted row
    big = x_rng + 2 * w.s_max
    au = acc.u
    ell = w.d * (au * (s_abs / n + w.s_max + w.k_d * big) + acc.eta)
    share_b = torch.minimum(w.d * big, math.sqrt(n * w.d) / (1 - au) * sig_x + n * acc.eta)
    e_tree = pad_hi((ell + w.k_d * share_b + 2 * w.d * acc.eta) * (1 + 1e-9))
    # the root's mean stored in the compute format (ulps "reduce" and "div", as a row sum's is)
    e_tree = e_tree + (store - 1) * (m_x + e_tree) * 1.01 + 2 * eta
    return e_sums, e_tree, k_sum, a_sum


def _var_rel(spec: KernelSpec, lo: torch.Tensor, hi: torch.Tensor, v_lo: torch.Tensor, eps: float,
             e_sums: torch.Tensor, e_tree: torch.Tensor, k_sum: float, a_sum: float,
             welford: bool = True) -> torch.Tensor:
    """a >= |v~ - v| / (v + eps) for every v >= v_lo, over the families the spec admits (module
    doc): two-pass sums, and with ``welford`` also Welford / Chan trees."""
    n = lo.shape[-1]
    u, eta = spec.compute.u, spec.compute.eta
    acc = spec.accumulate
    den = v_lo + eps
    store = (1 + spec.ulp("reduce") * u) * (1 + spec.ulp("div") * max(u, acc.u))
    # sums: v~ = (v + e^2)(1 + theta), |theta| <= rho_2
    rho_2 = (1 + spec.ulp("add") * u) ** 2 * (1 + spec.ulp("mul") * u) * (1 + k_sum) * store - 1
    abs_2 = (n * eta + a_sum) / n * (1 + rho_2) + 2 * eta
    a_2 = rho_2 + ((1 + rho_2) * e_sums ** 2 + abs_2) / den
    if not welford:
        return pad_hi(a_2, 1e-6)
    # Welford / Chan trees: M~ = M(x + s) + T (docs/bounds.md, "LayerNorm moments")
    m_x = mag(lo, hi).amax(-1, keepdim=True)
    x_rng = pad_hi(hi.amax(-1, keepdim=True) - lo.amin(-1, keepdim=True))
    w = welford_shifts(acc, n, m_x, x_rng)

    def gam(k: int) -> float:
        return math.expm1(k * math.log1p(acc.u)) * (1 + 1e-9)

    g1 = gam(w.k_t) + gam(2 * w.d) * (1 + gam(w.k_t))
    g2 = (1 + gam(2)) * (1 + gam(2 * w.d)) * math.sqrt(2.0)
    h = torch.where(v_lo >= eps, torch.sqrt(v_lo.clamp_min(0.0)) / den,
                    torch.full_like(v_lo, 0.5 / math.sqrt(eps) if eps > 0 else math.inf))
    # (2 sigma R + R^2) / (v + eps), R = rms(s - mean s): by the paths, or by Cauchy-Schwarz
    r_p = torch.minimum(w.s_max, w.r_l + w.r_d)
    core = 2 * h * r_p + r_p ** 2 / den
    if w.cs < 1:
        rho = w.r_l + 3 * n * acc.eta
        c2 = (2 * (h * rho + w.cs) / (1 - w.cs)
              + (rho / torch.sqrt(den) + w.cs) ** 2 / (1 - w.cs) ** 2)
        core = torch.minimum(core, pad_hi(c2 * (1 + 1e-9)))
    a_w = core + g1 * (1 + core) + g2 * (h + r_p / den) * w.lz
    a_w = (store * (1 + 1e-9)) * a_w + (store - 1) + (8 * acc.eta + 2 * eta) / den
    return pad_hi(torch.maximum(a_2, a_w), 1e-6)


def ln_error_parts(spec: KernelSpec, lo: torch.Tensor, hi: torch.Tensor, v_lo: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Per row: (E, rho_r, ok, alpha) with |mu~ - mu| <= E, |r~ / r - 1| <= rho_r (where ok),
    and alpha the relative rounding of the centring and the two products (module doc). The
    Welford / Chan family counts unless the spec says ``moments: sums``."""
    u = spec.compute.u
    e_sums, e_tree, k_sum, a_sum = _mean_errors(spec, lo, hi)
    welford = admits_welford(spec)
    e_mu = torch.maximum(e_sums, e_tree) if welford else e_sums
    a = _var_rel(spec, lo, hi, v_lo, eps, e_sums, e_tree, k_sum, a_sum, welford)
    # eps stored in the compute format, and the addition's absolute (subnormal) error
    a = a + pad_hi((eps - eps_stored(spec, eps) + 2 * spec.compute.eta) / (v_lo + eps), 1e-6)
    # rsqrt of fl(v~ + eps): rsqrt, or sqrt then a division (ulps; products of the two are
    # second order, covered by the 0.01), and the addition's rounding halved by the root
    k_r = max(spec.ulp("rsqrt"), spec.ulp("sqrt") + spec.ulp("div")) + 0.5 * spec.ulp("add") + 0.01
    ok = a < 0.5
    a_safe = torch.where(ok, a, torch.zeros_like(a))
    rho_r = (1 - a_safe) ** -0.5 * (1 + k_r * u) * (1 + 1e-9) - 1
    alpha = (1 + spec.ulp("add") * u) * (1 + spec.ulp("mul") * u) ** 2 - 1
    return e_mu, rho_r, ok, alpha


def eps_stored(spec: KernelSpec, eps: float) -> float:
    """A lower bound on eps as a program adds it: stored in the compute format (BERT's 1e-12 is
    0 in fp16), so eps - (u eps + eta), or 0."""
    c = spec.compute
    return max(eps - c.u * eps - c.eta, 0.0) * (1 - 1e-12)


def ln_r_max(spec: KernelSpec, eps: float) -> float:
    """r~ <= eps~^-1/2 (1 + k u) whatever the moments: v~ >= 0 in both families; eps~ the stored
    eps (``eps_stored``: inf where it may be 0)."""
    k_r = max(spec.ulp("rsqrt"), spec.ulp("sqrt") + spec.ulp("div")) + 0.5 * spec.ulp("add") + 0.01
    e = eps_stored(spec, eps)
    return (1.0 / math.sqrt(e) if e > 0 else math.inf) * (1 + k_r * spec.compute.u) * (1 + 1e-9)


def ln_overflow(spec: KernelSpec, lo: torch.Tensor, hi: torch.Tensor, sq_hi: torch.Tensor,
                eps: float, r_hi: torch.Tensor, e_mu: torch.Tensor, ok: torch.Tensor,
                rho_r: torch.Tensor) -> torch.Tensor:
    """Rows (keepdim) where a conforming program's LayerNorm may overflow, so that its output
    has no bound: a partial sum of the row (reduce.partial_overflow) or the stored row sum beyond
    the accumulator's or compute format's range; the sum of squares sum (x - mu~)^2 <=
    (sqrt(sum c^2) + sqrt(n) E)^2 (Minkowski), times its rounding (both families), beyond them
    (fp16: n sigma^2 > 65504 is inf, then r = 0 and y = b); or r~ beyond the compute format's
    range (fp16: eps = 1e-12 on a constant row, r~ = 1e6 = inf, then 0 * inf = NaN)."""
    from kcverify.bounds.rules.reduce import partial_overflow, row_sum_factor

    n = lo.shape[-1]
    lim = min(spec.accumulate.max_finite, spec.compute.max_finite)
    k, _ = row_sum_factor(spec, n)
    grow = (1 + k) * (1 + (2 * welford_depth(n) + 8) * spec.accumulate.u) * 1.01
    pos = hi.clamp_min(0.0).sum(-1, keepdim=True)
    neg = (-lo).clamp_min(0.0).sum(-1, keepdim=True)
    over = partial_overflow(spec, n, pos, neg) | (torch.maximum(pos, neg) * grow > lim)
    m2 = (torch.sqrt(sq_hi) + math.sqrt(n) * e_mu) ** 2 * grow
    over = over | (m2 > lim) | (m2 / n > spec.compute.max_finite)
    r_max = torch.where(ok, r_hi * (1 + rho_r) * (1 + 1e-6),
                        torch.full_like(r_hi, ln_r_max(spec, eps)))
    return over | ~(r_max * (1 + 2 * spec.compute.u) <= spec.compute.max_finite)


def _realized_err(spec: KernelSpec, lo, hi, c, r, v, eps, g_mag, y_mag) -> torch.Tensor:
    """|y_realized - layernorm(x)| bound for x in [lo, hi] (module doc): the moments' errors,
    the rsqrt's, and the roundings of the centring, the scalings and the bias."""
    u, eta = spec.compute.u, spec.compute.eta
    e_mu, rho_r, ok, alpha = ln_error_parts(spec, lo, hi, v[0], eps)
    k_add = spec.ulp("add")
    rho = (1 + alpha) * (1 + rho_r) - 1
    c_mag = mag(*c)
    err = g_mag * r[1] * (e_mu * (1 + rho) + c_mag * rho) * (1 + 1e-6)
    # the moments may be off by anything the families allow: r~ <= eps^-1/2 (1 + k u) and
    # |x - mu~| <= |c| + e_mu still hold
    wide = g_mag * ((c_mag + e_mu) * ln_r_max(spec, eps) * (1 + alpha) + c_mag * r[1]) * (1 + 1e-6)
    err = torch.where(ok, err, wide)
    err = err + (1.01 * k_add * u) * y_mag + (1.01 * k_add * u) * err + 4 * eta
    return pad_hi(err, 1e-6)


def layernorm_box(ctx: RuleCtx, x: Box, g: Box | None, b: Box | None, eps: float) -> Box:
    parts, exact, errs, xhs = [], [], [], []
    n = x.shape[-1]
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
        e_mu, rho_r, ok, _ = ln_error_parts(spec, lo, hi, v[0], eps)
        over = ln_overflow(spec, lo, hi, v[1] * n, eps, r[1], e_mu, ok, rho_r)
        y_lo2, y_hi2 = y_lo - err, y_hi + err
        over = over | (y_lo2 < -spec.compute.max_finite) | (y_hi2 > spec.compute.max_finite)
        if bool(over.any()):  # a moment, r~ or y may be +-inf (then NaN): no bound
            over = over.expand(err.shape)
            err = torch.where(over, math.inf, err)
            y_lo2 = torch.where(over, -math.inf, y_lo2)
            y_hi2 = torch.where(over, math.inf, y_hi2)
        exact.append((y_lo, y_hi))
        errs.append(err)
        parts += [y_lo2, y_hi2]
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


# stash_type (the precision of the mean and variance in ONNX's function body) is not the
# kernels' arithmetic: each kernel's moments and compute format (its spec) are what the rule bounds
LN_ATTRS = ("axis", "epsilon", "stash_type")


@bound_rule("LayerNormalization", domain=Interval, attrs=LN_ATTRS)
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
