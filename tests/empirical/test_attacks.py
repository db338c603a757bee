"""Quantities on concrete outputs (hand-computed), program search and region search."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from kcverify.empirical.attacks import Program, program_pairs, search_programs, search_region
from kcverify.empirical.metrics import MetricInputs
from kcverify.empirical.quantities import element_values, evaluate_query, query_values


@dataclass(frozen=True)
class Q:
    """Stand-in for kcverify.dsl.NumericalQuery."""

    slice: str
    quantity: str
    aggregate: str
    op: str
    threshold: float
    temperature: float = 1.0
    per_position: bool = False
    k: int | None = None


def _lsm(row: list[float]) -> list[float]:
    m = max(row)
    s = math.log(sum(math.exp(v - m) for v in row))
    return [v - m - s for v in row]


def test_quantities_by_hand() -> None:
    zt = np.array([[[1.0, 0.0, 0.0], [0.0, 2.0, 0.0]]])  # 1 input, 2 positions, vocab 3
    zi = np.array([[[1.0, 0.5, 0.0], [0.0, 2.0, -1.0]]])
    x = MetricInputs(zt, zi)
    assert element_values("logit_linf", x).tolist() == [[0.5, 1.0]]
    assert element_values("logit_l2", x).tolist() == [[0.5, 1.0]]
    tokens = np.array([[2, 1]])  # observed next token at t = 0 is 1
    lp, lq = _lsm([1.0, 0.0, 0.0]), _lsm([1.0, 0.5, 0.0])
    assert element_values("logprob_abs", x, tokens)[0, 0] == pytest.approx(abs(lq[1] - lp[1]))
    assert element_values("ratio_dev", x, tokens)[0, 0] == pytest.approx(abs(math.exp(lq[1] - lp[1]) - 1))
    p, q = [math.exp(v) for v in lp], [math.exp(v) for v in lq]
    assert element_values("tv", x)[0, 0] == pytest.approx(0.5 * sum(abs(a - b) for a, b in zip(p, q)))
    assert element_values("kl", x)[0, 0] == pytest.approx(sum(a * math.log(a / b) for a, b in zip(p, q)))
    assert element_values("top1_agree", x).tolist() == [[1.0, 1.0]]
    assert element_values("topk_agree", x, k=2).tolist() == [[1.0, 1.0]]  # same top-2 sets


def test_topk_agree_sets() -> None:
    zt = np.array([[3.0, 2.0, 1.0, 0.0]])
    assert element_values("topk_agree", MetricInputs(zt, np.array([[2.0, 3.0, 1.0, 0.0]])), k=2)[0, 0] == 1
    assert element_values("topk_agree", MetricInputs(zt, np.array([[3.0, 0.0, 1.0, 2.0]])), k=2)[0, 0] == 0


def test_query_aggregates_and_where() -> None:
    zt = np.zeros((3, 2, 4))
    zi = zt.copy()
    zi[1, 1, 2] = 0.7
    zi[2, 0, 0] = 0.2
    x = MetricInputs(zt, zi)
    o = evaluate_query(Q("s", "logit_linf", "max", "<=", 0.5), x)
    assert not o.holds and o.value == pytest.approx(0.7) and o.where == (1, 0)  # per input: t = 0
    o = evaluate_query(Q("s", "logit_linf", "max", "<=", 0.5, per_position=True), x)
    assert o.where == (1, 1) and o.margin == pytest.approx(-0.2)
    o = evaluate_query(Q("s", "logit_linf", "mean", "<=", 0.5), x)
    assert o.holds and o.value == pytest.approx(0.3) and o.where is None
    assert query_values(Q("s", "logit_linf", "max", "<=", 1), x).shape == (3, 1)
    agree = evaluate_query(Q("s", "top1_agree", "max", ">=", 1.0, per_position=True), x)
    assert not agree.holds and agree.where == (1, 1)  # forall t: agree fails where zi moved argmax


# -- a fake model: train logits W x, inference logits (W + E) x with program-dependent E ---------
W = np.random.default_rng(0).normal(size=(8, 4))


def fake_run(spec: str, feeds: dict, program: Program) -> np.ndarray:
    x = np.asarray(feeds["x"], dtype=np.float64)
    z = x @ W
    if spec == "inf":
        bump = {"up": 0.02, "down": -0.02}.get(program.rounding, 0.0)
        z = z + 0.05 * x.sum(axis=-1, keepdims=True) + bump
    return z


def test_program_pairs_portfolio() -> None:
    pairs = program_pairs(8)
    assert len(pairs) == 8 and len(set(pairs)) == 8
    assert pairs[1] == (Program(rounding="up"), Program(rounding="down"))


def test_search_programs_finds_and_replays() -> None:
    feeds = {"x": np.ones((3, 8))}  # drift 0.4 everywhere, +-0.02 by rounding
    found = search_programs(Q("s", "logit_linf", "max", "<=", 0.41), "train", "inf", feeds, fake_run)
    assert found.counterexample is not None and found.counterexample.replayed
    assert found.worst.value == pytest.approx(0.42)
    assert found.inf_program.rounding == "up"
    ok = search_programs(Q("s", "logit_linf", "max", "<=", 0.5), "train", "inf", feeds, fake_run)
    assert ok.counterexample is None and ok.worst.holds and ok.tried == 8


def test_search_region_reaches_a_corner() -> None:
    center = {"x": np.zeros((2, 8))}  # drift at the centre: 0 (no rounding bump with nearest)
    q = Q("s", "logit_linf", "max", "<=", 0.3)
    r = search_region(q, "train", "inf", center, "x", eps=1.0, run=fake_run, steps=10, samples=4)
    # the worst point of the box is a corner with every coordinate +-1: drift 0.05 * 8 = 0.4;
    # the centre and a random point stay far below 0.3, so the ascent had to work
    assert r.counterexample is not None and r.counterexample.replayed
    assert 0.3 < r.worst.value <= 0.4 + 1e-12 and r.history == sorted(r.history, reverse=True)
    pt = np.array(r.counterexample.input_point)
    assert np.all(np.abs(pt) <= 1.0 + 1e-12)
    safe = search_region(Q("s", "logit_linf", "max", "<=", 0.45), "train", "inf", center, "x",
                         eps=1.0, run=fake_run, steps=3, samples=2)
    assert safe.counterexample is None and safe.worst.value <= 0.4 + 1e-12


def test_search_region_l2_stays_in_ball() -> None:
    center = {"x": np.zeros((1, 8))}
    q = Q("s", "logit_linf", "max", "<=", 0.01)
    r = search_region(q, "train", "inf", center, "x", eps=0.5, run=fake_run, norm="l2", steps=4,
                      samples=2)
    assert r.counterexample is not None
    assert np.linalg.norm(r.counterexample.input_point) <= 0.5 + 1e-9
    # on the L2 ball the largest |0.05 * sum x| is 0.05 * 0.5 * sqrt(8)
    assert r.worst.value <= 0.05 * 0.5 * math.sqrt(8) + 1e-9


def _mlp(root: Path):
    from kcverify.empirical.attacks import kernel_runner
    from kcverify.kernels.spec import parse_kernel_spec
    from kcverify.models.ir import load_onnx

    path = root / "models" / "mlp_tiny.onnx"
    if not path.exists():
        pytest.skip("no example MLP")
    graph = load_onnx(path)
    train = parse_kernel_spec("train", {"compute": "fp32", "accumulate": "fp32"})
    inf = parse_kernel_spec("inf", {"weights": {"format": "fp8_e4m3", "scale": "per_channel"},
                                    "activations": {"format": "fp8_e4m3", "scale": "dynamic_per_tensor"},
                                    "accumulate": "fp32", "compute": "fp32"})
    return graph, train, inf, kernel_runner(graph)


def test_program_search_on_example_mlp(root: Path) -> None:
    graph, train, inf, run = _mlp(root)
    x = np.random.default_rng(0).normal(size=(4, 4)).astype(np.float32)
    feeds = {graph.inputs[0].name: x}
    r = search_programs(Q("all", "logit_linf", "max", "<=", 1e-6), train, inf, feeds, run, pairs=4)
    assert r.counterexample is not None and r.counterexample.replayed  # fp8 drifts more than 1e-6
    assert r.counterexample.replay_value == pytest.approx(r.worst.value, rel=1e-9)
    assert 0 < r.worst.value < 1.0
    safe = search_programs(Q("all", "logit_linf", "max", "<=", 10.0), train, inf, feeds, run, pairs=4)
    assert safe.worst.holds and safe.counterexample is None


def test_region_search_on_example_mlp(root: Path) -> None:
    graph, train, inf, run = _mlp(root)
    name = graph.inputs[0].name
    x = np.random.default_rng(1).normal(size=(2, 4))
    centre = search_programs(Q("all", "logit_linf", "max", "<=", 10.0), train, inf, {name: x}, run,
                             pairs=1).worst.value
    q = Q("all", "logit_linf", "max", "<=", centre)  # the centre meets it; does the box?
    r = search_region(q, train, inf, {name: x}, name, eps=0.5, run=run, steps=4, samples=2)
    assert r.worst.value >= centre  # the search never reports less than where it started
    if r.counterexample is not None:
        assert r.counterexample.replayed
        assert np.all(np.abs(np.array(r.counterexample.input_point) - x[r.counterexample.input_index])
                      <= 0.5 + 1e-6)


@pytest.mark.slow
def test_program_search_on_tiny_decoder(root: Path) -> None:
    from dataclasses import replace

    from kcverify.dsl import load_contract, numerical_query
    from kcverify.empirical.attacks import kernel_runner
    from kcverify.empirical.slices import load_slice
    from kcverify.models.ir import load_onnx

    path = root / "examples" / "contracts" / "fp8-deploy.yaml"
    if not path.exists():
        pytest.skip("no fp8 example contract")
    c = load_contract(path)
    graph = load_onnx(c.resolve(c.model.onnx))
    data = load_slice(c.slices["safety"], base_dir=path.parent)
    feeds = {k: v[:2] for k, v in data.feeds([v.name for v in graph.inputs]).items()}
    query = numerical_query(c.clause("N-FP8-SAFE-1"))
    run = kernel_runner(graph)
    tight = replace(query, threshold=1e-6)
    r = search_programs(tight, c.kernels["train"], c.kernels["inf"], feeds, run, pairs=2)
    assert r.counterexample is not None and r.counterexample.replayed
    assert r.counterexample.replay_value == pytest.approx(r.worst.value, rel=1e-9)


def test_snap_inside_keeps_float32_points_in_the_ball() -> None:
    from kcverify.empirical.attacks import snap_inside

    rng = np.random.default_rng(3)
    c = (rng.normal(size=64) * 100).astype(np.float32).astype(np.float64)
    eps = 0.01
    for norm in ("linf", "l2"):
        d = rng.choice([-1.0, 1.0], size=64) * eps
        if norm == "l2":
            d = d / np.linalg.norm(d) * eps
        x = snap_inside(c + d, c, eps, norm, np.dtype(np.float32))
        assert x.dtype == np.float32
        dist = x.astype(np.float64) - c
        assert (np.abs(dist).max() if norm == "linf" else np.linalg.norm(dist)) <= eps
        assert np.abs(dist).max() > 0.9 * (eps if norm == "linf" else eps / 8)  # still near the edge


def test_nan_output_is_the_worst_value_not_skipped() -> None:
    """A NaN in the inference output (an overflow, inf - inf) is no bounded drift: the query's
    value is +inf for an upper bound (-inf for a lower one), it never holds, and a program pair
    producing it wins the search over every finite pair (NaN < x is False: it used to lose)."""
    zt = np.zeros((2, 1, 3))
    zi = zt.copy()
    zi[1, 0, 2] = np.nan
    o = evaluate_query(Q("s", "logit_linf", "max", "<=", 100.0), MetricInputs(zt, zi))
    assert o.value == math.inf and not o.holds and o.margin == -math.inf and o.where == (1, 0)
    o = evaluate_query(Q("s", "logit_linf", "mean", "<=", 100.0), MetricInputs(zt, zi))
    assert o.value == math.inf and not o.holds

    def nan_late(spec: str, feeds: dict, program: Program) -> np.ndarray:
        z = fake_run(spec, feeds, program)
        return z * np.nan if spec == "inf" and program.rounding == "down" else z

    found = search_programs(Q("s", "logit_linf", "max", "<=", 10.0), "train", "inf",
                            {"x": np.ones((3, 8))}, nan_late)
    assert found.worst.value == math.inf
    assert found.counterexample is not None and found.counterexample.replayed
