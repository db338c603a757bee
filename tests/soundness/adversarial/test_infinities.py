"""Infinite values in both kernels: the drift convention and the row ops (findings 11 and 13).

The drift of a pair is i - t, 0 for the same infinity in both kernels, +-inf for an infinity
against a finite value, NaN where a value is NaN (kcverify.boxes, semantics §1.1). Every box the
engine returns (every domain) and every DiffBox is closed under it: a drift interval never
excludes what an infinite pair gives. A row op over a row that may hold +-inf (fp16 storage of
70000, an fp16 sum that overflows before it) is NaN (softmax: inf - inf; LayerNorm: x - mean) or
inf (a sum) in every program: no finite bound there, and the finite rows keep theirs.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from onnx import helper

from kcverify.bounds.box import Box
from kcverify.bounds.engine import infinite_drift
from kcverify.boxes import DiffBox
from tests.soundness.adversarial.harness import (
    SESSION,
    TRAIN,
    Ledger,
    attack,
    certify,
    chain_model,
    graph_of,
    node_model,
    ratio_text,
    spec,
)
from tests.soundness.adversarial.programs import Program

INF = np.inf
# value intervals: exactly +inf, exactly -inf, finite, [a, +inf], [-inf, a], (-inf, inf)
SETS = [(INF, INF), (-INF, -INF), (-1.0, 2.0), (3.0, INF), (-INF, 4.0), (-INF, INF)]


def _members(lo: float, hi: float) -> list[float]:
    """Representative values of [lo, hi]: its ends and a finite inner point; NaN for (-inf, inf)."""
    out = {lo, hi}
    if lo < hi:
        out.add(0.5 * (max(lo, -10.0) + min(hi, 10.0)))
    vals = sorted(out)
    return vals + ([float("nan")] if (lo, hi) == (-INF, INF) else [])


def _drift(t: float, i: float) -> float:
    if np.isnan(t) or np.isnan(i):
        return float("nan")
    if np.isinf(t) and t == i:
        return 0.0
    return i - t


@pytest.mark.parametrize("t_set,i_set", list(itertools.product(SETS, SETS)))
def test_drift_interval_holds_every_infinite_pair(t_set, i_set) -> None:
    """For every pair of value intervals and a rule's drift [-0.5, 0.5] (what it derived for the
    finite pairs), the closed drift interval holds every pair's drift, NaN only in (-inf, inf);
    engine (torch) and DiffBox (numpy) agree. [inf, inf] in both kernels was drift [inf, inf]."""
    arrs = [np.array([v]) for v in (*t_set, *i_set, -0.5, 0.5)]
    box = DiffBox(*arrs)
    eng = infinite_drift(Box(*(torch.tensor(a, dtype=torch.float64) for a in arrs)))
    assert np.array_equal(eng.dl.numpy(), box.drift_lo)
    assert np.array_equal(eng.dh.numpy(), box.drift_hi)
    lo, hi = float(box.drift_lo[0]), float(box.drift_hi[0])
    for t in _members(*t_set):
        for i in _members(*i_set):
            d = _drift(t, i)
            if not (np.isfinite(t) and np.isfinite(i)):
                ok = (lo == -INF and hi == INF) if np.isnan(d) else lo <= d <= hi
                assert ok, f"t={t}, i={i}: drift {d} outside [{lo}, {hi}]"
    if all(np.isfinite(v) for v in (*t_set, *i_set)):
        assert (lo, hi) == (-0.5, 0.5)  # finite value sets: the rule's drift stands


def _ok(led: Ledger, cls: str, found: list[str]) -> None:
    SESSION.merge(led)
    assert not found, ratio_text(led[cls])


@pytest.mark.parametrize("domain", ["interval", "linear", "best"])
def test_row_ops_over_a_row_holding_inf(domain: str) -> None:
    """fp16 stores 70000 as +inf. Row 0 holds it, row 1 does not: LayerNorm (x - mean = inf -
    inf), Softmax (inf - inf), ReduceSum / ReduceMean (inf) and ReduceMax (inf) of row 0 are
    checked against every program (the fp32 training kernel keeps 70000: drift inf), and row 1
    keeps a finite drift bound."""
    led = Ledger()
    f16 = spec(compute="fp16", accumulate="fp32")
    x = np.array([[70000, 1, 2, 3, -1, 0.5, 2, -3], [7, 1, 2, 3, -1, 0.5, 2, -3]], np.float32)
    n = x.shape[1]
    g, b = np.linspace(0.5, 1.5, n).astype(np.float32), np.full(n, 0.25, np.float32)
    cases = [
        ("LayerNormalization", node_model("LayerNormalization", [("x", (2, n)), ("g", g), ("b", b)],
                                          {"axis": -1}, opset=17),
         [{"ln_form": f} for f in ("two_pass", "two_pass_acc")]),
        ("Softmax", node_model("Softmax", [("x", (2, n))], {"axis": -1}, opset=13), [{}]),
        ("ReduceSum", node_model("ReduceSum", [("x", (2, n)), ("axes", np.array([1]))],
                                 {"keepdims": 1}, opset=13), [{}]),
        ("ReduceMean", node_model("ReduceMean", [("x", (2, n)), ("axes", np.array([1]))],
                                  {"keepdims": 1}, opset=18), [{}]),
        ("ReduceMax", node_model("ReduceMax", [("x", (2, n)), ("axes", np.array([1]))],
                                 {"keepdims": 1}, opset=18), [{}]),
    ]
    found = []
    for op, model, forms in cases:
        pairs = [(Program(TRAIN), Program(f16, order=o, **kw))
                 for kw in forms for o in ("seq", "pairwise")]
        found += attack(led, "infinities/row", model, TRAIN, f16, {"x": x}, pairs, domain=domain)
        box = certify(graph_of(model), TRAIN, f16, {"x": x}, domain)["y0"]
        assert box.linf()[0] == INF, op  # the training kernel (fp32) stores 70000
        assert np.all(np.isfinite(box.drift_lo[1])) and np.all(np.isfinite(box.drift_hi[1])), op
    _ok(led, "infinities/row", found)


@pytest.mark.parametrize("domain", ["interval", "best"])
def test_softmax_after_an_fp16_add_that_overflows(domain: str) -> None:
    """An fp16 Add overflowing into a softmax row (40000 + 30000 = inf, a residual before an
    attention score): NaN in every program; no bound on that row."""
    led = Ledger()
    f16 = spec(compute="fp16", accumulate="fp32")
    nodes = [helper.make_node("Add", ["x", "y"], ["s"]),
             helper.make_node("Softmax", ["s"], ["z"], axis=-1)]
    model = chain_model(nodes, [("x", (2, 4)), ("y", (2, 4))], ["z"], opset=13)
    feeds = {"x": np.array([[40000, 1, 2, 3], [4, 1, 2, 3]], np.float32),
             "y": np.array([[30000, 1, 2, 3], [1, 1, 2, 3]], np.float32)}
    found = attack(led, "infinities/softmax-add", model, TRAIN, f16, feeds,
                   [(Program(TRAIN), Program(f16))], domain=domain)
    box = certify(graph_of(model), TRAIN, f16, feeds, domain)["z"]
    assert box.linf()[0] == INF and np.isfinite(box.linf()[1])
    _ok(led, "infinities/softmax-add", found)
