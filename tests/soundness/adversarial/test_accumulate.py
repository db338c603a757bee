"""Issue 12's fp8-activation enclosures, attacked before and as they land.

Generic evaluators (point them at any MatMul spec):

* ``exactness_rows``: rows of fp8 x fp8 products whose exact sum needs exactly p bits (exact in
  every order) or p + 1 (just past the exactness limit 2^(L+p): some order rounds), with
  magnitudes and grains chosen at the boundary;
* ``dot_errors``: the realised error of every order arith offers (sequential, reversed, sorted,
  positives-then-negatives, alternating, pairwise, split-K chunks, random, greedy up / down)
  for such rows;
* ``straddle_chain``: a two-MatMul chain whose first output lands within an fp32 ulp or two of
  an fp8 rounding midpoint of the second cast, so that conforming programs cast it both ways:
  what a "stable cast" certificate must not miss.

Checked against ``kcverify.bounds.accumulate.dot_error`` (the any-order enclosures, directly)
and against the engine on MatMul graphs with fp8 activations (certify_drift, interval and best).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import helper

from kcverify.kernels.formats import get_format
from tests.soundness.adversarial.arith import FMT, ordered_sum, rnd
from tests.soundness.adversarial.attacks import SPECS, pairs
from tests.soundness.adversarial.harness import (
    SESSION,
    TRAIN,
    Ledger,
    attack,
    chain_model,
    node_model,
    ratio_text,
    spec,
)
from tests.soundness.adversarial.programs import Program

ORDERS = ("seq", "rev", "asc", "desc", "posneg", "alt", "pairwise", "chunk4", "chunk16",
          "random", "greedy_up", "greedy_down")
E4M3 = np.unique(np.abs(rnd(np.linspace(-448, 448, 200001), "fp8_e4m3")))


def _fp8_grid(fmt: str = "fp8_e4m3") -> np.ndarray:
    g = E4M3 if fmt == "fp8_e4m3" else np.unique(np.abs(rnd(np.linspace(-57344, 57344, 400001), fmt)))
    return g[g > 0]


def exactness_rows(rng: np.random.Generator, n_rows: int, k: int, bits: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """(a, b): n_rows x k e4m3 operand pairs at the exactness boundary. Per row: a *fine*
    product (9 2^-9)^2 = 81 2^-18 (grain 2^-18, lowest bit set), a *big* product 2^(bits - 19)
    (a power of two), k - 2 medium products in [2^-4, 16] (grains >= 2^-10), random signs,
    shuffled. Big + fine needs exactly ``bits`` significant bits: with k = 2 the row is exact in
    an fp32 accumulator for bits <= 24 and rounds for bits >= 25."""
    grid = _fp8_grid()
    mid = grid[(grid >= 0.25) & (grid <= 4.0)]
    a = rng.choice(mid, size=(n_rows, k))
    b = rng.choice(mid, size=(n_rows, k))
    e = bits - 19
    a[:, 0], b[:, 0] = 2.0 ** (e - e // 2), 2.0 ** (e // 2)
    a[:, 1] = b[:, 1] = 9 * 2.0**-9
    a *= rng.choice([-1.0, 1.0], size=a.shape)
    b *= rng.choice([-1.0, 1.0], size=b.shape)
    for r in range(n_rows):
        perm = rng.permutation(k)
        a[r], b[r] = a[r, perm], b[r, perm]
    assert np.all(rnd(a, "fp8_e4m3") == a) and np.all(rnd(b, "fp8_e4m3") == b)
    return a, b


def dot_errors(a: np.ndarray, b: np.ndarray, acc: str, rng: np.random.Generator
               ) -> np.ndarray:
    """max over ORDERS of |fl(sum a b) - sum a b| per row (fp8 products are exact in the
    accumulator, so ordered_sum on the exact products is each order's program)."""
    p = a * b
    exact = p.sum(-1)  # float64: exact for <= 2^10 terms of <= 8 bits within 2^40 of each other
    worst = np.zeros(p.shape[0])
    for order in ORDERS:
        s = ordered_sum(p, acc, order, rng)
        worst = np.maximum(worst, np.abs(s - exact))
    return worst


def _dot_error_api():
    try:
        from kcverify.bounds.accumulate import dot_error, grain_lower
    except ImportError:  # pragma: no cover - the module lands with issue 12
        pytest.skip("kcverify.bounds.accumulate is not there")
    return dot_error, grain_lower


@pytest.mark.parametrize("bits", [20, 24, 25, 26, 30])
@pytest.mark.parametrize("acc", ["fp32", "bf16", "fp16"])
def test_dot_error_encloses_every_order(bits: int, acc: str) -> None:
    """kcverify.bounds.accumulate.dot_error (exact products, grains) against the realised
    error of every order, on rows at the exactness boundary."""
    dot_error, grain_lower = _dot_error_api()
    rng = np.random.default_rng(bits * 7 + len(acc))
    led = Ledger()
    cls = "accumulate/dot_error"
    a, b = exactness_rows(rng, 24, 16, bits)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    e4 = get_format("fp8_e4m3")
    found = []
    for r in range(a.shape[0]):
        A, B = ta[r:r + 1], tb[r:r + 1].T.contiguous()
        ga, gb = grain_lower(A, A, e4), grain_lower(B, B, e4)
        bound = float(dot_error(A, A, B, B, get_format(acc), True, ga, gb).reshape(-1)[0])
        real = float(dot_errors(a[r:r + 1], b[r:r + 1], acc, rng)[0])
        st = led[cls]
        st.pairs += len(ORDERS)
        if bound > 0:
            st.worst_drift = max(st.worst_drift, real / bound)
        if not real <= bound:
            found.append(f"row {r}: realised {real!r} > enclosure {bound!r} ({acc}, {bits} bits)")
            st.violations.append(found[-1])
    SESSION.merge(led)
    assert not found, ratio_text(led[cls])


def _spec_for(acts: str, acc: str = "fp32") -> object:
    return spec(weights={"format": "fp8_e4m3", "scale": "per_channel"},
                activations={"format": "fp8_e4m3", "scale": acts}, accumulate=acc,
                compute="fp32")


@pytest.mark.parametrize("acts", ["dynamic_per_token", "dynamic_per_tensor"])
@pytest.mark.parametrize("bits", [24, 25, 26])
def test_matmul_rows_at_the_exactness_limit(acts: str, bits: int) -> None:
    """The engine on a MatMul whose cast operands are exactly the boundary rows: x's row r is
    a_r, w's column r is b_r, and two extra columns pin both scales to 1 (an activation column
    of 448 against a zero weight row, a weight row of 448 against a zero activation column), so
    the cast values are the rows themselves."""
    rng = np.random.default_rng(bits)
    R, K = 4, 16
    a, b = exactness_rows(rng, R, K, bits)
    x = np.zeros((R, K + 2))
    w = np.zeros((K + 2, R))
    x[:, :K], w[:K, :] = a, b.T
    x[:, K] = 448.0
    w[K + 1, :] = 448.0
    sp = _spec_for(acts)
    led = Ledger()
    model = node_model("MatMul", [("x", (R, K + 2)), ("w", w.astype(np.float32))])
    found = []
    for domain in ("interval", "best"):
        found += attack(led, "accumulate/exactness-limit", model, TRAIN, sp,
                        {"x": x.astype(np.float32)},
                        [(Program(TRAIN, order=o1), Program(sp, order=o2, per_sample="axis0"))
                         for o1, o2 in (("seq", "greedy_up"), ("desc", "greedy_down"),
                                        ("posneg", "alt"), ("chunk4", "pairwise"))],
                        domain=domain)
    SESSION.merge(led)
    assert not found, ratio_text(led["accumulate/exactness-limit"])


def straddle_rows(k: int) -> np.ndarray:
    """Rows for ReduceSum -> MatMul: row 0 sums M = 1.0625 2^k (an e4m3 midpoint times the scale
    2^k), h = ulp(M) / 2 (1 + 2^-10) and -ulp(M) / 2; row 1 is 448 2^k alone (the amax: s = 2^k
    exactly). Exact sum M + 2^-11 ulp(M): in fp32, (M, -ulp/2, h) gives M + ulp (cast up to
    1.125), (M, h, -ulp/2) and (h, -ulp/2, M) give M (a tie, cast to even: 1.0)."""
    M = 1.0625 * 2.0**k
    half = 2.0 ** (k - 24)  # ulp(M) / 2: M in [2^k, 2^(k+1)), ulp 2^(k-23)
    x = np.zeros((1, 2, 4))
    x[0, 0, :3] = [M, half * (1 + 2.0**-10), -half]
    x[0, 1, 0] = 448.0 * 2.0**k
    return x.astype(np.float32)


@pytest.mark.parametrize("acts", ["dynamic_per_token", "dynamic_per_tensor"])
@pytest.mark.parametrize("k", [-3, 0, 5])
def test_straddled_cast_downstream(acts: str, k: int) -> None:
    """A ReduceSum (any order in fp32) whose result straddles an fp8 rounding midpoint of the
    next MatMul's activation cast: programs cast it to 1.0 or 1.125 (times 2^k); the engine's
    cast image (and the zonotope's binary symbol) must hold both."""
    x = straddle_rows(k)
    sums = {o: float(ordered_sum(x[0, 0].astype(np.float64), "fp32", o)) for o in ("seq", "alt")}
    assert sums["seq"] != sums["alt"], sums  # the construction straddles
    rng = np.random.default_rng(k + 40)
    w2 = (0.5 * rng.normal(size=(2, 3))).astype(np.float32)
    sp = _spec_for(acts)
    nodes = [helper.make_node("ReduceSum", ["x", "axes"], ["h"], keepdims=0),
             helper.make_node("MatMul", ["h", "w2"], ["y"])]
    model = chain_model(nodes, [("x", (1, 2, 4)), ("axes", np.array([2])), ("w2", w2)], ["y"],
                        opset=13)
    led = Ledger()
    found = []
    for domain in ("interval", "best"):
        found += attack(led, "accumulate/straddle", model, TRAIN, sp, {"x": x},
                        [(Program(TRAIN, order=o1), Program(sp, order=o2))
                         for o1 in ("seq", "alt") for o2 in ("seq", "alt", "greedy_up")],
                        domain=domain)
    SESSION.merge(led)
    assert not found, ratio_text(led["accumulate/straddle"])
    # the diagnostic must not call a cast stable that conforming programs round both ways
    from kcverify.bounds import certify_drift
    from tests.soundness.adversarial.harness import graph_of

    res = certify_drift(graph_of(model), TRAIN, sp, {"x": x}, domain="interval")
    unstable = getattr(res, "unstable_casts", None)
    if unstable is not None:
        assert int(np.asarray(unstable).reshape(-1)[0]) >= 1, unstable


@pytest.mark.slow
@pytest.mark.parametrize("sp_name", ["fp8_token_fp32", "fp8_tensor_bf16", "fp8_dynblock",
                                     "e5m2_any_fp16"])
def test_matmul_spec_attack_slow(sp_name: str) -> None:
    """Any MatMul spec: boundary rows and straddles with adversarial program families."""
    sp = SPECS[sp_name]
    led = Ledger()
    found = []
    for bits in (24, 25, 26):
        rng = np.random.default_rng(100 + bits)
        a, _ = exactness_rows(rng, 6, 16, bits)  # as activations: the scales move them
        w = (0.5 * rng.normal(size=(16, 8))).astype(np.float32)
        model = node_model("MatMul", [("x", (6, 16)), ("w", w)])
        for domain in ("interval", "best"):
            found += attack(led, "accumulate/spec-attack", model, TRAIN, sp,
                            {"x": (a / 64).astype(np.float32)},
                            pairs(TRAIN, sp, 8, bits, per_sample="axis0"), domain=domain)
    SESSION.merge(led)
    assert not found, "\n".join(found[:3])


def test_exactness_rows_hit_both_sides() -> None:
    """The generator is what it says: 24-bit rows are exact in every order far more often than
    26-bit rows (which must round somewhere)."""
    rng = np.random.default_rng(0)
    exact = {}
    for bits in (24, 26):
        a, b = exactness_rows(rng, 40, 2, bits)
        err = dot_errors(a, b, "fp32", rng)
        exact[bits] = float(np.mean(err == 0))
    assert exact[24] == 1.0 and exact[26] < 1.0, exact
    assert FMT["fp32"].p == 24


# --- the grid path, any operand formats ------------------------------------------------------
_EMIN = {"fp8_e4m3": -9, "fp8_e5m2": -16, "bf16": -133, "fp16": -24}  # least subnormal exponent
_EMAX = {"fp8_e4m3": 8, "fp8_e5m2": 15, "bf16": 127, "fp16": 15}
_MANT = {"fp8_e4m3": 3, "fp8_e5m2": 2, "bf16": 7, "fp16": 10}

# name: (spec, activation format, weight format (None: a second activation), pin values)
GRID_SPECS = {
    "e4m3xe4m3-acc-fp32": (spec(weights={"format": "fp8_e4m3", "scale": "per_channel"},
                                activations={"format": "fp8_e4m3", "scale": "dynamic_per_token"},
                                accumulate="fp32", compute="fp32"), "fp8_e4m3", "fp8_e4m3"),
    "e4m3xe4m3-acc-bf16": (spec(weights={"format": "fp8_e4m3", "scale": "per_channel"},
                                activations={"format": "fp8_e4m3", "scale": "dynamic_per_token"},
                                accumulate="bf16", compute="bf16"), "fp8_e4m3", "fp8_e4m3"),
    "e4m3xe4m3-acc-fp16": (spec(weights={"format": "fp8_e4m3", "scale": "per_channel"},
                                activations={"format": "fp8_e4m3", "scale": "dynamic_per_tensor"},
                                accumulate="fp16", compute="fp16"), "fp8_e4m3", "fp8_e4m3"),
    "e5m2xe5m2-acc-fp32": (spec(weights={"format": "fp8_e5m2", "scale": "per_tensor"},
                                activations={"format": "fp8_e5m2", "scale": "dynamic_per_tensor"},
                                accumulate="fp32", compute="fp32"), "fp8_e5m2", "fp8_e5m2"),
    "bf16xe4m3-acc-fp32": (spec(weights={"format": "fp8_e4m3", "scale": "per_channel"},
                                accumulate="fp32", compute="bf16"), "bf16", "fp8_e4m3"),
    "fp16xe4m3-acc-fp32": (spec(weights={"format": "fp8_e4m3", "scale": "per_channel"},
                                accumulate="fp32", compute="fp16"), "fp16", "fp8_e4m3"),
    "bf16xbf16-acc-fp32": (spec(accumulate="fp32", compute="bf16"), "bf16", None),
}


def grid_rows(rng: np.random.Generator, R: int, K: int, fa: str, fb: str, bits: int
              ) -> tuple[np.ndarray, np.ndarray]:
    """(a (R, K), b (K, R)) values of formats fa, fb: in row r / column r a *fine* product
    (1 + 2^-ma)(1 + 2^-mb) 2^-(ka + kb) (grain 2^-(ma + mb + ka + kb), lowest bit set), a *big*
    product, a power of two ``bits`` - 1 binades above that grain, and medium products between;
    random signs, shuffled. Big + fine needs exactly ``bits`` significant bits."""
    ma, mb = _MANT[fa], _MANT[fb]
    top = _EMAX[fa] + _EMAX[fb] - 1
    k = 0
    while bits - 1 - (ma + mb + 2 * k) > top:
        k += 1
    big = bits - 1 - (ma + mb + 2 * k)
    ea = min(_EMAX[fa] - 1, max(big - (_EMAX[fb] - 1), big // 2))
    eb = big - ea
    assert _EMIN[fa] <= ea <= _EMAX[fa] and _EMIN[fb] <= eb <= _EMAX[fb], (fa, fb, bits)
    a = rnd(rng.uniform(0.5, 1.0, size=(R, K)) * 2.0 ** -k, fa)
    b = rnd(rng.uniform(0.5, 1.0, size=(R, K)) * 2.0 ** -k, fb)
    a[:, 0], b[:, 0] = 2.0**ea, 2.0**eb
    a[:, 1] = (1 + 2.0**-ma) * 2.0**-k
    b[:, 1] = (1 + 2.0**-mb) * 2.0**-k
    a *= rng.choice([-1.0, 1.0], size=a.shape)
    b *= rng.choice([-1.0, 1.0], size=b.shape)
    for r in range(R):
        perm = rng.permutation(K)
        a[r], b[r] = a[r, perm], b[r, perm]
    assert np.all(rnd(a, fa) == a) and np.all(rnd(b, fb) == b)
    return a, b.T.copy()


@pytest.mark.parametrize("offset", [-1, 0, 1, 2])
@pytest.mark.parametrize("name", sorted(GRID_SPECS))
def test_grid_path_rows_at_the_exactness_limit(name: str, offset: int) -> None:
    """Rows whose products span p_acc + offset bits (p_acc: the accumulator's significand),
    for every operand-format pair the MatMul grid path takes (fp8 x fp8 into fp32 / bf16 / fp16,
    bf16 or fp16 activations x fp8 weights, bf16 x bf16); the casts' scales pinned to 1 (an
    activation column of max_finite against a zero weight row, a weight row of max_finite
    against a zero activation column) so that the cast values are the rows themselves."""
    sp, fa, fb = GRID_SPECS[name]
    p = FMT[sp.accumulate.name].p
    rng = np.random.default_rng([p, offset + 2, len(name)])
    R, K = 4, 8
    a, b = grid_rows(rng, R, K, fa, fb or fa, p + offset)
    x = np.zeros((R, K + 2))
    w = np.zeros((K + 2, R))
    x[:, :K], w[:K, :] = a, b
    if sp.activations is not None:
        x[:, K] = FMT[fa].max
    if sp.weights is not None:
        w[K + 1, :] = FMT[fb].max
    led = Ledger()
    found = []
    if fb is None:  # a second activation: (R, K) @ (R, K, 1) per sample
        model = node_model("MatMul", [("a", (R, 1, K + 2)), ("b", (R, K + 2, 1))])
        feeds = {"a": x[:, None, :].astype(np.float32), "b": w.T[:, :, None].astype(np.float32)}
    else:
        model = node_model("MatMul", [("x", (R, K + 2)), ("w", w.astype(np.float32))])
        feeds = {"x": x.astype(np.float32)}
    progs = [(Program(TRAIN, order=o1), Program(sp, order=o2, per_sample="axis0"))
             for o1, o2 in (("greedy_up", "greedy_down"), ("greedy_down", "greedy_up"),
                            ("seq", "alt"), ("pairwise", "posneg"), ("chunk4", "rev"))]
    for domain in ("interval", "best"):
        found += attack(led, "accumulate/grid-path", model, TRAIN, sp, feeds, progs, domain=domain)
    SESSION.merge(led)
    assert not found, ratio_text(led["accumulate/grid-path"])
