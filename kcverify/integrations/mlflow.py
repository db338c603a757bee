"""The MLflow Model Registry gate (``kcverify[mlflow]``; docs/mlflow.md).

``admit(name, version, contract)`` takes one registered model version and decides whether it may
be served under a contract:

1. download the version's artifacts (``MlflowClient.get_model_version_download_uri``), external
   data included: MLflow's ONNX flavour saves the weights as external data by default, and the
   ONNX file named by the MLmodel's ``onnx`` flavour is loaded with them;
2. prove the contract on it (``kcverify.api.prove``; the contract's slice files are read next to
   the contract), or take the given certificate; either way re-check the certificate
   independently (``kcverify.api.check``);
3. decide as ``kcverify registry admit`` does: the certificate checks and every hard clause holds
   under the admission policy (``kcverify.registry.store.policy_reasons``);
4. log the certificate (and the report, when proved here) as artifacts of the version's run under
   ``kcverify/``, set the version's tags (``kcverify.verdict`` admitted | rejected,
   ``kcverify.certificate_sha256``, ``kcverify.contract``, ``kcverify.contract_version``,
   ``kcverify.version``, ``kcverify.reasons``), and only when admitted point ALIAS at the
   version. A rejected version never holds ALIAS: if it did (a re-run), the alias is removed.

MLflow webhooks notify but cannot veto, so the gate is the only writer of the serving alias:
deployers resolve ``models:/NAME@ALIAS`` (and may re-check the logged certificate).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kcverify.errors import InputFileError, KcverifyError

TAG = "kcverify."
ARTIFACT_DIR = "kcverify"
MAX_TAG = 4000  # MLflow limits tag values (5000 characters in recent servers)


class MlflowGateError(KcverifyError):
    """Bad input to the gate: MLflow missing, an unknown model version, no ONNX in it."""


@dataclass
class GateResult:
    """The gate's decision on one model version, and what it wrote to the registry."""

    name: str
    version: str
    admitted: bool
    reasons: list[str]
    certificate_sha256: str
    contract: str
    contract_version: str
    tags: dict[str, str]
    alias: str | None = None  # the alias set (None when not admitted or not asked)
    run_id: str | None = None
    artifacts: list[str] = field(default_factory=list)  # artifact paths logged to the run
    notes: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        """0 admitted, 1 rejected (the CLI's convention)."""
        return 0 if self.admitted else 1

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "admitted": self.admitted,
                "reasons": list(self.reasons), "certificate_sha256": self.certificate_sha256,
                "contract": self.contract, "contract_version": self.contract_version,
                "tags": dict(self.tags), "alias": self.alias, "run_id": self.run_id,
                "artifacts": list(self.artifacts), "notes": list(self.notes)}


def _mlflow() -> Any:
    try:
        import mlflow
    except ImportError:
        raise MlflowGateError("kcverify mlflow needs MLflow: pip install 'kcverify[mlflow]'"
                              ) from None
    return mlflow


def onnx_file(model_dir: Path) -> Path:
    """The ONNX file of a downloaded MLflow model: the ``onnx`` flavour's ``data`` in MLmodel,
    else the one .onnx file of the directory."""
    import yaml

    mlmodel = model_dir / "MLmodel"
    if mlmodel.is_file():
        try:
            meta = yaml.safe_load(mlmodel.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as e:
            raise MlflowGateError(f"{mlmodel}: not readable YAML ({e})") from None
        data = ((meta.get("flavors") or {}).get("onnx") or {}).get("data")
        if data:
            path = model_dir / str(data)
            if not path.is_file():
                raise MlflowGateError(f"{mlmodel}: the onnx flavour names {data!r}, which the "
                                      f"model version's artifacts do not contain")
            return path
    found = sorted(model_dir.rglob("*.onnx"))
    if len(found) != 1:
        flavors = "no MLmodel" if not mlmodel.is_file() else "no onnx flavour in MLmodel"
        raise MlflowGateError(f"{model_dir}: expected one ONNX model ({flavors}); found "
                              f"{len(found)} .onnx files")
    return found[0]


def admit(name: str, version: str | int, contract: str | os.PathLike[str], *,
          tracking_uri: str | None = None, registry_uri: str | None = None,
          cert: str | os.PathLike[str] | None = None, alias: str | None = None,
          policy: Sequence[str] | Mapping[str, str] | None = None, device: str = "cpu",
          progress: Callable[[str], None] | None = None) -> GateResult:
    """Gate model version ``name``/``version`` of an MLflow Model Registry on ``contract``
    (see the module docstring). Raises MlflowGateError / KcverifyError on bad input (MLflow
    missing, unknown version, no ONNX model, a bad contract or certificate file) before
    writing anything to the registry."""
    mlflow = _mlflow()
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from kcverify import __version__, api
    from kcverify.registry.store import parse_policy, policy_reasons

    def say(msg: str) -> None:
        if progress is not None:
            progress(msg)

    version = str(version)
    contract = Path(contract)
    parsed = api.load_contract(contract)  # a bad contract is bad input: nothing written yet
    if cert is not None and not Path(cert).is_file():
        raise InputFileError(f"{cert}: no such certificate file")
    pol = parse_policy(policy)
    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=registry_uri or tracking_uri)
    try:
        mv = client.get_model_version(name, version)
        uri = client.get_model_version_download_uri(name, version)
    except MlflowException as e:
        raise MlflowGateError(f"mlflow: model {name!r} version {version}: {e.message}") from None

    with tempfile.TemporaryDirectory(prefix="kcverify-mlflow-") as tmp:
        work = Path(tmp)
        say(f"downloading {name} version {version} ({uri})")
        try:
            with _quiet_download(progress is None):
                local = mlflow.artifacts.download_artifacts(artifact_uri=uri,
                                                            dst_path=str(work / "model"),
                                                            tracking_uri=tracking_uri)
        except MlflowException as e:
            raise MlflowGateError(f"mlflow: cannot download {name} version {version} from "
                                  f"{uri}: {e.message}") from None
        model = onnx_file(Path(local))
        if cert is None:
            cert_path = work / f"{model.name}.kcert.json"
            say(f"proving {contract} on {model.name}")
            result = api.prove(contract, model, cert=cert_path, device=device, progress=progress)
            report_path: Path | None = work / "report.json"
            from kcverify.report.writer import write_report_json

            write_report_json(result.report, report_path)
        else:
            cert_path, report_path = Path(cert), None
        say(f"checking {cert_path.name}")
        check = api.check(cert_path, model, contract)
        reasons = [f"certificate does not check: {p}" for p in check.problems]
        stmt = check.statement
        if stmt is not None and not reasons:
            levels = {c.id: c.level for c in parsed.clauses}
            reasons += policy_reasons(pol, stmt["predicate"]["clauses"], levels)
        admitted = not reasons
        digest = hashlib.sha256(cert_path.read_bytes()).hexdigest()
        pred_contract = (stmt or {}).get("predicate", {}).get("contract", {})
        tags = {
            f"{TAG}verdict": "admitted" if admitted else "rejected",
            f"{TAG}certificate_sha256": digest,
            f"{TAG}contract": str(pred_contract.get("name", parsed.name)),
            f"{TAG}contract_version": str(pred_contract.get("version", parsed.version)),
            f"{TAG}version": __version__,
            f"{TAG}reasons": "; ".join(reasons)[:MAX_TAG] if reasons else "",
        }
        out = GateResult(name, version, admitted, reasons, digest, tags[f"{TAG}contract"],
                         tags[f"{TAG}contract_version"], tags, run_id=mv.run_id or None,
                         notes=list(check.notes))
        try:
            if mv.run_id:
                for path in (cert_path, report_path):
                    if path is not None:
                        client.log_artifact(mv.run_id, str(path), artifact_path=ARTIFACT_DIR)
                        out.artifacts.append(f"{ARTIFACT_DIR}/{path.name}")
                tags[f"{TAG}certificate_artifact"] = (
                    f"runs:/{mv.run_id}/{ARTIFACT_DIR}/{cert_path.name}")
            else:
                out.notes.append("the model version has no run: the certificate is not logged "
                                 "as an artifact (its sha256 is in the tags)")
            for key, value in tags.items():
                client.set_model_version_tag(name, version, key, value)
            if alias:
                if admitted:
                    client.set_registered_model_alias(name, alias, version)
                    out.alias = alias
                elif _alias_version(client, name, alias) == version:
                    client.delete_registered_model_alias(name, alias)
                    out.notes.append(f"alias {alias!r} pointed at this rejected version: removed")
        except MlflowException as e:
            raise MlflowGateError(f"mlflow: recording the decision on {name} version {version} "
                                  f"failed: {e.message}") from None
    return out


@contextmanager
def _quiet_download(quiet: bool) -> Iterator[None]:
    """Without progress (--quiet), no MLflow download bar either."""
    key = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
    before = os.environ.get(key)
    if quiet:
        os.environ[key] = "false"
    try:
        yield
    finally:
        if quiet:
            if before is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = before


def _alias_version(client: Any, name: str, alias: str) -> str | None:
    """The version ``alias`` points at, None when it is not set."""
    from mlflow.exceptions import MlflowException

    try:
        return str(client.get_model_version_by_alias(name, alias).version)
    except MlflowException:
        return None
