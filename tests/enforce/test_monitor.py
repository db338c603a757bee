"""kcverify monitor: per-window clause values, H and the routing action (the E5 must-show)."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from kcverify.cli import main
from kcverify.enforce.traces import parse_time

ACTING = ("guard", "fallback")


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    code = main(["monitor", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def check_e5(body: dict, traces: Path, fault_at: str, window_s: float) -> None:
    """No action in windows wholly before the fault; guard or fallback in every window that
    holds a faulty record; H higher after the fault than before."""
    times = [parse_time(json.loads(ln)["time"]) for ln in traces.read_text().splitlines()]
    first = times[0]
    fault = next(t for t in times if t >= parse_time(fault_at))  # the first faulty record
    windows = body["windows"]
    assert windows, "no windows"
    before, after = [], []
    for k, w in enumerate(windows):
        start, end = parse_time(w["start"]), parse_time(w["end"])
        assert start == first + timedelta(seconds=k * window_s)  # aligned to the first record
        assert (end - start).total_seconds() == window_s
        assert w["action"] in ("none", "log", "warn", "guard", "fallback", "block")
        (before if end <= fault else after).append(w)  # after: holds a faulty record
    assert before and after
    assert all(w["action"] == "none" for w in before), [w["action"] for w in before]
    assert all(w["action"] in ACTING for w in after if w["n"]), [w["action"] for w in after]
    h_before = max(w["health"] for w in before)
    h_after = min(w["health"] for w in after if w["n"])
    assert h_before == 0.0 and h_after > h_before


def test_e5_monitor_json(e5, capsys):
    code, body = run_json(capsys, str(e5.contract), str(e5.traces), "--window", "300s")
    assert code == 1  # some window violated a clause
    assert len(body["windows"]) == 8
    check_e5(body, e5.traces, e5.fault_at, 300.0)
    w0 = body["windows"][0]
    ids = [c["id"] for c in w0["clauses"]]
    assert ids == ["N-SRV-1", "N-SRV-2", "S-SRV-1", "S-SRV-2", "R-SRV-1", "O-TRACE"]
    for c in w0["clauses"]:
        assert c["verdict"] == "passed" and c["deviation"] == 0.0 and c["value"] is not None
    w5 = body["windows"][5]
    n1 = next(c for c in w5["clauses"] if c["id"] == "N-SRV-1")
    assert n1["verdict"] == "failed" and n1["value"] > 50 * 0.05 and n1["deviation"] == 1.0
    assert w5["flagged"] and w5["flagged"][0]["where"].startswith(str(e5.traces))
    change = body["summary"]["build_changes"][0]
    assert change["from"] == "2025.06-r1" and change["to"] == "2025.06-r2"
    assert 0 < change["detection_lag_s"] <= 300.0


def test_e5_held_out_fault_inside_a_window(held_out, capsys):
    """Another trace file (fault at minute 13, x20, another seed and rate): same contract."""
    code, body = run_json(capsys, str(held_out.contract), str(held_out.traces), "--window",
                          "5m")
    assert code == 1
    check_e5(body, held_out.traces, held_out.fault_at, 300.0)
    code, body = run_json(capsys, str(held_out.contract), str(held_out.traces), "--window",
                          "120s")
    check_e5(body, held_out.traces, held_out.fault_at, 120.0)


def test_clean_half_no_action_exit_0(e5, capsys):
    code, body = run_json(capsys, str(e5.contract), str(e5.clean))
    assert code == 0
    assert {w["action"] for w in body["windows"]} == {"none"}


def test_table_and_html(e5, tmp_path, capsys):
    html = tmp_path / "e5.html"
    code = main(["monitor", str(e5.contract), str(e5.traces), "--window", "300s", "--html",
                 str(html)])
    out = capsys.readouterr().out
    assert code == 1
    lines = [ln for ln in out.splitlines() if ln[:4].strip().isdigit()]
    assert len(lines) == 8
    assert all(" none " in ln for ln in lines[:4]) and all(" fallback " in ln for ln in lines[4:])
    assert "build 2025.06-r1 -> 2025.06-r2 at 2025-06-01T12:20:00.492Z: detected after" in out
    page = html.read_text()
    assert page.count('class="band band-') == 8
    assert page.count('data-action="fallback"') == 4 and 'class="threshold"' in page
    assert 'class="change"' in page and "lag " in page and "<script" not in page


def test_follow_a_growing_file(e5, tmp_path, capsys):
    """--follow reads lines as they are appended (a partial line waits for its newline)."""
    lines = e5.clean.read_text().splitlines(keepends=True)[:400]
    live = tmp_path / "live.jsonl"
    live.write_text("".join(lines[:100]))

    def writer() -> None:
        with live.open("a") as f:
            for ln in lines[100:]:
                half = len(ln) // 2
                f.write(ln[:half])
                f.flush()
                time.sleep(0.001)
                f.write(ln[half:])
                f.flush()

    t = threading.Thread(target=writer)
    t.start()
    code = main(["monitor", str(e5.contract), str(live), "--follow", "--json", "--poll", "0.02",
                 "--idle-timeout", "1.5"])
    t.join()
    out = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    windows, summary = out[:-1], out[-1]["summary"]
    assert code == 0
    assert [w["index"] for w in windows] == list(range(len(windows)))
    assert sum(w["n"] for w in windows) == 400 == summary["records"]
    assert all(w["complete"] for w in windows[:-1]) and not windows[-1]["complete"]
