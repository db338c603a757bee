"""The JSON report: versioned, sorted keys, written atomically (temp file, then os.replace)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kcverify import __version__
from kcverify.fileio import atomic_write_text
from kcverify.report.model import Report

FORMAT = "kcverify-report"
FORMAT_VERSION = 1


def report_json(report: Report) -> dict[str, Any]:
    """The report as a JSON object: format header, then clauses, health and action."""
    body = report.to_json()
    body["format"] = FORMAT
    body["format_version"] = FORMAT_VERSION
    body["tool"] = {"name": "kcverify", "version": __version__}
    return _finite(body)


def _finite(obj: Any) -> Any:
    """Plain JSON values (kcverify.api.json_value: NaN as null, +-infinity as "inf" / "-inf")."""
    from kcverify.api import json_value

    return json_value(obj)


def write_report_json(report: Report, path: str | os.PathLike[str]) -> Path:
    """Write the JSON report to ``path`` atomically; returns the path."""
    text = json.dumps(report_json(report), indent=2, sort_keys=True, allow_nan=False) + "\n"
    return atomic_write_text(path, text)


def report_from_json(body: dict[str, Any]) -> Report:
    """A Report back from its JSON form (re-rendering a stored report, the health window)."""
    from kcverify.report.model import BlockDrift, ClauseResult, SliceResult

    def num(v: Any) -> Any:
        return float(v) if v in ("inf", "-inf") else v

    def block(b: dict[str, Any]) -> BlockDrift:
        return BlockDrift(b["block"], num(b.get("certified")), num(b.get("observed")), b.get("kind", ""))

    clauses = []
    for c in body.get("clauses", []):
        c = {k: num(v) for k, v in c.items() if k != "action_taken"}
        c["slices"] = [SliceResult(**{k: num(v) for k, v in s.items()}) for s in c.get("slices", [])]
        c["blocks"] = [block(b) for b in c.get("blocks", [])]
        clauses.append(ClauseResult(**c))
    return Report(body["contract"], body["model"], clauses, health=body.get("health"),
                  action=body.get("action", "none"), blocks=[block(b) for b in body.get("blocks", [])],
                  escalation=dict(body.get("escalation", {})), meta=dict(body.get("meta", {})))


def read_report_json(path: str | os.PathLike[str]) -> Report:
    """Read a JSON report written by write_report_json."""
    from kcverify.errors import InputFileError

    try:
        body = json.loads(Path(path).read_text(encoding="utf-8"))
        if body.get("format") != FORMAT:
            raise ValueError(f"format is {body.get('format')!r}, not {FORMAT!r}")
        return report_from_json(body)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InputFileError(f"{path}: not a kcverify report ({e}); expected the JSON that "
                             f"'kcverify prove --report' writes") from None
