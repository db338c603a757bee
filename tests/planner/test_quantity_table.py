"""One quantity table (kcverify.dsl.quantities): `kcverify lint`, the planner and the checker say
the same words for every quantity of the table, and a quantity added to the table (with a rule
that derives it) flows to all three. Runs on the shipped MLP (a few seconds)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kcverify.certs.checker import check_certificate
from kcverify.certs.rules import load_rule_modules, unregister_rule
from kcverify.cli import main
from kcverify.dsl import load_contract, numerical_query
from kcverify.dsl.quantities import QUANTITIES, Form, Quantity, query_text
from kcverify.planner import ProveOptions, prove

ROOT = Path(__file__).resolve().parents[2]
L2_RULE = ROOT / "examples" / "rules" / "l2_from_linf.py"
# thresholds every quantity meets on the MLP's points (certified L-inf drift about 0.11)
LOOSE = {"logit_linf": 1.0, "logit_l2": 1.0, "logprob_abs": 10.0, "ratio_dev": 1000.0,
         "tv": 1.0, "kl": 10.0}


def condition(q: Quantity, form: Form, threshold: float) -> str:
    """A clause condition over the slice ``points`` in ``form``."""
    if not q.upper:
        return f"forall x in points: {form.text('x', k=1)}"  # holds at every input: min >= 1
    if form.per_position:
        return f"forall x in points: forall t: {form.text('x', 't')} <= {threshold}"
    return f"forall x in points: {form.text('x')} <= {threshold}"


def contract_text(work: Path, clauses: list[tuple[str, str]]) -> Path:
    base = (work / "examples" / "contracts" / "mlp-fp8.yaml").read_text()
    body = "".join(f"  - {{id: {cid}, family: numerical, level: L2, action: guard,\n"
                   f"     assert: {text!r}}}\n" for cid, text in clauses)
    path = work / "examples" / "contracts" / "table.yaml"
    path.write_text(base[:base.index("clauses:")] + "clauses:\n" + body)
    return path


@pytest.fixture
def l2_rule() -> Iterator[None]:
    load_rule_modules([str(L2_RULE)])
    yield
    unregister_rule("l2-from-linf")


def test_every_quantity_same_words_in_lint_planner_checker(
        workspace: Any, tmp_path: Path, l2_rule: None, capsys: pytest.CaptureFixture[str]) -> None:
    model, _ = workspace("mlp_tiny.onnx", "mlp-fp8.yaml")
    clauses = [(f"Q-{i}", condition(q, q.forms[0], LOOSE.get(q.name, 1.0)))
               for i, q in enumerate(QUANTITIES.values())]
    path = contract_text(tmp_path, clauses)
    contract = load_contract(path)
    queries = {c.id: numerical_query(c) for c in contract.clauses}
    assert [q.quantity for q in queries.values()] == list(QUANTITIES)  # every form recognised

    # lint
    assert main(["lint", str(path)]) == 0
    out = capsys.readouterr().out
    for q in queries.values():
        assert f"certify: {query_text(q)}\n" in out

    # the planner: its progress (and notes) name each query in the same words
    said: list[str] = []
    cert = tmp_path / "table.kcert.json"
    result = prove(path, model, ProveOptions(progress=said.append, cert_path=cert,
                                             realizations=1))
    by_id = {c.id: c for c in result.report.clauses}
    for cid, q in queries.items():
        words = f"'{query_text(q)}'"
        if QUANTITIES[q.quantity].derivations or q.quantity == "logit_l2":
            assert by_id[cid].verdict == "proved", (cid, by_id[cid].note)
            assert any(words in m and "certified bound" in m for m in said), (cid, said)
        else:  # no rule derives it: the note says so, in the same words
            assert by_id[cid].verdict != "proved"
            assert f"{words}: no rule derives {q.quantity}" in by_id[cid].note

    # the checker: each proof given to another clause fails with that clause's words
    stmt = json.loads(cert.read_text())
    assert check_certificate(stmt, model, path).ok
    proved = [c for c in stmt["predicate"]["clauses"] if c["verdict"] == "proved"]
    proofs = [c["proof"] for c in proved]
    for c, p in zip(proved, proofs[1:] + proofs[:1]):
        c["proof"] = p
    problems = check_certificate(stmt, model, path).problems
    for c in proved:
        assert any(p.startswith(f"clause {c['id']}: the proof does not establish "
                                f"'{query_text(queries[c['id']])}'") for p in problems), problems


L1_RULE = '''
import math
from fractions import Fraction

from kcverify.certs import Rule, register_rule
from kcverify.certs.encoding import fx, unfx, up


class L1FromLinf(Rule):
    """||z_inf - z_train||_1 <= n * delta (n entries per element; premises [linf_drift, state])."""

    derives = "logit_l1"

    def conclude(self, premises, params, ctx):
        linf, state = premises
        t = linf["tensor"]
        n = math.prod(ctx.box(state["outputs"][t], t).shape[linf.get("keep", 1):])
        out = {"quantity": "l1_drift", "direction": "upper", "tensor": t,
               "bounds": [fx(up(n * Fraction(unfx(d)))) for d in linf["bounds"]]}
        out.update({k: linf[k] for k in ("slice", "keep") if k in linf})
        return out


register_rule("l1-from-linf")(L1FromLinf)
'''


def test_a_new_quantity_flows_to_lint_planner_and_checker(
        workspace: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """logit_l1 is not in the table; one entry (a form the analysis knows, the conclusion name)
    and a researcher's rule deriving it are all lint, prove and check need."""
    model, _ = workspace("mlp_tiny.onnx", "mlp-fp8.yaml")
    rule = tmp_path / "l1_rule.py"
    rule.write_text(L1_RULE)
    path = contract_text(tmp_path, [("N-L1", "forall x in points: "
                                              "l1(logits_inf(x) - logits_train(x)) <= 0.5")])
    assert numerical_query(load_contract(path).clauses[0]) is None  # not certifiable yet
    with pytest.raises(Exception, match="derives 'logit_l1' is not a quantity of the table"):
        load_rule_modules([str(rule)])

    monkeypatch.setitem(QUANTITIES, "logit_l1",
                        Quantity("logit_l1", "l1_drift", "upper", (Form("norm", "l1"),)))
    q = numerical_query(load_contract(path).clauses[0])
    assert q is not None and q.quantity == "logit_l1"
    assert main(["lint", str(path)]) == 0
    assert f"certify: {query_text(q)}" in capsys.readouterr().out
    cert = tmp_path / "l1.kcert.json"
    try:
        assert main(["prove", str(path), str(model), "--cert", str(cert), "--quiet",
                     "--rules", str(rule)]) == 0
        capsys.readouterr()
        stmt = json.loads(cert.read_text())
        (c,) = stmt["predicate"]["clauses"]
        assert c["verdict"] == "proved" and c["decided_by"] == "proof"
        assert c["proof"]["premises"][0]["premises"][0]["rule"] == "l1-from-linf"
        assert 0 < float.fromhex(c["bound"]) <= 0.5 and math.isfinite(float.fromhex(c["bound"]))
        assert main(["check", str(cert), str(model), str(path), "--rules", str(rule)]) == 0
        # the checker reads the table: the proof must conclude l1_drift for this clause
        c["proof"]["conclusion"]["quantity"] = "l2_drift"
        problems = check_certificate(stmt, model, path).problems
        assert any(f"does not establish '{query_text(q)}' (it bounds 'l2_drift', not "
                   "'l1_drift')" in p for p in problems), problems
    finally:
        unregister_rule("l1-from-linf")
