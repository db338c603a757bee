"""Per-block drift: certified from a bound run, observed from concrete runs; observed <= certified."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from kcverify.empirical.blocks import (
    block_drifts,
    certified_block_drift,
    check_observed_within,
    observed_block_drift,
)
from kcverify.report.model import BlockDrift


@dataclass
class Box:
    drift_lo: np.ndarray
    drift_hi: np.ndarray


@dataclass
class Rec:
    name: str
    out_state: dict


def test_certified_from_records() -> None:
    recs = [Rec("a", {"t": Box(np.array([-0.1, 0.0]), np.array([0.05, 0.2]))}),
            Rec("b", {"u": Box(np.array([-0.7]), np.array([0.3])), "v": Box(np.array([0.0]), np.array([0.9]))})]
    assert certified_block_drift(recs) == {"a": 0.2, "b": 0.9}


def test_rows_and_soundness_check() -> None:
    rows = block_drifts({"a": 0.2, "b": 0.9}, {"a": 0.1, "b": 1.0, "c": 0.3})
    assert rows == [BlockDrift("a", 0.2, 0.1), BlockDrift("b", 0.9, 1.0), BlockDrift("c", None, 0.3)]
    assert check_observed_within(rows) == ["b"]


def test_observed_within_certified_on_example_mlp(root: Path) -> None:
    from kcverify.bounds import blocks_of, certify_drift
    from kcverify.kernels.spec import parse_kernel_spec
    from kcverify.models.ir import load_onnx

    model = root / "models" / "mlp_small.onnx"
    if not model.exists():
        pytest.skip("no example MLP")
    graph = load_onnx(model)
    train = parse_kernel_spec("train", {"compute": "fp32", "accumulate": "fp32"})
    inf = parse_kernel_spec("inf", {"weights": {"format": "fp8_e4m3", "scale": "per_channel"},
                                    "activations": {"format": "fp8_e4m3", "scale": "dynamic_per_tensor"},
                                    "accumulate": "fp32", "compute": "fp32"})
    shape = [int(d) if isinstance(d, int) or str(d).isdigit() else 3 for d in graph.inputs[0].shape]
    feeds = {graph.inputs[0].name: np.random.default_rng(0).normal(size=shape).astype(np.float32)}
    blocks = blocks_of(graph)
    cert = certified_block_drift(certify_drift(graph, train, inf, feeds, blocks=blocks).blocks)
    for choices in ({}, {"order": "pairwise", "rounding": "up"}, {"order": "random", "seed": 5}):
        obs = observed_block_drift(graph, blocks, train, inf, feeds, **choices)
        rows = block_drifts(cert, obs)
        assert check_observed_within(rows) == [], rows
        assert any(r.observed and r.observed > 0 for r in rows)
