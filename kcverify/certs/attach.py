"""Attaching a certificate to its model: a sidecar ``MODEL.kcert.json`` (the default), or embedded
in the ONNX model's ``metadata_props`` under the key ``kcverify.certificate``.

Embedding changes the model file's bytes, so an embedded certificate cannot digest them. Its model
subject uses the digest method ``onnx-canonical-v1``: the sha256 of
``model.SerializeToString(deterministic=True)`` after removing every ``kcverify.certificate``
metadata entry. That digest is the same before and after embedding, and changes with any weight,
node, attribute or other metadata. ``embed`` first checks that the certificate matches the model
(by its stated method), then rewrites its model subject to the canonical digest.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

from kcverify.certs.statement import (
    DIGEST_FILE,
    DIGEST_ONNX_CANONICAL,
    dumps,
    loads_certificate,
    read_certificate,
    sha256_bytes,
    sha256_file,
    validate_statement,
    write_certificate,
)
from kcverify.errors import CertificateError, InputFileError, ModelImportError
from kcverify.fileio import atomic_write

METADATA_KEY = "kcverify.certificate"
SIDECAR_SUFFIX = ".kcert.json"


def sidecar_path(model_path: str | os.PathLike[str]) -> Path:
    """model.onnx -> model.onnx.kcert.json"""
    p = Path(model_path)
    return p.with_name(p.name + SIDECAR_SUFFIX)


def _load(model_path: str | os.PathLike[str]) -> Any:
    import onnx

    try:
        return onnx.load(str(model_path), load_external_data=False)
    except FileNotFoundError:
        raise InputFileError(f"{model_path}: no such model file") from None
    except Exception as e:  # onnx raises DecodeError and others
        raise ModelImportError(f"{model_path}: not an ONNX model ({e})") from None


def _strip(model: Any) -> Any:
    m = copy.deepcopy(model)
    keep = [p for p in m.metadata_props if p.key != METADATA_KEY]
    del m.metadata_props[:]
    for p in keep:
        m.metadata_props.add(key=p.key, value=p.value)
    return m


def canonical_model_digest(model_path: str | os.PathLike[str]) -> str:
    """sha256 of the model's deterministic serialization without the certificate entry."""
    return sha256_bytes(_strip(_load(model_path)).SerializeToString(deterministic=True))


def _graph_tensors(graph: Any) -> Any:
    """Every TensorProto of a graph and its subgraphs: initializers (dense and sparse) and the
    tensors held in node attributes."""
    yield from graph.initializer
    for sp in graph.sparse_initializer:
        yield from (sp.values, sp.indices)
    for node in graph.node:
        yield from _attribute_tensors(node.attribute)


def _attribute_tensors(attributes: Any) -> Any:
    for a in attributes:
        if a.HasField("t"):
            yield a.t
        yield from a.tensors
        if a.HasField("sparse_tensor"):
            yield from (a.sparse_tensor.values, a.sparse_tensor.indices)
        for sp in a.sparse_tensors:
            yield from (sp.values, sp.indices)
        if a.HasField("g"):
            yield from _graph_tensors(a.g)
        for g in a.graphs:
            yield from _graph_tensors(g)


def external_data_files(model_path: str | os.PathLike[str]) -> list[str]:
    """The external-data files the model's tensors name (their ``location``, relative to the
    model's directory), sorted and each once. A location that is absolute or leaves the model's
    directory is refused (ModelImportError), as onnx itself refuses to load it."""
    import posixpath

    from onnx import TensorProto

    model = _load(model_path)
    tensors = [*_graph_tensors(model.graph)]
    for fn in model.functions:
        for node in fn.node:
            tensors += _attribute_tensors(node.attribute)
    out: set[str] = set()
    for t in tensors:
        if t.data_location != TensorProto.EXTERNAL:
            continue
        loc = next((e.value for e in t.external_data if e.key == "location"), None)
        norm = posixpath.normpath(loc.replace("\\", "/")) if loc else ""
        if not loc or norm.startswith(("/", "../")) or norm in ("..", ".") or ":" in norm:
            raise ModelImportError(f"{model_path}: tensor {t.name!r} names external data "
                                   f"{loc!r}; expected a plain relative path inside the model's "
                                   "directory")
        out.add(loc)
    return sorted(out)


def model_digest(model_path: str | os.PathLike[str], method: str) -> str:
    if method == DIGEST_FILE:
        return sha256_file(model_path)
    if method == DIGEST_ONNX_CANONICAL:
        return canonical_model_digest(model_path)
    raise CertificateError(f"unknown model digest method {method!r}")


def model_subject(statement: dict[str, Any]) -> dict[str, Any]:
    for s in statement["subject"]:
        if s["annotations"]["kcverify.role"] == "model":
            return s
    raise CertificateError("certificate has no model subject")  # pragma: no cover - validated


def attach(model_path: str | os.PathLike[str], statement: dict[str, Any]) -> Path:
    """Write the sidecar certificate next to the model."""
    return write_certificate(sidecar_path(model_path), statement)


def embed(model_path: str | os.PathLike[str], statement: dict[str, Any],
          out_path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Embed the certificate in the model's metadata (in place, or into ``out_path``), atomically.

    Returns the embedded statement (its model subject now uses ``onnx-canonical-v1``).
    """
    validate_statement(statement)
    subj = model_subject(statement)
    method = subj["annotations"]["kcverify.digest"]
    if model_digest(model_path, method) != subj["digest"]["sha256"]:
        raise CertificateError(f"{model_path}: the certificate's model digest does not match this "
                               "model; refusing to embed")
    stmt = copy.deepcopy(statement)
    msub = model_subject(stmt)
    msub["digest"]["sha256"] = canonical_model_digest(model_path)
    msub["annotations"]["kcverify.digest"] = DIGEST_ONNX_CANONICAL
    model = _strip(_load(model_path))
    model.metadata_props.add(key=METADATA_KEY, value=dumps(stmt))
    atomic_write(Path(out_path or model_path), model.SerializeToString(deterministic=True))
    return stmt


def embedded_certificate(model_path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The certificate embedded in the model's metadata, or None."""
    for p in _load(model_path).metadata_props:
        if p.key == METADATA_KEY:
            return loads_certificate(p.value, f"{model_path} (embedded certificate)")
    return None


def find_certificate(model_path: str | os.PathLike[str]) -> tuple[dict[str, Any], str]:
    """The model's certificate and where it came from: the sidecar first, else the embedded one."""
    side = sidecar_path(model_path)
    if side.exists():
        return read_certificate(side), str(side)
    if not Path(model_path).exists():
        raise InputFileError(f"{model_path}: no such model file")
    emb = embedded_certificate(model_path)
    if emb is None:
        raise CertificateError(f"{model_path}: no certificate (no {side.name} and no "
                               f"{METADATA_KEY!r} metadata entry)")
    return emb, f"{model_path}#metadata:{METADATA_KEY}"


def load_certificate(cert: str | os.PathLike[str] | dict[str, Any],
                     model_path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """A certificate given as a statement, a JSON file, or an ONNX file holding one embedded."""
    if isinstance(cert, dict):
        validate_statement(cert)
        return cert
    p = Path(cert)
    if not p.exists():
        raise InputFileError(f"{p}: no such certificate file")
    if p.suffix == ".onnx" or (model_path is not None and p.resolve() == Path(model_path).resolve()):
        emb = embedded_certificate(p)
        if emb is None:
            raise CertificateError(f"{p}: holds no embedded certificate ({METADATA_KEY!r})")
        return emb
    return read_certificate(p)


__all__ = ["METADATA_KEY", "attach", "canonical_model_digest", "embed", "embedded_certificate",
           "external_data_files", "find_certificate", "load_certificate", "model_digest", "sidecar_path"]
