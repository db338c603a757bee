"""`kcverify prove` end to end on the shipped MLP example: prove, check, admit; refutation with a
replayed counterexample; a soft clause over its budget; a researcher's rule used by prove and
verified by check; bad input. Each run works on copies in tmp_path (nothing written in the repo).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from kcverify.certs.rules import RULES, unregister_rule
from kcverify.cli import main

ROOT = Path(__file__).resolve().parents[2]
RULE_FILE = ROOT / "examples" / "rules" / "l2_from_linf.py"


@pytest.fixture()
def work(tmp_path: Path) -> Path:
    """models/, examples/contracts and examples/data copied, so relative paths still resolve."""
    (tmp_path / "models").mkdir()
    shutil.copy(ROOT / "models" / "mlp_tiny.onnx", tmp_path / "models")
    shutil.copytree(ROOT / "examples" / "data", tmp_path / "examples" / "data")
    shutil.copytree(ROOT / "examples" / "contracts", tmp_path / "examples" / "contracts")
    return tmp_path


def contract_with(work: Path, clauses: str, name: str = "c.yaml") -> Path:
    base = (work / "examples" / "contracts" / "mlp-fp8.yaml").read_text()
    head = base[:base.index("clauses:")]
    path = work / "examples" / "contracts" / name
    path.write_text(head + "clauses:\n" + clauses + "escalation: {L1: log, L2: guard, L3: fallback}\n")
    return path


def test_prove_check_admit(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = work / "models" / "mlp_tiny.onnx"
    contract = work / "examples" / "contracts" / "mlp-fp8.yaml"
    report = work / "out" / "report.json"
    assert main(["prove", str(contract), str(model), "--report", str(report), "--quiet"]) == 0
    cert = model.with_name(model.name + ".kcert.json")
    assert cert.exists()
    body = json.loads(report.read_text())
    by_id = {c["id"]: c for c in body["clauses"]}
    assert by_id["N-MLP-1"]["verdict"] == "proved"
    assert 0 < by_id["N-MLP-1"]["bound"] <= by_id["N-MLP-1"]["threshold"]
    assert by_id["N-MLP-2"]["verdict"] == "proved"
    assert by_id["S-MLP-1"]["verdict"] == "passed"
    for c in body["clauses"]:
        assert {"id", "family", "verdict", "method", "bound", "threshold"} <= set(c)
    assert "health" in body and body["action"] == "none"
    # the certificate's proof rests on a bound at least the largest drift a program realizes
    stmt = json.loads(cert.read_text())
    proved = next(c for c in stmt["predicate"]["clauses"] if c["id"] == "N-MLP-1")
    assert proved["proof"]["rule"] == "threshold"
    assert main(["check", str(cert), str(model), str(contract)]) == 0
    reg = work / "registry"
    assert main(["registry", "--registry", str(reg), "admit", str(model), str(contract), str(cert)]) == 0
    capsys.readouterr()
    # tampering: one model byte, then a different contract; check and admit both reject
    import onnx

    m = onnx.load(model)
    w = m.graph.initializer[0]
    raw = bytearray(w.raw_data)
    raw[0] ^= 1  # one bit of one weight
    w.raw_data = bytes(raw)
    bad_model = work / "models" / "tampered.onnx"
    onnx.save(m, bad_model)
    assert main(["check", str(cert), str(bad_model), str(contract)]) == 1
    assert main(["registry", "--registry", str(reg), "admit", str(bad_model), str(contract),
                 str(cert)]) == 1
    other = contract_with(work, "  - {id: N-MLP-1, family: numerical, level: L2, action: guard,\n"
                                "     assert: 'forall x in points: linf(logits_inf(x) - logits_train(x)) <= 0.5'}\n")
    assert main(["check", str(cert), str(model), str(other)]) == 1
    assert main(["registry", "--registry", str(reg), "admit", str(model), str(other), str(cert)]) == 1


def test_refuted_with_replayed_counterexample(work: Path) -> None:
    model = work / "models" / "mlp_tiny.onnx"
    contract = contract_with(work, "  - {id: N-TIGHT, family: numerical, level: L3, action: fallback,\n"
                                   "     assert: 'forall x in points: linf(logits_inf(x) - logits_train(x)) <= 0.000001'}\n")
    report = work / "r.json"
    assert main(["prove", str(contract), str(model), "--report", str(report), "--quiet",
                 "--no-cert"]) == 1
    c = json.loads(report.read_text())["clauses"][0]
    assert c["verdict"] == "refuted"
    cex = c["evidence"]["counterexample"]
    assert cex["replayed"] is True and cex["value"] > 1e-6
    assert c["action_taken"] == "fallback"


def test_soft_clause_over_budget_exits_1_with_its_action(work: Path) -> None:
    model = work / "models" / "mlp_tiny.onnx"
    contract = contract_with(work, "  - {id: S-TIGHT, family: statistical, metric: p95_logit_l2, "
                                   "slices: [points],\n     threshold: 0.000001, budget: 0.05, "
                                   "level: L2, action: guard}\n")
    report = work / "r.json"
    assert main(["prove", str(contract), str(model), "--report", str(report), "--quiet",
                 "--no-cert"]) == 1
    body = json.loads(report.read_text())
    c = body["clauses"][0]
    assert c["verdict"] == "failed" and c["action_taken"] == "guard"
    assert c["sample_size"] == 64 and c["confidence"] == pytest.approx(0.95)
    assert body["action"] == "guard"


def test_researcher_rule_is_used_by_prove_and_verified_by_check(work: Path) -> None:
    model = work / "models" / "mlp_tiny.onnx"
    contract = contract_with(work, "  - {id: N-L2, family: numerical, level: L2, action: guard,\n"
                                   "     assert: 'forall x in points: l2(logits_inf(x) - logits_train(x)) <= 0.3'}\n")
    cert = work / "l2.kcert.json"
    try:
        assert main(["prove", str(contract), str(model), "--cert", str(cert), "--quiet",
                     "--rules", str(RULE_FILE)]) == 0
        stmt = json.loads(cert.read_text())
        clause = stmt["predicate"]["clauses"][0]
        assert clause["verdict"] == "proved"
        assert clause["proof"]["premises"][0]["premises"][0]["rule"] == "l2-from-linf"
        assert main(["check", str(cert), str(model), str(contract), "--rules", str(RULE_FILE)]) == 0
    finally:
        unregister_rule("l2-from-linf")
    assert "l2-from-linf" not in RULES
    assert main(["check", str(cert), str(model), str(contract)]) == 1  # the rule is needed


def test_bound_is_sound_against_sampled_programs(work: Path) -> None:
    """The certified per-input drift is above what drawn conforming programs realize."""
    from kcverify.bounds import certify_drift
    from kcverify.dsl import load_contract
    from kcverify.kernels.realize import random_realization, run_kernel
    from kcverify.models.ir import load_onnx

    c = load_contract(work / "examples" / "contracts" / "mlp-fp8.yaml")
    g = load_onnx(work / "models" / "mlp_tiny.onnx")
    x = dict(np.load(work / "examples" / "data" / "mlp_points.npz"))
    res = certify_drift(g, c.kernels["train"], c.kernels["inf"], x, domain="interval")
    out = g.outputs[0].name
    worst = np.zeros(len(res.linf))
    for k in range(6):
        zt = run_kernel(g, c.kernels["train"], x, **_choices(random_realization(c.kernels["train"], k)))
        zi = run_kernel(g, c.kernels["inf"], x, **_choices(random_realization(c.kernels["inf"], 50 + k)))
        worst = np.maximum(worst, (zi[out] - zt[out]).abs().amax(dim=1).double().numpy())
    assert np.all(worst <= res.linf)
    assert np.all(worst > 0)


def _choices(r: object) -> dict[str, object]:
    return {k: getattr(r, k) for k in ("seed", "order", "chunk", "rounding")}


def test_bad_input_is_one_line(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    contract = work / "examples" / "contracts" / "mlp-fp8.yaml"
    assert main(["prove", str(contract), str(work / "nope.onnx"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "nope.onnx" in err[0]
    (work / "examples" / "data" / "mlp_points.npz").unlink()
    assert main(["prove", str(contract), str(work / "models" / "mlp_tiny.onnx"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "mlp_points.npz" in err[0]
    assert not (work / "models" / "mlp_tiny.onnx.kcert.json").exists()  # nothing half-written


def test_embedded_certificate_checks(work: Path) -> None:
    model = work / "models" / "mlp_tiny.onnx"
    contract = work / "examples" / "contracts" / "mlp-fp8.yaml"
    assert main(["prove", str(contract), str(model), "--embed", "--quiet"]) == 0
    assert not model.with_name(model.name + ".kcert.json").exists()
    assert main(["check", str(model), str(model), str(contract)]) == 0
    reg = work / "registry"
    assert main(["registry", "--registry", str(reg), "admit", str(model), str(contract)]) == 0


def test_unused_blocks_are_not_stored(work: Path) -> None:
    """A clause bounded but decided on evidence leaves no block certificates behind."""
    model = work / "models" / "mlp_tiny.onnx"
    contract = contract_with(work, "  - {id: N-LOOSE, family: numerical, level: L1, action: log,\n"
                                   "     assert: 'forall x in points: linf(logits_inf(x) - logits_train(x)) <= 0.05'}\n")
    cert = work / "c.kcert.json"
    main(["prove", str(contract), str(model), "--cert", str(cert), "--quiet"])
    stmt = json.loads(cert.read_text())
    assert stmt["predicate"]["clauses"][0]["verdict"] in ("passed", "refuted")
    assert stmt["predicate"]["blocks"] == {}


def test_input_region_clause_proved_and_checked(work: Path) -> None:
    """A box around each point (input space): the chain starts from the box, and check agrees."""
    model = work / "models" / "mlp_tiny.onnx"
    text = (work / "examples" / "contracts" / "mlp-box.yaml").read_text().replace("<= 0.26", "<= 0.4")
    contract = work / "examples" / "contracts" / "box-loose.yaml"
    contract.write_text(text)
    cert = work / "b.kcert.json"
    assert main(["prove", str(contract), str(model), "--cert", str(cert), "--quiet"]) == 0
    stmt = json.loads(cert.read_text())
    assert stmt["predicate"]["clauses"][0]["method"].startswith("bound-")
    assert main(["check", str(cert), str(model), str(contract)]) == 0
