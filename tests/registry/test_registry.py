"""Registry admission: the gate, the store, the decision log, concurrency."""

from __future__ import annotations

import copy
import json
import multiprocessing
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from kcverify.certs.checker import check_certificate
from kcverify.certs.encoding import fx, unfx
from kcverify.certs.recheck import recheck_with
from kcverify.certs.testing import FakeBox, FakeEngine, example_certificate, kernel_specs
from kcverify.cli import main
from kcverify.errors import InputFileError, RegistryError
from kcverify.kernels.spec import parse_kernel_spec
from kcverify.registry import Registry, default_root


def fake_check(engine: FakeEngine, specs: dict[str, Any] | None = None) -> Any:
    specs = specs or kernel_specs()

    def check(cert: Any, model: Any, contract: Any) -> Any:
        return check_certificate(cert, model, contract, kernel_specs=specs,
                                 recheck_block=engine.recheck, expected_chain=engine.chain,
                                 store_input=None)

    return check


def make_registry(root: Path, engine: FakeEngine, specs: dict[str, Any] | None = None) -> Registry:
    return Registry(root, check=fake_check(engine, specs), kernel_specs=lambda _p: kernel_specs())


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture(scope="module")
def _example(tmp_path_factory: pytest.TempPathFactory, engine: FakeEngine) -> Any:
    return example_certificate(tmp_path_factory.mktemp("ex"), engine)


@pytest.fixture()
def example(_example: Any, tmp_path: Path) -> tuple[Path, Path, Path, dict[str, Any]]:
    """(model, contract, certificate file, statement) as fresh copies."""
    model, contract, _, stmt = _example
    d = tmp_path / "in"
    d.mkdir()
    (d / "model.onnx").write_bytes(model.read_bytes())
    (d / "contract.yaml").write_bytes(contract.read_bytes())
    (d / "data.npz").write_bytes((contract.parent / "data.npz").read_bytes())
    cert = d / "model.onnx.kcert.json"
    cert.write_text(json.dumps(stmt))
    return d / "model.onnx", d / "contract.yaml", cert, copy.deepcopy(stmt)


def blob_files(reg: Registry) -> list[Path]:
    return sorted(p for p in reg.blob_dir.rglob("*") if p.is_file())


def test_default_location(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KCVERIFY_REGISTRY", str(tmp_path / "env"))
    assert default_root() == tmp_path / "env"
    assert default_root(tmp_path / "x") == tmp_path / "x"
    monkeypatch.delenv("KCVERIFY_REGISTRY")
    assert default_root() == Path.home() / ".kcverify" / "registry"


def test_admit_list_show_revoke(example: Any, engine: FakeEngine, tmp_path: Path) -> None:
    model, contract, cert, _ = example
    reg = make_registry(tmp_path / "reg", engine)
    d = reg.admit(model, contract, cert)
    assert d.admitted and d.entry_id == 1 and not d.duplicate
    files = blob_files(reg)
    assert len(files) == 5  # model, contract, slice data, kernel specs, certificate
    import hashlib

    assert all(hashlib.sha256(p.read_bytes()).hexdigest() == p.name for p in files)
    e = reg.entry(1)
    assert e["status"] == "admitted" and e["contract_id"] == "fake-contract"
    assert set(e["kernel_digests"]) == {"train", "inf"}
    specs_blob = json.loads(reg.blob_path(e["kernels_sha256"]).read_text())
    assert specs_blob["canonical"]["inf"]["compute"] == "bf16"
    assert reg.certificate(1)["predicate"]["contract"]["name"] == "fake-contract"
    again = reg.admit(model, contract, cert)  # same tuple: deduplicated, still logged
    assert again.admitted and again.duplicate and again.entry_id == 1
    assert len(blob_files(reg)) == 5 and len(reg.entries()) == 1
    reg.revoke(1, "kernel rolled back")
    assert reg.entry(1)["status"] == "revoked" and reg.entries("admitted") == []
    with pytest.raises(RegistryError, match="already revoked"):
        reg.revoke(1, "again")
    with pytest.raises(RegistryError, match="no registry entry 7"):
        reg.revoke(7, "x")
    log = reg.decisions()
    assert [d["action"] for d in log] == ["admit", "admit", "revoke"]
    assert log[2]["reason"] == "kernel rolled back" and "already admitted" in log[1]["reason"]
    assert reg.integrity() == []
    # a revoked tuple may be admitted again, as a new entry
    assert reg.admit(model, contract, cert).entry_id == 2


def _tamper_model(m: Path, c: Path, cert: Path, st: dict[str, Any]) -> dict[str, Any]:
    data = bytearray(m.read_bytes())
    data[len(data) // 2] ^= 1
    m.write_bytes(bytes(data))
    return {}


def _tamper_contract(m: Path, c: Path, cert: Path, st: dict[str, Any]) -> dict[str, Any]:
    c.write_text(c.read_text() + "# edited\n")
    return {}


def _tamper_spec(m: Path, c: Path, cert: Path, st: dict[str, Any]) -> dict[str, Any]:
    specs = kernel_specs()
    specs["inf"] = parse_kernel_spec("inf", {"compute": "fp16", "accumulate": "fp32"})
    return {"specs": specs}


def _tamper_bound(m: Path, c: Path, cert: Path, st: dict[str, Any]) -> dict[str, Any]:
    cl = st["predicate"]["clauses"][0]
    cl["bound"] = fx(unfx(cl["bound"]) / 4)
    cert.write_text(json.dumps(st))
    return {}


def _tamper_block(m: Path, c: Path, cert: Path, st: dict[str, Any]) -> dict[str, Any]:
    node = st["predicate"]["clauses"][0]["proof"]
    while node["rule"] != "sequential":
        node = node["premises"][0]
    del node["premises"][0]
    cert.write_text(json.dumps(st))
    return {}


def _tamper_precondition(m: Path, c: Path, cert: Path, st: dict[str, Any]) -> dict[str, Any]:
    cl = st["predicate"]["clauses"][0]
    for obj in (cl, cl["proof"]["params"], cl["proof"]["conclusion"]):
        obj["threshold"] = fx(1e-9)
    cert.write_text(json.dumps(st))
    return {}


TAMPERS = {"model-byte": (_tamper_model, "model digest mismatch"),
           "contract": (_tamper_contract, "contract digest mismatch"),
           "kernel-spec": (_tamper_spec, "kernel spec digest mismatch"),
           "edited-bound": (_tamper_bound, "tighter than the proof gives"),
           "removed-block": (_tamper_block, "no earlier block produces"),
           "precondition": (_tamper_precondition, "outside its precondition")}


@pytest.mark.parametrize("case", sorted(TAMPERS))
def test_rejected_admission_leaves_nothing(case: str, example: Any, engine: FakeEngine,
                                           tmp_path: Path) -> None:
    model, contract, cert, st = example
    tamper, message = TAMPERS[case]
    extra = tamper(model, contract, cert, st)
    reg = make_registry(tmp_path / "reg", engine, extra.get("specs"))
    d = reg.admit(model, contract, cert)
    assert not d.admitted and d.entry_id is None
    assert any(message in r for r in d.reasons), d.reasons
    assert blob_files(reg) == [] and reg.entries(None) == []
    with sqlite3.connect(reg.root / "registry.sqlite3") as db:
        assert db.execute("SELECT COUNT(*) FROM blobs").fetchone() == (0,)
    (log,) = reg.decisions()
    assert log["action"] == "reject" and message in log["reason"] and log["entry_id"] is None


def test_hard_clauses_must_be_proved_or_passed(example: Any, engine: FakeEngine,
                                               tmp_path: Path) -> None:
    model, contract, cert, st = example
    reg = make_registry(tmp_path / "reg", engine)
    soft = next(c for c in st["predicate"]["clauses"] if not c["hard"])
    soft["verdict"], soft["proof"] = "unknown", None  # a soft clause may stay unknown
    cert.write_text(json.dumps(st))
    assert reg.admit(model, contract, cert).admitted
    hard = st["predicate"]["clauses"][0]
    hard["verdict"], hard["proof"] = "unknown", None
    cert.write_text(json.dumps(st))
    d = reg.admit(model, contract, cert)
    assert not d.admitted and d.reasons == ["hard clause N-1 is unknown (admission needs proved or "
                                            "passed)"]
    hard.update(verdict="refuted", bound=fx(0.9), evidence={"counterexample": {"input": 0}})
    cert.write_text(json.dumps(st))
    d = reg.admit(model, contract, cert)
    assert not d.admitted and d.reasons == ["hard clause N-1 is refuted (admission needs proved or "
                                            "passed)"]
    assert [x["action"] for x in reg.decisions()] == ["admit", "reject", "reject"]


def test_verify_reports_failing_entries(example: Any, engine: FakeEngine, tmp_path: Path) -> None:
    model, contract, cert, _ = example
    reg = make_registry(tmp_path / "reg", engine)
    reg.admit(model, contract, cert)
    assert [r.ok for r in reg.verify()] == [True]
    # an engine that now computes wider blocks (e.g. a fixed soundness bug) fails re-verification
    wide = FakeEngine(eps=2e-3)
    hook = recheck_with(wide.bound_block, {b.digest: w for b, w in zip(engine.blocks, wide.blocks)},
                        None, None, FakeBox)
    strict = Registry(reg.root, check=lambda c, m, k: check_certificate(
        c, m, k, kernel_specs=kernel_specs(), recheck_block=hook, expected_chain=engine.chain,
        store_input=None))
    (res,) = strict.verify()
    assert not res.ok and any("not inside the stored one" in p for p in res.problems)
    e = reg.entry(1)
    blob = reg.blob_path(e["contract_sha256"])
    blob.chmod(0o644)
    blob.write_text("tampered")
    (res,) = reg.verify()
    assert not res.ok and "corrupted" in res.problems[0]
    assert any("corrupted" in p for p in reg.integrity())


def _admit_worker(args: tuple[str, str, str, str, int]) -> tuple[bool, int | None]:
    root, model, contract, cert, seed = args
    reg = make_registry(Path(root), FakeEngine(seed=seed))
    d = reg.admit(model, contract, cert)
    return d.admitted, d.entry_id


def test_concurrent_admits(tmp_path: Path) -> None:
    jobs = []
    for k, seed in enumerate((0, 0, 7)):  # two certificates for one model, one for another
        engine = FakeEngine(seed=seed)
        m, c, _, st = example_certificate(tmp_path / f"ex{k}", engine, seed=k + 10)
        cert = tmp_path / f"ex{k}" / "cert.json"
        cert.write_text(json.dumps(st))
        jobs += [(str(tmp_path / "reg"), str(m), str(c), str(cert), seed)] * 3
    bad = tmp_path / "ex0" / "bad.json"
    st = json.loads((tmp_path / "ex0" / "cert.json").read_text())
    st["predicate"]["clauses"][0]["bound"] = fx(0.0)
    bad.write_text(json.dumps(st))
    jobs += [(str(tmp_path / "reg"), str(tmp_path / "ex0" / "model.onnx"),
              str(tmp_path / "ex0" / "contract.yaml"), str(bad), 0)] * 2
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(4) as pool:
        results = pool.map(_admit_worker, jobs)
    ids = [r[1] for r in results if r[0]]
    assert sorted(ids) == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert len({ids[0], ids[3], ids[6]}) == 3  # each certificate got one entry
    assert [r[0] for r in results].count(False) == 2
    reg = Registry(tmp_path / "reg")
    assert reg.integrity() == []
    assert len(reg.entries()) == 3
    # models, contract, kernel specs (shared), slice data and certs (one per certificate)
    assert len(blob_files(reg)) == 2 + 1 + 1 + 3 + 3
    actions = [d["action"] for d in reg.decisions()]
    assert actions.count("admit") == 9 and actions.count("reject") == 2


def test_cli(example: Any, engine: FakeEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
             capsys: pytest.CaptureFixture[str]) -> None:
    import kcverify.certs.checker as checker

    model, contract, cert, st = example
    real = checker.check_certificate
    monkeypatch.setattr(checker, "check_certificate",
                        lambda c, m, k, **kw: real(c, m, k, kernel_specs=kernel_specs(),
                                                   recheck_block=engine.recheck,
                                                   expected_chain=engine.chain,
                                                   store_input=None))
    monkeypatch.setenv("KCVERIFY_REGISTRY", str(tmp_path / "reg"))
    assert main(["registry", "admit", str(model), str(contract), str(cert)]) == 0
    assert "admitted: entry 1" in capsys.readouterr().out
    assert main(["registry", "list"]) == 0
    assert "fake-contract@1.0.0" in capsys.readouterr().out
    assert main(["registry", "verify"]) == 0
    assert "1 of 1 entries re-check" in capsys.readouterr().out
    st["predicate"]["clauses"][0]["bound"] = fx(0.0)
    cert.write_text(json.dumps(st))
    assert main(["registry", "admit", str(model), str(contract), str(cert)]) == 1
    assert "rejected (policy L0=evidence L1=evidence L2=proved L3=proved):" in capsys.readouterr().out
    assert main(["registry", "--registry", str(tmp_path / "reg"), "revoke", "1",
                 "--reason", "superseded"]) == 0
    assert main(["registry", "show", "1"]) == 0
    out = capsys.readouterr().out
    assert "revoked (superseded" in out and "admit: certificate checks" in out
    assert main(["registry", "log"]) == 0
    out = capsys.readouterr().out
    assert "reject" in out and "revoke" in out
    assert main(["registry", "show", "9"]) == 2
    assert main(["registry", "admit", str(model.with_name("x.onnx")), str(contract), str(cert)]) == 2
    capsys.readouterr()


def test_admit_missing_file_is_bad_input(example: Any, engine: FakeEngine, tmp_path: Path) -> None:
    model, contract, cert, _ = example
    reg = make_registry(tmp_path / "reg", engine)
    with pytest.raises(InputFileError):
        reg.admit(model, contract.with_name("none.yaml"), cert)
    assert reg.decisions() == []
