"""The differential zonotope domain: affine forms over shared error symbols, for both kernels.

Each float tensor carries, per kernel k (train, inf), a form

    x_k = c_k + sum_s G_k[s] * eps_s + e_k,     eps_s in [-1, 1],  |e_k| <= r_k (elementwise),

where the symbols eps_s are shared by both kernels and by every tensor of the block: a symbol is
one rounding error (or one input coordinate) wherever it flows, so its contributions keep their
signs through LayerNorm, softmax, attention and the next linear layer instead of being added in
absolute value at every step (the wrapping that makes intervals vacuous on transformers). The
drift is the difference of the two forms, (c_i - c_t) + (G_i - G_t) eps +- (r_i + r_t), so what
both kernels share cancels exactly.

Rules follow one pattern: the op's exact real map is applied to the forms (affine ops exactly;
products and smooth nonlinearities by a first-order expansion at the centre plus a remainder
bounded over the tensor's box, DeepZ / DeepT style), and the kernel's own error for the op
(semantics §1.1, the same error bounds the interval rules use) is added to ``r``. ``r`` is the part
without symbols; before an op that mixes elements (a matmul, a normalisation, a reduction) it is
turned into fresh symbols, one per element, so rounding errors keep their signs from there on.
Each form keeps at most ``K_MAX`` symbols and ``ELEMENT_BUDGET`` generator entries: the rows of
least total magnitude are folded into its ``r`` (order reduction; sound: |g eps| <= |g|, and
other tensors may keep the symbol). A form names its symbols (``ids``); binary symbols (values
-1 or +1: a straddled fp8 rounding) are listed in ``ZonoTrack.binary`` (see ``_cast_operand``);
their monomials are binary symbols too, with supports in ``ZonoTrack.mono``, and products,
smooth functions and casts of them are kept exact polynomials (binpoly.py; ``EXACT_BINARY``).

This domain runs beside the interval domain (engine.run_graph's ``zono``): every node is first
bounded by its interval rule; the zonotope rule reads the input boxes (the interval result met
with the forms' concretization) for its relaxations, and the node's box is then met with the
concretization of the new forms (the reduced product). Forms never leave a block: a block's
inputs start as fresh symbols spanning their stored boxes, so ``bound_block`` is still a function
of the stored in_state alone and the checker's re-run derives the same forms.

The verifier's own arithmetic: every form operation adds its float64 rounding error to ``r``
(``fp_err``: a few units of 2^-53 times |c| + sum |G| per elementwise op, (n + 4) 2^-53 |A||B| for
dot products), and concretizations are rounded outward.

Position-local symbols (issue 14). A rounding symbol created at one position of a sequence
touches only that position until attention mixes positions, yet a dense row spans the whole
tensor (seq times the entries). A form therefore has two parts:

    x = c + sum_s Gd[s] eps_{idsd[s]} + sum_j L[j] * eps_{lb[j] + P} + [-r, r],

a dense part (``Gd``, ``idsd``: symbols that may touch several positions) and a local part:
``L`` (kinds, *shape), one row per symbol *kind*, ``lb`` the kinds' base ids and ``P`` (shape,
int64) each element's position, so element e carries L[j, e] eps_{lb[j] + P[e]}: kind j at
position t is the symbol lb[j] + t, a different symbol at each position (a kind reserves the id
range lb[j] .. lb[j] + T - 1 from the tracker's counter, so no id is ever reused).
``local_to_dense`` writes the local part as dense rows (row lb[j] + t = L[j] where P == t);
``Form.G`` / ``ids`` / ``k`` are that dense writing, and ``dense()`` the dense form.

*Where P comes from.* New local symbols (``fresh``: one per element; ``row_symbols``: one per
row of a normalisation) use the form's P, or, on a form without a local part, the rows: every
index of the axes before the last is a position (a (batch, seq, d) tensor: batch x seq
positions). A group of elements sharing one new symbol must lie at one position (checked), and
the groups of one position get kinds 0, 1, ..: so every new symbol is distinct. Soundness never
depends on which P is chosen (any P is a valid naming of distinct symbols); P decides only which
ops can keep the part local. Movement ops (Reshape, Transpose, Slice, Gather, Expand, ...: exact
copies of elements) apply the same map to P as to c, r and every row (``_moved``), so a copied
element keeps its position and hence its symbols.

*Rules.* Elementwise ops of one form (scale, shift, smooth functions, Relu, Neg, the kernel's
error in r) act on L as on Gd, P unchanged (broadcast with the result). Two forms (Add, Sub,
Mul, Div by a form): their local parts are added kind by kind when their P agree (after
broadcasting; kinds paired by base id), otherwise one is written densely first; and a form one
of whose local symbols the other holds densely is written densely too, so that a symbol's
coefficients always meet in one row (kept in two parts, a bound adds their magnitudes: sound but
loses the cancellation). MatMul with a constant (and LayerNorm's sums over the last axis): local
when P is constant along the contracted / summed axis (the output element's position is then
its row's), else the form is made dense first. Everything that mixes positions (a product of two
forms: attention's QK^T and AV; Softmax, Concat, Where, Gemm, Conv, the QDQ rules, a cast
operand that picks per element among options) works on ``dense()``: ``ZonoTrack.step`` hands
the rules not in ``LOCAL_RULES`` dense forms, so a rule that does not know the local part is
correct by construction.

*Concretization and order reduction.* sum_s |G[s]| at element e is sum over dense rows plus
sum_j |L[j, e]| (exactly one local symbol per kind touches e), one summation of kd + kl terms
(``gsum``). The drift pairs the kernels' dense rows by id and their local kinds by base id when
both forms share P (the same kind at the same position is the same symbol), else it writes both
densely. ``cap`` counts dense rows and local kinds alike (each costs numel entries) and folds the
rows of least total magnitude into r, as before. A symbol in both parts of one form (should it
arise) is bounded by |g_dense| + |g_local| and, written densely, by its rounded sum plus that
rounding in r (``dense()``); ``Form.G`` refuses such a form rather than drop the rounding.
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kcverify.bounds import binpoly
from kcverify.bounds import cases as _cases
from kcverify.bounds.binpoly import Monomials
from kcverify.bounds.box import Box, Concrete, mag, mig, pad_hi, pad_lo
from kcverify.bounds.cases import next_up
from kcverify.bounds.registry import RuleCtx
from kcverify.kernels.spec import KernelSpec

U64 = 2.0**-53
TINY = 2.0**-1000
F64 = torch.float64
PRUNE_ZERO_ROWS = True  # matmul operands drop all-zero rows (the same set; False: keep them)
K_MAX = 16384           # symbols one form may keep (order reduction beyond)
ELEMENT_BUDGET = 2**24  # and at most this many generator entries (k * numel) per form


# --- forms ----------------------------------------------------------------------------------
NO_IDS = torch.zeros(0, dtype=torch.int64)
# the tracker whose rule is running (ZonoTrack.step): the form operations read its binary
# symbols' supports to keep functions of them exact (binpoly); None outside a run
_TRACK: contextvars.ContextVar[ZonoTrack | None] = contextvars.ContextVar("kcverify_zono",
                                                                          default=None)
CAST_TRACE: Callable | None = None  # diagnostics: called with each cast operand's choices
# diagnostics: called after each node's rule with (node, output name, the box met with the
# forms, the forms kept: ZState) for every float output that has forms (bench/bounds.py --widths)
STEP_TRACE: Callable | None = None


@dataclass(init=False, eq=False)
class Form:
    """c + sum_s G[s] eps_{ids[s]} + sum_j L[j] eps_{lb[j] + P} + [-r, r]: one kernel's value
    set. The dense part ``Gd`` has the symbol axis first; ``idsd`` (sorted, distinct) names the
    symbols its rows belong to. The position-local part (optional, see "Position-local symbols"
    in the module doc): ``L`` (kinds, *shape), ``lb`` (kinds,) the kinds' base ids, ``P`` (shape,
    int64) each element's position: element e carries L[j, e] * eps_{lb[j] + P[e]}.

    ``G``, ``ids`` and ``k`` are the form written densely (one row per symbol, computed once):
    a rule that does not know the local part reads those and gets the exact same set."""

    c: torch.Tensor
    Gd: torch.Tensor
    r: torch.Tensor
    idsd: torch.Tensor
    L: torch.Tensor | None
    lb: torch.Tensor | None
    P: torch.Tensor | None

    def __init__(self, c: torch.Tensor, G: torch.Tensor, r: torch.Tensor, ids: torch.Tensor,
                 L: torch.Tensor | None = None, lb: torch.Tensor | None = None,
                 P: torch.Tensor | None = None) -> None:
        if tuple(G.shape[1:]) != tuple(c.shape):  # a row broadcast over the result (f_add)
            G = G.expand(int(G.shape[0]), *c.shape)
        self.c, self.Gd, self.r, self.idsd = c, G, r, ids
        if L is not None and int(L.shape[0]) == 0:
            L = lb = P = None
        self.L, self.lb, self.P = L, lb, P
        self._gs: torch.Tensor | None = None
        self._dense: tuple[torch.Tensor, torch.Tensor, bool] | None = None

    # the two parts
    @property
    def kd(self) -> int:
        return int(self.Gd.shape[0])

    @property
    def kl(self) -> int:
        return 0 if self.L is None else int(self.L.shape[0])

    def _densified(self) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(G, ids, whether a symbol was in both parts: its two coefficients were added)."""
        if self._dense is None:
            if self.L is None:
                self._dense = (self.Gd, self.idsd, False)
            else:
                self._dense = _dense_writing(self.Gd.expand(self.kd, *self.shape), self.idsd,
                                             self.L, self.lb, self.P)
        return self._dense

    def _dense_view(self, i: int) -> torch.Tensor:
        d = self._densified()
        if d[2]:  # the merged coefficients were rounded: only dense() accounts for that
            raise AssertionError("a symbol in both parts of a form: read it through dense()")
        return d[i]

    @property
    def G(self) -> torch.Tensor:
        return self.Gd if self.L is None else self._dense_view(0)

    @property
    def ids(self) -> torch.Tensor:
        return self.idsd if self.L is None else self._dense_view(1)

    @property
    def k(self) -> int:
        return int(self.G.shape[0])

    def dense(self) -> Form:
        """The same form with every symbol in the dense part."""
        if self.L is None:
            return self
        G, ids, merged = self._densified()
        if merged:  # fl(a + b) per merged coefficient: |error| <= u |fl(a + b)| (1 + u)
            r = pad_hi(self.r + 4 * U64 * _l1(G)) + TINY
            return Form(self.c, G, r, ids)
        out = Form(self.c, G, self.r, ids)
        out._gs = self._gs  # the split form's gsum bounds the merged one's (no merged rows)
        return out

    def local_ids(self) -> torch.Tensor:
        """The ids of the local part's symbols present (lb[j] + t for t in P)."""
        if self.L is None:
            return NO_IDS
        if getattr(self, "_lids", None) is None:
            tv = torch.unique(self.P).to(self.lb.device)
            self._lids = (self.lb.reshape(-1, 1) + tv.reshape(1, -1)).reshape(-1)
        return self._lids

    def dpart(self) -> Form:
        """The dense part alone (with c and r): for the helpers that pair dense rows by id."""
        return self if self.L is None else Form(self.c, self.Gd, self.r, self.idsd)

    def with_r(self, r: torch.Tensor) -> Form:
        """The same symbols (both parts) and centre, another r."""
        out = Form(self.c, self.Gd, r, self.idsd, self.L, self.lb, self.P)
        out._gs = self._gs
        out._dense = self._dense
        return out

    def local_like(self, c: torch.Tensor, Gd: torch.Tensor, r: torch.Tensor,
                   L: torch.Tensor | None, P: torch.Tensor | None,
                   gs: torch.Tensor | None = None) -> Form:
        """A form over this form's dense symbols and local kinds (L, P: the new local part)."""
        out = Form(c, Gd, r, self.idsd, L, self.lb if L is not None else None, P)
        out._gs = gs
        return out

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.c.shape)

    def like(self, c: torch.Tensor, G: torch.Tensor, r: torch.Tensor,
             gs: torch.Tensor | None = None) -> Form:
        """A form over the same symbols written densely (``G`` has ``self.k`` rows, ordered as
        ``self.ids``); ``gs``: an upper bound of sum_s |G[s]| already known (an exact movement
        of this form's, or its scaling: see ``scaled_gsum``)."""
        out = Form(c, G, r, self.ids)
        out._gs = gs
        return out

    def scaled_gsum(self, s: torch.Tensor) -> torch.Tensor:
        """An upper bound of sum_s |fl(G[s] * s)| without a pass over G: each product is at
        most |g||s|(1 + u), and this form's gsum bounds sum |g| (one more rounding here)."""
        return pad_hi(self.gsum() * s.abs() * (1 + 4 * U64)) + TINY

    def gsum(self) -> torch.Tensor:
        """Upper bound of sum_s |G[s]| over both parts (float64 sum error included: the two
        parts' sums and their addition are one order of summing kd + kl terms)."""
        if self._gs is None:  # forms are never modified in place: computed once
            self._gs = _gsum(self.c, self.Gd, self.L)
        return self._gs

    def rad(self) -> torch.Tensor:
        return pad_hi(self.gsum() + self.r)

    def bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Concretization; a non-finite centre is an exact infinity (a masked entry)."""
        rad = self.rad()
        fin = torch.isfinite(self.c)
        return (torch.where(fin, pad_lo(self.c - rad), self.c),
                torch.where(fin, pad_hi(self.c + rad), self.c))

    def reshape(self, shape: tuple[int, ...]) -> Form:
        """The same form with the tensor reshaped (an exact movement: positions move along)."""
        shape = tuple(shape)
        out = Form(self.c.reshape(shape), self.Gd.reshape(self.kd, *shape), self.r.reshape(shape),
                   self.idsd, None if self.L is None else self.L.reshape(self.kl, *shape),
                   self.lb, None if self.P is None else self.P.reshape(shape))
        out._gs = self._gs.reshape(shape) if self._gs is not None else None
        return out

    def view(self, rank: int) -> Form:
        """Leading singleton axes so that the tensor has ``rank`` axes (numpy broadcasting)."""
        extra = rank - self.c.dim()
        if extra <= 0:
            return self
        return self.reshape((1,) * extra + self.shape)

    def without_zero_rows(self) -> Form:
        """The same form without the symbols whose coefficients are all zero (dense rows, local
        kinds): the same set exactly (0 * eps = 0). A matmul's cast operand (``_matmul_core``)
        is the dense writing of its local kinds (one row per kind and position, zero off that
        position) with the rows picked per element (the image box, a point or a new flip zero
        an element's rows): on the fp8-deploy decoder most of its rows are zero, and every later
        op and sum ran over them. ``gsum`` is kept when known: it bounds the same sum (the
        dropped rows add exact zeros). Bounds downstream change only by the float64 roundings
        of shorter sums, and where a cost limit counted zero rows (``binpoly.ROWS_MAX``: an
        exact product instead of its linearisation): both sound. ``PRUNE_ZERO_ROWS``."""
        kd, kl = self.kd, self.kl
        keep_d = _nonzero_rows(self.Gd) if kd else None
        keep_l = _nonzero_rows(self.L) if kl else None
        if ((keep_d is None or bool(keep_d.all())) and (keep_l is None or bool(keep_l.all()))):
            return self
        Gd, idsd = self.Gd, self.idsd
        if keep_d is not None and not bool(keep_d.all()):
            Gd, idsd = Gd[keep_d], idsd[keep_d.to(idsd.device)]
        L, lb = self.L, self.lb
        if keep_l is not None and not bool(keep_l.all()):
            L, lb = L[keep_l], lb[keep_l.to(lb.device)]
        out = Form(self.c, Gd, self.r, idsd, L, lb, self.P)
        out._gs = self._gs
        return out

    def cap(self, m: int) -> Form:
        """At most m rows (dense symbols + local kinds): the rows of least total magnitude are
        folded into r (sound: |g eps| <= |g|; other tensors may keep those symbols)."""
        kd, kl = self.kd, self.kl
        if kd + kl <= m:
            return self
        if kl == 0:
            keep, drop = _top_rows(_row_l1(self.Gd), m)
            extra = _l1(self.Gd, rows=drop) * (1 + (kd + 2) * U64)
            return Form(self.c, self.Gd[keep], pad_hi(self.r + extra) + TINY,
                        self.idsd[keep.to(self.idsd.device)])
        score = torch.cat([_row_l1(self.Gd), _row_l1(self.L)]) if kd else _row_l1(self.L)
        keep, drop = _top_rows(score, m)
        kd_keep, kl_keep = keep[keep < kd], keep[keep >= kd] - kd
        kd_drop, kl_drop = drop[drop < kd], drop[drop >= kd] - kd
        extra = _l1(self.L, rows=kl_drop)
        if kd_drop.numel():
            extra = extra + _l1(self.Gd, rows=kd_drop)
        extra = extra * (1 + (kd + kl + 2) * U64)
        dev = self.Gd.device
        return Form(self.c, self.Gd[kd_keep.to(dev)], pad_hi(self.r + extra) + TINY,
                    self.idsd[kd_keep.to(self.idsd.device)], self.L[kl_keep.to(dev)],
                    self.lb[kl_keep.to(self.lb.device)], self.P)


def _nonzero_rows(G: torch.Tensor) -> torch.Tensor:
    """Per row (symbol axis first), whether some coefficient is not zero (NaN counts)."""
    return G.reshape(int(G.shape[0]), -1).any(1)


def _gsum(c: torch.Tensor, Gd: torch.Tensor, L: torch.Tensor | None,
          rows: torch.Tensor | None = None) -> torch.Tensor:
    """Form.gsum of the form with dense part ``Gd`` (only its rows ``rows``, when given: the
    same number as the form of those rows, without copying them out) and local part ``L``."""
    kd = int(Gd.shape[0]) if rows is None else int(rows.numel())
    kl = 0 if L is None else int(L.shape[0])
    if kd + kl == 0:
        return torch.zeros_like(c)
    if kl == 0:
        return _l1(Gd, rows=rows) * (1 + (kd + 2) * U64) + TINY
    acc = _l1(L)
    if kd:
        acc = acc + _l1(Gd, rows=rows)
    return acc * (1 + (kd + kl + 2) * U64) + TINY


def local_to_dense(L: torch.Tensor, lb: torch.Tensor, P: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The local part written densely: the row of symbol lb[j] + t is L[j] where P == t and 0
    elsewhere (sorted ids; one row per kind and position present in P)."""
    shape = tuple(L.shape[1:])
    P = P.expand(shape)
    tv = torch.unique(P)
    mask = (P.unsqueeze(0) == tv.reshape(-1, *([1] * len(shape)))).to(L.dtype)
    Ld = (L.unsqueeze(1) * mask.unsqueeze(0)).reshape(-1, *shape)
    lids = (lb.reshape(-1, 1) + tv.to(lb.device).reshape(1, -1)).reshape(-1)
    order = torch.argsort(lids)
    return Ld[order.to(Ld.device)], lids[order]


def _dense_writing(Gd: torch.Tensor, idsd: torch.Tensor, L: torch.Tensor, lb: torch.Tensor,
                   P: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``_merge_rows([Gd, local_to_dense(L, lb, P)])`` written in one pass (the same rows, ids
    and flag): one zeroed result, the dense rows copied to their sorted places and each local
    coefficient L[j, e] scattered to row (kind j, position P[e]), instead of the kinds times
    positions masked products, their reordering, the join and its reordering (four copies of
    the dense writing; profile in docs/bounds.md "Speed"). Entries are copies of L, Gd or zero
    (an entry the masked product wrote as L * 0 = -0.0 is +0.0 here: the same number)."""
    shape = tuple(L.shape[1:])
    kd, kl = int(idsd.numel()), int(L.shape[0])
    P = P.expand(shape)
    tv = torch.unique(P)
    lids = (lb.reshape(-1, 1) + tv.to(lb.device).reshape(1, -1)).reshape(-1)
    u, inv = torch.unique(torch.cat([idsd, lids]), return_inverse=True)
    if u.numel() != kd + lids.numel():  # a symbol in both parts: its rows are added
        Ld, lids = local_to_dense(L, lb, P)
        return _merge_rows([Gd, Ld], [idsd, lids])
    numel = math.prod(shape)
    out = torch.zeros((int(u.numel()), numel), dtype=L.dtype, device=L.device)
    inv = inv.to(L.device)
    if kd:
        out[inv[:kd]] = Gd.reshape(kd, numel)
    tpos = torch.searchsorted(tv, P.reshape(-1).contiguous())  # each element's position's index in tv
    rows = inv[kd:].reshape(kl, int(tv.numel()))[:, tpos.to(L.device)]
    out.scatter_(0, rows, L.reshape(kl, numel))
    return out.reshape(-1, *shape), u, False


def _merge_rows(Gs: list[torch.Tensor], idss: list[torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Rows of several blocks joined by symbol id (sorted), and whether some symbol was in two
    blocks (its rows were added: rounded, see Form.dense). Distinct ids: each block is copied
    once to its sorted places (no join and reordering: two copies of the result)."""
    ids = torch.cat(idss)
    u, inv = torch.unique(ids, return_inverse=True)
    if u.numel() == ids.numel():
        shape = Gs[0].shape[1:]
        out = torch.empty((int(u.numel()), *shape), dtype=Gs[0].dtype, device=Gs[0].device)
        inv = inv.to(out.device)
        start = 0
        for G, i in zip(Gs, idss):
            n = int(i.numel())
            if n:
                out[inv[start:start + n]] = G
            start += n
        return out, u, False
    G = torch.cat(Gs, 0)
    out = torch.zeros((u.numel(), *G.shape[1:]), dtype=G.dtype, device=G.device)
    out.index_add_(0, inv.to(G.device), G)
    return out, u, True


def _row_l1(G: torch.Tensor) -> torch.Tensor:
    """sum_e |G[s, e]| per symbol s (the order-reduction score; no bound depends on it)."""
    return torch.linalg.vector_norm(G.reshape(G.shape[0], -1), 1, dim=1)


def _top_rows(score: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The indices of the m largest scores and of the rest, each in increasing order."""
    keep = torch.sort(torch.topk(score, m).indices).values
    drop = torch.ones(score.numel(), dtype=torch.bool, device=score.device)
    drop[keep] = False
    return keep, torch.nonzero(drop).reshape(-1)


L1_CHUNK = 2**16  # entries per chunk of the symbol-axis sums (small temporaries: see _l1)


def _l1(G: torch.Tensor, H: torch.Tensor | None = None, rows: torch.Tensor | None = None,
        hrows: torch.Tensor | None = None) -> torch.Tensor:
    """sum_s |G[s]| (or sum_s |G[s] - H[s]|; ``rows``/``hrows``: only those rows of G / H,
    paired in order), summed over the symbol axis in chunks. A pass over the whole form at once
    allocates a temporary as large as the form, and a fresh large allocation costs more (page
    faults) than the arithmetic; vector_norm along axis 0 is slower still. Every chunk order is
    one order of summing k non-negative terms: the callers' factor (1 + (k + 2) 2^-53) covers
    it (and the one rounding of each difference)."""
    k = int(G.shape[0]) if rows is None else int(rows.numel())
    shape = torch.broadcast_shapes(G.shape[1:], H.shape[1:]) if H is not None else G.shape[1:]
    acc = torch.zeros(shape, dtype=G.dtype, device=G.device)
    if k == 0:
        return acc
    step = max(1, L1_CHUNK // max(1, acc.numel()))
    for s in range(0, k, step):
        part = G[s:s + step] if rows is None else G[rows[s:s + step].to(G.device)]
        if H is not None:
            part = part - (H[s:s + step] if hrows is None else H[hrows[s:s + step].to(H.device)])
        acc += part.abs().sum(0)
    return acc


def _l1_disjoint(a: Form, b: Form) -> torch.Tensor:
    """Upper bound of sum_s |a.G[s] - b.G[s]| over the union of their symbols, without building
    the union: the rows of symbols only one form has contribute |g| (their gsum when no symbol
    is shared), the shared ones |g_a - g_b|."""
    if a.k == 0 or b.k == 0:
        return (a.gsum() if b.k == 0 else b.gsum()).expand(
            torch.broadcast_shapes(a.c.shape, b.c.shape))
    sa = torch.isin(a.ids, b.ids)
    if not bool(sa.any()):
        return a.gsum() + b.gsum()
    sb = torch.isin(b.ids, a.ids)
    ia = torch.nonzero(sa).reshape(-1)
    b_ids, perm = torch.sort(b.ids)  # ids are distinct: match each shared id of a in b
    ib = perm[torch.searchsorted(b_ids, a.ids[ia])]
    only_a = _l1(a.G, rows=torch.nonzero(~sa).reshape(-1))
    only_b = _l1(b.G, rows=torch.nonzero(~sb).reshape(-1))
    k = a.k + b.k
    return (only_a + only_b + _l1(a.G, b.G, ia, ib)) * (1 + (k + 2) * U64) + TINY


def combine(a: Form, b: Form, sign: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """a.G + sign * b.G over the union of their symbols (same shapes), and the union."""
    if a.ids is b.ids or (a.k == b.k and bool(torch.equal(a.ids, b.ids))):
        return (a.G + b.G if sign == 1.0 else a.G - b.G), a.ids
    if b.k == 0:
        return a.G, a.ids
    if a.k == 0:
        return (b.G if sign == 1.0 else -b.G), b.ids
    u = torch.unique(torch.cat([a.ids, b.ids]))
    shape = torch.broadcast_shapes(a.G.shape[1:], b.G.shape[1:])
    if a.k == u.numel():
        out = a.G.expand(a.k, *shape).clone()
        out.index_add_(0, torch.searchsorted(u, b.ids).to(out.device), b.G.expand(b.k, *shape),
                       alpha=sign)
        return out, u
    if b.k == u.numel():
        out = b.G.expand(b.k, *shape) * sign
        out.index_add_(0, torch.searchsorted(u, a.ids).to(out.device), a.G.expand(a.k, *shape))
        return out, u
    out = torch.zeros((u.numel(), *shape), dtype=F64, device=a.G.device)
    out.index_add_(0, torch.searchsorted(u, a.ids).to(out.device), a.G.expand(a.k, *shape))
    out.index_add_(0, torch.searchsorted(u, b.ids).to(out.device), b.G.expand(b.k, *shape),
                   alpha=sign)
    return out, u


def _row_positions(shape: tuple[int, ...], device: Any = None) -> torch.Tensor:
    """The default position map: every row (all axes but the last) its own position."""
    if len(shape) == 0:
        return torch.zeros((), dtype=torch.int64, device=device)
    rows = math.prod(shape[:-1])
    return torch.arange(rows, device=device).reshape(*shape[:-1], 1).expand(shape)


def _ranks(v: torch.Tensor) -> torch.Tensor:
    """For a 1-D integer tensor, each entry's rank among the entries of equal value (0, 1, ..
    in index order)."""
    if v.numel() == 0:
        return v.clone()
    sv, order = torch.sort(v, stable=True)
    first = torch.searchsorted(sv, sv)  # the first index of each value in sorted order
    rank = torch.empty_like(v)
    rank[order] = torch.arange(v.numel(), device=v.device) - first
    return rank


def const_form(v: torch.Tensor, r: torch.Tensor | None = None) -> Form:
    v = v.to(F64)
    return Form(v, torch.zeros((0, *v.shape), dtype=F64, device=v.device),
                torch.zeros_like(v) if r is None else r, NO_IDS)


def align(forms: list[Form]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The forms' G over the union of their symbols (zero rows where a form lacks one)."""
    ref = forms[0].ids
    if all(f.ids is ref or (f.k == ref.numel() and bool(torch.equal(f.ids, ref))) for f in forms):
        return [f.G for f in forms], ref
    u = torch.unique(torch.cat([f.ids for f in forms]))
    out = []
    for f in forms:
        if f.k == u.numel():
            out.append(f.G)
            continue
        g = torch.zeros((u.numel(), *f.shape), dtype=F64, device=f.c.device)
        if f.k:
            g[torch.searchsorted(u, f.ids).to(g.device)] = f.G
        out.append(g)
    return out, u


@dataclass
class ZState:
    """Both kernels' forms of one tensor (symbols shared)."""

    t: Form
    i: Form

    def forms(self) -> tuple[Form, Form]:
        return self.t, self.i

    def drift_bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        fi, ft = self.i, self.t
        c = fi.c - ft.c
        gl = None
        if fi.L is not None or ft.L is not None:
            same_p = (fi.L is not None and ft.L is not None
                      and (fi.P is ft.P or torch.equal(fi.P, ft.P))
                      and not bool(torch.isin(fi.idsd, ft.local_ids()).any())
                      and not bool(torch.isin(ft.idsd, fi.local_ids()).any()))
            if not same_p:  # one position map, or none: pair every symbol densely
                fi, ft = fi.dense(), ft.dense()
            else:  # sum_s |a_s - b_s| <= dense part's + local part's (a symbol in both parts)
                li = Form(fi.c, fi.L, fi.r, fi.lb)
                lt = Form(ft.c, ft.L, ft.r, ft.lb)
                if fi.lb is ft.lb or (fi.kl == ft.kl and bool(torch.equal(fi.lb, ft.lb))):
                    gl = _l1(fi.L, ft.L) * (1 + (fi.kl + 2) * U64) + TINY
                else:
                    gl = _l1_disjoint(li, lt)
                fi, ft = fi.dpart(), ft.dpart()
        if fi.ids is ft.ids or (fi.k == ft.k and bool(torch.equal(fi.ids, ft.ids))):
            k = fi.k  # the same symbols: no union to build
            g = _l1(fi.G, ft.G) * (1 + (k + 2) * U64)
        else:  # rows of symbols only one form has add |g|; shared ones |g_i - g_t|
            k = fi.k + ft.k
            g = _l1_disjoint(fi, ft)
        if k == 0:
            g = torch.zeros_like(c)
        if gl is not None:
            g = pad_hi(g + gl)
        fin = torch.isfinite(self.t.c) & torch.isfinite(self.i.c)
        both = (self.t.c == self.i.c) & ~fin  # the same infinity: no drift
        mags = torch.where(fin, self.i.c.abs() + self.t.c.abs(), torch.zeros_like(c))
        rad = pad_hi(g + ft.r + fi.r + 2 * U64 * mags + TINY)
        c = torch.where(both, torch.zeros_like(c), c)
        rad = torch.where(both, torch.zeros_like(rad), rad)
        return pad_lo(c - rad), pad_hi(c + rad)


def _local_pair(a: Form, b: Form, shape: tuple[int, ...]
                ) -> tuple[Form, Form, tuple | None]:
    """The local parts of two forms (same rank) over one position map: (a, b, (La, Lb, lb, P))
    with La / Lb (None: no local part) over the union ``lb`` of their kinds and P, all broadcast
    to ``shape``; or (a, b, None) when neither has one. Where both have local parts whose
    positions differ, b's is first written densely (the same set: b.dense()); then a form whose
    local symbols the other has densely is written densely too."""
    if a.L is None and b.L is None:
        return a, b, None
    if a.L is not None and b.L is not None:
        if not (a.P is b.P or torch.equal(a.P.expand(shape), b.P.expand(shape))):
            b = b.dense()
    # a symbol local in one form and dense in the other: both dense, so that its coefficients
    # add in one row (kept apart, the sum's bound would add their magnitudes)
    if a.L is not None and b.kd and bool(torch.isin(b.idsd, a.local_ids()).any()):
        a = a.dense()
    if b.L is not None and a.kd and bool(torch.isin(a.idsd, b.local_ids()).any()):
        b = b.dense()
    if a.L is None and b.L is None:
        return a, b, None
    if b.L is None:
        return a, b, (a.L.expand(a.kl, *shape), None, a.lb, a.P.expand(shape))
    if a.L is None:
        return a, b, (None, b.L.expand(b.kl, *shape), b.lb, b.P.expand(shape))
    P = a.P.expand(shape)
    if a.lb is b.lb or (a.kl == b.kl and bool(torch.equal(a.lb, b.lb))):
        return a, b, (a.L.expand(a.kl, *shape), b.L.expand(b.kl, *shape), a.lb, P)
    u = torch.unique(torch.cat([a.lb, b.lb]))
    out = []
    for f in (a, b):
        g = torch.zeros((u.numel(), *shape), dtype=F64, device=f.c.device)
        g[torch.searchsorted(u, f.lb).to(g.device)] = f.L.expand(f.kl, *shape)
        out.append(g)
    return a, b, (out[0], out[1], u, P)


def _cat_local(loc: tuple | None, L: torch.Tensor | None) -> tuple:
    """(L, lb, P) of a result from _local_pair's tuple and the result's local rows."""
    if loc is None or L is None:
        return None, None, None
    return L, loc[2], loc[3]


def fp_err(f: Form, mult: float) -> Form:
    """Add the float64 error of an elementwise form operation (mult units of 2^-53 relative)."""
    m = torch.where(torch.isfinite(f.c), f.c.abs(), torch.zeros_like(f.c))
    return f.with_r(f.r + pad_hi(mult * U64 * (m + f.gsum()) + TINY))


BOX_LOOSER = 4.0  # a form this many times wider than its box gives way to the box (per element)
EXACT_BINARY = True  # keep functions of binary symbols exact (binpoly); False: linearise


def _binary_track() -> ZonoTrack | None:
    """The running tracker when it has binary symbols (else None: nothing to keep exact)."""
    zt = _TRACK.get()
    return zt if EXACT_BINARY and zt is not None and zt._bin else None


def _bin_mask(zt: ZonoTrack, ids: torch.Tensor) -> torch.Tensor:
    return torch.isin(ids, zt.binary) if ids.numel() else torch.zeros(0, dtype=torch.bool)


def _cont_rad(f: Form, bm: torch.Tensor) -> torch.Tensor:
    """An upper bound of the form's continuous part: every symbol but the binary rows ``bm``
    of its dense part (the local part is never binary), plus r."""
    return pad_hi(_gsum(f.c, f.Gd, f.L, torch.nonzero(~bm).reshape(-1)) + f.r)


ROW_BUDGET = True  # past ROWS_MAX binary rows: keep the largest exact, the rest linear


def _row_budget(G: torch.Tensor, bm: torch.Tensor) -> torch.Tensor | None:
    """The binary rows ``bm`` of G cut to the ``binpoly.ROWS_MAX`` of largest sum_e |G[s, e]|;
    None where there are more and
    ROW_BUDGET is off (the caller then linearises everything). A binary symbol is a value in
    {-1, +1}, so in [-1, 1]: a rule may treat any of them as a continuous symbol (its row stays
    a linear term of the form, its |g| counts in the continuous radius, _cont_rad) and enclose a
    superset; the exact rules (smooth functions and casts on sign vectors; products keep their
    cap, _exact_product) then see only the rows kept, and their supports. Decoder eval input 0:
    positions 2, 4, 8, 9 of the logits 12.1 / 29.8 / 10.8 / 35.7 -> 5.7 / 21.2 / 6.5 / 23.6 at
    the same CPU time (the maximum, 45.19, is a late position's and does not move)."""
    n = int(bm.sum())
    if n <= binpoly.ROWS_MAX:
        return bm
    if not ROW_BUDGET:
        return None
    idx = torch.nonzero(bm).reshape(-1)
    sel = idx.to(G.device)
    score = G[sel].abs().reshape(n, -1).sum(1)
    top = idx[torch.topk(score.cpu(), binpoly.ROWS_MAX).indices]
    out = torch.zeros_like(bm)
    out[top] = True
    return out


def _bin_abs(G: torch.Tensor) -> torch.Tensor:
    """An upper bound of sum_s |G[s]| (rows of binary symbols)."""
    return pad_hi(_l1(G) * (1 + (int(G.shape[0]) + 2) * U64)) + TINY


def _exact_product(zt: ZonoTrack, a: Form, b: Form, ga: torch.Tensor, gb: torch.Tensor,
                   u: torch.Tensor, op: str) -> tuple[torch.Tensor, torch.Tensor,
                                                      list[int], torch.Tensor] | None:
    """The product of the binary parts of a and b (their dense rows ``ga`` / ``gb`` over the
    ids ``u``) as a polynomial (binpoly.poly_product), and the remainder that replaces
    rad(a) rad(b): |A|_1 radc(b) + radc(a) rad(b) (A the binary part of a, radc the rest). None
    when one of them has no binary row (then rad(a) rad(b) is that remainder already)."""
    bm = _bin_mask(zt, u)
    if not bool(bm.any()):
        return None
    bmd = bm.to(ga.device)
    A, B = ga[bmd], gb[bmd]
    if not (bool((A != 0).any()) and bool((B != 0).any())):
        return None
    if int(A.shape[0]) > binpoly.ROWS_MAX:  # the cost of the pairs: linearise instead
        # (not _row_budget: 512 x 512 rows make up to 131,072 monomials, and the decoder's eval
        # input 1 went from 48 to 112 CPU s for 91,332 -> 90,789)
        return None
    ids = u[bm].tolist()
    const, rows, rids, err = binpoly.poly_product(zt.mono, zt.new_monomial_id, A, ids, B, ids, op)
    abs_a = _bin_abs(A)
    rc_a, rc_b = _cont_rad(a, _bin_mask(zt, a.idsd)), _cont_rad(b, _bin_mask(zt, b.idsd))
    rad_b = b.rad()
    if op == "mul":
        rem = abs_a * rc_b + rc_a * rad_b
    else:
        n = int(a.c.shape[-1])
        rem = (abs_a @ rc_b + rc_a @ rad_b) * (1 + (n + 4) * U64)
    rem = pad_hi(rem + err) + TINY
    return const, rows, rids, rem


def _with_rows(f: Form, rows: torch.Tensor, ids: list[int]) -> Form:
    """f plus the rows ``rows`` of the symbols ``ids`` in its dense part (a symbol f already
    has: its row is added, rounded: |error| <= u |sum| per entry, into r)."""
    if not ids:
        return f
    G, u, merged = _merge_rows([f.Gd.expand(f.kd, *f.shape), rows.expand(len(ids), *f.shape)],
                               [f.idsd, torch.tensor(ids, dtype=torch.int64)])
    r = f.r
    if merged:
        r = pad_hi(r + 2 * U64 * _l1(G)) + TINY
    return Form(f.c, G, r, u, f.L, f.lb, f.P)


def f_add(a: Form, b: Form, sign: float = 1.0) -> Form:
    rank = max(a.c.dim(), b.c.dim())
    a, b = a.view(rank), b.view(rank)
    shape = torch.broadcast_shapes(a.shape, b.shape)
    a, b, loc = _local_pair(a, b, shape)
    G, u = combine(a.dpart(), b.dpart(), sign)
    L = None
    if loc is not None:
        La, Lb = loc[0], loc[1]
        L = (La if Lb is None else (Lb * sign if La is None
                                    else (La + Lb if sign == 1.0 else La - Lb)))
    return fp_err(Form(a.c + sign * b.c, G, a.r + b.r, u, *_cat_local(loc, L)), 4)


def f_scale(a: Form, s: torch.Tensor) -> Form:
    """a * s for an exact constant s (broadcast)."""
    s = s.to(F64)
    rank = max(a.c.dim(), s.dim())
    a = a.view(rank)
    c = a.c * s
    L = a.L * s if a.L is not None else None
    P = a.P.expand(c.shape) if a.L is not None else None
    return fp_err(a.local_like(c, a.Gd * s, a.r * s.abs(), L, P, a.scaled_gsum(s)), 4)


def f_shift(a: Form, s: torch.Tensor) -> Form:
    s = s.to(F64)
    rank = max(a.c.dim(), s.dim())
    a = a.view(rank)
    c = a.c + s
    z = torch.zeros_like(s)
    L = a.L + z if a.L is not None else None
    P = a.P.expand(c.shape) if a.L is not None else None
    return fp_err(a.local_like(c, a.Gd + z, a.r + z, L, P), 4)


PRODUCT_SECOND_ORDER = True  # f_mul: the remainder by polarization, centred (below)


def _l1_pm(ga: torch.Tensor, gb: torch.Tensor, t: torch.Tensor, sign: float) -> torch.Tensor:
    """sum_s |t ga[s] + sign gb[s] / t| in chunks (t a power of two: the scalings are exact;
    the one rounding of each sum and the summation: the caller's factor)."""
    acc = torch.zeros(torch.broadcast_shapes(ga.shape[1:], gb.shape[1:], t.shape),
                      dtype=F64, device=t.device)
    k = int(ga.shape[0])
    step = max(1, L1_CHUNK // max(1, acc.numel()))
    ti = 1.0 / t
    for i in range(0, k, step):
        acc += (ga[i:i + step] * t + sign * (gb[i:i + step] * ti)).abs().sum(0)
    return acc


def _product_remainder(a: Form, b: Form, ga: torch.Tensor, gb: torch.Tensor,
                       loc: tuple | None, same: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(shift, half): the second-order term da db of a product (da = a - ca, db = b - cb) lies
    in shift +- half. Polarization: for any t > 0, da db = ((t da + db/t)^2 - (t da - db/t)^2)/4,
    so da db in [-rad(t da - db/t)^2 / 4, rad(t da + db/t)^2 / 4], the radii taken over the
    *combined* generators (a symbol both share adds its coefficients before the absolute value)
    plus t r_a + r_b / t (the noise parts, independent). With t = 2^round(log2 sqrt(rad_b /
    rad_a)) (exact scalings) each end is at most (sqrt 2 + 1/sqrt 2)^2 / 4 = 1.125 rad_a rad_b;
    each is also capped by rad_a rad_b (the old bound). A square (``same``: one form, one value
    per element) is [0, rad_a^2]. docs/bounds.md, "Second-order remainders"."""
    ra, rb = a.rad(), b.rad()
    if same:
        hi = pad_hi(ra * ra)
        fin = torch.isfinite(hi)
        return (torch.where(fin, 0.5 * hi, torch.zeros_like(hi)),
                torch.where(fin, pad_hi(0.5 * hi) + TINY, torch.full_like(hi, math.inf)))
    cap = pad_hi(ra * rb)
    pos = (ra > 0) & (rb > 0) & torch.isfinite(cap)
    e = torch.where(pos, torch.round(0.5 * torch.log2(torch.where(pos, rb / ra, 1.0))),
                    torch.zeros_like(ra))
    e = torch.nan_to_num(e, nan=0.0).clamp(-400.0, 400.0)
    t = torch.exp2(e)
    kd = int(ga.shape[0])
    sums = []
    for sign in (1.0, -1.0):
        sp = _l1_pm(ga, gb, t, sign) if kd else torch.zeros_like(t)
        k = kd
        if loc is not None:
            La, Lb = loc[0], loc[1]
            if La is None:
                sp = sp + _l1(Lb) / t
                k += int(Lb.shape[0])
            elif Lb is None:
                sp = sp + _l1(La) * t
                k += int(La.shape[0])
            else:
                sp = sp + _l1_pm(La, Lb, t, sign)
                k += int(La.shape[0])
        rad = (sp + t * a.r + b.r / t) * (1 + (k + 8) * U64)
        sums.append(pad_hi(rad) + TINY)
    lp = torch.minimum(pad_hi(0.25 * sums[0] * sums[0]), cap)
    lm = torch.minimum(pad_hi(0.25 * sums[1] * sums[1]), cap)
    fin = torch.isfinite(lp) & torch.isfinite(lm)
    shift = torch.where(fin, 0.5 * lp - 0.5 * lm, torch.zeros_like(lp))
    half = torch.where(fin, pad_hi(0.5 * lp + 0.5 * lm + 4 * U64 * (lp + lm)) + TINY,
                       torch.full_like(lp, math.inf))
    return shift, half


def f_mul(a: Form, b: Form) -> Form:
    """Elementwise product: ca cb + (ca Gb + cb Ga) eps + |ca| rb + |cb| ra + the second-order
    term (``_product_remainder``; rad_a rad_b when PRODUCT_SECOND_ORDER is off)."""
    same = a is b
    rank = max(a.c.dim(), b.c.dim())
    a, b = a.view(rank), b.view(rank)
    shape = torch.broadcast_shapes(a.shape, b.shape)
    a, b, loc = _local_pair(a, b, shape)
    (ga, gb), u = align([a.dpart(), b.dpart()])
    c = a.c * b.c
    G = ga * b.c + a.c * gb
    L = None
    if loc is not None:
        La, Lb = loc[0], loc[1]
        L = (La * b.c if Lb is None else (a.c * Lb if La is None else La * b.c + a.c * Lb))
    zt = _binary_track()
    ex = _exact_product(zt, a, b, ga, gb, u, "mul") if zt is not None else None
    if ex is None:
        if not PRODUCT_SECOND_ORDER:
            r = a.c.abs() * b.r + b.c.abs() * a.r + a.rad() * b.rad()
            return fp_err(Form(c, G, pad_hi(r), u, *_cat_local(loc, L)), 8)
        shift, half = _product_remainder(a, b, ga, gb, loc, same)
        c = c + shift
        r = a.c.abs() * b.r + b.c.abs() * a.r + half + 4 * U64 * (c.abs() + shift.abs())
        return fp_err(Form(c, G, pad_hi(r) + TINY, u, *_cat_local(loc, L)), 8)
    const, rows, rids, rem = ex  # the binary parts' product exactly (b_j^2 = 1)
    r = pad_hi(a.c.abs() * b.r + b.c.abs() * a.r + rem + 2 * U64 * const.abs())
    out = _with_rows(Form(c + const, G, r, u, *_cat_local(loc, L)), rows, rids)
    return fp_err(out, 8)


MATMUL_POLAR_ROWS = 0  # f_matmul of two forms: symbols paired in the polarization (0: off, cost)
MATMUL_POLAR_ENTRIES = 2**22  # entries of one chunk's (rows, ..., I, D, J) temporary


def _matmul_remainder(a: Form, b: Form, ra: torch.Tensor, rb: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(shift, half): the second-order term sum_d da_id db_dj of a product of two forms lies in
    shift +- half. Per term d, the polarization of ``_product_remainder`` with t per (i, d, j);
    the rows paired exactly are the ``MATMUL_POLAR_ROWS`` symbols of largest total |g| over
    both operands, the others enter by the triangle inequality (|t g_a +- g_b / t| <= t |g_a| +
    |g_b| / t: sound for any subset). Each term is capped by rad_a rad_b, the old bound."""
    (ga, gb), _ = align([a, b])
    k = int(ga.shape[0])
    cap = pad_hi(ra.unsqueeze(-1) * rb.unsqueeze(-3))  # (..., I, D, J)
    pos = (cap > 0) & torch.isfinite(cap)
    q = torch.where(pos, rb.unsqueeze(-3) / ra.unsqueeze(-1), torch.ones_like(cap))
    e = torch.nan_to_num(torch.round(0.5 * torch.log2(q)), nan=0.0, posinf=0.0, neginf=0.0)
    t = torch.exp2(e.clamp(-400.0, 400.0))
    ti = 1.0 / t
    if k:
        score = _row_l1(ga) + _row_l1(gb)
        m = min(k, MATMUL_POLAR_ROWS)
        top, rest = _top_rows(score, m)
    else:
        top = rest = torch.zeros(0, dtype=torch.int64)
    sa = _l1(ga, rows=rest) if rest.numel() else torch.zeros_like(ra)
    sb = _l1(gb, rows=rest) if rest.numel() else torch.zeros_like(rb)
    sa = pad_hi((sa + a.r) * (1 + (k + 4) * U64)) + TINY
    sb = pad_hi((sb + b.r) * (1 + (k + 4) * U64)) + TINY
    base = t * sa.unsqueeze(-1) + ti * sb.unsqueeze(-3)
    acc = [torch.zeros_like(cap), torch.zeros_like(cap)]
    if top.numel():
        step = max(1, MATMUL_POLAR_ENTRIES // max(1, cap.numel()))
        tdev = top.to(ga.device)
        for i in range(0, int(top.numel()), step):
            rows = tdev[i:i + step]
            x = ga[rows].unsqueeze(-1) * t
            y = gb[rows].unsqueeze(-3) * ti
            acc[0] += (x + y).abs().sum(0)
            acc[1] += (x - y).abs().sum(0)
    out = []
    for sp in acc:
        rad = pad_hi((sp * (1 + (k + 8) * U64) + base) * (1 + 4 * U64)) + TINY
        out.append(torch.minimum(pad_hi(0.25 * rad * rad), cap))
    nd = int(cap.shape[-2])
    lp = out[0].sum(-2) * (1 + (nd + 4) * U64)
    lm = out[1].sum(-2) * (1 + (nd + 4) * U64)
    fin = torch.isfinite(lp) & torch.isfinite(lm)
    shift = torch.where(fin, 0.5 * lp - 0.5 * lm, torch.zeros_like(lp))
    half = torch.where(fin, pad_hi(0.5 * lp + 0.5 * lm + 4 * U64 * (lp + lm)) + TINY,
                       torch.full_like(lp, math.inf))
    return shift, half


def f_matmul(a: Form, b: Form) -> Form:
    """Matrix product of two forms (numpy.matmul broadcasting, both at least 2-D)."""
    rank = max(a.c.dim(), b.c.dim())
    a, b = a.view(rank).dense(), b.view(rank).dense()  # mixes positions: dense
    n = a.c.shape[-1]
    c = a.c @ b.c
    ga = a.like(c, (a.G @ b.c) if a.k else torch.zeros((0, *c.shape), dtype=F64, device=c.device), c)
    gb = b.like(c, (a.c @ b.G) if b.k else torch.zeros((0, *c.shape), dtype=F64, device=c.device), c)
    G, u = combine(ga, gb)
    fp = (n + 6) * U64 * ((a.c.abs() + a.gsum()) @ (b.c.abs() + b.gsum()))
    zt = _binary_track()
    ex = None
    if zt is not None:
        (gaa, gbb), ua = align([a, b])
        ex = _exact_product(zt, a, b, gaa, gbb, ua, "matmul")
    if ex is None:
        ra, rb = a.rad(), b.rad()
        if not PRODUCT_SECOND_ORDER or MATMUL_POLAR_ROWS <= 0:
            r = a.c.abs() @ b.r + a.r @ b.c.abs() + ra @ rb
            return Form(c, G, (r + fp) * (1 + (n + 6) * U64) + TINY, u)
        shift, half = _matmul_remainder(a, b, ra, rb)
        c = c + shift
        r = a.c.abs() @ b.r + a.r @ b.c.abs() + half + 4 * U64 * (c.abs() + shift.abs())
        return Form(c, G, (r + fp) * (1 + (n + 6) * U64) + TINY, u)
    const, rows, rids, rem = ex  # the binary parts' product exactly
    r = a.c.abs() @ b.r + a.r @ b.c.abs() + rem + 2 * U64 * const.abs()
    return _with_rows(Form(c + const, G, (r + fp) * (1 + (n + 6) * U64) + TINY, u), rows, rids)


def f_matmul_const(a: Form, w: torch.Tensor, left: bool = False) -> Form:
    """a @ w (or w @ a when ``left``) for an exact constant w."""
    w = w.to(F64)
    n = w.shape[-2] if not left else w.shape[-1]
    axis = -2 if left else -1  # the contracted axis of a: a local part needs one position on it
    if a.L is not None and not _constant_along(a.P, axis):
        a = a.dense()
    if left:
        c = w @ a.c
        G = w @ a.Gd if a.kd else a.Gd.new_zeros((0, *c.shape))
        L = w @ a.L if a.L is not None else None
        r = w.abs() @ a.r
        fp = w.abs() @ (a.c.abs() + a.gsum())
    else:
        c = a.c @ w
        G = a.Gd @ w if a.kd else a.Gd.new_zeros((0, *c.shape))
        L = a.L @ w if a.L is not None else None
        r = a.r @ w.abs()
        fp = (a.c.abs() + a.gsum()) @ w.abs()
    P = torch.broadcast_to(a.P.narrow(axis, 0, 1), c.shape) if a.L is not None else None
    return a.local_like(c, G, (r + (n + 6) * U64 * fp) * (1 + (n + 6) * U64) + TINY, L, P)


def f_matmul_const_fresh(zt: ZonoTrack, a: Form, w: torch.Tensor) -> Form:
    """a @ w for an exact 2-D constant w, with a's r made new symbols *after* the product: the
    error e_j (|e_j| <= r_j) of input element (t, j) is r_j delta_tj, delta_tj a new symbol, and
    reaches output row t as r_tj delta_tj w[j, :]: one position-local kind per contracted index
    j (n kinds over the output's numel), the same set as fresh(a) @ w without a's n fresh kinds
    over a's numel (a d -> 4d -> d MLP's hidden tensor is 4x the output: its fresh symbols do
    not fit its cap). Needs each row of a at its own position (checked, else fresh first)."""
    n = int(w.shape[0])
    if a.L is not None:
        if not _constant_along(a.P, -1):
            a = a.dense()
    P_in = a.P if a.L is not None else _row_positions(a.shape, a.c.device)
    rows = P_in.narrow(-1, 0, 1)
    if w.dim() != 2 or a.c.dim() < 2 or torch.unique(rows).numel() != rows.numel():
        return f_matmul_const(zt.fresh(a), w)
    r = a.r
    y = f_matmul_const(a.with_r(torch.zeros_like(r)), w)
    w64 = w.to(F64)
    rt = r.movedim(-1, 0).unsqueeze(-1)  # (n, ..., T, 1)
    L_new = rt * w64.reshape(n, *([1] * (r.dim() - 1)), int(w.shape[1]))  # (n, ..., T, m)
    # |fl(r_tj w_jm) - r_tj w_jm| <= u |r_tj w_jm|: summed over j, (|r| @ |w|) u, into r
    fp = pad_hi(2 * U64 * (r @ w64.abs())) + TINY
    P_out = torch.broadcast_to(rows, y.shape)
    T = int(rows.max()) + 1 if rows.numel() else 0
    lb = zt.k + torch.arange(n, dtype=torch.int64) * T
    zt.k += n * T
    if y.L is None:
        return Form(y.c, y.Gd, pad_hi(y.r + fp), y.idsd, L_new, lb, P_out)
    return Form(y.c, y.Gd, pad_hi(y.r + fp), y.idsd, torch.cat([y.L, L_new], 0),
                torch.cat([y.lb, lb]), y.P)


def _constant_along(P: torch.Tensor, axis: int) -> bool:
    """Whether every element has the position of the first one along ``axis``."""
    return bool((P == P.narrow(axis, 0, 1)).all())


def f_sum(a: Form, dim: int, keepdim: bool = True) -> Form:
    d = dim % a.c.dim()
    n = a.c.shape[d]
    if a.L is not None and not _constant_along(a.P, d):
        a = a.dense()
    c = a.c.sum(d, keepdim=keepdim)
    G = a.Gd.sum(d + 1, keepdim=keepdim)
    L = a.L.sum(d + 1, keepdim=keepdim) if a.L is not None else None
    P = None
    if a.L is not None:
        P = a.P.narrow(d, 0, 1) if keepdim else a.P.select(d, 0)
    r = a.r.sum(d, keepdim=keepdim)
    fp = (n + 4) * U64 * (a.c.abs() + a.gsum()).sum(d, keepdim=keepdim)
    return a.local_like(c, G, (r + fp) * (1 + (n + 6) * U64) + TINY, L, P)


def f_select(cond: torch.Tensor, a: Form, b: Form) -> Form:
    rank = max(a.c.dim(), b.c.dim(), cond.dim())
    a, b = a.view(rank), b.view(rank)
    (ga, gb), u = align([a, b])
    return Form(torch.where(cond, a.c, b.c), torch.where(cond, ga, gb), torch.where(cond, a.r, b.r), u)


SECOND_ORDER = True  # smooth functions: Taylor remainder from f'' on the hull, centred (below)


def _first_order(c: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, f: Callable, df: Callable,
                 df_range: Callable, d2_range: Callable | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(centre, f'(c), R): f(x) lies in centre + f'(c)(x - c) +- R for every x in [lo, hi],
    each rounded outward; None when any of them is not finite.

    Two enclosures of the remainder rho(x) = f(x) - f(c) - f'(c)(x - c) over the hull H of
    [lo, hi] and c, w = max |x - c|: the mean-value one, rho = (f'(xi) - f'(c))(x - c), |rho| <=
    max |f'(H) - f'(c)| w; and, with ``d2_range`` (an enclosure of f'' over an interval), the
    Lagrange form rho = f''(xi) (x - c)^2 / 2 with (x - c)^2 in [0, w^2], so rho in
    [min(0, min f''(H)) w^2 / 2, max(0, max f''(H)) w^2 / 2]. Both hold, so rho lies in their
    intersection [l, h]; the centre becomes f(c) + (l + h) / 2 and R (h - l) / 2: for a convex
    or concave f, a quarter of the mean-value radius to second order (docs/bounds.md,
    "Second-order remainders").

    The expansion point is p = c clamped into [lo, hi] (F10 s9: a centre moved by an upstream
    remainder can leave the box, and a hull from the box to c crossed 1/y's pole): f(x) = f(p)
    + f'(p)(x - p) + rho(x) = [f(p) + f'(p)(c - p)] + f'(p)(x - c) + rho(x), rho over H =
    [lo, hi] only; where c is in the box, p = c and nothing changes."""
    p = torch.minimum(torch.maximum(c, lo), hi)
    fp = f(p)
    lam = df(p)
    dc = c - p  # exact where c is in the box (0); else rounded: in the error below
    lin = lam * dc
    f0 = fp + lin
    f0_err = pad_hi(4 * U64 * (fp.abs() + lin.abs() + f0.abs()) + 64 * U64 * fp.abs()) + TINY
    h_lo, h_hi = lo, hi
    g_lo, g_hi = df_range(h_lo, h_hi)
    g_lo = pad_lo(g_lo, 64 * U64) - TINY
    g_hi = pad_hi(g_hi, 64 * U64) + TINY
    dev = pad_hi(torch.maximum(g_hi - lam, lam - g_lo).clamp_min(0.0))
    w = pad_hi(torch.maximum(hi - p, p - lo).clamp_min(0.0))
    R = pad_hi(dev * w + f0_err)
    if not (bool(torch.isfinite(f0).all()) and bool(torch.isfinite(lam).all())
            and bool(torch.isfinite(R).all())):
        return None
    R0 = pad_hi(dev * w)
    if d2_range is None or not SECOND_ORDER:
        return f0, lam, R
    m_lo, m_hi = d2_range(h_lo, h_hi)
    m_lo = pad_lo(m_lo, 1e-12) - TINY
    m_hi = pad_hi(m_hi, 1e-12) + TINY
    q = pad_hi(0.5 * w * w)
    t_lo = torch.nan_to_num(pad_lo(m_lo.clamp_max(0.0) * q), nan=-math.inf, neginf=-math.inf)
    t_hi = torch.nan_to_num(pad_hi(m_hi.clamp_min(0.0) * q), nan=math.inf, posinf=math.inf)
    t_lo = torch.where(q == 0, torch.zeros_like(q), t_lo)
    t_hi = torch.where(q == 0, torch.zeros_like(q), t_hi)
    lo_r = torch.maximum(t_lo, -R0)
    hi_r = torch.minimum(t_hi, R0)
    mid = 0.5 * lo_r + 0.5 * hi_r  # exact halves; their sum rounded: in the radius below
    cen = f0 + mid
    rad = torch.maximum(hi_r - mid, mid - lo_r).clamp_min(0.0)
    # the evaluation error of f(p) and of f0 = f(p) + f'(p)(c - p) (the caller adds 64 u
    # |centre|, which need not cover it once the centre moved) and the roundings of mid and
    # f0 + mid
    rad = rad + f0_err + 4 * U64 * (mid.abs() + cen.abs() + lo_r.abs() + hi_r.abs())
    rad = pad_hi(rad) + TINY
    if not bool(torch.isfinite(rad).all()):
        return f0, lam, R
    return cen, lam, rad


# --- enclosures of f'' over [lo, hi] (the Lagrange remainder of f_smooth) ---------------------
def _crit_range(f2: Callable, lo: torch.Tensor, hi: torch.Tensor,
                crits: tuple[float, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """min / max of f2 over [lo, hi] for an f2 whose extremes in the interior lie at ``crits``:
    f2 at both ends and at each critical point clamped into the interval (a clamped point
    outside is an end). Evaluation errors: _first_order pads by 1e-12 relative + 2^-1000."""
    vals = [f2(lo), f2(hi)] + [f2(torch.clamp(torch.full_like(lo, x), lo, hi)) for x in crits]
    v = torch.stack(vals)
    return v.amin(0), v.amax(0)


def _d2_exp(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.exp(lo), torch.exp(hi)


def _d2_inv(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(1/x)'' = 2 / x^3, decreasing on each side of 0; unbounded where [lo, hi] holds 0 (the
    rule's domain check excludes that; a guard should a caller ever pass such a hull: F10)."""
    cross = (lo <= 0) & (hi >= 0)
    a, b = 2.0 / (hi * hi * hi), 2.0 / (lo * lo * lo)
    return torch.where(cross, -math.inf, a), torch.where(cross, math.inf, b)


def _d2_rsqrt(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x^-1/2)'' = 3/4 x^-5/2, decreasing on x > 0."""
    return 0.75 * hi ** -2.5, 0.75 * lo ** -2.5


def _d2_sqrt(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x^1/2)'' = -1/4 x^-3/2, increasing on x > 0."""
    return -0.25 * lo ** -1.5, -0.25 * hi ** -1.5


def _d2_erf(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """erf'' = -(4 / sqrt(pi)) x exp(-x^2): extremes at -+1/sqrt(2)."""
    k = 4.0 / math.sqrt(math.pi)
    r = 1.0 / math.sqrt(2.0)
    return _crit_range(lambda x: -k * x * torch.exp(-x * x), lo, hi, (-r, r))


def _d2_tanh(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tanh'' = -2 tanh(x) / cosh(x)^2: extremes where tanh^2 = 1/3."""
    x0 = math.atanh(1.0 / math.sqrt(3.0))
    return _crit_range(lambda x: -2.0 * torch.tanh(x) / torch.cosh(x) ** 2, lo, hi, (-x0, x0))


def _d2_sigmoid(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sigmoid'' = s(x) s(-x) (s(-x) - s(x)): extremes at -+log(2 + sqrt(3))."""
    x0 = math.log(2.0 + math.sqrt(3.0))
    return _crit_range(lambda x: torch.sigmoid(x) * torch.sigmoid(-x)
                       * (torch.sigmoid(-x) - torch.sigmoid(x)), lo, hi, (-x0, x0))


def _d2_gelu(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x Phi(x))'' = phi(x) (2 - x^2) (the erf form): extremes at 0 and -+2."""
    k = 1.0 / math.sqrt(2.0 * math.pi)
    return _crit_range(lambda x: k * torch.exp(-0.5 * x * x) * (2.0 - x * x), lo, hi,
                       (-2.0, 0.0, 2.0))


def f_smooth(a: Form, lo: torch.Tensor, hi: torch.Tensor, f: Callable, df: Callable,
             df_range: Callable, d2_range: Callable | None = None) -> Form | None:
    """f(x) = f(c) + f'(c)(x - c) + R, |R| <= max |f'(hull) - f'(c)| * max |x - c| (mean-value
    theorem over the hull of [lo, hi] and c), met with the Lagrange remainder from ``d2_range``
    (an enclosure of f'' over an interval) and centred (``_first_order``). None when the
    expansion is not finite."""
    first = _first_order(a.c, lo, hi, f, df, df_range, d2_range)
    if first is None:
        return None
    f0, lam, R = first
    zt = _binary_track()
    if zt is not None and a.kd:
        bm = _bin_mask(zt, a.idsd)
        if bool(bm.any()):
            ex = _smooth_walsh(zt, a, bm, lo, hi, f, df, df_range)
            if ex is not None:
                return ex
    out = a.local_like(f0, a.Gd * lam, pad_hi(lam.abs() * a.r + R + 64 * U64 * f0.abs() + TINY),
                       a.L * lam if a.L is not None else None, a.P, a.scaled_gsum(lam))
    return fp_err(out, 4)


def _walsh_groups(zt: ZonoTrack, a: Form, bm: torch.Tensor, extra: tuple[int, ...] = ()):
    """Per group of elements with one support V (binpoly.Groups): (V, flat element indices,
    the values x_sigma on V's 2^k sign vectors (2^k, E), and the continuous part's radius w
    (E,), the float64 error of x_sigma included, and that error's bound alone (E,))."""
    Gb = a.Gd[bm.to(a.Gd.device)]
    ids = a.idsd[bm].tolist()
    groups = binpoly.Groups(zt.mono, Gb, ids, extra)
    rc = _cont_rad(a, bm).reshape(-1)
    cf = a.c.reshape(-1)
    Gf = Gb.reshape(int(Gb.shape[0]), -1)
    out = []
    for V, els, rows, chi in groups.groups:
        g = Gf[rows][:, els] if rows.numel() else Gf.new_zeros((0, int(els.numel())))
        xs = cf[els].unsqueeze(0) + chi @ g
        gab = g.abs().sum(0)
        efp = pad_hi((int(rows.numel()) + 4) * U64 * (cf[els].abs() + gab)) + TINY
        w = pad_hi(rc[els] + efp)
        out.append((V, els, xs, w, efp))
    return groups, out


def _smooth_walsh(zt: ZonoTrack, a: Form, bm: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                  f: Callable, df: Callable, df_range: Callable) -> Form | None:
    """f_smooth with the elements that depend on binary symbols evaluated on their sign
    vectors (binpoly module doc): f(x) = sum_T fh_T chi_T + lam d + noise, d the continuous part
    of x, lam the mean of f'(x_sigma), noise max_sigma |f'(x_sigma) - lam| w + max_sigma R_sigma
    (R_sigma the mean-value remainder over [x_sigma - w, x_sigma + w]) + the dropped Walsh
    terms + float64 errors, x_sigma's own times max |f'| near it included. The other elements: the first-order expansion at the centre."""
    bm = _row_budget(a.Gd, bm)
    if bm is None:
        return None
    groups, gs = _walsh_groups(zt, a, bm)
    if not gs:
        return None
    shape = a.shape
    numel = a.c.numel()
    c = a.c
    first = _first_order(c, lo, hi, f, df, df_range)
    if first is None:
        return None
    f0, lam, R = first
    cen = f0.reshape(-1).clone()
    slope = lam.reshape(-1).clone()
    extra = pad_hi(R + 64 * U64 * f0.abs()).reshape(-1).clone()  # beyond |slope| r
    walsh = torch.zeros(numel, dtype=torch.bool)
    terms: dict[int, torch.Tensor] = {}
    for V, els, xs, w, efp in gs:
        k = len(V)
        xl, xh = pad_lo(xs - w), pad_hi(xs + w)
        v0 = f(xs)
        l0 = df(xs)
        dl, dh = df_range(torch.minimum(xl, xs), torch.maximum(xh, xs))
        dl = pad_lo(dl, 64 * U64) - TINY
        dh = pad_hi(dh, 64 * U64) + TINY
        dv = pad_hi(torch.maximum(dh - l0, l0 - dl).clamp_min(0.0))
        Rs = pad_hi(dv * w)
        if not (bool(torch.isfinite(v0).all()) and bool(torch.isfinite(l0).all())
                and bool(torch.isfinite(Rs).all())):
            continue
        vmax = v0.abs().amax(0)
        coef = binpoly.fwht(v0, k)
        const, ids, rows, dropped = binpoly.walsh_terms(zt.mono, zt.new_monomial_id, V, coef,
                                                        vmax)
        lbar = l0.mean(0)
        spread = (l0 - lbar).abs().amax(0)
        n = 1 << k
        fp = (k * (n + 2) + 64) * U64 * vmax + (n + 4) * U64 * l0.abs().amax(0) * w
        # x - x_sigma is the continuous part d plus x_sigma's float64 error e (|e| <= efp):
        # f'(xi) e is not in lam d, and |f'(xi)| <= |f'(x_sigma)| + dv
        fp = fp + ((l0.abs() + dv).amax(0) * efp)
        noise = spread * w + Rs.amax(0) + dropped + fp
        noise = pad_hi(noise * (1 + 1e-12)) + TINY
        cen[els] = const
        slope[els] = lbar
        extra[els] = noise
        walsh[els] = True
        for i, row in zip(ids, rows):
            t = terms.get(i)
            if t is None:
                t = terms[i] = torch.zeros(numel, dtype=F64, device=c.device)
            t[els] = row
    if not bool(walsh.any()):
        return None
    slope = slope.reshape(shape)
    wm = walsh.reshape(shape).to(c.device)
    Gd = a.Gd * slope
    bmd = bm.to(Gd.device)
    Gd[bmd] = torch.where(wm, torch.zeros_like(Gd[bmd]), Gd[bmd])  # replaced by the terms
    r = pad_hi(slope.abs() * a.r + extra.reshape(shape) + TINY)
    out = a.local_like(cen.reshape(shape), Gd, r, a.L * slope if a.L is not None else None, a.P)
    ids = sorted(terms)
    if ids:
        rows = torch.stack([terms[i].reshape(shape) for i in ids])
        out = _with_rows(out, rows, ids)
    return fp_err(out, 4)


# --- the tracker ------------------------------------------------------------------------------
def _box_part(b: Box, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (b.tl, b.th) if k == 0 else (b.il, b.ih)


class ZonoTrack:
    """The forms of the live tensors of one block run, and the symbol counter."""

    def __init__(self, k_max: int | None = None, local: bool = True) -> None:
        self.local = local  # new per-element / per-row symbols position-local (module doc)
        self.forms: dict[str, ZState] = {}
        self.k = 0
        self.k_max = k_max or K_MAX
        self._bin: list[int] = []  # ids of symbols in {-1, +1} (``binary``)
        self._bin_t = torch.zeros(0, dtype=torch.int64)
        self.mono = Monomials()  # their supports: monomials of base binary symbols (binpoly)
        self.raw: list = []  # the node's input states as the interval domain has them

    @property
    def binary(self) -> torch.Tensor:
        """The ids of the binary symbols (base straddles and their monomials), as a tensor."""
        if int(self._bin_t.numel()) != len(self._bin):
            self._bin_t = torch.tensor(self._bin, dtype=torch.int64)
        return self._bin_t

    def new_monomial_id(self) -> int:
        """A fresh id for a monomial symbol (binpoly.Monomials records its support)."""
        i = self.k
        self.k += 1
        self._bin.append(i)
        return i

    # symbols
    def cap_for(self, f: Form) -> int:
        """Symbols one form may keep: the block's k_max, and at most ELEMENT_BUDGET entries."""
        return max(64, min(self.k_max, ELEMENT_BUDGET // max(1, f.c.numel())))

    def _kinds(self, f: Form, coefs: torch.Tensor, group: torch.Tensor,
               P: torch.Tensor | None) -> Form:
        """New position-local symbols: for each element e, one symbol of coefficient coefs[e]
        shared by the elements of e's group (group: (shape) ints, 0 .. n_groups - 1, constant
        across a group; P: the form's positions, None for rows). A group lies at one position;
        the groups of a position get kinds 0, 1, ..; symbol (kind j, position t) is
        id lb[j] + t, the ids a fresh range (distinct from every symbol so far)."""
        shape = f.shape
        if P is None:
            P = _row_positions(shape, f.c.device)
        Pf = P.expand(shape).reshape(-1)
        gf = group.reshape(-1)
        ng = int(gf.max()) + 1 if gf.numel() else 0
        gpos = torch.zeros(ng, dtype=torch.int64, device=Pf.device)
        gpos[gf] = Pf  # each group's position (the same for all its elements: checked)
        if not bool((gpos[gf] == Pf).all()):
            raise AssertionError("a group of new local symbols spans two positions")
        kind = _ranks(gpos)  # the groups of one position: kinds 0, 1, ..
        K = int(kind.max()) + 1 if kind.numel() else 0
        T = int(Pf.max()) + 1 if Pf.numel() else 0
        L = torch.zeros((K, Pf.numel()), dtype=F64, device=f.c.device)
        L[kind[gf], torch.arange(Pf.numel(), device=f.c.device)] = coefs.expand(shape).reshape(-1)
        lb = self.k + torch.arange(K, dtype=torch.int64) * T
        self.k += K * T
        L = L.reshape(K, *shape)
        if f.L is None:
            return Form(f.c, f.Gd, f.r, f.idsd, L, lb, P.expand(shape))
        return Form(f.c, f.Gd, f.r, f.idsd, torch.cat([f.L.expand(f.kl, *shape), L], 0),
                    torch.cat([f.lb, lb]), f.P)

    def fresh(self, f: Form) -> Form:
        """Turn r into new symbols, one per element (the largest first, within the budget)."""
        if self.local:
            if not bool((f.r > 0).any()):
                return f
            # one kind per element of a position: each element its own group
            group = torch.arange(f.c.numel(), device=f.c.device).reshape(f.shape)
            out = self._kinds(f.with_r(torch.zeros_like(f.r)), f.r, group, f.P)
            return out.cap(self.cap_for(f))
        m = f.r > 0
        cap = self.cap_for(f)
        if int(m.sum()) > cap:  # memory: only the largest errors become symbols
            thr = torch.topk(torch.where(m, f.r, torch.zeros_like(f.r)).reshape(-1), cap).values[-1]
            m = m & (f.r >= thr)
        idx = torch.nonzero(m.reshape(-1)).reshape(-1)[:cap]
        if idx.numel() == 0:
            return f
        m = torch.zeros(f.r.numel(), dtype=torch.bool, device=f.r.device)
        m[idx] = True
        m = m.reshape(f.r.shape)
        numel = f.c.numel()
        new_ids = torch.arange(self.k, self.k + idx.numel(), dtype=torch.int64)
        self.k += idx.numel()
        r = torch.where(m, torch.zeros_like(f.r), f.r)
        old_keep = None
        if f.k + idx.numel() > cap:  # order reduction before the rows are joined (one copy):
            # the same rows as joining and then f.cap(cap) (a new row's score is its r)
            score = torch.cat([_row_l1(f.G), f.r.reshape(-1)[idx]])
            keep, drop = _top_rows(score, cap)
            old_keep, new_keep = keep[keep < f.k], keep[keep >= f.k] - f.k
            old_drop, new_drop = drop[drop < f.k], drop[drop >= f.k] - f.k
            extra = _l1(f.G, rows=old_drop) * (1 + (f.k + idx.numel() + 2) * U64)
            r_flat = r.reshape(-1).clone()
            r_flat[idx[new_drop]] = f.r.reshape(-1)[idx[new_drop]]  # not made symbols: stay in r
            r = pad_hi(r_flat.reshape(r.shape) + extra) + TINY
            idx, new_ids = idx[new_keep], new_ids[new_keep]
        g_new = torch.zeros((idx.numel(), numel), dtype=F64, device=f.c.device)
        g_new[torch.arange(idx.numel(), device=f.c.device), idx] = f.r.reshape(-1)[idx]
        g_new = g_new.reshape(idx.numel(), *f.shape)
        if old_keep is None:
            G, ids = torch.cat([f.G, g_new], 0), torch.cat([f.ids, new_ids])
        else:
            G = torch.cat([f.G[old_keep.to(f.G.device)], g_new], 0)
            ids = torch.cat([f.ids[old_keep], new_ids])
        return Form(f.c, G, r, ids)

    def binary_symbols(self, f: Form, coef: torch.Tensor, site: Any = None) -> Form:
        """New binary symbols (values -1 or +1), one per element where ``coef`` != 0. ``site``:
        the cast site that made them (a straddle there), told to a proof by cases
        (cases.note_bases: which ties an output's form depends on)."""
        idx = torch.nonzero(coef.reshape(-1) != 0).reshape(-1)
        cap = self.cap_for(f)
        if idx.numel() > cap:  # memory: the largest become symbols, the rest noise in r
            keep = torch.topk(coef.reshape(-1)[idx].abs(), cap).indices
            rest = torch.ones(idx.numel(), dtype=torch.bool, device=idx.device)
            rest[keep] = False
            extra = torch.zeros(coef.numel(), dtype=F64, device=coef.device)
            extra[idx[rest]] = coef.reshape(-1)[idx[rest]].abs()
            f = f.with_r(pad_hi(f.r + extra.reshape(f.r.shape)))
            idx = torch.sort(idx[keep]).values
        numel = f.c.numel()
        g_new = torch.zeros((idx.numel(), numel), dtype=F64, device=f.c.device)
        g_new[torch.arange(idx.numel(), device=f.c.device), idx] = coef.reshape(-1)[idx]
        new_ids = torch.arange(self.k, self.k + idx.numel(), dtype=torch.int64)
        self.k += idx.numel()
        for i in new_ids.tolist():
            self._bin.append(i)
            self.mono.base(i)
        if site is not None and _cases.active():
            _cases.note_bases(self, site, new_ids.tolist(), idx.tolist())
        return Form(f.c, torch.cat([f.Gd.expand(f.kd, *f.shape),
                                    g_new.reshape(idx.numel(), *f.shape)], 0), f.r,
                    torch.cat([f.idsd, new_ids]), f.L, f.lb, f.P).cap(self.cap_for(f))

    def row_symbols(self, f: Form, coefs: list[torch.Tensor]) -> Form:
        """For each coefficient tensor (f's shape), one new symbol per row (the last axis): an
        error a normalising op shares across its row."""
        n = f.c.shape[-1]
        if self.local and (f.L is None or _constant_along(f.P, -1)):
            group = torch.arange(f.c.numel() // max(n, 1), device=f.c.device)
            group = group.reshape(*f.shape[:-1], 1).expand(f.shape)
            for coef in coefs:
                f = self._kinds(f, coef, group, f.P)
            return f.cap(self.cap_for(f))
        rows = f.c.numel() // max(n, 1)
        blocks = []
        idx = torch.arange(rows, device=f.c.device)
        for coef in coefs:
            g = torch.zeros((rows, rows, n), dtype=F64, device=f.c.device)
            g[idx, idx] = coef.expand(f.shape).reshape(rows, n)
            blocks.append(g.reshape(rows, *f.shape))
        new = torch.cat(blocks, 0)
        ids = torch.arange(self.k, self.k + new.shape[0], dtype=torch.int64)
        self.k += new.shape[0]
        return Form(f.c, torch.cat([f.G, new], 0), f.r, torch.cat([f.ids, ids])).cap(self.cap_for(f))

    def symbolize(self, z: ZState) -> ZState:
        """Fresh symbols for both kernels' r (before an op that mixes elements)."""
        return ZState(self.fresh(z.t), self.fresh(z.i))

    def from_box(self, b: Box) -> ZState:
        """Forms spanning a box: train = mid + diag(hw) eps (symbols), inf = train + drift box;
        the inference box itself is used where it is narrower than train + drift."""
        mid_t = 0.5 * b.tl + 0.5 * b.th
        hw_t = pad_hi(torch.maximum(b.th - mid_t, mid_t - b.tl).clamp_min(0.0))
        fin = torch.isfinite(b.tl) & torch.isfinite(b.th) & torch.isfinite(b.il) & torch.isfinite(b.ih)
        fin = fin & torch.isfinite(b.dl) & torch.isfinite(b.dh)
        exact_inf = (b.tl == b.th) & (b.il == b.ih) & (b.tl == b.il) & ~torch.isfinite(b.tl)
        if not bool((fin | exact_inf).all()):
            raise _NoForm
        if bool(exact_inf.any()):  # masked entries: the same infinity in every program
            zero = torch.zeros_like(b.tl)
            inf_val = torch.where(exact_inf, b.tl, zero)
            b = Box(*(torch.where(exact_inf, zero, p) for p in b.parts()))
            z = self.from_box(b)
            return ZState(*(f.local_like(torch.where(exact_inf, inf_val, f.c), f.Gd, f.r, f.L, f.P,
                                         f._gs) for f in z.forms()))
        t = self.fresh(const_form(mid_t, hw_t))
        mid_d = 0.5 * b.dl + 0.5 * b.dh
        hw_d = pad_hi(torch.maximum(b.dh - mid_d, mid_d - b.dl).clamp_min(0.0))
        # inf = train + drift, or its own box (no correlation) where that is narrower
        mid_i = 0.5 * b.il + 0.5 * b.ih
        hw_i = pad_hi(torch.maximum(b.ih - mid_i, mid_i - b.il).clamp_min(0.0))
        use_own = hw_i <= hw_d
        c_i = torch.where(use_own, mid_i, mid_t + mid_d)
        G_i = torch.where(use_own, torch.zeros_like(t.Gd), t.Gd)
        L_i = torch.where(use_own, torch.zeros_like(t.L), t.L) if t.L is not None else None
        r_i = torch.where(use_own, hw_i, pad_hi(hw_d + 2 * U64 * (mid_t.abs() + mid_d.abs()) + TINY))
        return ZState(t, t.local_like(c_i, G_i, r_i, L_i, t.P))

    def state_of(self, name: str, x: Any, ctx: RuleCtx) -> ZState | Concrete | None:
        """The forms of an input (cached by tensor name so that every consumer shares them),
        a Concrete for exact non-float values, None for an omitted input."""
        if x is None:
            return None
        if name in self.forms:
            return self.forms[name]
        if isinstance(x, Concrete):
            if not x.value.is_floating_point():
                return x
            b = ctx.lift(x)
            if (bool((b.tl == b.th).all()) and bool((b.il == b.ih).all())
                    and bool((b.tl == b.il).all())):
                return x  # exact in both kernels: a constant
            z = self.from_box(b)
            return z
        z = self.from_box(x)
        self.forms[name] = z
        return z

    def drop(self, name: str) -> None:
        self.forms.pop(name, None)

    def step(self, n: Any, names: list[str], ins: list, results: tuple, ctx: RuleCtx) -> tuple:
        """Run the node's zonotope rule and meet its boxes with the forms."""
        rule = ZRULES.get(n.op_type)
        if rule is None:
            return results
        if not any(isinstance(r, Box) for r in results):
            return results
        try:
            states = [self.state_of(nm, x, ctx) if nm else None for nm, x in zip(names, ins)]
            if not any(isinstance(s, ZState) for s in states):
                return results
            if n.op_type not in LOCAL_RULES:  # a rule that reads G: the dense form (same set)
                states = [ZState(s.t.dense(), s.i.dense()) if isinstance(s, ZState) else s
                          for s in states]
            boxes = [x if isinstance(x, Box) else None for x in ins]
            self.raw = ins
            token = _TRACK.set(self)
            try:
                outs = rule(self, ctx, states, boxes, results)
            finally:
                _TRACK.reset(token)
        except _NoForm:
            return results
        if outs is None:
            return results
        outs = outs if isinstance(outs, tuple) else (outs,)
        tightened = []
        for o_name, res, z in zip(n.outputs, results, outs):
            if z is None or not isinstance(res, Box) or not o_name:
                tightened.append(res)
                continue
            if tuple(z.t.shape) != tuple(res.shape) or tuple(z.i.shape) != tuple(res.shape):
                raise AssertionError(f"zonotope rule {n.op_type}: shape {z.t.shape} != {res.shape}")
            z = _sanitize(z, res)
            if z is None:
                tightened.append(res)
                continue
            z = ZState(z.t.cap(self.cap_for(z.t)), z.i.cap(self.cap_for(z.i)))
            b = meet(res, z)
            zb = self.box_where_looser(z, b)
            if zb is not z:  # the boxes' own forms may bound the drift tighter (il - th, ..)
                b = meet(b, zb)
            z = zb
            self.forms[o_name] = z
            tightened.append(b)
            if STEP_TRACE is not None:
                STEP_TRACE(n, o_name, b, z)
        return tuple(tightened)

    def box_where_looser(self, z: ZState, b: Box) -> ZState:
        """Per element, the box's own form (``from_box``: train = mid + hw eps, inference =
        train + drift, one new symbol per element) where a kernel's form is more than
        ``BOX_LOOSER`` times wider than the box met with it. A rule's form can be far wider than
        the other domains' box (a softmax over binary symbols: p in [0.99, 1] with a radius of
        0.1), and every later product and cast reads the form's radii; the element loses its
        correlation with the symbols upstream, never its value or drift bounds (the box is met
        with the form: it is no wider). Sound per element: each element's form encloses its
        values on its own, with the symbols shared or new."""
        hws = []
        for lo, hi in ((b.tl, b.th), (b.il, b.ih), (b.dl, b.dh)):
            mid = 0.5 * lo + 0.5 * hi
            hws.append((mid, pad_hi(torch.maximum(hi - mid, mid - lo).clamp_min(0.0))))
        (mid_t, hw_t), (mid_i, hw_i), (mid_d, hw_d) = hws
        fin = torch.isfinite(mid_t) & torch.isfinite(hw_t) & torch.isfinite(mid_i)
        fin = fin & torch.isfinite(hw_i) & torch.isfinite(mid_d) & torch.isfinite(hw_d)
        fin = fin & torch.isfinite(z.t.c) & torch.isfinite(z.i.c)
        # the box's form: train hw_t, inference its own hw_i or train + drift (from_box)
        box_i = torch.minimum(hw_i, hw_t + hw_d)
        worse = fin & ((z.t.rad() > BOX_LOOSER * hw_t) | (z.i.rad() > BOX_LOOSER * box_i))
        n = int(worse.sum())
        numel = int(z.t.c.numel())
        if n == 0 or numel * (max(z.t.k, z.i.k) + n) > ELEMENT_BUDGET:
            return z
        idx = torch.nonzero(worse.reshape(-1)).reshape(-1)
        g = torch.zeros((n, numel), dtype=F64, device=z.t.c.device)
        g[torch.arange(n, device=g.device), idx] = hw_t.reshape(-1)[idx]
        g = g.reshape(n, *z.t.shape)
        new_ids = torch.arange(self.k, self.k + n, dtype=torch.int64)
        self.k += n
        own = hw_i <= hw_d  # inference's own box where narrower than train + drift (from_box)
        t, i = z.t.dense(), z.i.dense()
        c_t = torch.where(worse, mid_t, t.c)
        r_t = torch.where(worse, torch.zeros_like(t.r), t.r)
        c_i = torch.where(worse, torch.where(own, mid_i, mid_t + mid_d), i.c)
        r_d = pad_hi(hw_d + 2 * U64 * (mid_t.abs() + mid_d.abs()) + TINY)
        r_i = torch.where(worse, torch.where(own, hw_i, r_d), i.r)
        g_i = torch.where(own.unsqueeze(0), torch.zeros_like(g), g)
        G_t = torch.cat([torch.where(worse, torch.zeros_like(t.G), t.G), g], 0)
        G_i = torch.cat([torch.where(worse, torch.zeros_like(i.G), i.G), g_i], 0)
        return ZState(Form(c_t, G_t, r_t, torch.cat([t.ids, new_ids])),
                      Form(c_i, G_i, r_i, torch.cat([i.ids, new_ids])))


def _sanitize(z: ZState, b: Box) -> ZState | None:
    """Non-finite centres are allowed only where the box says the value is exactly that
    infinity in both kernels (masked entries); there the form is that constant."""
    out = []
    for k, f in enumerate(z.forms()):
        nonfin = ~torch.isfinite(f.c) | ~torch.isfinite(f.r)
        if not bool(nonfin.any()):
            out.append(f)
            continue
        lo, hi = _box_part(b, k)
        if not bool(((lo == f.c) & (hi == f.c))[nonfin].all()):
            return None
        G = torch.where(nonfin, torch.zeros_like(f.Gd), f.Gd) if f.kd else f.Gd
        L = torch.where(nonfin, torch.zeros_like(f.L), f.L) if f.L is not None else None
        out.append(f.local_like(f.c, G, torch.where(nonfin, torch.zeros_like(f.r), f.r), L, f.P))
    return ZState(*out)


class _NoForm(Exception):
    """An input cannot be written as a form (an infinite bound): the node keeps its box."""


def meet(b: Box, z: ZState) -> Box:
    """The box met with the forms' concretization (never empty: both enclose the same set;
    if rounding made them disjoint, the box is kept)."""
    tl, th = z.t.bounds()
    il, ih = z.i.bounds()
    dl, dh = z.drift_bounds()
    out = []
    for lo, hi, flo, fhi in ((b.tl, b.th, tl, th), (b.il, b.ih, il, ih), (b.dl, b.dh, dl, dh)):
        nlo, nhi = torch.maximum(lo, flo), torch.minimum(hi, fhi)
        ok = (nlo <= nhi) & torch.isfinite(flo) & torch.isfinite(fhi)
        out += [torch.where(ok, nlo, lo), torch.where(ok, nhi, hi)]
    return Box(*out)


def in_bounds(z: ZState, b: Box | None, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel k's value bounds: the form's concretization met with the box when there is one."""
    f = z.t if k == 0 else z.i
    lo, hi = f.bounds()
    if b is not None:
        blo, bhi = _box_part(b, k)
        if tuple(blo.shape) == tuple(lo.shape):
            nlo, nhi = torch.maximum(lo, blo), torch.minimum(hi, bhi)
            ok = nlo <= nhi
            lo, hi = torch.where(ok, nlo, lo), torch.where(ok, nhi, hi)
    return lo, hi


# --- rules --------------------------------------------------------------------------------------
ZRule = Callable[..., Any]
ZRULES: dict[str, ZRule] = {}


def _register(op: str, fn: ZRule) -> None:
    """``fn`` as the zonotope rule of ``op`` in the one rule table (registry.rule; it also
    writes ``ZRULES``, which ZonoTrack.step reads), with the attributes it handles
    (registry.ZONOTOPE_ATTRS)."""
    from kcverify.bounds.registry import ZONOTOPE, ZONOTOPE_ATTRS, rule

    rule(op, domain=ZONOTOPE, attrs=ZONOTOPE_ATTRS.get(op, {}))(fn)


def zrule(*ops: str) -> Callable[[ZRule], ZRule]:
    def deco(fn: ZRule) -> ZRule:
        for op in ops:
            _register(op, fn)
        return fn
    return deco


def _as_z(x: Any, ctx: RuleCtx) -> ZState:
    if isinstance(x, ZState):
        return x
    v = x.value.to(ctx.device, F64)
    return ZState(const_form(v), const_form(v))


def _add_err(f: Form, err: torch.Tensor) -> Form:
    err = torch.where(torch.isfinite(err), err, torch.full_like(err, float("inf")))
    if not bool(torch.isfinite(err).all()):
        raise _NoForm
    return f.with_r(pad_hi(f.r + err) + TINY)


def _round(ctx: RuleCtx, spec: KernelSpec, prim: str | None, f: Form, steps: int = 1) -> Form:
    """The kernel's rounding of an exact result: |err| <= r|v| + eta per step (ctx.round)."""
    if prim is None:
        return f
    lo, hi = f.bounds()
    _, _, err = ctx.round(spec, prim, lo, hi, steps)
    return _add_err(f, err)


def _movement(op: str) -> ZRule:
    from kcverify.bounds.rules.shape import MOVEMENT

    fn = MOVEMENT[op]

    def rule(zt: ZonoTrack, ctx: RuleCtx, states: list, boxes: list, results: tuple):
        x = states[0]
        if not isinstance(x, ZState):
            return None
        others = [s.value if isinstance(s, Concrete) else None for s in states[1:]]
        if any(isinstance(s, ZState) for s in states[1:]):
            return None

        def move(t: torch.Tensor) -> Any:
            return fn(ctx.node, ctx.opset, t, *others)

        def apply(f: Form):
            return _moved(f, move)
        t, i = apply(x.t), apply(x.i)
        if isinstance(t, list):
            return tuple(ZState(a, b) for a, b in zip(t, i))
        return ZState(t, i)
    return rule


def _moved(f: Form, move: Callable) -> Form | list[Form]:
    """An exact selection / copy of elements applied to a form: the same map on c, r, every
    symbol's row (both parts), sum_s |G[s]| and the positions (each copied element keeps its
    position, so its local symbols stay its own)."""
    c, r = move(f.c), move(f.r)
    gs = move(f.gsum()) if f.kd + f.kl else None
    G = torch.vmap(move)(f.Gd) if f.kd else None
    L = torch.vmap(move)(f.L) if f.L is not None else None
    P = move(f.P.to(F64)) if f.L is not None else None  # positions < 2^53: exact in float64

    def one(j: int | None) -> Form:
        pick = (lambda t: t) if j is None else (lambda t: t[j])
        cj = pick(c).contiguous()
        Gj = (pick(G).contiguous() if G is not None
              else torch.zeros((0, *cj.shape), dtype=F64, device=cj.device))
        Lj = pick(L).contiguous() if L is not None else None
        Pj = pick(P).to(torch.int64).contiguous() if P is not None else None
        out = f.local_like(cj, Gj, pick(r).contiguous(), Lj, Pj)
        out._gs = pick(gs).contiguous() if gs is not None else None
        return out
    if isinstance(c, tuple):
        return [one(j) for j in range(len(c))]
    return one(None)


def _register_movement() -> None:
    from kcverify.bounds.rules.shape import MOVEMENT

    for op in MOVEMENT:
        if op != "Trilu":
            _register(op, _movement(op))


_register_movement()


@zrule("Cast")
def _cast(zt, ctx, states, boxes, results):
    """The identity where the target format holds every compute-format value; otherwise each
    kernel's cast error (the interval rule's bound) as an interval term."""
    from kcverify.bounds.rules.shape import cast_image, cast_is_exact, cast_target

    x = states[0]
    if not isinstance(x, ZState):
        return None
    target = cast_target(ctx)
    forms = []
    for spec, f in ((ctx.train, x.t), (ctx.inf, x.i)):
        if cast_is_exact(spec, target):
            forms.append(f)
        else:
            forms.append(_add_err(f, cast_image(spec, target, *f.bounds())[2]))
    return ZState(*forms)


@zrule("Gather")
def _gather(zt, ctx, states, boxes, results):
    from kcverify.bounds.rules.shape import _gather as g

    x, idx = states
    if not isinstance(x, ZState) or not isinstance(idx, Concrete):
        return None

    def apply(f: Form) -> Form:
        return _moved(f, lambda t: g(ctx.node, ctx.opset, t, idx.value))
    return ZState(apply(x.t), apply(x.i))


@zrule("Concat")
def _concat(zt, ctx, states, boxes, results):
    zs = [_as_z(s, ctx) for s in states if s is not None]
    rank = zs[0].t.c.dim()
    axis = int(ctx.attr("axis", 0)) % rank
    out = []
    for k in range(2):
        fs = [z.forms()[k] for z in zs]
        gs, u = align(fs)
        out.append(Form(torch.cat([f.c for f in fs], axis), torch.cat(gs, axis + 1),
                        torch.cat([f.r for f in fs], axis), u))
    return ZState(*out)


@zrule("Where")
def _where(zt, ctx, states, boxes, results):
    cond, x, y = states
    if not isinstance(cond, Concrete):
        return None
    c = cond.value.to(torch.bool).to(ctx.device)
    x, y = _as_z(x, ctx), _as_z(y, ctx)
    for z in (x, y):  # infinite centres only as exact constants (a mask); step() checks them
        if any(bool((~torch.isfinite(f.c) & ((f.r != 0) | (f.gsum() > TINY * 2))).any()) for f in z.forms()):
            return None
    return ZState(f_select(c, x.t, y.t), f_select(c, x.i, y.i))


def _binary(kind: str) -> ZRule:
    def rule(zt, ctx, states, boxes, results):
        a, b = states
        out = []
        for k, spec in enumerate(ctx.kernels):
            if kind in ("Add", "Sub"):
                fa, fb = _as_z(a, ctx).forms()[k], _as_z(b, ctx).forms()[k]
                f = f_add(fa, fb, 1.0 if kind == "Add" else -1.0)
                out.append(_round(ctx, spec, "add", f))
            elif kind == "Mul":
                if isinstance(b, Concrete):
                    f = f_scale(a.forms()[k], b.value)
                elif isinstance(a, Concrete):
                    f = f_scale(b.forms()[k], a.value)
                else:
                    f = f_mul(a.forms()[k], b.forms()[k])
                out.append(_round(ctx, spec, "mul", f))
            else:  # Div
                if isinstance(b, Concrete):
                    if not bool((b.value != 0).all()):
                        return None
                    f = f_scale(_as_z(a, ctx).forms()[k], 1.0 / b.value.to(F64))
                    f = fp_err(f, 4)  # 1/b rounded
                else:
                    lo, hi = in_bounds(b, boxes[1], k)
                    pos, neg = bool((lo > 0).all()), bool((hi < 0).all())
                    if not (pos or neg):
                        return None
                    inv = f_smooth(b.forms()[k], lo, hi, lambda x: 1.0 / x, lambda x: -1.0 / (x * x),
                                   _inv_drange, _d2_inv)
                    if inv is None:
                        return None
                    f = f_mul(_as_z(a, ctx).forms()[k], inv)
                out.append(_round(ctx, spec, "div", f))
        return ZState(*out)
    return rule


def _inv_drange(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-1/x^2 over [lo, hi]; unbounded below where [lo, hi] holds 0 (a guard, as _d2_inv)."""
    a, b = -1.0 / (lo * lo), -1.0 / (hi * hi)
    cross = (lo <= 0) & (hi >= 0)
    return torch.where(cross, -math.inf, torch.minimum(a, b)), torch.maximum(a, b)


for _op in ("Add", "Sub", "Mul", "Div"):
    _register(_op, _binary(_op))


@zrule("Neg")
def _neg(zt, ctx, states, boxes, results):
    x = states[0]
    return ZState(*(f.local_like(-f.c, -f.Gd, f.r, -f.L if f.L is not None else None, f.P,
                                 f.gsum()) for f in x.forms()))


# --- smooth unary ops ---------------------------------------------------------------------------
def _unary(prim: str, f: Callable, df: Callable, df_range: Callable,
           domain: Callable[[torch.Tensor, torch.Tensor], bool] | None = None,
           err: Callable | None = None, d2_range: Callable | None = None) -> ZRule:
    def rule(zt, ctx, states, boxes, results):
        x = states[0]
        out = []
        for k, spec in enumerate(ctx.kernels):
            lo, hi = in_bounds(x, boxes[0], k)
            if domain is not None and not domain(lo, hi):
                return None
            y = f_smooth(x.forms()[k], lo, hi, f, df, df_range, d2_range)
            if y is None:
                return None
            if err is not None:
                y = _add_err(y, err(ctx, spec, lo, hi, y))
            else:
                y = _round(ctx, spec, prim, y)
            out.append(y)
        return ZState(*out)
    return rule


def _register_unary() -> None:
    from kcverify.bounds.rules.elementwise import _erf_d, _exp_d, _sig_d, _sqrt_d, _tanh_d

    _register("Exp", _unary("exp", torch.exp, torch.exp, _exp_d, d2_range=_d2_exp))
    _register("Tanh", _unary("tanh", torch.tanh, lambda x: 1 - torch.tanh(x) ** 2, _tanh_d,
                             d2_range=_d2_tanh))
    _register("Erf", _unary("erf", torch.erf,
                               lambda x: 2 / math.sqrt(math.pi) * torch.exp(-x * x), _erf_d,
                               d2_range=_d2_erf))
    _register("Sigmoid", _unary("sigmoid", torch.sigmoid,
                                   lambda x: torch.sigmoid(x) * (1 - torch.sigmoid(x)), _sig_d,
                                   d2_range=_d2_sigmoid))
    _register("Sqrt", _unary("sqrt", torch.sqrt, lambda x: 0.5 / torch.sqrt(x), _sqrt_d,
                             domain=lambda lo, hi: bool((lo > 0).all()), d2_range=_d2_sqrt))
    _register("Reciprocal", _unary(
        "div", lambda x: 1.0 / x, lambda x: -1.0 / (x * x), _inv_drange,
        domain=lambda lo, hi: bool((lo > 0).all()) or bool((hi < 0).all()), d2_range=_d2_inv))


_register_unary()


def _gelu_rule(zt, ctx, states, boxes, results):
    from kcverify.bounds.rules.activation import gelu_df, gelu_drange, gelu_error, gelu_f

    form = "tanh" if str(ctx.attr("approximate", "none")) == "tanh" else "none"
    x = states[0]
    out = []
    for k, spec in enumerate(ctx.kernels):
        lo, hi = in_bounds(x, boxes[0], k)
        y = f_smooth(x.forms()[k], lo, hi, lambda v: gelu_f(v, form), lambda v: gelu_df(v, form),
                     lambda a, b: gelu_drange(a, b, form), _d2_gelu if form == "none" else None)
        if y is None:
            return None
        f_lo, f_hi = y.bounds()
        out.append(_add_err(y, gelu_error(spec, lo, hi, f_lo, f_hi, form)))
    return ZState(*out)


_register("Gelu", _gelu_rule)


@zrule("Relu")
def _relu(zt, ctx, states, boxes, results):
    """DeepZ: stable neurons exact; unstable ones lam x + mu +- mu, lam = hi/(hi - lo)."""
    x = states[0]
    out = []
    for k in range(2):
        f = x.forms()[k]
        lo, hi = in_bounds(x, boxes[0], k)
        pos, neg = lo >= 0, hi <= 0
        lam = torch.where(pos, torch.ones_like(lo), torch.where(neg, torch.zeros_like(lo),
                                                                hi / (hi - lo)))
        lam = torch.nan_to_num(lam, nan=0.0).clamp(0.0, 1.0)
        unst = ~(pos | neg)
        mu = torch.where(unst, pad_hi(-lam * lo / 2), torch.zeros_like(lo))
        y = f.local_like(lam * f.c + mu, f.Gd * lam,
                         pad_hi(lam * f.r + mu + 4 * U64 * (lam * f.c).abs()) + TINY,
                         f.L * lam if f.L is not None else None, f.P, f.scaled_gsum(lam))
        out.append(fp_err(y, 4))
    return ZState(*out)


# --- matmul -------------------------------------------------------------------------------------
def _cast_plan(ctx: RuleCtx, spec: KernelSpec, cs: Any, lo: torch.Tensor, hi: torch.Tensor,
               side: str, sample_axis: Any):
    """For a round-to-nearest float cast with no / static / dynamic per-tensor or per-token
    scale: the scale interval [s_lo, s_hi] (broadcastable, s_lo > 0) and a function mapping a
    value interval to the quotient's rounded endpoints (q_lo, q_hi), exactly as
    casts.cast_image encloses them; None for other casts."""
    from kcverify.bounds.box import imul
    from kcverify.bounds.casts import SCALE_SLACK, activation_scale_bounds, rne

    fmt = cs.format
    if spec.rounding != "nearest" or fmt.kind != "float" or cs.ftz:
        return None  # ftz: the interval rule's image (flushes) via _operand
    dynamic = cs.scale.startswith("dynamic")
    if cs.scale in ("none", "static"):
        v = 1.0 if cs.scale == "none" else float(cs.value or 1.0)
        s_lo = s_hi = torch.full((), v, dtype=F64, device=lo.device)
    elif cs.scale in ("dynamic_per_tensor", "dynamic_per_token"):
        s_lo, s_hi = activation_scale_bounds(lo, hi, cs, side, sample_axis, ctx.batch)
    else:
        return None
    if not bool((s_lo > 0).all()):
        return None

    def q_of(x_lo: torch.Tensor, x_hi: torch.Tensor, sc_lo: torch.Tensor | None = None,
             sc_hi: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # sc_lo / sc_hi: another scale interval (a branch of the scale, _walsh_cast)
        a, b = (s_lo, s_hi) if sc_lo is None else (sc_lo, sc_hi)
        t_lo, t_hi = imul(x_lo, x_hi, 1.0 / b, 1.0 / a)
        t_lo, t_hi = pad_lo(t_lo, SCALE_SLACK), pad_hi(t_hi, SCALE_SLACK)
        if dynamic:
            lim = fmt.max_finite * (1 + 2 * SCALE_SLACK)
            t_lo, t_hi = t_lo.clamp(-lim, lim), t_hi.clamp(-lim, lim)
        elif fmt.max_finite * (1 - 2 * SCALE_SLACK) <= float(torch.maximum(t_lo.abs(), t_hi.abs()).max()):
            raise _NoForm  # a static scale that may overflow: the interval rule says inf
        return rne(t_lo, fmt), rne(t_hi, fmt)
    q_of.max_finite = float(fmt.max_finite)  # type: ignore[attr-defined]
    return s_lo, s_hi, q_of


def _scaled(s_lo: torch.Tensor, s_hi: torch.Tensor, q1: torch.Tensor, q2: torch.Tensor,
            deq_u: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """s q for q in {q1, q2} (the two branches of a symbol), s in [s_lo, s_hi], dequantised
    with rounding deq_u: centre, coefficient of the branch symbol, and the noise radius."""
    s_mid = 0.5 * s_lo + 0.5 * s_hi
    s_hw = pad_hi(torch.maximum(s_hi - s_mid, s_mid - s_lo).clamp_min(0.0))
    qm = torch.maximum(q1.abs(), q2.abs())
    centre = s_mid * (0.5 * q1 + 0.5 * q2)
    coef = s_mid * (0.5 * q2 - 0.5 * q1)
    noise = s_hw * qm + (2 * deq_u + 1e-15) * s_hi * qm + 4 * U64 * (centre.abs() + coef.abs())
    return centre, coef, pad_hi(noise) + TINY


def _scale_branches(ctx: RuleCtx, spec: KernelSpec, cs: Any, f: Form, lo: torch.Tensor,
                    hi: torch.Tensor, brow: torch.Tensor, side: str, sample_axis: Any,
                    deq: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A dynamic per-tensor scale is amax / max_finite over the whole operand: once the amax
    element depends on a binary symbol b upstream (a straddled rounding in its row), the scale
    is uncertain for *every* element, and each element near a midpoint would become a fresh,
    independent binary symbol. But b is exactly +1 or -1: evaluate the operand's bounds, the
    scale and every element's cast on each branch; where every element's cast is a single value
    on both branches, the cast is the affine function mid + b * half-difference of that same
    symbol (exact), plus the scale's own interval and the dequantisation rounding as noise.
    Returns (centre, noise (inf where not exact), G) or None (one scale group only)."""
    if cs.scale != "dynamic_per_tensor":
        return None
    cand = mag(lo, hi) >= mig(lo, hi).max()  # elements that may hold the amax
    gb = f.G[brow].abs()
    score = (gb * cand.unsqueeze(0)).reshape(gb.shape[0], -1).amax(1)
    jj = int(score.argmax())
    if not float(score[jj]) > 0:
        return None
    g_j = f.G[brow[jj]]
    w_j = pad_hi((f.gsum() - g_j.abs()).clamp_min(0.0) + f.r) + TINY
    branch = []
    for sign in (1.0, -1.0):
        x_lo = torch.maximum(pad_lo(f.c + sign * g_j - w_j), lo)
        x_hi = torch.minimum(pad_hi(f.c + sign * g_j + w_j), hi)
        if bool((x_lo > x_hi).any()):
            return None  # the box rules this branch out somewhere: keep the other options
        plan = _cast_plan(ctx, spec, cs, x_lo, x_hi, side, sample_axis)
        if plan is None:
            return None
        s_lo, s_hi, q_of = plan
        if s_lo.numel() != 1:
            return None
        q_lo, q_hi = q_of(x_lo, x_hi)
        v_lo, v_hi = torch.minimum(s_lo * q_lo, s_hi * q_lo), torch.maximum(s_lo * q_lo, s_hi * q_lo)
        branch.append((q_lo == q_hi, pad_lo(v_lo), pad_hi(v_hi), s_hi * q_lo.abs()))
    (ok_p, lo_p, hi_p, m_p), (ok_m, lo_m, hi_m, m_m) = branch
    mid_p, mid_m = 0.5 * lo_p + 0.5 * hi_p, 0.5 * lo_m + 0.5 * hi_m
    hw = torch.maximum(torch.maximum(hi_p - mid_p, mid_p - lo_p), torch.maximum(hi_m - mid_m, mid_m - lo_m))
    centre = 0.5 * mid_p + 0.5 * mid_m
    coef = 0.5 * mid_p - 0.5 * mid_m
    noise = (pad_hi(hw.clamp_min(0.0)) + (2 * deq + 1e-15) * torch.maximum(m_p, m_m)
             + 4 * U64 * (centre.abs() + coef.abs()))
    noise = pad_hi(noise) + TINY
    ok = ok_p & ok_m & torch.isfinite(centre) & torch.isfinite(coef)
    G = torch.zeros_like(f.G)
    G[brow[jj]] = torch.where(ok, coef, torch.zeros_like(coef))
    return centre, torch.where(ok, noise, torch.full_like(noise, float("inf"))), G


BRANCH_SYMBOLS = 5  # binary symbols per element a cast is evaluated on, all 2^k branches
BINARY_COST = 0.5  # a new binary symbol's share of its coefficient when cast options compete


def _binary_branches(f: Form, brow: torch.Tensor, q_of: Callable, s_lo: torch.Tensor,
                     s_hi: torch.Tensor, deq: float, kmax: int = BRANCH_SYMBOLS
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The cast of x as a function of the binary symbols x depends on (issue 12).

    A straddled rounding upstream is a binary symbol b in {-1, +1}: the programs went one way
    or the other. Downstream, x = c + sum_j g_j b_j + w (the k binary symbols of largest
    |g_j| at the element, w the rest: other symbols and r). When, for each of the 2^k sign
    vectors sigma, the quotient of [c + g.sigma - w, c + g.sigma + w] rounds to one value
    q(sigma), the cast is an exact function of b: q(b) = sum_S qh_S chi_S(b) (its Walsh
    expansion, chi_S the product of the b_j, j in S; qh_S = 2^-k sum_sigma q(sigma) chi_S(sigma)).
    The affine part (S of size <= 1) keeps the upstream symbols: centre s_mid qh_0 and
    coefficient s_mid qh_j on b_j; the rest, |sum_{|S| >= 2} qh_S chi_S| <= sum |qh_S|, and the
    scale's interval, |s - s_mid| max |q|, and the dequantisation go to the noise. So several
    flipped roundings upstream leave the cast a function of those flips instead of a new,
    independent flip. Returns (centre, G (f's rows), noise: inf where a branch straddles)."""
    Gb = f.G[brow]
    k = min(kmax, int(brow.numel()))
    top = Gb.abs().topk(k, dim=0).indices  # (k, *shape): distinct rows per element
    g = torch.gather(Gb, 0, top)
    g_abs = g.abs().sum(0)
    # w: every other symbol and r; plus the float64 error of c + g.sigma (k + 1 terms)
    w = pad_hi((f.gsum() - g_abs).clamp_min(0.0) + f.r
               + (k + 2) * U64 * (f.c.abs() + g_abs)) + TINY
    n = 1 << k
    qs, ok = [], torch.isfinite(f.c)
    for m in range(n):
        x = f.c.clone()
        for j in range(k):
            x = x + g[j] if (m >> j) & 1 else x - g[j]
        q_lo, q_hi = q_of(pad_lo(x - w), pad_hi(x + w))
        ok = ok & (q_lo == q_hi) & torch.isfinite(q_lo)
        qs.append(torch.where(ok, q_lo, torch.zeros_like(q_lo)))
    Q = torch.stack(qs)  # (2^k, *shape): format values, exact
    sig = torch.tensor([[1.0 if (m >> j) & 1 else -1.0 for m in range(n)] for j in range(k)],
                       dtype=F64, device=Q.device)  # (k, 2^k)
    chi = torch.ones((n, n), dtype=F64, device=Q.device)  # chi[S, m] = prod_{j in S} sigma_j(m)
    for S in range(n):
        for j in range(k):
            if (S >> j) & 1:
                chi[S] = chi[S] * sig[j]
    # sums of 2^k format values, then a power of two: exact in float64 for fp8 / bf16 / fp16
    # formats (their values span < 2^40); an error term covers the rest anyway
    qh = torch.tensordot(chi, Q, dims=1) / n
    qmax = Q.abs().amax(0)
    single = torch.tensor([1 << j for j in range(k)], device=Q.device)
    first = qh[single]  # (k, *shape): the coefficient of b_j
    higher = qh.abs().sum(0) - qh[0].abs() - first.abs().sum(0)
    higher = pad_hi(higher.clamp_min(0.0) + (n + 4) * U64 * n * qmax)
    s_mid = 0.5 * s_lo + 0.5 * s_hi
    s_hw = pad_hi(torch.maximum(s_hi - s_mid, s_mid - s_lo).clamp_min(0.0))
    centre = s_mid * qh[0]
    coef = s_mid * first
    noise = (s_hw * qmax + s_hi * higher + (2 * deq + 1e-15) * s_hi * qmax
             + 4 * U64 * (centre.abs() + coef.abs().sum(0)))
    noise = pad_hi(noise) + TINY
    ok = ok & torch.isfinite(centre) & torch.isfinite(noise)
    G = torch.zeros_like(f.G)
    G.scatter_(0, brow[top], torch.where(ok, coef, torch.zeros_like(coef)))
    return (torch.where(ok, centre, torch.zeros_like(centre)), G,
            torch.where(ok, noise, torch.full_like(noise, float("inf"))))


SCALE_ENUM = 8  # base symbols a per-tensor scale's amax may be evaluated on (2^k branches)


def _scale_table(zt: ZonoTrack, cs: Any, f: Form, bm: torch.Tensor, lo: torch.Tensor,
                 hi: torch.Tensor, s_lo: torch.Tensor, side: str, sample_axis: Any,
                 batch: int | None) -> tuple[tuple[int, ...], torch.Tensor, torch.Tensor] | None:
    """A dynamic per-tensor scale s = fl32(amax / M) as a function of the base binary symbols
    its amax depends on (issue 12, design C). Only elements that may hold the amax (|x| can
    reach the largest least magnitude) matter; when their binary rows have supports within a
    set U of at most SCALE_ENUM base symbols, then on each sign vector sigma of U every such
    element lies in [x_sigma - w, x_sigma + w] (met with its box), and the scale kind's own
    enclosure of those bounds (the other elements keep their boxes) holds the scale of every
    program whose flips are sigma. Returns (U, s_lo, s_hi per sign vector of U) or None (one
    scale group only: a batch of one sample)."""
    from kcverify.bounds.casts import activation_scale_bounds

    if cs.scale != "dynamic_per_tensor" or s_lo.numel() != 1:
        return None
    cand = (mag(lo, hi) >= mig(lo, hi).max()).reshape(-1)
    Gb = f.G[bm.to(f.G.device)]
    ids = f.ids[bm].tolist()
    touch = (Gb.reshape(int(Gb.shape[0]), -1)[:, cand] != 0).any(1).tolist()
    U = tuple(sorted({b for i, t in zip(ids, touch) if t for b in zt.mono.support[i]}))
    if not U or len(U) > SCALE_ENUM:
        return None
    sub = Form(f.c, f.G, f.r, f.ids)
    groups, gs = _walsh_groups(zt, sub, bm, U)
    k = len(U)
    n = 1 << k
    t_lo, t_hi, t_j, t_sg = [], [], [], []
    lo_f, hi_f = lo.reshape(-1), hi.reshape(-1)
    vals = []  # per group: the columns of U's sign vectors in its own enumeration
    for V, els, xs, w, _ in gs:
        keep = cand[els]
        if not bool(keep.any()):
            continue
        pos = [V.index(b) for b in U]
        m = torch.arange(1 << len(V))
        idx = sum(((m >> p) & 1) << j for j, p in enumerate(pos))
        vals.append((els[keep], xs[:, keep], w[keep], idx))
    for sig in range(n):
        a, b = lo_f.clone(), hi_f.clone()
        for els, xs, w, idx in vals:
            # the element's values on sign vectors agreeing with sig on U (its other symbols
            # free): their hull
            sel = idx == sig
            xl = pad_lo(xs[sel] - w).amin(0)
            xh = pad_hi(xs[sel] + w).amax(0)
            a[els] = torch.maximum(a[els], xl)
            b[els] = torch.minimum(b[els], xh)
        bad = a > b  # no program has these flips (the box excludes them): any scale will do
        a, b = torch.where(bad, lo_f, a), torch.where(bad, hi_f, b)
        sl, sh = activation_scale_bounds(a.reshape(lo.shape), b.reshape(hi.shape), cs, side,
                                         sample_axis, batch)
        if sl.numel() != 1:
            return None
        t_lo.append(sl.reshape(()))
        t_hi.append(sh.reshape(()))
        # the amax element on these flips, when one element is certainly it (its least
        # magnitude above every other's greatest, above the floor, of one sign)
        least, most = mig(a, b), mag(a, b)
        j = int(least.argmax())
        others = torch.cat([most[:j], most[j + 1:]])
        one = (bool(least[j] > others.max()) if others.numel() else True) and \
            float(least[j]) >= cs.floor and not bool(bad[j])
        t_j.append(j if one else -1)
        t_sg.append(1.0 if float(a[j]) > 0 else -1.0)
    return U, torch.stack(t_lo), torch.stack(t_hi), t_j, t_sg


def _walsh_cast(zt: ZonoTrack, f: Form, bm: torch.Tensor, q_of: Callable, s_lo: torch.Tensor,
                s_hi: torch.Tensor, deq: float, scale: tuple | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]] | None:
    """The cast as an exact polynomial of the base binary symbols (binpoly module doc): for
    each element whose binary rows (and the scale's amax, ``scale`` = _scale_table's
    (U, s_lo, s_hi per sign vector of U)) depend on a set V of at most ENUM_MAX base symbols,
    the quotient of [x_sigma - w, x_sigma + w] by the scale of sigma must round to one value
    q(sigma) on every sign vector sigma of V; then cast(x) = s(sigma) q(sigma) for the program's
    flips sigma, and its Walsh expansion is kept whole (monomial symbols): centre, rows per
    monomial id, and the noise (the scale's width, the dequantisation, terms dropped, float64
    errors; inf where an element is not evaluated or a branch straddles)."""
    extra = scale[0] if scale is not None else ()
    groups, gs = _walsh_groups(zt, f, bm, extra)
    if not gs:
        return None
    shape = f.shape
    numel = f.c.numel()
    norm = None  # relative to the amax element (scale[3]: one element on every sign vector)
    if scale is not None and len(set(scale[3])) == 1 and scale[3][0] >= 0 \
            and len(set(scale[4])) == 1:
        j = scale[3][0]
        U = scale[0]
        bmd = bm.to(f.G.device)
        gj = f.G[bmd].reshape(int(bmd.sum()), -1)[:, j]
        rj = torch.nonzero(gj != 0).reshape(-1)
        bids = f.ids[bm].tolist()
        sgU = binpoly.signs(len(U))
        chi = torch.ones((1 << len(U), int(rj.numel())), dtype=F64)
        for c_, r_ in enumerate(rj.tolist()):
            for b_ in zt.mono.support[bids[r_]]:
                chi[:, c_] = chi[:, c_] * sgU[:, U.index(b_)]
        yU = f.c.reshape(-1)[j] + chi @ gj[rj]  # the amax element on U's sign vectors
        rc = _cont_rad(f, bm).reshape(-1)[j]
        y_err = (int(rj.numel()) + 4) * U64 * (f.c.reshape(-1)[j].abs() + gj[rj].abs().sum())
        rcj = pad_hi(rc + y_err) + TINY  # |continuous part of y| (and the float64 error of yU)
        norm = (j, scale[4][0], yU, rcj, float(f.r.reshape(-1)[j]) + float(y_err))
        abar = torch.zeros(numel, dtype=F64, device=f.c.device)
    centre = torch.zeros(numel, dtype=F64, device=f.c.device)
    noise = torch.full((numel,), float("inf"), dtype=F64, device=f.c.device)
    sl_f = s_lo.expand(shape).reshape(-1) if s_lo.numel() > 1 else s_lo.reshape(1)
    sh_f = s_hi.expand(shape).reshape(-1) if s_hi.numel() > 1 else s_hi.reshape(1)
    terms: dict[int, torch.Tensor] = {}
    for V, els, xs, w, _ in gs:
        k = len(V)
        n = 1 << k
        if scale is not None:
            pos = [V.index(b) for b in scale[0]]
            m = torch.arange(n)
            idx = sum(((m >> p) & 1) << j for j, p in enumerate(pos))
            a = scale[1][idx].unsqueeze(1).expand(n, int(els.numel()))
            b = scale[2][idx].unsqueeze(1).expand(n, int(els.numel()))
        else:
            a = (sl_f[els] if sl_f.numel() > 1 else sl_f).expand(n, int(els.numel()))
            b = (sh_f[els] if sh_f.numel() > 1 else sh_f).expand(n, int(els.numel()))
        q_lo, q_hi = q_of(pad_lo(xs - w), pad_hi(xs + w), a, b)
        ok = ((q_lo == q_hi) & torch.isfinite(q_lo)).all(0)
        if not bool(ok.any()):
            continue
        q = torch.where(ok.unsqueeze(0), q_lo, torch.zeros_like(q_lo))
        if norm is None:  # s(sigma) q(sigma), s in its interval
            s_mid = 0.5 * a + 0.5 * b
            s_hw = pad_hi(torch.maximum(b - s_mid, s_mid - a).clamp_min(0.0))
            v = s_mid * q
            nz = (s_hw * q.abs() + (2 * deq + 1e-15) * b * q.abs()).amax(0)
        else:  # s = fl32(|y| / M) for the amax element y = y_sigma + d: q sg / M (y_sigma + d)
            j, sg, yU, rcj, _ = norm
            M = float(q_of.max_finite)
            ys = yU[idx].unsqueeze(1)  # (n, 1)
            al = q * (sg / M)
            v = al * ys
            ab = al.mean(0)
            spread = (al - ab.unsqueeze(0)).abs().amax(0)
            ymax = ys.abs().amax() + rcj
            nz = (spread * rcj + al.abs().amax(0) * ymax * (2.0**-22 + 2 * deq + 1e-15)
                  + (n + 4) * U64 * al.abs().amax(0) * rcj)
        vmax = v.abs().amax(0)
        coef = binpoly.fwht(v, k)
        const, ids, rows, dropped = binpoly.walsh_terms(zt.mono, zt.new_monomial_id, V, coef,
                                                        vmax)
        fp = (k * (n + 2) + 8) * U64 * vmax + 4 * U64 * (const.abs() + rows.abs().sum(0))
        nz = pad_hi((nz + dropped + fp) * (1 + 1e-12)) + TINY
        okd = ok.to(centre.device)
        e_ok = els[ok]
        centre[e_ok] = const[okd]
        noise[e_ok] = nz[okd]
        if norm is not None:
            abar[e_ok] = ab[okd]
        for i, row in zip(ids, rows):
            t = terms.get(i)
            if t is None:
                t = terms[i] = torch.zeros(numel, dtype=F64, device=f.c.device)
            t[e_ok] = row[okd]
    if not bool(torch.isfinite(noise).any()):
        return None
    cont = None
    if norm is not None:  # the continuous rows of the amax element, times abar; r_j: noise
        cont = (norm[0], abar.reshape(shape))
        noise = pad_hi(noise + abar.abs() * (norm[4] + 4 * U64 * float(norm[3]))) + TINY
    return (centre.reshape(shape), noise.reshape(shape),
            {i: t.reshape(shape) for i, t in terms.items()}, cont)


def _normalized_cast(spec: KernelSpec, cs: Any, f: Form, lo: torch.Tensor, hi: torch.Tensor,
                     sample_axis: Any, batch: int | None, deq: float
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A dynamic per-tensor cast relative to its own amax element (issue 12).

    s = fl32(amax / M) (M = max_finite), and everything upstream of a dynamic cast carries the
    upstream scales as a common factor: the value intervals of x and of s then share one
    relative uncertainty, which an interval quotient x / [s_lo, s_hi] counts twice, making
    casts unstable that no program can round apart. When one element y = |x_j| of a sample's
    group is certainly its amax (its least magnitude exceeds every other element's greatest)
    and at least the floor, x_e / s = M x_e / y / (1 + theta), |theta| <= 2^-24, and the ratio is
    linearised on the forms: M x_e / y = M (c_e / c_y + dx_e / c_y - c_e dy / c_y^2) + R with
    |R| <= M (|dx_e| |dy| / (|c_y| y_min) + |c_e| |dy|^2 / (c_y^2 y_min)) (exact remainder of the
    first-order expansion, y in [y_min, .] > 0). Where the quotient's enclosure (also padded by
    the program's own quotient rounding, SCALE_SLACK) rounds to one value q, the cast value is
    q s = (q / M) y (1 + theta): an affine function of y's form, correlated with it, with the
    relative noise of theta and the dequantisation. Returns (centre, noise (inf where the cast
    is not certainly one value), G) or None."""
    from kcverify.bounds.casts import SCALE_SLACK, rne

    if (cs.scale != "dynamic_per_tensor" or spec.rounding != "nearest"
            or cs.format.kind != "float" or cs.ftz):
        return None
    shape = f.shape
    if not shape or f.k == 0:
        return None
    if isinstance(sample_axis, int) and not isinstance(sample_axis, bool) and len(shape) > 1:
        ax = sample_axis % len(shape)
    elif batch in (None, 1):
        ax = None
    else:
        return None

    def rows(t: torch.Tensor, lead: int = 0) -> torch.Tensor:  # (lead..., B, N)
        if ax is None:
            return t.reshape(*t.shape[:lead], 1, -1)
        return t.movedim(lead + ax, lead).reshape(*t.shape[:lead], t.shape[lead + ax], -1)

    def back(t: torch.Tensor, lead: int = 0) -> torch.Tensor:
        if ax is None:
            return t.reshape(*t.shape[:lead], *shape)
        moved = [shape[ax]] + [d for i, d in enumerate(shape) if i != ax]
        return t.reshape(*t.shape[:lead], *moved).movedim(lead, lead + ax)

    M = float(cs.format.max_finite)
    L, H, C, R = rows(lo), rows(hi), rows(f.c), rows(f.r)
    Gr = rows(f.G, 1)
    least, most = mig(L, H), mag(L, H)
    j = least.argmax(-1, keepdim=True)
    y_min = torch.gather(least, -1, j)
    others = most.scatter(-1, j, torch.full_like(y_min, -1.0)).amax(-1, keepdim=True)
    sign = torch.where(torch.gather(L, -1, j) > 0, 1.0, -1.0).to(F64)
    ok = (y_min > others) & (y_min >= cs.floor) & ((torch.gather(L, -1, j) > 0) | (torch.gather(H, -1, j) < 0))
    if not bool(ok.any()):
        return None
    c_y = sign * torch.gather(C, -1, j)
    G_y = sign.unsqueeze(0) * torch.gather(Gr, -1, j.unsqueeze(0).expand(Gr.shape[0], *j.shape))
    r_y = torch.gather(R, -1, j)
    gs = rows(f.gsum())
    dx = pad_hi(gs + R)
    dy = torch.gather(dx, -1, j)
    cy = torch.where(ok, c_y, torch.ones_like(c_y))
    ymin = torch.where(ok, y_min, torch.ones_like(y_min))
    t_c = M * C / cy
    t_G = M * (Gr / cy.unsqueeze(0) - (C / cy ** 2).unsqueeze(0) * G_y)
    rem = M * (dx * dy / (cy.abs() * ymin) + C.abs() * dy ** 2 / (cy ** 2 * ymin))
    t_r = M * (R / cy.abs() + C.abs() * r_y / cy ** 2) + rem
    t_rad = pad_hi(_l1(t_G) * (1 + (Gr.shape[0] + 2) * U64) + t_r) * (1 + 1e-9)
    t_lo, t_hi = t_c - t_rad, t_c + t_rad
    slack = 2 * SCALE_SLACK + 2.0**-23
    t_lo = torch.where(t_lo > 0, t_lo * (1 - slack), t_lo * (1 + slack))
    t_hi = torch.where(t_hi > 0, t_hi * (1 + slack), t_hi * (1 - slack))
    lim = M * (1 + 2 * SCALE_SLACK)
    q_lo, q_hi = rne(t_lo.clamp(-lim, lim), cs.format), rne(t_hi.clamp(-lim, lim), cs.format)
    good = ok & (q_lo == q_hi) & torch.isfinite(q_lo) & torch.isfinite(t_c)
    a = q_lo / M
    centre = a * c_y
    G = a.unsqueeze(0) * G_y
    ymax = c_y.abs() + pad_hi(torch.gather(gs, -1, j) + r_y)
    noise = a.abs() * (r_y + ymax * (2.0**-24 + 2 * deq + 2.0**-50)) * (1 + 1e-9)
    noise = pad_hi(noise + 4 * U64 * centre.abs()) + TINY
    inf = torch.full_like(noise, float("inf"))
    return back(centre), back(torch.where(good, noise, inf)), back(G, 1)


def _cast_operand(zt: ZonoTrack, ctx: RuleCtx, spec: KernelSpec, s: Any, box: Box | None,
                  k: int, weight: bool, side: str, out_axis: int, k_axis: int,
                  sample_axis: Any = None
                  ) -> tuple[Form | torch.Tensor, torch.Tensor, torch.Tensor, tuple]:
    """Kernel k's cast operand: a form (or an exact constant tensor), and its value bounds.

    Per element, the form with the least new noise among: x + e (keeps x's symbols, e the cast
    error); the cast image alone; the image when it holds one value (a point) or two adjacent
    values (a new *binary* symbol: a straddled rounding goes one way or the other); and, when
    x depends on a binary symbol, the image of each of its two branches (the cast is then an
    exact function of that symbol, so one flipped rounding upstream does not make every
    rounding downstream free)."""
    from kcverify.bounds.rules.linear import _operand, operand_scales

    if isinstance(s, Concrete):
        lo = hi = s.value.to(ctx.device, F64)
        q_lo, q_hi, _, _ = _operand(ctx, spec, s, lo, hi, weight, side, out_axis, k_axis,
                                    sample_axis)
        sc = operand_scales(ctx, spec, s, lo, hi, weight, side, out_axis, k_axis, sample_axis)
        if bool((q_lo == q_hi).all()):
            return q_lo, q_lo, q_hi, sc
        mid = 0.5 * q_lo + 0.5 * q_hi
        return const_form(mid, pad_hi(torch.maximum(q_hi - mid, mid - q_lo))), q_lo, q_hi, sc
    f = s.forms()[k]
    lo, hi = in_bounds(s, box, k)
    x = box if box is not None else s
    c_lo, c_hi, e_lo, e_hi = _operand(ctx, spec, x, lo, hi, weight, side, out_axis, k_axis,
                                      sample_axis)
    sc = operand_scales(ctx, spec, x, lo, hi, weight, side, out_axis, k_axis, sample_axis)
    if not (bool(torch.isfinite(c_lo).all()) and bool(torch.isfinite(c_hi).all())):
        raise _NoForm
    if bool((e_lo == 0).all()) and bool((e_hi == 0).all()):
        return f, lo, hi, sc
    f = f.dense()  # the options below pick rows per element (binary symbols are dense)
    e_mid = 0.5 * e_lo + 0.5 * e_hi
    e_hw = pad_hi(torch.maximum(e_hi - e_mid, e_mid - e_lo))
    i_mid = 0.5 * c_lo + 0.5 * c_hi
    i_hw = pad_hi(torch.maximum(c_hi - i_mid, i_mid - c_lo))
    inf = torch.full_like(lo, float("inf"))
    # options: 0 = x + e, 1 = image box, 2 = point / binary image, 3 = branches of a binary
    # symbol, 4 = branches of the binary symbol the scale's amax depends on (_scale_branches)
    noise = [e_hw, i_hw, inf, inf, inf, inf, inf]
    cs = spec.weights if weight else spec.activations
    plan = (_cast_plan(ctx, spec, cs, lo, hi, side, sample_axis)
            if cs is not None and not weight else None)
    deq = spec.accumulate.u
    G_branch = None
    if plan is not None:
        s_lo, s_hi, q_of = plan
        q_lo, q_hi = q_of(lo, hi)
        single = q_lo == q_hi
        adj = ~single & (q_hi == next_up(q_lo, cs.format))
        c2, g2, n2 = _scaled(s_lo, s_hi, q_lo, q_hi, deq)
        ok2 = (single | adj) & torch.isfinite(c2)
        noise[2] = torch.where(ok2, n2, inf)
        rows = torch.isin(f.ids, zt.binary) if zt.binary.numel() and f.k else None
        r6 = (_row_budget(f.G, rows) if rows is not None and bool(rows.any()) and EXACT_BINARY
              else None)  # past ROWS_MAX binary rows, the largest (the rest: continuous)
        if r6 is not None:
            # 6: the cast as an exact polynomial of the base binary symbols (and the scale's)
            tab = _scale_table(zt, cs, f, r6, lo, hi, s_lo, side, sample_axis, ctx.batch)
            wc = _walsh_cast(zt, f, r6, q_of, s_lo, s_hi, deq, tab)
            if wc is not None:
                c6, noise[6], terms, cont = wc
                new_ids = [i for i in sorted(terms) if i not in set(f.ids.tolist())]
                if new_ids:  # zero rows for the new monomials: the same set
                    k6 = f.ids[r6]
                    z = torch.zeros((len(new_ids), *f.shape), dtype=F64, device=f.c.device)
                    f = _with_rows(f, z, new_ids)
                    rows = torch.isin(f.ids, zt.binary)
                    r6 = torch.isin(f.ids, torch.cat([k6, torch.tensor(new_ids)]))
                pos = {i: j for j, i in enumerate(f.ids.tolist())}
                G6 = torch.zeros_like(f.G)
                for i, t in terms.items():
                    G6[pos[i]] = t
                if cont is not None:  # abar_e times the amax element's continuous rows
                    jc, abar = cont
                    # (a binary row left out by the budget is continuous here, and may be a
                    # Walsh term's monomial as well: the two add)
                    cr = torch.nonzero(~r6).reshape(-1).to(f.G.device)
                    gjc = f.G[cr].reshape(int(cr.numel()), -1)[:, jc]
                    G6[cr] = G6[cr] + gjc.reshape(-1, *([1] * len(f.shape))) * abar.unsqueeze(0)
        if rows is not None and bool(rows.any()):
            brow = torch.nonzero(rows).reshape(-1).to(f.G.device)
            c3, G_branch, noise[3] = _binary_branches(f, brow, q_of, s_lo, s_hi, deq)
            n3 = noise[3]
            sb = _scale_branches(ctx, spec, cs, f, lo, hi, brow, side, sample_axis, deq)
            if sb is not None:
                c4, n4, G_scale = sb
                noise[4] = n4
    nc = (_normalized_cast(spec, cs, f, lo, hi, sample_axis, ctx.batch, deq)
          if cs is not None and not weight and f.k else None)
    if nc is not None:
        c5, noise[5], G5 = nc
    cost = list(noise)
    if plan is not None:  # a new binary symbol is new uncertainty too (half its size counts:
        # two points, on whose branches downstream casts can still be exact, _binary_branches)
        cost[2] = noise[2] + torch.where(adj, BINARY_COST * g2.abs(), torch.zeros_like(g2))
    best = torch.stack(cost).argmin(0)
    c = torch.where(best == 0, f.c + e_mid, i_mid)
    r = torch.where(best == 0, pad_hi(f.r + e_hw + 2 * U64 * (f.c.abs() + e_mid.abs())) + TINY, i_hw)
    G = torch.where(best == 0, f.G, torch.zeros_like(f.G))
    if plan is not None:
        c = torch.where(best == 2, c2, c)
        r = torch.where(best == 2, n2, r)
        if G_branch is not None:
            c = torch.where(best == 3, c3, c)
            r = torch.where(best == 3, n3, r)
            G = torch.where(best == 3, G_branch, G)
            if torch.isfinite(noise[4]).any():
                c = torch.where(best == 4, c4, c)
                r = torch.where(best == 4, noise[4], r)
                G = torch.where(best == 4, G_scale, G)
    if nc is not None and bool((best == 5).any()):
        c = torch.where(best == 5, c5, c)
        r = torch.where(best == 5, noise[5], r)
        G = torch.where(best == 5, G5, G)
    if bool((best == 6).any()):
        c = torch.where(best == 6, c6, c)
        r = torch.where(best == 6, noise[6], r)
        G = torch.where(best == 6, G6, G)
    out = f.like(c, G, r)
    if CAST_TRACE is not None:
        CAST_TRACE(ctx.node.name, side, k, best, noise, f, zt)
    if plan is not None:
        new = (best == 2) & adj
        if bool(new.any()):
            out = zt.binary_symbols(out, torch.where(new, g2, torch.zeros_like(g2)),
                                    site=(ctx.node.name, side, spec.name))
    return out, c_lo, c_hi, sc


def _matmul_core(zt: ZonoTrack, ctx: RuleCtx, a: Any, b: Any, box_a: Box | None,
                 box_b: Box | None, aw: bool, bw: bool, axes: tuple) -> ZState | None:
    """(cast A) @ (cast B) for both kernels, accumulated in any order and rounded (the
    accumulation enclosure of rules/linear.py). ``axes``: the operands' sample axes."""
    from kcverify.bounds.rules.linear import _grid_pair, accumulation_error, rescale_error

    # x @ W with a constant W: x's r becomes symbols after the product (f_matmul_const_fresh)
    after = isinstance(a, ZState) and bw and isinstance(b, Concrete) and b.value.dim() == 2
    a = zt.symbolize(a) if isinstance(a, ZState) and not after else a
    b = zt.symbolize(b) if isinstance(b, ZState) else b
    out = []
    for k, spec in enumerate(ctx.kernels):
        fa, a_lo, a_hi, sa = _cast_operand(zt, ctx, spec, a, box_a, k, aw, "left", -2, -1, axes[0])
        fb, b_lo, b_hi, sb = _cast_operand(zt, ctx, spec, b, box_b, k, bw, "right", -1, -2, axes[1])
        if isinstance(fa, torch.Tensor) and isinstance(fb, torch.Tensor):
            return None
        if PRUNE_ZERO_ROWS:  # the same sets without the all-zero rows the casts left
            fa = fa.without_zero_rows() if isinstance(fa, Form) else fa
            fb = fb.without_zero_rows() if isinstance(fb, Form) else fb
        # the cast errors as symbols: one straddled rounding moves a whole row/column together
        fa = zt.fresh(fa) if isinstance(fa, Form) and not after else fa
        fb = zt.fresh(fb) if isinstance(fb, Form) else fb
        if after and isinstance(fa, Form) and isinstance(fb, torch.Tensor):
            y = f_matmul_const_fresh(zt, fa, fb)
        elif isinstance(fb, torch.Tensor):
            y = f_matmul_const(fa, fb)
        elif isinstance(fa, torch.Tensor):
            y = f_matmul_const(fb, fa, left=True)
        else:
            y = f_matmul(fa, fb)
        n = a_lo.shape[-1]
        mm = ((mag(a_lo, a_hi), mag(b_lo, b_hi), sa[1], sb[1])
              if spec.accumulation.mma is not None else None)  # the tensor-core bound's operands
        magn = mag(a_lo, a_hi) @ mag(b_lo, b_hi)  # one product for both error terms
        acc = accumulation_error(spec, n, magn, sa[0] * sb[0], sa[1] * sb[1], mm)
        grid = _grid_pair(ctx, spec, k, a, *_pre_cast(a, box_a, k, ctx), aw, axes[0], None,
                          b, *_pre_cast(b, box_b, k, ctx), bw, -1, -2, axes[1], n, count=False)
        if grid is not None:  # the sharper enclosure of exact products (rules/linear.py)
            acc = torch.minimum(acc, grid[2])
        acc = pad_hi(acc * (1 + (n + 4) * U64)) + TINY
        # the rescale's underflow part (a scale product that may be subnormal): rules/linear.py
        acc = acc + rescale_error(spec, n, magn, sa[0] * sb[0], sa[1], sb[1])
        y = _add_err(y, acc)
        y = _round(ctx, spec, "mul", y, steps=2)
        out.append(y)
    return ZState(*out)


def _pre_cast(x: Any, box: Box | None, k: int, ctx: RuleCtx) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel k's value bounds of a matmul operand before its cast."""
    if isinstance(x, Concrete):
        lifted = ctx.lift(x)
        return (lifted.tl, lifted.th) if k == 0 else (lifted.il, lifted.ih)
    return in_bounds(x, box, k)


def _weights_raw(zt: ZonoTrack, ctx: RuleCtx, states: list) -> tuple[list, list[bool]]:
    """Constant operands enter as they are (cast exactly by the spec), like the interval rule."""
    flags = [ctx.node.inputs[j] in ctx.constants for j in range(2)]
    ops = [zt.raw[j] if flags[j] and isinstance(zt.raw[j], Concrete) else states[j] for j in range(2)]
    return ops, flags


def _matmul_rule(zt, ctx, states, boxes, results):
    a, b = states
    if any(isinstance(s, Concrete) and s.value.dim() < 2 for s in (a, b)):
        return None
    if any(isinstance(s, ZState) and s.t.c.dim() < 2 for s in (a, b)):
        return None
    (a, b), (aw, bw) = _weights_raw(zt, ctx, [a, b])
    return _matmul_core(zt, ctx, a, b, boxes[0], boxes[1], aw, bw,
                        (ctx.sample_axis(0), ctx.sample_axis(1)))


def _transposed(x: Any) -> Any:
    if x is None:
        return None
    if isinstance(x, Concrete):
        return Concrete(x.value.transpose(0, 1), x.rounds)
    if isinstance(x, Box):
        return x.map(lambda t: t.transpose(0, 1))
    return ZState(*(f.like(f.c.transpose(0, 1), f.G.transpose(1, 2), f.r.transpose(0, 1))
                    for f in x.forms()))


@zrule("Gemm")
def _gemm(zt, ctx, states, boxes, results):
    """alpha * A' B' + beta * C, each step rounded as in the interval rule."""
    a, b = states[0], states[1]
    c = states[2] if len(states) > 2 else None
    if any(isinstance(s, ZState) and s.t.c.dim() != 2 for s in (a, b)):
        return None
    (a, b), (aw, bw) = _weights_raw(zt, ctx, [a, b])
    ta, tb = int(ctx.attr("transA", 0)), int(ctx.attr("transB", 0))
    alpha, beta = float(ctx.attr("alpha", 1.0)), float(ctx.attr("beta", 1.0))
    box_a, box_b = boxes[0], boxes[1]
    if ta:
        a, box_a = _transposed(a), _transposed(box_a)
    if tb:
        b, box_b = _transposed(b), _transposed(box_b)
    axes = tuple(1 - x if flag and isinstance(x, int) and not isinstance(x, bool) else x
                 for x, flag in ((ctx.sample_axis(0), ta), (ctx.sample_axis(1), tb)))
    y = _matmul_core(zt, ctx, a, b, box_a, box_b, aw, bw, axes)
    if y is None:
        return None
    out = []
    for k, spec in enumerate(ctx.kernels):
        f = y.forms()[k]
        if alpha != 1.0:
            f = _round(ctx, spec, "mul", f_scale(f, torch.tensor(alpha, dtype=F64)))
        if c is not None and beta != 0.0:
            fc = _as_z(c, ctx).forms()[k]
            if beta != 1.0:
                fc = _round(ctx, spec, "mul", f_scale(fc, torch.tensor(beta, dtype=F64)))
            f = _round(ctx, spec, "add", f_add(f, fc))
        out.append(f)
    return ZState(*out)


_register("MatMul", _matmul_rule)


# --- normalisation ------------------------------------------------------------------------------
def _rsqrt_drange(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """d/dv v^-1/2 = -v^-3/2 / 2, increasing on v > 0."""
    return -0.5 * lo ** -1.5, -0.5 * hi ** -1.5


@zrule("LayerNormalization")
def _layernorm(zt, ctx, states, boxes, results):
    from kcverify.bounds.rules.normalization import _norm_parts, _realized_err, ln_error_parts

    x, scale, bias = (list(states) + [None, None])[:3]
    if not isinstance(x, ZState):
        return None
    res = results[0]
    if isinstance(res, Box) and not all(bool(torch.isfinite(p).all()) for p in res.parts()[:4]):
        return None  # the interval rule saw a possible overflow (normalization.ln_overflow)
    shape = x.t.shape
    axis = int(ctx.attr("axis", -1)) % len(shape)
    eps = float(ctx.attr("epsilon", 1e-5))
    lead = shape[:axis]
    x = zt.symbolize(x)
    box = boxes[0]
    out = []
    for k, spec in enumerate(ctx.kernels):
        f = x.forms()[k]
        f = f.reshape((*lead, math.prod(shape[axis:])))
        lo, hi = in_bounds(x, box, k)
        lo, hi = lo.reshape(*lead, -1), hi.reshape(*lead, -1)
        n = f.c.shape[-1]
        mu = f_scale(f_sum(f, -1), torch.tensor(1.0 / n, dtype=F64))
        xc = f_add(f, mu, -1.0)
        v = f_scale(f_sum(f_mul(xc, xc), -1), torch.tensor(1.0 / n, dtype=F64))
        c_p, r_p, v_p, _ = _norm_parts(lo, hi, eps)
        v_lo, v_hi = v.bounds()
        v_lo = torch.maximum(v_lo, v_p[0]).clamp_min(0.0) + eps
        v_hi = torch.minimum(v_hi, v_p[1]) + eps
        if not bool((v_lo > 0).all()) or not bool((v_lo <= v_hi).all()):
            return None
        ve = f_shift(v, torch.tensor(eps, dtype=F64))
        rs = f_smooth(ve, pad_lo(v_lo), pad_hi(v_hi), lambda t: 1.0 / torch.sqrt(t),
                      lambda t: -0.5 * t ** -1.5, _rsqrt_drange, _d2_rsqrt)
        if rs is None:
            return None
        y = f_mul(xc, rs)
        g_mag = torch.ones_like(lo)
        gain = torch.ones_like(lo[..., :1].reshape(-1)[:1]).expand(n)  # a constant gain vector
        y_nb = y
        for pos, s in ((1, scale), (2, bias)):
            if s is None:
                continue
            sz = _as_z(s, ctx)
            sf = sz.forms()[k].dense()
            nf = math.prod(shape[axis:])
            sf = sf.like(sf.c.expand(shape[axis:]).reshape(nf),
                      sf.G.expand(sf.k, *shape[axis:]).reshape(sf.k, nf),
                      sf.r.expand(shape[axis:]).reshape(nf))
            if pos == 1:
                g_mag = (sf.c.abs() + sf.rad()).expand_as(lo)
                const = sf.k == 0 and not bool((sf.r > 0).any())
                gain = sf.c if const else None
                y = f_scale(y, sf.c) if const else f_mul(y, sf)
                y_nb = y
            else:
                y = f_add(y, sf)
        y_lo, y_hi = y.bounds()
        rows = math.prod(lead) if lead else 1
        parts = ln_error_parts(spec, lo, hi, (v_lo - eps).clamp_min(0.0), eps)
        if gain is not None and bool(parts[2].all()) and 2 * rows * f.c.numel() <= ELEMENT_BUDGET // 4:
            y = _ln_row_errors(zt, spec, y, y_nb, parts, gain, c_p, v_lo)
        else:
            err = _realized_err(spec, lo, hi, c_p, r_p, v_p, eps, g_mag, mag(y_lo, y_hi))
            y = _add_err(y, err)
        out.append(y.reshape(shape))
    return ZState(*out) if len(results) == 1 else (ZState(*out),) + (None,) * (len(results) - 1)


def _ln_row_errors(zt: ZonoTrack, spec: KernelSpec, y: Form, y_nb: Form, parts: tuple,
                   gain: torch.Tensor, c_p: tuple, v_lo: torch.Tensor) -> Form:
    """A LayerNorm's kernel error with the row structure kept (rules/normalization.py):
    y~_j - y_j = rho g_j x_hat_j - e_mu r (1 + rho) g_j + per-element roundings, where the
    mean's error e_mu and the rstd's relative error rho are one value per row. Each becomes one
    symbol per row (coefficients rho_r * centre(g x_hat), and E r_hi (1 + rho_r) g), so a row's
    common shift reaches the next layer through g^T W with its signs, not |g|^T |W|."""
    e_mu, rho_r, _, alpha = parts
    u, eta = spec.compute.u, spec.compute.eta
    r_hi = pad_hi(1.0 / torch.sqrt(pad_lo(v_lo)))  # v_lo includes eps
    c_mag = mag(*c_p)
    g_abs = gain.abs()
    coef_mu = (e_mu * (1 + rho_r) * r_hi) * gain
    coef_r = rho_r * y_nb.c
    noise = (rho_r * y_nb.rad() + g_abs * r_hi * (c_mag + e_mu) * (1 + rho_r) * alpha) * (1 + 1e-6)
    y_lo, y_hi = y.bounds()
    total = mag(y_lo, y_hi) + coef_mu.abs() + coef_r.abs() + noise
    noise = pad_hi(noise + 1.01 * spec.ulp("add") * u * total + 4 * eta, 1e-6)
    return zt.row_symbols(_add_err(y, noise), [coef_mu, coef_r])


SOFTMAX_PIVOT = True  # softmax: shift each row by its pivot element's form (below)


def _softmax_pivot(fz: Form, masked: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor
                   ) -> tuple[Form, torch.Tensor, torch.Tensor]:
    """z = x - x_p per row, p the row's largest centre (not masked): softmax(x) = softmax(x - y)
    for any y per row, here a form, so what the row's entries share (a common shift) cancels
    before exp, and z_p = 0 exactly (e_p = 1: no remainder; the others' are scaled by their
    small exp). (z, lo, hi): the form, its range met with [lo_j - hi_p, hi_j - lo_p]; masked
    entries 0 (the caller selects them out)."""
    cm = torch.where(masked, torch.full_like(fz.c, -float("inf")), fz.c)
    p = cm.argmax(-1, keepdim=True)
    xp = fz.like(fz.c.gather(-1, p), fz.G.gather(-1, p.unsqueeze(0).expand(fz.k, *p.shape)),
                 fz.r.gather(-1, p))
    z = f_add(fz, xp, -1.0)
    piv = torch.zeros_like(masked).scatter(-1, p, True)
    z = f_select(~piv, z, const_form(torch.zeros_like(fz.c)))  # x_p - x_p = 0 exactly
    zl, zh = z.bounds()
    lo_p, hi_p = lo.gather(-1, p), hi.gather(-1, p)
    zl = torch.maximum(zl, pad_lo(lo - hi_p))
    zh = torch.minimum(zh, pad_hi(hi - lo_p))
    zero = torch.zeros_like(zl)
    zl = torch.where(masked | piv, zero, zl)
    zh = torch.where(masked | piv, zero, zh)
    return z, zl, zh


def _softmax_exp_div(zf: Form, z_lo: torch.Tensor, z_hi: torch.Tensor, masked: torch.Tensor
                     ) -> Form | None:
    """exp(z) / sum exp(z) over the last axis (masked entries exactly 0) for a row-shifted z;
    None when a form is not finite or a row sum's form reaches 0."""
    zero = const_form(torch.zeros_like(zf.c))
    z_lo, z_hi = pad_lo(z_lo), pad_hi(z_hi)
    e = f_smooth(zf, z_lo, z_hi, torch.exp, torch.exp, lambda a, b: (torch.exp(a), torch.exp(b)),
                 _d2_exp)
    if e is None:
        return None
    e = f_select(~masked, e, zero)
    s = f_sum(e, -1)
    s_lo, s_hi = s.bounds()
    if not bool((s_lo > 0).all()):
        return None
    inv = f_smooth(s, s_lo, s_hi, lambda t: 1.0 / t, lambda t: -1.0 / (t * t), _inv_drange,
                   _d2_inv)
    if inv is None:
        return None
    return f_mul(e, inv)


@zrule("Softmax")
def _softmax(zt, ctx, states, boxes, results):
    from kcverify.bounds.rules.softmax import nan_rows, realized_error, softmax_range

    x = states[0]
    shape = x.t.shape
    if ctx.opset < 13:
        return None
    axis = int(ctx.attr("axis", -1)) % len(shape)
    if axis != len(shape) - 1:
        return None
    x = zt.symbolize(x)
    box = boxes[0]
    out = []
    for k, spec in enumerate(ctx.kernels):
        f = x.forms()[k]
        lo, hi = in_bounds(x, box, k)
        # masked entries: -inf in every program (exp gives exactly 0); a finite mask such as
        # finfo.min goes through exp like any value (its eta error then counts)
        masked = ~torch.isfinite(f.c)
        if bool((masked & ~(hi == -float("inf"))).any()):
            return None
        if box is not None and bool(nan_rows(spec, *_box_part(box, k)).any()):
            return None  # a row that may be NaN (softmax.nan_rows): the box's no-bound stands
        zero = const_form(torch.zeros_like(f.c))
        fz = f_select(~masked, f, zero)
        m = torch.where(masked, torch.full_like(f.c, -float("inf")), f.c).amax(-1, keepdim=True)
        p = None
        if SOFTMAX_PIVOT and bool(torch.isfinite(m).all()):
            p = _softmax_exp_div(*_softmax_pivot(fz, masked, lo, hi), masked)
        if p is None:  # no pivot, or a row sum's form reaches 0 with it: the centres' row max
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            zf = f_shift(fz, -m)
            z_lo, z_hi = torch.where(masked, zero.c, lo - m), torch.where(masked, zero.c, hi - m)
            p = _softmax_exp_div(zf, z_lo, z_hi, masked)
        if p is None:
            return None
        p_lo, p_hi, d_min = softmax_range(torch.where(masked, torch.full_like(lo, -float("inf")), lo),
                                          torch.where(masked, torch.full_like(hi, -float("inf")), hi))
        err = realized_error(spec, lo, hi, p_hi, d_min)
        err = torch.where(masked, torch.zeros_like(err), err)
        out.append(_add_err(p, err))
    return ZState(*out)


# the rules that read forms only through the local-aware primitives (f_add, f_scale, f_mul,
# f_matmul_const, f_sum, f_smooth, _moved, _add_err, _round, the tracker's symbols); every
# other rule (Concat, Where, Softmax, Gemm, Conv, the QDQ rules, any added later) gets the
# dense forms (ZonoTrack.step): correct by construction
def _local_rules() -> frozenset[str]:
    from kcverify.bounds.rules.shape import MOVEMENT

    return frozenset({op for op in MOVEMENT if op != "Trilu"} | {
        "Cast", "Gather", "Add", "Sub", "Mul", "Div", "Neg", "Exp", "Tanh", "Erf", "Sigmoid",
        "Sqrt", "Reciprocal", "Gelu", "Relu", "MatMul", "LayerNormalization"})


LOCAL_RULES = _local_rules()
