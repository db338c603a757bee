"""The registry: an admission gate in front of an embedded SQLite store with content-addressed blobs.

Layout of a registry directory (default ``~/.kcverify/registry``; ``--registry DIR`` or the
environment variable ``KCVERIFY_REGISTRY`` override it):

    registry.sqlite3       entries, their files, blobs, decisions (WAL journal; every change one
                           transaction)
    blobs/ab/abcdef…       each stored file named by its sha256 (model, its external-data files,
                           contract, slice data files, kernel specs, certificate), written
                           atomically, stored once however often admitted

Admission of (model, contract, certificate) under a policy: the checker (kcverify.certs.checker)
must pass, every *hard* clause must be ``proved`` or ``passed``, and every hard numerical clause
whose level the policy marks ``proved`` must be proved, not decided on evidence (the default
policy: L2 and L3 proved, L0 and L1 evidence acceptable). A rejected admission writes no blob and
no entry; like every decision (admit, reject, revoke), it is recorded in the ``decisions`` log
with its reason and the policy applied.

An admitted entry stores every file its proof depends on, with its place in the layout the
contract refers to (``entry_files``: paths relative to the common directory of the files at
admission, e.g. ``contracts/c.yaml``, ``data/eval.npz`` for a contract naming
``../data/eval.npz``). ``verify`` rebuilds that layout from the blobs in a temporary directory and
re-runs the checker and the recorded policy on it.

Concurrency: blobs are written and rows inserted while holding SQLite's write lock
(``BEGIN IMMEDIATE``), so concurrent admits serialise their writes; a failed transaction removes
the blobs it created. Readers never block (WAL).
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import shutil
import sqlite3
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kcverify.certs.statement import HOLDING_VERDICTS, PATH_KEY, dumps, sha256_bytes, subjects_of
from kcverify.errors import InputFileError, InternalError, RegistryError
from kcverify.fileio import atomic_write

ENV = "KCVERIFY_REGISTRY"
DB_NAME = "registry.sqlite3"
SCHEMA_VERSION = 2

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS blobs (
  sha256 TEXT PRIMARY KEY, size INTEGER NOT NULL, kind TEXT NOT NULL, created_at TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS entries (
  id INTEGER PRIMARY KEY AUTOINCREMENT,
  status TEXT NOT NULL CHECK (status IN ('admitted', 'revoked')),
  admitted_at TEXT NOT NULL,
  model_name TEXT NOT NULL, model_sha256 TEXT NOT NULL REFERENCES blobs(sha256),
  contract_name TEXT NOT NULL, contract_sha256 TEXT NOT NULL REFERENCES blobs(sha256),
  kernels_sha256 TEXT NOT NULL REFERENCES blobs(sha256),
  certificate_sha256 TEXT NOT NULL REFERENCES blobs(sha256),
  contract_id TEXT NOT NULL, contract_version TEXT NOT NULL,
  kernel_digests TEXT NOT NULL, clauses TEXT NOT NULL,
  revoked_at TEXT, revoke_reason TEXT, policy TEXT);
CREATE UNIQUE INDEX IF NOT EXISTS one_admitted_per_tuple
  ON entries (model_sha256, contract_sha256, certificate_sha256) WHERE status = 'admitted';
CREATE TABLE IF NOT EXISTS entry_files (
  entry_id INTEGER NOT NULL REFERENCES entries(id),
  role TEXT NOT NULL CHECK (role IN ('model', 'model-data', 'contract', 'slice')),
  name TEXT NOT NULL, path TEXT NOT NULL, sha256 TEXT NOT NULL REFERENCES blobs(sha256),
  PRIMARY KEY (entry_id, path));
CREATE TABLE IF NOT EXISTS decisions (
  id INTEGER PRIMARY KEY AUTOINCREMENT, at TEXT NOT NULL,
  action TEXT NOT NULL CHECK (action IN ('admit', 'reject', 'revoke')),
  entry_id INTEGER REFERENCES entries(id),
  model_sha256 TEXT, contract_sha256 TEXT, certificate_sha256 TEXT, reason TEXT NOT NULL,
  policy TEXT);
CREATE TABLE IF NOT EXISTS promotions (
  id INTEGER PRIMARY KEY AUTOINCREMENT, at TEXT NOT NULL, stage TEXT NOT NULL,
  decision TEXT NOT NULL, model_sha256 TEXT, contract_sha256 TEXT, record TEXT NOT NULL);
"""
# schema 1 -> 2: the policy of each admission, and the files each entry's proof depends on
MIGRATE_1_2 = """
ALTER TABLE entries ADD COLUMN policy TEXT;
ALTER TABLE decisions ADD COLUMN policy TEXT;
"""

# ---- admission policy -----------------------------------------------------------------------

LEVELS = ("L0", "L1", "L2", "L3")
REQUIREMENTS = ("proved", "evidence")
DEFAULT_POLICY = {"L0": "evidence", "L1": "evidence", "L2": "proved", "L3": "proved"}


def parse_policy(requires: Sequence[str] | Mapping[str, str] | None) -> dict[str, str]:
    """The default policy with ``LEVEL=proved|evidence`` overrides (``--require``)."""
    policy = dict(DEFAULT_POLICY)
    items = (list(requires.items()) if isinstance(requires, Mapping)
             else [tuple(r.split("=", 1)) if "=" in r else (r, "") for r in requires or ()])
    for level, req in items:
        level, req = str(level).strip().upper(), str(req).strip().lower()
        if level not in LEVELS or req not in REQUIREMENTS:
            raise RegistryError(f"--require {level}={req}: expected LEVEL=proved or "
                                f"LEVEL=evidence with LEVEL one of {', '.join(LEVELS)}")
        policy[level] = req
    return policy


def policy_text(policy: Mapping[str, str]) -> str:
    """``L0=evidence L1=evidence L2=proved L3=proved``: how the log and entries record it."""
    return " ".join(f"{lv}={policy[lv]}" for lv in LEVELS if lv in policy)


def policy_reasons(policy: Mapping[str, str], clauses: Sequence[Mapping[str, Any]],
                   levels: Mapping[str, str]) -> list[str]:
    """Why the certificate's clauses do not meet the policy (empty: they do).

    Every hard clause must be proved or passed. A hard *numerical* clause (family numerical, or a
    certifiable condition) at a level the policy marks ``proved`` must be proved: passed on
    evidence is not enough. Other hard clauses (statistical, runtime, static) can only be
    decided on evidence and need ``passed``. Soft clauses (with a budget) never block.
    """
    reasons = []
    for c in clauses:
        if not c["hard"]:
            continue
        if c["verdict"] not in HOLDING_VERDICTS:
            reasons.append(f"hard clause {c['id']} is {c['verdict']} (admission needs "
                           f"{' or '.join(HOLDING_VERDICTS)})")
            continue
        level = levels.get(c["id"])
        numerical = c.get("family") == "numerical" or c.get("klass") == "certifiable"
        if level is None:
            reasons.append(f"hard clause {c['id']}: the contract gives it no level")
        elif numerical and policy.get(level) == "proved" and c["verdict"] != "proved":
            reasons.append(f"hard clause {c['id']} ({level}) is decided on evidence "
                           f"({c['verdict']}); the policy requires {level}=proved")
    return reasons


# ---- the store ------------------------------------------------------------------------------

def default_root(explicit: str | os.PathLike[str] | None = None) -> Path:
    """``explicit``, else $KCVERIFY_REGISTRY, else ~/.kcverify/registry."""
    if explicit:
        return Path(explicit).expanduser()
    env = os.environ.get(ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".kcverify" / "registry"


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def _wal(db: sqlite3.Connection, wait_s: float = 60.0) -> None:
    """Switch to WAL (persistent in the file, so only the first opener changes it). Changing
    the journal mode needs an exclusive lock for which SQLite does not call the busy handler,
    so concurrent openers of a new registry retry here."""
    deadline = time.monotonic() + wait_s
    delay = 0.01
    while True:
        try:
            if str(db.execute("PRAGMA journal_mode").fetchone()[0]).lower() != "wal":
                db.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as e:
            if ("locked" not in str(e) and "busy" not in str(e)) or time.monotonic() > deadline:
                raise
            time.sleep(delay)
            delay = min(0.2, delay * 2)


@dataclass
class Decision:
    """The outcome of an admission: ``admitted`` with the entry id, or the reasons it was not."""

    admitted: bool
    entry_id: int | None
    reasons: list[str]
    notes: list[str] = field(default_factory=list)
    duplicate: bool = False
    policy: dict[str, str] = field(default_factory=dict)


@dataclass
class VerifyResult:
    entry_id: int
    ok: bool
    problems: list[str]


@dataclass(frozen=True)
class StoredFile:
    """One file an entry's proof depends on: its role, subject name, place in the layout
    (relative posix path), sha256 and bytes."""

    role: str
    name: str
    path: str
    sha256: str
    data: bytes = field(repr=False, default=b"")


CheckFn = Callable[..., Any]  # check_certificate(cert, model, contract) -> CheckReport


def _placed(p: Path) -> Path:
    """Where a file really is: its directory resolved (symlinks, ..), its own name kept (a
    symlinked contract still resolves its relative paths from the link's directory)."""
    return p.parent.resolve() / p.name


def _safe_relative(path: str) -> bool:
    norm = posixpath.normpath(path)
    return (bool(path) and path == norm and not norm.startswith(("/", "../"))
            and norm not in (".", ".."))


class Registry:
    """A registry directory. ``check`` is the checker (default kcverify.certs.checker's, with the
    real bound engine's re-check hook); tests pass one with fake hooks."""

    def __init__(self, root: str | os.PathLike[str] | None = None, *,
                 check: CheckFn | None = None,
                 kernel_specs: Callable[[Path], Mapping[str, Any]] | None = None) -> None:
        self.root = default_root(root).absolute()  # blobs stay reachable whatever the cwd
        self.blob_dir = self.root / "blobs"
        self._check = check
        self._kernel_specs = kernel_specs
        try:
            self.blob_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RegistryError(f"{self.root}: cannot create the registry ({e.strerror or e})") from None
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, "
                           "value TEXT NOT NULL)")
                row = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
                if row is not None and int(row[0]) == 1:
                    for stmt in MIGRATE_1_2.strip().splitlines():
                        db.execute(stmt)
                    db.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'",
                               (str(SCHEMA_VERSION),))
                elif row is not None and int(row[0]) != SCHEMA_VERSION:
                    raise RegistryError(f"{self.root}: registry schema {row[0]} is not supported "
                                        f"(this kcverify uses {SCHEMA_VERSION})")
                for stmt in SCHEMA.split(";"):
                    if stmt.strip():
                        db.execute(stmt)
                db.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)",
                           (str(SCHEMA_VERSION),))
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    # ---- plumbing ---------------------------------------------------------------------------

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        try:
            db = sqlite3.connect(self.root / DB_NAME, timeout=60, isolation_level=None)
        except sqlite3.Error as e:
            raise RegistryError(f"{self.root / DB_NAME}: cannot open the registry ({e})") from None
        try:
            db.row_factory = sqlite3.Row
            db.execute("PRAGMA busy_timeout = 60000")
            _wal(db)
            db.execute("PRAGMA foreign_keys = ON")
            db.execute("PRAGMA synchronous = FULL")
            yield db
        finally:
            db.close()

    @contextmanager
    def _transaction(self, db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def blob_path(self, sha: str) -> Path:
        return self.blob_dir / sha[:2] / sha

    def _put_blob(self, db: sqlite3.Connection, data: bytes, kind: str, created: list[Path]) -> str:
        """Store ``data`` under its sha256 (inside the caller's write transaction)."""
        sha = sha256_bytes(data)
        path = self.blob_path(sha)
        if not (path.exists() and path.stat().st_size == len(data)):
            atomic_write(path, data)
            created.append(path)
        db.execute("INSERT OR IGNORE INTO blobs VALUES (?, ?, ?, ?)", (sha, len(data), kind, _now()))
        return sha

    def _log(self, db: sqlite3.Connection, action: str, reason: str, entry_id: int | None = None,
             shas: tuple[str | None, str | None, str | None] = (None, None, None),
             policy: str | None = None) -> None:
        db.execute("INSERT INTO decisions (at, action, entry_id, model_sha256, contract_sha256, "
                   "certificate_sha256, reason, policy) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                   (_now(), action, entry_id, *shas, reason, policy))

    def _checker(self) -> CheckFn:
        if self._check is not None:
            return self._check
        from kcverify.certs.checker import check_certificate

        return check_certificate

    @staticmethod
    def _contract(contract: Path) -> Any:
        try:
            from kcverify.dsl import load_contract
        except ImportError as e:
            raise InternalError(f"the registry cannot load kcverify.dsl: {e}") from e
        return load_contract(contract)

    # ---- admission --------------------------------------------------------------------------

    def admit(self, model: str | os.PathLike[str], contract: str | os.PathLike[str],
              cert: str | os.PathLike[str] | dict[str, Any],
              policy: Mapping[str, str] | Sequence[str] | None = None) -> Decision:
        """Admit (model, kernel specs, contract, certificate) if it checks and its clauses meet
        the policy (``parse_policy``: the default, or LEVEL=proved|evidence overrides); either
        way the decision is logged with the policy. Bad input (a missing file) raises."""
        model, contract = Path(model), Path(contract)
        for p, what in ((model, "model"), (contract, "contract")):
            if not p.is_file():
                raise InputFileError(f"{p}: no such {what} file")
        pol = parse_policy(policy)
        ptext = policy_text(pol)
        report = self._checker()(cert, model, contract)
        stmt = report.statement
        model_bytes, contract_bytes = model.read_bytes(), contract.read_bytes()
        cert_bytes = dumps(stmt).encode("utf-8") if stmt is not None else b""
        shas = (sha256_bytes(model_bytes), sha256_bytes(contract_bytes),
                sha256_bytes(cert_bytes) if stmt is not None else None)
        reasons = [f"certificate does not check: {p}" for p in report.problems]
        files: list[StoredFile] = []
        if stmt is not None and not reasons:
            parsed = self._contract(contract)
            levels = {c.id: c.level for c in parsed.clauses}
            reasons += policy_reasons(pol, stmt["predicate"]["clauses"], levels)
            files, why = self._files(model, model_bytes, contract, contract_bytes, stmt)
            reasons += why
        if reasons:
            with self._connect() as db, self._transaction(db):
                self._log(db, "reject", "; ".join(reasons), None, shas, ptext)
            return Decision(False, None, reasons, list(report.notes), policy=pol)
        assert stmt is not None
        kernels = {s["name"].removeprefix("kernel:"): s["digest"]["sha256"]
                   for s in subjects_of(stmt, "kernel")}
        clauses = [{"id": c["id"], "hard": c["hard"], "verdict": c["verdict"]}
                   for c in stmt["predicate"]["clauses"]]
        kernel_blob = json.dumps(self._kernel_specs_json(contract, kernels), sort_keys=True).encode()
        created: list[Path] = []
        try:
            with self._connect() as db, self._transaction(db):
                row = db.execute("SELECT id FROM entries WHERE status = 'admitted' AND "
                                 "model_sha256 = ? AND contract_sha256 = ? AND "
                                 "certificate_sha256 = ?", shas).fetchone()
                if row is not None:
                    self._log(db, "admit", f"already admitted as entry {row['id']}", row["id"],
                              shas, ptext)
                    return Decision(True, int(row["id"]), [], list(report.notes), duplicate=True,
                                    policy=pol)
                stored = {f.path: self._put_blob(db, f.data, f.role, created) for f in files}
                m, c = shas[0], shas[1]
                k = self._put_blob(db, kernel_blob, "kernel-specs", created)
                x = self._put_blob(db, cert_bytes, "certificate", created)
                pred = stmt["predicate"]
                cur = db.execute(
                    "INSERT INTO entries (status, admitted_at, model_name, model_sha256, "
                    "contract_name, contract_sha256, kernels_sha256, certificate_sha256, "
                    "contract_id, contract_version, kernel_digests, clauses, policy) "
                    "VALUES ('admitted', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (_now(), model.name, m, contract.name, c, k, x, pred["contract"]["name"],
                     pred["contract"]["version"], json.dumps(kernels, sort_keys=True),
                     json.dumps(clauses), ptext))
                entry_id = int(cur.lastrowid or 0)
                for f in files:
                    db.execute("INSERT INTO entry_files VALUES (?, ?, ?, ?, ?)",
                               (entry_id, f.role, f.name, f.path, stored[f.path]))
                hard = [cl["id"] for cl in clauses if cl["hard"]]
                self._log(db, "admit", "certificate checks; hard clauses hold: "
                          f"{', '.join(hard) if hard else '(none)'}; policy {ptext}; stored "
                          f"{len(files)} files", entry_id, shas, ptext)
        except BaseException:
            for p in created:  # still ours: no other admission writes blobs while we held the lock
                try:
                    p.unlink()
                except OSError:
                    pass
            raise
        return Decision(True, entry_id, [], list(report.notes), policy=pol)

    def _files(self, model: Path, model_bytes: bytes, contract: Path, contract_bytes: bytes,
               stmt: Mapping[str, Any]) -> tuple[list[StoredFile], list[str]]:
        """Every file the certificate binds, read once, with its place in the layout (relative
        to the files' common directory); reasons when one changed since the check."""
        found: list[tuple[str, str, Path, bytes | None]] = [
            ("model", model.name, _placed(model), model_bytes),
            ("contract", contract.name, _placed(contract), contract_bytes)]
        for s in subjects_of(stmt, "model-data"):
            found.append(("model-data", s["name"], _placed(model.parent / s["annotations"][PATH_KEY]),
                          None))
        for s in subjects_of(stmt, "slice"):
            p = Path(s["annotations"][PATH_KEY])
            found.append(("slice", s["name"], _placed(p if p.is_absolute() else contract.parent / p),
                          None))
        # the digest each file must still have (the checker compared them a moment ago); a
        # model whose certificate is embedded has a canonical digest, checked by the checker
        want = {(role, role if role in ("model", "contract") else s["name"]): s["digest"]["sha256"]
                for s in stmt["subject"]
                if (role := s["annotations"]["kcverify.role"]) != "kernel"
                and s["annotations"].get("kcverify.digest") == "file-sha256"}
        root = Path(os.path.commonpath([str(p.parent) for _, _, p, _ in found]))
        out: dict[str, StoredFile] = {}
        reasons = []
        for role, name, path, data in found:
            if data is None:
                try:
                    data = path.read_bytes()
                except OSError as e:
                    reasons.append(f"{name}: {path} cannot be read ({e.strerror or e})")
                    continue
            sha = sha256_bytes(data)
            if want.get((role, role if role in ("model", "contract") else name), sha) != sha:
                reasons.append(f"{name}: {path} changed while it was admitted")
                continue
            rel = path.relative_to(root).as_posix()
            if rel in out and out[rel].sha256 != sha:
                reasons.append(f"{name}: {path} changed while it was admitted")
                continue
            out.setdefault(rel, StoredFile(role, name, rel, sha, data))
        return list(out.values()), reasons

    def _kernel_specs_json(self, contract: Path, digests: Mapping[str, str]) -> dict[str, Any]:
        """The kernel-spec blob: each spec's canonical form (from the contract) and its digest."""
        specs = (self._kernel_specs(contract) if self._kernel_specs is not None
                 else self._contract(contract).kernels)
        canon = {k: (v.canonical() if hasattr(v, "canonical") else v) for k, v in specs.items()}
        return {"digests": dict(digests), "canonical": canon}

    # ---- queries ----------------------------------------------------------------------------

    def entries(self, status: str | None = None) -> list[dict[str, Any]]:
        with self._connect() as db:
            q = "SELECT * FROM entries" + (" WHERE status = ?" if status else "") + " ORDER BY id"
            return [self._entry(db, r) for r in db.execute(q, (status,) if status else ())]

    @staticmethod
    def _entry(db: sqlite3.Connection, row: sqlite3.Row) -> dict[str, Any]:
        e = dict(row)
        e["kernel_digests"] = json.loads(e["kernel_digests"])
        e["clauses"] = json.loads(e["clauses"])
        e["files"] = [dict(r) for r in db.execute(
            "SELECT role, name, path, sha256 FROM entry_files WHERE entry_id = ? ORDER BY path",
            (e["id"],))]
        return e

    def entry(self, entry_id: int | str) -> dict[str, Any]:
        eid = _entry_id(entry_id)
        with self._connect() as db:
            row = db.execute("SELECT * FROM entries WHERE id = ?", (eid,)).fetchone()
            if row is None:
                raise RegistryError(f"no registry entry {entry_id!r} in {self.root}")
            return self._entry(db, row)

    def decisions(self, entry_id: int | str | None = None) -> list[dict[str, Any]]:
        with self._connect() as db:
            if entry_id is None:
                rows = db.execute("SELECT * FROM decisions ORDER BY id")
            else:
                rows = db.execute("SELECT * FROM decisions WHERE entry_id = ? ORDER BY id",
                                  (_entry_id(entry_id),))
            return [dict(r) for r in rows]

    def log_promotion(self, record: Mapping[str, Any]) -> int:
        """Append a promotion decision (kcverify.enforce.promote: stage, go / no-go, contract and
        model digests, kernel fingerprint, verdicts) to the promotion log; returns its id."""
        with self._connect() as db, self._transaction(db):
            cur = db.execute(
                "INSERT INTO promotions (at, stage, decision, model_sha256, contract_sha256, "
                "record) VALUES (?, ?, ?, ?, ?, ?)",
                (_now(), str(record["stage"]), str(record["decision"]),
                 (record.get("model") or {}).get("sha256"),
                 (record.get("contract") or {}).get("sha256"), json.dumps(record, sort_keys=True)))
            return int(cur.lastrowid or 0)

    def promotions(self) -> list[dict[str, Any]]:
        """The promotion log, oldest first; each row's ``record`` decoded."""
        with self._connect() as db:
            rows = [dict(r) for r in db.execute("SELECT * FROM promotions ORDER BY id")]
        for r in rows:
            r["record"] = json.loads(r["record"])
        return rows

    def certificate(self, entry_id: int | str) -> dict[str, Any]:
        from kcverify.certs.statement import loads_certificate

        e = self.entry(entry_id)
        return loads_certificate(self.blob_path(e["certificate_sha256"]).read_bytes(),
                                 f"entry {e['id']} certificate")

    # ---- revocation and re-verification -----------------------------------------------------

    def revoke(self, entry_id: int | str, reason: str) -> dict[str, Any]:
        if not reason.strip():
            raise RegistryError("revoke needs a reason")
        eid = _entry_id(entry_id)
        with self._connect() as db, self._transaction(db):
            row = db.execute("SELECT * FROM entries WHERE id = ?", (eid,)).fetchone()
            if row is None:
                raise RegistryError(f"no registry entry {entry_id!r} in {self.root}")
            if row["status"] == "revoked":
                raise RegistryError(f"entry {eid} is already revoked ({row['revoke_reason']})")
            db.execute("UPDATE entries SET status = 'revoked', revoked_at = ?, revoke_reason = ? "
                       "WHERE id = ?", (_now(), reason, eid))
            self._log(db, "revoke", reason, eid, (row["model_sha256"], row["contract_sha256"],
                                                  row["certificate_sha256"]))
        return self.entry(eid)

    def verify(self, entry_id: int | str | None = None) -> list[VerifyResult]:
        """Re-check admitted entries from their stored blobs: blob integrity, then the checker on
        the rebuilt layout, then the policy the entry was admitted under."""
        targets = [self.entry(entry_id)] if entry_id is not None else self.entries("admitted")
        return [VerifyResult(int(e["id"]), not (p := self._verify_entry(e)), p) for e in targets]

    def _verify_entry(self, e: Mapping[str, Any]) -> list[str]:
        problems = []
        files = list(e["files"])
        if not files or e.get("policy") is None:
            return [f"entry {e['id']} was admitted by an older kcverify that did not store the "
                    "files its proof depends on (slice data, external weights): admit it again"]
        blobs = [(key, e[key]) for key in ("kernels_sha256", "certificate_sha256")]
        blobs += [(f"{f['role']} {f['path']}", f["sha256"]) for f in files]
        for what, sha in blobs:
            p = self.blob_path(sha)
            if not p.is_file():
                problems.append(f"blob {sha[:16]}… ({what}) is missing")
            elif _sha256_file(p) != sha:
                problems.append(f"blob {sha[:16]}… ({what}) is corrupted")
        bad = [f["path"] for f in files if not _safe_relative(f["path"])]
        if bad:
            problems.append(f"entry files with unsafe paths {bad}")
        roles = {f["role"]: f["path"] for f in files if f["role"] in ("model", "contract")}
        if set(roles) != {"model", "contract"}:
            problems.append("the entry lacks its model or contract file")
        if problems:
            return problems
        with tempfile.TemporaryDirectory(prefix="kcverify-verify-") as tmp:
            for f in files:
                dest = Path(tmp) / f["path"]
                dest.parent.mkdir(parents=True, exist_ok=True)
                # a copy: onnx refuses external data behind symlinks or hard links
                shutil.copyfile(self.blob_path(f["sha256"]), dest)
            model, contract = Path(tmp) / roles["model"], Path(tmp) / roles["contract"]
            cert = json.loads(self.blob_path(e["certificate_sha256"]).read_bytes())
            try:
                report = self._checker()(cert, model, contract)
                problems += report.problems
                if not report.problems:
                    levels = {c.id: c.level for c in self._contract(contract).clauses}
                    pol = parse_policy(e["policy"].split())
                    problems += [f"policy {e['policy']}: {r}" for r in
                                 policy_reasons(pol, cert["predicate"]["clauses"], levels)]
            except InternalError:
                raise
            except Exception as ex:  # noqa: BLE001 - report, go on with the others
                problems.append(f"re-check failed: {ex}")
        return problems

    def integrity(self) -> list[str]:
        """Problems with the store itself: SQLite's integrity check, and every listed blob."""
        problems = []
        with self._connect() as db:
            res = [r[0] for r in db.execute("PRAGMA integrity_check")]
            if res != ["ok"]:
                problems += [f"sqlite: {r}" for r in res]
            for r in db.execute("PRAGMA foreign_key_check"):
                problems.append(f"sqlite: dangling reference {tuple(r)}")
            for (sha,) in db.execute("SELECT sha256 FROM blobs"):
                p = self.blob_path(sha)
                if not p.is_file() or _sha256_file(p) != sha:
                    problems.append(f"blob {sha[:16]}… missing or corrupted")
        return problems


def _entry_id(entry_id: int | str) -> int:
    try:
        return int(str(entry_id).lstrip("#"))
    except ValueError:
        raise RegistryError(f"registry entry ids are integers, not {entry_id!r}") from None


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
