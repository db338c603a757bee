"""Shared fixtures: the E5 traces (40 minutes, a kernel fault at minute 20, drift x50 after a
build change), generated once per session from the example contract with real kernels."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from kcverify.enforce.synthetic import FaultPlan, split_at, synthetic_traces

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = ROOT / "examples" / "traces" / "contract.yaml"
MODEL = ROOT / "models" / "mlp_tiny.onnx"


@dataclass(frozen=True)
class E5:
    contract: Path
    model: Path
    traces: Path
    clean: Path
    faulty: Path
    fault_at: str
    summary: dict


@pytest.fixture(scope="session")
def e5(tmp_path_factory: pytest.TempPathFactory) -> E5:
    d = tmp_path_factory.mktemp("e5")
    summary = synthetic_traces(CONTRACT, d / "traces.jsonl", FaultPlan())
    split_at(d / "traces.jsonl", summary["fault_at"], d / "clean.jsonl", d / "faulty.jsonl")
    return E5(CONTRACT, MODEL, d / "traces.jsonl", d / "clean.jsonl", d / "faulty.jsonl",
              summary["fault_at"], summary)


@pytest.fixture(scope="session")
def held_out(tmp_path_factory: pytest.TempPathFactory) -> E5:
    """Other traces with their own fault: 30 minutes, fault at minute 13 (inside a window), x20
    drift, another seed, a different rate and start time."""
    d = tmp_path_factory.mktemp("heldout")
    plan = FaultPlan(minutes=30, fault_at=13, factor=20, rate=17, seed=7,
                     start="2024-12-31T23:58:30.250+01:00", build="b-7", fault_build="b-8")
    summary = synthetic_traces(CONTRACT, d / "traces.jsonl", plan)
    split_at(d / "traces.jsonl", summary["fault_at"], d / "clean.jsonl", d / "faulty.jsonl")
    return E5(CONTRACT, MODEL, d / "traces.jsonl", d / "clean.jsonl", d / "faulty.jsonl",
              summary["fault_at"], summary)
