"""A scratch copy of a shipped model with the example contracts and data beside it, as the
relative paths in examples/contracts expect (prove writes its certificate next to the model)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def workspace(tmp_path: Path) -> Callable[[str, str], tuple[Path, Path]]:
    """workspace(model_file, contract_file) -> (model, contract) paths inside tmp_path."""

    def make(model_file: str, contract_file: str) -> tuple[Path, Path]:
        (tmp_path / "models").mkdir(exist_ok=True)
        shutil.copy(ROOT / "models" / model_file, tmp_path / "models")
        for sub in ("data", "contracts"):
            if not (tmp_path / "examples" / sub).exists():
                shutil.copytree(ROOT / "examples" / sub, tmp_path / "examples" / sub)
        return tmp_path / "models" / model_file, tmp_path / "examples" / "contracts" / contract_file
    return make
