"""Logged traces: the JSONL record format, its validation, and a reader that can follow a file.

One line per request and serving kernel (the JSON Schema is ``trace.schema.json`` next to this
module; docs/enforcement.md explains every field):

    {"request_id": "r42", "time": "2025-06-01T12:00:02.125Z", "slices": ["points"],
     "kernel": {"name": "inf", "fingerprint": {"build": "b1", "attention": "none",
                "quantisation": "fp8_e4m3", "hardware": "cpu"}},
     "inputs": {"x": [0.1, 0.2, 0.3, 0.4]},             # or "input_ids": [...], or "input_ref"
     "logits_train": [[0.3, -0.1]], "logits_inf": [[0.31, -0.12]],   # [positions, V] or [V]
     "latency_ms": 2.1, "replay": {...}, ...}          # any other field is kept

Instead of both kernels' logits a record may carry the sampled ``tokens`` with both kernels'
log-probabilities of them (``logprob_train``, ``logprob_inf``); then only the log-probability
quantities (logprob_abs, ratio_dev) can be re-evaluated from it.

Malformed input, and what the reader does with it (``skip_bad=False``, the default / ``True``):

    a line that is not a JSON object            error  file:line / skipped, counted ("json")
    a missing or mistyped field, a bad time     error  file:line / skipped, counted ("schema")
    a time earlier than the previous record's   error  file:line / skipped, counted ("order")
    the same (request_id, kernel name) twice    error  file:line / skipped, counted ("duplicate")
    an empty line                               ignored in both modes

An error is a :class:`TraceError` (``file:line: error: ...``, exit code 2). A skip calls
``warn`` with ``file:line: warning: skipped (reason): ...`` and is counted in ``skipped``; the
monitor and promote outputs report the counts, so a skip is never silent.
"""

from __future__ import annotations

import json
import math
import os
import re
import time as _time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np

from kcverify.errors import InputFileError, KcverifyError

SCHEMA_FILE = Path(__file__).with_name("trace.schema.json")
FINGERPRINT_KEYS = ("build", "attention", "quantisation", "hardware")
# The fields the reader turns into typed attributes; every other field is kept in ``extra``.
KNOWN_FIELDS = ("request_id", "time", "slices", "kernel", "input_ids", "inputs", "input_ref",
                "logits_train", "logits_inf", "tokens", "logprob_train", "logprob_inf", "labels",
                "latency_ms", "peak_memory_mb", "replay")
SKIP_REASONS = ("json", "schema", "order", "duplicate")
_RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$")
_HASH = re.compile(r"^sha256:[0-9a-f]{64}$")
PROGRAM_KEYS = ("seed", "order", "chunk", "rounding")


class TraceError(KcverifyError):
    """A malformed trace line: rendered ``file:line: error: message`` (exit code 2)."""

    def __init__(self, message: str, file: str | os.PathLike[str] | None = None,
                 line: int | None = None, reason: str = "schema") -> None:
        super().__init__(message)
        self.message = message
        self.file = None if file is None else os.fspath(file)
        self.line = line
        self.reason = reason

    def where(self) -> str:
        return f"{self.file or '<traces>'}" + (f":{self.line}" if self.line is not None else "")

    def render(self) -> str:
        return f"{self.where()}: error: {self.message}"

    def __str__(self) -> str:
        return self.render()


def load_schema() -> dict[str, Any]:
    """The JSON Schema of one trace record (package data)."""
    return json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))


# --------------------------------------------------------------------------------------------
# Times and durations
# --------------------------------------------------------------------------------------------


def parse_time(text: str) -> datetime:
    """An RFC 3339 date-time with an offset (``...Z`` or ``...+02:00``) as an aware datetime."""
    if not isinstance(text, str) or not _RFC3339.match(text):
        raise ValueError(f"{text!r} is not an RFC 3339 date-time with an offset "
                         f"(e.g. 2025-06-01T12:00:02.125Z)")
    t = text.replace("z", "Z").replace("t", "T")
    frac = re.search(r"\.(\d+)", t)
    if frac and len(frac.group(1)) > 6:  # fromisoformat takes at most microseconds
        t = t.replace(frac.group(0), "." + frac.group(1)[:6])
    try:
        return datetime.fromisoformat(t.replace("Z", "+00:00"))
    except ValueError as e:
        raise ValueError(f"{text!r} is not a valid date-time ({e})") from None


def format_time(t: datetime) -> str:
    """RFC 3339 in UTC with millisecond precision: 2025-06-01T12:05:00.000Z."""
    return t.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def parse_duration(text: str | float) -> float:
    """Seconds from ``300s``, ``5m``, ``1.5h``, ``250ms`` or a bare number of seconds (> 0)."""
    if isinstance(text, int | float):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|min|m|h)?\s*", str(text))
        if not m:
            raise KcverifyError(f"duration {text!r}: expected a number with a unit, e.g. 300s, "
                                f"5m, 1h (units: ms, s, m, h)")
        value = float(m.group(1)) * _UNITS[m.group(2) or "s"]
    if not value > 0 or not math.isfinite(value):
        raise KcverifyError(f"duration {text!r}: must be a positive number of seconds")
    return value


# --------------------------------------------------------------------------------------------
# One record
# --------------------------------------------------------------------------------------------


@dataclass
class TraceRecord:
    """One validated trace line. Arrays are float64 (int64 for token ids); ``extra`` keeps every
    field the format does not name; ``source``/``line`` locate the record."""

    request_id: str
    time: datetime
    slices: tuple[str, ...]
    kernel_name: str
    fingerprint: dict[str, str]
    latency_ms: float
    inputs: dict[str, np.ndarray] | None = None
    input_ref: dict[str, Any] | None = None
    logits_train: np.ndarray | None = None
    logits_inf: np.ndarray | None = None
    tokens: np.ndarray | None = None
    logprob_train: np.ndarray | None = None
    logprob_inf: np.ndarray | None = None
    labels: np.ndarray | None = None
    peak_memory_mb: float | None = None
    replay: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)
    source: str = "<traces>"
    line: int = 0

    @property
    def build(self) -> str:
        return self.fingerprint["build"]

    @property
    def has_logits(self) -> bool:
        return self.logits_train is not None

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}"

    def observed_tokens(self) -> np.ndarray | None:
        """The token ids the record's positions refer to (input_ids, else tokens), or None."""
        if self.inputs is not None and "input_ids" in self.inputs:
            return self.inputs["input_ids"].reshape(-1)
        return self.tokens

    def to_json(self) -> dict[str, Any]:
        """The record as it was read (every field, extra ones included)."""
        return dict(self.raw)


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON (a number must be finite)")


def _loads(text: str) -> Any:
    return json.loads(text, parse_constant=_reject_constant)


def _array(value: Any, what: str, integer: bool = False, min_ndim: int = 0,
           max_ndim: int | None = None) -> np.ndarray:
    """A rectangular numeric array from nested JSON lists; ValueError naming what is wrong."""
    if isinstance(value, bool) or not isinstance(value, list | int | float):
        raise ValueError(f"{what}: expected {'integers' if integer else 'numbers'} "
                         f"(a nested list), got {type(value).__name__}")
    try:
        arr = np.asarray(value, dtype=np.int64 if integer else np.float64)
    except (ValueError, TypeError, OverflowError):
        raise ValueError(f"{what}: expected a rectangular array of "
                         f"{'integers' if integer else 'numbers'}") from None
    if integer and not _all_ints(value):
        raise ValueError(f"{what}: expected integers")
    if not integer and _has_bool(value):
        raise ValueError(f"{what}: expected numbers, got true/false")
    if arr.ndim < min_ndim or (max_ndim is not None and arr.ndim > max_ndim):
        shape = "[V] or [positions, V]" if max_ndim == 2 else f"at least {min_ndim} axes"
        raise ValueError(f"{what}: expected shape {shape}, got {list(arr.shape)}")
    if arr.size == 0 and min_ndim:
        raise ValueError(f"{what}: empty")
    return arr


def _all_ints(v: Any) -> bool:
    if isinstance(v, list):
        return all(_all_ints(x) for x in v)
    return isinstance(v, int) and not isinstance(v, bool)


def _has_bool(v: Any) -> bool:
    if isinstance(v, list):
        return any(_has_bool(x) for x in v)
    return isinstance(v, bool)


def _string(obj: Mapping[str, Any], key: str, what: str, empty_ok: bool = False) -> str:
    if key not in obj:
        raise ValueError(f"missing required field {what!r}")
    v = obj[key]
    if not isinstance(v, str) or (not empty_ok and not v):
        raise ValueError(f"field {what!r}: expected a non-empty string, got {v!r}"
                         if not empty_ok else f"field {what!r}: expected a string, got {v!r}")
    return v


def _number(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
        raise ValueError(f"field {what!r}: expected a number >= 0, got {v!r}")
    return float(v)


def record_from_json(obj: Any, source: str = "<traces>", line: int = 0) -> TraceRecord:
    """Validate one decoded line against the trace format; TraceError (file:line) if it fails."""
    try:
        return _record(obj, source, line)
    except ValueError as e:
        raise TraceError(str(e), source, line, "schema") from None


def _record(obj: Any, source: str, line: int) -> TraceRecord:
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object (one trace record per line), got "
                         f"{type(obj).__name__}")
    request_id = _string(obj, "request_id", "request_id")
    t_text = _string(obj, "time", "time")
    t = parse_time(t_text)
    if "slices" not in obj:
        raise ValueError("missing required field 'slices' (a list of slice names)")
    slices = obj["slices"]
    if not isinstance(slices, list) or not all(isinstance(s, str) and s for s in slices):
        raise ValueError(f"field 'slices': expected a list of slice names, got {slices!r}")
    if "kernel" not in obj:
        raise ValueError("missing required field 'kernel' ({name, fingerprint})")
    kernel = obj["kernel"]
    if not isinstance(kernel, dict):
        raise ValueError(f"field 'kernel': expected an object {{name, fingerprint}}, got {kernel!r}")
    kname = _string(kernel, "name", "kernel.name")
    if "fingerprint" not in kernel:
        raise ValueError("missing required field 'kernel.fingerprint' "
                         f"({{{', '.join(FINGERPRINT_KEYS)}}})")
    fp = kernel["fingerprint"]
    if not isinstance(fp, dict):
        raise ValueError(f"field 'kernel.fingerprint': expected an object, got {fp!r}")
    fingerprint = {k: _string(fp, k, f"kernel.fingerprint.{k}", empty_ok=k != "build")
                   for k in FINGERPRINT_KEYS}
    fingerprint.update({k: v for k, v in fp.items() if k not in FINGERPRINT_KEYS
                        and isinstance(v, str)})
    if "latency_ms" not in obj:
        raise ValueError("missing required field 'latency_ms' (a number >= 0)")
    latency = _number(obj["latency_ms"], "latency_ms")
    peak = _number(obj["peak_memory_mb"], "peak_memory_mb") if "peak_memory_mb" in obj else None

    inputs: dict[str, np.ndarray] | None = None
    if "input_ids" in obj:
        inputs = {"input_ids": _array(obj["input_ids"], "field 'input_ids'", integer=True,
                                      min_ndim=1, max_ndim=1)}
    if "inputs" in obj:
        raw_in = obj["inputs"]
        if not isinstance(raw_in, dict) or not raw_in:
            raise ValueError("field 'inputs': expected an object mapping each model input to "
                             "its array")
        inputs = dict(inputs or {})
        for k, v in raw_in.items():
            ints = _all_ints(v)
            inputs[str(k)] = _array(v, f"field 'inputs.{k}'", integer=ints)
    ref = None
    if "input_ref" in obj:
        ref = obj["input_ref"]
        if (not isinstance(ref, dict) or not isinstance(ref.get("file"), str) or not ref["file"]
                or isinstance(ref.get("index"), bool) or not isinstance(ref.get("index"), int)
                or ref["index"] < 0):
            raise ValueError(f"field 'input_ref': expected {{file: PATH, index: N >= 0}}, got "
                             f"{ref!r}")
    if inputs is None and ref is None:
        raise ValueError("missing the request's inputs: give 'input_ids', 'inputs' or "
                         "'input_ref' {file, index}")

    zt = zi = tokens = lpt = lpi = None
    if "logits_train" in obj or "logits_inf" in obj:
        for k in ("logits_train", "logits_inf"):
            if k not in obj:
                raise ValueError(f"missing required field {k!r} (both kernels' logits are needed)")
        zt = _array(obj["logits_train"], "field 'logits_train'", min_ndim=1, max_ndim=2)
        zi = _array(obj["logits_inf"], "field 'logits_inf'", min_ndim=1, max_ndim=2)
        if zt.shape != zi.shape:
            raise ValueError(f"fields 'logits_train' and 'logits_inf' differ in shape: "
                             f"{list(zt.shape)} vs {list(zi.shape)}")
        if zt.ndim == 1:
            zt, zi = zt[None, :], zi[None, :]
    else:
        missing = [k for k in ("tokens", "logprob_train", "logprob_inf") if k not in obj]
        if missing:
            raise ValueError("missing both kernels' outputs: give 'logits_train' and "
                             "'logits_inf', or 'tokens', 'logprob_train' and 'logprob_inf' "
                             f"(missing {', '.join(repr(m) for m in missing)})")
    if "tokens" in obj or "logprob_train" in obj or "logprob_inf" in obj:
        if "tokens" in obj:
            tokens = _array(obj["tokens"], "field 'tokens'", integer=True, min_ndim=1, max_ndim=1)
        if "logprob_train" in obj or "logprob_inf" in obj:
            for k in ("logprob_train", "logprob_inf"):
                if k not in obj:
                    raise ValueError(f"missing required field {k!r} (both kernels' "
                                     f"log-probabilities are needed)")
            lpt = _array(obj["logprob_train"], "field 'logprob_train'", min_ndim=1, max_ndim=1)
            lpi = _array(obj["logprob_inf"], "field 'logprob_inf'", min_ndim=1, max_ndim=1)
            if lpt.shape != lpi.shape:
                raise ValueError("fields 'logprob_train' and 'logprob_inf' differ in length")
            if tokens is not None and tokens.shape != lpt.shape:
                raise ValueError("fields 'tokens' and 'logprob_train' differ in length")
    labels = None
    if "labels" in obj:
        labels = _array(obj["labels"], "field 'labels'", integer=True)
    replay = obj.get("replay")
    if replay is not None:
        _check_replay(replay)
    extra = {k: v for k, v in obj.items() if k not in KNOWN_FIELDS}
    return TraceRecord(request_id=request_id, time=t, slices=tuple(slices), kernel_name=kname,
                       fingerprint=fingerprint, latency_ms=latency, inputs=inputs, input_ref=ref,
                       logits_train=zt, logits_inf=zi, tokens=tokens, logprob_train=lpt,
                       logprob_inf=lpi, labels=labels, peak_memory_mb=peak, replay=replay,
                       extra=extra, raw=obj, source=source, line=line)


def _check_replay(replay: Any) -> None:
    if not isinstance(replay, dict):
        raise ValueError(f"field 'replay': expected an object {{train, inf}}, got {replay!r}")
    for side, sig in replay.items():
        if side not in ("train", "inf"):
            continue  # kept, not interpreted
        where = f"replay.{side}"
        if not isinstance(sig, dict) or not isinstance(sig.get("audit"), dict):
            raise ValueError(f"field {where!r}: expected {{program, audit: {{tensor: hash}}}}")
        for name, h in sig["audit"].items():
            if not isinstance(h, str) or not _HASH.match(h):
                raise ValueError(f"field '{where}.audit.{name}': expected 'sha256:' and 64 "
                                 f"lowercase hex digits, got {h!r}")
        prog = sig.get("program", {})
        if not isinstance(prog, dict) or any(k not in PROGRAM_KEYS for k in prog):
            raise ValueError(f"field '{where}.program': expected an object with keys among "
                             f"{', '.join(PROGRAM_KEYS)}, got {prog!r}")


# --------------------------------------------------------------------------------------------
# Reading a file (finished or growing)
# --------------------------------------------------------------------------------------------


def _warn_stderr(message: str) -> None:
    import sys

    print(message, file=sys.stderr)


class TraceReader:
    """Iterate the records of a JSONL trace file, validated, in time order.

    ``follow``: keep reading as the file grows (like ``tail -f``): a line is taken once it ends
    with a newline; the reader stops after ``idle_timeout`` seconds without a new line (never,
    when None) or when ``stop()`` returns True. ``skip_bad``: skip malformed lines, counted by
    reason and reported through ``warn``, instead of raising TraceError (module docstring).
    """

    def __init__(self, path: str | os.PathLike[str], *, follow: bool = False,
                 skip_bad: bool = False, poll_s: float = 0.25, idle_timeout: float | None = None,
                 warn: Callable[[str], None] | None = None, max_warnings: int = 20,
                 stop: Callable[[], bool] | None = None) -> None:
        self.path = Path(path)
        self.follow = follow
        self.skip_bad = skip_bad
        self.poll_s = poll_s
        self.idle_timeout = idle_timeout
        self.warn = warn or _warn_stderr
        self.max_warnings = max_warnings
        self.stop = stop
        self.skipped: Counter[str] = Counter()
        self.lines = 0
        self.records = 0
        self._last: TraceRecord | None = None
        self._seen: set[tuple[str, str]] = set()
        if not self.path.is_file():
            raise InputFileError(f"{self.path}: no such trace file (JSONL, one record per line)")

    @property
    def skipped_total(self) -> int:
        return sum(self.skipped.values())

    def _bad(self, err: TraceError) -> None:
        if not self.skip_bad:
            raise err
        self.skipped[err.reason] += 1
        n = self.skipped_total
        if n <= self.max_warnings:
            self.warn(f"{err.where()}: warning: skipped ({err.reason}): {err.message}")
        elif n == self.max_warnings + 1:
            self.warn(f"{self.path}: warning: more lines skipped; counts follow at the end")

    def summary(self) -> str | None:
        """One warning line with the skip counts, or None when nothing was skipped."""
        if not self.skipped:
            return None
        parts = ", ".join(f"{r}: {self.skipped[r]}" for r in SKIP_REASONS if self.skipped[r])
        return (f"{self.path}: warning: skipped {self.skipped_total} of {self.lines} lines "
                f"({parts})")

    def _parse(self, text: str, lineno: int) -> TraceRecord | None:
        if not text.strip():
            return None
        src = os.fspath(self.path)
        try:
            obj = _loads(text)
        except ValueError as e:
            msg = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
            col = f" at column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
            self._bad(TraceError(f"not a JSON object ({msg}{col}); expected one trace record "
                                 f"per line", src, lineno, "json"))
            return None
        try:
            rec = record_from_json(obj, src, lineno)
        except TraceError as e:
            self._bad(e)
            return None
        last = self._last
        if last is not None and rec.time < last.time:
            self._bad(TraceError(f"time {rec.raw['time']} is earlier than line {last.line}'s "
                                 f"{last.raw['time']}; records must be in time order",
                                 src, lineno, "order"))
            return None
        key = (rec.request_id, rec.kernel_name)
        if key in self._seen:
            self._bad(TraceError(f"request {rec.request_id!r} already has a record for kernel "
                                 f"{rec.kernel_name!r}; one record per request and kernel",
                                 src, lineno, "duplicate"))
            return None
        self._seen.add(key)
        self._last = rec
        self.records += 1
        return rec

    def _line(self, raw: bytes) -> TraceRecord | None:
        self.lines += 1
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            self._bad(TraceError(f"not UTF-8 text ({e.reason} at byte {e.start}); expected one "
                                 f"JSON object per line", self.path, self.lines, "json"))
            return None
        return self._parse(text, self.lines)

    def __iter__(self) -> Iterator[TraceRecord]:
        try:
            f = self.path.open("rb")
        except OSError as e:
            raise InputFileError(f"{self.path}: cannot read ({e.strerror or e})") from None
        with f:
            pending = b""
            idle_since = _time.monotonic()
            while True:
                chunk = f.readline()
                if chunk:
                    pending += chunk
                    if not pending.endswith(b"\n") and self.follow:
                        continue  # a line still being written
                    raw, pending = pending, b""
                    rec = self._line(raw)
                    if rec is not None:
                        idle_since = _time.monotonic()
                        yield rec
                    continue
                if not self.follow:
                    if pending:
                        rec = self._line(pending)
                        if rec is not None:
                            yield rec
                    return
                if self.stop is not None and self.stop():
                    return
                if (self.idle_timeout is not None
                        and _time.monotonic() - idle_since >= self.idle_timeout):
                    return
                _time.sleep(self.poll_s)


def read_traces(path: str | os.PathLike[str], skip_bad: bool = False,
                warn: Callable[[str], None] | None = None) -> tuple[list[TraceRecord], TraceReader]:
    """Every record of a finished trace file, and the reader (its skip counts)."""
    reader = TraceReader(path, skip_bad=skip_bad, warn=warn)
    return list(reader), reader


def tensor_hash(value: Any) -> str:
    """The replay signature of one tensor: ``sha256:`` over ``f8:<shape>:`` and its float64
    little-endian C-order bytes (integer tensors as int64: ``i8:``)."""
    import hashlib

    arr = np.asarray(value.detach().cpu().numpy() if hasattr(value, "detach") else value)
    if arr.dtype.kind in "iub":
        tag, data = "i8", np.ascontiguousarray(arr, dtype="<i8")
    else:
        tag, data = "f8", np.ascontiguousarray(arr, dtype="<f8")
    head = f"{tag}:{','.join(str(d) for d in arr.shape)}:".encode()
    return "sha256:" + hashlib.sha256(head + data.tobytes()).hexdigest()


def window_index(t: datetime, t0: datetime, width_s: float) -> int:
    """The window holding time ``t``: windows are [t0 + k w, t0 + (k + 1) w), k = 0, 1, ..."""
    return int(math.floor((t - t0).total_seconds() / width_s))


def window_bounds(t0: datetime, width_s: float, k: int) -> tuple[datetime, datetime]:
    return t0 + timedelta(seconds=k * width_s), t0 + timedelta(seconds=(k + 1) * width_s)
