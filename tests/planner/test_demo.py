"""`./dev demo` as a test: the shipped FP8 contract on the shipped tiny decoder decides every
clause (numerical, statistical with confidence, runtime, static), then check passes, and admit
follows the registry policy on clauses decided on evidence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kcverify.cli import main


@pytest.mark.slow
def test_demo_prove_check_admit(tmp_path: Path, workspace) -> None:  # type: ignore[no-untyped-def]
    model, contract = workspace("tiny_decoder.onnx", "fp8-deploy.yaml")
    report, html = tmp_path / "out" / "report.json", tmp_path / "out" / "report.html"
    assert main(["prove", str(contract), str(model), "--report", str(report), "--html", str(html),
                 "--quiet"]) == 0
    body = json.loads(report.read_text())
    by_id = {c["id"]: c for c in body["clauses"]}
    assert set(by_id) == {"N-FP8-1", "N-FP8-SAFE-1", "N-FP8-SAFE-2", "N-FP8-2", "S-FP8-1",
                          "R-FP8-1", "O-FP8-1"}
    assert all(c["verdict"] in ("proved", "passed") for c in body["clauses"])
    # honest headlines: a certifiable clause that passed was decided on evidence, and says so
    for c in body["clauses"]:
        want = "proof" if c["verdict"] == "proved" else "static" if c["method"] == "static" \
            else "evidence"
        assert c["decided_by"] == want, c
    on_evidence = [c for c in body["clauses"]
                   if c["klass"] == "certifiable" and c["decided_by"] == "evidence"]
    assert body["verdict"] == ("holds on evidence" if on_evidence else "holds")
    assert body["summary"].startswith(f"{body['tally']['proved']} proved · "
                                      f"{body['tally']['on evidence']} on evidence")
    page = html.read_text()
    assert f">{body['verdict']}</div>" in page and f">{body['summary']}</div>" in page
    for cid in ("S-FP8-1", "R-FP8-1"):
        assert by_id[cid]["sample_size"] >= 59 and by_id[cid]["confidence"] == pytest.approx(0.95)
    assert "<svg" in html.read_text()
    cert = model.with_name(model.name + ".kcert.json")
    assert main(["check", str(cert), str(model), str(contract)]) == 0
    reg = ["registry", "--registry", str(tmp_path / "reg"), "admit", str(model), str(contract),
           str(cert)]
    # hard L2/L3 numerical clauses decided on evidence do not pass the default policy ...
    hard_on_evidence = [c for c in on_evidence if c["family"] == "numerical"
                        and c["level"] in ("L2", "L3")]
    assert main(reg) == (1 if hard_on_evidence else 0)
    # ... and do pass one that accepts evidence for them
    assert main([*reg, "--require", "L2=evidence", "--require", "L3=evidence"]) == 0
