"""Researchers' rules are tried: docs/rules.md's example, copied into a file, is used by prove and
verified by check; a registered rule that derives a quantity the built-ins also derive is tried
beside them and the tightest conclusion is kept (and checked)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from kcverify.certs.rules import RULES, unregister_rule
from kcverify.cli import main

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "rules.md").read_text()
EXAMPLE = ROOT / "examples" / "rules" / "l2_from_linf.py"


def _contract(work: Path, condition: str, name: str = "c.yaml") -> Path:
    base = (work / "examples" / "contracts" / "mlp-fp8.yaml").read_text()
    path = work / "examples" / "contracts" / name
    path.write_text(base[:base.index("clauses:")] + "clauses:\n"
                    f"  - {{id: N-1, family: numerical, level: L2, action: guard,\n"
                    f"     assert: {condition!r}}}\n")
    return path


def _code_of(path: Path) -> str:
    """A module's code after its docstring."""
    text = path.read_text()
    return text[text.index('"""', 3) + 3:].strip()


def test_docs_example_is_the_shipped_rule_and_copying_it_works(
        workspace: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", DOC, re.S) if "class L2FromLinf" in b]
    assert block.strip() == _code_of(EXAMPLE)  # the page shows the file that ships
    assert 'derives = "logit_l2"' in block
    mine = tmp_path / "my_rules.py"
    mine.write_text(block)  # a researcher copies the example
    model, _ = workspace("mlp_tiny.onnx", "mlp-fp8.yaml")
    contract = _contract(tmp_path, "forall x in points: l2(logits_inf(x) - logits_train(x)) <= 0.3")
    cert = tmp_path / "l2.kcert.json"
    try:
        assert main(["prove", str(contract), str(model), "--cert", str(cert), "--quiet",
                     "--rules", str(mine)]) == 0
        clause = json.loads(cert.read_text())["predicate"]["clauses"][0]
        assert clause["verdict"] == "proved"
        assert clause["proof"]["premises"][0]["premises"][0]["rule"] == "l2-from-linf"
        assert main(["check", str(cert), str(model), str(contract), "--rules", str(mine)]) == 0
    finally:
        unregister_rule("l2-from-linf")
    capsys.readouterr()


SPREAD_RULE = '''
from fractions import Fraction

import numpy as np

from kcverify.certs import Rule, RuleError, register_rule
from kcverify.certs.encoding import fx, tanh_up, unfx, up


class TvFromSpread(Rule):
    """TV(p, q) <= tanh(s / (4T)), s = max_j dh_j - min_j dl_j, the spread of the logit drift box.

    softmax ignores a common shift: q = softmax((z + D - c)/T) for every c. With c the midpoint
    of [min dl, max dh], ||D - c||_inf <= s/2, and tv-from-linf's tanh(delta/(2T)) applies with
    delta = s/2. Never looser than tv-from-linf (s/2 <= max |drift|). Premises [linf, state].
    """

    derives = "tv"

    def conclude(self, premises, params, ctx):
        linf, state = premises
        t, keep = linf["tensor"], linf.get("keep", 1)
        temp = Fraction(unfx(params["temperature"]))
        box = ctx.box(state["outputs"][t], t)
        lead = int(np.prod(box.drift_lo.shape[:keep]))
        classes = box.drift_lo.shape[-1]
        hi = box.drift_hi.reshape(lead, -1, classes).max(axis=2)
        lo = box.drift_lo.reshape(lead, -1, classes).min(axis=2)
        out = []
        for h_row, l_row in zip(hi, lo):
            if not (np.all(np.isfinite(h_row)) and np.all(np.isfinite(l_row))):
                out.append(1.0)
                continue
            s = max(Fraction(float(h)) - Fraction(float(lw)) for h, lw in zip(h_row, l_row))
            if s < 0:
                raise RuleError("tv-from-spread: an empty drift box")
            out.append(tanh_up(up(s / (4 * temp))))
        res = {"quantity": "tv", "direction": "upper", "tensor": t, "temperature":
               params["temperature"], "bounds": [fx(v) for v in out]}
        res.update({k: linf[k] for k in ("slice", "keep") if k in linf})
        return res


register_rule("tv-from-spread")(TvFromSpread)
'''


def test_a_tighter_researcher_rule_is_tried_and_kept(
        workspace: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """tv-from-linf is built in; a researcher's tighter rule for tv is not ignored (it was: the
    planner took a plugin only for quantities without a built-in)."""
    from kcverify.planner import ProveOptions, prove

    model, _ = workspace("mlp_tiny.onnx", "mlp-fp8.yaml")
    rule = tmp_path / "spread.py"
    rule.write_text(SPREAD_RULE)
    loose = _contract(tmp_path, "forall x in points: tv(x) <= 0.5", "loose.yaml")
    from kcverify.certs.rules import load_rule_modules

    try:
        load_rule_modules([str(rule)])
        said: list[str] = []
        prove(loose, model, ProveOptions(progress=said.append, write_certificate=False))
        (line,) = [m for m in said if "kept" in m]
        found = dict(re.findall(r"(tv-from-\w+) ([0-9.e-]+)", line))
        builtin, spread = float(found["tv-from-linf"]), float(found["tv-from-spread"])
        assert spread < builtin and "kept tv-from-spread" in line
        # a threshold only the researcher's rule meets
        tau = (spread + builtin) / 2
        tight = _contract(tmp_path, f"forall x in points: tv(x) <= {tau!r}", "tight.yaml")
        cert = tmp_path / "tight.kcert.json"
        assert main(["prove", str(tight), str(model), "--cert", str(cert), "--quiet",
                     "--rules", str(rule)]) == 0
        clause = json.loads(cert.read_text())["predicate"]["clauses"][0]
        assert clause["verdict"] == "proved"
        assert clause["proof"]["premises"][0]["premises"][0]["rule"] == "tv-from-spread"
        assert main(["check", str(cert), str(model), str(tight), "--rules", str(rule)]) == 0
        # the checker re-runs the researcher's rule: a tighter stored bound is rejected
        stmt = json.loads(cert.read_text())
        node = stmt["predicate"]["clauses"][0]["proof"]["premises"][0]["premises"][0]
        node["conclusion"]["bounds"][0] = (float.fromhex(node["conclusion"]["bounds"][0]) / 2).hex()
        bad = tmp_path / "bad.kcert.json"
        bad.write_text(json.dumps(stmt))
        assert main(["check", str(bad), str(model), str(tight), "--rules", str(rule)]) == 1
        assert "(tv-from-spread): conclusion.bounds[0]" in capsys.readouterr().out
    finally:
        unregister_rule("tv-from-spread")
    assert "tv-from-spread" not in RULES
    # without the rule, the same clause is not proved (the built-in bound misses tau)
    assert main(["prove", str(tight), str(model), "--no-cert", "--quiet",
                 "--report", str(tmp_path / "r.json")]) == 0
    c = json.loads((tmp_path / "r.json").read_text())["clauses"][0]
    assert c["verdict"] == "passed" and c["decided_by"] == "evidence"
    capsys.readouterr()
