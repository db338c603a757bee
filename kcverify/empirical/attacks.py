"""Counterexample search for certifiable clauses the engines left unknown.

A certificate quantifies over every conforming *program* (semantics §1) and, for a region, every
input in it. A counterexample is therefore a pair of conforming programs (one per kernel, given by
Realization choices: seed, order, chunk, rounding) and an input on which the clause's quantity
breaks its threshold. Two searches:

* ``search_programs``: on a finite slice, a portfolio of program pairs chosen to push the kernels
  apart (opposite rounding directions, opposite accumulation orders, seeded random programs);
  the worst pair is kept.
* ``search_region``: for a region (box or L2 ball of radius eps around float inputs, e.g.
  embeddings), projected gradient ascent on the clause's violation margin with the gradient
  estimated by SPSA (simultaneous perturbation: g ~ (f(x + c D) - f(x - c D)) / 2c * D with
  Rademacher D, averaged over a few draws, all evaluated as one batch). The executor runs without
  autograd and casts are step functions, so a zeroth-order estimate is the gradient available.

A violation is *replayed* before it is reported (DNNV's validate_counter_example): the same
programs are run again on the offending input alone, and the quantity re-checked; only a replayed
violation refutes the clause.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kcverify.empirical.metrics import MetricInputs
from kcverify.empirical.quantities import QueryOutcome, evaluate_query


@dataclass(frozen=True)
class Program:
    """Realization choices: one concrete program conforming to a kernel spec."""

    seed: int = 0
    order: str = "sequential"
    chunk: int | None = None
    rounding: str = "nearest"

    def choices(self) -> dict[str, Any]:
        out: dict[str, Any] = {"seed": self.seed, "order": self.order, "rounding": self.rounding}
        if self.chunk is not None:
            out["chunk"] = self.chunk
        return out


def program_pairs(count: int = 8, seed: int = 0) -> list[tuple[Program, Program]]:
    """(train, inf) program pairs, the likeliest to drift apart first, then seeded random ones."""
    fixed = [
        (Program(), Program()),
        (Program(rounding="up"), Program(rounding="down")),
        (Program(rounding="down"), Program(rounding="up")),
        (Program(order="pairwise"), Program(order="reverse")),
        (Program(order="reverse", rounding="up"), Program(order="chunked", chunk=16, rounding="down")),
    ]
    rng = np.random.default_rng(seed)
    orders = ("sequential", "reverse", "pairwise", "chunked", "random")
    roundings = ("nearest", "up", "down", "random")
    out = fixed[:count]
    while len(out) < count:
        def draw() -> Program:
            order = orders[int(rng.integers(len(orders)))]
            chunk = int(rng.choice([4, 8, 16, 32])) if order == "chunked" else None
            return Program(int(rng.integers(1 << 30)), order, chunk,
                           roundings[int(rng.integers(len(roundings)))])
        out.append((draw(), draw()))
    return out


Runner = Callable[[Any, Mapping[str, np.ndarray], Program], np.ndarray]


def kernel_runner(graph: Any, output: str | None = None, device: str = "cpu",
                  base_dir: Any = None) -> Runner:
    """runner(spec, feeds, program) -> float64 logits, through kcverify.kernels.realize."""
    from kcverify.kernels.realize import run_kernel  # lazily: torch-heavy

    name = output or graph.outputs[0].name

    def run(spec: Any, feeds: Mapping[str, np.ndarray], program: Program) -> np.ndarray:
        out = run_kernel(graph, spec, feeds, device=device, base_dir=base_dir, **program.choices())
        return out[name].detach().cpu().double().numpy()

    return run


@dataclass
class Counterexample:
    """A replayed violation: the input, the element, both programs, and the values seen."""

    input_index: int | None
    position: int | None
    value: float
    threshold: float
    op: str
    train_program: Program
    inf_program: Program
    replayed: bool
    replay_value: float | None = None
    input_point: list[Any] | None = None  # the perturbed input, for a region counterexample

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SearchResult:
    """The worst outcome found, the programs that gave it, and a counterexample if it violates."""

    worst: QueryOutcome
    train_program: Program
    inf_program: Program
    tried: int
    counterexample: Counterexample | None = None
    history: list[float] = field(default_factory=list)


def _take(feeds: Mapping[str, np.ndarray], idx: Sequence[int] | slice) -> dict[str, np.ndarray]:
    return {k: np.asarray(v)[idx] for k, v in feeds.items()}


def search_programs(query: Any, train_spec: Any, inf_spec: Any, feeds: Mapping[str, np.ndarray],
                    run: Runner, tokens: np.ndarray | None = None, pairs: int = 8,
                    temperature: float | None = None, seed: int = 0) -> SearchResult:
    """Try ``pairs`` program pairs on the slice; keep the one with the smallest margin."""
    temp = float(temperature or getattr(query, "temperature", 1.0) or 1.0)
    cache: dict[tuple[str, Program], np.ndarray] = {}

    def logits(which: str, spec: Any, program: Program, f: Mapping[str, np.ndarray]) -> np.ndarray:
        key = (which, program)
        if key not in cache:
            cache[key] = run(spec, f, program)
        return cache[key]

    best: tuple[QueryOutcome, Program, Program] | None = None
    history = []
    candidates = program_pairs(pairs, seed)
    for tp, ip in candidates:
        x = MetricInputs(logits("train", train_spec, tp, feeds), logits("inf", inf_spec, ip, feeds),
                         temperature=temp)
        o = evaluate_query(query, x, tokens)
        history.append(o.value)
        if best is None or o.margin < best[0].margin:
            best = (o, tp, ip)
    assert best is not None
    worst, tp, ip = best
    result = SearchResult(worst, tp, ip, len(candidates), history=history)
    if not worst.holds:
        result.counterexample = _replay(query, train_spec, inf_spec, feeds, run, tokens, temp,
                                        worst, tp, ip)
    return result


def _replay(query: Any, train_spec: Any, inf_spec: Any, feeds: Mapping[str, np.ndarray],
            run: Runner, tokens: np.ndarray | None, temp: float, worst: QueryOutcome,
            tp: Program, ip: Program) -> Counterexample:
    """Re-run the violating programs (on the offending input alone, for max / min) and re-check."""
    if worst.where is not None:
        i, t = worst.where
        sub = _take(feeds, [i])
        sub_tokens = None if tokens is None else np.asarray(tokens)[[i]]
    else:
        i = t = None
        sub, sub_tokens = dict(feeds), tokens
    x = MetricInputs(run(train_spec, sub, tp), run(inf_spec, sub, ip), temperature=temp)
    again = evaluate_query(query, x, sub_tokens)
    return Counterexample(i, t, worst.value, float(query.threshold), query.op, tp, ip,
                          replayed=not again.holds, replay_value=again.value)


def snap_inside(point: np.ndarray, centre: np.ndarray, eps: float, norm: str,
                dtype: np.dtype) -> np.ndarray:
    """``point`` stored in ``dtype`` and still inside the eps-ball around ``centre`` (checked in
    float64): rounding to a narrow input type can step past the ball's edge by half an ulp, and a
    counterexample outside the region would refute nothing."""
    c = np.asarray(centre, dtype=np.float64)
    x = np.asarray(point, dtype=np.float64).astype(dtype)
    for it in range(40):
        d = x.astype(np.float64) - c
        if norm == "linf":
            bad = np.abs(d) > eps
            if not bad.any():
                return x
            x = np.where(bad, np.nextafter(x, np.asarray(c, dtype=dtype)), x).astype(dtype)
        else:
            r = float(np.linalg.norm(d))
            if r <= eps:
                return x
            x = (c + d * (eps / r) * (1 - 2.0 ** (it - 30))).astype(dtype)  # shrink harder each try
    return np.asarray(c, dtype=dtype)  # the centre is always inside


def search_region(query: Any, train_spec: Any, inf_spec: Any, center: Mapping[str, np.ndarray],
                  input_name: str, eps: float, run: Runner, norm: str = "linf",
                  tokens: np.ndarray | None = None, steps: int = 10, samples: int = 4,
                  step_size: float | None = None, program: tuple[Program, Program] | None = None,
                  temperature: float | None = None, seed: int = 0) -> SearchResult:
    """SPSA projected gradient ascent on the violation, in the eps-ball around each input.

    For a max (forall) query: a violation at one point of one input's ball refutes it.

    ``center[input_name]`` is a float array [n, ...]; each input is attacked independently (one
    batch holds, per input, the current point and its 2 * samples perturbations). The objective
    per input is the negated margin of the query restricted to that input (for a max aggregate,
    the input's worst element). Returns the worst point over all inputs and steps.
    """
    temp = float(temperature or getattr(query, "temperature", 1.0) or 1.0)
    tp, ip = program or (Program(), Program())
    rng = np.random.default_rng(seed)
    x0 = np.asarray(center[input_name], dtype=np.float64)
    n = x0.shape[0]
    c = eps * 0.5
    lr = step_size if step_size is not None else eps / 2
    others = {k: np.asarray(v) for k, v in center.items() if k != input_name}
    dtype = np.asarray(center[input_name]).dtype

    def project(x: np.ndarray) -> np.ndarray:
        d = x - x0
        if norm == "linf":
            d = np.clip(d, -eps, eps)
        else:
            flat = d.reshape(n, -1)
            r = np.linalg.norm(flat, axis=1, keepdims=True)
            d = (flat * np.minimum(1.0, eps / np.maximum(r, 1e-300))).reshape(d.shape)
        return x0 + d

    def margins(points: np.ndarray, reps: int) -> np.ndarray:
        """Per point, the query's margin on that point alone (points: [n * reps, ...])."""
        feeds = {input_name: points.astype(dtype)}
        feeds.update({k: np.repeat(v, reps, axis=0) for k, v in others.items()})
        x = MetricInputs(run(train_spec, feeds, tp), run(inf_spec, feeds, ip), temperature=temp)
        tok = None if tokens is None else np.repeat(np.asarray(tokens), reps, axis=0)
        out = np.empty(points.shape[0])
        for j in range(points.shape[0]):
            sub = MetricInputs(x.logits_train[j:j + 1], x.logits_inf[j:j + 1], temperature=temp)
            out[j] = evaluate_query(query, sub, None if tok is None else tok[j:j + 1]).margin
        return out

    # random start inside the ball (at the centre, a symmetric objective has no SPSA gradient)
    if norm == "linf":
        x = project(x0 + rng.uniform(-eps, eps, size=x0.shape))
    else:
        d = rng.normal(size=x0.shape).reshape(n, -1)
        d *= (eps * rng.uniform(0, 1, size=(n, 1))) / np.maximum(np.linalg.norm(d, axis=1, keepdims=True), 1e-300)
        x = project(x0 + d.reshape(x0.shape))
    best_m = margins(x0, 1)  # the centre itself is a candidate: never report less than it
    best_x = x0.copy()
    history = []
    for _ in range(steps):
        deltas = rng.choice([-1.0, 1.0], size=(samples, *x.shape))
        pts = [x] + list(itertools.chain.from_iterable(
            (project(x + c * d), project(x - c * d)) for d in deltas))
        batch = np.stack(pts, axis=1).reshape(n * len(pts), *x.shape[1:])
        m = margins(batch, len(pts)).reshape(n, len(pts))
        improved = m[:, 0] < best_m
        best_m = np.where(improved, m[:, 0], best_m)
        best_x[improved] = x[improved]
        for j in range(1, len(pts)):  # any probe point may itself be the worst
            better = m[:, j] < best_m
            best_m = np.where(better, m[:, j], best_m)
            best_x[better] = np.stack(pts, axis=1)[better, j]
        history.append(float(best_m.min()))
        grad = np.zeros_like(x)
        for s, d in enumerate(deltas):
            diff = (m[:, 1 + 2 * s] - m[:, 2 + 2 * s]) / (2 * c)
            grad += diff.reshape(n, *([1] * (x.ndim - 1))) * d
        step = -grad / samples  # descend the margin
        if norm == "linf":
            x = project(x + lr * np.sign(step))
        else:
            flat = step.reshape(n, -1)
            unit = flat / np.maximum(np.linalg.norm(flat, axis=1, keepdims=True), 1e-300)
            x = project(x + lr * unit.reshape(x.shape))
    worst_i = int(np.argmin(best_m))
    point = snap_inside(best_x[worst_i], x0[worst_i], eps, norm, dtype)
    feeds = {input_name: point[None]}
    feeds.update({k: v[[worst_i]] for k, v in others.items()})
    tok = None if tokens is None else np.asarray(tokens)[[worst_i]]
    outcome = evaluate_query(query, MetricInputs(run(train_spec, feeds, tp), run(inf_spec, feeds, ip),
                                                 temperature=temp), tok)
    result = SearchResult(outcome, tp, ip, steps * (1 + 2 * samples), history=history)
    if not outcome.holds:
        again = evaluate_query(query, MetricInputs(run(train_spec, feeds, tp), run(inf_spec, feeds, ip),
                                                   temperature=temp), tok)
        pos = outcome.where[1] if outcome.where else None
        result.counterexample = Counterexample(
            worst_i, pos, outcome.value, float(query.threshold), query.op, tp, ip,
            replayed=not again.holds, replay_value=again.value,
            input_point=point.tolist())
    return result
