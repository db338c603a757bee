"""The trace format: the JSON Schema, the reader's validation and its located errors or counted
skips (docs/enforcement.md, "Malformed traces")."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest

from kcverify.cli import main
from kcverify.enforce.traces import (
    TraceError,
    TraceReader,
    load_schema,
    parse_duration,
    parse_time,
    record_from_json,
)
from kcverify.errors import KcverifyError


@pytest.fixture(scope="module")
def good(e5) -> list[dict]:
    return [json.loads(ln) for ln in e5.clean.read_text().splitlines()[:6]]


def write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_generated_records_match_the_schema(e5):
    schema = load_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    v = jsonschema.Draft202012Validator(schema)
    for ln in e5.traces.read_text().splitlines()[::97]:
        v.validate(json.loads(ln))


def _mutations(rec: dict) -> list[tuple[str, dict]]:
    out = []
    for key in ("request_id", "time", "slices", "kernel", "latency_ms"):
        r = copy.deepcopy(rec)
        del r[key]
        out.append((f"missing required field {key!r}", r))
    r = copy.deepcopy(rec)
    del r["kernel"]["fingerprint"]["build"]
    out.append(("missing required field 'kernel.fingerprint.build'", r))
    r = copy.deepcopy(rec)
    del r["inputs"]
    out.append(("missing the request's inputs", r))
    r = copy.deepcopy(rec)
    del r["logits_inf"]
    out.append(("missing required field 'logits_inf'", r))
    r = copy.deepcopy(r)
    r.pop("logits_train")
    out.append(("missing both kernels' outputs", r))
    r = copy.deepcopy(rec)
    r["time"] = "2025-06-01 12:00:00"  # no offset
    out.append(("not an RFC 3339 date-time", r))
    r = copy.deepcopy(rec)
    r["latency_ms"] = -1
    out.append(("field 'latency_ms': expected a number >= 0", r))
    r = copy.deepcopy(rec)
    r["slices"] = "points"
    out.append(("field 'slices': expected a list", r))
    r = copy.deepcopy(rec)
    r["logits_train"] = [[1.0, 2.0], [3.0]]
    out.append(("expected a rectangular array", r))
    r = copy.deepcopy(rec)
    r["replay"]["inf"]["audit"]["y"] = "md5:abc"
    out.append(("field 'replay.inf.audit.y'", r))
    return out


def test_hand_validator_agrees_with_the_schema(good):
    v = jsonschema.Draft202012Validator(load_schema())
    rec = good[0]
    assert v.is_valid(rec)
    record_from_json(rec, "t.jsonl", 1)
    extra = {**rec, "tenant": "a", "route": "inf"}  # extra fields are kept
    assert record_from_json(extra, "t.jsonl", 1).extra["tenant"] == "a"
    assert v.is_valid(extra)
    for message, bad in _mutations(rec):
        if "rectangular" not in message:  # JSON Schema cannot express rectangular arrays
            assert not v.is_valid(bad), message
        with pytest.raises(TraceError) as e:
            record_from_json(bad, "t.jsonl", 7)
        assert e.value.render().startswith("t.jsonl:7: error: ")
        assert message in e.value.message


def test_sampled_tokens_form(good):
    rec = {k: v for k, v in good[0].items() if k not in ("logits_train", "logits_inf")}
    rec.update(tokens=[3, 5, 7], logprob_train=[-0.1, -0.2, -0.3], logprob_inf=[-0.1, -0.25, -0.3])
    r = record_from_json(rec)
    assert not r.has_logits and r.logprob_inf.shape == (3,)
    assert jsonschema.Draft202012Validator(load_schema()).is_valid(rec)


@pytest.mark.parametrize("case,line,message", [
    ("bad-json", 3, "not a JSON object"),
    ("missing-field", 2, "missing required field 'latency_ms'"),
    ("out-of-order", 4, "is earlier than line 3's"),
    ("duplicate", 5, "already has a record for kernel 'inf'"),
    ("nan", 2, "NaN is not valid JSON"),
])
def test_malformed_is_a_located_error(e5, good, tmp_path, capsys, case, line, message):
    rows: list = copy.deepcopy(good)
    if case == "bad-json":
        rows[2] = '{"request_id": "x", '
    elif case == "missing-field":
        del rows[1]["latency_ms"]
    elif case == "out-of-order":
        rows[3]["time"] = "2025-06-01T11:59:00Z"
    elif case == "duplicate":
        rows[4]["request_id"] = rows[0]["request_id"]
    elif case == "nan":
        rows[1] = json.dumps(rows[1]).replace(str(rows[1]["latency_ms"]), "NaN")
    path = write(tmp_path / f"{case}.jsonl", rows)
    for cmd in (["monitor", str(e5.contract), str(path), "--json"],
                ["promote", str(e5.contract), "--stage", "shadow", "--traces", str(path),
                 "--no-log"]):
        assert main(cmd) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"{path}:{line}: error: "), err
        assert message in err[0]


def test_skip_bad_counts_and_warns(e5, good, tmp_path, capsys):
    rows: list = copy.deepcopy(good)
    rows[1] = "not json"
    del rows[2]["time"]
    rows[4]["time"] = "2025-06-01T11:00:00Z"
    path = write(tmp_path / "mixed.jsonl", rows + [""])  # an empty line is ignored
    code = main(["monitor", str(e5.contract), str(path), "--json", "--skip-bad"])
    out = capsys.readouterr()
    body = json.loads(out.out)
    assert code == 0
    assert body["skipped"] == {"count": 3, "by_reason": {"json": 1, "schema": 1, "order": 1}}
    assert body["records"] == 3 and body["windows"][0]["skipped"] == 3
    warnings = out.err.strip().splitlines()
    assert warnings[0].startswith(f"{path}:2: warning: skipped (json)")
    assert warnings[-1] == f"{path}: warning: skipped 3 of 7 lines (json: 1, schema: 1, order: 1)"
    # a promotion never goes on skipped lines
    assert main(["promote", str(e5.contract), "--stage", "shadow", "--traces", str(path),
                 "--skip-bad", "--no-log"]) == 1
    assert "malformed trace lines were skipped" in capsys.readouterr().out


def test_not_utf8(e5, good, tmp_path, capsys):
    path = tmp_path / "bytes.jsonl"
    path.write_bytes(json.dumps(good[0]).encode() + b"\n\xff\xfe{}\n")
    assert main(["monitor", str(e5.contract), str(path)]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith(f"{path}:2: error: not UTF-8 text")
    assert main(["monitor", str(e5.contract), str(path), "--skip-bad", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["skipped"]["by_reason"] == {"json": 1}


def test_reader_streams_a_growing_file(good, tmp_path):
    path = tmp_path / "g.jsonl"
    path.write_text(json.dumps(good[0]) + "\n" + json.dumps(good[1])[:40])
    seen = []
    reader = TraceReader(path, follow=True, poll_s=0.01, idle_timeout=0.3)
    for rec in reader:
        seen.append(rec.request_id)
        if len(seen) == 1:  # finish the partial line while the reader waits
            with path.open("a") as f:
                f.write(json.dumps(good[1])[40:] + "\n")
    assert seen == [good[0]["request_id"], good[1]["request_id"]]


def test_times_and_durations():
    assert parse_time("2025-06-01T12:00:00Z") == parse_time("2025-06-01T14:00:00+02:00")
    assert parse_time("2025-06-01t12:00:00.1234567z").microsecond == 123456
    for bad in ("2025-06-01T12:00:00", "2025-06-01", "yesterday"):
        with pytest.raises(ValueError):
            parse_time(bad)
    assert parse_duration("300s") == parse_duration("5m") == parse_duration(300) == 300.0
    assert parse_duration("1.5h") == 5400.0 and parse_duration("250ms") == 0.25
    for bad in ("0s", "5 parsecs", "-3s"):
        with pytest.raises(KcverifyError):
            parse_duration(bad)
