"""Issue 6 through the planner: a box clause the interval bound misses is proved by z3, the
certificate records the smt-block leaf, and the checker re-solves it; an edited claim fails."""

from __future__ import annotations

import json
from pathlib import Path

import kcverify.smt
from kcverify.certs.encoding import fx
from kcverify.cli import main

# z3's budget is wall-clock seconds (prove's default: 30 s per input); the query takes ~15 CPU s,
# so on a loaded machine it ran out and the clause fell back to evidence. The test gives z3 the
# time the query needs (the real solver, the CLI's path); a wrong or unprovable claim still fails.
SMT_TIMEOUT = 300.0


def test_smt_proves_what_intervals_miss(tmp_path: Path, workspace, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    decide = kcverify.smt.smt_decide_block

    def patient(*args, **kwargs):  # type: ignore[no-untyped-def]
        kwargs["timeout_s"] = max(float(kwargs.get("timeout_s", 0.0)), SMT_TIMEOUT)
        return decide(*args, **kwargs)

    monkeypatch.setattr(kcverify.smt, "smt_decide_block", patient)
    model, contract = workspace("mlp_tiny.onnx", "mlp-box.yaml")
    cert, report = tmp_path / "box.kcert.json", tmp_path / "r.json"
    assert main(["prove", str(contract), str(model), "--cert", str(cert), "--report", str(report),
                 "--quiet"]) == 0
    c = json.loads(report.read_text())["clauses"][0]
    assert c["verdict"] == "proved" and c["method"] == "smt-z3"
    stmt = json.loads(cert.read_text())
    leaf = stmt["predicate"]["clauses"][0]["proof"]["premises"][0]["premises"][0]
    assert leaf["rule"] == "smt-block" and stmt["predicate"]["blocks"] == {}
    assert main(["check", str(cert), str(model), str(contract)]) == 0
    original = json.dumps(stmt)

    def forged(edit) -> str:  # type: ignore[no-untyped-def]
        """check's output on the certificate with one edit to the smt-block leaf's params."""
        st = json.loads(original)
        edit(st["predicate"]["clauses"][0]["proof"]["premises"][0]["premises"][0]["params"])
        cert.write_text(json.dumps(st))
        capsys.readouterr()
        assert main(["check", str(cert), str(model), str(contract)]) == 1
        return capsys.readouterr().out

    # a leaf may not choose its own problem: the kernels are the contract's, and the points it
    # re-solves contain the slice's inputs
    def weaker_inf(params):  # type: ignore[no-untyped-def]
        params["kernels"]["inf"]["activations"]["scale"] = "none"
    assert "is not the contract's kernel 'inf'" in forged(weaker_inf)

    def elsewhere(params):  # type: ignore[no-untyped-def]
        params["inputs"] = [[fx(float.fromhex(v) + 0.5) for v in p] for p in params["inputs"]]
    assert "does not contain input 0 of slice 'box'" in forged(elsewhere)
    leaf["params"]["claim"] = [fx(0.1)]  # below z3's maximum: does not re-solve
    leaf["conclusion"]["bounds"] = [fx(0.1)]
    cert.write_text(json.dumps(stmt))
    assert main(["check", str(cert), str(model), str(contract)]) == 1
