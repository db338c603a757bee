"""The self-contained HTML report: inline CSS, inline SVG plots, no script, no external asset."""

from __future__ import annotations

import json
import os
from html import escape
from pathlib import Path

from kcverify import __version__
from kcverify.fileio import atomic_write_text
from kcverify.report.model import BlockDrift, ClauseResult, Report, Verdict
from kcverify.report.svg import drift_chart, exceedance_chart, fmt

CSS = """
:root { --ink: #1d2330; --muted: #5b6475; --line: #d9dee7; --bg: #f6f7fa; --card: #fff;
  --pass: #1f8a4c; --fail: #c0392b; --unk: #b7791f; --cert: #2f4b7c; --obs: #7fb3d5; }
* { box-sizing: border-box; }
body { margin: 0; padding: 28px 36px; font: 14px/1.45 system-ui, -apple-system, "Segoe UI",
  Roboto, "DejaVu Sans", sans-serif; color: var(--ink); background: var(--bg); }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 28px 0 10px; }
.sub { color: var(--muted); margin-bottom: 18px; }
.cards { display: flex; gap: 14px; flex-wrap: wrap; }
.card { background: var(--card); border: 1px solid var(--line); border-radius: 8px;
  padding: 12px 16px; min-width: 150px; }
.card .k { color: var(--muted); font-size: 12px; text-transform: uppercase; letter-spacing: .04em; }
.card .v { font-size: 22px; font-weight: 600; margin-top: 2px; }
.card.bad .v { color: var(--fail); } .card.good .v { color: var(--pass); }
.card.warn .v { color: var(--unk); }
.by { display: inline-block; margin-left: 4px; padding: 0 6px; border-radius: 10px;
  font-size: 11px; border: 1px solid var(--line); color: var(--muted); white-space: nowrap; }
.by.evidence, .by.undecided { border-color: var(--unk); color: var(--unk); }
table { border-collapse: collapse; width: 100%; background: var(--card);
  border: 1px solid var(--line); border-radius: 8px; overflow: hidden; }
th, td { padding: 7px 10px; text-align: left; border-bottom: 1px solid var(--line);
  vertical-align: top; }
th { background: #eef1f6; font-size: 12px; color: var(--muted); text-transform: uppercase;
  letter-spacing: .03em; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
tr.slice td { background: #fafbfd; color: var(--muted); font-size: 13px; }
tr.slice td:first-child { padding-left: 26px; }
.badge { display: inline-block; padding: 1px 8px; border-radius: 10px; font-size: 12px;
  font-weight: 600; color: #fff; white-space: nowrap; }
.badge.proved, .badge.passed { background: var(--pass); }
.badge.refuted, .badge.failed { background: var(--fail); }
.badge.unknown { background: var(--unk); }
.note { color: var(--muted); font-size: 12px; max-width: 420px; }
.act-on { color: var(--fail); font-weight: 600; } .act-off { color: var(--muted); }
.chart { background: var(--card); border: 1px solid var(--line); border-radius: 8px;
  display: block; margin: 0 0 12px; max-width: 100%; height: auto; }
.chart text { font: 11px system-ui, "DejaVu Sans", sans-serif; fill: var(--ink); }
.chart .chart-title { font-size: 13px; font-weight: 600; }
.chart .tick, .chart .axis-label, .chart .legend { fill: var(--muted); }
.chart .grid { stroke: #edf0f5; } .chart .axis { stroke: #9aa3b2; }
.chart .bar-certified { fill: var(--cert); } .chart .bar-observed { fill: var(--obs); }
.chart .bar-passed { fill: #6cc08b; } .chart .bar-failed { fill: #e07b6f; }
.chart .bar-unknown { fill: #e3b55d; }
.chart .whisker { stroke: var(--ink); stroke-width: 1.5; }
.chart .budget { stroke: var(--fail); stroke-width: 2; stroke-dasharray: 6 4; }
.chart .ratio { fill: var(--cert); font-weight: 600; }
.plots { display: flex; flex-wrap: wrap; gap: 0 24px; }
.empty { color: var(--muted); font-style: italic; }
details summary { cursor: pointer; color: var(--cert); font-size: 12px; }
details pre { font-size: 11px; background: #f3f5f9; padding: 6px; border-radius: 4px;
  max-width: 420px; overflow-x: auto; }
footer { margin-top: 28px; color: var(--muted); font-size: 12px; }
.caveat { margin: 14px 0 0; padding: 8px 12px; border-left: 3px solid var(--unk);
  background: #fff8ea; max-width: 900px; }
"""


def _badge(v: Verdict | str) -> str:
    v = Verdict(v)
    return f'<span class="badge {v.value}">{escape(v.value)}</span>'


def _evidence(c: ClauseResult) -> str:
    """The clause's evidence (e.g. a replayed counterexample) as collapsible JSON, no script."""
    if not c.evidence:
        return ""
    body = json.dumps(c.evidence, indent=1, sort_keys=True, default=str)
    what = ", ".join(sorted(c.evidence))
    return f'<details><summary>{escape(what)}</summary><pre>{escape(body)}</pre></details>'


BY_WORDS = {"proof": "by proof", "counterexample": "by counterexample", "evidence": "on evidence",
            "static": "static check", "undecided": "undecided"}


def _by(c: ClauseResult) -> str:
    by = c.decided_by or "undecided"
    return f'<span class="by {escape(by)}" data-by="{escape(by)}">{escape(BY_WORDS[by])}</span>'


def _clause_rows(c: ClauseResult) -> str:
    act = (f'<span class="act-on">{escape(c.action_taken)}</span>' if c.violated else
           f'<span class="act-off">{escape(c.action or "-")}</span>')
    cond = "-" if c.threshold is None else f"{escape(c.direction)} {fmt(c.threshold)}"
    conf = "-" if c.confidence is None else f"{c.confidence:.0%}"
    what = escape(c.metric or c.method)
    rows = [f'<tr class="clause" data-id="{escape(c.id)}" data-by="{escape(c.decided_by or "")}">'
            f'<td><b>{escape(c.id)}</b><br>'
            f'<span class="note">{escape(c.family)} · {what}</span></td>'
            f'<td>{_badge(c.verdict)}{_by(c)}</td><td class="num">{fmt(c.value)}</td>'
            f'<td class="num">{cond}</td><td class="num">{fmt(c.bound)}</td>'
            f'<td class="num">{fmt(c.rate_upper, 3)}</td><td>{escape(c.method)}</td>'
            f'<td>{escape(c.slice or "-")}</td>'
            f'<td class="num">{"-" if c.sample_size is None else c.sample_size}</td>'
            f'<td class="num">{conf}</td><td>{escape(c.level or "-")}</td><td>{act}</td>'
            f'<td class="note">{"" if c.slices else escape(c.note)}{_evidence(c)}</td></tr>']
    for s in c.slices:
        counted = "" if s.violations is None else f" ({s.violations}/{s.n})"
        rows.append(f'<tr class="slice"><td>└ {escape(s.slice)}</td><td>{_badge(s.verdict)}</td>'
                    f'<td class="num">{fmt(s.value)}{counted}</td>'
                    f'<td class="num">{"-" if s.budget is None else "budget " + fmt(s.budget)}</td>'
                    f'<td></td><td class="num">{"-" if s.upper is None else fmt(s.upper, 3)}</td>'
                    f'<td></td><td>{escape(s.slice)}</td><td class="num">{s.n}</td><td></td><td></td>'
                    f'<td></td><td class="note">{escape(s.note)}</td></tr>')
    return "\n".join(rows)


def _drift_charts(report: Report) -> str:
    """One chart per slice whose clauses carry block drifts (else the report's own blocks)."""
    groups: dict[str, dict[str, BlockDrift]] = {}
    for c in report.clauses:
        merged = groups.setdefault(c.slice or c.id, {}) if c.blocks else None
        for b in c.blocks:  # clauses on one slice share its blocks: merge what each observed
            have = merged.setdefault(b.block, BlockDrift(b.block, b.certified, b.observed, b.kind))
            if have.certified is None:
                have.certified = b.certified
            if b.observed is not None and (have.observed is None or b.observed > have.observed):
                have.observed = b.observed
    if not groups:
        return drift_chart(report.blocks)
    if len(groups) == 1:
        (name, rows), = groups.items()
        return drift_chart(list(rows.values()),
                           title=f"Certified vs observed drift per block, slice {name}")
    return "\n".join(drift_chart(list(rows.values()),
                                 title=f"Slice {name}: certified vs observed drift per block")
                     for name, rows in groups.items())


def render_html(report: Report, title: str | None = None) -> str:
    """The whole page as one string."""
    health = "-" if report.health is None else f"{report.health:.3f}"
    title = title or f"kcverify report: {report.contract}"
    verdict, tone = report.headline()
    cards = [
        ("verdict", verdict, tone),
        ("health H", health, "good" if (report.health or 0) <= 1e-3 else "bad" if report.ok is False else ""),
        ("action", report.action, "bad" if report.action != "none" else "good"),
        ("clauses", report.summary(), tone),
    ]
    card_html = "".join(f'<div class="card {cls}" data-k="{escape(k)}"><div class="k">{escape(k)}</div>'
                        f'<div class="v">{escape(v)}</div></div>' for k, v, cls in cards)
    head = ("<tr><th>clause</th><th>verdict</th><th>value</th><th>condition</th>"
            '<th title="certified bound on the clause\'s quantity">certified bound</th>'
            '<th title="upper confidence bound on the violation rate">rate ≤</th>'
            "<th>method</th><th>slice</th><th>n</th><th>conf.</th><th>level</th><th>action</th>"
            "<th>evidence</th></tr>")
    open_ = [c for c in report.clauses if c.on_evidence]
    caveat = ""
    if open_:
        ids = ", ".join(f"{c.id} ({BY_WORDS[c.decided_by or 'undecided']})" for c in open_)
        caveat = (f'<p class="caveat" data-k="not-proved">Certifiable but not proved: '
                  f"{escape(ids)}. Their certified bounds miss the threshold; their verdicts rest "
                  "on the evidence shown (sampled programs or measurements), not on a proof.</p>")
    rows = "\n".join(_clause_rows(c) for c in report.clauses)
    policy = ", ".join(f"{k}: {v}" for k, v in sorted(report.escalation.items())) or "-"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{escape(title)}</title>
<style>{CSS}</style></head>
<body>
<h1>{escape(title)}</h1>
<div class="sub">contract <code>{escape(report.contract)}</code> · model <code>{escape(report.model)}</code>
 · escalation {escape(policy)}</div>
<div class="cards">{card_html}</div>
{caveat}
<h2>Clauses</h2>
<table class="clauses"><thead>{head}</thead><tbody>
{rows}
</tbody></table>
<div class="plots">
<section><h2>Drift per block</h2>
{_drift_charts(report)}</section>
<section><h2>Exceedance per slice</h2>
{exceedance_chart(report.clauses)}</section>
</div>
<footer>kcverify {escape(__version__)} · action in red: triggered by a violated clause; grey:
prescribed by the clause's level, not triggered. Certified bound: the bound the certificate
proves on the clause's quantity (∞: vacuous). Rate ≤: one-sided Clopper-Pearson bound on a soft
clause's violation rate; a bar's whisker is its upper bound, the dashed line its budget.</footer>
</body></html>
"""


def write_report_html(report: Report, path: str | os.PathLike[str]) -> Path:
    """Write the HTML page atomically; returns the path."""
    return atomic_write_text(path, render_html(report))
