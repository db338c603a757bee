"""Counterexamples for region clauses: search cheaply, then confirm under conforming programs.

Search (not trusted): projected gradient descent on a float64 copy of the network (the weights
as the kernel casts them), from the centre, the corners and random points of the box; for open
parts of a split, their centres. Confirmation (what a reported counterexample rests on): the
candidate is rounded to a float32 input inside the exact box, then run as concrete conforming
programs of the kernel spec (kcverify.kernels.realize.run_kernel: round-to-nearest, directed
roundings, several summation orders) and by onnxruntime; a witness is reported only when some
conforming program violates the property (exactly, in rationals), and it names that program.
onnxruntime's own output is recorded next to it (for an fp32 kernel it is one more program).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kcverify.dsl.vnnlib import Case
from kcverify.regions.chain import AffineChain

# (order, rounding, chunk) of the conforming programs a candidate is confirmed with
PROGRAMS = (("sequential", "nearest", 16), ("pairwise", "nearest", 16), ("reverse", "nearest", 16),
            ("chunked", "nearest", 8), ("sequential", "up", 16), ("sequential", "down", 16),
            ("random", "random", 4))


@dataclass
class Witness:
    """A confirmed counterexample: the input x (float32 values, flattened), the outputs y of the
    conforming program that violates (``program``), and what onnxruntime computed."""

    x: np.ndarray
    y: np.ndarray
    program: str
    ort_y: np.ndarray | None = None
    ort_violates: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def vnncomp(self) -> str:
        """The VNN-COMP witness: ((X_0 v) ... (Y_0 v)) with exact decimal floats."""
        rows = [f"(X_{i} {float(v)!r})" for i, v in enumerate(self.x)]
        rows += [f"(Y_{i} {float(v)!r})" for i, v in enumerate(self.y)]
        return "(" + "\n ".join(rows) + ")"


def inside_f32(x: np.ndarray, case: Case) -> np.ndarray | None:
    """x as float32 inside the exact box of ``case``: each coordinate clipped, rounded to
    float32 and, where rounding left the box (or hit a strict bound), stepped towards the middle
    (None when no float32 value fits)."""
    lo, hi = np.asarray(case.lo), np.asarray(case.hi)
    out = np.empty(len(lo), dtype=np.float32)
    for i in range(len(lo)):
        mid = np.float32(0.5 * (lo[i] + hi[i]))
        v = np.float32(min(max(float(x[i]), lo[i]), hi[i]))
        for _ in range(64):
            if _ok_dim(case, i, float(v)):
                break
            if v == mid:
                return None
            v = np.nextafter(v, mid)
        else:
            return None
        out[i] = v
    return out if case.contains(out.astype(np.float64).tolist()) else None


def _ok_dim(case: Case, i: int, value: float) -> bool:
    return all(a.holds([value if j == i else 0.0 for j in range(len(case.lo))])
               for a in case.x_atoms if a.coeffs and a.coeffs[0][0] == i)


class ChainNet:
    """A float64 torch copy of an affine-ReLU chain with given weights (for the search)."""

    def __init__(self, chain: AffineChain, mats: list | None = None) -> None:
        self.steps = []
        ai = 0
        for j, st in enumerate(chain.steps):
            if st.kind == "affine":
                W = torch.as_tensor(np.array(st.W), dtype=torch.float64)
                b = None if st.b is None else torch.as_tensor(np.array(st.b), dtype=torch.float64)
                if mats is not None:
                    (Wm, _), bias, _ = mats[j]
                    W = Wm.cpu()
                    b = None if bias is None else bias[0].cpu()
                self.steps.append(("affine", W, b))
                ai += 1
            elif st.kind in ("shift", "scale"):
                c = torch.as_tensor(np.array(st.b), dtype=torch.float64)
                self.steps.append((st.kind + ("/" if st.prim == "div" else ""), c, None))
            else:
                self.steps.append(("relu", None, None))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        a = x
        for kind, W, b in self.steps:
            if kind == "affine":
                a = a @ W
                if b is not None:
                    a = a + b
            elif kind == "shift":
                a = a + W
            elif kind == "scale":
                a = a * W
            elif kind == "scale/":
                a = a / W
            else:
                a = torch.relu(a)
        return a


def _violation(y: torch.Tensor, C: torch.Tensor, d: torch.Tensor, group: list[np.ndarray]
               ) -> torch.Tensor:
    """Per point: min over disjuncts of max over its atoms of (c . y - d) (<= 0: unsafe)."""
    s = y @ C.T - d
    per = [s[:, g].amax(-1) if len(g) else torch.full_like(s[:, 0], -1.0) for g in group]
    return torch.stack(per, -1).amin(-1)


def pgd_candidates(net: ChainNet, case: Case, C: np.ndarray, d: np.ndarray,
                   groups: list[np.ndarray], n_starts: int = 128, steps: int = 100,
                   samples: int = 8192, seed: int = 0) -> np.ndarray:
    """Points of the case box ordered by how unsafe the search network finds them: the most
    unsafe of the centre, random corners and ``samples`` uniform points start projected
    gradient descent (``descend``) on the violation."""
    lo, hi = np.asarray(case.lo, dtype=np.float64), np.asarray(case.hi, dtype=np.float64)
    rng = np.random.default_rng(seed)
    n = len(lo)
    pool = np.concatenate([[0.5 * (lo + hi), lo, hi],
                           rng.uniform(lo, hi, size=(samples, n)),
                           np.where(rng.random((min(samples, 1 << n), n)) < 0.5, lo, hi)])
    Ct, dt = torch.as_tensor(C, dtype=torch.float64), torch.as_tensor(d, dtype=torch.float64)
    with torch.no_grad():
        v0 = _violation(net(torch.as_tensor(pool)), Ct, dt, groups)
    x = pool[torch.argsort(v0)[:n_starts].numpy()]
    return descend(net, x, np.broadcast_to(lo, x.shape), np.broadcast_to(hi, x.shape), Ct, dt,
                   groups, steps)


def descend(net: ChainNet, x: np.ndarray, lo: np.ndarray, hi: np.ndarray, C: torch.Tensor,
            d: torch.Tensor, groups: list[np.ndarray], steps: int = 100) -> np.ndarray:
    """Projected signed-gradient descent on the violation, each start x[s] kept in its own box
    [lo[s], hi[s]] (steps of 1/8 of the box, halved every 20); the best points, most unsafe
    first."""
    xt = torch.as_tensor(np.array(x), dtype=torch.float64)
    tl = torch.as_tensor(np.array(lo), dtype=torch.float64)
    th = torch.as_tensor(np.array(hi), dtype=torch.float64)
    step = (th - tl) / 8
    best_x = xt.clone()
    best_v = torch.full((len(xt),), math.inf, dtype=torch.float64)
    for k in range(steps):
        xt.requires_grad_(True)
        v = _violation(net(xt), C, d, groups)
        (g,) = torch.autograd.grad(v.sum(), xt)
        with torch.no_grad():
            better = v < best_v
            best_v = torch.where(better, v, best_v)
            best_x[better] = xt[better]
            xt = torch.minimum(torch.maximum(xt - step * torch.sign(g), tl), th)
            if k % 20 == 19:
                step = step / 2
    order = torch.argsort(best_v)
    return best_x[order].numpy()


def confirm(graph: Any, spec: Any, case: Case, x: np.ndarray, input_name: str,
            input_shape: tuple[int, ...], output: str, ort_session: Any = None,
            programs: tuple = PROGRAMS) -> Witness | None:
    """A witness if some conforming program of ``spec`` maps the float32 input x (inside the
    case's exact box) to an unsafe output of the case; else None."""
    from kcverify.kernels.realize import run_kernel

    x32 = np.asarray(x, dtype=np.float32).reshape(-1)
    xs = x32.astype(np.float64).tolist()
    if not case.contains(xs):
        return None
    feeds = {input_name: x32.reshape(1, *input_shape)}
    ort_y, ort_bad = None, None
    if ort_session is not None:
        ort_y = np.asarray(ort_session.run(None, feeds)[0], dtype=np.float64).reshape(-1)
        ort_bad = case.unsafe_at(ort_y.tolist()) is not None
    for order, rounding, chunk in programs:
        y = run_kernel(graph, spec, feeds, order=order, rounding=rounding, chunk=chunk, seed=0)
        yv = y[output].detach().cpu().numpy().astype(np.float64).reshape(-1)
        if case.unsafe_at(yv.tolist()) is not None:
            return Witness(x32, yv, f"{spec.name} kernel, {order} summation, {rounding} rounding",
                           ort_y, ort_bad)
    return None


def confirm_drift(graph: Any, train: Any, inf: Any, x: np.ndarray, eps: float,
                  input_name: str, input_shape: tuple[int, ...], output: str,
                  strict: bool = False, programs: tuple = PROGRAMS) -> Witness | None:
    """A witness if some pair of conforming programs drifts by more than eps (>= eps when the
    clause is strict) at the float32 input x."""
    from kcverify.kernels.realize import run_kernel

    x32 = np.asarray(x, dtype=np.float32).reshape(-1)
    feeds = {input_name: x32.reshape(1, *input_shape)}
    yt = run_kernel(graph, train, feeds, order="sequential", rounding="nearest", seed=0)
    yt = yt[output].detach().cpu().numpy().astype(np.float64).reshape(-1)
    for order, rounding, chunk in programs:
        yi = run_kernel(graph, inf, feeds, order=order, rounding=rounding, chunk=chunk, seed=0)
        yi = yi[output].detach().cpu().numpy().astype(np.float64).reshape(-1)
        d = float(np.max(np.abs(yi - yt)))
        if d > eps or (strict and d >= eps):
            return Witness(x32, yi - yt, f"train: sequential/nearest; inf: {order}/{rounding}",
                           extra={"drift": d, "train_y": yt.tolist(), "inf_y": yi.tolist()})
    return None
