"""The three renderings: JSON (fields, atomic write), the terminal table, the HTML page and its
inline SVG plots (parsed with html.parser; rendered by headless Chromium where present)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from kcverify.report import (
    BlockDrift,
    ClauseResult,
    Report,
    render_html,
    render_table,
    write_report_html,
    write_report_json,
)

sys.path.insert(0, str(Path(__file__).parent))
from sample import sample_report  # noqa: E402

CLAUSE_KEYS = {"id", "family", "verdict", "method", "bound", "threshold", "slice", "sample_size",
               "confidence", "level", "action", "action_taken", "value", "budget", "violations",
               "slices", "blocks", "metric", "direction", "note", "evidence", "rate_upper", "klass",
               "decided_by"}


def test_json_report(tmp_path: Path) -> None:
    path = write_report_json(sample_report(), tmp_path / "out" / "report.json")
    body = json.loads(path.read_text())
    assert body["format"] == "kcverify-report" and body["format_version"] == 1
    assert set(body) >= {"clauses", "health", "action", "ok", "counts", "blocks", "tool", "summary",
                         "verdict", "tally"}
    assert body["action"] == "fallback" and body["ok"] is False
    assert 0 <= body["health"] <= 1
    by_id = {c["id"]: c for c in body["clauses"]}
    assert set(by_id["S-FP8-1"]) == CLAUSE_KEYS
    s = by_id["S-FP8-1"]
    assert (s["verdict"], s["sample_size"], s["confidence"], s["action_taken"]) == \
        ("failed", 500, 0.95, "guard")
    assert [x["slice"] for x in s["slices"]] == ["all", "safety"]
    assert s["slices"][0]["upper"] == 0.18
    assert by_id["N-FP8-1"]["blocks"][3]["certified"] == 0.83
    assert list(tmp_path.joinpath("out").iterdir()) == [path]  # no temp file left
    assert path.read_text() == json.dumps(body, indent=2, sort_keys=True) + "\n"


def test_json_has_no_nan(tmp_path: Path) -> None:
    r = Report("c", "m", [ClauseResult("x", "numerical", "unknown", "ibp", value=float("nan"),
                                       bound=float("inf"))])
    body = json.loads(write_report_json(r, tmp_path / "r.json").read_text())
    assert body["clauses"][0]["value"] is None and body["clauses"][0]["bound"] == "inf"


def test_table_is_aligned() -> None:
    text = render_table(sample_report())
    lines = text.splitlines()
    header, rule = lines[0], lines[1]
    starts = [i for i, ch in enumerate(header) if ch != " " and (i == 0 or header[i - 1] == " ")]
    assert header.split() == ["CLAUSE", "FAMILY", "VERDICT", "BY", "VALUE", "COND", "CERTIFIED",
                              "RATE<=", "SLICE", "N", "CONF", "LEVEL", "ACTION"]
    verdict_col = starts[2]
    rows = [ln for ln in lines[2:] if ln and not ln.startswith(("  └",)) and "clauses:" not in ln]
    assert len(rows) == 6
    for ln in rows:
        assert ln[verdict_col - 2:verdict_col] == "  " and ln[verdict_col] != " "
    assert set(rule.replace(" ", "")) == {"-"}
    assert "S-FP8-1     statistical  failed   evidence" in text
    assert "0.031 (60/400)" in text and "(guard)" in text  # prescribed, not triggered on N-FP8-1
    assert lines[-1].startswith("6 clauses: 1 proved · 2 on evidence · 1 undecided · 2 failed; "
                                "verdict: violated") and "fallback" in lines[-1]


class _Collect(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []
        self.stack: list[str] = []
        self.svg_text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        if tag not in ("rect", "line"):  # self-closed in SVG
            self.stack.append(tag)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))

    def handle_endtag(self, tag: str) -> None:
        if tag in self.stack:
            while self.stack and self.stack.pop() != tag:
                pass

    def handle_data(self, data: str) -> None:
        self.text.append(data)
        if "svg" in self.stack:
            self.svg_text.append(data)


def _parse(html: str) -> _Collect:
    p = _Collect()
    p.feed(html)
    return p


def _with(p: _Collect, tag: str, cls: str) -> list[dict[str, str | None]]:
    return [a for t, a in p.tags if t == tag and cls in (a.get("class") or "").split()]


def test_html_page_structure_and_plots() -> None:
    html = render_html(sample_report())
    p = _parse(html)
    names = [t for t, _ in p.tags]
    assert names.count("svg") == 2
    assert "script" not in names and "link" not in names and "http" not in html.replace(
        'xmlns="http://www.w3.org/2000/svg"', "")
    certified = _with(p, "rect", "bar-certified")
    observed = _with(p, "rect", "bar-observed")
    data_cert = {a["data-block"]: float(a["data-value"]) for a in certified if a.get("data-block")}
    assert data_cert == {"embedding": 0.0021, "layer0": 0.052, "layer1": 0.31, "head": 0.83}
    assert len([a for a in observed if a.get("data-block")]) == 4
    # bar heights are ordered like the values (log scale keeps the order)
    heights = [float(a["height"]) for a in certified if a.get("data-block")]
    assert heights == sorted(heights)
    rates = {a["data-label"]: float(a["data-value"]) for a in _with(p, "rect", "bar-rate")}
    assert rates == {"S-FP8-1 / all": 0.15, "S-FP8-1 / safety": 0.03, "S-FP8-2 / all": 0.0}
    budgets = [float(a["data-value"]) for a in _with(p, "line", "budget") if a.get("data-value")]
    assert budgets == [0.05, 0.05, 0.01]
    assert len(_with(p, "rect", "bar-failed")) == 1 and len(_with(p, "rect", "bar-unknown")) == 1
    svg_text = " ".join(p.svg_text)
    assert "Certified vs observed drift per block" in svg_text and "20.2×" in svg_text
    assert "Exceedance per slice" in svg_text
    text = " ".join(p.text)
    for needle in ("S-FP8-1", "failed", "0.031 (60/400)", "0.18", "95%", "0.229", "on evidence"):
        assert needle in text
    rows = [a for t, a in p.tags if t == "tr" and a.get("class") == "clause"]
    assert [a["data-id"] for a in rows] == ["N-FP8-1", "N-FP8-2", "S-FP8-1", "S-FP8-2", "R-FP8-1",
                                            "S-FP8-3"]


def test_html_escapes_and_handles_empty() -> None:
    r = Report("<c>", "m", [ClauseResult("<script>x</script>", "numerical", "proved", "ibp")])
    html = render_html(r)
    assert "<script>" not in html and "&lt;script&gt;" in html
    assert "No per-block certificates" in html and "No empirical clause" in html


def test_linear_scale_for_close_values() -> None:
    r = Report("c", "m", [], blocks=[BlockDrift("a", 0.5, 0.4), BlockDrift("b", 1.0, 0.9)])
    html = render_html(r)
    assert "(log scale)" not in html
    p = _parse(html)
    h = {a["data-block"]: float(a["height"]) for a in _with(p, "rect", "bar-certified") if a.get("data-block")}
    assert h["b"] == pytest.approx(2 * h["a"], rel=0.02)  # linear axis from 0


CHROMIUM = next((c for c in ("/usr/bin/chromium", "/usr/bin/chromium-browser") if Path(c).exists()), None) \
    or shutil.which("chromium")


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed")
def test_html_renders_in_headless_chromium(tmp_path: Path) -> None:
    page = write_report_html(sample_report(), tmp_path / "report.html")
    png = tmp_path / "report.png"
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--window-size=1400,1100", f"--screenshot={png}", page.as_uri()],
                   check=True, capture_output=True, timeout=120)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1400, 1100)
    assert len(data) > 30_000  # a blank page compresses to a few KB; plots and table do not


def test_vacuous_bounds_are_drawn_not_broken() -> None:
    r = Report("c", "m", [], blocks=[BlockDrift("a", 5e-8, 0.0), BlockDrift("b", float("inf"), 0.26),
                                     BlockDrift("c", 35.0, 0.17)])
    html = render_html(r)
    assert "nan" not in html.lower()
    p = _parse(html)
    assert "∞" in " ".join(p.svg_text) and "206×" in " ".join(p.svg_text)
    for a in _with(p, "rect", "bar-certified"):
        assert float(a["height"]) >= 0 and float(a["y"]) >= 0
    ticks = [t for t, a in p.tags if t == "text" and a.get("class") == "tick"]
    assert len(ticks) <= 7  # ten decades, thinned


def test_one_drift_chart_per_slice() -> None:
    a = [BlockDrift("layer0", 0.5, 0.1), BlockDrift("head", 0.9, 0.2)]
    b = [BlockDrift("layer0", 0.7, 0.3), BlockDrift("head", 1.1, 0.4)]
    r = Report("c", "m", [
        ClauseResult("N-1", "numerical", "proved", "interval", slice="all", blocks=a),
        ClauseResult("N-2", "numerical", "proved", "interval", slice="all", blocks=a),
        ClauseResult("N-3", "numerical", "proved", "interval", slice="safety", blocks=b)], blocks=a)
    p = _parse(render_html(r))
    assert [t for t, _ in p.tags].count("svg") == 2  # one drift chart per slice (all, safety)
    titles = [t for t in p.svg_text if "drift per block" in t]
    assert any("Slice all" in t for t in titles) and any("Slice safety" in t for t in titles)
    assert len(_with(p, "rect", "bar-certified")) == 4 + 2  # 4 blocks + 2 legend swatches


def test_clauses_on_one_slice_merge_their_observations() -> None:
    r = Report("c", "m", [
        ClauseResult("N-1", "numerical", "unknown", "interval", slice="all",
                     blocks=[BlockDrift("layer0", 0.5, None)]),
        ClauseResult("N-2", "numerical", "unknown", "interval", slice="all",
                     blocks=[BlockDrift("layer0", 0.5, 0.2)])])
    p = _parse(render_html(r))
    obs = [float(a["data-value"]) for a in _with(p, "rect", "bar-observed") if a.get("data-block")]
    assert obs == [0.2]


def test_counterexample_evidence_is_shown() -> None:
    c = ClauseResult("N-1", "numerical", "refuted", "program-search",
                     evidence={"counterexample": {"input_index": 3, "position": 7, "value": 2.5}})
    p = _parse(render_html(Report("c", "m", [c])))
    assert "details" in [t for t, _ in p.tags]
    text = " ".join(p.text)
    assert "counterexample" in text and '"input_index": 3' in text


def test_json_accepts_numpy_values(tmp_path: Path) -> None:
    import numpy as np

    c = ClauseResult("S-1", "statistical", "passed", "clopper-pearson",
                     value=np.float64(0.5), sample_size=np.int64(100), violations=np.int32(0),
                     evidence={"per_input": np.array([0.1, 0.2]), "where": tmp_path})
    body = json.loads(write_report_json(Report("c", "m", [c], meta={"n": np.int64(3)}),
                                        tmp_path / "r.json").read_text())
    clause = body["clauses"][0]
    assert clause["sample_size"] == 100 and clause["evidence"]["per_input"] == [0.1, 0.2]
    assert clause["evidence"]["where"] == str(tmp_path) and body["meta"]["n"] == 3


def test_json_round_trip(tmp_path: Path) -> None:
    from kcverify.errors import InputFileError
    from kcverify.report.writer import read_report_json

    r = sample_report()
    r.clauses[0].blocks.append(BlockDrift("extra", float("inf"), 0.3))
    path = write_report_json(r, tmp_path / "r.json")
    back = read_report_json(path)
    assert back.to_json() == r.to_json()
    assert render_html(back) == render_html(r)
    (tmp_path / "bad.json").write_text('{"format": "something-else"}')
    with pytest.raises(InputFileError, match="bad.json: not a kcverify report"):
        read_report_json(tmp_path / "bad.json")
