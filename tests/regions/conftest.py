"""Fixtures for the region tests (helpers.py has the data location and model builders)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.regions.helpers import acas_dir


@pytest.fixture(scope="session")
def acas() -> Path:
    p = acas_dir()
    if p is None:
        pytest.skip("ACAS Xu data not available (shared/data/acasxu)")
    return p
