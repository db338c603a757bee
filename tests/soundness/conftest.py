"""Report the soundness suite's totals: pairs drawn and the worst observed/certified ratio."""

from __future__ import annotations

import pytest


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    from tests.soundness._helpers import TOTAL

    if TOTAL["pairs"]:
        terminalreporter.write_line(
            f"soundness: {int(TOTAL['pairs'])} (input, realization) pairs checked; worst observed/"
            f"certified drift ratio {TOTAL['worst_ratio']:.4f}")
