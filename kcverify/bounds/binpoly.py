"""Exact functions of binary symbols inside the differential zonotope (issue 12).

A straddled fp8 rounding that no analysis can settle (a *tie*: an exact value on a rounding
midpoint, which conforming programs round either way) is a binary symbol b in {-1, +1}
(zonotope.py, ``ZonoTrack.binary_symbols``). Affine maps keep b exactly; a nonlinear map
(LayerNorm's square and rsqrt, softmax's exp and reciprocal, GELU, the next cast) used to
linearise around the centre and put the second-order remainder, a few 1e-3 relative for a full
fp8 spacing, into the noise, where it made the next casts straddle and become new, independent
binary symbols (docs/bounds.md, "Where it stops").

Here a function of binary symbols is kept *exactly*, as a multilinear polynomial (its Walsh
expansion). Write the binary part of a value as sum_S g_S chi_S(b), chi_S = prod_{j in S} b_j
over a set S of *base* symbols (the straddles). Every monomial chi_S is itself a value in
{-1, +1}, so it is a binary symbol of the forms like any other, with its *support* S recorded
(``Monomials``): affine maps need nothing new, and the rules below use the supports:

* products (elementwise and matmul) of two forms multiply their binary parts as polynomials:
  chi_S chi_T = chi_{S xor T} (b_j^2 = 1), so a square of b is the constant 1, not noise; the
  cross terms of two continuous parts, and of a binary part with a continuous part, are bounded
  in absolute value as before;
* a smooth function f of one element whose binary symbols have supports inside a set V of
  k <= ``ENUM_MAX`` base symbols is evaluated on each of the 2^k sign vectors sigma of V:
  f(x) = f(x_sigma + d) with d the continuous part (|d| <= w), so by the mean-value theorem
  f(x) = f(x_sigma) + f'(x_sigma) d + R_sigma, |R_sigma| <= max |f'(hull) - f'(x_sigma)| w. The
  values f(x_sigma) are written exactly as their Walsh expansion sum_T fh_T chi_T(b),
  fh_T = 2^-k sum_sigma f(x_sigma) chi_T(sigma) (an identity on {-1, +1}^k: the characters are an
  orthogonal basis); the continuous part keeps one slope, the mean lam of f'(x_sigma), and
  max_sigma |f'(x_sigma) - lam| w + max_sigma |R_sigma| goes to the noise;
* a cast is evaluated the same way (zonotope._cast_operand): on each sign vector the quotient's
  enclosure must round to one value, and the cast is then the exact polynomial.

Soundness: a monomial symbol's value in every program is the product of its base symbols'
values; rules that treat it as an independent symbol in {-1, +1} (or in [-1, 1]) enclose a
superset; rules that enumerate sign vectors of base symbols substitute that product, which is
exact. Terms dropped (coefficients below ``DROP_REL`` of the element's magnitude, supports
beyond ``DEGREE_MAX``, terms beyond ``TERMS_MAX`` per element group) go to the noise in absolute
value. Every float64 sum carries its error bound (number of terms times 2^-53 times the sum of
magnitudes).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kcverify.bounds.box import pad_hi

F64 = torch.float64
U64 = 2.0**-53
TINY = 2.0**-1000
ENUM_MAX = 14      # base symbols one element may be evaluated on (2^k sign vectors)
DEGREE_MAX = 2     # monomials of larger support (products, Walsh terms) go to the noise
TERMS_MAX = 256    # Walsh terms kept per group of elements with one support (the largest)
ROWS_MAX = 512     # a product of forms with more binary rows than this is linearised (cost)
DROP_REL = 2.0**-40  # a Walsh coefficient below this times the element's magnitude: noise


class Monomials:
    """The supports of the binary symbols of one zonotope run: id -> sorted tuple of base ids
    (a base symbol's support is itself), and the id of each support (one symbol per monomial,
    so that a monomial made in two places is the same symbol and cancels)."""

    def __init__(self) -> None:
        self.support: dict[int, tuple[int, ...]] = {}
        self.by_support: dict[tuple[int, ...], int] = {}

    def base(self, i: int) -> None:
        self.support[i] = (i,)
        self.by_support[(i,)] = i

    def id_of(self, sup: tuple[int, ...], new_id: Callable[[], int]) -> int:
        got = self.by_support.get(sup)
        if got is None:
            got = new_id()
            self.support[got] = sup
            self.by_support[sup] = got
        return got


def xor(s: tuple[int, ...], t: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(sorted(set(s).symmetric_difference(t)))


def _pairs(nza: torch.Tensor, nzb: torch.Tensor) -> list[tuple[int, int]]:
    """The (s, t) whose rows may meet (nza: (ma, e) and nzb: (mb, e) nonzero patterns)."""
    ov = (nza.to(F64) @ nzb.to(F64).T) > 0
    return [tuple(p) for p in torch.nonzero(ov).tolist()]


def poly_product(mono: Monomials, new_id: Callable[[], int], A: torch.Tensor, ida: list[int],
                 B: torch.Tensor, idb: list[int], op: str
                 ) -> tuple[torch.Tensor, torch.Tensor, list[int], torch.Tensor]:
    """(sum_s A_s chi_s) op (sum_t B_t chi_t) for binary rows A (ma, ...) and B (mb, ...), op
    "mul" (elementwise, broadcast) or "matmul": the constant part (chi_s chi_s = 1), the rows of
    the product's monomials and their ids, and the bound of the float64 error plus the terms
    sent to the noise (monomials of support beyond DEGREE_MAX)."""
    if op == "mul":
        shape = torch.broadcast_shapes(A.shape[1:], B.shape[1:])
        Ae, Be = A.expand(A.shape[0], *shape), B.expand(B.shape[0], *shape)
        pairs = _pairs((Ae != 0).reshape(A.shape[0], -1), (Be != 0).reshape(B.shape[0], -1))

        def prod(s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return Ae[s] * Be[t]
        absprod = A.abs().sum(0) * B.abs().sum(0)
        n = 1
    else:
        shape = torch.broadcast_shapes(A.shape[1:-2], B.shape[1:-2]) + (A.shape[-2], B.shape[-1])
        za = (A != 0).any(-2)  # (ma, *batch, K)
        zb = (B != 0).any(-1)
        bshape = shape[:-2]
        za = za.expand(A.shape[0], *bshape, A.shape[-1]).reshape(A.shape[0], -1)
        zb = zb.expand(B.shape[0], *bshape, B.shape[-2]).reshape(B.shape[0], -1)
        pairs = _pairs(za, zb)

        def prod(s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return A[s] @ B[t]
        absprod = A.abs().sum(0) @ B.abs().sum(0)
        n = int(A.shape[-1])
    const = torch.zeros(shape, dtype=F64, device=A.device)
    noise = torch.zeros(shape, dtype=F64, device=A.device)
    targets: dict[int, int] = {}
    tgt_of: list[int] = []
    keep_s, keep_t, drop_s, drop_t = [], [], [], []
    for s, t in pairs:
        sup = xor(mono.support[ida[s]], mono.support[idb[t]])
        if len(sup) > DEGREE_MAX:
            drop_s.append(s)
            drop_t.append(t)
            continue
        keep_s.append(s)
        keep_t.append(t)
        if not sup:
            tgt_of.append(-1)
        else:
            i = mono.id_of(sup, new_id)
            tgt_of.append(targets.setdefault(i, len(targets)))
    rows = torch.zeros((len(targets), *shape), dtype=F64, device=A.device)
    tg = torch.tensor(tgt_of, dtype=torch.int64)
    ks, kt = torch.tensor(keep_s, dtype=torch.int64), torch.tensor(keep_t, dtype=torch.int64)
    step = max(1, 2**22 // max(1, const.numel()))
    for a in range(0, len(keep_s), step):
        p = prod(ks[a:a + step], kt[a:a + step])
        t = tg[a:a + step]
        c = t < 0
        if bool(c.any()):
            const += p[c].sum(0)
        if bool((~c).any()):
            rows.index_add_(0, t[~c], p[~c])
    if drop_s:
        ds, dt = torch.tensor(drop_s), torch.tensor(drop_t)
        for a in range(0, len(drop_s), step):
            noise += prod(ds[a:a + step], dt[a:a + step]).abs().sum(0)
    m = len(pairs) + 4
    err = pad_hi(noise * (1 + (m + n) * U64) + (m + n + 4) * U64 * absprod) + TINY
    ids = [0] * len(targets)
    for i, j in targets.items():
        ids[j] = i
    return const, rows, ids, err


def fwht(v: torch.Tensor, k: int) -> torch.Tensor:
    """Walsh coefficients of values on the 2^k sign vectors (axis 0, sign vector m has
    sigma_j = +1 where bit j of m is set, else -1): out[T] = 2^-k sum_m v[m] chi_T(sigma_m),
    T a bit set of the symbols. Exact in float64 for sums of format values; each pass halves a
    sum of two terms (one rounding each: the caller bounds k (2^k + 2) 2^-53 max |v|)."""
    rest = v.shape[1:]
    x = v.reshape(*([2] * k), *rest) if k else v.reshape(*rest)
    for j in range(k):
        ax = k - 1 - j  # bit j of m is axis k - 1 - j of the (2, .., 2) view (row-major)
        a, b = x.select(ax, 0), x.select(ax, 1)
        x = torch.stack([0.5 * a + 0.5 * b, 0.5 * b - 0.5 * a], ax)
    return x.reshape(1 << k, *rest)


def signs(k: int, device=None) -> torch.Tensor:
    """(2^k, k): sigma_j(m) = +1 where bit j of m is set, else -1."""
    m = torch.arange(1 << k, device=device).reshape(-1, 1)
    bits = (m >> torch.arange(k, device=device).reshape(1, -1)) & 1
    return bits.to(F64) * 2 - 1


class Groups:
    """The elements of a tensor grouped by the set of base symbols their binary rows depend on.

    ``G`` (m, *shape): the binary rows of a form, ``ids`` their ids; ``extra``: base symbols
    every element is evaluated on besides its own (a shared scale's). For each group: the base
    ids V (sorted), the flat element indices, the rows touching it (all with support inside V),
    and chi (2^k, m_V): each row's monomial on each sign vector of V."""

    def __init__(self, mono: Monomials, G: torch.Tensor, ids: list[int],
                 extra: tuple[int, ...] = (), enum_max: int = ENUM_MAX) -> None:
        m = int(G.shape[0])
        shape = tuple(G.shape[1:])
        numel = 1
        for d in shape:
            numel *= d
        bases = sorted({b for i in ids for b in mono.support[i]} | set(extra))
        pos = {b: j for j, b in enumerate(bases)}
        rowsup = torch.zeros((m, len(bases)), dtype=torch.bool)
        for r, i in enumerate(ids):
            for b in mono.support[i]:
                rowsup[r, pos[b]] = True
        nz = (G.reshape(m, numel) != 0).to(F64).T  # (numel, m)
        elemsup = (nz @ rowsup.to(F64)) > 0  # (numel, nb)
        for b in extra:
            elemsup[:, pos[b]] = True
        self.bases = bases
        self.groups: list[tuple[tuple[int, ...], torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.too_big = torch.zeros(numel, dtype=torch.bool)
        if numel == 0 or not bases:
            return
        pats, inv = torch.unique(elemsup, dim=0, return_inverse=True)
        for g in range(int(pats.shape[0])):
            pat = pats[g]
            els = torch.nonzero(inv == g).reshape(-1)
            k = int(pat.sum())
            if k == 0:
                continue
            if k > enum_max:
                self.too_big[els] = True
                continue
            inside = ~(rowsup[:, ~pat].any(1))
            touch = (nz[els].sum(0) > 0) & inside
            rows = torch.nonzero(touch).reshape(-1)
            V = tuple(bases[j] for j in torch.nonzero(pat).reshape(-1).tolist())
            vpos = {b: j for j, b in enumerate(V)}
            sg = signs(k)
            chi = torch.ones((1 << k, int(rows.numel())), dtype=F64)
            for c, r in enumerate(rows.tolist()):
                for b in mono.support[ids[r]]:
                    chi[:, c] = chi[:, c] * sg[:, vpos[b]]
            self.groups.append((V, els, rows, chi))


def walsh_terms(mono: Monomials, new_id: Callable[[], int], V: tuple[int, ...],
                coef: torch.Tensor, mag: torch.Tensor
                ) -> tuple[torch.Tensor, list[int], torch.Tensor, torch.Tensor]:
    """From Walsh coefficients ``coef`` (2^k, E) over V's subsets: the constant (E,), the ids of
    the kept monomials and their rows (t, E), and the absolute sum of the dropped ones (E,):
    coefficients below DROP_REL * mag everywhere, and beyond the TERMS_MAX largest."""
    k = len(V)
    const = coef[0]
    if k == 0:
        return const, [], coef[:0], torch.zeros_like(const)
    rest = coef[1:]
    deg = torch.tensor([bin(T).count("1") for T in range(1, 1 << k)])
    big = (rest.abs() > DROP_REL * mag.unsqueeze(0)).any(1) & (deg <= DEGREE_MAX)
    idx = torch.nonzero(big).reshape(-1)
    if idx.numel() > TERMS_MAX:
        score = rest[idx].abs().sum(1)
        idx = idx[torch.topk(score, TERMS_MAX).indices]
        idx = torch.sort(idx).values
    keep = torch.zeros(rest.shape[0], dtype=torch.bool)
    keep[idx] = True
    dropped = rest[~keep].abs().sum(0) if bool((~keep).any()) else torch.zeros_like(const)
    ids = []
    for T in (idx + 1).tolist():
        sup = tuple(V[j] for j in range(k) if (T >> j) & 1)
        ids.append(mono.id_of(sup, new_id))
    return const, ids, rest[idx], dropped
