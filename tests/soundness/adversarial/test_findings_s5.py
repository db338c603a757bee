"""Session 5's adversary findings (/work/notes/s5/adv_findings.md), each a minimal reproducer
marked ``xfail(strict=True)`` until its fix lands (then the mark goes and it guards the fix)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from tests.soundness.adversarial.arith import rnd
from tests.soundness.adversarial.attacks import fp8_midpoints
from tests.soundness.adversarial.harness import TRAIN, chain_model, graph_of, spec

cases = pytest.importorskip("kcverify.bounds.cases")

SP = spec(weights={"format": "fp8_e4m3", "scale": "per_channel"},
          activations={"format": "fp8_e4m3", "scale": "dynamic_per_tensor"},
          accumulate="fp32", compute="fp32")


def _batch_one_model(kind: str, T: int = 2, K: int = 4):
    """x (1, T, K) -> MatMul -> h (1, T, 3) -> Concat with a constant (1, T, 1) / Reshape to
    the static [1, 3 T] -> MatMul: a valid batch-1 model whose constant carries the batch axis."""
    rng = np.random.default_rng(0)
    w1 = rnd(rng.normal(size=(K, 3)), "fp8_e4m3").astype(np.float32)
    n = helper.make_node
    if kind == "concat":
        nodes = [n("MatMul", ["x", "w1"], ["h"], name="mm1"),
                 n("Concat", ["h", "pin"], ["z"], axis=2, name="cat"),
                 n("MatMul", ["z", "w2"], ["y"], name="mm2")]
        ins = [("pin", np.full((1, T, 1), 2.0, np.float32)),
               ("w2", rnd(rng.normal(size=(4, 2)), "fp8_e4m3").astype(np.float32))]
    else:
        nodes = [n("MatMul", ["x", "w1"], ["h"], name="mm1"),
                 n("Reshape", ["h", "shape"], ["z"], name="reshape"),
                 n("MatMul", ["z", "w2"], ["y"], name="mm2")]
        ins = [("shape", np.array([1, 3 * T], np.int64)),
               ("w2", rnd(rng.normal(size=(3 * T, 2)), "fp8_e4m3").astype(np.float32))]
    model = chain_model(nodes, [("x", (1, T, K)), ("w1", w1), *ins], ["y"])
    x = fp8_midpoints((1, T, K), "fp8_e4m3", np.random.default_rng(0), amax=1.3)
    return graph_of(model), {"x": x}


@pytest.mark.parametrize("kind", ["concat", "reshape"])
def test_cases_best_runs_on_batch_one_constants(kind: str) -> None:
    """Control: the same models by cases in the best domain (one case per run)."""
    g, feeds = _batch_one_model(kind)
    res = cases.certify_cases(g, TRAIN, SP, feeds, max_leaves=8, domain="best")
    assert np.all(np.isfinite(res.linf))
    assert len(res.leaves[0]) > 1, "the inputs must leave cases open"


@pytest.mark.xfail(strict=True, reason="F1: certify_cases(domain='interval') stacks an input's "
                   "open cases on the sample axis; a constant carrying the batch axis (Concat "
                   "with a (1, T, 1) initializer, Reshape to a static [1, n]) then fails with "
                   "BoundError")
@pytest.mark.parametrize("kind", ["concat", "reshape"])
def test_cases_batch_interval_on_batch_one_constants(kind: str) -> None:
    g, feeds = _batch_one_model(kind)
    res = cases.certify_cases(g, TRAIN, SP, feeds, max_leaves=8, domain="interval")
    assert np.all(np.isfinite(res.linf))
