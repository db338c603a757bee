"""`kcverify inspect` in-process through kcverify.cli.main."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _model_helpers import MODELS, two_unknown_ops

from kcverify.cli import main


def test_inspect_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(MODELS / "tiny_decoder.onnx")]) == 0
    out = capsys.readouterr().out
    assert "input    input_ids: int64 [batch, seq]" in out
    assert "MatMul 13" in out and "unsupported none" in out
    for block in ("embedding", "layer0", "layer1", "head"):
        assert f"  {block}" in out
    assert "onnxruntime" not in out


def test_inspect_json_against_ort(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(MODELS / "tiny_encoder.onnx"), "--json", "--against-ort",
                 "--batch", "3", "--seq", "7"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["ops"]["Softmax"] == 2 and rep["unsupported"] == []
    assert [b["kind"] for b in rep["blocks"]] == ["embedding", "layer", "layer"]
    assert all(len(b["digest"]) == 64 and b["nodes"] > 0 for b in rep["blocks"])
    assert rep["against_ort"]["ok"] is True
    assert rep["against_ort"]["feeds"] == {"input_ids": [3, 7]}
    hidden = rep["against_ort"]["outputs"]["hidden"]
    assert 0 <= hidden["max_abs_diff"] <= 1e-5 * hidden["max_abs_output"]


def test_inspect_lists_unsupported_ops(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import onnx

    path = tmp_path / "odd.onnx"
    onnx.save(two_unknown_ops(), path)
    assert main(["inspect", str(path), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["unsupported"] == [{"op": "acme::FancyNorm", "node": "fancy_1"},
                                  {"op": "acme::Warp", "node": "warp_9"}]
    assert main(["inspect", str(path), "--against-ort"]) == 1
    out = capsys.readouterr().out
    assert "unsupported acme::FancyNorm ('fancy_1'), acme::Warp ('warp_9')" in out
    assert "skipped" in out


def test_inspect_missing_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "no/such/model.onnx"]) == 2
    assert capsys.readouterr().err.strip() == "error: no/such/model.onnx: no such ONNX file"
