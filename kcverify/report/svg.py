"""Inline SVG charts for the HTML report, written by hand (no plotting library, no script).

Two charts: certified against observed drift per block (grouped bars, log scale when the values
span more than two decades), and exceedance per slice (observed violation rate as a bar, its
one-sided upper confidence bound as a whisker, the budget as a dashed line).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

from kcverify.report.model import BlockDrift, ClauseResult, Verdict

WIDTH = 640
PAD_L, PAD_R, PAD_T, PAD_B = 64, 16, 44, 96


def fmt(x: float | None, digits: int = 4) -> str:
    """A number in ``digits`` significant digits ("-" for None, "∞" for infinity)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if math.isinf(x):
        return "∞" if x > 0 else "-∞"
    if x == 0:
        return "0"
    return f"{x:.{digits}g}"


def _nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    span = hi - lo
    if span <= 0:
        return [lo]
    raw = span / count
    mag = 10 ** math.floor(math.log10(raw))
    step = min((m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw), default=raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


@dataclass
class _Axis:
    lo: float
    hi: float
    log: bool
    top: float
    bottom: float

    def y(self, v: float) -> float:
        if self.log:
            v = math.log10(max(v, 10 ** self.lo))
        frac = (v - self.lo) / (self.hi - self.lo) if self.hi > self.lo else 0.0
        return self.bottom - frac * (self.bottom - self.top)

    def ticks(self) -> list[tuple[float, str]]:
        if self.log:
            decades = [e for e in range(math.floor(self.lo), math.ceil(self.hi) + 1) if self.lo <= e <= self.hi]
            every = max(1, math.ceil(len(decades) / 6))
            return [(10.0**e, fmt(10.0**e, 2)) for e in decades[::-1][::every][::-1]]
        return [(t, fmt(t, 3)) for t in _nice_ticks(self.lo, self.hi)]


def _frame(height: int, axis: _Axis, title: str, ylabel: str, label: str) -> list[str]:
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" role="img" '
           f'aria-label="{escape(label)}" viewBox="0 0 {WIDTH} {height}" width="{WIDTH}" '
           f'height="{height}">',
           f'<title>{escape(title)}</title>',
           f'<text class="chart-title" x="{PAD_L}" y="18">{escape(title)}</text>']
    for v, text in axis.ticks():
        y = axis.y(v)
        out.append(f'<line class="grid" x1="{PAD_L}" x2="{WIDTH - PAD_R}" y1="{y:.1f}" y2="{y:.1f}"/>')
        out.append(f'<text class="tick" x="{PAD_L - 6}" y="{y + 4:.1f}" text-anchor="end">{escape(text)}</text>')
    out.append(f'<line class="axis" x1="{PAD_L}" x2="{PAD_L}" y1="{axis.top}" y2="{axis.bottom}"/>')
    out.append(f'<line class="axis" x1="{PAD_L}" x2="{WIDTH - PAD_R}" y1="{axis.bottom}" y2="{axis.bottom}"/>')
    out.append(f'<text class="axis-label" transform="translate(14 {(axis.top + axis.bottom) / 2:.0f}) '
               f'rotate(-90)" text-anchor="middle">{escape(ylabel)}</text>')
    return out


def _fits(text: str, slot: float) -> bool:
    return len(text if len(text) <= 22 else text[:22]) * 6.2 <= slot * 0.95


def _pad_bottom(labels: Sequence[str], slot: float) -> int:
    """Room under the axis: one text line when every label fits its slot, else slanted labels."""
    return 40 if all(_fits(t, slot) for t in labels) else PAD_B


def _xlabel(x: float, y: float, text: str, slot: float) -> str:
    """A category label under its bar: horizontal when it fits its slot, else slanted."""
    short = text if len(text) <= 22 else text[:21] + "…"
    if _fits(text, slot):
        return (f'<text class="xlabel" x="{x:.1f}" y="{y + 2:.1f}" text-anchor="middle">'
                f'{escape(short)}<title>{escape(text)}</title></text>')
    return (f'<text class="xlabel" x="{x + 4:.1f}" y="{y:.1f}" text-anchor="end" '
            f'transform="rotate(-35 {x + 4:.1f} {y:.1f})">{escape(short)}<title>{escape(text)}</title></text>')


def drift_chart(blocks: Sequence[BlockDrift], height: int = 320,
                title: str = "Certified vs observed drift per block") -> str:
    """Grouped bars per block: certified drift bound (dark) and the largest drift observed."""
    rows = [b for b in blocks if b.certified is not None or b.observed is not None]
    if not rows:
        return '<p class="empty">No per-block certificates in this run.</p>'
    vals = [v for b in rows for v in (b.certified, b.observed) if v is not None and v > 0 and math.isfinite(v)]
    vmax = max(vals) if vals else 1.0
    vmin = min(vals) if vals else 1.0
    log = vmax / vmin > 100
    slot = (WIDTH - PAD_L - PAD_R) / len(rows)
    height -= PAD_B - _pad_bottom([b.block for b in rows], slot)
    bottom = height - _pad_bottom([b.block for b in rows], slot)
    if log:
        axis = _Axis(math.floor(math.log10(vmin)), math.ceil(math.log10(vmax)), True, PAD_T + 10, bottom)
    else:
        axis = _Axis(0.0, vmax * 1.15, False, PAD_T + 10, bottom)
    title = title + (" (log scale)" if log else "")
    out = _frame(height, axis, title, "max |z_inf − z_train|", "certified versus observed drift per block")
    bw = min(28.0, slot * 0.36)
    for i, b in enumerate(rows):
        cx = PAD_L + slot * (i + 0.5)
        for j, (cls, v) in enumerate((("bar-certified", b.certified), ("bar-observed", b.observed))):
            if v is None:
                continue
            x = cx - bw + j * bw
            top = axis.y(v) if v > 0 and math.isfinite(v) else (axis.top if v and v > 0 else axis.bottom)
            h = max(axis.bottom - top, 0.5)
            what = "certified bound" if j == 0 else "observed drift"
            out.append(f'<rect class="{cls}" x="{x:.1f}" y="{axis.bottom - h:.1f}" width="{bw:.1f}" '
                       f'height="{h:.1f}" data-block="{escape(b.block)}" data-value="{v!r}">'
                       f'<title>{escape(b.block)}: {what} {fmt(v)}</title></rect>')
        if b.certified is not None and math.isinf(b.certified):
            out.append(f'<text class="ratio" x="{cx - bw / 2:.1f}" y="{axis.top - 3:.1f}" '
                       f'text-anchor="middle">∞</text>')
        elif b.certified and b.observed and b.observed > 0:
            ratio = b.certified / b.observed
            out.append(f'<text class="ratio" x="{cx:.1f}" y="{axis.y(b.certified) - 4:.1f}" '
                       f'text-anchor="middle">{fmt(ratio, 3)}×</text>')
        out.append(_xlabel(cx, axis.bottom + 14, b.block, slot))
    lx = PAD_L
    out.append(f'<rect class="bar-certified" x="{lx}" y="27" width="10" height="10"/>'
               f'<text class="legend" x="{lx + 14}" y="36">certified bound</text>'
               f'<rect class="bar-observed" x="{lx + 120}" y="27" width="10" height="10"/>'
               f'<text class="legend" x="{lx + 134}" y="36">observed drift (ratio above: certified / observed)</text>')
    out.append("</svg>")
    return "\n".join(out)


@dataclass(frozen=True)
class ExceedanceBar:
    label: str
    rate: float
    upper: float | None
    budget: float | None
    verdict: str


def exceedance_bars(clauses: Sequence[ClauseResult]) -> list[ExceedanceBar]:
    """One bar per (clause, slice) that has a violation rate."""
    bars = []
    for c in clauses:
        for s in c.slices:
            if s.rate is None or not s.n:
                continue
            bars.append(ExceedanceBar(f"{c.id} / {s.slice}", s.rate, s.upper, s.budget,
                                      Verdict(s.verdict).value))
    return bars


def exceedance_chart(clauses: Sequence[ClauseResult], height: int = 320) -> str:
    """Per slice: observed violation rate (bar), upper confidence bound (whisker), budget (dashed)."""
    bars = exceedance_bars(clauses)
    if not bars:
        return '<p class="empty">No empirical clause with per-slice exceedance in this run.</p>'
    top = max([b.rate for b in bars] + [b.upper or 0 for b in bars] + [b.budget or 0 for b in bars])
    slot = (WIDTH - PAD_L - PAD_R) / len(bars)
    height -= PAD_B - _pad_bottom([b.label for b in bars], slot)
    axis = _Axis(0.0, max(top * 1.15, 0.01), False, PAD_T + 10,
                 height - _pad_bottom([b.label for b in bars], slot))
    out = _frame(height, axis, "Exceedance per slice", "violation rate",
                 "exceedance rate per slice against its budget")
    bw = min(40.0, slot * 0.5)
    for i, b in enumerate(bars):
        cx = PAD_L + slot * (i + 0.5)
        y = axis.y(b.rate)
        h = max(axis.bottom - y, 0.5)
        cls = {"failed": "bar-failed", "passed": "bar-passed"}.get(b.verdict, "bar-unknown")
        out.append(f'<rect class="bar-rate {cls}" x="{cx - bw / 2:.1f}" y="{axis.bottom - h:.1f}" '
                   f'width="{bw:.1f}" height="{h:.1f}" data-label="{escape(b.label)}" '
                   f'data-value="{b.rate!r}"><title>{escape(b.label)}: rate {fmt(b.rate)}, '
                   f'upper bound {fmt(b.upper)}, budget {fmt(b.budget)} ({b.verdict})</title></rect>')
        if b.upper is not None:
            yu = axis.y(b.upper)
            out.append(f'<line class="whisker" x1="{cx:.1f}" x2="{cx:.1f}" y1="{y:.1f}" y2="{yu:.1f}"/>'
                       f'<line class="whisker" x1="{cx - 6:.1f}" x2="{cx + 6:.1f}" y1="{yu:.1f}" y2="{yu:.1f}"/>')
        if b.budget is not None:
            yb = axis.y(b.budget)
            out.append(f'<line class="budget" x1="{cx - slot * 0.42:.1f}" x2="{cx + slot * 0.42:.1f}" '
                       f'y1="{yb:.1f}" y2="{yb:.1f}" data-value="{b.budget!r}">'
                       f'<title>budget {fmt(b.budget)}</title></line>')
        out.append(f'<text class="value" x="{cx:.1f}" y="{min(y, axis.y(b.upper or 0)) - 5:.1f}" '
                   f'text-anchor="middle">{fmt(b.rate, 3)}</text>')
        out.append(_xlabel(cx, axis.bottom + 14, b.label, slot))
    lx = PAD_L
    out.append(f'<rect class="bar-passed" x="{lx}" y="27" width="10" height="10"/>'
               f'<text class="legend" x="{lx + 14}" y="36">violation rate k/n</text>'
               f'<line class="whisker" x1="{lx + 130}" x2="{lx + 130}" y1="25" y2="39"/>'
               f'<text class="legend" x="{lx + 136}" y="36">upper confidence bound</text>'
               f'<line class="budget" x1="{lx + 280}" x2="{lx + 304}" y1="32" y2="32"/>'
               f'<text class="legend" x="{lx + 310}" y="36">budget</text>')
    out.append("</svg>")
    return "\n".join(out)
