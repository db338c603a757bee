"""SMT on small blocks: exact maxima sandwiched between realizations and the bound engine,
a shipped-model clause the interval domain cannot prove, replayed counterexamples, the rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kcverify.bounds import Region, blocks_of, certify_drift
from kcverify.certs.rules import RuleContext, get_rule, implies
from kcverify.kernels.cast import round_to_format
from kcverify.kernels.formats import get_format
from kcverify.kernels.realize import run_kernel
from kcverify.models.ir import load_onnx
from kcverify.smt import NotEncodable, decide_drift, max_drift, realized_drift, smt_decide_block
from kcverify.smt.exact import fr, round_rational
from kcverify.smt.testing import fp8_specs, random_mlp

TRAIN, INF = fp8_specs()


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2", "bf16", "fp16", "fp32", "int8"])
def test_round_rational_is_the_realizations_cast(fmt: str) -> None:
    f = get_format(fmt)
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.standard_normal(300) * 10.0 ** rng.integers(-8, 3, 300),
                        [0.0, 0.5, 1.5, 2.5, -2.5, f.min_normal * 1.5, 1000.0]])
    want = round_to_format(torch.as_tensor(x), f).numpy()
    got = [float(round_rational(fr(v), f)) for v in x]
    assert np.array_equal(np.asarray(got), want)


@pytest.mark.parametrize("seed", range(4))
def test_exact_max_between_realizations_and_certified_bound(seed: int) -> None:
    """On random 3-8-8-2 ReLU nets (fp8_e4m3 inference, fp32 training), point inputs:
    best realized drift <= z3's exact maximum, and the bound engine's certified bound agrees with
    it. z3's encoding bounds each accumulation by gamma_n over the scaled products, while the
    engine uses the grain enclosure (exact fp8 rows add no error): the engine's family is the
    narrower one, so it may sit below z3's maximum by that accumulation slack (~1e-5 relative
    here), never more (and never below what programs realize)."""
    g = random_mlp(seed=seed)
    x = np.random.default_rng(seed).uniform(-1, 1, (1, 3)).astype(np.float32)
    engine = float(certify_drift(g, TRAIN, INF, x).linf[0])
    m = max_drift(g, TRAIN, INF, x, timeout_s=20)
    assert m.exact
    realized = realized_drift(g, TRAIN, INF, x[0], programs=6, seed=seed)
    assert realized <= m.value and realized <= fr(engine), (realized, float(m.value), engine)
    assert m.value <= fr(engine) * (1 + fr(1e-4)), (realized, float(m.value), engine)


def test_region_max_between_sampled_realizations_and_certified_bound() -> None:
    """On a box: sampled realizations <= z3's maximum <= the interval domain's bound, and
    sampled realizations <= the best bound.

    z3's encoding relaxes each activation cast to a bounded error with the dynamic scale ranging
    over an interval, independently per cast (encode.py's module doc): its maximum is over a
    superset of the conforming programs. The interval domain makes the same relaxation, so its
    bound lies above z3's maximum; ``best`` may lie below it (the zonotope's cast relative to its
    amax element shares the scale between elements, which no independent-error encoding does):
    here z3 reaches 0.0376 with a witness whose exact replay drifts 0.0029, and ``best``
    certifies 0.0296. So ``best`` is checked against what programs realize, densely."""
    g = random_mlp((3, 6, 2), seed=7)
    x = np.random.default_rng(7).uniform(-1, 1, (1, 3)).astype(np.float32)
    eps = 0.01
    interval = float(certify_drift(g, TRAIN, INF, x, region=Region(eps=eps),
                                   domain="interval").linf[0])
    best = float(certify_drift(g, TRAIN, INF, x, region=Region(eps=eps)).linf[0])
    m = max_drift(g, TRAIN, INF, x, eps=eps, timeout_s=20)
    assert m.exact and m.value <= fr(interval)
    rng = np.random.default_rng(0)
    pts = [x[0] + eps * s for s in (rng.choice([-1.0, 1.0], 3) for _ in range(4))]
    seen = max(realized_drift(g, TRAIN, INF, p.astype(np.float32), programs=2) for p in pts)
    assert seen <= m.value
    # the exact maximum sits strictly inside: SMT is sharper than the interval domain here
    assert m.value < fr(interval)
    # best against programs: the box's corners and a dense sample, two summation orders
    pts = np.concatenate([x + eps * rng.uniform(-1, 1, (20000, 3)),
                          x + eps * rng.choice([-1.0, 1.0], (2000, 3))]).astype(np.float32)
    for order in ("sequential", "pairwise"):
        t = run_kernel(g, TRAIN, {"x": pts}, order=order)["y"]
        i = run_kernel(g, INF, {"x": pts}, order=order)["y"]
        assert float((i - t).abs().max()) <= best


def test_shipped_model_clause_proved_by_smt_not_by_intervals() -> None:
    """models/mlp_tiny.onnx, an L-inf ball of radius 0.01: tau between z3's maximum and the
    interval bound is proved by SMT, its node re-solves, and an edited bound is rejected."""
    g = load_onnx("models/mlp_tiny.onnx")
    x = np.random.default_rng(0).uniform(-1, 1, (1, 4)).astype(np.float32)
    eps = 0.01
    engine = float(certify_drift(g, TRAIN, INF, x, region=Region(eps=eps)).linf[0])
    m = max_drift(g, TRAIN, INF, x, eps=eps, timeout_s=120)
    assert m.exact and float(m.value) < 0.8 * engine
    tau = (float(m.value) + engine) / 2
    assert engine > tau  # the interval domain cannot prove it
    d = smt_decide_block(g, TRAIN, INF, x, tau, eps=eps, timeout_s=120)
    assert d.verdict == "proved" and d.node is not None
    rule = get_rule("smt-block")
    ctx = RuleContext(expected_chain=[(b.name, b.digest) for b in blocks_of(g)])
    assert rule.check(d.node, ctx) == []
    # the paper's chain goes on top unchanged: aggregate, then threshold
    agg = get_rule("aggregate").conclude([d.node["conclusion"]], {"stat": "max"}, ctx)
    held = get_rule("threshold").conclude([agg], {"threshold": tau.hex(), "op": "<="}, ctx)
    assert held and float.fromhex(agg["bounds"][0]) == tau
    other = RuleContext(expected_chain=[("layer0", "0" * 64)])
    assert "neither the certified model" in rule.check(d.node, other)[0]
    edited = dict(d.node, params=dict(d.node["params"]))
    low = float(m.value) * 0.9
    edited["params"]["claim"] = [low.hex()]
    edited["conclusion"] = dict(d.node["conclusion"], bounds=[low.hex()])
    problems = rule.check(edited, ctx)
    assert problems and "does not re-solve" in problems[0]
    claimed = dict(d.node["conclusion"], bounds=[low.hex()])
    assert "tighter than justified" in implies(d.node["conclusion"], claimed, {"bounds": "upper"})[0]


def test_refuted_clause_carries_a_replayed_counterexample() -> None:
    g = random_mlp(seed=2)
    x = np.random.default_rng(2).uniform(-1, 1, (1, 3)).astype(np.float32)
    realized = realized_drift(g, TRAIN, INF, x[0], programs=4)
    tau = 0.9 * realized
    v = decide_drift(g, TRAIN, INF, x, tau, timeout_s=20)
    assert v.verdict == "refuted"
    w = v.witness
    assert w["replayed_drift"] > tau and w["realized_drift"] > tau
    assert [float.fromhex(h) for h in w["x"]] == [float(t) for t in x[0]]


def test_proved_and_refuted_agree_with_the_maximum() -> None:
    g = random_mlp(seed=1)
    x = np.random.default_rng(1).uniform(-1, 1, (1, 3)).astype(np.float32)
    m = max_drift(g, TRAIN, INF, x, timeout_s=20)
    assert decide_drift(g, TRAIN, INF, x, float(m.value) * 1.001, programs=0).verdict == "proved"
    assert decide_drift(g, TRAIN, INF, x, float(m.value) * 0.5, programs=0).verdict in ("refuted", "unknown")


def test_time_limit_gives_unknown() -> None:
    g = random_mlp(seed=0)
    x = np.random.default_rng(0).uniform(-1, 1, (1, 3)).astype(np.float32)
    v = decide_drift(g, TRAIN, INF, x, 1e-3, timeout_s=1e-4, programs=0)
    assert v.verdict == "unknown" and "z3" in v.note


def test_static_scale_and_unstable_relus() -> None:
    """A box wide enough for unstable ReLUs (exact If encoding), static activation scale."""
    train, inf = fp8_specs("static")
    g = random_mlp((3, 4, 2), seed=3)
    x = np.random.default_rng(3).uniform(-1, 1, (1, 3)).astype(np.float32)
    eps = 0.1
    m = max_drift(g, train, inf, x, eps=eps, timeout_s=80)
    assert m.stats["unstable_relus"] > 0 and m.exact
    engine = float(certify_drift(g, train, inf, x, region=Region(eps=eps)).linf[0])
    assert m.value <= fr(engine)
    corner = (x[0] + eps * np.sign(np.random.default_rng(5).standard_normal(3))).astype(np.float32)
    assert realized_drift(g, train, inf, corner, programs=2) <= m.value


def test_outside_the_encoding_is_a_clear_error() -> None:
    from onnx import TensorProto, helper

    from kcverify.models.ir import from_onnx

    node = helper.make_node("Softmax", ["x"], ["y"], name="sm", axis=-1)
    gp = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 3])],
                           [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 3])])
    g = from_onnx(helper.make_model(gp, opset_imports=[helper.make_opsetid("", 17)]))
    with pytest.raises(NotEncodable, match="ops outside the SMT encoding: Softmax"):
        max_drift(g, TRAIN, INF, np.zeros((1, 3), np.float32))
    d = smt_decide_block(g, TRAIN, INF, np.zeros((1, 3), np.float32), 0.1)
    assert d.verdict == "skipped" and "Softmax" in d.note
