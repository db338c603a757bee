"""The prove report says how many casts sit on an fp8 rounding boundary (issue 12): per bounded
slice, the unstable casts of each input, in the report's meta, its JSON and its table."""

from __future__ import annotations

import json

import numpy as np
import onnx

from kcverify.api import prove
from kcverify.report.table import render_table
from tests.bounds.test_cases import X, _model

CONTRACT = """contract: tie
version: 1.0.0
model: {onnx: tie.onnx}
kernels:
  train: {compute: fp32, accumulate: fp32}
  inf: {compute: fp32, accumulate: fp32,
        activations: {format: fp8_e4m3, scale: dynamic_per_tensor}}
slices:
  tie: {inputs: tie.npz}
clauses:
  - id: N-1
    family: numerical
    assert: "forall x in tie: linf(logits_inf(x) - logits_train(x)) <= 5.0"
    level: L2
    action: guard
"""


def test_the_report_counts_unstable_casts(tmp_path) -> None:
    onnx.save(_model(), tmp_path / "tie.onnx")
    np.savez(tmp_path / "tie.npz", x=np.repeat(X, 2, axis=0))
    (tmp_path / "c.yaml").write_text(CONTRACT)
    res = prove(tmp_path / "c.yaml", tmp_path / "tie.onnx", domain="interval")
    assert res.report.meta["unstable_casts"] == {"tie": [1, 1]}
    assert "unstable casts" in render_table(res.report) and "tie 2 (max 1 per input)" in \
        render_table(res.report)
    json.dumps(res.report.meta)  # strict JSON-able
