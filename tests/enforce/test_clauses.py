"""Clauses re-evaluated on trace records: the metric and condition paths, unknowns, O-TRACE, H."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kcverify.cli import main
from kcverify.dsl import load_contract
from kcverify.empirical.evaluate import evaluate_metric
from kcverify.empirical.metrics import get_metric
from kcverify.enforce.clauses import _metric_inputs, _ragged_outcome, evaluate_contract
from kcverify.enforce.monitor import evaluate_window, health
from kcverify.enforce.traces import read_traces, record_from_json

ROOT = Path(__file__).resolve().parents[2]

CONTRACT = """\
contract: rl-traces
model: {onnx: MODEL}
kernels:
  train: {compute: fp32}
  inf: {compute: fp32, weights: fp8_e4m3}
slices:
  live: {traces: live.jsonl}
  other: {traces: other.jsonl}
clauses:
  - id: N-LP
    family: numerical
    assert: "forall x in live, t: abs(logprob_inf(x, t) - logprob_train(x, t)) <= 0.15"
    level: L3
  - id: N-KL
    family: numerical
    assert: "forall x in live, t: kl(probs_train(x, t), probs_inf(x, t)) <= 0.01"
    level: L2
  - {id: S-OTHER, family: statistical, metric: mean_kl, slices: [other], threshold: 0.01}
  - {id: R-LAT, family: runtime, metric: p95_latency_ms, slices: [live], threshold: 5, level: L1}
"""


def _record(i: int, lp_diff: list[float], build: str = "b1", hardware: str = "cpu") -> dict:
    lpt = [-1.0, -2.0, -0.5]
    return {"request_id": f"r{i}", "time": f"2025-01-01T00:00:{i:02d}Z", "slices": [],
            "kernel": {"name": "inf", "fingerprint": {"build": build, "attention": "sdpa",
                                                      "quantisation": "fp8",
                                                      "hardware": hardware}},
            "input_ids": [1, 2, 3], "tokens": [4, 5, 6], "logprob_train": lpt,
            "logprob_inf": [a + d for a, d in zip(lpt, lp_diff)], "latency_ms": 1.0 + i / 100}


@pytest.fixture
def rl(tmp_path: Path):
    (tmp_path / "c.yaml").write_text(CONTRACT.replace("MODEL", str(ROOT / "models" /
                                                                   "mlp_tiny.onnx")))
    rows = [_record(i, [0.01 * i, -0.02, 0.0]) for i in range(10)]
    (tmp_path / "live.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def test_sampled_token_records(rl):
    contract = load_contract(rl / "c.yaml")
    records, _ = read_traces(rl / "live.jsonl")
    for r in records:
        r.slices = ("live",)  # what the contract's {traces: live.jsonl} slice does
    out = {o.id: o for o in evaluate_contract(contract, records)}
    assert out["N-LP"].verdict == "passed" and out["N-LP"].value == pytest.approx(0.09)
    assert out["N-KL"].verdict == "unknown" and "needs both kernels' logits" in out["N-KL"].note
    assert out["S-OTHER"].verdict == "unknown" and "no records in this slice" in out["S-OTHER"].note
    assert out["R-LAT"].verdict == "unknown"  # 10 calls cannot show p95 <= 5 at 95 %
    assert out["O-TRACE"].verdict == "passed"
    # H over the clauses with a value: N-LP (L3, d=0), R-LAT (L1, d=0), O-TRACE (L2, d=0)
    assert health(list(out.values())) == 0.0


def test_monitor_uses_the_contracts_trace_slice(rl, capsys):
    rows = [_record(i, [0.01 * i, -0.02, 0.0]) for i in range(10)]
    rows[7]["logprob_inf"][1] = rows[7]["logprob_train"][1] + 0.3  # 2x the threshold
    (rl / "live.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["monitor", str(rl / "c.yaml"), str(rl / "live.jsonl"), "--json"]) == 1
    w = json.loads(capsys.readouterr().out)["windows"][0]
    lp = next(c for c in w["clauses"] if c["id"] == "N-LP")
    assert lp["verdict"] == "failed" and lp["value"] == pytest.approx(0.3)
    assert lp["worst"]["request_id"] == "r7" and lp["worst"]["where"].endswith("live.jsonl:8")
    assert w["action"] == "fallback"  # N-LP is L3
    # H = w_L3 * d / (w_L3 + w_L2 + w_L1): d(N-LP) = (0.3 - 0.15) / 0.15 = 1 (capped)
    assert w["health"] == pytest.approx(3 * 1.0 / (3 + 2 + 1))


def test_fingerprint_change_within_a_build_is_an_observability_violation(rl):
    contract = load_contract(rl / "c.yaml")
    rows = [_record(i, [0.0, 0.0, 0.0]) for i in range(4)]
    rows[2]["kernel"]["fingerprint"]["hardware"] = "gpu-h100"
    records = [record_from_json(r, "x.jsonl", i + 1) for i, r in enumerate(rows)]
    for r in records:
        r.slices = ("live",)
    w = evaluate_window(contract, records, 0, records[0].time, records[-1].time)
    o = next(c for c in w.clauses if c.id == "O-TRACE")
    assert o.verdict == "failed" and "build 'b1' has 2 different fingerprints" in o.note
    assert "x.jsonl:3" in o.note and w.action == "guard"
    rows[2]["kernel"]["fingerprint"]["build"] = "b2"  # another build may differ
    records = [record_from_json(r, "x.jsonl", i + 1) for i, r in enumerate(rows)]
    assert not any(c.violated for c in evaluate_contract(contract, records)
                   if c.id == "O-TRACE")


def test_ragged_path_agrees_with_evaluate_metric(e5):
    """Records of unequal length go through _ragged_outcome; on equal-length records it must
    give exactly what kcverify.empirical.evaluate_metric gives."""
    records, _ = read_traces(e5.faulty)
    records = records[:80]
    for name, threshold, budget in (("mean_kl", 0.005, 0.05), ("p95_logit_l2", 0.5, None),
                                    ("top1_overlap", 0.9, 0.2)):
        m = get_metric(name)
        a = evaluate_metric(m, threshold, _metric_inputs(records, 1.0), budget)
        b = _ragged_outcome(m, threshold, records, budget, 0.95, m.direction, 1.0)
        assert a.value == pytest.approx(b.value, rel=1e-12)
        assert a.decision.outcome == b.decision.outcome
        assert a.decision.violations == b.decision.violations
        np.testing.assert_allclose(a.per_unit, b.per_unit, rtol=1e-12)


def test_ragged_records_are_evaluated(e5, tmp_path):
    """Two lengths of records in one slice: the metric is still decided (no silent drop)."""
    contract = load_contract(e5.contract)
    rows = [json.loads(ln) for ln in e5.clean.read_text().splitlines()[:40]]
    for r in rows[::2]:  # every other record gets a second position
        r["logits_train"] = [r["logits_train"], r["logits_train"]]
        r["logits_inf"] = [r["logits_inf"], r["logits_inf"]]
    records = [record_from_json(r, "r.jsonl", i + 1) for i, r in enumerate(rows)]
    out = {o.id: o for o in evaluate_contract(contract, records)}
    assert out["S-SRV-1"].n == 40 and out["S-SRV-1"].verdict == "passed"
    assert out["N-SRV-1"].verdict == "passed" and out["N-SRV-1"].n == 40
