"""Admission policy (--require LEVEL=proved|evidence), recorded in the entry and the log; the
schema migration of registries written before entries stored their files."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from kcverify.certs.checker import check_certificate
from kcverify.certs.encoding import fx
from kcverify.certs.testing import FakeEngine, example_certificate, kernel_specs
from kcverify.cli import main
from kcverify.errors import RegistryError
from kcverify.registry import Registry
from kcverify.registry.store import DEFAULT_POLICY, parse_policy, policy_text


def fake_check(engine: FakeEngine) -> Any:
    def check(cert: Any, model: Any, contract: Any) -> Any:
        return check_certificate(cert, model, contract, kernel_specs=kernel_specs(),
                                 recheck_block=engine.recheck, expected_chain=engine.chain,
                                 store_input=None)
    return check


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture()
def on_evidence(tmp_path: Path, engine: FakeEngine) -> tuple[Path, Path, Path, dict[str, Any]]:
    """The fake example with N-1 (L2) and N-RLHF-1 (L3) decided on evidence: passed, with a
    measured value and no proof (what the planner writes when the bound misses)."""
    model, contract, _, st = example_certificate(tmp_path / "in", engine)
    for cid in ("N-1", "N-RLHF-1"):
        c = next(c for c in st["predicate"]["clauses"] if c["id"] == cid)
        c.update(verdict="passed", proof=None, bound=None, method="empirical-fallback",
                 evidence={"observed": fx(0.01), "n": 64, "formal_verdict": "unknown"})
    cert = tmp_path / "in" / "model.onnx.kcert.json"
    cert.write_text(json.dumps(st))
    return model, contract, cert, st


def test_parse_policy() -> None:
    assert parse_policy(None) == DEFAULT_POLICY == {"L0": "evidence", "L1": "evidence",
                                                    "L2": "proved", "L3": "proved"}
    assert parse_policy(["L3=evidence", "l1=Proved"]) == {"L0": "evidence", "L1": "proved",
                                                          "L2": "proved", "L3": "evidence"}
    assert policy_text(DEFAULT_POLICY) == "L0=evidence L1=evidence L2=proved L3=proved"
    for bad in ("L4=proved", "L2=maybe", "L2"):
        with pytest.raises(RegistryError, match="expected LEVEL=proved or LEVEL=evidence"):
            parse_policy([bad])


def test_evidence_where_proof_is_required_is_rejected(on_evidence: Any, engine: FakeEngine,
                                                      tmp_path: Path) -> None:
    model, contract, cert, _ = on_evidence
    reg = Registry(tmp_path / "reg", check=fake_check(engine))
    d = reg.admit(model, contract, cert)  # default: L2 and L3 need proofs
    assert not d.admitted and d.reasons == [
        "hard clause N-1 (L2) is decided on evidence (passed); the policy requires L2=proved",
        "hard clause N-RLHF-1 (L3) is decided on evidence (passed); the policy requires "
        "L3=proved"]
    d = reg.admit(model, contract, cert, ["L2=evidence"])
    assert not d.admitted and [r.split(" (")[0] for r in d.reasons] == ["hard clause N-RLHF-1"]
    d = reg.admit(model, contract, cert, ["L2=evidence", "L3=evidence"])
    assert d.admitted and d.entry_id == 1
    e = reg.entry(1)
    assert e["policy"] == "L0=evidence L1=evidence L2=evidence L3=evidence"
    log = reg.decisions()
    assert [x["action"] for x in log] == ["reject", "reject", "admit"]
    assert [x["policy"] for x in log] == ["L0=evidence L1=evidence L2=proved L3=proved",
                                          "L0=evidence L1=evidence L2=evidence L3=proved",
                                          e["policy"]]
    assert "the policy requires L3=proved" in log[1]["reason"]
    assert "policy L0=evidence L1=evidence L2=evidence L3=evidence" in log[2]["reason"]
    (res,) = reg.verify()  # re-checked under the policy it was admitted with
    assert res.ok, res.problems
    # the stored policy is re-applied: an entry whose recorded policy now fails is reported
    with sqlite3.connect(reg.root / "registry.sqlite3") as db:
        db.execute("UPDATE entries SET policy = ? WHERE id = 1", (policy_text(DEFAULT_POLICY),))
    (res,) = reg.verify()
    assert not res.ok and "the policy requires L2=proved" in res.problems[0]


def test_proved_clauses_meet_the_default_policy(engine: FakeEngine, tmp_path: Path) -> None:
    model, contract, _, st = example_certificate(tmp_path / "in", engine)
    cert = tmp_path / "in" / "c.json"
    cert.write_text(json.dumps(st))
    reg = Registry(tmp_path / "reg", check=fake_check(engine))
    d = reg.admit(model, contract, cert)
    assert d.admitted and d.policy == DEFAULT_POLICY


def test_cli_require(on_evidence: Any, engine: FakeEngine, tmp_path: Path,
                     monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import kcverify.certs.checker as checker

    model, contract, cert, _ = on_evidence
    real = checker.check_certificate
    monkeypatch.setattr(checker, "check_certificate",
                        lambda c, m, k, **kw: real(c, m, k, kernel_specs=kernel_specs(),
                                                   recheck_block=engine.recheck,
                                                   expected_chain=engine.chain, store_input=None))
    reg = ["registry", "--registry", str(tmp_path / "reg")]
    args = [str(model), str(contract), str(cert)]
    assert main([*reg, "admit", *args]) == 1
    out = capsys.readouterr().out
    assert out.startswith("rejected (policy L0=evidence L1=evidence L2=proved L3=proved):")
    assert "hard clause N-1 (L2) is decided on evidence (passed)" in out
    assert main([*reg, "admit", *args, "--require", "L2=maybe"]) == 2
    assert "error: --require L2=maybe: expected LEVEL=proved or LEVEL=evidence" in \
        capsys.readouterr().err
    assert main([*reg, "admit", *args, "--require", "L2=evidence", "--require",
                 "L3=evidence"]) == 0
    assert "admitted: entry 1 under policy L0=evidence L1=evidence L2=evidence L3=evidence" in \
        capsys.readouterr().out
    assert main([*reg, "show", "1"]) == 0
    out = capsys.readouterr().out
    assert "policy    L0=evidence L1=evidence L2=evidence L3=evidence" in out
    assert "file      slice      data.npz" in out
    assert main([*reg, "log"]) == 0
    assert capsys.readouterr().out.count("reject") == 1  # the bad --require logged nothing


SCHEMA_1 = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE blobs (sha256 TEXT PRIMARY KEY, size INTEGER NOT NULL, kind TEXT NOT NULL,
  created_at TEXT NOT NULL);
CREATE TABLE entries (id INTEGER PRIMARY KEY AUTOINCREMENT,
  status TEXT NOT NULL CHECK (status IN ('admitted', 'revoked')), admitted_at TEXT NOT NULL,
  model_name TEXT NOT NULL, model_sha256 TEXT NOT NULL REFERENCES blobs(sha256),
  contract_name TEXT NOT NULL, contract_sha256 TEXT NOT NULL REFERENCES blobs(sha256),
  kernels_sha256 TEXT NOT NULL REFERENCES blobs(sha256),
  certificate_sha256 TEXT NOT NULL REFERENCES blobs(sha256),
  contract_id TEXT NOT NULL, contract_version TEXT NOT NULL,
  kernel_digests TEXT NOT NULL, clauses TEXT NOT NULL, revoked_at TEXT, revoke_reason TEXT);
CREATE TABLE decisions (id INTEGER PRIMARY KEY AUTOINCREMENT, at TEXT NOT NULL,
  action TEXT NOT NULL CHECK (action IN ('admit', 'reject', 'revoke')),
  entry_id INTEGER REFERENCES entries(id), model_sha256 TEXT, contract_sha256 TEXT,
  certificate_sha256 TEXT, reason TEXT NOT NULL);
INSERT INTO meta VALUES ('schema_version', '1');
INSERT INTO entries VALUES (1, 'admitted', 'then', 'm.onnx', 'aa', 'c.yaml', 'bb', 'cc', 'dd',
  'x', '1', '{}', '[]', NULL, NULL);
INSERT INTO decisions VALUES (1, 'then', 'admit', 1, 'aa', 'bb', 'dd', 'ok');
"""


def test_schema_1_is_migrated(tmp_path: Path) -> None:
    root = tmp_path / "old"
    root.mkdir()
    with sqlite3.connect(root / "registry.sqlite3") as db:
        db.executescript(SCHEMA_1)
    reg = Registry(root)
    with sqlite3.connect(root / "registry.sqlite3") as db:
        assert db.execute("SELECT value FROM meta").fetchone() == ("2",)
    (e,) = reg.entries()
    assert e["policy"] is None and e["files"] == []
    assert reg.decisions()[0]["policy"] is None
    (res,) = reg.verify()
    assert not res.ok and "admit it again" in res.problems[0]
    Registry(root)  # opening again is a no-op
