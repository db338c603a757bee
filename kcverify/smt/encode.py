"""Both kernels of a small block in z3 linear real arithmetic, every rounding error a variable.

    prob = prepare(graph, train, inf, x0, eps=0.0)      # the plan: constants, intervals
    enc = encode(prob)                                  # z3 constraints, drift expressions

The block is a chain of Gemm / MatMul (activations on the left, constant weights on the right),
Add / Sub / Mul (by a constant, or of two tensors), Relu and data-movement no-ops, on one float
input of shape (batch, n); one sample of the batch is encoded. For each kernel k (train, inf) the
encoding states, as linear constraints over real variables (semantics §1.1 and kcverify.kernels.spec):

* input x: the sample (point) or a real x with |x - x0| <= eps (shared by both kernels), stored
  in the compute format: exact for a point, else x + e with |e| <= u_c|x| + eta_c;
* weights: the exact constants Q_k(W) (kcverify.kernels.scale.quantize_weight, or the compute
  format's rounding), as rationals;
* activation casts: Q(a) = a + e with |e| <= f(u|a| + eta*s) and |e| <= f*s*step(max|a/s|)/2
  (f = 1 to nearest, 2 for ``rounding: any``), Q(a) in [Q(lo), Q(hi)] (monotone cast, nearest,
  point scale), Q(a) = 0 where a = 0; the scale s is the exact float32 scale where the interval
  bounds pin it to one value, else bounded by the largest one the intervals allow;
* accumulation: acc = sum Q(a_i)Q(W_ij) + e, |e| <= gamma_n * sum |Q(W_ij)| |Q(a_i)|;
* rounding to the compute format: |e| <= ((1+u)^2 - 1)|v| + (2+u)eta after a matmul (rescale and
  round), |e| <= max(1, ulps)*u|v| + eta after add / mul;
* Relu: identity / zero where the bound engine's interval of that kernel fixes its sign (stable),
  else r with (v >= 0 and r = v) or (v <= 0 and r = 0), the exact disjunction, plus its triangle
  relaxation (implied; it guides the optimiser).

|v| is linear (v or -v) where the interval bounds fix v's sign and the interval's magnitude
otherwise. Every interval comes from the bound engine (kcverify.bounds.engine.run_graph), sound by
its own argument; ``assume_intervals`` also adds the engine's value intervals of intermediate
tensors and outputs as constraints (sound facts: they only cut assignments no conforming program
reaches; the engine's *drift* intervals are never assumed, so the encoding's drift is its own).
Soundness: every conforming pair of programs, run on an input of the set, gives an assignment of
the variables that satisfies every constraint, so a property of all assignments holds for all
conforming programs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np
import torch
import z3

from kcverify.errors import KcverifyError, KernelSpecError
from kcverify.kernels.cast import round_to_format
from kcverify.kernels.formats import Format, get_format
from kcverify.kernels.scale import quantize_weight
from kcverify.kernels.spec import KernelSpec
from kcverify.models.ir import Graph, Node
from kcverify.smt.exact import floor_log2, fr, grid_step, round_rational, scale_from_amax

KERNELS = ("train", "inf")
PASS_THROUGH = frozenset({"Identity", "Flatten", "Dropout"})
SUPPORTED = frozenset({"Gemm", "MatMul", "Relu", "Add", "Sub", "Mul"}) | PASS_THROUGH
FP32 = get_format("fp32")
MAX_SCALES = 4096  # float32 scales enumerated for a dynamic scale the intervals leave open


class NotEncodable(KcverifyError):
    """The block has an op, shape or scaling the SMT encoding does not model."""


@dataclass
class CastPlan:
    """One kernel's activation cast of one MatMul operand (None in Step.cast: no cast)."""

    fmt: Format
    factor: int  # 1: round to nearest; 2: any neighbour
    s_hi: Fraction  # largest scale the intervals allow (the scale itself when ``point``)
    point: bool  # the scale is one known value
    scheme: str  # none | static | dynamic_per_tensor | dynamic_per_token
    scales: list[Fraction] = field(default_factory=list)  # every scale possible (empty: unknown)
    s_lo: Fraction | None = None  # smallest scale the intervals allow (None: unknown)


@dataclass
class Step:
    """One node: op kind, tensors, and per-kernel constants."""

    node: Node
    op: str  # linear | relu | addc | subc | rsubc | mulc | add | sub | pass
    inputs: list[str]
    output: str
    weights: list[list[list[Fraction]]] = field(default_factory=list)  # per kernel, K x N
    bias: list[Fraction] | None = None
    const: list[Fraction] | None = None
    cast: list[CastPlan | None] = field(default_factory=list)


@dataclass
class Problem:
    """A block prepared for encoding: its steps, the sample, the region and the intervals."""

    graph: Graph
    specs: tuple[KernelSpec, KernelSpec]
    input: str
    x0: list[Fraction]
    eps: Fraction
    steps: list[Step]
    outputs: list[str]
    # tensor -> kernel index -> (lo, hi) float64 arrays of the sample (flattened), sound
    iv: dict[str, tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]]
    drift: dict[str, tuple[np.ndarray, np.ndarray]]

    @property
    def point(self) -> bool:
        return self.eps == 0

    def size(self, name: str) -> int:
        return int(self.iv[name][0][0].size)

    def neurons(self) -> int:
        return sum(self.size(s.output) for s in self.steps if s.op == "linear")

    def unstable_relus(self) -> int:
        """ReLUs whose sign the intervals leave open, in either kernel (both count)."""
        n = 0
        for s in self.steps:
            if s.op == "relu":
                for k in range(2):
                    lo, hi = self.iv[s.inputs[0]][k]
                    n += int(np.sum((lo < 0) & (hi > 0)))
        return n


# --- preparing ----------------------------------------------------------------------------------
def _intervals(graph: Graph, train: KernelSpec, inf: KernelSpec, name: str, x: np.ndarray,
               eps: float) -> tuple[dict, dict]:
    from kcverify.bounds.box import Box, pad_hi, pad_lo
    from kcverify.bounds.engine import check_rules, input_box, load_rules, run_graph

    load_rules()
    check_rules(graph, "interval", set())
    t = torch.as_tensor(np.asarray(x, dtype=np.float64)[None])
    lo, hi = (t, t) if eps == 0 else (pad_lo(t - eps), pad_hi(t + eps))
    state = {name: input_box(train, inf, lo, hi)}
    names = {o for n in graph.nodes for o in n.outputs if o}
    from kcverify.models.blocks import sample_axes

    # one sample is encoded: its per-sample scales are the operands' (batch of one)
    boxes = run_graph(graph, train, inf, state, "interval", "cpu", keep=names,
                      axes=sample_axes(graph), batch=1)
    boxes[name] = state[name]
    iv, drift = {}, {}
    for k, b in boxes.items():
        if isinstance(b, Box):
            a = [p.detach().cpu().numpy().reshape(-1) for p in b.parts()]
            iv[k] = ((a[0], a[1]), (a[2], a[3]))
            drift[k] = (a[4], a[5])
    return iv, drift


def _weight_consts(spec: KernelSpec, w: np.ndarray, where: str) -> list[list[Fraction]]:
    """Q(W) exactly as a realization casts the right operand W (K, N) of a MatMul."""
    t = torch.as_tensor(np.asarray(w, dtype=np.float64))
    if spec.weights is None:
        q = round_to_format(t, spec.compute)
    else:
        if spec.weights.kind.blocked:
            raise NotEncodable(f"{where}: {spec.weights.scale} weight scales are not encoded "
                               "(partial sums are promoted per block); use per_channel or per_tensor")
        q, _ = quantize_weight(t, spec.weights, out_axis=-1, reduce_axis=-2)
    arr = q.numpy()
    return [[fr(v) for v in row] for row in arr]


def _cast_plan(spec: KernelSpec, lo: np.ndarray, hi: np.ndarray, where: str) -> CastPlan | None:
    cs = spec.activations
    if cs is None:
        return None
    if cs.ftz or cs.saturate is False:
        raise NotEncodable(f"{where}: flush-to-zero and non-saturating casts are not encoded")
    factor = 1 if spec.rounding == "nearest" else 2
    fmt = cs.format
    if not (np.all(np.isfinite(lo)) and np.all(np.isfinite(hi))):
        raise NotEncodable(f"{where}: the activation cast's operand interval is not finite "
                           "(its scale has no bounded encoding)")
    mag = float(np.max(np.maximum(np.abs(lo), np.abs(hi)))) if lo.size else 0.0
    if cs.scale in ("none", "static"):
        s = Fraction(1) if cs.scale == "none" else fr(float(np.float32(cs.value)))
        if fr(mag) / s > fr(fmt.max_finite):
            raise NotEncodable(f"{where}: the activation cast to {fmt.name} may overflow "
                               f"(|a| up to {mag:.4g}, scale {float(s):.4g})")
        return CastPlan(fmt, factor, s, True, cs.scale, [s])
    try:  # the scale kind says whether it has an encoding (kcverify.kernels.scales)
        scheme = cs.kind.smt_scheme()
    except KernelSpecError as e:
        raise NotEncodable(f"{where}: {e.message}") from None
    if scheme != "dynamic":
        raise NotEncodable(f"{where}: {cs.scale} activation scales are not encoded")
    mig = np.where((lo <= 0) & (hi >= 0), 0.0, np.minimum(np.abs(lo), np.abs(hi)))
    a_lo, a_hi = fr(float(np.max(mig))), fr(mag)
    s_lo, s_hi = scale_from_amax(a_lo, fmt, FP32), scale_from_amax(a_hi, fmt, FP32)
    if a_lo == 0:  # all zero gives s = 1, but then every cast is exact: s_hi serves the rest
        return CastPlan(fmt, factor, s_hi, a_hi == 0, cs.scale, [s_hi] if a_hi == 0 else [])
    scales = [s_lo]
    f = np.float32(float(s_lo))
    while fr(float(f)) < s_hi and len(scales) <= MAX_SCALES:
        f = np.nextafter(f, np.float32(np.inf))
        scales.append(fr(float(f)))
    if len(scales) > MAX_SCALES:
        scales = []
    return CastPlan(fmt, factor, s_hi, s_lo == s_hi, cs.scale, scales, s_lo)


def _const_vector(graph: Graph, name: str, n: int, where: str) -> list[Fraction]:
    arr = np.asarray(graph.initializers[name], dtype=np.float64)
    try:
        b = np.broadcast_to(arr.reshape(-1) if arr.ndim <= 1 else arr.reshape(arr.shape[-1]), (n,))
    except ValueError:
        raise NotEncodable(f"{where}: constant {name!r} of shape {arr.shape} does not broadcast "
                           f"along a row of {n}") from None
    return [fr(v) for v in b]


def prepare(graph: Graph, train: KernelSpec, inf: KernelSpec, x0: Any, eps: float = 0.0,
            sample: int = 0) -> Problem:
    """Plan the encoding of ``graph`` on one sample (x0: array (batch, n) or (n,), or a feeds
    mapping) with the L-inf region of radius eps; NotEncodable when the block is outside it."""
    if len(graph.inputs) != 1:
        raise NotEncodable(f"the SMT encoding takes a block with one input, not {len(graph.inputs)}")
    name = graph.inputs[0].name
    if isinstance(x0, dict):
        x0 = x0[name]
    x = np.asarray(x0, dtype=np.float64)
    if x.ndim == 2:
        x = x[sample]
    if x.ndim != 1:
        raise NotEncodable(f"input {name!r}: the SMT encoding takes (batch, n) inputs, not rank {x.ndim + 1}")
    for spec in (train, inf):
        if spec.onnx is not None:
            raise NotEncodable(f"kernel {spec.name!r} is a second ONNX graph ({spec.onnx}): the SMT "
                               "encoding does not handle QDQ graphs (docs/qdq.md); the bound "
                               "engine's joint graph decides them")
    iv, drift = _intervals(graph, train, inf, name, x, eps)
    consts = graph.constant_names()
    steps: list[Step] = []
    unsupported = sorted({n.op_type for n in graph.nodes if n.op_type not in SUPPORTED})
    if unsupported:
        raise NotEncodable(f"ops outside the SMT encoding: {', '.join(unsupported)}; "
                           f"supported: {', '.join(sorted(SUPPORTED))}")
    for n in graph.nodes:
        where = f"{n.op_type} node {n.name!r}"
        ins = [i for i in n.inputs if i]
        out = n.outputs[0]
        if out not in iv:
            raise NotEncodable(f"{where}: its output has no interval (a constant computation?)")
        if n.op_type in ("Gemm", "MatMul"):
            a, b = ins[0], ins[1]
            if a in consts or b not in graph.initializers:
                raise NotEncodable(f"{where}: only activations @ constant weights are encoded")
            if n.op_type == "Gemm":
                if int(n.attrs.get("transA", 0)) or float(n.attrs.get("alpha", 1.0)) != 1.0 \
                        or float(n.attrs.get("beta", 1.0)) != 1.0:
                    raise NotEncodable(f"{where}: transA, alpha or beta != 1 are not encoded")
            w = np.asarray(graph.initializers[b], dtype=np.float64)
            if w.ndim != 2:
                raise NotEncodable(f"{where}: weight of rank {w.ndim}; expected a matrix")
            if n.op_type == "Gemm" and int(n.attrs.get("transB", 0)):
                w = w.T
            if w.shape[0] != len(iv[a][0][0]):
                raise NotEncodable(f"{where}: inner dimensions differ")
            st = Step(n, "linear", [a], out)
            st.weights = [_weight_consts(spec, w, where) for spec in (train, inf)]
            st.cast = [_cast_plan(spec, *iv[a][k], where) for k, spec in enumerate((train, inf))]
            if n.op_type == "Gemm" and len(ins) > 2:
                if ins[2] not in graph.initializers:
                    raise NotEncodable(f"{where}: a non-constant bias is not encoded")
                st.bias = _const_vector(graph, ins[2], w.shape[1], where)
            steps.append(st)
        elif n.op_type == "Relu":
            for k in range(2):  # relu >= 0, and exactly 0 where stable inactive
                (_, hi_i), (lo, hi) = iv[ins[0]][k], iv[out][k]
                iv[out] = tuple((np.maximum(lo, 0.0), np.where(hi_i <= 0, 0.0, np.maximum(hi, 0.0)))
                                if kk == k else iv[out][kk] for kk in range(2))
            steps.append(Step(n, "relu", [ins[0]], out))
        elif n.op_type in PASS_THROUGH:
            if len(iv[ins[0]][0][0]) != len(iv[out][0][0]):
                raise NotEncodable(f"{where}: changes the size")
            steps.append(Step(n, "pass", [ins[0]], out))
        else:  # Add, Sub, Mul
            size = len(iv[out][0][0])
            c_idx = [k for k, i in enumerate(ins) if i in graph.initializers]
            if len(c_idx) == 1:
                other = ins[1 - c_idx[0]]
                if len(iv[other][0][0]) != size:
                    raise NotEncodable(f"{where}: broadcasting the variable operand is not encoded")
                c = _const_vector(graph, ins[c_idx[0]], size, where)
                op = {"Add": "addc", "Mul": "mulc"}.get(n.op_type) or ("subc" if c_idx[0] == 1 else "rsubc")
                st = Step(n, op, [other], out)
                st.const = c
            elif not c_idx and n.op_type in ("Add", "Sub"):
                if any(len(iv[i][0][0]) != size for i in ins):
                    raise NotEncodable(f"{where}: broadcasting is not encoded")
                st = Step(n, n.op_type.lower(), list(ins), out)
            else:
                raise NotEncodable(f"{where}: only products by constants are encoded")
            steps.append(st)
    outs = [v.name for v in graph.outputs]
    for o in outs:
        if o not in iv:
            raise NotEncodable(f"output {o!r} has no interval")
    return Problem(graph, (train, inf), name, [fr(v) for v in x], fr(eps), steps, outs, iv, drift)


# --- shared error-bound arithmetic (the encoding and the replay use the same numbers) ------------
def gamma_exact(n: int, u: Fraction) -> Fraction:
    """gamma_n = n u / (1 - n u), exactly."""
    nu = n * u
    if nu >= 1:
        raise NotEncodable(f"gamma_{n} is undefined for u = {float(u)} (n*u >= 1)")
    return nu / (1 - nu)


def round_coeffs(fmt: Format, steps: int, ulps: float = 1.0) -> tuple[Fraction, Fraction]:
    """(rel, abs): |fl(v) - v| <= rel|v| + abs for ``steps`` roundings of ulps*u each."""
    u = fr(fmt.u) * fr(max(1.0, ulps))
    eta = fr(fmt.eta)
    rel = (1 + u) ** steps - 1
    absb = steps * eta * (1 + u) ** max(0, steps - 1)
    return rel, absb


def mag_of(lo: float, hi: float) -> Fraction:
    return max(abs(fr(lo)), abs(fr(hi)))


def cast_image(lo: float, hi: float, cp: CastPlan) -> tuple[Fraction, Fraction] | None:
    """Hull over the possible scales s of [Q_s(lo), Q_s(hi)] (each nearest cast is monotone):
    by enumeration of the float32 scales, or, for a range [s_lo, s_hi] of scales, Q_s(a) = s g
    with g = rne(a / s) in [rne(min a/s), rne(max a/s)], an interval product. None: unknown."""
    if cp.scales:
        los = [round_rational(fr(lo) / s, cp.fmt) * s for s in cp.scales]
        his = [round_rational(fr(hi) / s, cp.fmt) * s for s in cp.scales]
        return min(los), max(his)
    if cp.s_lo is None or cp.s_lo <= 0:
        return None
    ss = (cp.s_lo, cp.s_hi)
    q = [fr(lo) / s for s in ss] + [fr(hi) / s for s in ss]
    g_lo, g_hi = round_rational(min(q), cp.fmt), round_rational(max(q), cp.fmt)
    c = [g * s for g in (g_lo, g_hi) for s in ss]
    return min(c), max(c)


def cast_halfstep(m: Fraction, cp: CastPlan) -> Fraction:
    """Largest |Q(a) - a| over |a| <= m: factor * s * step(m / s) / 2 (beyond max: saturation
    error, within the same step for dynamic scales)."""
    s = cp.s_hi
    top = min(m / s, fr(cp.fmt.max_finite))
    return cp.factor * s * grid_step(top, cp.fmt) / 2


def sign_of(lo: float, hi: float) -> int:
    """+1 / -1 where [lo, hi] fixes the sign (0 counts as either), else 0."""
    if lo >= 0:
        return 1
    if hi <= 0:
        return -1
    return 0


# --- the z3 encoding -----------------------------------------------------------------------------
TINY = Fraction(1, 2**80)


def up(q: Fraction, bits: int = 24) -> Fraction:
    """q rounded up to a ``bits``-bit dyadic, and to at least 2^-80 when positive: looser bound
    constants with short numerators and denominators keep the simplex's rationals small."""
    if q <= 0:
        return -down(-q, bits) if q < 0 else q
    step = Fraction(2) ** (floor_log2(q) - bits)
    return max(TINY, math.ceil(q / step) * step)


def down(q: Fraction, bits: int = 24) -> Fraction:
    """q rounded down to a ``bits``-bit dyadic (0 when 0 < q < 2^-80)."""
    if q <= 0:
        return -up(-q, bits) if q < 0 else q
    if q < TINY:
        return Fraction(0)
    step = Fraction(2) ** (floor_log2(q) - bits)
    return math.floor(q / step) * step


def rv(q: Fraction | int) -> z3.ArithRef:
    q = Fraction(q)
    return z3.RealVal(f"{q.numerator}/{q.denominator}")


@dataclass
class Encoding:
    """z3 constraints of both kernels on the block, and the output drift expressions."""

    problem: Problem
    constraints: list[Any]
    x: list[Any]  # input variables (or constants)
    values: dict[str, list[list[Any]]]  # tensor -> kernel -> entries
    errors: dict[str, Any]  # name -> z3 Real
    drift: list[Any]  # flattened over the block's outputs
    drift_names: list[str]
    relus: int = 0
    unstable: int = 0


class _Enc:
    def __init__(self, p: Problem, assume_intervals: bool) -> None:
        self.p = p
        self.assume = assume_intervals
        self.cons: list[Any] = []
        self.errors: dict[str, Any] = {}
        self.unstable = 0
        self.relus = 0

    def err(self, name: str, bound: Any) -> Any:
        e = z3.Real(name)
        self.errors[name] = e
        self.cons += [e <= bound, -bound <= e]
        return e

    def absval(self, v: Any, lo: float, hi: float) -> Any:
        sg = sign_of(lo, hi)
        if sg > 0:
            return v
        if sg < 0:
            return -v
        return rv(up(mag_of(lo, hi)))

    def rounded(self, name: str, v: Any, absv: Any, rel: Fraction, absb: Fraction) -> Any:
        return v + self.err(name, rv(up(rel)) * absv + rv(up(absb)))


def _store_input(e: _Enc, k: int, x: list[Any]) -> list[Any]:
    p = e.p
    spec = p.specs[k]
    if p.point:
        return [rv(round_rational(v, spec.compute)) for v in p.x0]
    rel, absb = round_coeffs(spec.compute, 1)
    out = []
    for i, xi in enumerate(x):
        lo, hi = float(p.x0[i] - p.eps), float(p.x0[i] + p.eps)
        out.append(e.rounded(f"{KERNELS[k]}:input:{i}", xi, e.absval(xi, lo, hi), rel, absb))
    return out


def _cast(e: _Enc, k: int, st: Step, a: list[Any]) -> tuple[list[Any], list[Any]]:
    """(Q(a), |Q(a)|) per entry of one kernel's operand."""
    lo_a, hi_a = e.p.iv[st.inputs[0]][k]
    cp = st.cast[k]
    tag = f"{KERNELS[k]}:{st.node.name}:cast"
    if cp is None:
        return a, [e.absval(a[i], lo_a[i], hi_a[i]) for i in range(len(a))]
    u, eta = fr(cp.fmt.u), fr(cp.fmt.eta)
    q_out, q_abs = [], []
    for i, ai in enumerate(a):
        lo, hi = float(lo_a[i]), float(hi_a[i])
        m = mag_of(lo, hi)
        sg = sign_of(lo, hi)
        if lo == 0 and hi == 0:
            q_out.append(rv(0))
            q_abs.append(rv(0))
            continue
        half = cast_halfstep(m, cp)
        rel_b = rv(cp.factor * u) * e.absval(ai, lo, hi) + rv(up(cp.factor * eta * cp.s_hi))
        ei = z3.Real(f"{tag}:{i}")
        e.errors[f"{tag}:{i}"] = ei
        e.cons += [ei <= rel_b, -rel_b <= ei, ei <= rv(half), -rv(half) <= ei]
        qi = ai + ei
        img = cast_image(lo, hi, cp) if cp.factor == 1 else None
        if img is not None:
            e.cons += [rv(img[0]) <= qi, qi <= rv(img[1])]
        if sg > 0:
            e.cons.append(qi >= 0)
        elif sg < 0:
            e.cons.append(qi <= 0)
        q_out.append(qi)
        q_abs.append(qi if sg > 0 else (-qi if sg < 0 else rv(up(m + half))))
    return q_out, q_abs


def _linear(e: _Enc, k: int, st: Step, a: list[Any]) -> list[Any]:
    p = e.p
    spec = p.specs[k]
    W = st.weights[k]
    n_in, n_out = len(W), len(W[0])
    qa, qabs = _cast(e, k, st, a)
    if spec.accumulation.mma is not None:  # any order covers pinned schedules, not tensor cores
        raise NotEncodable(f"{st.node.name}: the {spec.accumulation.mma} accumulator is not encoded")
    gam = up(gamma_exact(n_in, fr(spec.accumulate.u)))
    rel2, abs2 = round_coeffs(spec.compute, 2)
    rel1, abs1 = round_coeffs(spec.compute, 1, spec.ulp("add"))
    lo_o, hi_o = p.iv[st.output][k]
    mags = _operand_mags(p, k, st)
    tag = f"{KERNELS[k]}:{st.node.name}"
    out = []
    for j in range(n_out):
        col = [(W[i][j], i) for i in range(n_in) if W[i][j] != 0]
        dot = z3.Sum([rv(w) * qa[i] for w, i in col]) if col else rv(0)
        sabs = z3.Sum([rv(abs(w)) * qabs[i] for w, i in col]) if col else rv(0)
        acc = dot + e.err(f"{tag}:acc:{j}", rv(gam) * sabs)
        m_acc = up((1 + gam) * sum((abs(w) * mags[i] for w, i in col), Fraction(0)))
        if st.bias is None:
            sg = sign_of(lo_o[j], hi_o[j])  # fl is monotone: acc has the sign of its rounding
            absacc = acc if sg > 0 else (-acc if sg < 0 else rv(m_acc))
            y = e.rounded(f"{tag}:round:{j}", acc, absacc, rel2, abs2)
            out.append(y)
            continue
        # the pre-rounding values from the output interval: |v| <= (|out| + abs1) / (1 - rel1)
        # for v = y + c; y = v' - c with |v' - v| <= eb; |acc| <= (|y| + abs2) / (1 - rel2)
        m_out = mag_of(lo_o[j], hi_o[j])
        m_v = min(m_acc * (1 + rel2) + abs2 + abs(st.bias[j]), (m_out + abs1) / (1 - rel1))
        eb = rel1 * m_v + abs1
        y_lo, y_hi = fr(lo_o[j]) - eb - st.bias[j], fr(hi_o[j]) + eb - st.bias[j]
        if y_lo > 0:
            absacc = acc
        elif y_hi < 0:
            absacc = -acc
        else:
            absacc = rv(up(min(m_acc, (max(abs(y_lo), abs(y_hi)) + abs2) / (1 - rel2))))
        y = e.rounded(f"{tag}:round:{j}", acc, absacc, rel2, abs2)
        v = y + rv(st.bias[j])
        absv = v if lo_o[j] > 0 else (-v if hi_o[j] < 0 else rv(up(m_v)))
        out.append(e.rounded(f"{tag}:bias:{j}", v, absv, rel1, abs1))
    return out


def _operand_mags(p: Problem, k: int, st: Step) -> list[Fraction]:
    """Upper bounds on |Q(a_i)| (the cast operand) from the interval of a."""
    lo_a, hi_a = p.iv[st.inputs[0]][k]
    cp = st.cast[k]
    out = []
    for i in range(len(lo_a)):
        m = mag_of(lo_a[i], hi_a[i])
        out.append(m if cp is None else m + cast_halfstep(m, cp))
    return out


def _elementwise(e: _Enc, k: int, st: Step, args: list[list[Any]]) -> list[Any]:
    p = e.p
    spec = p.specs[k]
    prim = "mul" if st.op == "mulc" else "add"
    rel, absb = round_coeffs(spec.compute, 1, spec.ulp(prim))
    lo_o, hi_o = p.iv[st.output][k]
    tag = f"{KERNELS[k]}:{st.node.name}:{prim}"
    mags = [[mag_of(lo, hi) for lo, hi in zip(*p.iv[name][k])] for name in st.inputs]
    out = []
    for j in range(len(args[0])):
        a = args[0][j]
        if st.op in ("addc", "subc", "rsubc", "mulc"):
            c = st.const[j]
            w = {"addc": a + rv(c), "subc": a - rv(c), "rsubc": rv(c) - a, "mulc": rv(c) * a}[st.op]
            m = mags[0][j] * abs(c) if st.op == "mulc" else mags[0][j] + abs(c)
        else:
            b = args[1][j]
            w = a + b if st.op == "add" else a - b
            m = mags[0][j] + mags[1][j]
        absw = w if lo_o[j] > 0 else (-w if hi_o[j] < 0 else rv(up(m)))
        out.append(e.rounded(f"{tag}:{j}", w, absw, rel, absb))
    return out


def encode(p: Problem, assume_intervals: bool = True) -> Encoding:
    """The z3 encoding of problem ``p`` (see the module doc)."""
    e = _Enc(p, assume_intervals)
    if p.point:
        x = [rv(v) for v in p.x0]
    else:
        x = [z3.Real(f"x:{i}") for i in range(len(p.x0))]
        for i, xi in enumerate(x):
            e.cons += [rv(p.x0[i] - p.eps) <= xi, xi <= rv(p.x0[i] + p.eps)]
    values: dict[str, list[list[Any]]] = {p.input: [_store_input(e, k, x) for k in range(2)]}
    for st in p.steps:
        vals = []
        for k in range(2):
            args = [values[i][k] for i in st.inputs]
            if st.op == "linear":
                v = _linear(e, k, st, args[0])
            elif st.op == "relu":
                lo, hi = p.iv[st.inputs[0]][k]
                v = []
                for j, a in enumerate(args[0]):
                    e.relus += 1
                    if lo[j] >= 0:
                        v.append(a)
                    elif hi[j] <= 0:
                        v.append(rv(0))
                    else:
                        e.unstable += 1
                        r = z3.Real(f"{KERNELS[k]}:{st.node.name}:relu:{j}")
                        H, L = up(fr(hi[j])), down(fr(lo[j]))  # the chord over [L, H] ⊇ [lo, hi]
                        e.cons += [r >= 0, r >= a, r <= rv(H / (H - L)) * (a - rv(L)),
                                   z3.Or(z3.And(a >= 0, r == a), z3.And(a <= 0, r == 0))]
                        v.append(r)
            elif st.op == "pass":
                v = list(args[0])
            else:
                v = _elementwise(e, k, st, args)
            vals.append(v)
        values[st.output] = vals
        if assume_intervals:
            for k in range(2):
                lo, hi = p.iv[st.output][k]
                for j, vj in enumerate(vals[k]):
                    if math.isfinite(lo[j]):
                        e.cons.append(rv(down(fr(lo[j]), 12)) <= vj)
                    if math.isfinite(hi[j]):
                        e.cons.append(vj <= rv(up(fr(hi[j]), 12)))
    drift, names = [], []
    for o in p.outputs:
        t, i = values[o]
        for j in range(len(t)):
            drift.append(i[j] - t[j])
            names.append(f"{o}[{j}]")
    return Encoding(p, e.cons, x, values, e.errors, drift, names, e.relus, e.unstable)
