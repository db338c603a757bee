"""Decide the L-inf drift clause of a small block with z3, or compute its exact maximum.

    v = decide_drift(graph, train, inf, x0, threshold, eps=0.0, timeout_s=10)
    v.verdict     # "proved" | "refuted" | "unknown"
    m = max_drift(graph, train, inf, x0, eps=0.0, timeout_s=30)
    m.value       # Fraction: max over the encoding of max_j |z_inf_j - z_train_j| (exact=True)

proved: the negation "some output drifts by more than tau" is unsat over the encoding
(kcverify.smt.encode), which contains every conforming pair of programs on every input of the set.
refuted: the solver's witness, replayed in exact rationals as a conforming pair of programs
(kcverify.smt.replay), drifts by more than tau; concrete realizations (kcverify.kernels.realize)
at the witness input are run too and their drift is reported. A witness that does not survive the
replay (the encoding relaxes exact casts) leaves the clause unknown. unknown: also at the time
limit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np
import z3

from kcverify.kernels.spec import KernelSpec
from kcverify.models.ir import Graph
from kcverify.smt.encode import Encoding, Problem, encode, prepare
from kcverify.smt.exact import fr
from kcverify.smt.replay import Replay, replay


@dataclass
class SmtVerdict:
    """The outcome of one SMT decision of max_j |drift_j| <= threshold on one sample."""

    verdict: str
    threshold: float
    seconds: float
    stats: dict[str, Any]
    witness: dict[str, Any] | None = None
    note: str = ""


@dataclass
class MaxDrift:
    """max over the encoding of max_j |drift_j|: ``value`` when exact, else [lower, upper]."""

    value: Fraction | None
    lower: Fraction | None
    upper: Fraction | None
    exact: bool
    seconds: float
    stats: dict[str, Any] = field(default_factory=dict)
    x: list[Fraction] | None = None


def stats_of(enc: Encoding) -> dict[str, Any]:
    p = enc.problem
    return {"neurons": p.neurons(), "relus": enc.relus, "unstable_relus": enc.unstable,
            "error_vars": len(enc.errors), "constraints": len(enc.constraints),
            "outputs": len(enc.drift)}


def _fraction(v: Any) -> Fraction:
    if z3.is_rational_value(v):
        return Fraction(v.numerator_as_long(), v.denominator_as_long())
    if z3.is_int_value(v):
        return Fraction(v.as_long())
    # an algebraic number cannot arise in linear arithmetic; approximate conservatively
    return Fraction(v.as_decimal(30).rstrip("?"))


def _model_values(model: z3.ModelRef, enc: Encoding) -> tuple[list[Fraction], dict[str, Fraction]]:
    x = [_fraction(model.eval(xi, model_completion=True)) for xi in enc.x]
    errs = {n: _fraction(model.eval(v, model_completion=True)) for n, v in enc.errors.items()}
    return x, errs


def _float_input(p: Problem, x: list[Fraction]) -> np.ndarray:
    """The witness input as float32 values inside the region (a model input is float32)."""
    out = np.empty(len(x), dtype=np.float32)
    for i, v in enumerate(x):
        lo, hi = p.x0[i] - p.eps, p.x0[i] + p.eps
        f = np.float32(float(v))
        while fr(float(f)) < lo:
            f = np.nextafter(f, np.float32(np.inf))
        while fr(float(f)) > hi:
            f = np.nextafter(f, np.float32(-np.inf))
        out[i] = f
    return out


def realized_drift(graph: Graph, train: KernelSpec, inf: KernelSpec, x: np.ndarray,
                   programs: int = 16, seed: int = 0) -> float:
    """max_j |z_inf_j - z_train_j| over pairs of concrete conforming programs on input x: the
    nearest / sequential programs of both specs and ``programs`` random ones of each."""
    import random

    from kcverify.kernels.realize import random_realization, run_kernel

    rng = random.Random(seed)
    feeds = {graph.inputs[0].name: np.asarray(x, dtype=np.float32).reshape(1, -1)}
    out = graph.outputs[0].name

    def runs(spec: KernelSpec) -> np.ndarray:
        rows = [run_kernel(graph, spec, feeds)[out].numpy().reshape(-1)]
        for _ in range(programs):
            r = random_realization(spec, rng)
            rows.append(run_kernel(graph, spec, feeds, seed=r.seed, order=r.order, chunk=r.chunk,
                                   rounding=r.rounding)[out].numpy().reshape(-1))
        return np.stack(rows)

    t, i = runs(train), runs(inf)
    return float(max(np.max(i.max(0) - t.min(0)), np.max(t.max(0) - i.min(0))))


def _witness(p: Problem, enc: Encoding, model: z3.ModelRef) -> tuple[Replay, np.ndarray]:
    x, errs = _model_values(model, enc)
    xf = _float_input(p, x)
    return replay(p, [fr(float(v)) for v in xf], errs), xf


def decide_problem(p: Problem, threshold: float, timeout_s: float = 10.0,
                   assume_intervals: bool = True, programs: int = 8) -> SmtVerdict:
    """Decide max_j |drift_j| <= threshold on a prepared problem (see the module doc).

    Per output j and sign, z3's Optimize maximises the signed drift (on these linear problems
    far faster than refuting the disjunction |drift_j| > tau directly): an optimum <= tau for
    every one is the proof (unsat of the negation); a model above tau is a witness, replayed.
    """
    t0 = time.perf_counter()
    enc = encode(p, assume_intervals)
    st = stats_of(enc)
    tau = fr(threshold)
    note = ""
    last: dict[str, Any] | None = None
    for j, d in enumerate(enc.drift):
        for sign in (1, -1):
            left = timeout_s - (time.perf_counter() - t0)
            if left <= 0:
                return SmtVerdict("unknown", threshold, time.perf_counter() - t0, st, last,
                                  note="z3: time limit")
            opt = z3.Optimize()
            opt.set("timeout", max(1, int(left * 1000)))
            opt.add(*enc.constraints)
            h = opt.maximize(sign * d)
            res = opt.check()
            if res != z3.sat:
                return SmtVerdict("unknown", threshold, time.perf_counter() - t0, st, last,
                                  note=f"z3: {opt.reason_unknown() or res}")
            lo, hi = opt.lower(h), opt.upper(h)
            if z3.is_rational_value(hi) and _fraction(hi) <= tau:
                continue  # this output's drift never exceeds tau on this side
            if not (z3.is_rational_value(lo) and _fraction(lo) > tau):
                return SmtVerdict("unknown", threshold, time.perf_counter() - t0, st, last,
                                  note="z3: the optimum was not reached")
            rep, xf = _witness(p, enc, opt.model())
            last = {"x": [float(v).hex() for v in xf], "output": enc.drift_names[j],
                    "replayed_drift": float(rep.max_abs_drift), "clamped_choices": rep.clamped}
            if programs:
                last["realized_drift"] = realized_drift(p.graph, *p.specs, xf, programs)
            if rep.max_abs_drift > tau:
                return SmtVerdict("refuted", threshold, time.perf_counter() - t0, st, last,
                                  note="witness replayed exactly as a conforming pair of programs")
            note = ("the error model admits a violation, but its witness does not survive the "
                    "exact replay (relaxed casts)")
    if last is not None:
        return SmtVerdict("unknown", threshold, time.perf_counter() - t0, st, last, note=note)
    return SmtVerdict("proved", threshold, time.perf_counter() - t0, st)


def decide_drift(graph: Graph, train: KernelSpec, inf: KernelSpec, x0: Any, threshold: float,
                 eps: float = 0.0, sample: int = 0, timeout_s: float = 10.0,
                 assume_intervals: bool = True, programs: int = 8) -> SmtVerdict:
    """Decide "max_j |z_inf_j(x) - z_train_j(x)| <= threshold for every x with |x - x0| <= eps
    and every conforming pair of programs" on one sample of x0 (see the module doc)."""
    return decide_problem(prepare(graph, train, inf, x0, eps, sample), threshold, timeout_s,
                          assume_intervals, programs)


def max_problem(p: Problem, timeout_s: float = 30.0, assume_intervals: bool = True) -> MaxDrift:
    """max over the encoding of max_j |drift_j|: one z3 Optimize per output and sign (a single
    objective over the disjunction is far slower), exact rationals; ``timeout_s`` in all."""
    t0 = time.perf_counter()
    enc = encode(p, assume_intervals)
    st = stats_of(enc)
    best: Fraction | None = None
    upper: Fraction | None = Fraction(0)
    arg: list[Fraction] | None = None
    for d in enc.drift:
        for sign in (1, -1):
            left = timeout_s - (time.perf_counter() - t0)
            if left <= 0:
                return MaxDrift(None, best, None, False, time.perf_counter() - t0, st, arg)
            opt = z3.Optimize()
            opt.set("timeout", max(1, int(left * 1000)))
            opt.add(*enc.constraints)
            h = opt.maximize(sign * d)
            if opt.check() != z3.sat:
                return MaxDrift(None, best, None, False, time.perf_counter() - t0, st, arg)
            lo, hi = opt.lower(h), opt.upper(h)
            lo_f = _fraction(lo) if z3.is_rational_value(lo) else None
            hi_f = _fraction(hi) if z3.is_rational_value(hi) else None
            if lo_f is not None and (best is None or lo_f > best):
                best = lo_f
                arg, _ = _model_values(opt.model(), enc)
            upper = None if (hi_f is None or upper is None) else max(upper, hi_f)
    dt = time.perf_counter() - t0
    exact = best is not None and upper is not None and best == upper
    return MaxDrift(best if exact else None, best, upper, exact, dt, st, arg)


def max_drift(graph: Graph, train: KernelSpec, inf: KernelSpec, x0: Any, eps: float = 0.0,
              sample: int = 0, timeout_s: float = 30.0, assume_intervals: bool = True) -> MaxDrift:
    """The exact maximum L-inf drift the encoding admits on one sample (see max_problem)."""
    return max_problem(prepare(graph, train, inf, x0, eps, sample), timeout_s, assume_intervals)
