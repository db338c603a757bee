"""Case files: every bad case fails with its expected message at its expected place; every ok
case and every shipped example lints; `kcverify lint` exits 0 / 2 with one stderr line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kcverify.cli import main
from kcverify.dsl import load_contract
from kcverify.errors import ContractError

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
BAD = sorted((HERE / "cases" / "bad").glob("*.yaml"))
OK = sorted((HERE / "cases" / "ok").glob("*.yaml"))
EXAMPLES = sorted((ROOT / "examples" / "contracts").glob("*.yaml"))
EXPECT = re.compile(r"^# expect: (\d+):(\d+): (.+)$")


def _expectation(path: Path) -> tuple[int, int, str]:
    first = path.read_text().splitlines()[0]
    m = EXPECT.match(first)
    assert m, f"{path.name}: first line must be '# expect: LINE:COL: message'"
    return int(m.group(1)), int(m.group(2)), m.group(3)


def test_enough_cases() -> None:
    assert len(BAD) >= 15
    assert len(OK) >= 3
    assert {p.name for p in EXAMPLES} >= {"minimal.yaml", "rl-stability.yaml", "fp8-deploy.yaml"}


@pytest.mark.parametrize("path", BAD, ids=lambda p: p.stem)
def test_bad_case(path: Path) -> None:
    line, col, message = _expectation(path)
    with pytest.raises(ContractError) as info:
        load_contract(path)
    e = info.value
    assert (e.file, e.line, e.column) == (str(path), line, col), e.render()
    assert message in e.message, e.render()


@pytest.mark.parametrize("path", BAD, ids=lambda p: p.stem)
def test_lint_bad_case_one_line(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line, col, message = _expectation(path)
    assert main(["lint", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{path}:{line}:{col}: error: "), lines[0]
    assert message in lines[0]
    assert "Traceback" not in err


@pytest.mark.parametrize("path", EXAMPLES + OK, ids=lambda p: p.stem)
def test_lint_ok(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["lint", str(path)]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    contract = load_contract(path)
    for clause in contract.clauses:
        assert f"{clause.id}: [{clause.klass}]" in out
        assert clause.text in out


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_lint_json(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["lint", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    contract = load_contract(path)
    assert info["contract"] == contract.name
    assert info["sha256"] == contract.sha256
    assert [c["id"] for c in info["clauses"]] == [c.id for c in contract.clauses]
    assert {c["class"] for c in info["clauses"]} <= {"certifiable", "empirical", "static"}


def test_lint_missing_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["lint", "no/such/contract.yaml"]) == 2
    err = capsys.readouterr().err
    assert err == "no/such/contract.yaml: error: contract file not found\n"


def test_lint_never_opens_data(tmp_path: Path) -> None:
    """The examples name model and data files; lint must not need them."""
    for path in EXAMPLES:
        copy = tmp_path / path.name
        copy.write_text(path.read_text())
        contract = load_contract(copy)
        assert not contract.resolve(contract.slices[next(iter(contract.slices))].inputs).exists()
