"""The MLflow Model Registry gate against a real registry: an MLflow tracking store on SQLite in
a temporary directory (no mock), models logged with MLflow's ONNX flavour with their weights as
external data. A passing version gets the kcverify tags and the alias; a failing one gets the
tags (verdict rejected, the reasons) and no alias."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kcverify.cli import main

mlflow = pytest.importorskip("mlflow")
onnx = pytest.importorskip("onnx")

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = ROOT / "examples" / "contracts" / "mlp-fp8.yaml"
NAME = "mlp-gate"


def _scaled(factor: float) -> Any:
    """models/mlp_tiny.onnx with its last layer's weights scaled (factor 1: the shipped model)."""
    from onnx import numpy_helper

    model = onnx.load(str(ROOT / "models" / "mlp_tiny.onnx"))
    if factor != 1:
        for k, t in enumerate(model.graph.initializer):
            if t.name == "4.weight":
                arr = numpy_helper.to_array(t) * np.float32(factor)
                model.graph.initializer[k].CopyFrom(numpy_helper.from_array(arr, t.name))
    return model


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A SQLite-backed MLflow registry with two versions of NAME: 1 passes the MLP contract,
    2 (last layer x 40) does not."""
    tmp = tmp_path_factory.mktemp("mlflow")
    mp = pytest.MonkeyPatch()
    mp.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    mp.setenv("DO_NOT_TRACK", "true")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    exp = mlflow.create_experiment("kcverify-gate", artifact_location=(tmp / "artifacts").as_uri())
    runs = {}
    for version, factor in (("1", 1.0), ("2", 40.0)):
        with mlflow.start_run(experiment_id=exp) as run:
            # size_threshold=0: every weight goes to the external data file, as a large model's
            # (pip_requirements given: MLflow would otherwise infer them in a subprocess)
            mlflow.onnx.log_model(_scaled(factor), name="model", registered_model_name=NAME,
                                  size_threshold=0, pip_requirements=["onnx", "onnxruntime"])
        runs[version] = run.info.run_id
    yield {"uri": uri, "runs": runs, "tmp": tmp}
    mlflow.set_tracking_uri(None)
    mp.undo()


def _client(uri: str) -> Any:
    return mlflow.tracking.MlflowClient(tracking_uri=uri, registry_uri=uri)


def _admit(registry: dict[str, Any], version: str, *extra: str) -> int:
    return main(["mlflow", "admit", "--tracking-uri", registry["uri"], NAME, version,
                 str(CONTRACT), "--alias", "champion", "--quiet", *extra])


def test_versions_store_weights_as_external_data(registry: dict[str, Any]) -> None:
    client = _client(registry["uri"])
    uri = client.get_model_version_download_uri(NAME, "1")
    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri,
                                                     dst_path=str(registry["tmp"] / "dl")))
    onnx_files = list(local.glob("*.onnx"))
    assert len(onnx_files) == 1
    model = onnx.load(str(onnx_files[0]), load_external_data=False)
    assert all(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer)


@pytest.fixture(scope="module")
def decided(registry: dict[str, Any]) -> dict[str, Any]:
    """The gate run once on each version, in order (1 passes, 2 fails), with what it printed."""
    out = {}
    for version in ("1", "2"):
        with _capture() as buf:
            code = _admit(registry, version)
        out[version] = (code, buf.getvalue())
    return out


class _capture:
    """Capture stdout (module-scoped fixtures cannot use capsys)."""

    def __enter__(self) -> Any:
        import contextlib
        import io

        self.buf = io.StringIO()
        self.cm = contextlib.redirect_stdout(self.buf)
        self.cm.__enter__()
        return self.buf

    def __exit__(self, *exc: object) -> None:
        self.cm.__exit__(*exc)


def test_passing_version_gets_tags_and_alias(registry: dict[str, Any],
                                             decided: dict[str, Any]) -> None:
    code, out = decided["1"]
    assert code == 0 and "mlp-gate version 1: admitted" in out
    client = _client(registry["uri"])
    tags = client.get_model_version(NAME, "1").tags
    assert tags["kcverify.verdict"] == "admitted"
    assert tags["kcverify.contract"] == "mlp-fp8" and tags["kcverify.contract_version"] == "1.0.0"
    assert tags["kcverify.version"] == __import__("kcverify").__version__
    assert tags["kcverify.reasons"] == ""
    assert str(client.get_model_version_by_alias(NAME, "champion").version) == "1"
    # the certificate is an artifact of the version's run, and the tag holds its sha256
    run = registry["runs"]["1"]
    names = [a.path for a in client.list_artifacts(run, "kcverify")]
    assert "kcverify/model.onnx.kcert.json" in names and "kcverify/report.json" in names
    cert = Path(client.download_artifacts(run, "kcverify/model.onnx.kcert.json",
                                          str(registry["tmp"] / "cert1")))
    assert hashlib.sha256(cert.read_bytes()).hexdigest() == tags["kcverify.certificate_sha256"]
    assert tags["kcverify.certificate_artifact"] == f"runs:/{run}/kcverify/model.onnx.kcert.json"


def test_failing_version_gets_tags_and_no_alias(registry: dict[str, Any],
                                                decided: dict[str, Any]) -> None:
    code, out = decided["2"]
    assert code == 1
    assert "mlp-gate version 2: rejected" in out and "reason: hard clause N-MLP-1" in out
    client = _client(registry["uri"])
    tags = client.get_model_version(NAME, "2").tags
    assert tags["kcverify.verdict"] == "rejected"
    assert "N-MLP-1" in tags["kcverify.reasons"]
    assert len(tags["kcverify.certificate_sha256"]) == 64
    assert "kcverify/model.onnx.kcert.json" in [
        a.path for a in client.list_artifacts(registry["runs"]["2"], "kcverify")]
    assert str(client.get_model_version_by_alias(NAME, "champion").version) == "1"


def test_given_certificate_is_checked_not_proved(registry: dict[str, Any],
                                                 decided: dict[str, Any], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """--cert: the gate checks it. Version 1's own certificate admits version 1; it does not
    admit version 2 (another model digest), and the alias stays on 1."""
    client = _client(registry["uri"])
    cert = Path(client.download_artifacts(registry["runs"]["1"], "kcverify/model.onnx.kcert.json",
                                          str(tmp_path)))
    mine = tmp_path / "v1.kcert.json"
    shutil.copy(cert, mine)
    assert _admit(registry, "1", "--cert", str(mine), "--json") == 0
    assert json.loads(capsys.readouterr().out)["admitted"] is True
    assert _admit(registry, "2", "--cert", str(mine)) == 1
    assert "certificate does not check" in capsys.readouterr().out
    assert str(client.get_model_version_by_alias(NAME, "champion").version) == "1"


def test_bad_input_writes_nothing(registry: dict[str, Any], decided: dict[str, Any],
                                  capsys: pytest.CaptureFixture[str]) -> None:
    client = _client(registry["uri"])
    before = client.get_model_version(NAME, "2").tags
    assert _admit(registry, "7") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: mlflow: model {NAME!r} version 7")
    assert main(["mlflow", "admit", "--tracking-uri", registry["uri"], NAME, "2",
                 str(ROOT / "examples" / "contracts" / "nope.yaml"), "--alias", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nope.yaml" in err[0]
    assert client.get_model_version(NAME, "2").tags == before
    assert str(client.get_model_version_by_alias(NAME, "champion").version) == "1"


def test_rejected_version_loses_the_alias(registry: dict[str, Any], decided: dict[str, Any],
                                          tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A re-run that rejects the version the alias points at (here: a tampered certificate)
    removes the alias; re-admitting it sets it again."""
    client = _client(registry["uri"])
    good = Path(client.download_artifacts(registry["runs"]["1"], "kcverify/model.onnx.kcert.json",
                                          str(tmp_path)))
    stmt = json.loads(good.read_text())
    stmt["predicate"]["clauses"][0]["bound"] = (1e-9).hex()  # a tighter bound than proved
    bad = tmp_path / "tampered.kcert.json"
    bad.write_text(json.dumps(stmt, sort_keys=True, indent=1))
    assert str(client.get_model_version_by_alias(NAME, "champion").version) == "1"
    assert _admit(registry, "1", "--cert", str(bad)) == 1
    assert "alias 'champion' pointed at this rejected version: removed" in capsys.readouterr().out
    assert client.get_model_version(NAME, "1").tags["kcverify.verdict"] == "rejected"
    with pytest.raises(mlflow.exceptions.MlflowException):
        client.get_model_version_by_alias(NAME, "champion")
    assert _admit(registry, "1", "--cert", str(good)) == 0
    assert str(client.get_model_version_by_alias(NAME, "champion").version) == "1"
