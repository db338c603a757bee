"""EmpiricalRun on the example MLP: shared outputs, metric clauses, numerical fallback."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kcverify.empirical.escalation import escalate
from kcverify.report.model import Report, Verdict

CONTRACT = """
contract: mlp-run
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
  all:  {{inputs: data.npz}}
  near: {{inputs: data.npz, region: {{space: input, norm: linf, eps: 0.05}}}}
clauses:
  - id: N-tight
    family: numerical
    assert: "forall x in all: linf(logits_inf(x) - logits_train(x)) <= 0.000001"
    level: L3
  - id: N-loose
    family: numerical
    assert: "forall x in near: linf(logits_inf(x) - logits_train(x)) <= 10"
    level: L2
  - {{id: S-1, family: statistical, metric: top1_overlap, slices: [all], threshold: 0.99,
     budget: 0.05, level: L2}}
  - {{id: S-2, family: statistical, metric: p99_logit_l2, slices: [all], threshold: 0.000001,
     budget: 0.05, level: L2, action: guard}}
  - {{id: R-1, family: runtime, metric: p95_latency_ms, slices: [all], threshold: 10000,
     level: L1}}
"""


@pytest.fixture
def run(root: Path, tmp_path: Path):
    from kcverify.dsl import load_contract
    from kcverify.empirical.run import EmpiricalRun
    from kcverify.models.ir import load_onnx

    model = root / "models" / "mlp_tiny.onnx"
    if not model.exists():
        pytest.skip("no example MLP")
    np.savez(tmp_path / "data.npz", x=np.random.default_rng(0).normal(size=(80, 4)).astype(np.float32))
    (tmp_path / "c.yaml").write_text(CONTRACT.format(model=model))
    contract = load_contract(tmp_path / "c.yaml")
    return EmpiricalRun(contract, load_onnx(model), min_repeats=1, warmup=1)


def test_metric_clauses(run) -> None:
    c = run.contract
    s1 = run.decide(c.clause("S-1"))
    assert s1.sample_size == 80 and s1.confidence == 0.95 and s1.metric == "top1_overlap"
    assert s1.verdict in (Verdict.PASSED, Verdict.UNKNOWN, Verdict.FAILED)
    s2 = run.decide(c.clause("S-2"))  # fp8 drift far above 1e-6 on every input
    assert s2.verdict is Verdict.FAILED and s2.violations == 80 and s2.action == "guard"
    r1 = run.decide(c.clause("R-1"))
    assert r1.verdict is Verdict.PASSED and r1.sample_size >= 59  # enough calls for p95
    assert len(run._outputs) == 1  # both clauses shared one run of the kernels
    rep = escalate(Report(str(c.path), "mlp_tiny.onnx", [s1, s2, r1], escalation=dict(c.escalation)))
    assert rep.exit_code == 1 and rep.action == "guard"


def test_numerical_fallback(run) -> None:
    from kcverify.dsl import numerical_queries

    c = run.contract
    tight = run.check_numerical(c.clause("N-tight"), numerical_queries(c.clause("N-tight")), pairs=2)
    assert tight.verdict is Verdict.REFUTED and tight.evidence["counterexample"]["replayed"]
    assert "replayed counterexample" in tight.note
    loose = run.check_numerical(c.clause("N-loose"), numerical_queries(c.clause("N-loose")), pairs=2,
                                region_steps=2)
    assert loose.verdict is Verdict.PASSED and "region-search" in loose.method
    assert "not a proof" in loose.note and loose.value < 10
