"""Atomic file writes: a reader sees the old file or the new one, never a part (certificates,
reports, registry blobs, models with an embedded certificate)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path``: a temp file in the same directory, fsync, os.replace, then
    fsync of the directory. The file gets the usual permissions (0666 minus the umask)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    try:
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:  # pragma: no cover - directories cannot be fsynced on some systems
        pass
    return path


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    return atomic_write(path, text.encode("utf-8"))
