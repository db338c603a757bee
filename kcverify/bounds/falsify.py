"""The falsifier: the largest drift it can *realize*, a lower bound on the true supremum that a
certified bound must dominate (and the measure of a bound's tightness).

It searches over the rounding choices the error model allows, running concrete conforming
programs of both kernels (kcverify.kernels.realize: accumulation orders, split-K chunkings,
directed roundings all-up / all-down against each other, random roundings; then roundings
directed element by element by the gradient of the largest drift, ``guided_pair``), and, for regions,
over inputs in the set: corners and random points, then a projected SPSA ascent (a two-point
stochastic gradient estimate, Spall 1992) on the realized drift. Every reported value was
computed by actual conforming programs, so it is a witness, not an estimate.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kcverify.bounds.engine import Region, _as_feeds
from kcverify.kernels.cast import round_to_format
from kcverify.kernels.realize import (
    EXPLICIT_CAST_OPS,
    IEEE_OPS,
    Realization,
    random_realization,
)
from kcverify.kernels.scale import cast_values
from kcverify.kernels.spec import KernelSpec
from kcverify.models.arith import conv_nd
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


class _Guided(_Safe):
    """A conforming program whose roundings go up or down *element by element*, as ``directions``
    says: key (node, primitive, occurrence) -> a tensor of -1 / 0 / +1 (down, nearest, up). Each
    choice is one the spec admits anyway (the 'up' / 'down' / 'random' realizations make the same
    choices for a whole tensor or at random); here a gradient picks them (``guided_pair``). Casts
    choose their neighbour the same way only under ``rounding: any``."""

    def __init__(self, spec: KernelSpec, directions: dict[tuple[str, str, int], torch.Tensor],
                 order: str = "pairwise", label: str = "") -> None:
        super().__init__(spec, 0, order, None, "random")
        self.directions = directions
        self.label = label
        self._seen: dict[tuple[str, str], int] = {}

    def __repr__(self) -> str:
        return f"Guided({self.spec.name!r}, order={self.order!r}, {self.label})"

    def reset(self) -> None:
        """Start a run: occurrences count from 0 again."""
        self._seen.clear()
        self._ln_var.clear()

    def _key(self, node: Any, primitive: str) -> tuple[str, str, int]:
        i = self._seen.get((node.name, primitive), 0)
        self._seen[(node.name, primitive)] = i + 1
        return (node.name, primitive, i)

    def _pick(self, key: tuple[str, str, int], rn: torch.Tensor, up: torch.Tensor,
              down: torch.Tensor) -> torch.Tensor:
        d = self.directions.get(key)
        if d is None or d.shape != rn.shape:
            return rn
        d = d.to(rn.device)
        return torch.where(d > 0, up, torch.where(d < 0, down, rn))

    def round(self, node: Any, primitive: str, value: torch.Tensor) -> torch.Tensor:
        if not value.is_floating_point() or node.op_type in EXPLICIT_CAST_OPS:
            return value
        key = self._key(node, primitive)
        v = value.to(torch.float64)
        rn = round_to_format(v, self.spec.compute)
        if self.spec.accumulation.pinned and primitive in IEEE_OPS:
            return rn.to(value.dtype)
        up, down = self.neighbours(primitive, v, rn)
        r = self._pick(key, rn, up, down)
        r = torch.where(torch.isfinite(v), r, v)  # +-inf (masks) and NaN stay as they are
        return r.to(value.dtype)

    def _cast_activation(self, node: Any, x: torch.Tensor, cast: Any, reduce_axis: int,
                         sample_axis: Any = 0) -> Any:
        key = self._key(node, f"cast{reduce_axis}")
        op = super()._cast_activation(node, x, cast, reduce_axis, sample_axis)
        if cast is None or self.spec.rounding != "any":
            return op  # nearest-even: the spec leaves the program no choice
        rn = cast_values(x, cast, op.s)
        up, down = cast_values(x, cast, op.s, "up"), cast_values(x, cast, op.s, "down")
        return dataclasses.replace(op, q=self._pick(key, rn, up, down))


class _Probe(_Guided):
    """The same program, run with autograd: every rounded result is its exact value plus the
    (detached) rounding plus a zero leaf, so d(output) / d(leaf) is the output's sensitivity to
    that rounding (straight through every rounding and cast)."""

    def __init__(self, spec: KernelSpec, directions: dict[tuple[str, str, int], torch.Tensor],
                 order: str = "pairwise") -> None:
        super().__init__(spec, directions, order)
        self.leaves: dict[tuple[str, str, int], torch.Tensor] = {}
        self._inner = 0

    def reset(self) -> None:
        super().reset()
        self.leaves.clear()

    def _leaf(self, key: tuple[str, str, int], exact: torch.Tensor, out: torch.Tensor
              ) -> torch.Tensor:
        z = torch.zeros_like(exact, dtype=torch.float64, requires_grad=True)
        self.leaves[key] = z
        out = out.to(exact.dtype)
        step = torch.where(out == exact, torch.zeros_like(out), out - exact).detach()
        # a masked (infinite) value carries no sensitivity: its leaf would only spread NaN
        z_ = torch.where(torch.isfinite(exact.detach()), z, torch.zeros_like(z))
        return (exact + step + z_).to(exact.dtype)

    def round(self, node: Any, primitive: str, value: torch.Tensor) -> torch.Tensor:
        if self._inner or not value.is_floating_point() or node.op_type in EXPLICIT_CAST_OPS:
            return super().round(node, primitive, value.detach())
        n = self._seen.get((node.name, primitive), 0)
        out = super().round(node, primitive, value.detach())
        return self._leaf((node.name, primitive, n), value, out)

    def matmul(self, node: Any, a: torch.Tensor, b: torch.Tensor, a_role: str, b_role: str
               ) -> torch.Tensor:
        out = super().matmul(node, a.detach(), b.detach(), a_role, b_role)
        return self._leaf((node.name, "matmul", 0), torch.matmul(a, b), out)

    def conv(self, node: Any, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
             stride: list[int], padding: list[int], dilation: list[int], groups: int,
             x_role: str, w_role: str) -> torch.Tensor:
        out = super().conv(node, x.detach(), w.detach(), None if bias is None else bias.detach(),
                           stride, padding, dilation, groups, x_role, w_role)
        exact = conv_nd(x, w, bias, stride, padding, dilation, groups)
        return self._leaf((node.name, "conv", 0), exact, out)

    def reduce_sum(self, node: Any, x: torch.Tensor, dims: tuple[int, ...], keepdim: bool = True
                   ) -> torch.Tensor:
        if not x.is_floating_point():
            return super().reduce_sum(node, x, dims, keepdim)
        n = self._seen.get((node.name, "reduce"), 0)
        self._inner += 1
        try:
            out = super().reduce_sum(node, x.detach(), dims, keepdim)
        finally:
            self._inner -= 1
        exact = x.sum(dim=tuple(dims), keepdim=keepdim)
        return self._leaf((node.name, "reduce", n), exact, out)


def _run(graph: Graph, real: Realization, feeds: dict[str, np.ndarray], device: str,
         grad: bool = False) -> dict[str, torch.Tensor]:
    from kcverify.models.executor import Executor

    if isinstance(real, _Guided):
        real.reset()
    ex = Executor(graph, device=device, dtype=torch.float64, arithmetic=real.bind(graph))
    return ex.run(feeds, grad=grad)


def _worst(graph: Graph, outs: list[dict[str, torch.Tensor]]
           ) -> list[tuple[str, int, float, float]]:
    """Per input: (output, flat index, |drift|, sign of inf - train) of its largest drift."""
    best: dict[int, tuple[str, int, float, float]] = {}
    for v in graph.outputs:
        t, i = outs[0][v.name].detach(), outs[1][v.name].detach()
        if not t.is_floating_point():
            continue
        d = torch.where(torch.isfinite(t) & torch.isfinite(i), i - t, torch.zeros_like(t))
        flat = d.reshape(d.shape[0], -1)
        idx = flat.abs().argmax(1)
        for k in range(flat.shape[0]):
            val = float(flat[k, idx[k]])
            if k not in best or abs(val) > best[k][2]:
                best[k] = (v.name, int(idx[k]), abs(val), 1.0 if val >= 0 else -1.0)
    return [best[k] for k in sorted(best)]


def guided_pair(graph: Graph, train: KernelSpec, inf: KernelSpec, feeds: dict[str, np.ndarray],
                rounds: int = 2, device: str = "cpu", start: tuple[Realization, Realization] | None
                = None) -> list[tuple[Realization, Realization]]:
    """Programs whose every rounding is pushed, element by element, in the direction that grows
    the largest drift: per input, the output element where |inf - train| is largest (in the
    ``start`` pair, default round-to-nearest), then each rounding of the inference program up
    where d(that element) / d(rounding) has the drift's sign and down where it has the other,
    the training program the opposite way (a linearisation: a heuristic choice among programs the
    spec admits, so what it realizes is a witness). ``rounds`` re-linearises at the last pair."""
    pair: tuple[Realization, Realization] = start or (
        _Guided(train, {}, label="nearest"), _Guided(inf, {}, label="nearest"))
    dirs: list[dict[tuple[str, str, int], torch.Tensor]] = [{}, {}]
    out: list[tuple[Realization, Realization]] = []
    for r in range(rounds):
        worst = _worst(graph, [_run(graph, p, feeds, device) for p in pair])
        new: list[dict[tuple[str, str, int], torch.Tensor]] = []
        for side, spec in enumerate((train, inf)):
            probe = _Probe(spec, dirs[side])
            res = _run(graph, probe, feeds, device, grad=True)
            target = None
            for k, (name, idx, _, sign) in enumerate(worst):
                y = res[name][k].reshape(-1)[idx] * (sign if side == 1 else -sign)
                target = y if target is None else target + y
            leaves = [(key, z) for key, z in probe.leaves.items()]
            if target is None or not leaves or not target.requires_grad:
                new.append(dict(dirs[side]))
                continue
            grads = torch.autograd.grad(target, [z for _, z in leaves], allow_unused=True)
            new.append({key: torch.sign(torch.nan_to_num(g)).detach()
                        for (key, _), g in zip(leaves, grads) if g is not None})
        dirs = new
        pair = (_Guided(train, dirs[0], label=f"guided round {r + 1}"),
                _Guided(inf, dirs[1], label=f"guided round {r + 1}"))
        out.append(pair)
    return out


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
    outs = [_run(graph, real, feeds, device) for real in pair]
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
            device: str = "cpu", guided: int = 2) -> FalsifyResult:
    """Largest realized drift per input, over ``programs`` pairs of conforming programs, then
    ``guided`` rounds of gradient-guided roundings (``guided_pair``) at the best point, and, for
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
        for pair in guided_pair(graph, train, inf, fd, guided, device) if guided else []:
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
    for pair in guided_pair(graph, train, inf, cur, guided, device) if guided else []:
        consider(cur, pair)
    return FalsifyResult(best, witness, evals)
