"""Replay an SMT witness as one conforming pair of programs, in exact rationals.

The solver's assignment relaxes the exact casts to bounded errors, so it is not yet a program.
The replay executes both kernels from the witness input with every cast, scale and stored input
computed *exactly* (round to nearest-even on rationals, float32 scales from the replayed amax, as
kcverify.kernels.realize does), and takes from the witness only the choices the spec leaves free:
each accumulation error (clamped to gamma_n * sum |a_i b_i| of the replayed operands) and each
rounding to the compute format (the grid value within the spec's bound that is nearest to the
witness's value; the nearest-even rounding when the witness's is out of reach). Every value the
replay produces is therefore what some program conforming to the spec computes (semantics §1.1), and
its drift is a real violation when it exceeds the threshold. ``clamped`` counts the witness
choices the replay had to change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

from kcverify.smt.encode import (
    FP32,
    KERNELS,
    Problem,
    Step,
    gamma_exact,
    round_coeffs,
)
from kcverify.smt.exact import fr, round_rational, scale_from_amax


@dataclass
class Replay:
    """Both kernels' outputs and the drift of one replayed conforming pair of programs."""

    x: list[Fraction]
    outputs: dict[str, tuple[list[Fraction], list[Fraction]]]
    drift: list[Fraction]
    clamped: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def max_abs_drift(self) -> Fraction:
        return max((abs(d) for d in self.drift), default=Fraction(0))


class _Run:
    def __init__(self, p: Problem, errors: dict[str, Fraction]) -> None:
        self.p = p
        self.errors = errors
        self.clamped = 0

    def choice(self, name: str, bound: Fraction) -> Fraction:
        """The witness's error, clamped to the bound recomputed on the replayed values."""
        e = self.errors.get(name, Fraction(0))
        if abs(e) > bound:
            self.clamped += 1
            e = bound if e > 0 else -bound
        return e

    def snap(self, name: str, v: Fraction, k: int, rel: Fraction, absb: Fraction) -> Fraction:
        """A compute-format value within rel|v| + absb of v, nearest to v + witness error."""
        fmt = self.p.specs[k].compute
        bound = rel * abs(v) + absb
        target = v + self.errors.get(name, Fraction(0))
        cands = [round_rational(target, fmt, "down", saturate=False),
                 round_rational(target, fmt, "up", saturate=False)]
        ok = [c for c in cands if abs(c - v) <= bound]
        if not ok:
            self.clamped += 1
            return round_rational(v, fmt, saturate=False)
        return min(ok, key=lambda c: abs(c - target))


def _cast(run: _Run, k: int, st: Step, a: list[Fraction]) -> list[Fraction]:
    spec = run.p.specs[k]
    cp = st.cast[k]
    if cp is None:
        return [round_rational(v, spec.compute, saturate=False) for v in a]
    if cp.scheme == "none":
        s = Fraction(1)
    elif cp.scheme == "static":
        s = cp.s_hi
    else:
        s = scale_from_amax(max((abs(v) for v in a), default=Fraction(0)), cp.fmt, FP32)
    tag = f"{KERNELS[k]}:{st.node.name}:cast"
    out = []
    for i, v in enumerate(a):
        if cp.factor == 1:
            out.append(round_rational(v / s, cp.fmt) * s)
        else:  # rounding: any -- the neighbour on the witness's side
            e = run.errors.get(f"{tag}:{i}", Fraction(0))
            out.append(round_rational(v / s, cp.fmt, "up" if e > 0 else "down") * s)
    return out


def _linear(run: _Run, k: int, st: Step, a: list[Fraction]) -> list[Fraction]:
    spec = run.p.specs[k]
    W = st.weights[k]
    qa = _cast(run, k, st, a)
    gam = gamma_exact(len(W), fr(spec.accumulate.u))
    rel2, abs2 = round_coeffs(spec.compute, 2)
    rel1, abs1 = round_coeffs(spec.compute, 1, spec.ulp("add"))
    tag = f"{KERNELS[k]}:{st.node.name}"
    out = []
    for j in range(len(W[0])):
        dot = sum((W[i][j] * qa[i] for i in range(len(W))), Fraction(0))
        sabs = sum((abs(W[i][j] * qa[i]) for i in range(len(W))), Fraction(0))
        acc = dot + run.choice(f"{tag}:acc:{j}", gam * sabs)
        y = run.snap(f"{tag}:round:{j}", acc, k, rel2, abs2)
        if st.bias is not None:
            y = run.snap(f"{tag}:bias:{j}", y + st.bias[j], k, rel1, abs1)
        out.append(y)
    return out


def _elementwise(run: _Run, k: int, st: Step, args: list[list[Fraction]]) -> list[Fraction]:
    spec = run.p.specs[k]
    prim = "mul" if st.op == "mulc" else "add"
    rel, absb = round_coeffs(spec.compute, 1, spec.ulp(prim))
    out = []
    for j, a in enumerate(args[0]):
        if st.const is not None:
            c = st.const[j]
            w = {"addc": a + c, "subc": a - c, "rsubc": c - a, "mulc": c * a}[st.op]
        else:
            w = a + args[1][j] if st.op == "add" else a - args[1][j]
        out.append(run.snap(f"{KERNELS[k]}:{st.node.name}:{prim}:{j}", w, k, rel, absb))
    return out


def replay(p: Problem, x: list[Fraction], errors: dict[str, Fraction]) -> Replay:
    """Run both kernels exactly from input x with the witness's free choices (module doc)."""
    run = _Run(p, errors)
    values: dict[str, list[list[Fraction]]] = {
        p.input: [[round_rational(v, p.specs[k].compute, saturate=False) for v in x] for k in range(2)]}
    for st in p.steps:
        vals = []
        for k in range(2):
            args = [values[i][k] for i in st.inputs]
            if st.op == "linear":
                v = _linear(run, k, st, args[0])
            elif st.op == "relu":
                v = [max(a, Fraction(0)) for a in args[0]]
            elif st.op == "pass":
                v = list(args[0])
            else:
                v = _elementwise(run, k, st, args)
            vals.append(v)
        values[st.output] = vals
    outs = {o: (values[o][0], values[o][1]) for o in p.outputs}
    drift = [i - t for o in p.outputs for t, i in zip(*outs[o])]
    return Replay(list(x), outs, drift, run.clamped)
