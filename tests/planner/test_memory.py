"""prove under a memory budget (ProveOptions.memory, `--memory`): blocks whose method cannot fit
are bounded with intervals, the report says so, and the certificate still checks (the checker
re-runs the method each record names)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kcverify.bounds import memory
from kcverify.bounds.engine import blocks_of, expanded
from kcverify.cli import main
from kcverify.models.ir import load_onnx

CONTRACT = """\
contract: mlp-two
version: 1.0.0
model: {onnx: models/mlp_tiny.onnx, sha256: auto}
kernels:
  train: {compute: fp32, accumulate: fp32}
  inf:
    weights: {format: fp8_e4m3, scale: per_channel}
    activations: {format: fp8_e4m3, scale: dynamic_per_tensor}
    accumulate: fp32
    compute: fp32
slices:
  two: {inputs: two.npz}
clauses:
  - id: N-1
    family: numerical
    assert: "forall x in two: linf(logits_inf(x) - logits_train(x)) <= 0.25"
    level: L2
    action: guard
escalation: {L1: log, L2: guard, L3: fallback}
"""


def test_prove_under_a_small_budget_notes_and_checks(tmp_path: Path, workspace) -> None:  # type: ignore[no-untyped-def]
    model, _ = workspace("mlp_tiny.onnx", "mlp-fp8.yaml")
    g = load_onnx(model)
    pts = np.load(tmp_path / "examples/data/mlp_points.npz")
    np.savez(tmp_path / "two.npz", **{pts.files[0]: pts[pts.files[0]][:2]})
    contract = tmp_path / "mlp-two.yaml"
    contract.write_text(CONTRACT)
    sizes = memory.tensor_sizes(g, {g.inputs[0].name: pts[pts.files[0]][:1]})
    budget = max(memory.estimate(expanded(b.graph, "linear"), sizes, "interval")
                 for b in blocks_of(g))
    report = tmp_path / "report.json"
    # linear: one input per chunk, intervals + symbolic intervals + zonotope; the budget holds
    # the intervals only
    assert main(["prove", str(contract), str(model), "--domain", "linear", "--memory",
                 str(budget), "--report", str(report), "--quiet"]) in (0, 1)
    meta = json.loads(report.read_text())["meta"]
    notes = meta["memory_notes"]
    assert notes and all("> budget" in n and n.endswith("used interval") for n in notes)
    cert = model.with_name(model.name + ".kcert.json")
    assert main(["check", str(cert), str(model), str(contract)]) == 0
