"""The example rule of docs/rules.md, registered from a test file and verified by the checker.

The rule lives in examples/rules/l2_from_linf.py (the file docs/rules.md shows).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kcverify.certs import RuleContext
from kcverify.certs.checker import check_certificate
from kcverify.certs.encoding import fx, unfx
from kcverify.certs.rules import load_rule_modules, unregister_rule
from kcverify.certs.statement import CertificateBuilder
from kcverify.certs.testing import CONTRACT_TEXT, SLICES, FakeBox, FakeEngine

RULE_FILE = Path(__file__).resolve().parents[2] / "examples" / "rules" / "l2_from_linf.py"


@pytest.fixture()
def l2_rule() -> Any:
    assert load_rule_modules([str(RULE_FILE)]) == ["l2-from-linf"]
    yield
    unregister_rule("l2-from-linf")


L2_CONTRACT = CONTRACT_TEXT[:CONTRACT_TEXT.index("clauses:")] + """clauses:
  - {id: N-L2, family: numerical, level: L2, action: guard,
     assert: "forall x in all: l2(logits_inf(x) - logits_train(x)) <= 0.1"}
"""


def test_example_rule_is_used_and_checked(l2_rule: Any, example: Any, engine: FakeEngine) -> None:
    model, contract, specs, _ = example
    contract.write_text(L2_CONTRACT)
    x = np.random.default_rng(3).uniform(-1, 1, size=(4, engine.n_in))
    np.savez(contract.parent / "data.npz", x=x)
    b = CertificateBuilder(model, contract, specs, {"name": "fake-contract", "version": "1.0.0"},
                           slices=SLICES, store_input=None)
    refs = [b.add_block(r) for r in engine.certify(x)]
    chain = b.sequential(refs, {"x": FakeBox.point(x)}, ["logits"], slice="all")
    linf = b.apply("linf-from-state", [chain], tensor="logits")
    l2 = b.apply("l2-from-linf", [linf, chain])
    b.add_clause("N-L2", "numerical", "proved", threshold=0.1, method="fake-affine",
                 proof=b.apply("threshold", [l2], threshold=0.1))
    stmt = b.build()
    kw = {"kernel_specs": specs, "recheck_block": engine.recheck, "expected_chain": engine.chain,
          "store_input": None}
    assert check_certificate(stmt, model, contract, **kw).ok
    l2["conclusion"]["bounds"][0] = fx(unfx(linf["conclusion"]["bounds"][0]))  # claims n = 1
    report = check_certificate(stmt, model, contract, **kw)
    assert not report.ok and "(l2-from-linf): conclusion.bounds[0]" in report.problems[0]


def test_example_rule_is_sound_on_samples(l2_rule: Any) -> None:
    from kcverify.certs.records import BlockData, StoredBox
    from kcverify.certs.rules import get_rule

    rng = np.random.default_rng(0)
    z = np.zeros((1, 7, 3))
    ctx = RuleContext(blocks={"r": BlockData("r", "b", "0" * 64, "m", {}, {"t": StoredBox(*[z] * 6)})})
    delta = 0.25
    c = get_rule("l2-from-linf").conclude(
        [{"quantity": "linf_drift", "direction": "upper", "tensor": "t", "bounds": [fx(delta)]},
         {"kind": "state", "outputs": {"t": "r"}}], {}, ctx)
    d = rng.uniform(-delta, delta, size=(1000, 21))
    d[0] = delta  # the worst case
    assert np.linalg.norm(d, axis=1).max() <= unfx(c["bounds"][0])


def test_rule_modules_are_loaded_for_the_cli(tmp_path: Any) -> None:
    from kcverify.certs.rules import RULES, load_rule_modules
    from kcverify.errors import InputFileError

    mod = tmp_path / "my_rules.py"
    mod.write_text('from kcverify.certs import register_rule\n\n\n'
                   '@register_rule("always-fails")\n'
                   'def always_fails(application, ctx):\n'
                   '    """A check-only rule that rejects every application (for the test)."""\n'
                   '    return ["never valid"]\n')
    try:
        assert load_rule_modules([str(mod)]) == ["always-fails"]
        assert RULES["always-fails"].check({}, RuleContext()) == ["never valid"]
    finally:
        unregister_rule("always-fails")
    with pytest.raises(InputFileError, match="cannot import rule module"):
        load_rule_modules(["no_such_module_kcv"])


def test_a_prefix_of_the_chain_is_a_state_a_compositional_rule_continues_from(
        example: Any, engine: FakeEngine) -> None:
    """sequential accepts the model's first blocks (the state of what they produce), as
    examples/rules/residual_lipschitz.py uses it; any other sequence of blocks is refused."""
    from kcverify.certs.rules import RULES

    model, contract, specs, _ = example
    x = np.random.default_rng(3).uniform(-1, 1, size=(2, engine.n_in))
    b = CertificateBuilder(model, contract, specs, {"name": "fake-contract", "version": "1.0.0"},
                           slices=SLICES, store_input=None)
    refs = [b.add_block(r) for r in engine.certify(x)]
    prefix = b.sequential(refs[:1], {"x": FakeBox.point(x)}, ["h"])
    assert prefix["conclusion"]["outputs"] == {"h": refs[0]}
    b.ctx.expected_chain = engine.chain
    assert RULES["sequential"].check(prefix, b.ctx) == []
    b.ctx.expected_chain = engine.chain[::-1]  # b0 is not the model's first block
    (problem,) = RULES["sequential"].check(prefix, b.ctx)
    assert "is not the model's segmentation" in problem and "nor a prefix of it" in problem


def test_example_rule_per_position_on_a_classifier(l2_rule: Any) -> None:
    """keep = 2 on (batch, classes) logits: one position per input (linf-from-state's reading),
    so n is the number of classes, not 1 (the example once claimed ||d||_2 <= delta there)."""
    from kcverify.certs.records import BlockData, StoredBox
    from kcverify.certs.rules import get_rule

    z = np.zeros((2, 5))
    ctx = RuleContext(blocks={"r": BlockData("r", "b", "0" * 64, "m", {}, {"t": StoredBox(*[z] * 6)})})
    delta = 0.25
    c = get_rule("l2-from-linf").conclude(
        [{"quantity": "linf_drift", "direction": "upper", "tensor": "t", "keep": 2,
          "bounds": [fx(delta), fx(delta)]}, {"kind": "state", "outputs": {"t": "r"}}], {}, ctx)
    corner = np.full(5, delta)
    assert np.linalg.norm(corner) <= unfx(c["bounds"][0]) <= np.linalg.norm(corner) * (1 + 1e-12)
