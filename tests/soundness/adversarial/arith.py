"""Exact floating-point arithmetic for the adversarial programs, written without kcverify.kernels.

Everything is numpy float64 holding values of a target format:

* ``FMT[name]``: the format constants (significand bits p with the implicit bit, emin, largest
  finite value), typed in from IEEE 754 / the OCP FP8 spec, not read from kcverify;
* ``rnd(x, fmt, mode)``: round float64 x into a format, exactly (x / quantum is a power-of-two
  scaling, np.rint is round-half-even, floor / ceil are the directed modes); overflow follows
  the format (inf, or NaN for e4m3fn), ``sat=True`` clamps instead (satfinite);
* ``within(x, fmt, k, mode)``: a value of the format at most k ulps (k * u * |x|, plus eta below
  the normal range) from x, as far up / down as that allows: what a primitive with ``ulps: k``
  may return;
* ``ordered_sum``: a sum along the last axis in a chosen order, every addition rounded to nearest
  in the accumulator format, exactly;
* ``fma_sum``: the same for exact products a_i * b_i of float64 values.

Exactness: ``round3(a, b, c, f)`` = RN_f(a + b + c) by TwoSum / TwoProduct (Dekker) and one
round-to-odd step in float64 before the rounding to f (Boldo-Melquiond: correct for 53 >= p + 2),
so every rounding below is a single correct one, whatever the operands' precisions.

Orders (per output element, data dependent where it says so): ``seq``, ``rev``, ``asc`` / ``desc``
(by |term|), ``posneg`` (positives then negatives: the partial sums grow, then cancel), ``alt``
(largest positive, largest negative, ...), ``pairwise`` (balanced tree), ``chunk<c>`` (split-K:
chunks of c summed left to right, partials then left to right), ``random`` and ``greedy_up`` /
``greedy_down`` (at each step the remaining term whose addition rounds furthest up / down),
``tree_up`` / ``tree_down`` (any tree, not only a chain: at each step the pair of live values,
terms or partial sums, whose rounded sum moves furthest up / down; ties to the largest sum),
``halves`` (a balanced tree: the first ceil(n/2) terms and the last floor(n/2), recursively).

``sm90_dot``: Hopper FP8 tensor-core accumulation (MMA-Sim's model, DeepSeek-V3 3.3.2), written
from those public descriptions: groups of 32 products, each group's terms (and, in the ``with_c``
variant, the running accumulator) aligned to their largest exponent E and truncated to 13
fractional bits (multiples of 2^(E-13), toward zero, or toward -inf in the ``floor`` variant),
summed exactly, the sum rounded toward zero to 13 fraction bits (an e8m13 value).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Fmt:
    name: str
    p: int  # significand bits, implicit bit included
    emin: int  # exponent of the smallest normal
    max: float  # largest finite magnitude
    has_inf: bool = True

    @property
    def u(self) -> float:
        return 2.0 ** -self.p

    @property
    def eta(self) -> float:  # half the smallest subnormal
        return 2.0 ** (self.emin - self.p)

    @property
    def tiny(self) -> float:  # smallest subnormal
        return 2.0 ** (self.emin - self.p + 1)


FMT: dict[str, Fmt] = {f.name: f for f in (
    Fmt("fp32", 24, -126, float.fromhex("0x1.fffffep+127")),
    Fmt("bf16", 8, -126, float.fromhex("0x1.fep+127")),
    Fmt("fp16", 11, -14, 65504.0),
    Fmt("fp8_e4m3", 4, -6, 448.0, has_inf=False),
    Fmt("fp8_e5m2", 3, -14, 57344.0),
    Fmt("fp64", 53, -1022, float.fromhex("0x1.fffffffffffffp+1023")),
    # OCP MX v1.0 element formats (no inf / NaN: casts saturate)
    Fmt("fp6_e2m3", 4, 0, 7.5, has_inf=False),
    Fmt("fp6_e3m2", 3, -2, 28.0, has_inf=False),
    Fmt("fp4_e2m1", 2, 0, 6.0, has_inf=False),
)}
# OCP MX v1.0: emax_elem, the exponent of the element format's largest normal value
EMAX_ELEM = {"fp4_e2m1": 2, "fp6_e2m3": 2, "fp6_e3m2": 4, "fp8_e4m3": 8, "fp8_e5m2": 15}


def fmt_of(name: str) -> Fmt:
    return FMT[name]


def quantum(x: np.ndarray, f: Fmt) -> np.ndarray:
    """The format's spacing in x's binade: 2^(max(floor(log2|x|), emin) - p + 1)."""
    x = np.asarray(x, dtype=np.float64)
    _, e = np.frexp(x)  # |x| = m 2^e, m in [0.5, 1); frexp(0) = (0, 0)
    e = np.where(x == 0, f.emin + 1, e)
    return np.ldexp(1.0, np.maximum(e - 1, f.emin) - f.p + 1)


def rnd(x, f: Fmt | str, mode: str = "nearest", sat: bool = False) -> np.ndarray:
    """x (float64) rounded into format f: nearest (half to even), up, down, zero."""
    f = FMT[f] if isinstance(f, str) else f
    x = np.asarray(x, dtype=np.float64)
    if f.name == "fp64":
        return x.copy()
    with np.errstate(invalid="ignore", over="ignore"):
        q = quantum(np.where(np.isfinite(x), x, 1.0), f)
        y = x / q
        if mode == "nearest":
            r = np.rint(y)
        elif mode == "up":
            r = np.ceil(y)
        elif mode == "down":
            r = np.floor(y)
        elif mode == "zero":
            r = np.trunc(y)
        else:
            raise ValueError(mode)
        out = np.where(np.isfinite(x), r * q, x)
        out = np.where(out == 0, np.copysign(0.0, x), out)
        over = np.abs(out) > f.max
        if np.any(over):
            if sat:
                big = np.copysign(f.max, x)
            elif f.has_inf:
                # IEEE: directed modes toward zero stop at max
                tz = ((mode == "down") & (x > 0)) | ((mode == "up") & (x < 0)) | (mode == "zero")
                big = np.where(tz & np.isfinite(x), np.copysign(f.max, x), np.copysign(np.inf, x))
            else:
                big = np.full_like(x, np.nan)
            out = np.where(over, big, out)
    return out


def representable(x, f: Fmt | str) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return (rnd(x, f) == x) | ~np.isfinite(x)


def next_up(x, f: Fmt | str) -> np.ndarray:
    """The least value of format f above x (x a value of f): the spacing above x is q(x), or
    q(x)/2 for a negative power of two, so x + q(x)/4 rounded up lands on it."""
    f = FMT[f] if isinstance(f, str) else f
    x = np.asarray(x, dtype=np.float64)
    return rnd(x + quantum(x, f) / 4, f, "up")


def next_down(x, f: Fmt | str) -> np.ndarray:
    """The greatest value of format f below x (x a value of f)."""
    f = FMT[f] if isinstance(f, str) else f
    x = np.asarray(x, dtype=np.float64)
    return rnd(x - quantum(x, f) / 4, f, "down")


def within(x, f: Fmt | str, k: float, mode: str, rng: np.random.Generator | None = None
           ) -> np.ndarray:
    """A value of f within k ulps of the exact x (|y - x| <= k u |x|, + eta below the normal
    range; 1e-9 of the radius kept back for float64's own error in x): nearest, or the largest
    (``up``) / smallest (``down``) such value, or either at random (``random``)."""
    f = FMT[f] if isinstance(f, str) else f
    x = np.asarray(x, dtype=np.float64)
    near = rnd(x, f)
    if mode == "nearest" or k <= 0:
        return near
    if mode == "random":
        assert rng is not None
        pick = rng.random(x.shape) < 0.5
        return np.where(pick, within(x, f, k, "up"), within(x, f, k, "down"))
    with np.errstate(invalid="ignore", over="ignore"):
        sub = np.abs(x) < 2.0 ** f.emin
        rad = (k * f.u * np.abs(x) + np.where(sub, f.eta, 0.0)) * (1 - 1e-9)
        cand = rnd(x + rad, f, "down") if mode == "up" else rnd(x - rad, f, "up")
        ok = np.isfinite(cand) & (np.abs(cand - x) <= rad)
        return np.where(np.isfinite(x) & ok, cand, near)


# --- sums -----------------------------------------------------------------------------------
def perm(terms: np.ndarray, order: str, rng: np.random.Generator | None = None) -> np.ndarray:
    """Index permutation along the last axis (per leading index) for a data-dependent order."""
    n = terms.shape[-1]
    base = np.broadcast_to(np.arange(n), terms.shape)
    if order in ("seq", "pairwise") or order.startswith("chunk"):
        return base
    if order == "rev":
        return base[..., ::-1]
    a = np.abs(terms)
    if order == "asc":
        return np.argsort(a, axis=-1, kind="stable")
    if order == "desc":
        return np.argsort(-a, axis=-1, kind="stable")
    if order == "posneg":  # positives (largest first), then negatives (smallest |.| first)
        key = np.where(terms >= 0, -a, a + np.max(a, axis=-1, keepdims=True) * 4 + 1)
        return np.argsort(key, axis=-1, kind="stable")
    if order == "alt":  # largest positive, largest negative, next ...
        pos_rank = np.argsort(np.argsort(np.where(terms >= 0, -a, np.inf), axis=-1), axis=-1)
        neg_rank = np.argsort(np.argsort(np.where(terms < 0, -a, np.inf), axis=-1), axis=-1)
        key = np.where(terms >= 0, 2 * pos_rank, 2 * neg_rank + 1).astype(np.float64)
        return np.argsort(key, axis=-1, kind="stable")
    if order == "random":
        assert rng is not None
        return np.argsort(rng.random(terms.shape), axis=-1)
    raise ValueError(f"unknown order {order!r}")


def _add(a: np.ndarray, b: np.ndarray, f: Fmt) -> np.ndarray:
    return round3(a, b, np.zeros_like(a + b), f)


def ordered_sum(terms: np.ndarray, f: Fmt | str, order: str = "seq",
                rng: np.random.Generator | None = None, init: np.ndarray | None = None
                ) -> np.ndarray:
    """Sum along the last axis, each addition rounded to nearest in f (terms: values of a
    format of at most f's precision, or of fp32 when f is fp32)."""
    f = FMT[f] if isinstance(f, str) else f
    t = np.asarray(terms, dtype=np.float64)
    if order.startswith("greedy"):
        return _greedy_sum(t, f, order == "greedy_up")
    if order.startswith("tree_"):
        return _greedy_tree(t, f, order == "tree_up")
    if order == "halves":
        return _halves(t, f)
    t = np.take_along_axis(t, perm(t, order, rng), axis=-1)
    n = t.shape[-1]
    if n == 0:
        return np.zeros(t.shape[:-1]) if init is None else init
    if order == "pairwise":
        while t.shape[-1] > 1:
            if t.shape[-1] % 2:
                t = np.concatenate([t, np.zeros_like(t[..., :1])], axis=-1)
            t = _add(t[..., 0::2], t[..., 1::2], f)
        s = t[..., 0]
        return s if init is None else _add(init, s, f)
    if order.startswith("chunk"):
        c = int(order[5:])
        parts = [ordered_sum(t[..., k:k + c], f, "seq") for k in range(0, n, c)]
        return ordered_sum(np.stack(parts, axis=-1), f, "seq", init=init)
    s = t[..., 0] if init is None else _add(init, t[..., 0], f)
    for k in range(1, n):
        s = _add(s, t[..., k], f)
    return s


def _greedy_sum(t: np.ndarray, f: Fmt, up: bool) -> np.ndarray:
    """At each step add the remaining term whose rounded addition moves the sum furthest up
    (down) from the exact running value: rounding errors that all point one way."""
    lead = t.shape[:-1]
    n = t.shape[-1]
    left = np.ones(t.shape, dtype=bool)
    s = np.zeros(lead)
    sgn = 1.0 if up else -1.0
    for _ in range(n):
        cand = rnd(s[..., None] + t, f)
        err = (cand - (s[..., None] + t)) * sgn
        err = np.where(left, err, -np.inf)
        k = np.argmax(err, axis=-1)
        s = np.take_along_axis(cand, k[..., None], axis=-1)[..., 0]
        np.put_along_axis(left, k[..., None], False, axis=-1)
    return s


def _halves(t: np.ndarray, f: Fmt) -> np.ndarray:
    n = t.shape[-1]
    if n == 1:
        return t[..., 0]
    h = (n + 1) // 2
    return _add(_halves(t[..., :h], f), _halves(t[..., h:], f), f)


def _expo(x: np.ndarray) -> np.ndarray:
    """floor(log2 |x|) (x != 0), exact."""
    _, e = np.frexp(x)
    return e - 1


def _trunc_to(x: np.ndarray, q: np.ndarray, mode: str) -> np.ndarray:
    r = x / q
    return (np.trunc(r) if mode == "zero" else np.floor(r)) * q


def sm90_group(c: np.ndarray, terms: np.ndarray, with_c: bool = True, mode: str = "zero"
               ) -> np.ndarray:
    """One MMA step: c (..., ) + the group's exact products terms (..., g) (float64, exact), as
    the module doc describes; returns the new accumulator (an e8m13 value)."""
    allt = np.concatenate([c[..., None], terms], axis=-1) if with_c else terms
    nz = allt != 0
    with np.errstate(divide="ignore"):
        ex = np.where(nz, _expo(np.where(nz, allt, 1.0)), -10_000)
    E = ex.max(axis=-1, keepdims=True)
    q = np.ldexp(1.0, np.maximum(E - 13, -1074))
    s = _trunc_to(allt, q, mode).sum(axis=-1)  # exact: <= 33 terms on one grid
    if not with_c:
        s = s + c  # exact in float64 (both on grids within 53 bits here)
    out = np.zeros_like(s)
    nzs = s != 0
    es = _expo(np.where(nzs, s, 1.0))
    qs = np.ldexp(1.0, np.maximum(es - 13, -1074))
    out = np.where(nzs, np.trunc(s / qs) * qs, 0.0)
    return out


def sm90_dot(p: np.ndarray, promote: int | None, f: Fmt, order: str = "seq",
             with_c: bool = True, mode: str = "zero", group: int = 32,
             rng: np.random.Generator | None = None, scales: np.ndarray | None = None
             ) -> np.ndarray:
    """Exact products p (..., K) accumulated by the tensor core in groups of ``group``, the
    e8m13 accumulator promoted into ``f`` (fp32) every ``promote`` products (None: once, at the
    end), each promoted partial times ``scales[..., chunk]`` (per-block scales: one rounding)
    when given, the partials combined in ``order`` in f."""
    K = p.shape[-1]
    step = promote or K
    parts = []
    for k0 in range(0, K, step):
        c = np.zeros(p.shape[:-1])
        for g0 in range(k0, min(K, k0 + step), group):
            c = sm90_group(c, p[..., g0:min(K, k0 + step, g0 + group)], with_c, mode)
        if scales is not None:
            c = rnd(c * scales[..., k0 // step], f)
        parts.append(rnd(c, f))
    return ordered_sum(np.stack(parts, axis=-1), f, order, rng)


def _greedy_tree(t: np.ndarray, f: Fmt, up: bool) -> np.ndarray:
    """Greedy pair merging (``tree_up`` / ``tree_down``): n - 1 steps, each adding the two live
    values whose rounded sum has the largest signed rounding error; exact sums in float64."""
    lead = t.shape[:-1]
    v = t.reshape(-1, t.shape[-1]).copy()
    rows, n = v.shape
    if n == 0:
        return np.zeros(lead)
    live = np.ones(v.shape, dtype=bool)
    sgn = 1.0 if up else -1.0
    iu, ju = np.triu_indices(n, 1)
    r = np.arange(rows)
    for _ in range(n - 1):
        ex = v[:, iu] + v[:, ju]
        with np.errstate(invalid="ignore", over="ignore"):
            cand = rnd(ex, f)
            err = (cand - ex) * sgn
        err = np.where(live[:, iu] & live[:, ju], err, -np.inf)
        k = np.argmax(err, axis=-1)
        i, j = iu[k], ju[k]
        v[r, i] = cand[r, k]
        live[r, j] = False
        v[r, j] = 0.0
    return v[live].reshape(lead) if n > 1 else v[:, 0].reshape(lead)


def two_sum(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def _split(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    c = 134217729.0 * a  # 2^27 + 1
    hi = c - (c - a)
    return hi, a - hi


def two_prod(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """a * b = p + e exactly (Dekker), for products far from float64 over/underflow."""
    p = a * b
    ah, al = _split(a)
    bh, bl = _split(b)
    e = ((ah * bh - p) + ah * bl + al * bh) + al * bl
    return p, e


def _odd(s: np.ndarray, r: np.ndarray) -> np.ndarray:
    """Round-to-odd of s + r (float64, |r| < ulp(s)) into float64."""
    m = s.view(np.int64)
    odd = (m & 1) == 1
    nxt = np.nextafter(s, np.where(r > 0, np.inf, -np.inf))
    return np.where((r == 0) | odd, s, nxt)


def round3(a: np.ndarray, b: np.ndarray, c: np.ndarray, f: Fmt) -> np.ndarray:
    """RN_f(a + b + c) exactly, for float64 a, b, c (no float64 overflow); with an infinite or
    NaN operand, IEEE's result (inf + x = inf, inf - inf = NaN)."""
    with np.errstate(invalid="ignore", over="ignore"):
        naive = a + b + c
    if not np.all(np.isfinite(naive)):
        with np.errstate(invalid="ignore"):
            fin = np.isfinite(naive)
            safe = [np.where(fin, v, 0.0) for v in (a, b, c)]
            return np.where(fin, round3(*safe, f), naive)
    s1, e1 = two_sum(a, b)
    s2, e2 = two_sum(e1, c)
    s3, e3 = two_sum(s1, s2)
    # a + b + c = s3 + e3 + e2 with |e3 + e2| below the spacing around s3 in the direction of
    # its sign: round to odd in float64 (53 >= p + 2 bits), then to f (Boldo-Melquiond)
    return rnd(_odd(s3, e3 + e2), f)


def fma_sum(a: np.ndarray, b: np.ndarray, f: Fmt | str, order: str = "seq",
            rng: np.random.Generator | None = None) -> np.ndarray:
    """sum_k a[..., k] * b[..., k] with exact products, every addition rounded to nearest in f,
    in ``order`` (decided on the exact products)."""
    f = FMT[f] if isinstance(f, str) else f
    a, b = np.broadcast_arrays(np.asarray(a, np.float64), np.asarray(b, np.float64))
    p, e = two_prod(a, b)
    if order.startswith("chunk"):
        c = int(order[5:])
        parts = [fma_sum(a[..., k:k + c], b[..., k:k + c], f, "seq")
                 for k in range(0, a.shape[-1], c)]
        return ordered_sum(np.stack(parts, axis=-1), f, "seq")
    if order == "pairwise":
        first = round3(p, e, np.zeros_like(p), f)  # each product rounded once, then a tree
        return ordered_sum(first, f, "pairwise")
    if order.startswith(("greedy", "tree_")) and not np.any(e):
        return ordered_sum(p, f, order)  # exact products: the sum of p is the program
    idx = perm(p, order, rng) if not order.startswith(("greedy", "tree_")) else perm(p, "desc")
    p = np.take_along_axis(p, idx, axis=-1)
    e = np.take_along_axis(e, idx, axis=-1)
    s = round3(p[..., 0], e[..., 0], np.zeros_like(p[..., 0]), f)
    for k in range(1, p.shape[-1]):
        s = round3(s, p[..., k], e[..., k], f)
    return s
