"""Deciding statistical and runtime clauses; running both kernels on the shipped example."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from kcverify.empirical.escalation import escalate
from kcverify.empirical.evaluate import (
    evaluate_clause,
    evaluate_metric,
    min_sample_size,
    slice_inputs,
)
from kcverify.empirical.metrics import MetricInputs
from kcverify.empirical.runtime import RuntimeSample
from kcverify.report.model import Report, Verdict


@dataclass(frozen=True)
class FakeClause:
    id: str
    family: str
    metric: str
    threshold: float
    budget: float | None
    level: str = "L2"
    action: str = "guard"
    slices: tuple[str, ...] = ("all",)
    temperature: float = 1.0


def classifier(n: int, flips: int, seed: int = 0) -> MetricInputs:
    """n inputs, 1 position, 4 classes; the inference kernel flips the top-1 of ``flips`` inputs."""
    rng = np.random.default_rng(seed)
    zt = rng.normal(size=(n, 4))
    zi = zt + rng.normal(scale=1e-3, size=zt.shape)
    top = np.argmax(zt, axis=1)
    for i in range(flips):
        zi[i, (top[i] + 1) % 4] = zt[i].max() + 1.0
    return MetricInputs(zt, zi)


def test_min_sample_size() -> None:
    assert min_sample_size(0.05, 0.95) == 59  # 1 - 0.05^(1/59) <= 0.05 < 1 - 0.05^(1/58)
    assert 1 - 0.05 ** (1 / 59) <= 0.05 < 1 - 0.05 ** (1 / 58)


def test_soft_top1_three_outcomes() -> None:
    ok = evaluate_metric("top1_overlap", 0.99, classifier(400, 0), budget=0.02)
    assert ok.decision.outcome == "passed" and ok.decision.violations == 0 and ok.value == 1.0
    bad = evaluate_metric("top1_overlap", 0.99, classifier(400, 40), budget=0.02)
    assert bad.decision.outcome == "failed" and bad.decision.violations == 40
    assert bad.value == pytest.approx(0.9)
    few = evaluate_metric("top1_overlap", 0.99, classifier(20, 0), budget=0.05)
    assert few.decision.outcome == "unknown" and "59 inputs would decide it" in few.decision.note


def test_hard_clause_fails_on_one_violation() -> None:
    o = evaluate_metric("top1_overlap", 0.99, classifier(400, 1), budget=None)
    assert o.decision.outcome == "failed" and o.decision.violations == 1


def test_per_input_units_for_sequences() -> None:
    # 3 inputs x 2 positions; input 1 has one flipped position -> its overlap 0.5 < 0.9
    zt = np.tile(np.array([3.0, 2.0, 1.0]), (3, 2, 1))
    zi = zt.copy()
    zi[1, 0] = [0.0, 2.0, 1.0]
    o = evaluate_metric("top1_overlap", 0.9, MetricInputs(zt, zi))
    assert o.per_unit.tolist() == [1.0, 0.5, 1.0] and o.decision.violations == 1
    assert o.value == pytest.approx(5 / 6)


def test_alpha_reading_of_budget() -> None:
    x = classifier(200, 0)
    o = evaluate_metric("mean_kl", 1e-3, x, budget=0.05, budget_means="alpha")
    assert o.decision.method == "bootstrap" and o.decision.confidence == pytest.approx(0.95)
    assert o.decision.outcome == "passed"


def test_ece_gap_bootstrap() -> None:
    rng = np.random.default_rng(2)
    zt = rng.normal(scale=3.0, size=(300, 5))
    y = np.argmax(zt + rng.normal(scale=2.0, size=zt.shape), axis=1)
    x = MetricInputs(zt, zt * 0.1, labels=y)  # inference kernel much less confident
    gap = evaluate_metric("ece_gap", 0.01, x)
    assert gap.decision.outcome == "failed" and gap.value > 0.05
    assert evaluate_metric("ece_gap", 0.9, x).decision.outcome == "passed"


def test_runtime_percentile_and_memory() -> None:
    lat = np.concatenate([np.full(190, 10.0), np.full(10, 100.0)])  # 5% slow calls
    x = MetricInputs(latencies_ms=lat, peak_memory_mb=500.0)
    assert evaluate_metric("p95_latency_ms", 200.0, x).decision.outcome == "passed"
    assert evaluate_metric("p95_latency_ms", 5.0, x).decision.outcome == "failed"
    mid = evaluate_metric("p95_latency_ms", 50.0, x)  # exactly 5% over: inconclusive
    assert mid.decision.outcome == "unknown" and mid.decision.n == 200
    assert mid.decision.budget == pytest.approx(0.05)
    mem = evaluate_metric("peak_memory_mb", 400.0, x)
    assert mem.decision.outcome == "failed" and mem.decision.method == "measured"


def test_evaluate_clause_over_slices_and_escalation() -> None:
    inputs = {"all": classifier(400, 40), "safety": classifier(100, 0, seed=1)}
    c = FakeClause("S-1", "statistical", "top1_overlap", 0.99, 0.02, slices=("all", "safety", "gone"))
    r = evaluate_clause(c, inputs)
    assert r.verdict is Verdict.FAILED and r.sample_size == 500 and r.violations == 40
    assert [s.slice for s in r.slices] == ["all", "safety", "gone"]
    assert r.slices[1].verdict is Verdict.UNKNOWN  # 100 inputs cannot show <= 2%
    assert r.slices[2].note == "no data for this slice"
    assert r.value == pytest.approx(0.9) and r.confidence == 0.95
    rep = escalate(Report("c.yaml", "m.onnx", [r]))
    assert rep.exit_code == 1 and rep.action == "guard" and rep.clauses[0].action_taken == "guard"


def test_evaluate_clause_runtime_from_sample() -> None:
    sample = RuntimeSample(np.full(60, 3.0), 100.0, 50.0, "cpu", 1, 60, "test")
    x = slice_inputs(np.zeros((2, 3)), np.zeros((2, 3)), runtime=sample)
    r = evaluate_clause(FakeClause("R-1", "runtime", "p95_latency_ms", 40.0, None, "L1", "log"),
                        {"all": x})
    assert r.verdict is Verdict.PASSED and r.sample_size == 60 and r.value == 3.0
    few = slice_inputs(np.zeros((2, 3)), np.zeros((2, 3)), runtime=RuntimeSample(
        np.full(50, 3.0), 100.0, 50.0, "cpu", 1, 50, "test"))  # 50 calls cannot show <= 5%
    r = evaluate_clause(FakeClause("R-1", "runtime", "p95_latency_ms", 40.0, None), {"all": few})
    assert r.verdict is Verdict.UNKNOWN and "59 calls would decide it" in r.note


MLP_CONTRACT = """
contract: mlp-fp8
version: 1.0.0
model: {{onnx: {model}, sha256: auto}}
kernels:
  train: {{compute: fp32, accumulate: fp32}}
  inf:
    weights: {{format: fp8_e4m3, scale: per_channel}}
    activations: {{format: fp8_e4m3, scale: dynamic_per_tensor}}
    accumulate: fp32
    compute: fp32
slices:
  all: {{inputs: data.npz}}
clauses:
  - {{id: S-1, family: statistical, metric: top1_overlap, slices: [all], threshold: 0.99,
     budget: 0.5, level: L2, action: guard}}
  - {{id: R-1, family: runtime, metric: p95_latency_ms, slices: [all], threshold: 10000,
     level: L1, action: log}}
"""


def test_run_both_kernels_on_example_mlp(root: Path, tmp_path: Path) -> None:
    from kcverify.dsl import load_contract
    from kcverify.empirical.evaluate import measure_kernel_runtime, run_both_kernels
    from kcverify.empirical.slices import load_slice
    from kcverify.models.ir import load_onnx

    model = root / "models" / "mlp_tiny.onnx"
    if not model.exists():
        pytest.skip("no example MLP")
    np.savez(tmp_path / "data.npz", x=np.random.default_rng(0).normal(size=(12, 4)).astype(np.float32))
    (tmp_path / "c.yaml").write_text(MLP_CONTRACT.format(model=model))
    contract = load_contract(tmp_path / "c.yaml")
    graph = load_onnx(contract.resolve(contract.model.onnx))
    data = load_slice(contract.slices["all"], base_dir=tmp_path)
    feeds = data.feeds([v.name for v in graph.inputs])
    zt, zi = run_both_kernels(graph, contract.kernels["train"], contract.kernels["inf"], feeds,
                              batch_size=5)
    assert zt.shape == zi.shape == (12, 2) and zt.dtype == np.float64
    assert 0 < np.abs(zi - zt).max() < 1.0  # fp8 drifts, but not wildly
    exact, _ = run_both_kernels(graph, None, contract.kernels["inf"], feeds)
    assert np.abs(exact - zt).max() < 1e-5  # the fp32 training kernel is close to exact fp32
    rt = measure_kernel_runtime(graph, contract.kernels["inf"], feeds, warmup=1, repeats=5)
    assert rt.n == 60 and rt.peak_memory_mb > 0
    inputs = {"all": slice_inputs(zt, zi, runtime=rt)}
    s1 = evaluate_clause(contract.clause("S-1"), inputs)
    assert s1.sample_size == 12 and s1.confidence == 0.95 and s1.slices[0].n == 12
    r1 = evaluate_clause(contract.clause("R-1"), inputs)
    assert r1.verdict is Verdict.PASSED and r1.sample_size == 60  # 60 calls, none over 10 s


@pytest.mark.parametrize("backend", ["onnxruntime", "executor", "realization"])
def test_runtime_backends_run_the_model(root: Path, backend: str) -> None:
    from kcverify.empirical.evaluate import kernel_callable, measure_kernel_runtime
    from kcverify.kernels.spec import parse_kernel_spec
    from kcverify.models.ir import load_onnx

    model = root / "models" / "mlp_tiny.onnx"
    if not model.exists():
        pytest.skip("no example MLP")
    graph = load_onnx(model)
    spec = parse_kernel_spec("inf", {"compute": "fp32", "accumulate": "fp32"})
    x = {graph.inputs[0].name: np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32)}
    out = kernel_callable(graph, spec, backend=backend)(x)
    y = out[0] if isinstance(out, list) else out[graph.outputs[0].name].detach().numpy()
    ref = kernel_callable(graph, spec, backend="executor")(x)[graph.outputs[0].name].numpy()
    assert np.allclose(y, ref, atol=1e-5)
    s = measure_kernel_runtime(graph, spec, x, warmup=1, repeats=2, backend=backend)
    assert s.backend == backend and s.n == 6 and np.all(s.latencies_ms > 0)
    with pytest.raises(ValueError, match="unknown runtime backend"):
        kernel_callable(graph, spec, backend="tpu")
