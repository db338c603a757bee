"""The report model: verdicts, violated/action_taken, JSON shape."""

from __future__ import annotations

import json

import pytest

from kcverify.report.model import ClauseResult, Report, SliceResult, Verdict


def test_verdict_strings_and_violation() -> None:
    assert Verdict("passed") is Verdict.PASSED
    assert Verdict("passed-empirically") is Verdict.PASSED
    assert Verdict.FAILED.violated and Verdict.REFUTED.violated
    assert not Verdict.UNKNOWN.violated and Verdict.PROVED.holds
    assert Verdict.from_outcome("unknown") is Verdict.UNKNOWN
    with pytest.raises(ValueError):
        ClauseResult("x", "numerical", "maybe", "ibp")


def test_report_json_and_exit_code() -> None:
    ok = ClauseResult("N-1", "numerical", "proved", "interval", value=0.01, threshold=0.05)
    bad = ClauseResult("S-1", "statistical", "failed", "clopper-pearson",
                       level="L2", action="guard",
                       slices=[SliceResult("all", "failed", n=100, violations=9)])
    r = Report("c.yaml", "m.onnx", [ok, bad], health=0.5, action="guard")
    assert r.exit_code == 1 and Report("c", "m", [ok]).exit_code == 0
    body = json.loads(json.dumps(r.to_json()))
    assert body["clauses"][1]["verdict"] == "failed"
    assert body["clauses"][1]["action_taken"] == "guard"
    assert body["clauses"][0]["action_taken"] == "none"
    assert body["clauses"][1]["slices"][0]["verdict"] == "failed"
    assert body["counts"]["proved"] == 1 and body["ok"] is False
