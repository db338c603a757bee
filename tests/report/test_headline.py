"""Honest headlines: a certifiable clause decided on evidence reads as such in the terminal
summary, the HTML headline and the JSON report; the certified bound and the violation-rate
bound are separate columns."""

from __future__ import annotations

import json
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from kcverify.empirical.escalation import escalate
from kcverify.report import ClauseResult, Report, render_html, render_table, write_report_json
from kcverify.report.model import decided_by_default

sys.path.insert(0, str(Path(__file__).parent))
from sample import sample_report  # noqa: E402

INF = float("inf")


def demo_like() -> Report:
    """The shape of `./dev demo` today: four certifiable clauses with a vacuous certified bound,
    passed on a handful of sampled programs; a soft statistical clause; runtime; static."""
    ev = dict(verdict="passed", method="empirical-fallback (program-search)", klass="certifiable")
    clauses = [
        ClauseResult("N-FP8-1", "numerical", value=0.2534, bound=INF, threshold=1.0, slice="all",
                     sample_size=8, level="L2", **ev),
        ClauseResult("N-FP8-SAFE-1", "numerical", value=0.2711, bound=INF, threshold=1.0,
                     slice="safety", sample_size=4, level="L3", **ev),
        ClauseResult("N-FP8-SAFE-2", "numerical", value=0.75, bound=0.0, threshold=0.6,
                     direction=">=", slice="safety", sample_size=4, level="L3", **ev),
        ClauseResult("N-FP8-2", "numerical", value=0.1547, bound=INF, threshold=2.0, slice="all",
                     sample_size=8, level="L2", **ev),
        ClauseResult("S-FP8-1", "statistical", "passed", "clopper-pearson", value=0.0016,
                     bound=INF, rate_upper=0.04573, threshold=0.02, slice="sample",
                     sample_size=64, confidence=0.95, budget=0.05, level="L2",
                     klass="certifiable"),
        ClauseResult("R-FP8-1", "runtime", "passed", "clopper-pearson", value=0.37,
                     rate_upper=0.04573, threshold=50.0, slice="all", sample_size=64,
                     confidence=0.95, budget=0.05, level="L1", klass="empirical"),
        ClauseResult("O-FP8-1", "observability", "passed", "static", level="L1", klass="static"),
    ]
    return escalate(Report("fp8-deploy", "tiny_decoder.onnx", clauses,
                           escalation={"L1": "log", "L2": "guard", "L3": "fallback"}))


def all_proved() -> Report:
    clauses = [
        ClauseResult("N-1", "numerical", "proved", "bound-best", value=0.1, bound=0.1,
                     threshold=0.25, slice="points", sample_size=64, klass="certifiable"),
        ClauseResult("S-1", "statistical", "passed", "clopper-pearson", value=0.1,
                     rate_upper=0.046, threshold=0.5, slice="points", sample_size=64,
                     confidence=0.95, budget=0.05, klass="empirical"),
    ]
    return escalate(Report("mlp", "mlp.onnx", clauses))


class _Cards(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.cards: dict[str, tuple[str, str]] = {}
        self._card: tuple[str, str] | None = None
        self._in_v = False
        self.by: dict[str, str] = {}
        self.caveat = ""
        self._in_caveat = False
        self.headers: list[str] = []
        self._in_th = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        cls = (a.get("class") or "").split()
        if tag == "div" and "card" in cls:
            self._card = (a.get("data-k") or "", " ".join(cls))
        if tag == "div" and "v" in cls and self._card:
            self._in_v = True
        if tag == "tr" and "clause" in cls:
            self.by[a["data-id"] or ""] = a.get("data-by") or ""
        if tag == "p" and "caveat" in cls:
            self._in_caveat = True
        self._in_th = tag == "th"

    def handle_endtag(self, tag: str) -> None:
        if tag == "p":
            self._in_caveat = False
        if tag == "th":
            self._in_th = False

    def handle_data(self, data: str) -> None:
        if self._in_v and self._card:
            self.cards[self._card[0]] = (data, self._card[1])
            self._in_v, self._card = False, None
        if self._in_caveat:
            self.caveat += data
        if self._in_th:
            self.headers.append(data)


def test_terminal_summary_says_on_evidence() -> None:
    text = render_table(demo_like())
    last = [ln for ln in text.splitlines() if ln.startswith("7 clauses")][0]
    assert last.startswith("7 clauses: 0 proved · 6 on evidence · 1 static · 0 failed; "
                           "verdict: holds on evidence;")
    assert "certifiable, not proved: N-FP8-1 (evidence), N-FP8-SAFE-1 (evidence)" in text
    row = next(ln for ln in text.splitlines() if ln.startswith("N-FP8-1 "))
    assert row.split()[2:6] == ["passed", "evidence", "0.2534", "<="]
    assert "proved" not in row


def test_bound_columns_say_which_bound() -> None:
    lines = render_table(demo_like()).splitlines()
    header = lines[0]
    cert, rate = header.index("CERTIFIED"), header.index("RATE<=")

    def cell(line: str, at: int) -> str:
        return line[at:].split()[0]
    rows = {ln.split()[0]: ln for ln in lines[2:9]}
    assert cell(rows["N-FP8-1"], cert) == "∞" and cell(rows["N-FP8-1"], rate) == "-"
    assert cell(rows["S-FP8-1"], cert) == "∞" and cell(rows["S-FP8-1"], rate) == "0.0457"
    assert cell(rows["R-FP8-1"], cert) == "-" and cell(rows["R-FP8-1"], rate) == "0.0457"


def test_html_headline_is_not_a_green_holds() -> None:
    p = _Cards()
    p.feed(render_html(demo_like()))
    verdict, cls = p.cards["verdict"]
    assert verdict == "holds on evidence" and "warn" in cls and "good" not in cls
    assert p.cards["clauses"][0] == "0 proved · 6 on evidence · 1 static · 0 failed"
    assert p.by["N-FP8-1"] == "evidence" and p.by["O-FP8-1"] == "static"
    assert "N-FP8-1 (on evidence)" in p.caveat and "not on a proof" in p.caveat
    assert "certified bound" in p.headers and "rate ≤" in p.headers and "bound" not in p.headers
    q = _Cards()
    q.feed(render_html(all_proved()))
    assert q.cards["verdict"][0] == "holds" and "good" in q.cards["verdict"][1]
    assert q.caveat == ""


def test_json_report_per_clause_decided_by(tmp_path: Path) -> None:
    body = json.loads(write_report_json(demo_like(), tmp_path / "r.json").read_text())
    assert body["verdict"] == "holds on evidence"
    assert body["summary"] == "0 proved · 6 on evidence · 1 static · 0 failed"
    assert body["tally"] == {"proved": 0, "on evidence": 6, "static": 1, "undecided": 0,
                             "failed": 0}
    by = {c["id"]: (c["verdict"], c["decided_by"], c["klass"]) for c in body["clauses"]}
    assert by["N-FP8-1"] == ("passed", "evidence", "certifiable")
    assert by["O-FP8-1"] == ("passed", "static", "static")
    s1 = next(c for c in body["clauses"] if c["id"] == "S-FP8-1")
    assert s1["bound"] == "inf" and s1["rate_upper"] == 0.04573
    assert json.loads(write_report_json(all_proved(), tmp_path / "p.json").read_text())[
        "verdict"] == "holds"


def test_decided_by_defaults_and_validation() -> None:
    assert decided_by_default("proved", "bound-best") == "proof"
    assert decided_by_default("refuted", "program-search") == "counterexample"
    assert decided_by_default("passed", "static") == "static"
    assert decided_by_default("failed", "clopper-pearson") == "evidence"
    assert decided_by_default("unknown", "none") == "undecided"
    with pytest.raises(ValueError, match="decided_by 'luck'"):
        ClauseResult("x", "numerical", "passed", "m", decided_by="luck")
    # a stored report without the new fields reads back with them derived
    r = sample_report()
    assert [c.decided_by for c in r.clauses] == ["proof", "counterexample", "evidence",
                                                 "evidence", "evidence", "undecided"]
    assert r.headline() == ("violated", "bad")


def test_report_schema_states_the_new_fields() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    from kcverify.api import schema
    from kcverify.report.writer import report_json

    body = report_json(demo_like())
    v = jsonschema.Draft202012Validator(schema("report"))
    v.validate(body)
    body["clauses"][0]["decided_by"] = "luck"
    with pytest.raises(jsonschema.ValidationError):
        v.validate(body)
    del body["clauses"][0]["decided_by"]
    with pytest.raises(jsonschema.ValidationError):
        v.validate(body)
