"""Activations: ReLU (ReluDiff's stable/unstable split), LeakyReLU, GELU (erf and tanh forms).

ReLU: both kernels' hull >= 0 -> drift passes through; <= 0 -> drift 0; otherwise relu is
monotone and 1-Lipschitz, so the drift lies in [min(0, dl), max(0, dh)]; always intersected with
the value-set difference. ReLU selects a representable value: no rounding.

GELU f(x) = x Phi(x) (or its tanh approximation) is quasi-convex with one minimum at x* ~ -0.752,
so f([lo, hi]) = [f(x*) if x* may lie inside else min f(ends), max f(ends)]; f' has its extremes
at ~ +-sqrt(2) and is monotone between them, which bounds f' over the hull for the mean-value
drift rule. A conforming program may evaluate GELU fused (one rounding of k ulps) or through its
decomposition (x/sqrt2, erf, 1+, x*, 0.5*); the error bound E(x) below covers both:
erf form E = (0.5 (5 + k)|x| + 1.1|f|) u + (|x| + 2) eta, tanh form with 7 + k (the inner cubic
adds ~2.3 u through tanh' * |w| <= 0.45 * 5u).
"""

from __future__ import annotations

import math

import torch

from kcverify.bounds.box import U64, Box, imul, mag, meet_hi, meet_lo, pad_hi, pad_lo
from kcverify.bounds.registry import Interval, RuleCtx, bound_rule

# located extremes (mpmath, 50 digits; each constant within 1e-16 of the true value): the
# minimum of f at X_STAR, the extremes of f' at -+D_AT (sqrt 2 for the erf form)
X_STAR = {"none": -0.7517915246935645, "tanh": -0.7524614220710163}
F_MIN = {"none": -0.16997120747990366, "tanh": -0.17004075057125405}
D_AT = {"none": 1.4142135623730951, "tanh": 1.4185040087908284}
D_MIN = {"none": -0.12890414518515479, "tanh": -0.12899306865877176}
D_MAX = {"none": 1.1289041451851548, "tanh": 1.1289930686587718}
WINDOW = 1e-12  # > the constants' error: an interval this close to an extreme may hold it
C_TANH = math.sqrt(2 / math.pi)
# float64 evaluation error of gelu_f / gelu_df, relative to the magnitudes involved: with erf,
# tanh, exp within k ulps (2ku) of the true value, |fl(f) - f| <= (k + 1.5) U |x| + U |f| for the
# erf form (1 + erf cancels for negative x, so the error scales with |x|, not |f|) and
# (k + 2.6) U |x| + U |f| for the tanh form; |fl(f') - f'| <= (k + 1.5) U + ... for the erf form
# and grows like |x|^3 U for the tanh form (1 - t^2 cancels). EVAL_PAD = 16 U covers k <= 8.
EVAL_PAD = 16 * U64


def _relu_d(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    one, zero = torch.ones_like(lo), torch.zeros_like(lo)
    return torch.where(lo >= 0, one, zero), torch.where(hi <= 0, zero, one)


@bound_rule("Relu", domain=Interval)
def relu(ctx: RuleCtx, a) -> Box:
    """max(x, 0)."""
    return ctx.elementwise(ctx.lift(a), lambda lo, hi: (lo.clamp_min(0), hi.clamp_min(0)),
                           _relu_d, None)


@bound_rule("LeakyRelu", domain=Interval, attrs=("alpha",))
def leaky_relu(ctx: RuleCtx, a) -> Box:
    alpha = float(ctx.attr("alpha", 0.01))
    lo_s, hi_s = min(alpha, 1.0), max(alpha, 1.0)

    def f(lo, hi):
        # the image of [lo, hi]: f is monotone only for alpha >= 0; for alpha < 0 it falls on
        # x < 0, so the image is the hull of f(lo), f(hi) and f(0) = 0 where lo < 0 < hi
        f_lo, f_hi = torch.where(lo >= 0, lo, lo * alpha), torch.where(hi >= 0, hi, hi * alpha)
        if alpha >= 0:
            return f_lo, f_hi
        a, b = torch.minimum(f_lo, f_hi), torch.maximum(f_lo, f_hi)
        cross = (lo < 0) & (hi > 0)
        return torch.where(cross, a.clamp_max(0.0), a), torch.where(cross, b.clamp_min(0.0), b)

    def d(lo, hi):
        a_ = torch.full_like(lo, alpha)
        one = torch.ones_like(lo)
        g_lo = torch.where(lo >= 0, one, torch.where(hi <= 0, a_, torch.full_like(lo, lo_s)))
        g_hi = torch.where(lo >= 0, one, torch.where(hi <= 0, a_, torch.full_like(lo, hi_s)))
        return g_lo, g_hi
    return ctx.elementwise(ctx.lift(a), f, d, "mul")


def gelu_f(x: torch.Tensor, form: str) -> torch.Tensor:
    if form == "tanh":
        return 0.5 * x * (1 + torch.tanh(C_TANH * (x + 0.044715 * x ** 3)))
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def gelu_df(x: torch.Tensor, form: str) -> torch.Tensor:
    if form == "tanh":
        t = torch.tanh(C_TANH * (x + 0.044715 * x ** 3))
        return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * C_TANH * (1 + 3 * 0.044715 * x * x)
    return 0.5 * (1 + torch.erf(x / math.sqrt(2))) + x * torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def gelu_range(lo: torch.Tensor, hi: torch.Tensor, form: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Enclosure of f([lo, hi]) (quasi-convex f), padded by the float64 evaluation error."""
    f_lo, f_hi = gelu_f(lo, form), gelu_f(hi, form)
    xs = X_STAR[form]
    left = hi <= xs - WINDOW
    right = lo >= xs + WINDOW
    low = torch.where(left, f_hi, torch.where(right, f_lo, F_MIN[form]))
    high = torch.maximum(f_lo, f_hi)
    x_mag = mag(lo, hi)
    low = low - EVAL_PAD * (x_mag + low.abs())
    high = high + EVAL_PAD * (x_mag + high.abs())
    return pad_lo(low) - 1e-300, pad_hi(high) + 1e-300


def gelu_drange(lo: torch.Tensor, hi: torch.Tensor, form: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Enclosure of f'([lo, hi]): f' is monotone between its extremes at -+D_AT; padded by the
    float64 evaluation error (see EVAL_PAD)."""
    d_lo, d_hi = gelu_df(lo, form), gelu_df(hi, form)
    g_lo, g_hi = torch.minimum(d_lo, d_hi), torch.maximum(d_lo, d_hi)
    at = D_AT[form]
    has_max = (lo <= at + WINDOW) & (hi >= at - WINDOW)
    has_min = (lo <= -at + WINDOW) & (hi >= -at - WINDOW)
    g_hi = torch.where(has_max, D_MAX[form], g_hi)
    g_lo = torch.where(has_min, D_MIN[form], g_lo)
    scale = 1.0 + mag(lo, hi) * (1 + 0.134 * mag(lo, hi) ** 2) if form == "tanh" else 1.0
    g_lo = g_lo - EVAL_PAD * (scale + g_lo.abs())
    g_hi = g_hi + EVAL_PAD * (scale + g_hi.abs())
    return pad_lo(g_lo), pad_hi(g_hi)


def gelu_error(spec, lo: torch.Tensor, hi: torch.Tensor, f_lo: torch.Tensor, f_hi: torch.Tensor,
               form: str) -> torch.Tensor:
    """|realized - exact| for x in [lo, hi], f(x) in [f_lo, f_hi] (module doc: fused or
    decomposed GELU)."""
    prim = "tanh" if form == "tanh" else "erf"
    u, eta = spec.compute.u, spec.compute.eta
    k = spec.ulp(prim)
    c = (7 + k) if form == "tanh" else (5 + k)
    # the inner tanh's or erf's absolute error (KernelSpec.abs_err; a fused kernel's own erf,
    # "gelu_erf": torch's vectorised Gelu) reaches f through 0.5 x
    a = 0.5 * spec.abs_err("tanh" if form == "tanh" else "gelu_erf") * mag(lo, hi)
    return pad_hi((0.5 * c * mag(lo, hi) + 1.1 * mag(f_lo, f_hi)) * u + (mag(lo, hi) + 2) * eta
                  + a, 1e-6)


def gelu_box(ctx: RuleCtx, x: Box, form: str) -> Box:
    outs = []
    errs = []
    for spec, lo, hi in ((ctx.train, x.tl, x.th), (ctx.inf, x.il, x.ih)):
        f_lo, f_hi = gelu_range(lo, hi, form)
        err = gelu_error(spec, lo, hi, f_lo, f_hi, form)
        outs += [f_lo - err, f_hi + err]
        errs.append(err)
        ft = (f_lo, f_hi) if spec is ctx.train else None
        if ft is not None:
            ft_range = ft
    fi_range = (outs[2] + errs[1], outs[3] - errs[1])
    h_lo, h_hi = x.hull()
    g_lo, g_hi = gelu_drange(h_lo, h_hi, form)
    dl, dh = imul(g_lo, g_hi, x.dl, x.dh)
    dl = meet_lo(dl, fi_range[0] - ft_range[1]) - errs[0] - errs[1]
    dh = meet_hi(dh, fi_range[1] - ft_range[0]) + errs[0] + errs[1]
    return Box.make(outs[0], outs[1], outs[2], outs[3], dl, dh)


@bound_rule("Gelu", domain=Interval, attrs={"approximate": ("none", "tanh")})
def gelu(ctx: RuleCtx, a) -> Box:
    """Gelu (opset 20): approximate = none | tanh."""
    form = str(ctx.attr("approximate", "none"))
    return gelu_box(ctx, ctx.lift(a), "tanh" if form == "tanh" else "none")


def _softplus64(x: torch.Tensor) -> torch.Tensor:
    """log(1 + e^x) in float64 without overflow: max(x, 0) + log1p(e^-|x|) (error a few U)."""
    return x.clamp_min(0.0) + torch.log1p(torch.exp(-x.abs()))


@bound_rule("Softplus", domain=Interval)
def softplus(ctx: RuleCtx, a) -> Box:
    """log(1 + e^x), monotone with f' = sigmoid(x) in (0, 1).

    A conforming program may evaluate it fused (torch returns x above its threshold 20,
    onnxruntime x + log1p(e^-x)) or as its ONNX body Log(Exp(x) + 1). The body's exp may
    overflow to inf (x above log(max_finite) of the compute format: 88.7 in fp32, 11.1 in fp16),
    and then the program returns inf, while a fused kernel returns about x: each kernel's value
    set holds both (its upper end inf there). Bounding Softplus through the body alone made the
    value set [inf, inf] for x > 709.78, where float64's exp overflows too, and excluded the
    fused result (finding F7 of session 9: 0.76 against a certified 0.0078).

    Error of one evaluation, either way: the body's exp (k_exp u relative) and + 1 (k_add u) move
    log(1 + e^x) by at most (k_exp + k_add) u absolutely (d log(1 + y) = dy / (1 + y) and
    y / (1 + y) < 1), its log adds k_log u |f|; a fused kernel's k ulps are inside that, and
    torch's threshold (x for x > 20) is off by log1p(e^-20) < 2.1e-9, inside 1 u absolute of fp32.
    e(v) = (k_exp + k_add + 1) u + (k_log + 1) u |v| + 2 eta, in both kernels."""
    x = ctx.lift(a)
    parts = []
    errs = []
    for spec, lo, hi in ((ctx.train, x.tl, x.th), (ctx.inf, x.il, x.ih)):
        u, eta = spec.compute.u, spec.compute.eta
        f_lo = pad_lo(_softplus64(lo), 8 * U64)
        f_hi = pad_hi(_softplus64(hi), 8 * U64)
        e_abs = (spec.ulp("exp") + spec.ulp("add") + 1) * u + 2 * eta
        e_rel = (spec.ulp("log") + 1) * u
        err = pad_hi(e_abs + e_rel * mag(f_lo, f_hi), 1e-6)
        v_lo, v_hi = pad_lo(f_lo - err), pad_hi(f_hi + err)
        # the body's exp may overflow (its rounding included): that program returns inf
        # (e^x (1 + k_exp u) past max_finite needs x > log(max_finite) - log(1 + k_exp u))
        over = hi > math.log(spec.compute.max_finite) - (spec.ulp("exp") + 1) * u - 1e-9
        v_hi = torch.where(over, math.inf, v_hi)
        err = torch.where(over, math.inf, err)
        parts += [v_lo, v_hi]
        errs.append(err)
    h_lo, h_hi = x.hull()
    g_lo = pad_lo(torch.sigmoid(h_lo), 8 * U64).clamp_min(0.0)
    g_hi = pad_hi(torch.sigmoid(h_hi), 8 * U64).clamp_max(1.0)
    dl, dh = imul(g_lo, g_hi, x.dl, x.dh)
    dl = dl - errs[0] - errs[1]
    dh = dh + errs[0] + errs[1]
    return Box.make(*parts, pad_lo(dl), pad_hi(dh))
