"""kcverify promote: the four stages on traces, the decision rules, the registry's log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kcverify.cli import main
from kcverify.enforce.promote import STAGES
from kcverify.registry import Registry

ROOT = Path(__file__).resolve().parents[2]


def promote(capsys, *argv: str) -> tuple[int, dict]:
    code = main(["promote", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("stage", ["ci", "shadow", "canary"])
def test_stage_go_on_clean_no_go_on_faulty(e5, tmp_path, capsys, stage):
    reg = tmp_path / "reg"
    code, rec = promote(capsys, str(e5.contract), "--stage", stage, "--traces", str(e5.clean),
                        "--registry", str(reg))
    assert code == 0 and rec["decision"] == "go" and rec["reasons"] == []
    assert {v["family"] for v in rec["verdicts"]} == set(STAGES[stage])
    assert all(v["verdict"] == "passed" for v in rec["verdicts"])
    code, rec = promote(capsys, str(e5.contract), "--stage", stage, "--traces", str(e5.faulty),
                        "--registry", str(reg))
    assert code == 1 and rec["decision"] == "no-go"
    assert rec["reasons"][0].startswith("N-SRV-1 (numerical, hard) is failed on slice points")
    log = Registry(reg).promotions()
    assert [r["decision"] for r in log] == ["go", "no-go"] and rec["log_id"] == log[1]["id"]
    assert log[1]["record"]["kernel"]["build"] == "2025.06-r2"
    assert log[1]["record"]["traces"][0]["sha256"] and log[1]["model_sha256"]
    # and `kcverify registry log` shows both decisions, as text and as JSON
    capsys.readouterr()
    assert main(["registry", "--registry", str(reg), "log"]) == 0
    out = capsys.readouterr().out
    assert f"promote {stage}" in out and "no-go" in out
    assert main(["registry", "--registry", str(reg), "log", "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert [p["decision"] for p in body["promotions"]] == ["go", "no-go"]


def test_canary_must_show_table(e5, tmp_path, capsys):
    """The must-show as a user sees it: canary exits 0 on the clean half, 1 on the faulty half,
    naming the clause and the slice; both decisions land in the registry's log."""
    reg = str(tmp_path / "reg")
    assert main(["promote", str(e5.contract), "--stage", "canary", "--traces", str(e5.clean),
                 "--registry", reg]) == 0
    assert "stage canary: GO" in capsys.readouterr().out
    assert main(["promote", str(e5.contract), "--stage", "canary", "--traces", str(e5.faulty),
                 "--registry", reg]) == 1
    out = capsys.readouterr().out
    assert "stage canary: NO-GO" in out
    assert "no-go: N-SRV-1 (numerical, hard) is failed on slice points" in out
    assert "logged: promotion 2" in out


def test_held_out_canary(held_out, capsys):
    assert main(["promote", str(held_out.contract), "--stage", "canary", "--traces",
                 str(held_out.clean), "--no-log"]) == 0
    assert main(["promote", str(held_out.contract), "--stage", "canary", "--traces",
                 str(held_out.faulty), "--no-log"]) == 1
    capsys.readouterr()


def test_several_builds_need_build(e5, capsys):
    assert main(["promote", str(e5.contract), "--stage", "canary", "--traces",
                 str(e5.traces), "--no-log"]) == 2
    assert "the traces hold 2 builds (2025.06-r1, 2025.06-r2); name the candidate with " \
           "--build" in capsys.readouterr().err
    code, rec = promote(capsys, str(e5.contract), "--stage", "canary", "--traces",
                        str(e5.traces), "--build", "2025.06-r1", "--no-log")
    assert code == 0 and rec["kernel"]["build"] == "2025.06-r1" and rec["log_id"] is None


def test_full_needs_sustained_compliance(e5, capsys):
    code, rec = promote(capsys, str(e5.contract), "--stage", "full", "--traces", str(e5.clean),
                        "--no-log")
    assert code == 1 and "sustained compliance needs a stability window of 1800 s" \
        in rec["reasons"][0]
    code, rec = promote(capsys, str(e5.contract), "--stage", "full", "--traces", str(e5.clean),
                        "--stability", "15m", "--no-log")
    assert code == 0 and len(rec["stability"]["windows"]) == 3
    assert all(w["action"] == "none" for w in rec["stability"]["windows"])
    # the whole file as one build (the fault build relabelled): the last 15 minutes drift
    code, rec = promote(capsys, str(e5.contract), "--stage", "full", "--traces", str(e5.faulty),
                        "--stability", "15m", "--no-log")
    assert code == 1 and any("is not compliant (action fallback" in r for r in rec["reasons"])


def test_soft_clause_inconclusive_is_no_go(e5, tmp_path, capsys):
    """Ten clean requests cannot show a 5 % budget at 95 %: shadow is no-go (unknown)."""
    few = tmp_path / "few.jsonl"
    few.write_text("".join(e5.clean.read_text().splitlines(keepends=True)[:10]))
    code, rec = promote(capsys, str(e5.contract), "--stage", "shadow", "--traces", str(few),
                        "--no-log")
    assert code == 1
    assert any(r.startswith("S-SRV-2 (statistical, soft, budget 0.05) is unknown on slice "
                            "points") and "inconclusive" in r for r in rec["reasons"])


def test_stage_without_traces(e5, capsys):
    assert main(["promote", str(e5.contract), "--stage", "shadow", "--no-log"]) == 2
    assert "stage shadow is decided on traces" in capsys.readouterr().err


def test_ci_from_the_certificate(capsys):
    """ci without traces: the numerical verdicts of a certificate that checks (else no-go)."""
    from kcverify.certs.checker import check_certificate

    contract = ROOT / "examples" / "contracts" / "mlp-fp8.yaml"
    model = ROOT / "models" / "mlp_tiny.onnx"
    cert = ROOT / "certs" / "mlp-fp8.kcert.json"
    code, rec = promote(capsys, str(contract), "--stage", "ci", "--cert", str(cert), "--no-log")
    problems = check_certificate(str(cert), model, contract).problems
    ids = [v["id"] for v in rec["verdicts"]]
    assert ids == ["N-MLP-1", "N-MLP-2"]
    if problems:
        assert code == 1 and all("does not check" in r for r in rec["reasons"])
    else:
        assert code == 0 and {v["verdict"] for v in rec["verdicts"]} == {"proved"}
    assert main(["promote", str(contract), "--stage", "ci", "--cert", "nope.json",
                 "--no-log"]) == 2
    assert "nope.json: no certificate" in capsys.readouterr().err
