"""`kcverify bound`, driven in-process through kcverify.cli.main."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kcverify.cli import main

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = ROOT / "examples" / "contracts" / "fp8-deploy.yaml"


def test_bound_json_one_entry_per_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    x = np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    rc = main(["bound", str(ROOT / "models" / "mlp_tiny.onnx"), str(CONTRACT), "--inputs",
               str(tmp_path / "x.npy"), "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["bounds"]) == 3
    assert all(0 < b["linf"] < 1 for b in out["bounds"])
    assert [b["name"] for b in out["blocks"]]


def test_bound_npz_and_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    np.savez(tmp_path / "x.npz", x=np.zeros((2, 4), np.float32))
    rc = main(["bound", str(ROOT / "models" / "mlp_tiny.onnx"), str(CONTRACT), "--inputs",
               str(tmp_path / "x.npz"), "--domain", "interval", "--eps", "0.01"])
    assert rc == 0
    assert "input    1  linf <=" in capsys.readouterr().out


def test_bound_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bound", str(ROOT / "models" / "mlp_tiny.onnx"), str(CONTRACT), "--inputs",
               str(tmp_path / "missing.npy")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and "no such inputs file" in err
    bad = tmp_path / "c.yaml"
    bad.write_text(CONTRACT.read_text().replace("  inf:\n", "  serve:\n"))
    np.save(tmp_path / "x.npy", np.zeros((1, 4), np.float32))
    rc = main(["bound", str(ROOT / "models" / "mlp_tiny.onnx"), str(bad), "--inputs",
               str(tmp_path / "x.npy")])
    err = capsys.readouterr().err
    assert rc == 2 and "error: " in err and err.count("\n") == 1
    with pytest.raises(SystemExit):
        main(["bound", str(ROOT / "models" / "mlp_tiny.onnx"), str(CONTRACT), "--inputs",
              str(tmp_path / "x.npy"), "--domain", "cubic"])


def test_bound_linear_no_looser_than_interval(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    np.save(tmp_path / "x.npy", np.random.default_rng(3).normal(size=(2, 8)).astype(np.float32))
    got = {}
    for d in ("interval", "linear"):
        assert main(["bound", str(ROOT / "models" / "mlp_small.onnx"), str(CONTRACT), "--inputs",
                     str(tmp_path / "x.npy"), "--domain", d, "--eps", "0.05", "--json"]) == 0
        got[d] = [b["linf"] for b in json.loads(capsys.readouterr().out)["bounds"]]
    assert all(a <= b for a, b in zip(got["linear"], got["interval"]))
    assert any(a < 0.99 * b for a, b in zip(got["linear"], got["interval"]))
