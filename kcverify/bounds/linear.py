"""The differential linear (symbolic-interval) domain, for regions around points.

Per sample, the region's input deviations are variables z in [-1, 1]^m (m = number of region
input elements; x = center + eps z for an L-inf box). Every tensor carries, per kernel k,
an affine form plus an interval error term, and the drift carries its own form over the *same*
variables (NeuroDiff's differential symbolic intervals):

    x_k   = A_k z + b_k + [el_k, eh_k]            (A_k: (batch, *shape, m))
    x_i - x_t = D z + d + [fl, fh]

so the shared dependence on the input cancels in the drift instead of being bounded twice, which
is where the interval domain loses on regions. Rules (``@rule(op, domain=SYMBOLIC)``):

* Gemm / MatMul with constant weights: y_k = Q_k(W) (x_k + c_k) + acc_k + rnd_k with c_k the
  activation cast error (relative model u|x| + eta s over the concretized value set: exact-cast
  images do not help on wide sets) and acc/rnd the gamma_n and rounding terms, all in the error
  interval; drift D_y = Q_i(W) D + (Q_i(W) - Q_t(W)) A_t, with the matching d and interval terms.
* Add / Sub (forms add), Mul / Div by a constant, data movement that keeps the batch axis.
* Relu: a stable neuron keeps its form (or becomes 0); an unstable one is concretized into the
  error interval (ReluVal); the drift of a neuron that is not active in both kernels is
  concretized to [min(0, dl), max(0, dh)] intersected with the value-set difference.

Every concretization is intersected with the interval domain's box for the same tensor
(``domain="best"``: the reduced product), and the box is what the engine stores. Ops without a
linear rule end the symbolic part: their box becomes a constant form (A = 0) with an interval
term, which is sound for every op the interval domain bounds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kcverify.bounds.box import U64, Box, Concrete, imatmul, mag, pad_hi, pad_lo
from kcverify.bounds.registry import EXECUTOR, SYMBOLIC, RuleCtx, RulesOf, linear_rule, rule

# this domain's rules in the one table (registry.RULES[(op, "symbolic")]); ``linear_rule`` is
# registry.rule(..., domain=SYMBOLIC)
LINEAR_RULES = RulesOf(SYMBOLIC.name)
__all__ = ["LINEAR_RULES", "Form", "LinState", "from_box", "linear_rule", "tighten"]


@dataclass
class Form:
    """A (batch, *shape, m) coefficient tensor, a (batch, *shape) constant, an interval term."""

    A: torch.Tensor
    b: torch.Tensor
    el: torch.Tensor
    eh: torch.Tensor

    def bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Concretization over z in [-1, 1]^m, rounded outward."""
        r = self.A.abs().sum(-1)
        r = r * (1 + (self.A.shape[-1] + 2) * U64)
        return pad_lo(self.b - r + self.el), pad_hi(self.b + r + self.eh)


@dataclass
class LinState:
    t: Form
    i: Form
    d: Form


def const_form(lo: torch.Tensor, hi: torch.Tensor, m: int) -> Form:
    shape = torch.broadcast_shapes(lo.shape, hi.shape)
    z = torch.zeros(*shape, m, dtype=lo.dtype, device=lo.device)
    mid = 0.5 * lo + 0.5 * hi
    return Form(z, mid, pad_lo(lo - mid), pad_hi(hi - mid))


def from_box(b: Box, m: int) -> LinState:
    return LinState(const_form(b.tl, b.th, m), const_form(b.il, b.ih, m), const_form(b.dl, b.dh, m))


def tighten(box: Box, st: LinState) -> Box:
    """The reduced product: the box intersected with the three concretized forms, only where
    the box's value sets are finite. A form is an affine map plus rounding terms; it has no
    overflow (a saturating or overflowing cast, an fp16 sum beyond 65504: the interval rule's
    value set is then infinite), so where a kernel's value may be infinite the box stands for
    that kernel's value and for the drift (finding 12: a static scale whose quotient may
    overflow on a region, certified as the unsaturated product)."""
    tl, th = st.t.bounds()
    il, ih = st.i.bounds()
    dl, dh = st.d.bounds()
    fin_t = torch.isfinite(box.tl) & torch.isfinite(box.th)
    fin_i = torch.isfinite(box.il) & torch.isfinite(box.ih)
    fin_d = fin_t & fin_i
    # fmax / fmin: a NaN in a form (inf - inf in a constant term) is no information
    out = Box(*(torch.where(f, op(b, v), b) for f, op, b, v in (
        (fin_t, torch.fmax, box.tl, tl), (fin_t, torch.fmin, box.th, th),
        (fin_i, torch.fmax, box.il, il), (fin_i, torch.fmin, box.ih, ih),
        (fin_d, torch.fmax, box.dl, dl), (fin_d, torch.fmin, box.dh, dh))))
    bad = (out.tl > out.th) | (out.il > out.ih) | (out.dl > out.dh)
    if bool(bad.any()):  # rounding-level disagreement of two sound enclosures: keep the box
        out = Box(*(torch.where(bad, a, b) for a, b in zip(box.parts(), out.parts())))
    return out


# --- affine helpers ---------------------------------------------------------------------
def _add(f: Form, g: Form, sign: float = 1.0) -> Form:
    if sign > 0:
        return Form(f.A + g.A, f.b + g.b, f.el + g.el - _err(f.b, g.b), f.eh + g.eh + _err(f.b, g.b))
    return Form(f.A - g.A, f.b - g.b, f.el - g.eh - _err(f.b, g.b), f.eh - g.el + _err(f.b, g.b))


def _err(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Float64 rounding of the constant term of a sum."""
    return 2 * U64 * (a.abs() + b.abs()) + 2.0**-1000


def _scale(f: Form, c: torch.Tensor) -> Form:
    """c * f for a constant tensor c (broadcast)."""
    lo, hi = f.el * c, f.eh * c
    b = f.b * c
    e = 2 * U64 * b.abs()
    return Form(f.A * c.unsqueeze(-1), b, torch.minimum(lo, hi) - e, torch.maximum(lo, hi) + e)


def _widen(f: Form, lo: torch.Tensor, hi: torch.Tensor) -> Form:
    return Form(f.A, f.b, f.el + lo, f.eh + hi)


def _matmul_form(f: Form, W: torch.Tensor) -> Form:
    """f @ W for a constant matrix W (K, N): coefficients, constant and interval term."""
    A = torch.einsum("...km,kn->...nm", f.A, W)
    b = f.b @ W
    el, eh, _ = imatmul(f.el, f.eh, W, W)
    n = W.shape[0]
    magn = (f.A.abs().sum(-1) + f.b.abs()) @ W.abs()
    e = (n + 4) * U64 * magn * 1.01
    return Form(A, b, el - e, eh + e)


# --- rules: fn(ctx, ins: list[(orig, Box | None, LinState | None)], out: Box, m) -> LinState ----
@rule("Identity", "Dropout", domain=SYMBOLIC, attrs=EXECUTOR)
def _identity(ctx: RuleCtx, ins: list, out: Box, m: int) -> LinState | None:
    return ins[0][2]


@rule("Cast", domain=SYMBOLIC, attrs=("to", "saturate"))
def _cast(ctx: RuleCtx, ins: list, out: Box, m: int) -> LinState | None:
    """The identity where the cast is exact in both kernels; otherwise no symbolic state (a
    rounding cast: the interval rule's box stands)."""
    from kcverify.bounds.rules.shape import cast_is_exact, cast_target

    target = cast_target(ctx)
    exact = cast_is_exact(ctx.train, target) and cast_is_exact(ctx.inf, target)
    return ins[0][2] if exact else None


@rule("Flatten", "Reshape", domain=SYMBOLIC, attrs=EXECUTOR)
def _reshape(ctx: RuleCtx, ins: list, out: Box, m: int) -> LinState | None:
    st = ins[0][2]
    if st is None or out.tl.dim() == 0 or out.tl.shape[0] != st.t.b.shape[0]:
        return None
    shape = tuple(out.tl.shape)

    def rs(f: Form) -> Form:
        return Form(f.A.reshape(*shape, m), f.b.reshape(shape), f.el.reshape(shape), f.eh.reshape(shape))
    return LinState(rs(st.t), rs(st.i), rs(st.d))


def _as_state(x: tuple, m: int) -> LinState | None:
    orig, box, st = x
    if st is not None:
        return st
    if box is not None:
        return from_box(box, m)
    return None


@rule("Add", "Sub", domain=SYMBOLIC)
def _addsub(ctx: RuleCtx, ins: list, out: Box, m: int) -> LinState | None:
    a, b = _as_state(ins[0], m), _as_state(ins[1], m)
    if a is None or b is None:
        return None
    sign = 1.0 if ctx.node.op_type == "Add" else -1.0
    res = []
    for fa, fb, spec, lo, hi in ((a.t, b.t, ctx.train, out.tl, out.th), (a.i, b.i, ctx.inf, out.il, out.ih)):
        f = _add(*_bcast_pair(fa, fb), sign)
        _, _, r = ctx.round(spec, "add", lo, hi)
        res.append(_widen(f, -r, r))
    d = _add(*_bcast_pair(a.d, b.d), sign)
    rt, ri = res[0].eh - _add(*_bcast_pair(a.t, b.t), sign).eh, res[1].eh - _add(*_bcast_pair(a.i, b.i), sign).eh
    d = _widen(d, -(rt + ri), rt + ri)
    return LinState(res[0], res[1], d)


def _bcast_pair(f: Form, g: Form) -> tuple[Form, Form]:
    shape = torch.broadcast_shapes(f.b.shape, g.b.shape)
    m = f.A.shape[-1]

    def ex(h: Form) -> Form:
        return Form(h.A.expand(*shape, m), h.b.expand(shape), h.el.expand(shape), h.eh.expand(shape))
    return ex(f), ex(g)


@rule("Mul", "Div", domain=SYMBOLIC)
def _mul_const(ctx: RuleCtx, ins: list, out: Box, m: int) -> LinState | None:
    """Multiplication (division) by a constant only; otherwise no form."""
    (ao, _, a_st), (bo, _, b_st) = ins[0], ins[1]
    if isinstance(bo, Concrete) and a_st is not None:
        st, c = a_st, bo
    elif isinstance(ao, Concrete) and b_st is not None and ctx.node.op_type == "Mul":
        st, c = b_st, ao
    else:
        return None
    cb = ctx.lift(c)
    if not bool(((cb.tl == cb.th) & (cb.il == cb.ih) & (cb.tl == cb.il)).all()):
        return None  # the constant is stored differently by the two kernels
    cv = cb.tl
    if ctx.node.op_type == "Div":
        if bool((cv == 0).any()):
            return None
        cv = 1.0 / cv  # not exact: widen below
    res = []
    for f, spec, lo, hi in ((st.t, ctx.train, out.tl, out.th), (st.i, ctx.inf, out.il, out.ih)):
        g = _scale(f, cv)
        _, _, r = ctx.round(spec, "div" if ctx.node.op_type == "Div" else "mul", lo, hi)
        if ctx.node.op_type == "Div":
            r = r + 4 * U64 * mag(lo, hi)
        res.append(_widen(g, -r, r))
    d = _scale(st.d, cv)
    rt = res[0].eh - _scale(st.t, cv).eh
    ri = res[1].eh - _scale(st.i, cv).eh
    return LinState(res[0], res[1], _widen(d, -(rt + ri), rt + ri))


@rule("Gemm", domain=SYMBOLIC, attrs=("transA", "transB", "alpha", "beta"))
@rule("MatMul", domain=SYMBOLIC)
def _gemm(ctx: RuleCtx, ins: list, out: Box, m: int, max_rank: int = 2) -> LinState | None:
    """y_k = (x_k + c_k) Q_k(W) + acc_k + rnd_k [+ bias]; the drift's form per the module doc.
    ``max_rank``: the largest rank of x accepted (3: rows of a batch, as Conv's columns)."""
    from kcverify.bounds.rules.linear import (
        _operand,
        accumulation_error,
        operand_scales,
        rescale_error,
    )

    node = ctx.node
    if node.op_type == "Gemm" and (int(ctx.attr("transA", 0)) or float(ctx.attr("alpha", 1.0)) != 1.0
                                   or float(ctx.attr("beta", 1.0)) != 1.0):
        return None
    (xo, xb, _), (wo, _, _) = ins[0], ins[1]
    xs = _as_state(ins[0], m)
    if xs is None or not isinstance(wo, Concrete) or node.inputs[1] not in ctx.constants \
            or wo.value.dim() != 2 or xb is None or not 2 <= xb.tl.dim() <= max_rank:
        return None
    w = wo
    if node.op_type == "Gemm" and int(ctx.attr("transB", 0)):
        w = Concrete(wo.value.transpose(0, 1), wo.rounds)
    n = w.value.shape[0]
    forms, qws, errs, casts = [], [], [], []
    for f, spec, lo, hi in ((xs.t, ctx.train, xb.tl, xb.th), (xs.i, ctx.inf, xb.il, xb.ih)):
        wl = ctx.lift(w)
        wlo, whi = (wl.tl, wl.th) if spec is ctx.train else (wl.il, wl.ih)
        q_lo, q_hi, _, _ = _operand(ctx, spec, w, wlo, whi, True, "right", -1, -2)
        if not bool((q_lo == q_hi).all()):
            return None
        Q = q_lo
        _, _, c_lo, c_hi = _operand(ctx, spec, xo, lo, hi, False, "left", -2, -1)
        g = _widen(f, c_lo, c_hi)  # x + c
        y = _matmul_form(g, Q)
        magn = mag(lo + torch.minimum(c_lo, torch.zeros_like(c_lo)),
                   hi + torch.maximum(c_hi, torch.zeros_like(c_hi))) @ Q.abs()
        sx = operand_scales(ctx, spec, xo, lo, hi, False, "left", -2, -1)
        sw = operand_scales(ctx, spec, w, wlo, whi, True, "right", -1, -2)
        acc = accumulation_error(spec, n, magn, sx[0] * sw[0], sx[1] * sw[1])
        acc = acc + rescale_error(spec, n, magn, sx[0] * sw[0], sx[1], sw[1])
        p_lo, p_hi = y.bounds()  # the product before any bias: what is rounded
        _, _, rnd = ctx.round(spec, "mul", p_lo - acc, p_hi + acc, steps=2)
        e = pad_hi(acc + rnd)
        forms.append(_widen(y, -e, e))
        qws.append(Q)
        errs.append((c_lo, c_hi, e))
        casts.append(g)
    Qt, Qi = qws
    # drift: (x_i + c_i) Q_i - (x_t + c_t) Q_t = (d + c_i - c_t) Q_i + (x_t + c_t)(Q_i - Q_t)
    dd = _widen(xs.d, errs[1][0] - errs[0][1], errs[1][1] - errs[0][0])
    xt_c = _widen(xs.t, errs[0][0], errs[0][1])
    D = _add(_matmul_form(dd, Qi), _matmul_form(xt_c, Qi - Qt))
    # or directly cast_i(x_i) Q_i - cast_t(x_t) Q_t over the shared variables: per element, the
    # form with the narrower concretization (each is a sound form of the same drift)
    D2 = _add(_matmul_form(casts[1], Qi), _matmul_form(casts[0], Qt), -1.0)
    lo1, hi1 = D.bounds()
    lo2, hi2 = D2.bounds()
    pick = (hi2 - lo2) < (hi1 - lo1)
    if bool(pick.any()):
        D = Form(torch.where(pick.unsqueeze(-1), D2.A, D.A), torch.where(pick, D2.b, D.b),
                 torch.where(pick, D2.el, D.el), torch.where(pick, D2.eh, D.eh))
    D = _widen(D, -(errs[0][2] + errs[1][2]), errs[0][2] + errs[1][2])
    st = LinState(forms[0], forms[1], D)
    if node.op_type == "Gemm" and len(ins) > 2 and ins[2][0] is not None:
        bias = _as_state(ins[2], m)
        if bias is None:
            return None
        res = []
        for fy, fb, spec, lo, hi in ((st.t, bias.t, ctx.train, out.tl, out.th), (st.i, bias.i, ctx.inf, out.il, out.ih)):
            f = _add(*_bcast_pair(fy, fb))
            _, _, r = ctx.round(spec, "add", lo, hi)
            res.append(_widen(f, -r, r))
        rt = res[0].eh - _add(*_bcast_pair(st.t, bias.t)).eh
        ri = res[1].eh - _add(*_bcast_pair(st.i, bias.i)).eh
        d = _widen(_add(*_bcast_pair(st.d, bias.d)), -(rt + ri), rt + ri)
        st = LinState(res[0], res[1], d)
    return st


@rule("Relu", domain=SYMBOLIC)
def _relu(ctx: RuleCtx, ins: list, out: Box, m: int) -> LinState | None:
    """Stable neurons keep (or zero) their forms; unstable ones are concretized (ReluVal);
    the drift keeps its form only where both kernels are stably active."""
    (_, xb, _) = ins[0]
    xs = _as_state(ins[0], m)
    if xs is None or xb is None:
        return None
    forms = []
    act = []
    for f, lo, hi, olo, ohi in ((xs.t, xb.tl, xb.th, out.tl, out.th), (xs.i, xb.il, xb.ih, out.il, out.ih)):
        on = (lo >= 0)
        off = (hi <= 0)
        keep = on.unsqueeze(-1)
        A = torch.where(keep, f.A, torch.zeros_like(f.A))
        b = torch.where(on, f.b, torch.zeros_like(f.b))
        el = torch.where(on, f.el, torch.where(off, torch.zeros_like(f.el), olo - b))
        eh = torch.where(on, f.eh, torch.where(off, torch.zeros_like(f.eh), ohi - b))
        forms.append(Form(A, b, pad_lo(el), pad_hi(eh)))
        act.append((on, off))
    both_on = act[0][0] & act[1][0]
    both_off = act[0][1] & act[1][1]
    keep = both_on.unsqueeze(-1)
    D = torch.where(keep, xs.d.A, torch.zeros_like(xs.d.A))
    db = torch.where(both_on, xs.d.b, torch.zeros_like(xs.d.b))
    dl = torch.where(both_on, xs.d.el, torch.where(both_off, torch.zeros_like(db), out.dl))
    dh = torch.where(both_on, xs.d.eh, torch.where(both_off, torch.zeros_like(db), out.dh))
    return LinState(forms[0], forms[1], Form(D, db, pad_lo(dl), pad_hi(dh)))
