"""Reports: the plain dataclasses the planner fills (model), and three renderings of them:
JSON (writer), the terminal table (table), and a self-contained HTML page with SVG plots (page)."""

from __future__ import annotations

from kcverify.report.model import BlockDrift, ClauseResult, Report, SliceResult, Verdict
from kcverify.report.page import render_html, write_report_html
from kcverify.report.table import render_table
from kcverify.report.writer import read_report_json, report_json, write_report_json

__all__ = ["BlockDrift", "ClauseResult", "Report", "SliceResult", "Verdict", "read_report_json",
           "render_html", "render_table", "report_json", "write_report_html", "write_report_json"]
