"""Session 6's findings, one minimal reproducer each (/work/notes/s6/adv_findings.md), marked
xfail(strict=True) while open: the day a fix lands the test passes, strict xfail fails, and the
mark comes off."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[3]

FP16_ACC = """contract: s6-fp16-acc
version: 1.0.0
kernels:
  train: {compute: fp32, accumulate: fp32}
  inf: {weights: {format: fp8_e4m3, scale: per_channel},
        activations: {format: fp8_e4m3, scale: dynamic_per_tensor},
        accumulate: fp16, compute: fp16}
slices:
  pts: {inputs: one.npz}
clauses:
  - id: N-1
    family: numerical
    assert: "forall x in pts: linf(logits_inf(x) - logits_train(x)) <= 100.0"
    level: L2
    action: guard
escalation: {L1: log, L2: guard, L3: fallback}
"""


@pytest.mark.slow  # test_f3 runs the same prove
def test_f1_fp16_accumulator_prove_does_not_crash(tmp_path: Path) -> None:
    """fp8 activations and an fp16 accumulator on mlp_tiny: the interval bound is infinite
    (448^2 > 65504), the planner tries SMT, and smt.encode._cast_plan converts the next
    layer's infinite amax to a Fraction: a traceback, exit 1 (neither 'unknown' nor the
    internal-error exit 3)."""
    (tmp_path / "c.yaml").write_text(FP16_ACC)
    np.savez(tmp_path / "one.npz", x=np.array([[0.5, -0.25, 1.0, 0.125]], np.float32))
    r = subprocess.run([sys.executable, "-m", "kcverify", "prove", str(tmp_path / "c.yaml"),
                        str(ROOT / "models" / "mlp_tiny.onnx"), "--cert",
                        str(tmp_path / "c.kcert.json"), "--report", str(tmp_path / "r.json")],
                       capture_output=True, text=True, timeout=300)
    assert "Traceback" not in r.stderr, r.stderr.strip().splitlines()[-1]
    assert r.returncode in (0, 1), r.returncode


@pytest.mark.slow  # test_s6_tamper[in-inconsistent] checks it in-process
def test_f2_infeasible_in_state_is_refused_not_a_crash(tmp_path: Path) -> None:
    """mlp-fp8's contract on mlp_tiny proved; the last block's in_state drift interval halved
    (train and inf kept). ``kcverify check`` re-runs the block from that box; the Gemm rule
    intersects two enclosures, finds them empty and raises InternalError ("two enclosures
    disagree, a soundness bug"): exit 3 with a traceback, where a certificate that does not
    check should give exit 1 and a FAIL line."""
    import copy
    import json

    from tests.soundness.adversarial.test_s6_tamper import MLP, m_in_inconsistent
    from tests.soundness.adversarial.test_s6_util import prove_cert

    model = ROOT / "models" / "mlp_tiny.onnx"
    st = prove_cert(tmp_path, MLP, model, "mlp")
    st2 = copy.deepcopy({k: v for k, v in st.items() if not k.startswith("s6:")})
    m_in_inconsistent(st2, {})
    cert = tmp_path / "t.kcert.json"
    cert.write_text(json.dumps(st2, sort_keys=True))
    r = subprocess.run([sys.executable, "-m", "kcverify", "check", str(cert), str(model),
                        st["s6:contract"]], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr, (r.returncode, r.stderr[-300:])


def test_f3_fp16_accumulator_prove_writes_a_report(tmp_path: Path) -> None:
    """F1's contract and input: the bound is inf, SMT is skipped, the program search realises
    an fp16 overflow (a NaN drift) and the certificate encoder refuses the NaN: exit 1 with one
    error line, neither --report nor the certificate written. A valid contract on a valid model
    should end with a decided clause (refuted / failed / unknown) in a report."""
    (tmp_path / "c.yaml").write_text(FP16_ACC)
    np.savez(tmp_path / "one.npz", x=np.array([[0.5, -0.25, 1.0, 0.125]], np.float32))
    r = subprocess.run([sys.executable, "-m", "kcverify", "prove", str(tmp_path / "c.yaml"),
                        str(ROOT / "models" / "mlp_tiny.onnx"), "--cert",
                        str(tmp_path / "c.kcert.json"), "--report", str(tmp_path / "r.json")],
                       capture_output=True, text=True, timeout=300)
    assert "error:" not in r.stderr, r.stderr.strip().splitlines()[-1]
    assert (tmp_path / "r.json").exists()
