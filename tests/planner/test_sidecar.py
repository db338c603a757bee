"""A second contract on the same model does not silently replace the first one's certificate:
prove refuses before any work (exit 2, one line, the first certificate untouched) unless --force;
--cert keeps both, and check works on each."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kcverify.cli import main


def _second_contract(contract: Path) -> Path:
    text = contract.read_text().replace("contract: mlp-fp8\n", "contract: mlp-fp8-guard\n")
    other = contract.with_name("mlp-guard.yaml")
    other.write_text(text)
    return other


def test_second_contract_does_not_overwrite(workspace: Any,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    model, first = workspace("mlp_tiny.onnx", "mlp-fp8.yaml")
    second = _second_contract(first)
    side = model.with_name(model.name + ".kcert.json")
    assert main(["prove", str(first), str(model), "--quiet"]) == 0
    before = side.read_bytes()
    capsys.readouterr()

    assert main(["prove", str(second), str(model), "--quiet"]) == 2
    out, err = capsys.readouterr()
    (line,) = err.strip().splitlines()
    assert line.startswith(f"error: {side} holds the certificate of contract 'mlp-fp8'")
    keep = model.with_name(f"{model.name}.mlp-fp8-guard.kcert.json")
    assert f"--cert {keep}" in line and "--force" in line and out == ""
    assert side.read_bytes() == before  # untouched: refused before proving

    # keep both: the suggested per-contract name; check works on each
    assert main(["prove", str(second), str(model), "--cert", str(keep), "--quiet"]) == 0
    assert main(["check", str(side), str(model), str(first)]) == 0
    assert main(["check", str(keep), str(model), str(second)]) == 0
    assert main(["check", str(keep), str(model), str(first)]) == 1  # not each other's

    # a re-run of the same contract replaces its own certificate; --force replaces another's
    assert main(["prove", str(first), str(model), "--quiet"]) == 0
    assert main(["prove", str(second), str(model), "--quiet", "--force"]) == 0
    assert main(["check", str(side), str(model), str(second)]) == 0
    capsys.readouterr()


def test_embedded_certificate_of_another_contract_is_kept(
        workspace: Any, capsys: pytest.CaptureFixture[str]) -> None:
    model, first = workspace("mlp_tiny.onnx", "mlp-fp8.yaml")
    second = _second_contract(first)
    assert main(["prove", str(first), str(model), "--embed", "--quiet"]) == 0
    before = model.read_bytes()
    capsys.readouterr()
    assert main(["prove", str(second), str(model), "--embed", "--quiet"]) == 2
    assert "holds the certificate of contract 'mlp-fp8'" in capsys.readouterr().err
    assert model.read_bytes() == before
    assert main(["check", str(model), str(model), str(first)]) == 0
    capsys.readouterr()


def test_unreadable_certificate_at_the_path_is_not_overwritten(
        workspace: Any, capsys: pytest.CaptureFixture[str]) -> None:
    model, first = workspace("mlp_tiny.onnx", "mlp-fp8.yaml")
    side = model.with_name(model.name + ".kcert.json")
    side.write_text("my notes, not a certificate")
    assert main(["prove", str(first), str(model), "--quiet"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "is not a kcverify certificate" in line and "--force" in line
    assert side.read_text() == "my notes, not a certificate"
