"""The registry: an admission gate in front of an embedded SQLite store with content-addressed blobs.

Layout of a registry directory (default ``~/.kcverify/registry``; ``--registry DIR`` or the
environment variable ``KCVERIFY_REGISTRY`` override it):

    registry.sqlite3       entries, blobs, decisions (WAL journal; every change one transaction)
    blobs/ab/abcdef…       each stored file named by its sha256 (model, contract, kernel specs,
                           certificate), written atomically, stored once however often admitted

Admission of (model, contract, certificate): the checker (kcverify.certs.checker) must pass, and
every *hard* clause must be ``proved`` or ``passed`` — a hard clause that is refuted, failed or
unknown blocks admission. A rejected admission writes no blob and no entry; like every decision
(admit, reject, revoke), it is recorded in the ``decisions`` log with its reason.

Concurrency: blobs are written and rows inserted while holding SQLite's write lock
(``BEGIN IMMEDIATE``), so concurrent admits serialise their writes; a failed transaction removes
the blobs it created. Readers never block (WAL).
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kcverify.certs.statement import HOLDING_VERDICTS, dumps, sha256_bytes
from kcverify.errors import InputFileError, RegistryError
from kcverify.fileio import atomic_write

ENV = "KCVERIFY_REGISTRY"
DB_NAME = "registry.sqlite3"
SCHEMA_VERSION = 1

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
  revoked_at TEXT, revoke_reason TEXT);
CREATE UNIQUE INDEX IF NOT EXISTS one_admitted_per_tuple
  ON entries (model_sha256, contract_sha256, certificate_sha256) WHERE status = 'admitted';
CREATE TABLE IF NOT EXISTS decisions (
  id INTEGER PRIMARY KEY AUTOINCREMENT, at TEXT NOT NULL,
  action TEXT NOT NULL CHECK (action IN ('admit', 'reject', 'revoke')),
  entry_id INTEGER REFERENCES entries(id),
  model_sha256 TEXT, contract_sha256 TEXT, certificate_sha256 TEXT, reason TEXT NOT NULL);
"""


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


@dataclass
class VerifyResult:
    entry_id: int
    ok: bool
    problems: list[str]


CheckFn = Callable[..., Any]  # check_certificate(cert, model, contract) -> CheckReport


class Registry:
    """A registry directory. ``check`` is the checker (default kcverify.certs.checker's, with the
    real bound engine's re-check hook); tests pass one with fake hooks."""

    def __init__(self, root: str | os.PathLike[str] | None = None, *,
                 check: CheckFn | None = None,
                 kernel_specs: Callable[[Path], Mapping[str, Any]] | None = None) -> None:
        self.root = default_root(root)
        self.blob_dir = self.root / "blobs"
        self._check = check
        self._kernel_specs = kernel_specs
        try:
            self.blob_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RegistryError(f"{self.root}: cannot create the registry ({e.strerror or e})") from None
        with self._connect() as db:
            db.executescript(SCHEMA)
            db.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            v = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0]
            if int(v) != SCHEMA_VERSION:
                raise RegistryError(f"{self.root}: registry schema {v} is not supported "
                                    f"(this kcverify uses {SCHEMA_VERSION})")

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
             shas: tuple[str | None, str | None, str | None] = (None, None, None)) -> None:
        db.execute("INSERT INTO decisions (at, action, entry_id, model_sha256, contract_sha256, "
                   "certificate_sha256, reason) VALUES (?, ?, ?, ?, ?, ?, ?)",
                   (_now(), action, entry_id, *shas, reason))

    def _checker(self) -> CheckFn:
        if self._check is not None:
            return self._check
        from kcverify.certs.checker import check_certificate

        return check_certificate

    # ---- admission --------------------------------------------------------------------------

    def admit(self, model: str | os.PathLike[str], contract: str | os.PathLike[str],
              cert: str | os.PathLike[str] | dict[str, Any]) -> Decision:
        """Admit (model, kernel specs, contract, certificate) if it checks and every hard clause
        holds; either way the decision is logged. Bad input (a missing file) raises."""
        model, contract = Path(model), Path(contract)
        for p, what in ((model, "model"), (contract, "contract")):
            if not p.is_file():
                raise InputFileError(f"{p}: no such {what} file")
        report = self._checker()(cert, model, contract)
        stmt = report.statement
        model_bytes, contract_bytes = model.read_bytes(), contract.read_bytes()
        cert_bytes = dumps(stmt).encode("utf-8") if stmt is not None else b""
        shas = (sha256_bytes(model_bytes), sha256_bytes(contract_bytes),
                sha256_bytes(cert_bytes) if stmt is not None else None)
        reasons = [f"certificate does not check: {p}" for p in report.problems]
        if stmt is not None:
            for c in stmt["predicate"]["clauses"]:
                if c["hard"] and c["verdict"] not in HOLDING_VERDICTS:
                    reasons.append(f"hard clause {c['id']} is {c['verdict']} (admission needs "
                                   f"{' or '.join(HOLDING_VERDICTS)})")
        if reasons:
            with self._connect() as db, self._transaction(db):
                self._log(db, "reject", "; ".join(reasons), None, shas)
            return Decision(False, None, reasons, list(report.notes))
        assert stmt is not None
        kernels = {s["name"].removeprefix("kernel:"): s["digest"]["sha256"]
                   for s in stmt["subject"] if s["annotations"]["kcverify.role"] == "kernel"}
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
                    self._log(db, "admit", f"already admitted as entry {row['id']}", row["id"], shas)
                    return Decision(True, int(row["id"]), [], list(report.notes), duplicate=True)
                m = self._put_blob(db, model_bytes, "model", created)
                c = self._put_blob(db, contract_bytes, "contract", created)
                k = self._put_blob(db, kernel_blob, "kernel-specs", created)
                x = self._put_blob(db, cert_bytes, "certificate", created)
                pred = stmt["predicate"]
                cur = db.execute(
                    "INSERT INTO entries (status, admitted_at, model_name, model_sha256, "
                    "contract_name, contract_sha256, kernels_sha256, certificate_sha256, "
                    "contract_id, contract_version, kernel_digests, clauses) "
                    "VALUES ('admitted', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (_now(), model.name, m, contract.name, c, k, x, pred["contract"]["name"],
                     pred["contract"]["version"], json.dumps(kernels, sort_keys=True),
                     json.dumps(clauses)))
                entry_id = int(cur.lastrowid or 0)
                hard = [cl["id"] for cl in clauses if cl["hard"]]
                self._log(db, "admit", "certificate checks; hard clauses hold: "
                          f"{', '.join(hard) if hard else '(none)'}", entry_id, shas)
        except BaseException:
            for p in created:  # still ours: no other admission writes blobs while we held the lock
                try:
                    p.unlink()
                except OSError:
                    pass
            raise
        return Decision(True, entry_id, [], list(report.notes))

    def _kernel_specs_json(self, contract: Path, digests: Mapping[str, str]) -> dict[str, Any]:
        """The kernel-spec blob: each spec's canonical form (from the contract) and its digest."""
        specs: Mapping[str, Any] | None = None
        if self._kernel_specs is not None:
            specs = self._kernel_specs(contract)
        else:
            try:
                from kcverify.dsl import load_contract
            except ImportError:
                specs = None
            else:
                specs = load_contract(contract).kernels
        canon = ({k: (v.canonical() if hasattr(v, "canonical") else v) for k, v in specs.items()}
                 if specs is not None else None)
        return {"digests": dict(digests), "canonical": canon}

    # ---- queries ----------------------------------------------------------------------------

    def entries(self, status: str | None = None) -> list[dict[str, Any]]:
        with self._connect() as db:
            q = "SELECT * FROM entries" + (" WHERE status = ?" if status else "") + " ORDER BY id"
            return [self._entry(r) for r in db.execute(q, (status,) if status else ())]

    @staticmethod
    def _entry(row: sqlite3.Row) -> dict[str, Any]:
        e = dict(row)
        e["kernel_digests"] = json.loads(e["kernel_digests"])
        e["clauses"] = json.loads(e["clauses"])
        return e

    def entry(self, entry_id: int | str) -> dict[str, Any]:
        eid = _entry_id(entry_id)
        with self._connect() as db:
            row = db.execute("SELECT * FROM entries WHERE id = ?", (eid,)).fetchone()
        if row is None:
            raise RegistryError(f"no registry entry {entry_id!r} in {self.root}")
        return self._entry(row)

    def decisions(self, entry_id: int | str | None = None) -> list[dict[str, Any]]:
        with self._connect() as db:
            if entry_id is None:
                rows = db.execute("SELECT * FROM decisions ORDER BY id")
            else:
                rows = db.execute("SELECT * FROM decisions WHERE entry_id = ? ORDER BY id",
                                  (_entry_id(entry_id),))
            return [dict(r) for r in rows]

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
        """Re-check admitted entries from their stored blobs: blob integrity, then the checker."""
        targets = [self.entry(entry_id)] if entry_id is not None else self.entries("admitted")
        results = []
        for e in targets:
            problems = []
            for key in ("model_sha256", "contract_sha256", "kernels_sha256", "certificate_sha256"):
                p = self.blob_path(e[key])
                if not p.is_file():
                    problems.append(f"blob {e[key][:16]}… ({key}) is missing")
                elif _sha256_file(p) != e[key]:
                    problems.append(f"blob {e[key][:16]}… ({key}) is corrupted")
            if not problems:
                with tempfile.TemporaryDirectory(prefix="kcverify-verify-") as tmp:
                    model = Path(tmp) / e["model_name"]
                    contract = Path(tmp) / e["contract_name"]
                    model.symlink_to(self.blob_path(e["model_sha256"]))
                    contract.symlink_to(self.blob_path(e["contract_sha256"]))
                    cert = json.loads(self.blob_path(e["certificate_sha256"]).read_bytes())
                    try:
                        report = self._checker()(cert, model, contract)
                        problems += report.problems
                    except Exception as ex:  # noqa: BLE001 - report, go on with the others
                        problems.append(f"re-check failed: {ex}")
            results.append(VerifyResult(int(e["id"]), not problems, problems))
        return results

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
