"""Bit-precise mode: a tiny block in z3's floating-point theory, for one fixed summation order.

    b = bitprecise_max(graph, train, inf, x0, eps, timeout_s=60)
    b.lower, b.upper      # the exact max drift of the sequential programs lies in [lower, upper]

What it executes, per kernel, for Gemm(transB) / Relu chains whose compute and accumulator
formats are one IEEE sort C (fp16 = FPSort(5, 11), bf16 = FPSort(8, 8)): inputs are C values in the
box; weights are the exact constants Q(W) (kcverify.smt.encode); each activation operand of the
inference kernel is cast to its fp8 format with scale none: e5m2 through the IEEE sort
FPSort(5, 3) (saturating, as the realizations do), e4m3fn *emulated* in C (FPSort(4, 4) has
IEEE's inf/NaN exponent and tops out at 240, while e4m3fn reaches 448): 4 significant bits by
rounding through FPSort(5, 4) for |a| >= 2^-6, the 2^-9 subnormal grid below it
(roundToIntegral(a * 2^9) * 2^-9, exact scalings), saturation at 448. Products and the sum are
one fused multiply-add per term, left to right: acc_0 = RNE(a_0 w_0), acc_i = RNE(a_i w_i + acc_{i-1})
(the realizations' ``sequential`` order: exact products, one rounding per addition); the bias is
one RNE addition; Relu selects. The drift of each output is taken exactly in FPSort(11, 53).

The maximum is found by bisection on tau (each step a bit-blasted sat query "some |drift_j| >
tau"): a model raises ``lower`` to the drift it attains (exact), unsat lowers ``upper``; started
at a drift some input attains, one unsat answer proves it is the maximum. Comparing
it with max_drift (the error model, every order) shows where the error model itself is loose.
Limits: biases must be C values; activation and weight scales ``none``; no overflow handling
beyond the fp8 saturation (keep values small); gradual underflow in C is IEEE's.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import z3

from kcverify.kernels.spec import KernelSpec
from kcverify.models.ir import Graph
from kcverify.smt.encode import NotEncodable, Problem, Step, prepare
from kcverify.smt.exact import fr, round_rational

SORTS = {"fp16": (5, 11), "bf16": (8, 8), "fp8_e5m2": (5, 3)}
F64 = z3.FPSort(11, 53)
RNE = z3.RNE()


@dataclass
class BitMax:
    """The max drift of the sequential programs: in [lower, upper]; ``x`` attains ``lower``."""

    lower: float
    upper: float
    x: list[float] | None
    seconds: float
    queries: int


def _val(q: Fraction | float, sort: Any) -> Any:
    return z3.FPVal(float(q), sort)


def _cast(a: Any, fmt: str, c_sort: Any) -> Any:
    """The inference cast of a C value to fp8 (scale none), back in C exactly."""
    if fmt == "fp8_e5m2":
        q = z3.fpToFP(RNE, a, z3.FPSort(5, 3))
        back = z3.fpToFP(RNE, q, c_sort)
        top = _val(57344.0, c_sort)
        return z3.If(z3.fpIsInf(q), z3.If(z3.fpIsPositive(a), top, z3.fpNeg(top)), back)
    if fmt == "fp8_e4m3":
        small = z3.fpLT(z3.fpAbs(a), _val(2.0**-6, c_sort))
        sub = z3.fpMul(RNE, z3.fpRoundToIntegral(RNE, z3.fpMul(RNE, a, _val(2.0**9, c_sort))),
                       _val(2.0**-9, c_sort))
        norm = z3.fpToFP(RNE, z3.fpToFP(RNE, a, z3.FPSort(5, 4)), c_sort)
        q = z3.If(small, sub, norm)
        top = _val(448.0, c_sort)
        big = z3.Or(z3.fpGT(z3.fpAbs(q), top), z3.fpIsInf(q))
        return z3.If(big, z3.If(z3.fpIsPositive(a), top, z3.fpNeg(top)), q)
    raise NotEncodable(f"bit-precise mode casts to fp8_e4m3 or fp8_e5m2, not {fmt}")


def _sort_of(spec: KernelSpec) -> Any:
    if spec.compute.name != spec.accumulate.name or spec.compute.name not in ("fp16", "bf16"):
        raise NotEncodable(f"kernel {spec.name!r}: bit-precise mode needs compute = accumulate = "
                           f"fp16 or bf16, not {spec.compute.name} / {spec.accumulate.name}")
    for role, cs in (("weights", spec.weights), ("activations", spec.activations)):
        if cs is not None and cs.scale != "none":
            raise NotEncodable(f"kernel {spec.name!r}: bit-precise mode needs {role} scale none")
    return z3.FPSort(*SORTS[spec.compute.name])


def _forward(p: Problem, k: int, x: list[Any], sort: Any) -> list[Any]:
    spec = p.specs[k]
    vals: dict[str, list[Any]] = {p.input: x}
    zero = _val(0.0, sort)
    for st in p.steps:
        a = vals[st.inputs[0]]
        if st.op == "relu":
            vals[st.output] = [z3.If(z3.fpLT(v, zero), zero, v) for v in a]
        elif st.op == "pass":
            vals[st.output] = a
        elif st.op == "linear":
            vals[st.output] = _linear(spec, st, k, a, sort)
        else:
            raise NotEncodable(f"bit-precise mode: {st.node.op_type} is not encoded")
    return [v for o in p.outputs for v in vals[o]]


def _linear(spec: KernelSpec, st: Step, k: int, a: list[Any], sort: Any) -> list[Any]:
    W = st.weights[k]
    if spec.activations is not None:
        a = [_cast(v, spec.activations.format.name, sort) for v in a]
    out = []
    for j in range(len(W[0])):
        for i in range(len(W)):
            if round_rational(W[i][j], spec.compute) != W[i][j]:
                raise NotEncodable("bit-precise mode: a weight constant is not a compute value")
        acc = z3.fpMul(RNE, a[0], _val(W[0][j], sort))
        for i in range(1, len(W)):
            acc = z3.fpFMA(RNE, a[i], _val(W[i][j], sort), acc)
        if st.bias is not None:
            c = st.bias[j]
            if round_rational(c, spec.compute) != c:
                raise NotEncodable(f"bit-precise mode: bias {float(c)!r} is not a "
                                   f"{spec.compute.name} value")
            acc = z3.fpAdd(RNE, acc, _val(c, sort))
        out.append(acc)
    return out


def _as_float(model: z3.ModelRef, t: Any) -> float:
    bits = model.eval(z3.fpToIEEEBV(t), model_completion=True).as_long()
    return struct.unpack("<d", struct.pack("<Q", bits))[0]


def bitprecise_max(graph: Graph, train: KernelSpec, inf: KernelSpec, x0: Any, eps: float,
                   upper: float, lower: float = 0.0, timeout_s: float = 60.0,
                   rel_tol: float = 1e-3, max_queries: int = 24) -> BitMax:
    """The max L-inf drift of the two sequential programs over the box (module doc), by
    bisection in [lower, upper]: ``upper`` must bound it (max_drift of the error model covers
    these programs); ``lower`` (a drift some input attains, e.g. from sampled realizations) is
    queried first, so one unsat answer settles the maximum exactly. Each query is a fresh
    solver: z3's incremental mode (push/pop) gives up the bit-blasting tactic and stalls."""
    t0 = time.perf_counter()
    p = prepare(graph, train, inf, x0, eps)
    sorts = [_sort_of(train), _sort_of(inf)]
    if sorts[0] != sorts[1]:
        raise NotEncodable("bit-precise mode needs one compute format for both kernels")
    sort = sorts[0]
    xs = [z3.FP(f"x{i}", sort) for i in range(len(p.x0))]
    box = []
    for i, xi in enumerate(xs):
        lo, hi = p.x0[i] - p.eps, p.x0[i] + p.eps
        for b in (lo, hi):
            if round_rational(b, train.compute) != b:
                raise NotEncodable("bit-precise mode: the box corners must be compute-format values")
        box += [z3.fpGEQ(xi, _val(lo, sort)), z3.fpLEQ(xi, _val(hi, sort))]
    t_out = _forward(p, 0, xs, sort)
    i_out = _forward(p, 1, xs, sort)
    drift = [z3.fpSub(RNE, z3.fpToFP(RNE, b, F64), z3.fpToFP(RNE, a, F64)) for a, b in zip(t_out, i_out)]
    lo_b, hi_b, x_best, queries = float(lower), float(upper), None, 0
    first = lo_b > 0
    while queries < max_queries and (first or hi_b - lo_b > rel_tol * hi_b):
        left = timeout_s - (time.perf_counter() - t0)
        if left <= 0:
            break
        tau = lo_b if first else (lo_b + hi_b) / 2
        first = False
        s = z3.Solver()
        s.set("timeout", max(1, int(left * 1000)))
        s.add(*box)
        s.add(z3.Or([z3.fpGT(z3.fpAbs(d), z3.FPVal(tau, F64)) for d in drift]))
        res = s.check()
        queries += 1
        if res == z3.sat:
            m = s.model()
            lo_b = max(abs(_as_float(m, d)) for d in drift)
            x_best = [_as_float(m, z3.fpToFP(RNE, xi, F64)) for xi in xs]
        elif res == z3.unsat:
            hi_b = tau
        else:
            break
    return BitMax(lo_b, hi_b, x_best, time.perf_counter() - t0, queries)


def fp_box_model(sizes: tuple[int, ...], seed: int, fmt: str = "fp16") -> Graph:
    """A random Gemm/Relu net whose weights and biases are ``fmt`` values (bit-precise inputs)."""
    import numpy as np
    from onnx import numpy_helper

    from kcverify.kernels.formats import get_format
    from kcverify.models.ir import from_onnx
    from kcverify.smt.testing import random_mlp_model

    model = random_mlp_model(sizes, seed)
    f = get_format(fmt)
    for init in model.graph.initializer:
        arr = numpy_helper.to_array(init).astype(np.float64)
        q = np.vectorize(lambda v: float(round_rational(fr(float(v)), f)))(arr).astype(np.float32)
        init.CopyFrom(numpy_helper.from_array(q, init.name))
    return from_onnx(model, name=f"fp-mlp{sizes}-{seed}")


def box_values(lo: float, hi: float, fmt: str) -> list[float]:
    """Every ``fmt`` value in [lo, hi] (fp16 / bf16), in order."""
    import ml_dtypes
    import numpy as np

    dt = np.dtype(np.float16) if fmt == "fp16" else np.dtype(ml_dtypes.bfloat16)
    with np.errstate(invalid="ignore"):
        bits = np.arange(1 << 16, dtype=np.uint16).view(dt).astype(np.float32).astype(np.float64)
    v = np.unique(bits[np.isfinite(bits)])
    return [float(t) for t in v[(v >= lo) & (v <= hi)]]


def enumerated_max(graph: Graph, train: KernelSpec, inf: KernelSpec, x0: Any, eps: float,
                   limit: int = 200_000) -> tuple[float, list[float]]:
    """The max L-inf drift of the two sequential round-to-nearest realizations over every
    compute-format input in the box (the same programs as bitprecise_max), by running them."""
    import itertools

    import numpy as np

    from kcverify.kernels.realize import run_kernel

    x = np.asarray(x0, dtype=np.float64).reshape(-1)
    grids = [box_values(v - eps, v + eps, train.compute.name) for v in x]
    if int(np.prod([len(g) for g in grids])) > limit:
        raise NotEncodable(f"the box holds more than {limit} compute-format inputs")
    X = np.array(list(itertools.product(*grids)), dtype=np.float32)
    name, out = graph.inputs[0].name, graph.outputs[0].name
    yt = run_kernel(graph, train, {name: X}, order="sequential")[out].numpy()
    yi = run_kernel(graph, inf, {name: X}, order="sequential")[out].numpy()
    d = np.abs(yi - yt).reshape(len(X), -1).max(axis=1)
    k = int(np.argmax(d))
    return float(d[k]), [float(v) for v in X[k]]
