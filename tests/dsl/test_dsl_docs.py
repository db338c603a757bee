"""docs/contract.md stays true: its YAML contract lints, its expressions type-check, its Python
example runs, and its error lines are the ones the bad cases produce."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from kcverify.dsl import parse_contract

ROOT = Path(__file__).resolve().parent.parent.parent
DOC = (ROOT / "docs" / "contract.md").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC, re.S)


def test_yaml_block_lints() -> None:
    (block,) = _blocks("yaml")
    contract = parse_contract(block, "doc.yaml")
    assert [c.id for c in contract.clauses] == ["N-1", "N-RLHF-1", "S-1", "R-1"]


def test_expression_block_type_checks() -> None:
    (block,) = _blocks("text")
    head = "contract: d\nkernels: {train: {}, inf: {}}\nslices: {all: a, long_ctx: b}\nclauses:\n"
    lines = [ln.strip() for ln in block.strip().splitlines()]
    clauses = "".join(f"  - {{id: E{i}, family: numerical, assert: {ln!r}}}\n"
                      for i, ln in enumerate(lines))
    contract = parse_contract(head + clauses)
    assert all(c.klass == "certifiable" for c in contract.clauses)


def test_python_block_runs(monkeypatch: pytest.MonkeyPatch,
                           capsys: pytest.CaptureFixture[str]) -> None:
    (block,) = _blocks("python")
    monkeypatch.chdir(ROOT)
    exec(compile(block, "docs/contract.md", "exec"), {})
    assert "N-FP8-1 certifiable" in capsys.readouterr().out


def test_error_lines_match_cases() -> None:
    errors = re.findall(r"^    contract\.yaml:(\d+:\d+): error: (.*?)(?: near .*)?$", DOC, re.M)
    assert len(errors) >= 4
    produced = []
    for path in sorted((ROOT / "tests" / "dsl" / "cases" / "bad").glob("*.yaml")):
        first = path.read_text().splitlines()[0]
        produced.append(first.removeprefix("# expect: "))
    for where, message in errors:
        short = message.split(";")[0].split(" (did you")[0]
        assert f"{where}: {short}" in produced or any(
            p.startswith(f"{where}: {short}") for p in produced), (where, message)
    assert os.path.exists(ROOT / "kcverify" / "dsl" / "grammar" / "contract.lark")
