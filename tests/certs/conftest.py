"""Fixtures: a fake two-block engine and a certificate through every built-in rule."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from kcverify.certs.testing import FakeEngine, example_certificate


@pytest.fixture(scope="session")
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture(scope="session")
def _example(tmp_path_factory: pytest.TempPathFactory, engine: FakeEngine) -> tuple[Any, ...]:
    return example_certificate(tmp_path_factory.mktemp("example"), engine)


@pytest.fixture()
def example(_example: tuple[Any, ...], tmp_path: Path) -> tuple[Path, Path, dict[str, Any], dict[str, Any]]:
    """(model, contract, kernel specs, statement): fresh copies (with the slice data data.npz
    beside the contract) each test may edit."""
    model, contract, specs, stmt = _example
    m, c = tmp_path / "model.onnx", tmp_path / "contract.yaml"
    m.write_bytes(model.read_bytes())
    c.write_bytes(contract.read_bytes())
    data = contract.parent / "data.npz"
    if data.exists():  # (kcverify.certs.testing writes it; kept optional to run on older code)
        (tmp_path / "data.npz").write_bytes(data.read_bytes())
    return m, c, specs, copy.deepcopy(stmt)
