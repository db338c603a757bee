"""The certificate: an in-toto Statement v1 whose predicate holds the clauses and proof trees.

    {"_type": "https://in-toto.io/Statement/v1",
     "subject": [{"name", "digest": {"sha256"}, "annotations": {"kcverify.role", "kcverify.digest"}}]
                 -- the ONNX model, each external-data file of the model ("model-data:<location>"),
                    the contract file, each slice's data file ("slice:<name>"), one per kernel
                    spec ("kernel:<name>"),
     "predicateType": "https://kcverify.dev/certificate/v1",
     "predicate": {"format": "kcverify-certificate", "format_version": 2, "tool", "libraries",
                   "contract": {"name", "version"}, "clauses": [...], "blocks": {ref: block}}}

Digests: the contract, each slice data file and each external-data file are the sha256 of their
bytes (slice and model-data subjects also carry ``kcverify.path``: the path as the contract, or
the model's external-data ``location``, writes it); a kernel spec is the sha256 of
``json.dumps(spec.canonical(), sort_keys=True)``; the model is the sha256 of its bytes
(``kcverify.digest: file-sha256``) or, for certificates embedded in the model, of its canonical
serialization without the certificate entry (``onnx-canonical-v1``, see kcverify.certs.attach).
Every float a checker re-verifies is a ``float.hex`` string; arrays are base64 float64.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from kcverify.certs.encoding import fx, unfx
from kcverify.certs.records import decode_block, encode_block, encode_state
from kcverify.certs.rules import RuleContext, get_rule
from kcverify.errors import CertificateError, InputFileError
from kcverify.fileio import atomic_write

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://kcverify.dev/certificate/v1"
FORMAT = "kcverify-certificate"
FORMAT_VERSION = 2  # 2: slice data and external weights are subjects (1 did not bind them)
VERDICTS = ("proved", "refuted", "unknown", "passed", "failed")
HOLDING_VERDICTS = ("proved", "passed")  # a hard clause must have one of these to be admitted
DIGEST_FILE = "file-sha256"
DIGEST_ONNX_CANONICAL = "onnx-canonical-v1"
DIGEST_CANONICAL_JSON = "canonical-json"
ROLES = ("model", "model-data", "contract", "slice", "kernel")
PATH_KEY = "kcverify.path"  # slice and model-data subjects: the path as the contract/model writes it
LIBRARIES = ("torch", "onnx", "onnxruntime", "numpy", "z3-solver", "ml_dtypes", "lark")
_SHA = re.compile(r"^[0-9a-f]{64}$")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except OSError as e:
        raise InputFileError(f"{path}: cannot read ({e.strerror or e})") from None
    return h.hexdigest()


def kernel_spec_digest(spec: Any) -> str:
    """sha256 of json.dumps(spec.canonical(), sort_keys=True); a mapping is taken as canonical."""
    canon = spec.canonical() if hasattr(spec, "canonical") else spec
    return sha256_bytes(json.dumps(canon, sort_keys=True).encode("utf-8"))


def library_versions() -> dict[str, str]:
    out = {}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def tool_version() -> str:
    from kcverify import __version__

    return __version__


def subject(name: str, digest: str, role: str, method: str, path: str | None = None
            ) -> dict[str, Any]:
    ann = {"kcverify.role": role, "kcverify.digest": method}
    if path is not None:
        ann[PATH_KEY] = path
    return {"name": name, "digest": {"sha256": digest}, "annotations": ann}


def subjects_of(statement: Mapping[str, Any], role: str) -> list[dict[str, Any]]:
    """The statement's subjects with ``kcverify.role`` == role, in order."""
    return [s for s in statement["subject"] if s["annotations"]["kcverify.role"] == role]


def slice_path(spec: Any) -> str:
    """The data file of a slice as the contract writes it: a DSL Slice's ``inputs``, or a path."""
    return str(getattr(spec, "inputs", spec) or "")


def data_slices(slices: Mapping[str, Any]) -> dict[str, str]:
    """The slices that have a data file (name -> its path as written). A slice given only by a
    trace file (``traces``, read by monitor/promote, never by prove) has none: no claim of a
    certificate rests on it, and a growing log is not digested."""
    return {name: path for name in sorted(slices) if (path := slice_path(slices[name]))}


def slice_subjects(contract_path: str | os.PathLike[str], slices: Mapping[str, Any]
                   ) -> list[dict[str, Any]]:
    """One ``slice:<name>`` subject per slice with a data file: the sha256 of the file, resolved
    against the contract's directory (InputFileError when it cannot be read)."""
    base = Path(contract_path).parent
    out = []
    for name, written in data_slices(slices).items():
        p = Path(written)
        path = p if p.is_absolute() else base / p
        try:
            digest = sha256_file(path)
        except InputFileError:
            raise InputFileError(f"{path}: slice {name!r}: cannot read its data file (the "
                                 "certificate digests every slice of the contract)") from None
        out.append(subject(f"slice:{name}", digest, "slice", DIGEST_FILE, written))
    return out


def model_data_subjects(model_path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """One ``model-data:<location>`` subject per external-data file the ONNX model names (its
    weights stored outside the .onnx file), with the sha256 of the file's bytes."""
    from kcverify.certs.attach import external_data_files

    base = Path(model_path).parent
    return [subject(f"model-data:{loc}", sha256_file(base / loc), "model-data", DIGEST_FILE, loc)
            for loc in external_data_files(model_path)]


# ---- reading and writing --------------------------------------------------------------------

def dumps(statement: Mapping[str, Any]) -> str:
    return json.dumps(statement, sort_keys=True, indent=1, allow_nan=False) + "\n"


def write_certificate(path: str | os.PathLike[str], statement: Mapping[str, Any]) -> Path:
    """Validate, then write atomically: a temp file in the same directory, fsync, os.replace."""
    validate_statement(statement)
    text = dumps(statement)
    path = Path(path)
    atomic_write(path, text.encode("utf-8"))
    return path


def loads_certificate(text: str | bytes, where: str = "certificate") -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CertificateError(f"{where}: not JSON ({e})") from None
    validate_statement(obj, where)
    return obj


def read_certificate(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and validate a certificate file; CertificateError names what is wrong."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise InputFileError(f"{path}: cannot read certificate ({e.strerror or e})") from None
    return loads_certificate(data, str(path))


def _req(obj: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(obj, Mapping) or key not in obj:
        raise CertificateError(f"{where}: missing {key!r}")
    v = obj[key]
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise CertificateError(f"{where}.{key}: expected {names}, got {type(v).__name__}")
    return v


def validate_statement(obj: Any, where: str = "certificate") -> None:
    """Structural validation of a certificate (not its soundness: that is the checker's)."""
    if not isinstance(obj, Mapping):
        raise CertificateError(f"{where}: expected a JSON object")
    if obj.get("_type") != STATEMENT_TYPE:
        raise CertificateError(f"{where}: _type must be {STATEMENT_TYPE!r}")
    if obj.get("predicateType") != PREDICATE_TYPE:
        raise CertificateError(f"{where}: predicateType must be {PREDICATE_TYPE!r}")
    subjects = _req(obj, "subject", list, where)
    roles: dict[str, int] = {}
    names: set[str] = set()
    for i, s in enumerate(subjects):
        w = f"{where}: subject[{i}]"
        _req(s, "name", str, w)
        digest = _req(s, "digest", dict, w)
        if not _SHA.match(str(digest.get("sha256", ""))):
            raise CertificateError(f"{w}.digest.sha256: expected 64 lowercase hex digits")
        ann = _req(s, "annotations", dict, w)
        role = ann.get("kcverify.role")
        if role not in ROLES:
            raise CertificateError(f"{w}: kcverify.role must be one of {', '.join(ROLES)}")
        if role in ("slice", "model-data") and not isinstance(ann.get(PATH_KEY), str):
            raise CertificateError(f"{w}: a {role} subject needs its path ({PATH_KEY})")
        if role in ("slice", "model-data", "kernel"):
            if s["name"] in names:
                raise CertificateError(f"{w}: subject {s['name']!r} listed twice")
            names.add(s["name"])
        roles[role] = roles.get(role, 0) + 1
    if roles.get("model") != 1 or roles.get("contract") != 1:
        raise CertificateError(f"{where}: subject must list exactly one model and one contract")
    pred = _req(obj, "predicate", dict, where)
    w = f"{where}: predicate"
    if pred.get("format") != FORMAT:
        raise CertificateError(f"{w}.format must be {FORMAT!r}")
    if pred.get("format_version") != FORMAT_VERSION:
        old = (" — version 1 did not bind the slice data or external weights; prove again"
               if pred.get("format_version") == 1 else "")
        raise CertificateError(f"{w}.format_version {pred.get('format_version')!r} is not supported "
                               f"(this kcverify reads {FORMAT_VERSION}){old}")
    tool = _req(pred, "tool", dict, w)
    _req(tool, "name", str, f"{w}.tool")
    _req(tool, "version", str, f"{w}.tool")
    _req(pred, "libraries", dict, w)
    contract = _req(pred, "contract", dict, w)
    _req(contract, "name", str, f"{w}.contract")
    _req(contract, "version", str, f"{w}.contract")
    blocks = _req(pred, "blocks", dict, w)
    for ref, blk in blocks.items():
        decode_block(ref, blk)
    seen: set[str] = set()
    for i, c in enumerate(_req(pred, "clauses", list, w)):
        cw = f"{w}.clauses[{i}]"
        cid = _req(c, "id", str, cw)
        if cid in seen:
            raise CertificateError(f"{cw}: duplicate clause id {cid!r}")
        seen.add(cid)
        cw = f"{w}.clauses[{cid!r}]"
        for key in ("family", "klass", "method"):
            _req(c, key, str, cw)
        _req(c, "hard", bool, cw)
        if c.get("verdict") not in VERDICTS:
            raise CertificateError(f"{cw}.verdict: {c.get('verdict')!r} is not one of "
                                   f"{', '.join(VERDICTS)}")
        for key in ("bound", "threshold"):
            if c.get(key) is not None:
                unfx(c[key], f"{cw}.{key}")
        if c.get("op") not in (None, "<=", "<", ">=", ">"):
            raise CertificateError(f"{cw}.op: expected <=, <, >= or >")
        _req(c, "evidence", dict, cw)
        if c.get("proof") is not None:
            _validate_node(c["proof"], f"{cw}.proof")


def _validate_node(node: Any, where: str) -> None:
    if not isinstance(node, Mapping):
        raise CertificateError(f"{where}: a proof node must be an object")
    _req(node, "rule", str, where)
    _req(node, "conclusion", dict, where)
    _req(node, "params", dict, where)
    for i, p in enumerate(_req(node, "premises", list, where)):
        _validate_node(p, f"{where}.premises[{i}]")


# ---- building -------------------------------------------------------------------------------

class CertificateBuilder:
    """Assemble a certificate from block records, rule applications and clause verdicts.

    ``kernel_specs`` maps names ("train", "inf") to KernelSpec (or canonical mappings);
    ``contract_meta`` gives the contract's {"name", "version"}; ``slices`` maps every slice of
    the contract to its DSL Slice (or its data path as written in the contract): each data file
    is digested, as is each external-data file of the model. ``store_input`` maps raw model
    inputs to the values the kernels store (default: the bound engine's; None: unchanged). Nodes are built with ``block``,
    ``sequential`` and ``apply`` (which runs the rule, so a node's conclusion is what the rule
    justifies); clauses with ``add_clause``; ``build()`` returns the statement.
    """

    def __init__(self, model_path: str | os.PathLike[str], contract_path: str | os.PathLike[str],
                 kernel_specs: Mapping[str, Any], contract_meta: Mapping[str, Any], *,
                 slices: Mapping[str, Any] | None = None,
                 model_digest: str = DIGEST_FILE, store_input: Any = "default") -> None:
        self.model_path = Path(model_path)
        self.contract_path = Path(contract_path)
        if model_digest == DIGEST_FILE:
            mdig = sha256_file(self.model_path)
        elif model_digest == DIGEST_ONNX_CANONICAL:
            from kcverify.certs.attach import canonical_model_digest

            mdig = canonical_model_digest(self.model_path)
        else:
            raise CertificateError(f"unknown model digest method {model_digest!r}")
        self.subjects = [subject(self.model_path.name, mdig, "model", model_digest),
                         *model_data_subjects(self.model_path),
                         subject(self.contract_path.name, sha256_file(self.contract_path),
                                 "contract", DIGEST_FILE),
                         *slice_subjects(self.contract_path, slices or {})]
        for name in sorted(kernel_specs):
            self.subjects.append(subject(f"kernel:{name}", kernel_spec_digest(kernel_specs[name]),
                                         "kernel", DIGEST_CANONICAL_JSON))
        self.contract = {"name": str(contract_meta.get("name", "")),
                         "version": str(contract_meta.get("version", ""))}
        self.blocks: dict[str, dict[str, Any]] = {}
        self.ctx = RuleContext()
        if store_input == "default":
            from kcverify.certs.recheck import default_store_input

            store_input = default_store_input(self.model_path, kernel_specs)
        self.ctx.store_input = store_input
        self.clauses: list[dict[str, Any]] = []
        self.extra: dict[str, Any] = {}

    def add_block(self, record: Any, ref: str | None = None) -> str:
        """Store a bound-engine BlockRecord; returns its ref (default "<index>:<name>")."""
        enc = encode_block(record)
        ref = ref or f"{len(self.blocks)}:{enc['name']}"
        if ref in self.blocks:
            raise CertificateError(f"block ref {ref!r} used twice")
        self.blocks[ref] = enc
        self.ctx.blocks[ref] = decode_block(ref, enc)
        return ref

    def block(self, ref: str) -> dict[str, Any]:
        """The leaf node for a stored block certificate."""
        return self.apply("block", [], ref=ref)

    def sequential(self, refs: Sequence[str], inputs: Mapping[str, Any],
                   outputs: Sequence[str], slice: str | None = None) -> dict[str, Any]:
        """Chain the blocks ``refs`` (in order) from the model-input region ``inputs`` (boxes) of
        the contract slice ``slice`` (named so the checker can match proofs to clauses)."""
        params: dict[str, Any] = {"inputs": encode_state(inputs), "outputs": list(outputs)}
        if slice is not None:
            params["slice"] = slice
        return self.apply("sequential", [self.block(r) for r in refs], **params)

    def apply(self, rule: str, premises: Sequence[dict[str, Any]], **params: Any) -> dict[str, Any]:
        """A proof node: ``rule`` applied to ``premises`` (nodes); float params are stored as hex.

        Raises RuleError when the application is outside the rule's preconditions.
        """
        enc = {k: fx(v) if isinstance(v, float) else v for k, v in params.items()}
        concl = get_rule(rule).conclude([p["conclusion"] for p in premises], dict(enc), self.ctx)
        return {"rule": rule, "premises": list(premises), "conclusion": concl, "params": enc}

    def add_clause(self, id: str, family: str, verdict: str, *, klass: str = "certifiable",
                   hard: bool = True, bound: float | None = None, threshold: float | None = None,
                   op: str | None = None, quantity: str | None = None, method: str = "",
                   evidence: Mapping[str, Any] | None = None, proof: dict[str, Any] | None = None,
                   **extra: Any) -> dict[str, Any]:
        """Record one clause's verdict. A proved clause's ``bound`` defaults to its proof's bound."""
        if verdict not in VERDICTS:
            raise CertificateError(f"clause {id!r}: verdict {verdict!r} is not one of "
                                   f"{', '.join(VERDICTS)}")
        if proof is not None and bound is None and "bound" in proof.get("conclusion", {}):
            bound = unfx(proof["conclusion"]["bound"][0])
        if proof is not None and op is None:
            op = proof.get("conclusion", {}).get("op")
        if proof is not None and quantity is None:
            quantity = proof.get("conclusion", {}).get("quantity")
        clause = {"id": str(id), "family": str(family), "klass": str(klass), "hard": bool(hard),
                  "verdict": verdict, "bound": None if bound is None else fx(bound),
                  "threshold": None if threshold is None else fx(threshold), "op": op,
                  "quantity": quantity, "method": str(method),
                  "evidence": _jsonable(dict(evidence or {})), "proof": proof, **extra}
        self.clauses.append(clause)
        return clause

    def build(self) -> dict[str, Any]:
        stmt = {
            "_type": STATEMENT_TYPE,
            "subject": list(self.subjects),
            "predicateType": PREDICATE_TYPE,
            "predicate": {
                "format": FORMAT, "format_version": FORMAT_VERSION,
                "tool": {"name": "kcverify", "version": tool_version()},
                "libraries": library_versions(),
                "contract": dict(self.contract),
                "clauses": list(self.clauses),
                "blocks": dict(self.blocks),
                **self.extra,
            },
        }
        validate_statement(stmt)
        return stmt


def _jsonable(obj: Any) -> Any:
    """Evidence as JSON: floats as hex strings where exact, numpy scalars and arrays unwrapped."""
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if hasattr(obj, "tolist"):
        return _jsonable(obj.tolist())
    if isinstance(obj, float):
        return fx(obj)
    return obj
