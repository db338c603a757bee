"""A transformer clause proved formally: the weight-only fp8 contract's one-input slice is bounded
by `best` with the zonotope (examples/contracts/w8-decoder.yaml), the certificate checks (the
checker re-runs every block with the zonotope)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kcverify.cli import main


@pytest.mark.slow
def test_w8_probe_is_proved_and_checks(tmp_path: Path, workspace) -> None:  # type: ignore[no-untyped-def]
    model, contract = workspace("tiny_decoder.onnx", "w8-decoder.yaml")
    report = tmp_path / "out" / "report.json"
    assert main(["prove", str(contract), str(model), "--report", str(report), "--quiet"]) == 0
    by_id = {c["id"]: c for c in json.loads(report.read_text())["clauses"]}
    probe = by_id["N-W8-PROBE"]
    assert probe["verdict"] == "proved"
    assert 0 < probe["bound"] <= 0.5  # measured 0.188; the intervals alone give inf
    cert = model.with_name(model.name + ".kcert.json")
    # the checker re-runs every block from its stored in_state; with intervals alone layer1's
    # output would not fit inside the stored (zonotope) bound, so this also shows the re-run
    # derives the same forms
    assert main(["check", str(cert), str(model), str(contract)]) == 0
