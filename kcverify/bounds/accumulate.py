"""Enclosures of a dot product's accumulation error, for every summation order.

A conforming program forms the products p_k = a_k * b_k of a row and adds them in the
accumulator format (precision p bits, unit roundoff u = 2^-p, every addition rounded to nearest)
in *any* order: any binary tree over the terms. Three enclosures of |computed - sum p_k|, each
sound for every tree; ``dot_error`` returns the smallest that applies.

1. **Classical, products rounded** (operands whose products are not representable in the
   accumulator, e.g. fp32 x fp32): gamma_n * sum |p_k| (Higham, Thm 3.1 with n roundings per
   term).

2. **Exact products, partial sums bounded.** When every product is representable in the
   accumulator (the operands' significands have at most p bits together: fp8 x fp8, fp8 x bf16),
   only the n - 1 additions round. Every exact partial sum of a subset of the terms lies in
   [-N, P] (P = sum of the positive terms, N = sum of |negative terms|), so with M = max(P, N)
   and E the total error, every addition's exact result has magnitude <= M + E, its rounding
   error <= u (M + E), and E <= (n - 1) u (M + E), i.e. E <= (n - 1) u M / (1 - (n - 1) u).

3. **Grains: most of the row adds exactly.** The *grain* g(x) of a float x != 0 is the largest
   power of two dividing it (g(0) = inf). A product of two floats with grains g_a, g_b has grain
   g_a g_b. Take an integer L with M + F(L) < 2^(L+p), where F(L) = sum_k max(0, 2^L - g(p_k))
   (the *fine* terms are those with g(p_k) < 2^L). Then for every summation tree

       |computed - sum p_k| <= F(L).

   Proof. Give each value v that exists during the summation (a term, or a computed partial
   sum) the potential phi(v) = max(0, 2^L - g(v)); the initial total is F(L). Assume first
   that every exact sum x + y formed has |x + y| < 2^(L+p) (checked at the end). An addition
   x + y with g(x) <= g(y):
   * is exact if both grains are >= 2^L (x + y is then a multiple of 2^L below 2^(L+p):
     representable), and exact whenever |x + y| < g(x) 2^p (a multiple of g(x) with at most p
     significant bits). An exact result is a multiple of g(x), so phi(x + y) <= phi(x) <=
     phi(x) + phi(y): the total potential does not grow.
   * Otherwise it rounds, |x + y| >= g(x) 2^p, so its ulp w = ulp(x + y) >= 2 g(x), the error
     is <= w / 2 (round to nearest), and the result is a multiple of w: its potential is
     <= max(0, 2^L - w). The total potential falls by >= (2^L - g(x)) - max(0, 2^L - w)
     >= min(w - g(x), 2^L - g(x)) >= w / 2 (w >= 2 g(x); and 2^L - g(x) >= 2^(L-1) >= w / 2
     because g(x) < 2^L is a power of two and w <= 2^L below 2^(L+p)).
   So each rounding error is paid for by a potential drop of at least its size, and the sum of
   all rounding errors is <= F(L). Finally every exact sum formed is a partial sum of the terms
   plus the errors made inside its subtree: |x + y| <= M + F(L) < 2^(L+p), as assumed (an
   induction on the tree). Additions in the subnormal range are exact and keep multiples of the
   grain, so the argument needs no normal-range assumption; overflow is excluded by the caller.

   Numbers. fp8 e4m3 x e4m3 products have <= 8 significant bits, grains >= 2^-18 and magnitudes
   <= 448^2; with an fp32 accumulator a row whose terms span <= 24 bits (most rows of a dynamic-
   scaled activation times a per-channel-scaled weight) has F(L) = 0: it is exact in every order.
   Rows that mix magnitudes pay only for their few fine terms, instead of (n - 1) u M.

Scaling. The enclosures are in the units the terms have when they enter the accumulator. A
program may enter q_a q_b scaled by a power of two (the exponent of the scales' product): the
grains, M and the error all scale by it exactly (no overflow or underflow assumed; the caller
checks), so the bound in unscaled units times the scale product encloses the scaled program.

Everything here is float64 torch; sums of non-negative terms are padded outward by the float64
error of the summation (K * 2^-52 relative), powers of two are exact.
"""

from __future__ import annotations

import math

import torch

from kcverify.kernels.formats import Format, gamma

_U64 = 2.0**-53


def _pad_sum(x: torch.Tensor, n: int) -> torch.Tensor:
    """An upper bound on the exact value of a float64 sum of n non-negative terms."""
    return x * (1.0 + (n + 2) * 2 * _U64)


def grain_lower(lo: torch.Tensor, hi: torch.Tensor, fmt: Format) -> torch.Tensor:
    """A lower bound on the grain of every value of ``fmt`` in [lo, hi] (its quantum at the
    smallest magnitude in the interval); +inf where the interval is exactly {0}."""
    if fmt.kind != "float":
        raise ValueError(f"grains are defined for float formats, not {fmt.name!r}")
    emin = round(math.log2(fmt.min_normal))
    mig = torch.where((lo <= 0) & (hi >= 0), torch.zeros_like(lo), torch.minimum(lo.abs(), hi.abs()))
    _, e = torch.frexp(mig)  # mig = m 2^e, m in [0.5, 1); 0 -> e = 0
    expo = torch.clamp(e.to(torch.float64) - 1, min=emin)
    expo = torch.where(mig > 0, expo, torch.full_like(expo, emin))
    g = torch.exp2(expo - fmt.mantissa_bits)
    return torch.where((lo == 0) & (hi == 0), torch.full_like(g, math.inf), g)


def pos_neg_sums(a_lo: torch.Tensor, a_hi: torch.Tensor, b_lo: torch.Tensor, b_hi: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Upper bounds on P = sum_k max(0, a_k b_k) and N = sum_k max(0, -a_k b_k) of A @ B over
    the intervals (a positive product is a+ b+ or a- b-, a negative one a+ b- or a- b+)."""
    ap, an = a_hi.clamp_min(0), (-a_lo).clamp_min(0)
    bp, bn = b_hi.clamp_min(0), (-b_lo).clamp_min(0)
    n = a_lo.shape[-1]
    p = _pad_sum(ap @ bp + an @ bn, n)
    q = _pad_sum(ap @ bn + an @ bp, n)
    return p, q


def grain_error(ga: torch.Tensor, gb: torch.Tensor, m: torch.Tensor, precision: int,
                chunk_elems: int = 1 << 22) -> torch.Tensor:
    """Enclosure 3 for A @ B: min over L in {L0, L0 + 1} of F(L) where M + F(L) < 2^(L+p).

    ``ga`` (..., M, K) and ``gb`` (..., K, N) lower-bound the operands' grains, ``m`` (..., M, N)
    upper-bounds max(P, N); inf where no L qualifies (the caller keeps another enclosure)."""
    # L0: the least L with 2^(L+p) > m
    _, e = torch.frexp(m)
    l0 = e.to(torch.float64) - precision  # 2^(e-1) <= m < 2^e = 2^(L0+p)
    best = torch.full_like(m, math.inf)
    k = ga.shape[-1]
    for step in (0.0, 1.0):
        level = torch.exp2(l0 + step)  # 2^L, (..., M, N)
        f = torch.zeros_like(m)
        # F(L) = sum_k relu(2^L - g_a[m, k] g_b[k, n]); K in chunks to bound memory
        rows = max(1, chunk_elems // max(1, m.shape[-1] * m.shape[-2]))
        for k0 in range(0, k, rows):
            g = ga[..., :, None, k0:k0 + rows] * gb[..., k0:k0 + rows, :].transpose(-1, -2)[..., None, :, :]
            f = f + (level[..., None] - g).clamp_min(0).sum(-1)
        f = _pad_sum(f, k)
        ok = (m + f) * (1 + 4 * _U64) < level * 2.0**precision
        best = torch.where(ok, torch.minimum(best, f), best)
    return best


def dot_error(a_lo: torch.Tensor, a_hi: torch.Tensor, b_lo: torch.Tensor, b_hi: torch.Tensor,
              acc: Format, exact_products: bool, ga: torch.Tensor | None = None,
              gb: torch.Tensor | None = None) -> torch.Tensor:
    """An enclosure of |fl(A @ B) - A @ B| per output for every order of accumulation.

    ``exact_products``: every product is representable in ``acc`` (enclosures 2 and 3 apply);
    ``ga``/``gb``: grain lower bounds of the operands (enclosure 3; None skips it)."""
    n = a_lo.shape[-1]
    pos, neg = pos_neg_sums(a_lo, a_hi, b_lo, b_hi)
    if not exact_products:
        return gamma(n, acc.u) * _pad_sum(pos + neg, 2)
    g = gamma(max(n - 1, 0), acc.u)
    m = torch.maximum(pos, neg)
    err = g * m * (1 + 4 * _U64)
    if ga is not None and gb is not None:
        err = torch.minimum(err, grain_error(ga, gb, m, acc.mantissa_bits + 1))
    return err


# --- Hopper FP8 tensor cores (docs/kernels.md, sm90_fp8) -----------------------------------------
SM90_BITS = 13  # fraction bits kept below the group's largest exponent, and in the accumulator
SM90_GROUP = 32


def _chunk_cuts(k: int, promote: int | None, split: int, block_cuts: tuple[int, ...]) -> list[int]:
    """Where a tensor-core accumulation restarts from zero (kernels/realize.py chunk_cuts: the
    split-K parts, aligned to 32, every ``promote`` products within a part, every scale
    block)."""
    from kcverify.kernels.realize import chunk_cuts

    return chunk_cuts(k, promote, split, block_cuts)


def sm90_error(a_mag: torch.Tensor, b_mag: torch.Tensor, floor_a: torch.Tensor,
               floor_b: torch.Tensor, floor_c: torch.Tensor, promote: int | None,
               splits: tuple[int, ...], block_cuts: tuple[int, ...] = (),
               u_acc: float = 2.0**-24) -> torch.Tensor:
    """|computed - exact| of A @ B on Hopper FP8 tensor cores, per output, for every split-K
    configuration in ``splits`` (the max), in the operands' units.

    ``a_mag`` (..., M, K), ``b_mag`` (..., K, N): upper bounds on |a|, |b| (scaled); ``floor_a``
    / ``floor_b`` (broadcastable to the rows of A / columns of B): upper bounds on s 2^emin of
    each operand (a subnormal fp8 value aligns by its format's least exponent); ``floor_c``:
    s_a s_b 2^-126 (the accumulator's least exponent). The scales must be constant along every
    chunk (block cuts are chunk cuts).

    One k-group step c' = RZ13(sum trunc_E(t)) over t in {c, p_1..p_G}, E the largest aligned
    exponent: each term loses less than min(|t|, 2^(E-13)) (truncation toward zero), and the
    sum's rounding toward zero less than 2^-13 |sum| + 2^(-126-13) (the subnormal range). With
    2^E <= max(max_p 2^(e_a + e_b), 2^e_c) <= max(max|a|^ max|b|^, A_prev, floor_c) (x^ =
    max(|x|, floor): the aligned exponent of a subnormal is its format's least) and, since every
    operation rounds toward zero, |c| <= A_prev = sum of the chunk's earlier |p|:

        err_g <= min(A_prev, tau) + min(P_g, G tau) + 2^-13 (A_prev + P_g) + floor_c 2^-13,
        tau = 2^-13 max(m_g, A_prev, floor_c).

    The chunks' results (|v| <= their sum of |p|) are promoted into fp32 and added in any
    order, each possibly rounded on entry (scaled): gamma_(nc+1)(u_acc) sum |p|."""
    k = a_mag.shape[-1]
    t = 2.0**-SM90_BITS
    a_hat = torch.maximum(a_mag, floor_a)
    b_hat = torch.maximum(b_mag, floor_b)
    magn = None
    best = None
    for split in splits:
        cuts = _chunk_cuts(k, promote, split, block_cuts)
        total = None
        nc = 0
        for k0, k1 in zip(cuts[:-1], cuts[1:]):
            if k1 <= k0:
                continue
            nc += 1
            prev = None
            for g0 in range(k0, k1, SM90_GROUP):
                g1 = min(k1, g0 + SM90_GROUP)
                p = a_mag[..., g0:g1] @ b_mag[..., g0:g1, :]
                p = _pad_sum(p, g1 - g0)
                m = a_hat[..., g0:g1].amax(-1, keepdim=True) * b_hat[..., g0:g1, :].amax(-2, keepdim=True)
                a_prev = torch.zeros_like(p) if prev is None else prev
                tau = t * torch.maximum(torch.maximum(m, a_prev), floor_c)
                err = (torch.minimum(a_prev, tau) + torch.minimum(p, (g1 - g0) * tau)
                       + t * (a_prev + p) + t * floor_c)
                total = err if total is None else total + err
                prev = a_prev + p
        if magn is None:
            magn = _pad_sum(a_mag @ b_mag, k)
        e = _pad_sum(total, 4 * k) + gamma(nc + 1, u_acc) * magn
        best = e if best is None else torch.maximum(best, e)
    return best * (1 + 8 * _U64)


def sm90_error_from_magnitude(magn: torch.Tensor, k: int, promote: int | None,
                              splits: tuple[int, ...], floor: torch.Tensor,
                              u_acc: float = 2.0**-24) -> torch.Tensor:
    """sm90_error when only sum |a_k b_k| is known (a caller without the operands): every
    truncation loses at most the term itself, so a group loses at most (1 + 2^-13) of the
    magnitudes it holds, <= (1 + 2^-13) magn + floor; sound and wide."""
    groups = max(1, -(-k // SM90_GROUP)) + 4 * max(splits)
    return (groups * ((1 + 2.0**-SM90_BITS) * magn + floor) + gamma(groups + 1, u_acc) * magn
            ) * (1 + 8 * _U64)
