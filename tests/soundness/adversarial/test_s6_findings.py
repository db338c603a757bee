"""Session 6's findings, one minimal reproducer each (/work/notes/s6/adv_findings.md), marked
xfail(strict=True) while open: the day a fix lands the test passes, strict xfail fails, and the
mark comes off."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

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
