"""Sidecar and embedded certificates; the checker finds both; `kcverify check` exit codes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import onnx
import pytest

from kcverify.certs.attach import (
    METADATA_KEY,
    attach,
    canonical_model_digest,
    embed,
    find_certificate,
    sidecar_path,
)
from kcverify.certs.checker import check_certificate
from kcverify.certs.testing import FakeEngine
from kcverify.cli import main
from kcverify.errors import CertificateError, InputFileError


def test_sidecar_then_embedded(example: Any, engine: FakeEngine, tmp_path: Path) -> None:
    model, contract, specs, stmt = example
    kw = {"kernel_specs": specs, "recheck_block": engine.recheck, "expected_chain": engine.chain,
          "store_input": None}
    side = attach(model, stmt)
    assert side == sidecar_path(model) and side.name == "model.onnx.kcert.json"
    found, where = find_certificate(model)
    assert found == stmt and where == str(side)
    before = canonical_model_digest(model)
    emb = embed(model, stmt)
    assert canonical_model_digest(model) == before  # the embedded entry is not digested
    side.unlink()
    found, where = find_certificate(model)
    assert found == emb and where.endswith(f"#metadata:{METADATA_KEY}")
    msub = next(s for s in emb["subject"] if s["annotations"]["kcverify.role"] == "model")
    assert msub["annotations"]["kcverify.digest"] == "onnx-canonical-v1"
    assert check_certificate(model, model, contract, **kw).ok  # CERT = the model itself
    # a weight changed after embedding is caught
    m = onnx.load(str(model))
    m.graph.initializer[0].raw_data = bytes([m.graph.initializer[0].raw_data[0] ^ 1]) + \
        m.graph.initializer[0].raw_data[1:]
    onnx.save(m, str(model))
    report = check_certificate(model, model, contract, **kw)
    assert not report.ok and "model digest mismatch (onnx-canonical-v1)" in report.problems[0]


def test_embed_refuses_a_certificate_for_another_model(example: Any) -> None:
    model, _, _, stmt = example
    model.write_bytes(model.read_bytes() + b"\x00")
    with pytest.raises(CertificateError, match="refusing to embed"):
        embed(model, stmt)


def test_find_certificate_when_there_is_none(example: Any) -> None:
    with pytest.raises(CertificateError, match="no certificate"):
        find_certificate(example[0])
    with pytest.raises(InputFileError):
        find_certificate(example[0].with_name("absent.onnx"))


def test_cli_check_exit_codes(example: Any, monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    model, contract, specs, stmt = example
    import kcverify.certs.checker as checker

    real = checker.check_certificate
    engine = FakeEngine()

    def fake(cert: Any, m: Any, c: Any, **kw: Any) -> Any:
        return real(cert, m, c, kernel_specs=specs, recheck_block=engine.recheck,
                    expected_chain=engine.chain, store_input=None)

    monkeypatch.setattr(checker, "check_certificate", fake)
    side = attach(model, stmt)
    assert main(["check", str(side), str(model), str(contract)]) == 0
    assert "ok: certificate checks" in capsys.readouterr().out
    doc = json.loads(side.read_text())
    doc["predicate"]["clauses"][0]["bound"] = "0x0p+0"
    side.write_text(json.dumps(doc))
    assert main(["check", str(side), str(model), str(contract)]) == 1
    assert "FAIL: clause N-1" in capsys.readouterr().out
    assert main(["check", str(side), str(model.with_name("nope.onnx")), str(contract)]) == 2
    assert "no such model file" in capsys.readouterr().err


def test_describe_proof_trees(example: Any) -> None:
    from kcverify.certs.describe import describe_certificate

    lines = describe_certificate(example[3])
    text = "\n".join(lines)
    assert lines[0].startswith("contract fake-contract@1.0.0, 7 clauses, 2 block certificates")
    assert "N-1 (hard): proved bound" in text
    assert "threshold: ratio_dev" in text and "sequential over all: 0:b0 → 1:b1" in text
    assert "S-1 (soft): passed" in text
