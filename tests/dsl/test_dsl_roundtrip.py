"""The printer and the parser are inverse: parse(to_text(e)) == e for every canonical tree."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kcverify.dsl import load_contract, parse_expr, to_text
from kcverify.dsl.ast import (
    KEYWORDS,
    Aggregate,
    Binder,
    BinOp,
    BoolOp,
    Call,
    Compare,
    Expr,
    Neg,
    Not,
    Num,
    Quantifier,
    Str,
    Var,
    strip_positions,
)

ROOT = Path(__file__).resolve().parent.parent.parent

names = st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True).filter(lambda n: n not in KEYWORDS)
numbers = st.one_of(
    st.integers(min_value=0, max_value=10**6).map(float),
    st.floats(min_value=0, allow_nan=False, allow_infinity=False),
    st.sampled_from([0.05, 1e-3, 2.5e-7, 0.1, 1e20, 123456789012345.0]),
)
leaves = st.one_of(
    numbers.map(Num),
    names.map(Var),
    st.text(alphabet="abc .-_XYZ019", max_size=6).map(Str),
)
binder_slice = st.builds(Binder, names, names)
binder_any = st.builds(Binder, names, st.one_of(st.none(), names))


def _extend(children: st.SearchStrategy[Expr]) -> st.SearchStrategy[Expr]:
    return st.one_of(
        children.filter(lambda e: not isinstance(e, Num)).map(Neg),
        st.builds(BinOp, st.sampled_from("+-*/"), children, children),
        st.builds(Compare, st.sampled_from(["<=", "<", ">=", ">", "==", "!="]), children,
                  children),
        children.map(Not),
        st.builds(BoolOp, st.sampled_from(["and", "or", "implies"]), children, children),
        st.builds(Call, names, st.lists(children, max_size=3).map(tuple)),
        st.builds(Quantifier, st.sampled_from(["forall", "exists"]), binder_any, children),
        st.builds(Aggregate, names,
                  st.tuples(binder_slice, st.lists(binder_any, max_size=2)).map(
                      lambda t: (t[0], *t[1])),
                  children),
    )


trees = st.recursive(leaves, _extend, max_leaves=24)


@settings(max_examples=400, deadline=None)
@given(trees)
def test_parse_inverts_print(e: Expr) -> None:
    text = to_text(e)
    back = parse_expr(text)
    assert back == e, text
    assert to_text(back) == text


@settings(max_examples=100, deadline=None)
@given(trees)
def test_positions_ignored_by_equality(e: Expr) -> None:
    parsed = parse_expr(to_text(e))
    assert strip_positions(parsed) == parsed == e
    assert parsed.line == 1 and parsed.column is not None


@pytest.mark.parametrize(("text", "canonical"), [
    ("a + b * c", "a + b * c"),
    ("(a + b) * c", "(a + b) * c"),
    ("a - (b - c)", "a - (b - c)"),
    ("(a - b) - c", "a - b - c"),
    ("a / (b * c)", "a / (b * c)"),
    ("--a", "--a"),
    ("-(a + b)", "-(a + b)"),
    ("not not a", "not not a"),
    ("not (a and b)", "not (a and b)"),
    ("a or b and c", "a or b and c"),
    ("(a or b) and c", "(a or b) and c"),
    ("a implies (b implies c)", "a implies (b implies c)"),
    ("a <= b < c", "a <= b and b < c"),
    ("a and (forall t: b)", "a and (forall t: b)"),
    ("forall x in s, t: a", "forall x in s: forall t: a"),
    ("mean(x in s, t: a)", "mean(x in s, t: a)"),
    ("f()", "f()"),
    ("1e-3 + 1.50 + 2E2 + .5", "0.001 + 1.5 + 200 + 0.5"),
    ("'x\"y'", "'x\"y'"),
])
def test_canonical_text(text: str, canonical: str) -> None:
    assert to_text(parse_expr(text)) == canonical


def test_examples_round_trip() -> None:
    for path in sorted((ROOT / "examples" / "contracts").glob("*.yaml")):
        for clause in load_contract(path).clauses:
            assert parse_expr(clause.text) == clause.expr


def test_dsl_does_not_import_torch() -> None:
    code = "import kcverify.dsl, kcverify.commands.lint, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def _contracts() -> list[Path]:
    return (sorted((ROOT / "examples" / "contracts").glob("*.yaml"))
            + sorted((ROOT / "tests" / "dsl" / "cases" / "ok").glob("*.yaml")))


@pytest.mark.parametrize("path", _contracts(), ids=lambda p: p.stem)
def test_contract_printer_round_trip(path: Path) -> None:
    from dataclasses import replace

    from kcverify.dsl import parse_contract
    from kcverify.dsl.printer import contract_to_yaml

    c = load_contract(path)
    text = contract_to_yaml(c)
    back = parse_contract(text, str(path))
    assert replace(back, sha256=c.sha256) == c
    assert contract_to_yaml(back) == text
