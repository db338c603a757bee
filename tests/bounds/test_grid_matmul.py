"""The MatMul rule's grid path (rules/linear.py): fp8 x fp8 products accumulated unscaled, the
value set as (Q_a @ Q_b +- E) [s_a s_b] with E from kcverify.bounds.accumulate.

Conforming programs here are written apart from kernels/realize.py: ml_dtypes' fp8 casts of the
exact quotient x / s (s = fl32(amax / 448)), the unscaled products summed in float32 one
addition at a time in adversarial orders (ascending magnitudes, the fine terms first, alternating
signs, descending), then one fp32 rounding of s_a s_b * acc. Rows are built on both sides of
the exactness limit: products spanning at most 24 bits (every order gives the exact sum) and
rows just past it (a few fine terms that must pay).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from kcverify.bounds import certify_drift
from kcverify.bounds import diagnostics as _diag  # noqa: F401 - the run counts unstable casts
from kcverify.kernels.spec import parse_kernel_spec
from kcverify.models.ir import from_onnx
from tests.helpers import matmul_model

FP32 = parse_kernel_spec("train", {"compute": "fp32", "accumulate": "fp32"})
INF = parse_kernel_spec("inf", {"weights": {"format": "fp8_e4m3", "scale": "per_channel"},
                                "activations": {"format": "fp8_e4m3", "scale": "dynamic_per_tensor"},
                                "accumulate": "fp32", "compute": "fp32"})
E4M3 = ml_dtypes.float8_e4m3fn
_CODES = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float64)
GRID = np.unique(_CODES[np.isfinite(_CODES)])  # every e4m3 value, ascending


def _f32(x: float) -> float:
    return float(np.float32(x))


def _orders(terms: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    mags = np.abs(terms)
    grains = np.array([np.ldexp(1.0, int(np.frexp(t)[1]) - 8) if t else np.inf for t in terms])
    alt = np.argsort(-mags)
    pos, neg = alt[terms[alt] > 0], alt[terms[alt] <= 0]
    inter = np.array([i for pair in zip(pos, neg) for i in pair]
                     + list(pos[len(neg):]) + list(neg[len(pos):]), dtype=int)
    return [np.argsort(mags), np.argsort(-mags), np.argsort(grains), inter,
            rng.permutation(len(terms))]


def _programs(x: np.ndarray, w: np.ndarray, rng: np.random.Generator):
    """Every (order) program's output for input row x (independent of the realizer)."""
    amax = float(np.abs(x).max())
    sa = _f32(max(amax, 1e-12) / 448.0)
    qa = (x / sa).astype(E4M3).astype(np.float64)
    sw = np.array([_f32(max(float(np.abs(w[:, j]).max()), 1e-12) / 448.0) for j in range(w.shape[1])])
    qw = (w / sw).astype(E4M3).astype(np.float64)
    outs = []
    for _ in range(1):
        ys = []
        for j in range(w.shape[1]):
            terms = qa * qw[:, j]
            row = []
            for order in _orders(terms, rng):
                acc = np.float32(0.0)
                for t in terms[order]:
                    acc = np.float32(acc + np.float32(t))  # products are exact in fp32
                row.append(_f32(float(np.float64(sa) * sw[j]) * float(acc)))
            ys.append(row)
        outs.append(np.array(ys))  # (n, orders)
    return outs[0]


@pytest.mark.parametrize("fine", [0, 2, 6])
def test_grid_rows_on_both_sides_of_the_exactness_limit(fine: int) -> None:
    rng = np.random.default_rng(11 + fine)
    k, n = 64, 8
    w = rng.normal(size=(k, n)) * 0.1
    x = rng.normal(size=(1, k))
    # a few fine terms: activations tiny next to the row's amax push products below the grid
    x[0, :fine] *= 2.0 ** -12
    res = certify_drift(matmul_model(w), FP32, INF, {"x": x.astype(np.float32)}, domain="interval")
    box = res.outputs["y"]
    ys = _programs(x[0].astype(np.float32).astype(np.float64), w.astype(np.float32).astype(np.float64), rng)
    lo, hi = box.inf_lo[0], box.inf_hi[0]
    for j in range(n):
        assert np.all(lo[j] <= ys[j]) and np.all(ys[j] <= hi[j]), (j, lo[j], ys[j], hi[j])
    if fine == 0:
        # exact rows: the value set is the scale's range times one exact sum, plus the roundings
        rel = (hi - lo) / np.maximum(np.abs(hi), 1e-30)
        assert float(np.median(rel)) < 2e-6
    assert res.unstable_casts is not None and res.unstable_casts.shape == (1,)


def test_unstable_casts_are_counted_at_an_fp8_midpoint() -> None:
    """An activation on a rounding midpoint (in units of its scale) is unstable; the run says so."""
    k, n = 8, 2
    w = np.eye(k, n)
    # amax 448 * s, s = 1: x = 448 and a value halfway between two e4m3 neighbours (in [8, 16)
    # the spacing is 1: 8.5), perturbed by far less than the fp32 quotient slack
    x = np.zeros((1, k))
    x[0, 0] = 448.0
    x[0, 1] = 8.5
    res = certify_drift(matmul_model(w), FP32, INF, {"x": x.astype(np.float32)}, domain="interval")
    assert int(res.unstable_casts[0]) >= 1
    x[0, 1] = 8.25  # strictly between midpoints: stable
    res = certify_drift(matmul_model(w), FP32, INF, {"x": x.astype(np.float32)}, domain="interval")
    assert int(res.unstable_casts[0]) == 0


def test_cancellation_row_pays_for_its_fine_terms() -> None:
    """448*448 - 448*448 + 2^-9: added in the order (big, fine, -big) the fine term is lost (fp32
    has 24 bits; 200704 + 2^-9 needs 27), so a conforming program computes 0 where the exact sum
    is 2^-9 (times the scales). The enclosure must contain both; with E = 0 it would not."""
    w = np.array([[1.0], [1.0], [2.0 ** -15 / 7]])
    x = np.array([[448.0, -448.0, 1.0]])
    res = certify_drift(matmul_model(w), FP32, INF, {"x": x.astype(np.float32)}, domain="interval")
    box = res.outputs["y"]
    sw = _f32(1.0 / 448.0)
    exact = 2.0 ** -9 * sw
    lost = 0.0  # (200704 + 2^-9) rounds to 200704 in fp32, then - 200704
    assert float(np.float32(np.float32(200704.0) + np.float32(2.0 ** -9))) == 200704.0
    for y in (exact, lost):
        assert box.inf_lo[0, 0] <= y <= box.inf_hi[0, 0], (box.inf_lo, y, box.inf_hi)


def _two_matmuls(w1: np.ndarray, w2: np.ndarray):
    k, m = w1.shape
    _, n = w2.shape
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W1"], ["h"]), helper.make_node("MatMul", ["h", "W2"], ["y"])],
        "mm2", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])],
        [numpy_helper.from_array(w1.astype(np.float32), "W1"),
         numpy_helper.from_array(w2.astype(np.float32), "W2")])
    return from_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


def _cast_row(v: np.ndarray, tie_up: bool | None = None) -> tuple[np.ndarray, float]:
    """Dynamic per-tensor e4m3 cast of one row: (q, s); ``tie_up`` resolves an exact tie."""
    s = _f32(max(float(np.abs(v).max()), 1e-12) / 448.0)
    t = v / s
    q = t.astype(E4M3).astype(np.float64)
    if tie_up is not None:
        for i, ti in enumerate(t):
            j = int(np.searchsorted(GRID, ti))
            if 0 < j < len(GRID) and ti == 0.5 * (GRID[j - 1] + GRID[j]):
                q[i] = GRID[j] if tie_up else GRID[j - 1]  # a conforming quotient goes either way
    return q, s


def _program(x: np.ndarray, w1: np.ndarray, w2: np.ndarray, tie_up: bool) -> np.ndarray:
    """x -> cast -> @ W1 (fp32 sums, one rounding of the scaled sum) -> cast -> @ W2."""
    def mm(v: np.ndarray, w: np.ndarray, tie: bool | None) -> np.ndarray:
        q, s = _cast_row(v, tie)
        out = []
        for j in range(w.shape[1]):
            sw = _f32(max(float(np.abs(w[:, j]).max()), 1e-12) / 448.0)
            qw = (w[:, j] / sw).astype(E4M3).astype(np.float64)
            acc = np.float32(0.0)
            for t in q * qw:
                acc = np.float32(acc + np.float32(t))
            out.append(_f32(float(np.float64(s) * sw) * float(acc)))
        return np.array(out)
    return mm(mm(x, w1, tie_up), w2, None)


def test_a_tie_that_moves_the_next_scale_is_covered_on_both_branches() -> None:
    """A cast on an exact rounding midpoint (8.5 between 8 and 9 at scale 1) is a binary choice;
    here it also decides the amax of the next MatMul's input, so the next per-tensor scale, and
    with it every element's rounding, depends on it (zonotope: _scale_branches). Programs taking
    either branch are inside the certified sets of both domains."""
    m, n = 4, 3
    x = np.array([[448.0, 8.5, 3.0, -5.0]])
    w1 = np.array([[0.01, 0.02, -0.03, 0.01],
                   [1.00, 0.10, 0.20, -0.30],   # column 0 carries the tie: the amax of h
                   [0.05, 0.30, 0.10, 0.20],
                   [0.02, -0.10, 0.40, 0.10]])
    w2 = np.random.default_rng(3).normal(size=(m, n))
    g = _two_matmuls(w1, w2)
    ys = [_program(x[0].astype(np.float32).astype(np.float64), w1.astype(np.float32).astype(np.float64),
                   w2.astype(np.float32).astype(np.float64), up) for up in (False, True)]
    assert not np.array_equal(ys[0], ys[1])  # the two branches really differ
    for domain in ("interval", "linear"):
        res = certify_drift(g, FP32, INF, {"x": x.astype(np.float32)}, domain=domain)
        box = res.outputs["y"]
        for y in ys:
            assert np.all(box.inf_lo[0] <= y) and np.all(y <= box.inf_hi[0]), (domain, box.inf_lo, y, box.inf_hi)
