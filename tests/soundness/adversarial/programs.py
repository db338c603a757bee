"""Conforming programs of a kernel spec, written from the spec's text alone (kcverify/kernels/
spec.py's docstring, docs/bounds.md, semantics §1.1), not from kcverify.kernels.realize.

A ``Program`` is one member of the family a ``KernelSpec`` describes; its fields are the choices
the spec leaves open, taken adversarially:

* ``order``: the accumulation order of every dot product and standalone reduction, and
  ``row_order`` of the row sums inside Softmax and LayerNorm (arith.py lists the orders; each is a
  permutation or a bracketing of the sum, every addition rounded to nearest in the accumulator);
* ``rounding``: where the spec allows k ulps (``ulps``: exp, tanh, erf, rsqrt, ..., and 1 ulp for
  + - * /), the value returned is the nearest, or the furthest up / down the k ulps allow, or
  either at random (arith.within);
* ``cast_rounding``: activation casts round to nearest-even, or, when the spec says
  ``rounding: any``, to either neighbour (up / down / random);
* ``quotient``: an activation cast rounds a / s taken exactly or first rounded to fp32
  (``mixed``: either, per element at random);
* ``acc``: what a MatMul accumulates: ``unscaled`` products of the cast values q_a q_b (the
  scales applied after the sum: ``rescale`` "one" fl32(acc fl32(s_a s_b)), "two"
  fl32(fl32(acc s_a) s_b), or "exact" one rounding of acc s_a s_b), or ``dequant``
  products of the dequantised values (s_a q_a)(s_b q_b); per-block scales promote each block's
  partial sum before the blocks are summed;
* ``sat``: an fp8 cast of a value beyond the format saturates (satfinite) or gives NaN; a
  cast whose spec says ``ftz`` flushes its subnormal results to zero;
* ``trace``: a list that records every activation cast (format, q, s) in execution order, for
  checking a "stable cast" claim (test_stable_casts.py);
* the spec's accumulation family (``spec.accumulation``, test_families.py): ``sequential``,
  ``pairwise`` (``pairwise_form``: levels, or the halves of finding 18), ``tile_k``,
  ``mma: sm90_fp8`` (arith.sm90_dot; ``mma_variant`` / ``mma_trunc``), ``split_k`` (``split``,
  ``split_sizes``, ``split_order``); block scales ``mx`` (OCP MX v1.0) and ``nv`` (NVFP4,
  ``nv_prod``), 2-D ``per_block`` weight tiles, fp4 / fp6 element formats (always saturating);
* ``sm_form`` / ``ln_form`` / ``gelu_form``: the decomposition. Row sums inside Softmax and
  LayerNorm are sums in the accumulator format in ``row_order``, stored in the compute format
  within ulps("reduce") (the spec since issue 11); Softmax divides by the sum (``two_pass``) or
  multiplies by its reciprocal (``recip``, torch / onnxruntime); LayerNorm's mean, centred
  values, squares and variance are compute-format values (``two_pass``) or accumulator values
  (``two_pass_acc``); GELU is torch's (0.5 x)(1 + erf(x / sqrt 2)) (``decomposed``), ONNX's
  function body x (0.5 (1 + erf)) (``onnx``), or the tanh form likewise; ``fused``: one
  rounding of the exact result.

Values are numpy float64 arrays holding values of the compute format. Dynamic per-tensor scales
take their amax over the whole operand (``per_sample="whole"``: run one sample at a time) or over
every axis but 0 (``"axis0"``: for graphs whose every tensor keeps the sample on axis 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch

from kcverify.kernels.spec import CastSpec, KernelSpec
from tests.soundness.adversarial.arith import (
    EMAX_ELEM,
    FMT,
    Fmt,
    fma_sum,
    ordered_sum,
    rnd,
    round3,
    sm90_dot,
    two_prod,
    within,
)

# ulps the spec gives a primitive when its table does not name it (the spec docstring's default)
_DEFAULT_K = 2.0


@dataclass(frozen=True)
class Program:
    spec: KernelSpec
    order: str = "seq"
    row_order: str | None = None
    rounding: str = "nearest"
    cast_rounding: str = "nearest"
    quotient: str = "exact"
    acc: str = "unscaled"
    rescale: str = "one"
    sat: bool = True
    sm_form: str = "two_pass"
    ln_form: str = "two_pass"
    gelu_form: str = "decomposed"
    per_sample: str = "whole"
    seed: int = 0
    label: str = ""
    # when a list: every activation cast appends (format name, q, s) (test_stable_casts)
    trace: list | None = None
    # the accumulation families (spec.accumulation): the sm90 variant, split-K choice, NVFP4
    mma_variant: str = "with_c"  # "with_c" / "no_c" (alignment with the accumulator or not)
    mma_trunc: str = "zero"  # each aligned term truncated toward "zero" or "floor"
    split: int | None = None  # one of the spec's split_k (None: the first)
    split_sizes: str = "ceil"  # "ceil" (parts of ceil(K/S), the last shorter) or "even"
    nv_prod: str = "exact"  # NVFP4's s = d S exact or rounded to fp32
    # ``order: pairwise``: "levels" ((t0+t1), (t2+t3), ..., the spec since 2b6b584) or "halves"
    # (the first ceil(n/2) terms and the last floor(n/2), recursively: its old text, finding 18)
    pairwise_form: str = "levels"
    # the order of split-K's S partial sums (None: left to right for a pinned family, sequential
    # or pairwise, and this program's order otherwise)
    split_order: str | None = None
    # a Conv's bias: added as the graph stores it, or first stored in the compute format
    bias: str = "exact"
    # when a list: the interpreter appends ("node", name) before each MatMul / Gemm / Conv and
    # every activation cast appends (side, q) ("left" / "right"), for locating a program's
    # casts by (node, side) as a proof by cases names them (test_cases.py)
    sites: list | None = None
    # ``ln_form="welford"``: LayerNorm's moments by a Welford / Chan tree (welford.py): its shape
    # and its update forms (a welford.Form; None: the default form)
    wf_tree: str = "torch"
    wf_form: object = None

    @property
    def C(self) -> Fmt:
        return FMT[self.spec.compute.name]

    @property
    def A(self) -> Fmt:
        return FMT[self.spec.accumulate.name]

    @property
    def rows(self) -> str:
        return self.row_order or self.order

    def k(self, prim: str) -> float:
        return float(self.spec.ulps.get(prim, _DEFAULT_K))

    def with_(self, **kw) -> Program:
        return replace(self, **kw)

    def __str__(self) -> str:
        return self.label or (f"{self.spec.name}[{self.order}/{self.rows}, {self.rounding}, "
                              f"cast {self.cast_rounding}, q {self.quotient}, {self.acc}]")

    # --- rounding of one primitive ------------------------------------------------------
    def rng(self, salt: int = 0) -> np.random.Generator:
        return np.random.default_rng([self.seed, salt])

    def prim(self, exact: np.ndarray, prim: str, salt: int = 0) -> np.ndarray:
        """The exact result of a primitive as this program returns it (within k ulps)."""
        return within(exact, self.C, self.k(prim), self.rounding, self.rng(salt))

    def store(self, x: np.ndarray) -> np.ndarray:
        return rnd(np.asarray(x, np.float64), self.C)

    # --- + - * / and unary primitives -----------------------------------------------------
    def add(self, a, b, salt: int = 0) -> np.ndarray:
        a, b = np.broadcast_arrays(np.asarray(a, np.float64), np.asarray(b, np.float64))
        with np.errstate(invalid="ignore"):
            near = round3(a, b, np.zeros_like(a), self.C)
        if self.rounding == "nearest" or self.k("add") <= 0:
            return _keep_inf(a + b, near)
        return _keep_inf(a + b, self._directed(a + b, near, "add", salt))

    def sub(self, a, b, salt: int = 0) -> np.ndarray:
        return self.add(a, -np.asarray(b, np.float64), salt)

    def mul(self, a, b, salt: int = 0) -> np.ndarray:
        a = np.asarray(a, np.float64)
        b = np.asarray(b, np.float64)
        with np.errstate(invalid="ignore", over="ignore"):
            ex = a * b  # operands of <= 26 bits: exact
        near = rnd(ex, self.C)
        if self.rounding == "nearest":
            return near
        return _keep_inf(ex, self._directed(ex, near, "mul", salt))

    def div(self, a, b, salt: int = 0) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            ex = np.asarray(a, np.float64) / np.asarray(b, np.float64)
        near = rnd(ex, self.C)  # a / b of two <= 24-bit values: double rounding innocuous
        if self.rounding == "nearest":
            return near
        return _keep_inf(ex, self._directed(ex, near, "div", salt))

    def sqrt(self, a, salt: int = 0) -> np.ndarray:
        with np.errstate(invalid="ignore"):
            ex = np.sqrt(np.asarray(a, np.float64))
        near = rnd(ex, self.C)
        if self.rounding == "nearest":
            return near
        return self._directed(ex, near, "sqrt", salt)

    def _directed(self, ex: np.ndarray, near: np.ndarray, prim: str, salt: int) -> np.ndarray:
        with np.errstate(invalid="ignore", over="ignore"):
            d = within(ex, self.C, self.k(prim), self.rounding, self.rng(salt))
        return np.where(np.isfinite(d), d, near)

    def unary(self, name: str, x) -> np.ndarray:
        """exp, log, tanh, erf, sigmoid, reciprocal, softplus within their ulps (float64 reference: 1e-15
        relative, far inside the 1e-9 of the radius arith.within keeps back)."""
        x = np.asarray(x, np.float64)
        t = torch.from_numpy(x)
        with np.errstate(all="ignore"):
            if name == "exp":
                ex = np.exp(x)
            elif name == "log":
                ex = np.log(x)
            elif name == "tanh":
                ex = np.tanh(x)
            elif name == "erf":
                ex = torch.erf(t).numpy()
            elif name == "sigmoid":
                ex = torch.sigmoid(t).numpy()
            elif name == "reciprocal":
                return self.div(1.0, x)
            elif name == "softplus":
                # a fused kernel (odd seeds: the exact value within the log's ulps) or the ONNX
                # body log(exp(x) + 1), each primitive within its ulps (its exp may overflow)
                if self.seed % 2:
                    return self.prim(np.logaddexp(0.0, x), "log")
                return self.unary("log", self.add(self.unary("exp", x), 1.0))
            else:
                raise ValueError(name)
        out = self.prim(ex, name)
        return _keep_inf(ex, out)

    # --- casts ------------------------------------------------------------------------
    def cast(self, x: np.ndarray, cs: CastSpec, s: np.ndarray, rounding: str) -> np.ndarray:
        """cast(x / s) into cs.format: the quotient exact or fp32, nearest or ``rounding``."""
        f = FMT[cs.format.name]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            t = x / s
            if self.quotient == "fp32":
                t = rnd(t, "fp32")
            elif self.quotient == "mixed":  # per element: exact or fp32 (a kernel whose
                # lanes divide in different precisions, e.g. a vectorised body and a scalar tail)
                t = np.where(self.rng(19).random(np.shape(t)) < 0.5, rnd(t, "fp32"), t)
        if rounding == "nearest":
            q = rnd(t, f, sat=self.sat)
        else:
            up = rnd(t, f, "up", sat=self.sat)
            down = rnd(t, f, "down", sat=self.sat)
            if rounding == "up":
                q = up
            elif rounding == "down":
                q = down
            else:
                q = np.where(self.rng(7).random(t.shape) < 0.5, up, down)
        if cs.ftz:  # subnormal results of the cast flushed to zero (the spec's ``ftz``)
            q = np.where(np.abs(q) < 2.0 ** f.emin, 0.0 * q, q)
        return q

    def scale(self, amax: np.ndarray, cs: CastSpec) -> np.ndarray:
        """s = fl32(amax / max_finite), an all-zero group 1; a subnormal or zero fp32 scale is
        what fl32 gives unless the spec states a floor the kernel clamps amax to (then
        fl32(max(amax, floor)) / max_finite, rounded to fp32)."""
        if cs.scale == "static":
            return np.asarray(rnd(float(cs.value), "fp32"))
        floor = getattr(cs, "floor", None)
        if floor:
            amax = rnd(np.maximum(amax, float(floor)), "fp32")
        top = float(cs.format.max_finite)  # qmax for an integer format
        with np.errstate(divide="ignore", invalid="ignore"):
            s = rnd(amax / top, "fp32")
        return np.where(amax == 0, 1.0, s)

    # --- MatMul ------------------------------------------------------------------------
    def operand(self, x: np.ndarray, const: bool, side: str
                ) -> tuple[np.ndarray, np.ndarray, int | None]:
        """(q, s, block): the cast operand q, its scales s (broadcastable; per block: expanded
        along K) and the block size when s varies along K. side: "left" (..., M, K) or "right"
        (..., K, N)."""
        cs = self.spec.weights if const else self.spec.activations
        kax = x.ndim - 1 if side == "left" else x.ndim - 2
        oax = x.ndim - 2 if side == "left" else x.ndim - 1
        one = np.ones([1] * x.ndim)
        if cs is None:
            return (self.store(x) if const else x), one, None
        a = np.abs(x)
        if cs.scale in ("none", "static"):
            s = one if cs.scale == "none" else self.scale(None, cs) * one
            blk = None
        elif cs.scale == "per_tensor":
            s = self.scale(a.max(keepdims=True), cs) * one
            blk = None
        elif cs.scale == "per_channel":
            axes = tuple(d for d in range(x.ndim) if d != oax)
            s = self.scale(a.max(axis=axes, keepdims=True), cs)
            blk = None
        elif cs.scale == "dynamic_per_tensor":
            if self.per_sample == "whole" or x.ndim < 2:
                s = self.scale(a.max(keepdims=True), cs) * one
            else:
                s = self.scale(a.max(axis=tuple(range(1, x.ndim)), keepdims=True), cs)
            blk = None
        elif cs.scale == "dynamic_per_token":
            s = self.scale(a.max(axis=kax, keepdims=True), cs)
            blk = None
        elif cs.scale in ("per_block", "dynamic_per_block") and isinstance(cs.block_size, tuple):
            bk, bn = (int(v) for v in cs.block_size)  # 2-D weight tiles (bk along K x bn)
            s = self.scale(_block_amax(_block_amax(a, kax, bk), oax, bn), cs)
            blk = bk
        elif cs.scale in ("per_block", "dynamic_per_block"):
            blk = int(cs.block_size or 32)
            s = self.scale(_block_amax(a, kax, blk), cs)
        elif cs.scale == "mx":
            blk = int(cs.block_size or 32)
            s = mx_scale(_block_amax(a, kax, blk), cs.format.name)
        elif cs.scale == "nv":
            blk = int(cs.block_size or 16)
            s = self.nv_scale(a, cs, kax, blk, const)
        else:
            raise ValueError(cs.scale)
        rounding = "nearest" if const or self.spec.rounding == "nearest" else self.cast_rounding
        if cs.format.kind == "int":  # symmetric integer steps (weights only)
            qmax = float(cs.format.max_finite)
            return np.clip(np.rint(x / s), -qmax, qmax), s, blk
        if cs.scale in ("mx", "nv") or FMT[cs.format.name].name.startswith(("fp4", "fp6")):
            sat = self.sat if cs.saturate is None and cs.format.name.startswith("fp8") else True
            p = self.with_(sat=sat if cs.saturate is None else bool(cs.saturate))
            q = (Program.cast(p.with_(quotient="exact"), x, cs, s, rounding) if const
                 else p.cast(x, cs, s, rounding))
            q = np.where(s == 0, 0.0, q)  # an NVFP4 block scale that underflowed: Q = 0
        elif const:  # Q(W): the exact quotient, nearest-even, in every conforming program
            q = Program.cast(self.with_(quotient="exact"), x, cs, s, "nearest")
        else:
            q = self.cast(x, cs, s, rounding)
        if self.trace is not None and not const:
            self.trace.append((cs.format.name, q, np.broadcast_to(s, q.shape)))
        if self.sites is not None and not const:
            self.sites.append((side, q))
        return q, s, blk

    def nv_scale(self, a: np.ndarray, cs: CastSpec, kax: int, blk: int, const: bool
                 ) -> np.ndarray:
        """NVFP4: S = fl32(max(amax_t, floor) / (448 * 6)) (activations: per sample when
        per_sample is axis0), d = RNE_e4m3(amax_b / (6 S)) per block along K, s = d S (exact,
        or rounded to fp32 when ``nv_prod`` says so)."""
        if const or self.per_sample == "whole" or a.ndim < 2:
            amax_t = a.max(keepdims=True)
        else:
            amax_t = a.max(axis=tuple(range(1, a.ndim)), keepdims=True)
        S = rnd(np.maximum(amax_t, float(cs.floor)) / (448.0 * 6.0), "fp32")
        with np.errstate(divide="ignore", invalid="ignore"):
            d = rnd(_block_amax(a, kax, blk) / (6.0 * S), "fp8_e4m3", sat=True)
        s = d * S
        return rnd(s, "fp32") if self.nv_prod == "fp32" else s

    def matmul(self, a: np.ndarray, b: np.ndarray, a_const: bool, b_const: bool) -> np.ndarray:
        """numpy.matmul semantics under the spec's casts, accumulation and rescaling."""
        sq = []
        if a.ndim == 1:
            a = a[None, :]
            sq.append(-2)
        if b.ndim == 1:
            b = b[:, None]
            sq.append(-1)
        qa, sa, ba = self.operand(a, a_const, "left")
        qb, sb, bb = self.operand(b, b_const, "right")
        cast = self.spec.weights is not None or self.spec.activations is not None
        y = self._dot(qa, sa, ba, qb, sb, bb, cast)
        for d in sq:
            y = np.squeeze(y, d)
        return y

    def conv(self, x: np.ndarray, w: np.ndarray, b: np.ndarray | None, strides: tuple[int, int],
             pads: tuple[int, int, int, int], dilations: tuple[int, int], x_const: bool,
             w_const: bool) -> np.ndarray:
        """A 2-D convolution (group 1; x (N, C, H, W), w (O, C, kh, kw), pads (top, left,
        bottom, right)) as the spec's dot product per output: the input cast as a whole (its
        scale from every element of x, those no window reads included), zero padded after the
        cast, each output's C kh kw terms (c, i, j order) against the weight's row, the weight
        cast per output channel (its matrix (O, C kh kw)); the bias added in one rounding, of
        the bias as stored (``bias="exact"``) or first stored in the compute format
        (``"stored"``)."""
        n, c, h, wd = x.shape
        o, _, kh, kw = w.shape
        qx, sx, _ = self.operand(x, x_const, "left")
        qw, sw, bw = self.operand(w.reshape(o, -1).T, w_const, "right")  # (C kh kw, O)
        top, left, bottom, right = pads
        qp = np.zeros((n, c, h + top + bottom, wd + left + right))
        qp[:, :, top:top + h, left:left + wd] = qx
        sh, sw_ = strides
        dh, dw = dilations
        ho = (qp.shape[2] - dh * (kh - 1) - 1) // sh + 1
        wo = (qp.shape[3] - dw * (kw - 1) - 1) // sw_ + 1
        ri = np.arange(ho)[:, None] * sh + np.arange(kh)[None, :] * dh  # (ho, kh)
        ci = np.arange(wo)[:, None] * sw_ + np.arange(kw)[None, :] * dw  # (wo, kw)
        cols = qp[:, :, ri[:, None, :, None], ci[None, :, None, :]]  # (n, c, ho, wo, kh, kw)
        cols = cols.transpose(0, 2, 3, 1, 4, 5).reshape(n, ho * wo, c * kh * kw)
        sa = np.asarray(sx).reshape(-1, 1, 1)
        cast = self.spec.weights is not None or self.spec.activations is not None
        y = self._dot(cols, sa, None, qw, sw, bw, cast)  # (n, L, O)
        y = y.reshape(n, ho, wo, o).transpose(0, 3, 1, 2)
        if b is not None:
            bb = np.asarray(b, np.float64).reshape(o, 1, 1)
            if self.bias == "stored":
                bb = self.store(bb)
            y = self.add(y, bb, salt=17)
        return y

    def _sum(self, pa: np.ndarray, pb: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """sum_k pa pb along the last axis as the spec's accumulation family allows (kernels/
        spec.py Accumulation): ``any`` in this program's order; ``sequential``; ``pairwise``
        (halves); ``tile_k`` (tiles left to right, tiles' sums in this program's order);
        ``mma: sm90_fp8`` (arith.sm90_dot, this program's variant); each of ``split_k``'s S
        contiguous parts alone, the S partial sums added in this program's order."""
        fam = self.spec.accumulation
        A = self.A
        if fam.is_default:
            return fma_sum(pa, pb, A, self.order, rng)
        pa, pb = np.broadcast_arrays(pa, pb)
        p, e = two_prod(pa, pb)
        assert not np.any(e), "a family program needs exact products"
        K = p.shape[-1]
        S = self.split if self.split is not None else fam.split_k[0]
        if S > 1:
            if self.split_sizes == "even":
                bounds = np.cumsum([0] + [len(c) for c in np.array_split(np.arange(K), S)])
            else:
                c = -(-K // S)
                bounds = list(range(0, K, c)) + [K]
            parts = [self._family(p[..., k0:k1], rng) for k0, k1 in zip(bounds[:-1], bounds[1:])
                     if k1 > k0]
            pinned = fam.mma is None and fam.order in ("sequential", "pairwise")
            porder = self.split_order or ("seq" if pinned else _free(self.order))
            return ordered_sum(np.stack(parts, axis=-1), A, porder, rng)
        return self._family(p, rng)

    def _family(self, p: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        fam = self.spec.accumulation
        A = self.A
        if fam.mma == "sm90_fp8":
            return sm90_dot(p, fam.promote, A, _free(self.order), self.mma_variant == "with_c",
                            self.mma_trunc, rng=rng)
        if fam.order == "sequential":
            return ordered_sum(p, A, "seq")
        if fam.order == "pairwise":
            return ordered_sum(p, A, "halves" if self.pairwise_form == "halves" else "pairwise")
        if fam.order == "tile_k":
            t = int(fam.tile_k)
            tiles = [ordered_sum(p[..., k:k + t], A, "seq") for k in range(0, p.shape[-1], t)]
            return ordered_sum(np.stack(tiles, axis=-1), A, _free(self.order), rng)
        return ordered_sum(p, A, self.order, rng)

    def _dot(self, qa, sa, ba, qb, sb, bb, cast: bool) -> np.ndarray:
        A = self.A
        K = qa.shape[-1]
        # products laid out (..., M, N, K)
        pa = qa[..., :, None, :]
        pb = np.swapaxes(qb, -1, -2)[..., None, :, :]
        rng = self.rng(11)
        if not cast:
            acc = self._sum(pa, pb, rng)
            return self._out(acc)
        sa_k = np.broadcast_to(sa, qa.shape)  # (..., M, K)
        sb_k = np.broadcast_to(sb, qb.shape)  # (..., K, N)
        if ba is None and bb is None:
            if self.acc.startswith("dequant"):
                da, db = _deq(qa, sa), _deq(qb, sb)
                if self.acc == "dequant_rounded":  # s q rounded to the accumulator first
                    da, db = rnd(da, A), rnd(db, A)
                acc = fma_sum(da[..., :, None, :], np.swapaxes(db, -1, -2)[..., None, :, :], A,
                              self.order, rng)
                return self._out(acc)
            acc = self._sum(pa, pb, rng)
            s_a = sa_k[..., :, :1]  # (..., M, 1) constant along K
            s_b = sb_k[..., :1, :]  # (..., 1, N)
            return self._rescale(acc, s_a, s_b)
        # a scale varies along K: blocks of the smaller block size
        blk = min(x for x in (ba, bb) if x is not None)
        parts = []
        for k0 in range(0, K, blk):
            k1 = min(K, k0 + blk)
            p = self._sum(pa[..., k0:k1], pb[..., k0:k1], rng)
            s_a = sa_k[..., :, k0:k0 + 1]
            s_b = sb_k[..., k0:k0 + 1, :]
            with np.errstate(invalid="ignore", over="ignore"):
                hi, lo = two_prod(p, s_a * s_b)  # s_a s_b: 48 bits, exact in float64
                p = round3(hi, lo, np.zeros_like(hi), A)  # one rounding in the accumulator
            parts.append(p)
        acc = ordered_sum(np.stack(parts, axis=-1), A, _free(self.order), rng)
        return self._out(acc)

    def _rescale(self, acc, s_a, s_b) -> np.ndarray:
        with np.errstate(invalid="ignore", over="ignore"):
            if self.rescale == "one":
                S = rnd(s_a * s_b, "fp32")
                y = rnd(acc * S, "fp32")
            elif self.rescale == "exact":  # one rounding of acc s_a s_b (an FMA-like epilogue)
                hi, lo = two_prod(acc, s_a * s_b)  # s_a s_b: 48 bits, exact in float64
                y = round3(hi, lo, np.zeros_like(hi), FMT["fp32"])
            else:
                y = rnd(rnd(acc * s_a, "fp32") * s_b, "fp32")
        return self._out(y)

    def _out(self, y: np.ndarray) -> np.ndarray:
        return rnd(y, self.C)

    # --- normalising ops ----------------------------------------------------------------
    def softmax(self, x: np.ndarray, axis: int = -1) -> np.ndarray:
        x = np.moveaxis(np.asarray(x, np.float64), axis, -1)
        if self.sm_form == "fused":
            with np.errstate(invalid="ignore", over="ignore"):
                m = np.max(x, -1, keepdims=True)
                e = np.exp(x - m)
                ex = e / e.sum(-1, keepdims=True)
            y = within(ex, self.C, max(self.k("exp"), self.k("div"), 1.0), self.rounding,
                       self.rng(3))
        else:
            m = np.max(x, -1, keepdims=True)
            d = self.sub(x, m, salt=1)
            e = self.unary("exp", d)
            s = self.row_sum(e, salt=2)[..., None]
            if self.sm_form == "recip":  # torch / onnxruntime CPU: e * (1 / sum)
                y = self.mul(e, self.div(1.0, s, salt=3), salt=16)
            else:
                y = self.div(e, s, salt=3)
        return np.moveaxis(y, -1, axis)

    def layernorm(self, x: np.ndarray, g, b, axis: int, eps: float) -> np.ndarray:
        x = np.asarray(x, np.float64)
        axis %= x.ndim
        lead = x.shape[:axis]
        xf = x.reshape(*lead, -1)
        n = xf.shape[-1]
        if self.ln_form == "fused":
            mu = xf.mean(-1, keepdims=True)
            c = xf - mu
            v = (c * c).mean(-1, keepdims=True)
            xh = c / np.sqrt(v + eps)
            y = xh.reshape(x.shape)
            if g is not None:
                y = y * g
            if b is not None:
                y = y + b
            return within(y, self.C, 1.0, self.rounding, self.rng(4))
        acc = self.ln_form == "two_pass_acc"  # mean and variance kept in the accumulator
        if self.ln_form == "welford":  # a Welford / Chan tree (welford.py), torch's family
            from tests.soundness.adversarial import welford as wf

            form = self.wf_form if self.wf_form is not None else wf.Form()
            mu, M = wf.moments(xf, wf.build(self.wf_tree, n, self.seed), form, self.A)
            # the root's mean and fl(M / n) stored in the compute format within ulps("reduce")
            # and ulps("div") (docs/bounds.md, 8632d58)
            mu = self.prim(mu, "reduce", 5)[..., None]
            c = self.sub(xf, mu, salt=6)
            v = self.prim(rnd(M / n, self.A), "div", 8)[..., None]
        else:
            s = self.row_sum(xf, salt=5, store=not acc)
            mu = (rnd(s / n, self.A) if acc else self.div(s, float(n)))[..., None]
            c = self.sub(xf, mu, salt=6)
            sq = rnd(c * c, self.A) if acc else self.mul(c, c, salt=7)
            ss = self.row_sum(sq, salt=8, store=not acc)
            v = (rnd(ss / n, self.A) if acc else self.div(ss, float(n)))[..., None]
        ve = rnd(v + eps, self.A) if acc else self.add(v, rnd(eps, self.C), salt=9)
        if self.rounding == "nearest":
            r = self.div(1.0, self.sqrt(ve))
        else:  # one rsqrt within its ulps
            r = within(1.0 / np.sqrt(ve), self.C, self.k("rsqrt"), self.rounding, self.rng(10))
        y = self.mul(c, r, salt=11).reshape(x.shape)
        if g is not None:
            y = self.mul(y, g, salt=12)
        if b is not None:
            y = self.add(y, b, salt=13)
        return y

    def row_sum(self, t: np.ndarray, salt: int, store: bool = True) -> np.ndarray:
        """A row sum inside a normalising op: any order in the accumulator format, then (when
        ``store``) stored in the compute format within ulps("reduce")."""
        s = ordered_sum(t, self.A, self.rows, self.rng(salt))
        return self.prim(s, "reduce", salt) if store else s

    def reduce_sum(self, x: np.ndarray, axes: tuple[int, ...], keepdims: bool, mean: bool
                   ) -> np.ndarray:
        """Standalone ReduceSum / ReduceMean: any order in the accumulator, then the compute
        format (and the division by n)."""
        x = np.asarray(x, np.float64)
        axes = tuple(sorted(a % x.ndim for a in axes)) if axes else tuple(range(x.ndim))
        keep = [d for d in range(x.ndim) if d not in axes]
        t = np.transpose(x, keep + list(axes))
        t = t.reshape(*[x.shape[d] for d in keep], -1)
        n = t.shape[-1]
        s = rnd(ordered_sum(t, self.A, self.order, self.rng(14)), self.C)
        if mean:
            s = self.div(s, float(n))
        if keepdims:
            shape = [1 if d in axes else x.shape[d] for d in range(x.ndim)]
            s = s.reshape(shape)
        return s

    def gelu(self, x: np.ndarray, approximate: str = "none") -> np.ndarray:
        x = np.asarray(x, np.float64)
        if self.gelu_form == "fused":
            if approximate == "tanh":
                ex = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
                k = self.k("tanh")
            else:
                ex = 0.5 * x * (1 + torch.erf(torch.from_numpy(x) / math.sqrt(2)).numpy())
                k = self.k("erf")
            return within(ex, self.C, k, self.rounding, self.rng(15))
        if approximate == "tanh":
            x3 = self.mul(self.mul(x, x), x)
            inner = self.add(x, self.mul(x3, rnd(0.044715, self.C)))
            t = self.unary("tanh", self.mul(inner, rnd(math.sqrt(2 / math.pi), self.C)))
        else:
            t = self.unary("erf", self.div(x, rnd(math.sqrt(2), self.C)))
        if self.gelu_form == "onnx":  # ONNX's function body: x * (0.5 (1 + t))
            return self.mul(x, self.mul(0.5, self.add(1.0, t)))
        return self.mul(self.mul(0.5, x), self.add(1.0, t))  # torch, HF: (0.5 x)(1 + t)


def _free(order: str) -> str:
    """The program's order where a family leaves the combination of partial sums free (an
    order over whole terms: a chunking or a product-level greedy order becomes sequential)."""
    return "seq" if order.startswith(("chunk", "greedy")) else order


def mx_scale(amax: np.ndarray, fmt: str) -> np.ndarray:
    """OCP MX v1.0: X = 2^(floor(log2 amax) - emax_elem), clamped to E8M0's [2^-127, 2^127];
    amax = 0 gives 2^-127."""
    with np.errstate(divide="ignore"):
        _, e = np.frexp(np.where(amax > 0, amax, 1.0))
    ex = np.where(amax > 0, e - 1 - EMAX_ELEM[fmt], -127)
    return np.ldexp(1.0, np.clip(ex, -127, 127))


def _keep_inf(ex: np.ndarray, y: np.ndarray) -> np.ndarray:
    """An infinite exact value (a mask) stays itself; NaN stays NaN."""
    return np.where(np.isinf(ex) | np.isnan(ex), ex, y)


def _deq(q: np.ndarray, s: np.ndarray) -> np.ndarray:
    """The dequantised value s q, exact in float64 (<= 24 + 11 bits)."""
    return q * s


def _block_amax(a: np.ndarray, axis: int, blk: int) -> np.ndarray:
    """amax over blocks of blk entries along axis, expanded back along it."""
    m = np.moveaxis(a, axis, -1)
    k = m.shape[-1]
    nb = -(-k // blk)
    pad = nb * blk - k
    if pad:
        m = np.concatenate([m, np.zeros((*m.shape[:-1], pad))], axis=-1)
    bm = m.reshape(*m.shape[:-1], nb, blk).max(-1)
    bm = np.repeat(bm, blk, axis=-1)[..., :k]
    return np.moveaxis(bm, -1, axis)
