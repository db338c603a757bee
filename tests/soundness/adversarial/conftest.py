"""The adversarial suite's summary: per attack class, pairs tried, violations, worst ratios."""

from __future__ import annotations

import pytest


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    from tests.soundness.adversarial.harness import SESSION

    if SESSION.classes:
        terminalreporter.section("adversarial soundness: per attack class")
        for line in SESSION.report().splitlines():
            terminalreporter.write_line(line)
