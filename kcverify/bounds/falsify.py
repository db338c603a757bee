"""The falsifier: the largest drift it can *realize*, a lower bound on the true supremum that a
certified bound must dominate (and the measure of a bound's tightness).

It searches over the rounding choices the error model allows, running concrete conforming
programs of both kernels (kcverify.kernels.realize: accumulation orders, split-K chunkings,
directed roundings all-up / all-down against each other, random roundings), and, for regions,
over inputs in the set: corners and random points, then a projected SPSA ascent (a two-point
stochastic gradient estimate, Spall 1992) on the realized drift. Every reported value was
computed by actual conforming programs, so it is a witness, not an estimate.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kcverify.bounds.engine import Region, _as_feeds
from kcverify.kernels.realize import Realization, random_realization
from kcverify.kernels.spec import KernelSpec
from kcverify.models.ir import Graph


@dataclass
class FalsifyResult:
    best: np.ndarray  # (batch,) largest realized max |z_inf - z_train| per input
    witness: list[tuple[str, str]]  # per input: (train program, inf program) that realized it
    evaluations: int


class _Safe(Realization):
    """An infinite exact value (a masked logit) stays itself under directed rounding."""

    def round(self, node: Any, primitive: str, value: torch.Tensor) -> torch.Tensor:
        out = super().round(node, primitive, value)
        return torch.where(torch.isinf(value), value, out)


def program_pairs(train: KernelSpec, inf: KernelSpec, n: int, seed: int = 0
                  ) -> list[tuple[Realization, Realization]]:
    """Adversarial pairs first (train rounds down while inf rounds up, and vice versa; fast
    orders), then per-element sorted orders with directed roundings, then random conforming
    pairs (``n`` in all; n >= 5 includes the sorted pairs)."""
    pairs = [
        (_Safe(train, seed, "pairwise", None, "down"), _Safe(inf, seed, "pairwise", None, "up")),
        (_Safe(train, seed, "pairwise", None, "up"), _Safe(inf, seed, "pairwise", None, "down")),
        (_Safe(train, seed, "chunked", 16, "nearest"), _Safe(inf, seed, "chunked", 16, "nearest")),
        # adversarial per-element orders (kernels/realize.py's sorted) with directed roundings
        (_Safe(train, seed, "sorted", None, "down"), _Safe(inf, seed, "sorted", None, "up")),
        (_Safe(train, seed, "sorted", None, "up"), _Safe(inf, seed, "sorted", None, "down")),
    ]
    rng = random.Random(seed)
    while len(pairs) < n:
        a, b = random_realization(train, rng), random_realization(inf, rng)
        pairs.append((_Safe(train, a.seed, a.order, a.chunk, a.rounding),
                      _Safe(inf, b.seed, b.order, b.chunk, b.rounding)))
    return pairs[:n]


def _drift(graph: Graph, pair: tuple[Realization, Realization], feeds: dict[str, np.ndarray],
           device: str) -> np.ndarray:
    from kcverify.models.executor import Executor

    outs = []
    for real in pair:
        ex = Executor(graph, device=device, dtype=torch.float64, arithmetic=real.bind(graph))
        outs.append(ex.run(feeds))
    best = None
    for v in graph.outputs:
        t, i = outs[0][v.name], outs[1][v.name]
        if not t.is_floating_point():
            continue
        d = torch.where(torch.isinf(t) & (t == i), torch.zeros_like(t), (i - t).abs())
        d = torch.where(torch.isnan(d), torch.full_like(d, float("inf")), d)
        m = d.reshape(d.shape[0], -1).amax(1).double().cpu().numpy()
        best = m if best is None else np.maximum(best, m)
    assert best is not None
    return best


def falsify(graph: Graph, train: KernelSpec, inf: KernelSpec, feeds: Any,
            region: Region | None = None, programs: int = 6, steps: int = 0, seed: int = 0,
            device: str = "cpu") -> FalsifyResult:
    """Largest realized drift per input, over ``programs`` pairs of conforming programs and, for
    an input-space region, ``steps`` SPSA ascent steps from the best corner/random start."""
    fd = _as_feeds(graph, feeds)
    pairs = program_pairs(train, inf, programs, seed)
    batch = next(iter(fd.values())).shape[0]
    best = np.zeros(batch)
    witness = [("", "")] * batch
    evals = 0

    def consider(pt: dict[str, np.ndarray], pair: tuple[Realization, Realization]) -> np.ndarray:
        nonlocal evals
        d = _drift(graph, pair, pt, device)
        evals += 1
        for k in range(batch):
            if d[k] > best[k]:
                best[k] = d[k]
                witness[k] = (repr(pair[0]), repr(pair[1]))
        return d

    float_in = [k for k, v in fd.items() if v.dtype.kind == "f"]
    if region is None or region.eps == 0 or region.space != "input" or not float_in:
        for pair in pairs:
            consider(fd, pair)
        return FalsifyResult(best, witness, evals)
    rng = np.random.default_rng(seed)
    eps = region.eps

    def project(pt: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = dict(pt)
        for k in float_in:
            delta = pt[k].astype(np.float64) - fd[k].astype(np.float64)
            if region.norm == "l2":
                n = np.sqrt((delta.reshape(batch, -1) ** 2).sum(1)).reshape(-1, *[1] * (delta.ndim - 1))
                delta = delta * np.minimum(1.0, eps / np.maximum(n, 1e-300)) * (1 - 1e-12)
            else:
                delta = np.clip(delta, -eps * (1 - 1e-12), eps * (1 - 1e-12))
            out[k] = fd[k].astype(np.float64) + delta
        return out

    starts = [project({k: (fd[k].astype(np.float64) + (eps * np.sign(rng.normal(size=fd[k].shape))
                       if k in float_in else 0)) if k in float_in else fd[k] for k in fd})
              for _ in range(2)]
    starts.append(project(dict(fd)))
    cur, cur_d = starts[0], None
    for s in starts:
        d = consider(s, pairs[0])
        if cur_d is None or d.sum() > cur_d.sum():
            cur, cur_d = s, d
    for pair in pairs[1:]:
        consider(cur, pair)
    lr = eps / 2
    for _ in range(steps):
        signs = {k: rng.choice([-1.0, 1.0], size=fd[k].shape) for k in float_in}
        c = eps / 8
        plus = project({k: cur[k] + c * signs[k] if k in float_in else cur[k] for k in cur})
        minus = project({k: cur[k] - c * signs[k] if k in float_in else cur[k] for k in cur})
        dp, dm = consider(plus, pairs[0]), consider(minus, pairs[0])
        g = (dp - dm).reshape(-1, *[1] * (fd[float_in[0]].ndim - 1))
        cur = project({k: cur[k] + lr * np.sign(g) * signs[k] if k in float_in else cur[k]
                       for k in cur})
        consider(cur, pairs[0])
    return FalsifyResult(best, witness, evals)
