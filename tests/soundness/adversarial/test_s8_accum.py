"""Session 8: the accumulation and cast enclosures of fp8 MatMuls, attacked end to end.

The claims (docs/bounds.md, "Dot products of format values (the grid path)", "Casts"): a row of
fp8 x fp8 products added in an fp32 (bf16, fp16) accumulator in *any* order is within the
grain bound F(L) of its exact sum (exact when every grain is >= 2^L and M < 2^(L+p)); the
result is rescaled by the scales and rounded to the compute format (two roundings). Attacked:

* ``limit_column``: rows whose sum of |products| sits at 2^(L+p) - g, exactly, + g (g the
  least grain: exact in every order, the first value past the limit, one product more), with
  both signs (P and N each near the limit, a small exact sum), mixed magnitudes (only the
  fine products can round);
* ``ExtremeProgram``: per output element, the largest (or least) result over a set of
  summation trees evaluated here in exact arithmetic (sorted, reversed, positives first,
  alternating, pairwise, every split of the sorted row into two sequential halves, greedy
  directed trees, random orders) - a conforming program (every dot product in its own order);
* scales at the ends of their range: amax a power of two times 448 (s exact), amax at the
  fp32 subnormals (the floor decides), a weight column all zero (per-channel scale from the
  floor), a static activation scale and small weights whose scale product is subnormal (F1,
  fixed in 893fbd3);
* casts whose inputs sit at e4m3 midpoints +- 1 fp32 ulp under a non-power-of-two scale
  (the exact and the fp32 quotient round apart: ``quotient`` exact / fp32 / mixed);

on MatMul, Gemm (alpha, bias) and attention-score graphs built with onnx.helper, against
the engine's interval, linear and best domains, per element (train, inf, drift), with
onnxruntime as one training program. The harness fixes of this session (programs.Program
casts constant weights with the exact quotient; test_s6_fp8.TieProgram's all-fp32 baseline)
have their own tests here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from onnx import helper

from kcverify.bounds import certify_drift
from tests.soundness.adversarial.arith import next_down, next_up, ordered_sum, rnd, two_prod
from tests.soundness.adversarial.harness import (
    SESSION,
    TRAIN,
    Ledger,
    Runtime,
    attack,
    chain_model,
    graph_of,
    node_model,
    ratio_text,
    spec,
)
from tests.soundness.adversarial.programs import Program

# every positive e4m3 value: subnormals m 2^-9 (m = 1..7), normals m 2^(e-3) (m = 8..15)
E4M3 = np.array(sorted({m * 2.0**-9 for m in range(1, 8)}
                       | {m * 2.0 ** (e - 3) for m in range(8, 16) for e in range(-6, 9)
                          if m * 2.0 ** (e - 3) <= 448}))


def grain(x: np.ndarray) -> np.ndarray:
    """The largest power of two dividing x (inf for 0), float64, written from the definition."""
    x = np.abs(np.asarray(x, np.float64))
    m, e = np.frexp(x)  # x = m 2^e, m in [0.5, 1): 53-bit integer mantissa
    mi = (m * 2.0**53).astype(np.int64)
    tz = np.zeros(x.shape, np.int64)
    v = mi.copy()
    for _ in range(54):
        even = (v != 0) & (v % 2 == 0)
        tz += even
        v = np.where(even, v // 2, v)
    g = np.ldexp(1.0, (e - 53 + tz).astype(np.int64))
    return np.where(x == 0, np.inf, g)


# --- summation trees, evaluated here --------------------------------------------------------
def _seq(t: np.ndarray, p: int) -> float:
    s = t[0]
    for v in t[1:]:
        s = _rn(s + v, p)
    return float(s)


def _rn(x: float, p: int) -> float:
    """x (an exact float64 sum) rounded to nearest-even with p significant bits (no range
    limits: the rows here stay far from over- and underflow of the formats used)."""
    if x == 0 or not np.isfinite(x):
        return x
    m, e = np.frexp(x)
    sc = np.ldexp(m, p)  # |sc| in [2^(p-1), 2^p)
    return float(np.ldexp(np.rint(sc), int(e) - p))  # rint: half to even


def _pairwise(t: np.ndarray, p: int) -> float:
    t = list(t)
    while len(t) > 1:
        t = [_rn(t[i] + t[i + 1], p) if i + 1 < len(t) else t[i] for i in range(0, len(t), 2)]
    return float(t[0])


def tree_results(row: np.ndarray, p: int, rng: np.random.Generator, n_random: int = 24
                 ) -> np.ndarray:
    """Results of many summation trees of ``row`` (exact products) in a p-bit accumulator:
    the orders above, every split of the |.|-descending row into two sequential halves (each
    half ascending or descending), the greedy directed trees (arith), random orders."""
    row = np.asarray(row, np.float64)
    row = row[row != 0]  # a zero term adds exactly wherever it goes
    n = row.size
    if n <= 1:
        return np.array([row.sum()])
    a = np.abs(row)
    desc = row[np.argsort(-a, kind="stable")]
    asc = desc[::-1]
    pos = np.concatenate([np.sort(row[row >= 0])[::-1], np.sort(row[row < 0])[::-1]])
    neg = np.concatenate([np.sort(row[row < 0]), np.sort(row[row >= 0])])
    out = [_seq(t, p) for t in (row, row[::-1], desc, asc, pos, neg)]
    out += [_pairwise(t, p) for t in (row, desc, asc, pos)]
    for k in range(1, n):  # split at every point: big ones and small ones summed apart
        for left, right in ((desc[:k], desc[k:]), (desc[:k], desc[k:][::-1]),
                            (pos[:k], pos[k:]), (neg[:k], neg[k:])):
            out.append(_rn(_seq(left, p) + _seq(right, p), p))
            out.append(_seq(np.concatenate([right, [_seq(left, p)]]), p))
    fmt = {24: "fp32", 8: "bf16", 11: "fp16"}.get(p)
    if fmt is not None:
        for o in ("tree_up", "tree_down", "greedy_up", "greedy_down"):
            out.append(float(ordered_sum(row[None], fmt, o)[0]))
    for _ in range(n_random):
        t = row[rng.permutation(n)]
        out.append(_seq(t, p) if rng.random() < 0.5 else _pairwise(t, p))
    return np.array(out)


@dataclass(frozen=True)
class ExtremeProgram(Program):
    """A Program whose every dot product (default accumulation family, exact products) takes,
    per output element, the largest (``pick="max"``) or least (``"min"``) result of
    ``tree_results``, or either at random per element (``"rand"``, by ``seed``): each element in
    its own summation tree, which the spec allows."""

    pick: str = "max"

    def _sum(self, pa, pb, rng):
        if not self.spec.accumulation.is_default:
            return Program._sum(self, pa, pb, rng)
        pa, pb = np.broadcast_arrays(np.asarray(pa, np.float64), np.asarray(pb, np.float64))
        prod, err = two_prod(pa, pb)
        if np.any(err) or self.A.name not in ("fp32", "bf16", "fp16"):
            return Program._sum(self, pa, pb, rng)
        p = {"fp32": 24, "bf16": 8, "fp16": 11}[self.A.name]
        if float(np.abs(prod).sum(-1).max(initial=0.0)) * 1.01 >= self.A.max:
            return Program._sum(self, pa, pb, rng)  # a partial sum may overflow: IEEE's own
        flat = prod.reshape(-1, prod.shape[-1])
        r = np.random.default_rng([self.seed, 8])
        res = [tree_results(row, p, r) for row in flat]
        up = (r.random(len(res)) < 0.5 if self.pick == "rand"
              else np.full(len(res), self.pick == "max"))
        val = [v.max() if u else v.min() for v, u in zip(res, up)]
        return np.array(val).reshape(prod.shape[:-1])


# --- rows at the exactness limit ------------------------------------------------------------
def _product_table() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every positive product of two e4m3 values: (sorted unique values, one factor pair)."""
    pa, pb = np.meshgrid(E4M3, E4M3, indexing="ij")
    v = (pa * pb).reshape(-1)
    vals, idx = np.unique(v, return_index=True)
    return vals, pa.reshape(-1)[idx], pb.reshape(-1)[idx]


PROD_VALS, PROD_A, PROD_B = _product_table()
PROD_GRAIN = grain(PROD_VALS)


def decompose(r: float, min_grain: float, rng: np.random.Generator, slots: int
              ) -> list[tuple[float, float]] | None:
    """r as a sum of at most ``slots`` e4m3 x e4m3 products of grain >= min_grain (greedy,
    the largest fitting product or at random one of the three largest): factor pairs."""
    ok = PROD_GRAIN >= min_grain
    vals, fa, fb = PROD_VALS[ok], PROD_A[ok], PROD_B[ok]
    out = []
    while r > 0 and len(out) < slots:
        i = int(np.searchsorted(vals, r, side="right")) - 1
        if i < 0:
            return None
        i = max(0, i - int(rng.integers(0, 3))) if len(out) < slots - 3 else i
        out.append((float(fa[i]), float(fb[i])))
        r -= float(vals[i])
    return out if r == 0 else None


WHERE = {"below": -1, "at": 0, "above": 1, "above-prod": None}


def limit_column(L: int, p: int, where: str, rng: np.random.Generator, signed: bool,
                 slots: int) -> list[tuple[float, float]] | None:
    """Factor pairs (a_k, b_k) of one row: n_f fine products c g (c odd, g = 2^L: the only
    grain-g terms), the rest products of grain >= 2g, with sum of |.| (``signed``: the
    positive sum P; the negatives N = P - 1..3 g) = 2^(L+p) + d, d = -g / 0 / +g / + a fine
    product (``where``)."""
    g = 2.0**L
    T = 2.0 ** (L + p)
    n_f = int(rng.integers(1, 5))
    cs = [int(c) for c in rng.choice([1, 3, 5, 7], size=n_f)]
    d = g * (WHERE[where] if WHERE[where] is not None else cs[0])
    if (n_f + (d / g)) % 2:  # T + d - sum c g must be a multiple of 2g
        cs.append(1)
    fine = []
    for c in cs:  # c g = (c 2^-3) (2^(L+3)): two e4m3 factors when L + 3 in range
        a, b = c * 2.0**-3, 2.0 ** (L + 3)
        if not (np.isin(a, E4M3) and np.isin(b, E4M3)):
            a, b = float(c), g
        if not (np.isin(a, E4M3) and np.isin(b, E4M3)):
            return None
        fine.append((a, b))
    sign_f = [float(rng.choice([-1.0, 1.0])) if signed else 1.0 for _ in fine]
    pos_fine = sum(a * b for (a, b), sg in zip(fine, sign_f) if sg > 0)
    big = decompose(T + d - pos_fine, 2 * g, rng, slots - len(fine))
    if big is None:
        return None
    row = [(a, b * sg) for (a, b), sg in zip(fine, sign_f)] + big
    if signed:  # N = P - k g, k in 1..3 (odd k: the exact sum has grain g)
        P = T + d
        neg_fine = sum(a * b for (a, b), sg in zip(fine, sign_f) if sg < 0)
        k = int(rng.integers(1, 4))
        rest = P - k * g - neg_fine
        neg = decompose(rest, g, rng, slots) if rest > 0 else []
        if neg is None:
            return None
        row += [(a, -b) for a, b in neg]
    return row


def limit_case(p: int, where: str, seed: int, N: int = 4, signed: bool = False,
               slots: int = 12) -> tuple[np.ndarray, np.ndarray]:
    """(qa (K,), qb (K, N)): N independent rows at the limit (``limit_column``), each on its
    own slots (qb zero elsewhere), L drawn so that 2^(L+p) is within 4 products of 448^2."""
    rng = np.random.default_rng([seed, p, len(where), int(signed)])
    rows = []
    for _ in range(400):
        L = int(rng.integers(-9, -3)) if p == 24 else int(rng.integers(2, 10))
        r = limit_column(L, p, where, rng, signed, slots)
        if r is not None:
            rows.append(r)
        if len(rows) == N:
            break
    assert len(rows) == N, "no row at the limit found"
    K = sum(len(r) for r in rows)
    qa, qb = np.zeros(K), np.zeros((K, N))
    k = 0
    for n, r in enumerate(rows):
        for a, b in r:
            qa[k], qb[k, n] = a, b
            k += 1
    return qa, qb


def mm_spec(acc: str = "fp32", compute: str = "fp32", act: dict | None = None,
            w: dict | None = None):
    return spec(weights=w or {"format": "fp8_e4m3", "scale": "per_channel"},
                activations=act or {"format": "fp8_e4m3", "scale": "dynamic_per_tensor"},
                accumulate=acc, compute=compute)


def programs_for(sp, seed: int) -> list[tuple[Program, Program]]:
    """Training / inference pairs: extreme trees crossed, plus rescale and quotient choices."""
    out = []
    for k, (pt, pi) in enumerate((("max", "min"), ("min", "max"))):
        for rescale in ("one", "two", "exact"):
            out.append((ExtremeProgram(TRAIN, pick=pt, seed=seed + k, label=f"train/{pt}"),
                        ExtremeProgram(sp, pick=pi, rescale=rescale, seed=seed + k,
                                       quotient="fp32" if rescale == "two" else "exact",
                                       label=f"inf/{pi}/{rescale}")))
    out.append((Program(TRAIN, order="rev"), ExtremeProgram(sp, pick="max", quotient="mixed",
                                                            seed=seed, label="inf/max/mixed")))
    return out


def ort_runtime(model) -> Runtime:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])

    def fn(feeds):
        names = [o.name for o in model.graph.output]
        res = sess.run(None, {k: np.asarray(v, np.float32) for k, v in feeds.items()})
        return {n: np.asarray(r, np.float64) for n, r in zip(names, res)}
    return Runtime("onnxruntime", fn)


def cached(model, feeds: dict, prs: list) -> list[tuple[Runtime, Runtime]]:
    """The pairs' programs run once (every domain's boxes are checked against the same
    values): each as a Runtime returning its outputs."""
    from tests.soundness.adversarial.interp import ProgramRunner

    run = ProgramRunner(model)
    memo: dict[int, Runtime] = {}

    def one(p) -> Runtime:
        if id(p) not in memo:
            with np.errstate(all="ignore"):
                out = p(feeds) if isinstance(p, Runtime) else run(p, feeds)
            memo[id(p)] = Runtime(str(p), lambda _f, out=out: out)
        return memo[id(p)]
    return [(one(a), one(b)) for a, b in prs]


def run_mm(led: Ledger, cls: str, model, sp, feeds: dict, seed: int,
           domains=("interval", "linear", "best"), ort: bool = True) -> list[str]:
    found: list[str] = []
    g = graph_of(model)
    prs = programs_for(sp, seed)
    if ort:
        prs.append((ort_runtime(model), ExtremeProgram(sp, pick="min", seed=seed,
                                                      label="inf/min")))
    prs = cached(model, feeds, prs)
    for dom in domains:
        with np.errstate(all="ignore"):
            boxes = certify_drift(g, TRAIN, sp, feeds, domain=dom).outputs
        found += attack(led, f"{cls}/{dom}", model, TRAIN, sp, feeds, prs, outputs=boxes,
                        graph=g)
    return found


def matmul_limit(p: int, where: str, seed: int, signed: bool, s_exp: int = 0):
    acc = {24: "fp32", 8: "bf16", 11: "fp16"}[p]
    qa, qb = limit_case(p, where, seed, signed=signed)
    K, N = qb.shape
    # x: qa then an amax entry 448 (s_a = 2^s_exp exactly), against a zero weight row;
    # W: qb with a row of 448 against a zero x entry (per-channel s_b = 1), and a zero column
    x = np.concatenate([qa, [448.0, 0.0]]) * 2.0**s_exp
    W = np.zeros((K + 2, N + 1))
    W[:K, :N] = qb
    W[K + 1, :N] = 448.0
    model = node_model("MatMul", [("x", (1, K + 2)), ("W", W.astype(np.float32))])
    sp = mm_spec(acc=acc)
    return model, sp, {"x": x[None].astype(np.float32)}, (qa, qb)


LIMITS = [(p, w, s) for p in (24, 8) for w in ("below", "at", "above", "above-prod")
          for s in (False, True)]


def test_limit_rows_are_where_they_claim() -> None:
    """The constructed rows sit where the name says: the independent grain / limit figures
    (and an exact-in-every-order row really is exact in every tree tried here)."""
    for p, where, signed in LIMITS:
        qa, qb = limit_case(p, where, 1, signed=signed)
        prods = qa[:, None] * qb
        for n in range(qb.shape[1]):
            r = prods[:, n]
            g = grain(r[r != 0]).min()
            M = max(r[r > 0].sum(), -r[r < 0].sum())
            lim = 2.0 ** (np.log2(g) + p)
            if where == "below":
                assert M < lim
                res = tree_results(r, p, np.random.default_rng(0))
                assert np.all(res == r.sum()), (p, where, n)
            if where in ("above", "above-prod"):
                assert M > lim


@pytest.mark.parametrize("p,where,signed", [(24, "above", False), (8, "above", True),
                                            (8, "below", False)])
def test_limit_rows_fast(p: int, where: str, signed: bool) -> None:
    led = Ledger()
    model, sp, feeds, _ = matmul_limit(p, where, 1, signed)
    found = run_mm(led, f"s8/accum/limit-{p}-{where}-{'pn' if signed else 'p'}", model, sp,
                   feeds, 1, domains=("interval", "best"))
    SESSION.merge(led)
    assert not found, "\n".join(found[:3])


def test_extreme_trees_reach_the_bound() -> None:
    """A row past the limit whose rounding the extreme trees do reach (the attack is not
    vacuous): bf16 accumulator, the 'above' rows: some program differs from the exact sum."""
    model, sp, feeds, (qa, qb) = matmul_limit(8, "above", 1, False)
    prods = qa[:, None] * qb
    moved = 0
    for n in range(qb.shape[1]):
        res = tree_results(prods[:, n], 8, np.random.default_rng(0))
        moved += int(np.any(res != prods[:, n].sum()))
    assert moved >= 1


@pytest.mark.campaign
@pytest.mark.parametrize("p,where,signed", LIMITS)
def test_limit_rows_campaign(p: int, where: str, signed: bool) -> None:
    led = Ledger()
    found = []
    for seed in range(1, 5):
        for s_exp in (0, -20, 20):
            model, sp, feeds, _ = matmul_limit(p, where, seed, signed, s_exp)
            found += run_mm(led, f"s8/accum/limit-{p}-{where}-{'pn' if signed else 'p'}", model,
                            sp, feeds, seed, ort=s_exp == 0)
    SESSION.merge(led)
    print(led.report())
    assert not found, "\n".join(found[:3])


# --- scales at the ends of their range ------------------------------------------------------
def scale_case(kind: str, seed: int, K: int = 8, N: int = 4):
    """(model, spec, feeds) for one scale corner: ``pow2`` amax = 448 2^-20 (s exact),
    ``subnormal`` x in the fp32 subnormals (amax below the floor: s from the floor),
    ``floor`` amax just above / at the floor, ``sat`` amax 448-boundary quotients (values
    just under amax whose fp32 quotient rounds up to 448), ``zero-col`` a weight column all
    zero and one with a subnormal amax, ``mid`` e4m3 midpoints +- 1 fp32 ulp under s =
    fl32(1.7 / 448)."""
    rng = np.random.default_rng([seed, len(kind)])
    W = (rnd(rng.normal(size=(K, N)), "fp8_e4m3") * 0.5)
    sp = mm_spec()
    if kind == "pow2":
        x = rng.choice(E4M3, size=(1, K)) * rng.choice([-1.0, 1.0], size=(1, K))
        x[0, 0] = 448.0
        x = x * 2.0**-20
    elif kind == "subnormal":
        x = rng.uniform(-1, 1, size=(1, K)) * 1e-39
    elif kind == "floor":
        fl = float(rnd(1e-12, "fp32"))
        x = rng.uniform(-1, 1, size=(1, K)) * fl
        x[0, 0] = fl if seed % 2 else float(next_up(np.array(fl), "fp32"))
    elif kind == "sat":
        amax = 1.7
        x = rng.uniform(-1, 1, size=(1, K)) * amax
        x[0, 0] = amax
        x[0, 1:3] = float(next_down(np.array(amax), "fp32"))
        x[0, 3] = -amax * 432 / 448
    elif kind == "zero-col":
        x = rng.normal(size=(1, K))
        W[:, 0] = 0.0
        W[:, 1] = rng.uniform(-1, 1, size=K) * 1e-40
    elif kind == "mid":
        s = float(rnd(1.7 / 448, "fp32"))
        mids = (E4M3[:-1] + E4M3[1:]) / 2
        v = rnd(mids[rng.integers(0, 90, size=(1, K))] * s, "fp32")
        nudge = rng.integers(-1, 2, size=v.shape)
        v = np.where(nudge > 0, next_up(v, "fp32"), np.where(nudge < 0, next_down(v, "fp32"),
                                                              v))
        x = v * rng.choice([-1.0, 1.0], size=v.shape)
        x[0, 0] = 1.7
    else:
        raise ValueError(kind)
    model = node_model("MatMul", [("x", (1, K)), ("W", W.astype(np.float32))])
    return model, sp, {"x": rnd(x, "fp32").astype(np.float32)}


SCALE_KINDS = ("pow2", "subnormal", "floor", "sat", "zero-col", "mid")


@pytest.mark.parametrize("kind", SCALE_KINDS)
def test_scale_corners_fast(kind: str) -> None:
    led = Ledger()
    model, sp, feeds = scale_case(kind, 1)
    found = run_mm(led, f"s8/scale/{kind}", model, sp, feeds, 1, domains=("interval", "best"),
                   ort=False)
    SESSION.merge(led)
    assert not found, "\n".join(found[:3])


@pytest.mark.campaign
@pytest.mark.parametrize("kind", SCALE_KINDS)
def test_scale_corners_campaign(kind: str) -> None:
    led = Ledger()
    found = []
    for seed in range(1, 7):
        model, sp, feeds = scale_case(kind, seed)
        found += run_mm(led, f"s8/scale/{kind}", model, sp, feeds, seed)
    SESSION.merge(led)
    print(led.report())
    assert not found, "\n".join(found[:3])


# --- Gemm and attention scores --------------------------------------------------------------
def gemm_case(seed: int, where: str = "above", p: int = 24):
    """Gemm(x, W, C, alpha) with the limit rows of ``limit_case``; alpha 0.75 and 2^-3."""
    rng = np.random.default_rng([seed, 5])
    qa, qb = limit_case(p, where, seed)
    K, N = qb.shape
    x = np.concatenate([qa, [448.0, 0.0]])[None]
    W = np.zeros((K + 2, N))
    W[:K] = qb
    W[K + 1] = 448.0
    C = rnd(rng.normal(size=(N,)) * 100, "fp32")
    alpha = float(rng.choice([0.75, 2.0**-3]))
    model = node_model("Gemm", [("x", (1, K + 2)), ("W", W.astype(np.float32)),
                                ("C", C.astype(np.float32))], {"alpha": alpha})
    acc = {24: "fp32", 8: "bf16", 11: "fp16"}[p]
    return model, mm_spec(acc=acc), {"x": x.astype(np.float32)}


def scores_case(seed: int, p: int = 24, T: int = 4):
    """S = q k^T with q = xa Wq and k = xb Wk both cast (two activation operands: the grid
    path on activation x activation), then softmax: q rows of designed values."""
    rng = np.random.default_rng([seed, 9])
    qa, qb = limit_case(p, "above", seed, N=T)
    K = qa.size
    # q (1, 1, K) = qa, k (1, T, K) = qb^T: Identity weights keep them (W = I, per-channel s = 1
    # needs column amax 448: use W = 448 I and inputs / 448)
    Wi = (np.eye(K) * 448.0).astype(np.float32)
    xa = (qa / 448.0)[None, None]
    xb = (qb.T / 448.0)[None]
    nodes = [helper.make_node("MatMul", ["xa", "Wi"], ["q"], name="mq"),
             helper.make_node("MatMul", ["xb", "Wi"], ["k"], name="mk"),
             helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["q", "kt"], ["s"], name="qk"),
             helper.make_node("Mul", ["s", "c"], ["s1"]),
             helper.make_node("Softmax", ["s1"], ["pr"], axis=-1)]
    c = np.array(2.0**-12, np.float32)
    model = chain_model(nodes, [("xa", (1, 1, K)), ("xb", (1, T, K)), ("Wi", Wi), ("c", c)],
                        ["s", "pr"], opset=17)
    del rng
    return model, mm_spec(acc={24: "fp32", 8: "bf16"}[p]), {
        "xa": rnd(xa, "fp32").astype(np.float32), "xb": rnd(xb, "fp32").astype(np.float32)}


def test_gemm_and_scores_fast() -> None:
    led = Ledger()
    found = []
    model, sp, feeds = gemm_case(1)
    found += run_mm(led, "s8/accum/gemm", model, sp, feeds, 1, domains=("interval", "best"))
    model, sp, feeds = scores_case(1, p=8)
    found += run_mm(led, "s8/accum/scores", model, sp, feeds, 1, domains=("interval", "best"),
                    ort=False)
    SESSION.merge(led)
    assert not found, "\n".join(found[:3])


@pytest.mark.campaign
def test_gemm_and_scores_campaign() -> None:
    led = Ledger()
    found = []
    for seed in range(1, 6):
        for p in (24, 8):
            for where in ("below", "above", "above-prod"):
                model, sp, feeds = gemm_case(seed, where, p)
                found += run_mm(led, f"s8/accum/gemm-{p}", model, sp, feeds, seed)
            model, sp, feeds = scores_case(seed, p)
            found += run_mm(led, f"s8/accum/scores-{p}", model, sp, feeds, seed, ort=False)
    SESSION.merge(led)
    print(led.report())
    assert not found, "\n".join(found[:3])


# --- F1: a subnormal scale product ----------------------------------------------------------
def f1_case(kind: str):
    """K = 1: x = 448 s_a, W = one weight of amax w. ``static``: activation scale 1e-30 and
    s_b = 2^-36; ``dynamic``: amax_floor 1e-30 on both, x = W = fl32(448 1.3 2^-70). fl32(s_a
    s_b) is subnormal: fl32(acc fl32(s_a s_b)) is off by ~1e-4 relative."""
    if kind == "static":
        act = {"format": "fp8_e4m3", "scale": "static", "value": 1e-30}
        w = {"format": "fp8_e4m3", "scale": "per_channel"}
        x = np.array([[448.0 * float(rnd(1e-30, "fp32"))]])
        W = np.array([[448.0 * 2.0**-36]])
    else:
        act = {"format": "fp8_e4m3", "scale": "dynamic_per_tensor", "amax_floor": 1e-30}
        w = {"format": "fp8_e4m3", "scale": "per_channel", "amax_floor": 1e-30}
        v = float(rnd(448 * 1.3 * 2.0**-70, "fp32"))
        x = np.array([[v]])
        W = np.array([[v]])
    sp = mm_spec(act=act, w=w)
    model = node_model("MatMul", [("x", (1, 1)), ("W", W.astype(np.float32))])
    return model, sp, {"x": rnd(x, "fp32").astype(np.float32)}


@pytest.mark.parametrize("kind", ["static", "dynamic"])
@pytest.mark.parametrize("domain", ["interval", "best"])
def test_f1_subnormal_scale_product(kind: str, domain: str) -> None:
    """F1 s8, fixed in 893fbd3 (rules/linear.rescale_error): 131x / 642x outside before."""
    model, sp, feeds = f1_case(kind)
    boxes = certify_drift(graph_of(model), TRAIN, sp, feeds, domain=domain).outputs
    led = Ledger()
    found = attack(led, "s8/F1", model, TRAIN, sp, feeds,
                   [(Program(TRAIN), Program(sp, rescale=r, label=f"rescale {r}"))
                    for r in ("one", "two", "exact")], outputs=boxes)
    assert not found, "\n".join(found[:2]) + "\n" + ratio_text(led["s8/F1"])


# --- the harness fixes of this session ------------------------------------------------------
def test_program_casts_weights_with_the_exact_quotient() -> None:
    """programs.Program casts a constant operand as kernels.scale.quantize_weight does (the
    exact quotient, nearest-even) whatever its quotient / cast_rounding; a weight whose fp32
    quotient rounds the other way (a tie) used to give a non-conforming program."""
    import torch

    from kcverify.kernels.scale import quantize_weight

    sp = mm_spec()
    s = float(rnd(1.7 / 448, "fp32"))
    col = [1.7]
    mids = (E4M3[:-1] + E4M3[1:]) / 2
    for m in mids[20:120]:
        v = rnd(m * s, "fp32")
        for c in (next_down(v, "fp32"), v, next_up(v, "fp32")):
            e = c / s
            f = rnd(e, "fp32")
            if rnd(e, "fp8_e4m3") != rnd(f, "fp8_e4m3"):
                col.append(float(c))
    assert len(col) > 3, "no tie found"
    W = np.array(col)[:, None]
    ref, _ = quantize_weight(torch.tensor(W), sp.weights, out_axis=-1)
    for prog in (Program(sp, quotient="fp32"), Program(sp, quotient="mixed", seed=3),
                 Program(sp, cast_rounding="up", quotient="fp32")):
        q, sb, _ = prog.operand(W, True, "right")
        assert np.array_equal(q * sb, ref.numpy()), prog


def test_tie_search_fp32_baseline_runs() -> None:
    """test_s6_fp8.TieProgram with _all_true() masks takes the fp32 quotient everywhere (the
    empty dict subclass used to be falsy: the 'all-fp32' baseline ran all-exact)."""
    from tests.soundness.adversarial import test_s6_fp8 as s6

    model, sp, feeds = scale_case("mid", 1)
    from tests.soundness.adversarial.interp import ProgramRunner

    run = ProgramRunner(model)
    ya = run(s6.tie_prog(sp, s6._all_true(), "seq", "one"), feeds)["y0"]
    y32 = run(Program(sp, quotient="fp32"), feeds)["y0"]
    ye = run(Program(sp, quotient="exact"), feeds)["y0"]
    assert not np.array_equal(ye, y32), "the case has no tie"
    assert np.array_equal(ya, y32)



# --- other kernels: e5m2, bf16 / fp16 compute and accumulators, per token, static -------------
VARIANTS = {
    "e5m2": mm_spec(w={"format": "fp8_e5m2", "scale": "per_channel"},
                    act={"format": "fp8_e5m2", "scale": "dynamic_per_tensor"}),
    "bf16c": mm_spec(compute="bf16"),
    "fp16acc": mm_spec(acc="fp16", compute="fp16"),
    "bf16acc": mm_spec(acc="bf16", compute="bf16"),
    "w8only-bf16": spec(weights={"format": "fp8_e4m3", "scale": "per_channel"},
                        accumulate="fp32", compute="bf16"),
    "token": mm_spec(act={"format": "fp8_e4m3", "scale": "dynamic_per_token"}),
    "static": mm_spec(w={"format": "fp8_e4m3", "scale": "per_tensor"},
                      act={"format": "fp8_e4m3", "scale": "static", "value": 0.0037}),
}


def variant_case(name: str, seed: int, kind: str):
    """x (2, 12) @ W (12, 5): ``normal``, ``mid`` (e4m3 / e5m2 midpoints +- 1 fp32 ulp, per
    sample amax 1.3 / 0.07) or ``mixed`` (columns at 1e3, 1, 1e-3: only some products fine)."""
    from tests.soundness.adversarial.attacks import fp8_midpoints

    rng = np.random.default_rng([seed, 77])
    K, N = 12, 5
    W = rnd(rng.normal(size=(K, N)) * 0.3, "fp8_e4m3") * rng.choice([1, 2.0**-5], size=(K, 1))
    fmt = "fp8_e5m2" if name == "e5m2" else "fp8_e4m3"
    if kind == "normal":
        x = rng.normal(size=(2, K))
    elif kind == "mid":
        x = np.stack([fp8_midpoints((K,), fmt, rng, amax=a,
                                    static=0.0037 if name == "static" else None)
                      for a in (1.3, 0.07)])
    else:
        x = rng.normal(size=(2, K)) * rng.choice([1e3, 1, 1e-3], size=(1, K))
    x = rnd(x, "bf16" if "bf16" in name else "fp32").astype(np.float32)
    model = node_model("MatMul", [("x", (2, K)), ("W", W.astype(np.float32))])
    return model, VARIANTS[name], {"x": x}


@pytest.mark.campaign
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variants_campaign(name: str) -> None:
    """3024 pairs at 54c8a88 (F1 fixed): 0 violations, worst obs/cert 1.0."""
    led = Ledger()
    found = []
    for seed in range(1, 4):
        for kind in ("normal", "mid", "mixed"):
            model, sp, feeds = variant_case(name, seed, kind)
            found += run_mm(led, f"s8/variants/{name}/{kind}", model, sp, feeds, seed)
    SESSION.merge(led)
    print(led.report())
    assert not found, "\n".join(found[:3])


# --- regions: L-inf boxes through the grid path ---------------------------------------------
def region_case(p: int, where: str, seed: int, rel: float, n_pts: int = 12):
    """The limit rows' x as the centre of an L-inf box of eps = rel * (median |qa|) / 8 (the
    casts' images span several e4m3 values of different grains); points: corners and random
    (attacks.box_points) and centre moves by 2^-k |x| clipped to the box."""
    from tests.soundness.adversarial.attacks import box_points

    qa, qb = limit_case(p, where, seed)
    K, N = qb.shape
    x0 = np.concatenate([qa, [448.0, 0.0]])[None].astype(np.float32)
    W = np.zeros((K + 2, N))
    W[:K] = qb
    W[K + 1] = 448.0
    model = node_model("MatMul", [("x", (1, K + 2)), ("W", W.astype(np.float32))])
    eps = rel * float(np.median(np.abs(qa[qa != 0]))) / 8
    rng = np.random.default_rng([seed, 5])
    pts = box_points(rng, x0, eps, n_pts)
    for k in range(6):
        step = np.minimum(2.0 ** -(k + 3) * np.abs(x0), eps)
        pts.append(rnd(x0 + rng.choice([-1, 1], size=x0.shape) * step, "fp32"))
    pts = [np.clip(q, x0 - eps, x0 + eps).astype(np.float32) for q in pts]
    return model, mm_spec(acc={24: "fp32", 8: "bf16"}[p]), x0, eps, pts


def region_attack(led: Ledger, p: int, where: str, seed: int, rel: float,
                  domains=("interval", "linear", "best"), n_pts: int = 12) -> list[str]:
    from kcverify.bounds.engine import Region
    from tests.soundness.adversarial.interp import ProgramRunner

    model, sp, x0, eps, pts = region_case(p, where, seed, rel, n_pts)
    run = ProgramRunner(model)
    vals = []
    for q in pts:
        for k, (pt, pi, quo) in enumerate((("min", "max", "exact"), ("max", "min", "fp32"),
                                           ("rand", "rand", "mixed"))):
            with np.errstate(all="ignore"):
                yt = run(ExtremeProgram(TRAIN, pick=pt, seed=seed + k), {"x": q})["y0"]
                yi = run(ExtremeProgram(sp, pick=pi, quotient=quo, seed=seed + k),
                         {"x": q})["y0"]
            vals.append((yt, yi, f"{pt}/{pi}/{quo}"))
    found = []
    g = graph_of(model)
    for dom in domains:
        with np.errstate(all="ignore"):
            box = certify_drift(g, TRAIN, sp, {"x": x0}, domain=dom,
                                region=Region("input", "linf", eps)).outputs["y0"]
        cls = f"s8/region/{p}-{where}/{dom}"
        for yt, yi, lab in vals:
            found += led.check(cls, box, yt, yi, f"{cls} seed {seed} rel {rel} {lab}")
    return found


def test_region_fast() -> None:
    led = Ledger()
    found = region_attack(led, 8, "above", 1, 0.3, domains=("best",), n_pts=3)
    SESSION.merge(led)
    assert not found, "\n".join(found[:3])


@pytest.mark.campaign
@pytest.mark.parametrize("p", [24, 8])
def test_region_campaign(p: int) -> None:
    led = Ledger()
    found = []
    for where in ("below", "above", "above-prod"):
        for seed in (1, 2, 3):
            for rel in (0.02, 0.3, 2.0):
                found += region_attack(led, p, where, seed, rel)
    SESSION.merge(led)
    print(led.report())
    assert not found, "\n".join(found[:3])
