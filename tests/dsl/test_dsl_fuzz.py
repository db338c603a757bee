"""Bad input never escapes as anything but a ContractError with a position (no tracebacks)."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from kcverify.dsl import parse_contract, parse_expr
from kcverify.errors import ContractError

ROOT = Path(__file__).resolve().parent.parent.parent
EXAMPLE = (ROOT / "examples" / "contracts" / "minimal.yaml").read_text()

tokens = st.sampled_from([
    "forall", "exists", " in ", "all", "x", "t", ":", ",", "(", ")", "and", "or", "not",
    "implies", "<=", "<", "==", "=", "+", "-", "*", "/", "0.05", "1e-3", "1e", "linf", "kl",
    "logits_inf", "logits_train", "ratio", "mean", "p99", '"s"', "'", " ", "\n", "&", "[",
])
texts = st.lists(tokens, max_size=14).map("".join)


@settings(max_examples=200, deadline=None)
@given(texts)
def test_expression_errors_are_located(text: str) -> None:
    try:
        parse_expr(text, "f.yaml")
    except ContractError as e:
        assert e.file == "f.yaml" and e.line is not None and e.column is not None
        assert "\n" not in e.render()


@settings(max_examples=120, deadline=None)
@given(st.integers(0, len(EXAMPLE) - 1), st.integers(0, 3),
       st.sampled_from(["", " ", ":", "{", "]", "x", "-", "\n", '"', "(", "1", "\t"]))
def test_contract_mutations_fail_cleanly(at: int, cut: int, insert: str) -> None:
    text = EXAMPLE[:at] + insert + EXAMPLE[at + cut:]
    try:
        parse_contract(text, "m.yaml")
    except ContractError as e:
        assert e.file == "m.yaml"
        assert "\n" not in e.render()
