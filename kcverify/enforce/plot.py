"""The monitor's HTML page: H over time with the health threshold and the action bands (the
paper's E5 figure), build changes with their detection lag, and one row per window.

Self-contained: inline SVG drawn here, the report's CSS (kcverify.report.page.CSS), no script.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from html import escape
from typing import Any

from kcverify import __version__
from kcverify.enforce.monitor import Summary, WindowResult
from kcverify.enforce.traces import format_time
from kcverify.fileio import atomic_write_text
from kcverify.report.page import CSS
from kcverify.report.svg import fmt

WIDTH, HEIGHT = 760, 300
PAD_L, PAD_R, PAD_T, PAD_B = 56, 16, 48, 44
BAND = {"none": "#e9f5ee", "log": "#dfeaf6", "warn": "#fbf0d9", "guard": "#f9dfb0",
        "fallback": "#f3b7ad", "block": "#d9827a"}
PLOT_CSS = """
.chart .h-line { fill: none; stroke: #2f4b7c; stroke-width: 2; }
.chart .h-dot { fill: #2f4b7c; }
.chart .threshold { stroke: #c0392b; stroke-width: 1.5; stroke-dasharray: 6 4; }
.chart .change { stroke: #1d2330; stroke-width: 1.5; stroke-dasharray: 2 3; }
.chart .lag { stroke: #1d2330; stroke-width: 1.2; }
"""


def health_chart(windows: Sequence[WindowResult], threshold: float,
                 changes: Sequence[dict[str, Any]] = ()) -> str:
    """H per window (a step line) over time, the threshold, and each window's action as a band."""
    if not windows:
        return '<p class="empty">No trace records.</p>'
    t0 = windows[0].start
    t_end = windows[-1].end
    span = max((t_end - t0).total_seconds(), 1e-9)
    x0, x1 = PAD_L, WIDTH - PAD_R
    top, bottom = PAD_T, HEIGHT - PAD_B

    def x(t: Any) -> float:
        return x0 + (t - t0).total_seconds() / span * (x1 - x0)

    def y(h: float) -> float:
        return bottom - h * (bottom - top)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" role="img" '
           f'aria-label="health score over time with action bands" viewBox="0 0 {WIDTH} '
           f'{HEIGHT}" width="{WIDTH}" height="{HEIGHT}">',
           '<title>H over time</title>',
           f'<text class="chart-title" x="{PAD_L}" y="18">Health score H per window '
           f'(0 compliant, 1 every clause at least 100 % over) and the routing action</text>']
    for w in windows:
        out.append(f'<rect class="band band-{escape(w.action)}" x="{x(w.start):.1f}" y="{top}" '
                   f'width="{max(x(w.end) - x(w.start), 0.5):.1f}" height="{bottom - top}" '
                   f'fill="{BAND.get(w.action, "#eeeeee")}" data-action="{escape(w.action)}">'
                   f'<title>{format_time(w.start)}: {w.action}, n = {w.n}</title></rect>')
    for h in (0.0, 0.25, 0.5, 0.75, 1.0):
        out.append(f'<line class="grid" x1="{x0}" x2="{x1}" y1="{y(h):.1f}" y2="{y(h):.1f}"/>'
                   f'<text class="tick" x="{x0 - 6}" y="{y(h) + 4:.1f}" text-anchor="end">'
                   f'{fmt(h, 2)}</text>')
    minutes = span / 60.0
    step = next(s for s in (1, 2, 5, 10, 15, 30, 60, 120, 240, 480, 1e9) if minutes / s <= 10)
    m = 0.0
    while m <= minutes + 1e-9:
        xx = x0 + m * 60.0 / span * (x1 - x0)
        out.append(f'<text class="tick" x="{xx:.1f}" y="{bottom + 16}" text-anchor="middle">'
                   f'{fmt(m, 4)}</text>')
        m += step
    out.append(f'<text class="axis-label" x="{(x0 + x1) / 2:.0f}" y="{HEIGHT - 8}" '
               f'text-anchor="middle">minutes since {escape(format_time(t0))}</text>')
    out.append(f'<text class="axis-label" transform="translate(14 {(top + bottom) / 2:.0f}) '
               f'rotate(-90)" text-anchor="middle">H</text>')
    out.append(f'<line class="axis" x1="{x0}" x2="{x0}" y1="{top}" y2="{bottom}"/>'
               f'<line class="axis" x1="{x0}" x2="{x1}" y1="{bottom}" y2="{bottom}"/>')
    yt = y(min(max(threshold, 0.0), 1.0))
    out.append(f'<line class="threshold" x1="{x0}" x2="{x1}" y1="{yt:.1f}" y2="{yt:.1f}" '
               f'data-value="{threshold!r}"><title>health threshold {fmt(threshold)}</title>'
               f'</line>')
    pts = []
    for w in windows:
        if w.health is None:
            continue
        pts.append(f"{x(w.start):.1f},{y(w.health):.1f} {x(w.end):.1f},{y(w.health):.1f}")
        out.append(f'<circle class="h-dot" cx="{(x(w.start) + x(w.end)) / 2:.1f}" '
                   f'cy="{y(w.health):.1f}" r="3" data-health="{w.health!r}">'
                   f'<title>{format_time(w.start)}: H = {fmt(w.health)}, {w.action}</title>'
                   f'</circle>')
    if pts:
        out.append(f'<polyline class="h-line" points="{" ".join(pts)}"/>')
    from kcverify.enforce.traces import parse_time

    for ch in changes:
        at = parse_time(ch["at"])
        xc = x(at)
        out.append(f'<line class="change" x1="{xc:.1f}" x2="{xc:.1f}" y1="{top - 6}" '
                   f'y2="{bottom}"/><text class="legend" x="{xc + 4:.1f}" y="{bottom - 6}">'
                   f'build {escape(str(ch["to"]))}</text>')
        if ch.get("detection_lag_s") is not None:
            xd = x(at) + ch["detection_lag_s"] / span * (x1 - x0)
            yl = top + 14
            out.append(f'<line class="lag" x1="{xc:.1f}" x2="{xd:.1f}" y1="{yl}" y2="{yl}"/>'
                       f'<line class="lag" x1="{xd:.1f}" x2="{xd:.1f}" y1="{yl - 5}" '
                       f'y2="{yl + 5}"/><text class="legend" x="{(xc + xd) / 2:.1f}" '
                       f'y="{yl - 4}" text-anchor="middle">lag {fmt(ch["detection_lag_s"], 4)} s'
                       f'</text>')
    lx = PAD_L + 4
    legend = []
    for act in ("none", "log", "guard", "fallback"):
        legend.append(f'<rect x="{lx}" y="27" width="10" height="10" fill="{BAND[act]}" '
                      f'stroke="#9aa3b2"/><text class="legend" x="{lx + 14}" y="36">{act}</text>')
        lx += 70
    legend.append(f'<line class="threshold" x1="{lx}" x2="{lx + 22}" y1="32" y2="32"/>'
                  f'<text class="legend" x="{lx + 26}" y="36">threshold {fmt(threshold)}</text>')
    out += legend
    out.append("</svg>")
    return "\n".join(out)


def _rows(windows: Sequence[WindowResult]) -> str:
    rows = []
    for w in windows:
        bad = ", ".join(f"{escape(c.id)} = {fmt(c.value)} ({c.direction} {fmt(c.threshold)})"
                        for c in w.violated) or "-"
        rows.append(f"<tr><td class=num>{w.index}</td><td>{escape(format_time(w.start))}</td>"
                    f"<td>{escape(', '.join(w.builds))}</td><td class=num>{w.n}</td>"
                    f"<td class=num>{fmt(w.health, 3)}</td><td>{escape(w.action)}</td>"
                    f"<td class=note>{bad}</td></tr>")
    return "\n".join(rows)


def render_monitor_html(contract: Any, summary: Summary, window_s: float, threshold: float,
                        traces: str) -> str:
    windows = summary.windows
    changes = summary.changes()
    acts = summary.to_json()["actions"]
    lag = next((c["detection_lag_s"] for c in changes if c["detection_lag_s"] is not None), None)
    hs = [w.health for w in windows if w.health is not None]
    cards = [("windows", str(len(windows)), ""),
             ("max H", fmt(max(hs), 3) if hs else "-", "bad" if hs and max(hs) > threshold
              else "good"),
             ("acting windows", str(sum(v for k, v in acts.items() if k != "none")),
              "bad" if any(k != "none" for k in acts) else "good"),
             ("detection lag", "-" if lag is None else f"{lag:.0f} s", "warn" if lag else "")]
    card_html = "".join(f'<div class="card {cls}"><div class="k">{escape(k)}</div>'
                        f'<div class="v">{escape(v)}</div></div>' for k, v, cls in cards)
    change_html = "".join(
        f"<li>build {escape(str(c['from']))} → {escape(str(c['to']))} at {escape(c['at'])} "
        f"(first record {escape(c['first_record'])}): "
        + ("not detected" if c["detection_lag_s"] is None else
           f"action {escape(str(c['action']))} after {c['detection_lag_s']:.0f} s")
        + "</li>" for c in changes) or "<li>no build change</li>"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>kcverify monitor: {escape(contract.name)}</title>
<style>{CSS}{PLOT_CSS}</style></head><body>
<h1>Monitor: {escape(contract.name)} {escape(contract.version)}</h1>
<div class="sub">{escape(traces)} · windows of {window_s:g} s from the first record ·
health threshold {fmt(threshold)}</div>
<div class="cards">{card_html}</div>
<h2>Health over time</h2>
{health_chart(windows, threshold, changes)}
<h2>Build changes</h2><ul>{change_html}</ul>
<h2>Windows</h2>
<table><tr><th>#</th><th>start</th><th>builds</th><th>n</th><th>H</th><th>action</th>
<th>violated clauses</th></tr>
{_rows(windows)}
</table>
<footer>kcverify {escape(__version__)} · kcverify monitor</footer>
</body></html>
"""


def write_monitor_html(path: str | os.PathLike[str], contract: Any, summary: Summary,
                       window_s: float, threshold: float, traces: str) -> None:
    atomic_write_text(path, render_monitor_html(contract, summary, window_s, threshold, traces))
