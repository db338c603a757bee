"""Objectives for the split driver: a drift clause, or a VNN-LIB property on one kernel's outputs.

* ``DriftObjective(cb, eps)``: max_j |z_inf,j - z_train,j| <= eps on a part (the NeuroDiff
  clause). Per part, the chain domain's drift box met with the back-substituted drift bound of
  every output (``backward_drift``; with ``cb.alpha_iters`` the training value's lower slopes
  optimised per output row, as for the intermediate bounds); the value is that L-inf bound.
* ``PropertyObjective(cb, case)``: one VNN-LIB case (an input box with its unsafe DNF over Y) on
  the outputs of one kernel. A disjunct (a conjunction of atoms ``c . Y <= d`` or ``< d``) is
  impossible on a part when some atom is: min over the part of c . Y > d (>= d for a strict atom).
  The minimum is bounded below by the larger of interval arithmetic on the output box and the
  back-substituted bound of c . Y itself (``backward_value``; the outputs' shared dependence on x
  cancels in c . Y). A part is proved when every disjunct is impossible; its value is
  max over disjuncts of min over atoms of (d - lower(c . Y)), a certified upper bound on how far
  the part is from proving (proved when < 0, or <= 0 with only strict atoms deciding).
* ``EngineObjective``: the same two checks with the bound engine's own domains
  (kcverify.bounds.certify_drift on each part's box) for models that are not affine-ReLU chains.

Split dimension: the input with the largest |coefficient| x width in the back-substituted bound
that decides the part (the worst output, or the best atom of the hardest disjunct): the
gradient-times-width heuristic (measured on ACAS Xu: 431 parts against 2,565 when every third
level splits the widest input instead, and against 8,041 for the forward forms' coefficients).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np
import torch

from kcverify.dsl.vnnlib import Atom, Case
from kcverify.regions.chain import (
    F64,
    ChainBounds,
    backward_drift,
    backward_value,
    optimise_slopes,
)
from kcverify.regions.split import PartEval, widest

QUAD_AT = 3.0  # split.branch_and_bound's quad for the drift objective, in units of eps
DEEPER = 10.0  # and its deeper: parts above 30 eps are cut in eighths
Falsifier = Callable[[np.ndarray, np.ndarray], Any]  # (lo, hi) of open parts -> witness or None


def _choose(coef: np.ndarray | None, lo: np.ndarray, hi: np.ndarray, width0: np.ndarray
            ) -> np.ndarray:
    """Split dimensions: the largest |coefficient| x width of the deciding bound's linear
    function of x; the widest input (relative to the box) where that function is flat."""
    wide = widest(lo, hi, width0)
    if coef is None:
        return wide
    score = np.abs(coef) * (hi - lo)
    return np.where(score.max(axis=1) > 0, np.argmax(score, axis=1), wide)


@dataclass
class DriftObjective:
    """max |drift| <= eps (``strict``: < eps) on each part, with the chain domain."""

    cb: ChainBounds
    eps: float
    width0: np.ndarray
    strict: bool = False
    falsify: Falsifier | None = None
    # proved parts keep this relative slack for re-checking: a re-run on other batch
    # compositions may round the float32 slope descent (chain.SLOPE_DTYPE) differently
    margin: float = 2.0 ** -10

    def bounds(self, lo: np.ndarray, hi: np.ndarray, coefficients: list | None = None,
               prior: Any = None, inter: list | None = None) -> torch.Tensor:
        """Per part, per output: the certified |drift| bound (batch, 2 n_out: upper bounds of
        the drift, then of minus the drift), float64; ``prior``/``inter``: inherited and
        resulting intermediate boxes (ChainBounds.bound)."""
        r = self.cb.bound(lo, hi, prior=prior)
        if inter is not None:
            inter.append(r.intermediates(self.cb.chain.steps))
        n = self.cb.chain.n_out
        eye = torch.eye(n, dtype=F64, device=self.cb.dev).expand(len(lo), n, n)
        C = torch.cat([eye, -eye], 1)
        # alpha-CROWN for the objective too: the training value's lower slopes of the drift's
        # back-substitution, optimised per output row (2 n_out rows per part: next to free)
        cb = self.cb
        slopes = optimise_slopes(cb, r, None, C, len(cb.chain.steps), cb.alpha_iters) \
            if cb.alpha_iters and cb.crown else None
        res = backward_drift(cb, r, C, coefficients=coefficients, slopes=slopes)
        up = torch.minimum(res[:, :n], r.dhi)
        low = torch.maximum(-res[:, n:], r.dlo)
        mag = torch.cat([up, -low], 1)
        bad = r.overflow | ~torch.isfinite(mag).all(-1)
        return torch.where(bad[:, None], torch.full_like(mag, math.inf), mag)

    @property
    def quad_above(self) -> float:
        """Parts whose value is above this are quartered by the split (``branch_and_bound``'s
        ``quad``): QUAD_AT x eps. A stalled part needs more than one cut there, and bounding
        its quarters at once saves the halves' full bounds (docs/regions.md)."""
        return QUAD_AT * self.eps

    @property
    def deeper(self) -> float:
        """Parts above quad_above x this are cut in eighths (``branch_and_bound``'s ``deeper``)."""
        return DEEPER

    def chooser(self) -> DriftObjective:
        """This objective on the forward-only domain, without a falsifier: what the split
        bounds every candidate cut with (branch_and_bound's ``chooser``)."""
        return DriftObjective(self.cb.forward_only(), self.eps, self.width0, self.strict,
                              None, self.margin)

    def evaluate(self, lo: np.ndarray, hi: np.ndarray, prior: Any = None) -> PartEval:
        co: list = []
        inter: list = []
        mag = self.bounds(lo, hi, co, prior, inter)
        v = mag.amax(-1)
        value = (v * (1 + self.margin)).cpu().numpy()
        proved = value < self.eps if self.strict else value <= self.eps
        j = mag.argmax(-1)
        coef = co[0][torch.arange(len(j)), j].cpu().numpy()
        dims = _choose(coef, lo, hi, self.width0)
        cex = None
        if self.falsify is not None and not proved.all():
            cex = self.falsify(lo[~proved], hi[~proved])
        return PartEval(proved, value, dims, cex, inter[0].cpu().numpy())


class AtomTable:
    """The atoms of one case's unsafe DNF as matrices: C (q, n_out) float64 coefficients, their
    representation error |c - float(c)|, exact right-hand sides, and which disjunct each is in."""

    def __init__(self, case: Case, n_out: int) -> None:
        atoms: list[Atom] = [a for conj in case.unsafe for a in conj]
        self.atoms = atoms
        self.group = np.array([k for k, conj in enumerate(case.unsafe) for _ in conj], dtype=int)
        self.n_disjuncts = len(case.unsafe)
        self.always = [k for k, conj in enumerate(case.unsafe) if not conj]
        C = np.zeros((len(atoms), n_out))
        E = np.zeros((len(atoms), n_out))
        for i, a in enumerate(atoms):
            for j, c in a.coeffs:
                C[i, j] = float(c)
                E[i, j] = abs(float(c - Fraction(C[i, j]))) * (1 + 2.0 ** -50)
        self.C, self.E = C, E
        self.rhs = [a.rhs for a in atoms]
        self.strict = np.array([a.op == "<" for a in atoms])

    def margins(self, low: np.ndarray) -> np.ndarray:
        """d - lower (per part, per atom), exact in sign: > 0 means the atom may hold."""
        out = np.empty_like(low)
        for i, d in enumerate(self.rhs):
            col = low[:, i]
            fd = float(d)
            out[:, i] = fd - col
            # exact decision where the float difference is ambiguous
            near = np.abs(out[:, i]) <= 4 * np.finfo(float).eps * (abs(fd) + np.abs(col))
            for b in np.flatnonzero(near):
                if math.isfinite(col[b]):
                    q = d - Fraction(float(col[b]))
                    out[b, i] = 0.0 if q == 0 else (math.copysign(max(abs(float(q)), 1e-300),
                                                                  float(q)))
        return out

    def decide(self, low: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(proved per part, value per part, per part and disjunct: the smallest margin and the
        atom that has it)."""
        m = self.margins(low)  # <= 0 with a non-strict atom impossible; < 0 strict-or-not
        impossible = np.where(self.strict[None, :], m <= 0, m < 0)
        B = low.shape[0]
        per = np.full((B, self.n_disjuncts), np.inf)
        arg = np.zeros((B, self.n_disjuncts), dtype=int)
        dis_ok = np.ones((B, self.n_disjuncts), dtype=bool)
        for k in range(self.n_disjuncts):
            cols = np.flatnonzero(self.group == k)
            if len(cols) == 0:
                dis_ok[:, k] = False
                continue
            sub = m[:, cols]
            best = np.argmin(sub, axis=1)
            per[:, k] = sub[np.arange(B), best]
            arg[:, k] = cols[best]
            dis_ok[:, k] = impossible[:, cols].any(axis=1)
        proved = dis_ok.all(axis=1)
        value = per.max(axis=1) if self.n_disjuncts else np.full(B, -np.inf)
        return proved, value, per, arg


@dataclass
class PropertyObjective:
    """One VNN-LIB case on the outputs of kernel ``kernel`` of ``cb`` (index 0 for a
    single-kernel ChainBounds)."""

    cb: ChainBounds
    case: Case
    width0: np.ndarray
    kernel: int = 0
    falsify: Falsifier | None = None

    def __post_init__(self) -> None:
        self.table = AtomTable(self.case, self.cb.chain.n_out)

    def lower_bounds(self, lo: np.ndarray, hi: np.ndarray, coefficients: list | None = None,
                     prior: Any = None, inter: list | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
        """Per part, per atom: a lower bound of c . Y; and the overflow mask."""
        r = self.cb.bound(lo, hi, drift=False, prior=prior)
        if inter is not None:
            inter.append(r.intermediates(self.cb.chain.steps))
        B = len(lo)
        C = torch.as_tensor(self.table.C, dtype=F64, device=self.cb.dev).expand(B, -1, -1)
        back = -backward_value(self.cb, r, self.kernel, -C, coefficients=coefficients)
        ylo, yhi = r.lo[self.kernel], r.hi[self.kernel]
        Cp, Cn = C.clamp(min=0), C.clamp(max=0)
        inter = (Cp * ylo[:, None, :] + Cn * yhi[:, None, :]).sum(-1)
        n = C.shape[-1]
        inter = inter - (n + 4) * 2.0 ** -53 * (C.abs() * torch.maximum(
            ylo.abs(), yhi.abs())[:, None, :]).sum(-1)
        low = torch.maximum(back, torch.nextafter(inter, torch.full_like(inter, -math.inf)))
        E = torch.as_tensor(self.table.E, dtype=F64, device=self.cb.dev)
        if bool((E > 0).any()):
            ymag = torch.maximum(ylo.abs(), yhi.abs())
            low = low - (E[None] * ymag[:, None, :]).sum(-1) * (1 + 2.0 ** -40)
        bad = r.overflow | ~torch.isfinite(low).all(-1)
        low = torch.where(bad[:, None], torch.full_like(low, -math.inf), low)
        return low.cpu().numpy(), bad.cpu().numpy()

    def chooser(self) -> PropertyObjective:
        """This objective on the forward-only domain, without a falsifier (see
        DriftObjective.chooser)."""
        return PropertyObjective(self.cb.forward_only(), self.case, self.width0, self.kernel)

    def evaluate(self, lo: np.ndarray, hi: np.ndarray, prior: Any = None) -> PartEval:
        co: list = []
        inter: list = []
        low, _ = self.lower_bounds(lo, hi, co, prior, inter)
        proved, value, per, arg = self.table.decide(low)
        hard = np.argmax(per, axis=1)  # the disjunct furthest from impossible
        atom = arg[np.arange(len(lo)), hard]
        coef = co[0][torch.arange(len(lo)), torch.as_tensor(atom)].cpu().numpy()
        dims = _choose(coef, lo, hi, self.width0)
        cex = None
        if self.falsify is not None and not proved.all():
            cex = self.falsify(lo[~proved], hi[~proved])
        return PartEval(proved, value, dims, cex, inter[0].cpu().numpy())


@dataclass
class EngineObjective:
    """The drift clause (``case`` None) or a VNN-LIB case on kernel ``kernel``'s outputs, with the
    bound engine's domain ``domain`` on each part's box (models that are not affine-ReLU chains).
    ``graph``: the model; ``input``/``shape``: its single float input and shape without batch."""

    graph: Any
    train: Any
    inf: Any
    input: str
    shape: tuple[int, ...]
    width0: np.ndarray
    eps: float = 0.0
    case: Case | None = None
    kernel: int = 0
    domain: str = "interval"
    strict: bool = False
    falsify: Falsifier | None = None
    device: str = "cpu"
    margin: float = 2.0 ** -20

    def boxes(self, lo: np.ndarray, hi: np.ndarray) -> Any:
        from kcverify.bounds import certify_drift

        sh = (len(lo), *self.shape)
        mid = (0.5 * lo + 0.5 * hi).reshape(sh).astype(np.float32)
        res = certify_drift(self.graph, self.train, self.inf, {self.input: mid},
                            domain=self.domain, device=self.device,
                            input_bounds={self.input: (lo.reshape(sh), hi.reshape(sh))})
        return res.outputs[self.graph.outputs[0].name]

    def evaluate(self, lo: np.ndarray, hi: np.ndarray, prior: Any = None) -> PartEval:
        box = self.boxes(lo, hi)
        B = len(lo)
        if self.case is None:
            mag = np.maximum(np.abs(box.drift_lo), np.abs(box.drift_hi)).reshape(B, -1)
            value = mag.max(axis=1) * (1 + self.margin)
            value = np.where(np.isfinite(value), value, np.inf)
            proved = value < self.eps if self.strict else value <= self.eps
        else:
            table = AtomTable(self.case, int(np.prod(box.train_lo.shape[1:])))
            ylo = (box.train_lo if self.kernel == 0 else box.inf_lo).reshape(B, -1)
            yhi = (box.train_hi if self.kernel == 0 else box.inf_hi).reshape(B, -1)
            Cp, Cn = np.clip(table.C, 0, None), np.clip(table.C, None, 0)
            low = ylo @ Cp.T + yhi @ Cn.T
            ymag = np.maximum(np.abs(ylo), np.abs(yhi))
            slack = (table.C.shape[1] + 4) * 2.0 ** -53 * np.abs(table.C) + table.E * 1.01
            low = low - ymag @ slack.T
            low = np.nextafter(low, -np.inf)
            low = np.where(np.isfinite(low), low, -np.inf)
            proved, value, _, _ = table.decide(low)
        dims = widest(lo, hi, self.width0)
        cex = None
        if self.falsify is not None and not np.all(proved):
            cex = self.falsify(lo[~proved], hi[~proved])
        return PartEval(proved, value, dims, cex)
