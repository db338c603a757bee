"""The MatMul grid path and its grain enclosure (kcverify/bounds/accumulate.py, rules/linear.py
``grid_accumulation``, the zonotope's ``_matmul_core``), attacked with exact arithmetic.

The claim (docs/bounds.md, "the grid path"): for products p_k whose grains are >= g_k, with L
such that M + F(L) < 2^(L+p) (M = max(P, N), F(L) = sum_k max(0, 2^L - g_k)), *every* summation
tree in a p-bit accumulator has |computed - exact| <= F(L); a row with F(L) = 0 is exact in any
order. Three kinds of attack, from the theorem down to the engine:

* ``reachable``: the *set of every result* of every binary tree over a row (all pairings, memoised
  on the multiset of live values), exactly, in a p-bit format with a bounded exponent range
  (subnormals included: the proof says additions there are exact), p = 3..6 and fp32; the
  worst tree's error against F(L) computed here from the statement and against
  ``grain_error`` / ``dot_error``;
* adversarial trees on longer rows (arith.py ``tree_up`` / ``tree_down``: at every step the pair
  of live values whose rounded sum moves furthest up / down; the greedy orders; sorted; split-K)
  on rows built at the limit: sum |p| = 2^(L+24) +- a few grains, one huge product among many
  tiny ones off the coarse grid, cancelling rows (P ~ N, tiny exact sum);
* the engine on MatMul / Gemm graphs whose casts are pinned (an activation column of max_finite
  against a zero weight row, a weight row of max_finite against a zero activation column: the
  cast values are the rows), fp32 / bf16 / fp16 accumulators, e4m3 / e5m2 / bf16 operands,
  per-block weight scales (the general path), and a bias added in fp32 (Gemm), domains interval
  and best, against programs that sum in those adversarial trees.

Exactness: products of fp8 / bf16 values and their sums over <= 2^10 terms span < 53 bits here,
so float64 holds every exact partial sum; rounding to the accumulator is arith.rnd (exact).
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from kcverify.bounds.accumulate import dot_error, grain_error, grain_lower
from kcverify.kernels.formats import get_format
from tests.soundness.adversarial.arith import FMT, ordered_sum, rnd
from tests.soundness.adversarial.harness import (
    SESSION,
    TRAIN,
    Ledger,
    attack,
    node_model,
    ratio_text,
    spec,
)
from tests.soundness.adversarial.programs import Program

# every positive e4m3 value: subnormals m 2^-9 (m = 1..7), normals m 2^(e-3) (m = 8..15)
E4M3 = np.array(sorted({m * 2.0**-9 for m in range(1, 8)}
                       | {m * 2.0 ** (e - 3) for m in range(8, 16) for e in range(-6, 9)
                          if m * 2.0 ** (e - 3) <= 448}))


# --- exact rounding and the set of every tree's result ---------------------------------------
def rne_q(x: Fraction, p: int, emin: int) -> Fraction:
    """x rounded to nearest-even in a p-bit binary format whose least normal exponent is emin
    (subnormals below; no overflow: the rows stay far below it)."""
    if x == 0:
        return x
    e = math.floor(math.log2(abs(x)))
    while abs(x) >= Fraction(2) ** (e + 1):
        e += 1
    while abs(x) < Fraction(2) ** e:
        e -= 1
    q = Fraction(2) ** (max(e, emin) - p + 1)
    k = x / q
    fl = math.floor(k)
    r = k - fl
    n = fl + 1 if r > Fraction(1, 2) or (r == Fraction(1, 2) and fl % 2 == 1) else fl
    return n * q


def reachable(terms: tuple[Fraction, ...], p: int, emin: int) -> set[Fraction]:
    """Every value some binary summation tree over ``terms`` can compute (each addition rounded
    to nearest-even in the (p, emin) format)."""

    @functools.cache
    def go(live: tuple[Fraction, ...]) -> frozenset[Fraction]:
        if len(live) == 1:
            return frozenset(live)
        out: set[Fraction] = set()
        n = len(live)
        for i in range(n):
            for j in range(i + 1, n):
                rest = live[:i] + live[i + 1:j] + live[j + 1:]
                s = rne_q(live[i] + live[j], p, emin)
                out |= go(tuple(sorted(rest + (s,))))
        return frozenset(out)
    return set(go(tuple(sorted(terms))))


def grain(x: Fraction) -> Fraction:
    """The largest power of two dividing x (x != 0)."""
    g = Fraction(1)
    while (x / g).denominator != 1:
        g /= 2
    while (x / (2 * g)).denominator == 1:
        g *= 2
    return g


def stated_bound(terms: list[Fraction], p: int) -> Fraction | None:
    """min over the L allowed by the statement of F(L) (None: no L qualifies for L0, L0 + 1)."""
    P = sum((t for t in terms if t > 0), Fraction(0))
    N = -sum((t for t in terms if t < 0), Fraction(0))
    M = max(P, N)
    best = None
    if M == 0:
        return Fraction(0)
    l0 = math.floor(math.log2(M)) - p - 1
    for L in range(l0, l0 + 4):
        lev = Fraction(2) ** L
        F = sum((max(Fraction(0), lev - grain(t)) for t in terms if t != 0), Fraction(0))
        if M + F < lev * 2**p:
            best = F if best is None else min(best, F)
    return best


def _small_value(rng: np.random.Generator, bits: int, emin: int, emax: int) -> Fraction:
    """A random value of a (bits, emin) format with exponent <= emax, subnormals included."""
    e = int(rng.integers(emin - 2, emax + 1))
    m = int(rng.integers(1, 2**bits))
    if e >= emin:
        m |= 1 << (bits - 1)  # normal
        v = Fraction(m) * Fraction(2) ** (e - bits + 1)
    else:
        v = Fraction(m % (1 << (bits - 1)) or 1) * Fraction(2) ** (emin - bits + 1)
    return -v if rng.random() < 0.5 else v


@pytest.mark.parametrize("p", [3, 4, 5, 6])
def test_every_tree_within_the_grain_bound(p: int) -> None:
    """Rows of 4-6 products of two small-format values (ba + bb <= p significant bits: exact
    products), the accumulator's exponent range small enough that subnormal additions occur:
    the worst of every tree's error is within F(L) (the statement, in Fractions) and within
    kcverify's grain_error."""
    rng = np.random.default_rng(p)
    emin = -3
    ba = max(1, p // 2)
    bb = p - ba
    worst_ratio, checked = 0.0, 0
    for _ in range(400):
        if checked >= 30:
            break
        n = int(rng.integers(4, 7))
        a = [_small_value(rng, ba, -2, 3) for _ in range(n)]
        b = [_small_value(rng, bb, -2, 2) for _ in range(n)]
        terms = [x * y for x, y in zip(a, b)]
        if any(rne_q(t, p, emin) != t for t in terms):
            continue  # a product not representable in the accumulator: outside the grid path
        exact = sum(terms, Fraction(0))
        err = max(abs(v - exact) for v in reachable(tuple(terms), p, emin))
        bound = stated_bound(terms, p)
        if bound is not None:
            assert err <= bound, (p, terms, err, bound)
        # the engine's arithmetic: grains of a and b as float64 tensors
        ga = torch.tensor([[float(grain(x)) for x in a]], dtype=torch.float64)
        gb = torch.tensor([[float(grain(y))] for y in b], dtype=torch.float64)
        P = sum((t for t in terms if t > 0), Fraction(0))
        N = -sum((t for t in terms if t < 0), Fraction(0))
        m = torch.tensor([[float(max(P, N))]], dtype=torch.float64)
        g_err = float(grain_error(ga, gb, m, p).reshape(-1)[0])
        if math.isfinite(g_err):
            assert Fraction(g_err) >= err, (p, terms, err, g_err)
        if math.isfinite(g_err) and g_err > 0:
            worst_ratio = max(worst_ratio, float(err) / g_err)
        checked += 1
    assert checked >= 20, checked
    st = SESSION["grid/every-tree"]
    st.pairs += checked
    st.worst_drift = max(st.worst_drift, worst_ratio)


def reachable_float(terms: list[float], acc: str) -> set[float]:
    """``reachable`` for an IEEE accumulator (fp32 / bf16 / fp16) on float64 terms whose every
    partial sum is exact in float64 (the rows here): arith.rnd does each rounding."""
    f = FMT[acc]

    @functools.cache
    def go(live: tuple[float, ...]) -> frozenset[float]:
        if len(live) == 1:
            return frozenset(live)
        out: set[float] = set()
        n = len(live)
        for i in range(n):
            for j in range(i + 1, n):
                rest = live[:i] + live[i + 1:j] + live[j + 1:]
                sm = float(rnd(live[i] + live[j], f))
                out |= go(tuple(sorted(rest + (sm,))))
        return frozenset(out)
    return set(go(tuple(sorted(float(t) for t in terms))))


def engine_bound(a: np.ndarray, b: np.ndarray, acc: str, fa: str = "fp8_e4m3",
                 fb: str = "fp8_e4m3") -> float:
    """kcverify's any-order enclosure for one row a . b (dot_error with grains, exact products)."""
    A = torch.from_numpy(np.asarray(a, np.float64)[None, :])
    B = torch.from_numpy(np.asarray(b, np.float64)[:, None])
    ga, gb = grain_lower(A, A, get_format(fa)), grain_lower(B, B, get_format(fb))
    return float(dot_error(A, A, B, B, get_format(acc), True, ga, gb).reshape(-1)[0])


@functools.cache
def e4m3_factor(v: float) -> tuple[float, float] | None:
    """e4m3 values (x, y) with x * y = v exactly, the largest x first; None if v is not an
    e4m3 product."""
    y = E4M3[::-1]
    x = abs(v) / y
    ok = (x <= 448) & (rnd(x, "fp8_e4m3") == x) & (x > 0)
    k = int(np.argmax(ok))
    if not ok[k]:
        return None
    return math.copysign(float(x[k]), v), float(y[k])


def decompose(n: int, g: float) -> list[float]:
    """n * g (n > 0 an integer) as a sum of e4m3 products m 2^j g with m < 16 (4-bit chunks,
    lowest first), each exactly an e4m3 product."""
    out, j = [], 0
    while n:
        m = n & 15
        if m:
            out.append(m * 2.0**j * g)
        n >>= 4
        j += 4
    return out


def limit_terms(acc: str, offset: int, fine: tuple[int, ...]) -> list[float]:
    """Products of e4m3 values whose positive part is 2^(L+p) + offset g with g = 2^L and
    2^(L+p) = 128 (fp32: g = 2^-17, bf16: 2^-1, fp16: 2^-4): the coarse product 120 plus the
    remainder 8 + offset g in 4-bit chunks, and the ``fine`` terms m g / 2 (odd m: grain g / 2 < 2^L,
    so F(L) > 0; a negative m subtracts). offset < 0 and no fine term: M < 2^(L+p) on the
    2^L grid, exact in every order; otherwise at or past the limit."""
    p = FMT[acc].p
    g = 2.0 ** (7 - p)
    terms = [120.0]
    rest = int(round(8.0 / g)) + offset
    assert rest > 0
    terms += decompose(rest, g)
    terms += [m * g / 2 for m in fine]
    assert all(e4m3_factor(t) is not None for t in terms), terms
    return terms


def is_product(v: float) -> bool:
    return e4m3_factor(v) is not None


def _operands(terms: list[float]) -> tuple[np.ndarray, np.ndarray]:
    pairs = [e4m3_factor(t) for t in terms]
    return np.array([x for x, _ in pairs]), np.array([y for _, y in pairs])


LIMIT_CASES = [(acc, off, fine) for acc in ("fp32", "bf16", "fp16")
               for off, fine in ((-3, ()), (-1, ()), (0, ()), (2, ()), (-3, (1,)), (-1, (3, -1)),
                                 (0, (5, -3)), (1, (-7,)), (3, (1, 1)))]


@pytest.mark.parametrize("acc,offset,fine", LIMIT_CASES)
def test_limit_rows_every_tree(acc: str, offset: int, fine: tuple[int, ...]) -> None:
    """Rows at the exactness limit of fp32 / bf16 / fp16 accumulators, +- a few grains, with
    and without fine terms off the 2^L grid: the worst of *every* summation tree (exhaustive)
    is within the engine's enclosure, and a row the statement calls exact (M < 2^(L+p), no
    fine term) is exact in every tree."""
    terms = limit_terms(acc, offset, fine)
    if len(terms) > 8:
        pytest.skip("too many terms for the exhaustive tree set")
    exact = math.fsum(terms)
    outs = reachable_float(terms, acc)
    worst = max(abs(v - exact) for v in outs)
    a, b = _operands(terms)
    bound = engine_bound(a, b, acc)
    st = SESSION["grid/limit-rows-every-tree"]
    st.pairs += len(outs)
    if bound > 0:
        st.worst_drift = max(st.worst_drift, worst / bound)
    assert worst <= bound, (acc, offset, fine, worst, bound, sorted(outs))
    fr = [Fraction(t) for t in terms]
    stated = stated_bound(fr, FMT[acc].p)
    if stated is not None:
        assert Fraction(worst) <= stated, (worst, stated)
    if offset < 0 and not fine:
        assert outs == {exact}, "a row below the limit on the 2^L grid must be exact"


def mixed_row(rng: np.random.Generator, n: int) -> list[float]:
    """One huge product (448 * 448, or 416 * 448) and n - 1 tiny ones off its grid (grains
    2^-18 .. 2^-12), random signs: the huge term absorbs them one by one in some orders."""
    big = float(rng.choice([448.0 * 448.0, 416.0 * 448.0, -448.0 * 448.0]))
    tiny = E4M3[(E4M3 >= 2.0**-9) & (E4M3 <= 2.0**-3)]
    small = [float(rng.choice(tiny) * rng.choice(tiny) * rng.choice([-1.0, 1.0]))
             for _ in range(n - 1)]
    return [big] + small


def cancel_row(rng: np.random.Generator, n: int) -> list[float]:
    """P ~ N: two huge products of opposite signs that cancel to a few coarse grains, and
    fine terms whose sum is the whole answer (sum |p| / |sum| ~ 2^20)."""
    terms = [448.0 * 448.0, -448.0 * 416.0, -448.0 * 32.0]  # exact sum 0
    tiny = E4M3[(E4M3 >= 2.0**-9) & (E4M3 <= 2.0**-2)]
    terms += [float(rng.choice(tiny) * rng.choice(tiny) * rng.choice([-1.0, 1.0]))
              for _ in range(n - 3)]
    return terms


@pytest.mark.parametrize("kind", ["mixed", "cancel"])
@pytest.mark.parametrize("acc", ["fp32", "bf16", "fp16"])
def test_mixed_and_cancelling_rows_every_tree(kind: str, acc: str) -> None:
    """Exhaustive trees on 6-term rows: one huge product among tiny ones off its grid, and
    rows whose huge products cancel exactly (fp16: scaled down to stay below 65504)."""
    rng = np.random.default_rng([len(kind), len(acc)])
    st = SESSION[f"grid/{kind}-every-tree"]
    for _ in range(6):
        terms = mixed_row(rng, 6) if kind == "mixed" else cancel_row(rng, 6)
        if acc == "fp16":  # 448 * 7 = 3136 < 65504: e4m3 products still, the rest dropped
            terms = [t * 2.0**-6 for t in terms if is_product(t * 2.0**-6)]
        exact = math.fsum(terms)
        outs = reachable_float(terms, acc)
        worst = max(abs(v - exact) for v in outs)
        a, b = _operands(terms)
        bound = engine_bound(a, b, acc)
        st.pairs += len(outs)
        if bound > 0:
            st.worst_drift = max(st.worst_drift, worst / bound)
        assert worst <= bound, (acc, terms, worst, bound)


TREE_ORDERS = ("tree_up", "tree_down", "greedy_up", "greedy_down", "asc", "desc", "posneg",
               "alt", "pairwise", "chunk4", "chunk16", "seq", "rev")


def long_rows(rng: np.random.Generator, acc: str, R: int, n: int) -> list[list[float]]:
    """Rows of n terms: limit rows padded with more fine terms, mixed and cancelling rows."""
    rows = []
    for r in range(R):
        kind = r % 3
        if kind == 0:
            fine = tuple(int(m) for m in rng.choice([-7, -5, -3, -1, 1, 3, 5, 7], size=n))
            t = limit_terms(acc, int(rng.integers(-3, 4)), ())
            t += [m * 2.0 ** (7 - FMT[acc].p) / 2 for m in fine[: n - len(t)]]
        elif kind == 1:
            t = mixed_row(rng, n)
        else:
            t = cancel_row(rng, n)
        if acc == "fp16" and kind:
            t = [x * 2.0**-6 for x in t if is_product(x * 2.0**-6)]
        rows.append(t)
    return rows


@pytest.mark.parametrize("acc", ["fp32", "bf16", "fp16"])
def test_adversarial_trees_on_long_rows(acc: str) -> None:
    """32-term rows under greedy pair-merging trees (tree_up / tree_down), the greedy chains,
    sorted, alternating, pairwise and split-K orders: within the engine's enclosure."""
    rng = np.random.default_rng(len(acc))
    st = SESSION[f"grid/long-rows/{acc}"]
    found = []
    for t in long_rows(rng, acc, 12, 32):
        terms = np.array(t)[None, :]
        exact = math.fsum(t)
        a, b = _operands(t)
        bound = engine_bound(a, b, acc)
        for order in TREE_ORDERS:
            v = float(ordered_sum(terms, acc, order, np.random.default_rng(0))[0])
            err = abs(v - exact)
            st.pairs += 1
            if bound > 0:
                st.worst_drift = max(st.worst_drift, err / bound)
            if not err <= bound:
                found.append(f"{acc} {order}: error {err!r} > enclosure {bound!r}")
    st.violations += found
    assert not found, found[:3]


# --- the engine on MatMul / Gemm graphs -------------------------------------------------------
def pinned_matmul(rows: list[list[float]]) -> tuple[np.ndarray, np.ndarray]:
    """(x (R, K + 2), W (K + 2, R)) with x's row r @ W's column r = rows[r] as e4m3 products,
    the last two columns pinning every dynamic / per-channel scale to 1 (module doc)."""
    R = len(rows)
    K = max(len(r) for r in rows)
    x = np.zeros((R, K + 2))
    w = np.zeros((K + 2, R))
    for r, t in enumerate(rows):
        a, b = _operands(t)
        x[r, :len(t)], w[:len(t), r] = a, b
    x[:, K] = 448.0
    w[K + 1, :] = 448.0
    return x.astype(np.float32), w.astype(np.float32)


def _sp(acc: str, acts: str = "dynamic_per_token", weights: dict | None = None):
    compute = "fp32" if acc == "fp32" else acc
    return spec(weights=weights or {"format": "fp8_e4m3", "scale": "per_channel"},
                activations={"format": "fp8_e4m3", "scale": acts}, accumulate=acc,
                compute=compute)


def _engine_attack(cls: str, model, sp, feeds: dict, orders=TREE_ORDERS) -> list[str]:
    led = Ledger()
    found = []
    progs = [(Program(TRAIN, order=o1), Program(sp, order=o2, per_sample="axis0"))
             for o1, o2 in zip(("tree_down", "tree_up", "seq") * 5, orders)]
    for domain in ("interval", "best"):
        found += attack(led, cls, model, TRAIN, sp, feeds, progs, domain=domain)
    SESSION.merge(led)
    return found


@pytest.mark.parametrize("acts", ["dynamic_per_token", "dynamic_per_tensor"])
@pytest.mark.parametrize("acc", ["fp32", "bf16", "fp16"])
def test_engine_on_limit_rows(acc: str, acts: str) -> None:
    """The MatMul rule (interval and best) on pinned rows at the limit, mixed and cancelling,
    against programs summing in adversarial trees."""
    rng = np.random.default_rng([len(acc), len(acts)])
    rows = [limit_terms(acc, off, fine) for off, fine in ((-2, ()), (0, (3, -1)), (2, (1,)))]
    rows += long_rows(rng, acc, 3, 16)
    x, w = pinned_matmul(rows)
    model = node_model("MatMul", [("x", x.shape), ("w", w)])
    found = _engine_attack(f"grid/engine/{acc}", model, _sp(acc, acts), {"x": x})
    assert not found, "\n".join(found[:3])


def test_gemm_bias_in_fp32() -> None:
    """Gemm(x, W, c): the grid path's value set, then the bias added with one rounding (fp32
    compute: torch's addmm epilogue), bias values chosen to cancel the product to a few ulps."""
    rows = [limit_terms("fp32", off, fine) for off, fine in ((-2, ()), (0, (3, -1)), (2, (1,)))]
    x, w = pinned_matmul(rows)
    c = np.array([-128.0, -128.0 - 2.0**-16, 3.0 * 2.0**-18], np.float32)
    from onnx import helper

    from tests.soundness.adversarial.harness import chain_model

    nodes = [helper.make_node("Gemm", ["x", "w", "c"], ["y"])]
    model = chain_model(nodes, [("x", x.shape), ("w", w), ("c", c)], ["y"])
    found = _engine_attack("grid/gemm-bias", model, _sp("fp32"), {"x": x})
    assert not found, "\n".join(found[:3])


@pytest.mark.parametrize("acc", ["fp32", "bf16"])
def test_per_block_weight_scales_off_the_grid(acc: str) -> None:
    """Per-block weight scales (blocks of 4, each its own scale: the grid path does not apply,
    every block's partial sum is rescaled once in the accumulator, then the blocks summed):
    the general enclosure against adversarial trees inside and across the blocks."""
    rng = np.random.default_rng(len(acc) + 11)
    rows = long_rows(rng, acc, 4, 14)
    x, w = pinned_matmul(rows)
    # scale the weight blocks apart (powers of three: no block shares a scale)
    w = w * np.repeat(3.0 ** np.arange(-2, 2), 4)[: w.shape[0], None].astype(np.float32)
    sp = _sp(acc, weights={"format": "fp8_e4m3", "scale": "per_block", "block_size": 4})
    model = node_model("MatMul", [("x", x.shape), ("w", w.astype(np.float32))])
    found = _engine_attack(f"grid/per-block/{acc}", model, sp, {"x": x})
    assert not found, "\n".join(found[:3])


@pytest.mark.parametrize("fmt", ["fp8_e5m2", "int8"])
def test_other_weight_formats(fmt: str) -> None:
    """e5m2 x e5m2 (grid path) and int8 weights x e4m3 activations (the general path) on
    mixed and cancelling rows."""
    rng = np.random.default_rng(len(fmt))
    rows = long_rows(rng, "fp32", 4, 12)
    x, w = pinned_matmul(rows)
    acts = "fp8_e5m2" if fmt == "fp8_e5m2" else "fp8_e4m3"
    sp = spec(weights={"format": fmt, "scale": "per_channel"},
              activations={"format": acts, "scale": "dynamic_per_token"}, accumulate="fp32",
              compute="fp32")
    model = node_model("MatMul", [("x", x.shape), ("w", w)])
    found = _engine_attack(f"grid/{fmt}", model, sp, {"x": x})
    assert not found, "\n".join(found[:3])


def test_limit_rows_are_what_they_say() -> None:
    """The constructions: the offset moves P across 2^(L+p) by that many grains, and past the
    limit with fine terms some tree does round (else the attacks could not fail)."""
    for acc in ("fp32", "bf16", "fp16"):
        p = FMT[acc].p
        g = 2.0 ** (7 - p)
        for off in (-3, 0, 2):
            t = limit_terms(acc, off, ())
            assert math.fsum(x for x in t if x > 0) == 128.0 + off * g
        t = limit_terms(acc, 1, (3, -1))
        outs = reachable_float(t, acc)
        assert len(outs) > 1, (acc, outs)


def test_reachable_matches_a_chain() -> None:
    """reachable() holds what a plain sequential fp32 sum gives (the enumerator is a superset
    of the chains), and is a single value on exact rows."""
    t = [120.0, 7.5, 0.5, 2.0**-18, -3 * 2.0**-18]
    outs = reachable_float(t, "fp32")
    assert float(ordered_sum(np.array([t]), "fp32", "seq")[0]) in outs
    assert float(ordered_sum(np.array([t]), "fp32", "rev")[0]) in outs
    assert reachable_float([1.0, 2.0, 4.0], "fp32") == {7.0}
    assert ratio_text(Ledger()["x"]).startswith("0 pairs")


@pytest.mark.parametrize("acc", ["fp32", "bf16"])
def test_gemm_trans_b(acc: str) -> None:
    """Gemm(x, W^T, transB=1): the weight's per-channel scale and grains taken along the other
    axis; the same pinned limit rows."""
    from onnx import helper

    from tests.soundness.adversarial.harness import chain_model

    rows = [limit_terms(acc, off, fine) for off, fine in ((-2, ()), (0, (3, -1)), (2, (1,)))]
    x, w = pinned_matmul(rows)
    nodes = [helper.make_node("Gemm", ["x", "wt"], ["y"], transB=1)]
    model = chain_model(nodes, [("x", x.shape), ("wt", np.ascontiguousarray(w.T))], ["y"])
    found = _engine_attack(f"grid/gemm-transB/{acc}", model, _sp(acc), {"x": x})
    assert not found, "\n".join(found[:3])
