"""The package as a user installs it: the wheel holds every subpackage and the package data
(grammar, JSON Schemas, py.typed), and importing kcverify stays light.

The wheel is built without build isolation (the venv's setuptools, no network): what matters is
the list of files pyproject.toml puts in it, which a hand-written package list once got wrong
(kcverify.models.ops and kcverify.bounds.rules were missing and `kcverify --help` crashed)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    out = tmp_path_factory.mktemp("wheel")
    pytest.importorskip("setuptools")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(out), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = out.glob("kcverify-*.whl")
    with zipfile.ZipFile(wheel) as z:
        return set(z.namelist())


def test_wheel_holds_every_package(wheel_files: set[str]) -> None:
    packages = sorted(p.parent.relative_to(ROOT).as_posix()
                      for p in (ROOT / "kcverify").rglob("__init__.py"))
    assert "kcverify/models/ops" in packages and "kcverify/bounds/rules" in packages
    missing = [p for p in packages if f"{p}/__init__.py" not in wheel_files]
    assert not missing, f"packages left out of the wheel: {missing}"
    modules = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "kcverify").rglob("*.py"))
    assert not [m for m in modules if m not in wheel_files]


def test_wheel_holds_package_data(wheel_files: set[str]) -> None:
    assert "kcverify/dsl/grammar/contract.lark" in wheel_files
    assert "kcverify/py.typed" in wheel_files
    schemas = sorted(p.relative_to(ROOT).as_posix()
                     for p in (ROOT / "kcverify" / "schemas").glob("*.json"))
    assert schemas and all(s in wheel_files for s in schemas)
    # nothing from outside the package (tests, examples, a top-level grammar package)
    assert all(f.startswith(("kcverify/", "kcverify-")) for f in wheel_files), sorted(wheel_files)


def test_grammar_is_package_data() -> None:
    """The parser reads the grammar through the package (importlib), so a plain checkout and an
    installed wheel load the same file."""
    from kcverify.dsl.parser import grammar

    assert (ROOT / "kcverify" / "dsl" / "grammar" / "contract.lark").is_file()
    assert not (ROOT / "grammar").exists()
    assert grammar().parse("1 <= 2") is not None


def test_import_is_light() -> None:
    """`import kcverify` loads neither torch, onnx nor the CLI; the API resolves lazily."""
    code = ("import sys, kcverify\n"
            "heavy = [m for m in ('torch', 'onnx', 'onnxruntime', 'z3', 'scipy', 'kcverify.cli')"
            " if m in sys.modules]\n"
            "assert not heavy, heavy\n"
            "assert callable(kcverify.prove) and callable(kcverify.load_contract)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
