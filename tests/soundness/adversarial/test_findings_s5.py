"""Session 5's adversary findings (/work/notes/s5/adv_findings.md), each a minimal reproducer
marked ``xfail(strict=True)`` until its fix lands (then the mark goes and it guards the fix)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from tests.soundness.adversarial.arith import rnd
from tests.soundness.adversarial.attacks import SPECS, fp8_midpoints
from tests.soundness.adversarial.harness import TRAIN, chain_model, graph_of, spec

cases = pytest.importorskip("kcverify.bounds.cases")

SP = SPECS["fp8_tensor_fp32"]


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


@pytest.mark.parametrize("kind", ["concat", "reshape"])
def test_cases_batch_interval_on_batch_one_constants(kind: str) -> None:
    """F1 (fixed): certify_cases(domain='interval') stacked all open cases on the sample axis;
    a constant carrying the batch axis then failed with BoundError. Runs are now batches of the
    slice's own size."""
    g, feeds = _batch_one_model(kind)
    res = cases.certify_cases(g, TRAIN, SP, feeds, max_leaves=8, domain="interval")
    assert np.all(np.isfinite(res.linf))
    assert len(res.leaves[0]) > 1 and res.runs > 2  # cases were split and run one by one


FTZ_SP = spec(weights={"format": "fp8_e4m3", "scale": "per_channel"},
              activations={"format": "fp8_e4m3", "scale": "static", "value": 1.0, "ftz": True},
              accumulate="fp32", compute="fp32")


def _ftz_case():
    """x's quotients 0.005 are e4m3 subnormals (3 2^-9 to nearest): an ftz program casts 0."""
    from tests.soundness.adversarial.harness import node_model

    x = np.array([[[0.25, 0.005, -0.005, 0.005]]], np.float32)
    w = np.array([[1.0, 0.5], [1.0, -2.0], [0.5, 1.0], [2.0, 1.0]], np.float32)
    return node_model("MatMul", [("x", (1, 1, 4)), ("W", w)]), {"x": x}


def test_ftz_program_flushes() -> None:
    """The reproducer's program does flush (else the xfails below could not fail)."""
    from tests.soundness.adversarial.interp import ProgramRunner
    from tests.soundness.adversarial.programs import Program

    model, feeds = _ftz_case()
    run = ProgramRunner(model)
    plain = spec(weights={"format": "fp8_e4m3", "scale": "per_channel"},
                 activations={"format": "fp8_e4m3", "scale": "static", "value": 1.0},
                 accumulate="fp32", compute="fp32")
    a = run(Program(FTZ_SP), feeds)["y0"]
    b = run(Program(plain), feeds)["y0"]
    assert np.allclose(a, [[[0.25, 0.125]]]) and not np.allclose(a, b)


@pytest.mark.parametrize("domain", ["interval", "linear", "best"])
def test_ftz_flushed_casts_inside(domain: str) -> None:
    from tests.soundness.adversarial.harness import Ledger, attack
    from tests.soundness.adversarial.programs import Program

    model, feeds = _ftz_case()
    led = Ledger()
    found = attack(led, "ftz", model, TRAIN, FTZ_SP, feeds,
                   [(Program(TRAIN), Program(FTZ_SP)), (Program(TRAIN, order="rev"),
                                                       Program(FTZ_SP, quotient="fp32"))],
                   domain=domain)
    assert not found, "\n".join(found[:2])


@pytest.mark.parametrize("scale", ["static", "none", "dynamic_per_tensor", "dynamic_per_token"])
def test_ftz_wide(scale: str) -> None:
    """F2 beyond the reproducer: K = 8 rows whose quotients are (k + 1/4) 2^-9 (e4m3 subnormals,
    away from midpoints), under every scale the grid path and the zonotope's plan take; before
    50c4510 the programs drifted up to 430x the certified bound."""
    from tests.soundness.adversarial.harness import Ledger, attack, node_model
    from tests.soundness.adversarial.programs import Program

    acts = {"format": "fp8_e4m3", "scale": scale, "ftz": True}
    if scale == "static":
        acts["value"] = 2.0**-7
    sp = spec(weights={"format": "fp8_e4m3", "scale": "per_channel"}, activations=acts,
              accumulate="fp32", compute="fp32")
    rng = np.random.default_rng(1)
    K = 8
    s = 1.0 / 448 if scale.startswith("dynamic") else (2.0**-7 if scale == "static" else 1.0)
    x = np.zeros((1, 2, K))
    q = (np.arange(1, 8) + 0.25) * 2.0**-9
    x[0, :, 1:] = rng.choice(q, size=(2, K - 1)) * s * rng.choice([-1, 1], size=(2, K - 1))
    x[0, :, 0] = 1.0 if scale.startswith("dynamic") else 0.5 * s
    x = rnd(x, "fp32").astype(np.float32)
    w = rnd(rng.normal(size=(K, 3)), "fp8_e4m3").astype(np.float32)
    model = node_model("MatMul", [("x", (1, 2, K)), ("w", w)])
    progs = [(Program(TRAIN), Program(sp)), (Program(TRAIN, order="rev"),
                                             Program(sp, quotient="fp32", order="greedy_up"))]
    for domain in ("interval", "best"):
        led = Ledger()
        found = attack(led, "ftz", model, TRAIN, sp, {"x": x}, progs, domain=domain)
        assert not found, "\n".join(found[:2])
