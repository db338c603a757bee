"""Operands whose interval is not finite are outside the SMT encoding (NotEncodable, so the
planner moves on), never an exception from converting infinity to a rational."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest

from kcverify.cli import main
from kcverify.kernels.spec import parse_kernel_spec
from kcverify.models.ir import load_onnx
from kcverify.smt import NotEncodable
from kcverify.smt.encode import prepare

ROOT = Path(__file__).resolve().parents[2]


def test_infinite_operand_interval_is_not_encodable() -> None:
    """fp8 activations into an fp16 accumulator: 448^2 > 65504, the first layer's interval is
    infinite, and the second layer's cast would need a scale from an infinite amax."""
    g = load_onnx(ROOT / "models" / "mlp_tiny.onnx")
    train = parse_kernel_spec("train", {"compute": "fp32", "accumulate": "fp32"})
    inf = parse_kernel_spec("inf", {
        "weights": {"format": "fp8_e4m3", "scale": "per_channel"},
        "activations": {"format": "fp8_e4m3", "scale": "dynamic_per_tensor"},
        "accumulate": "fp16", "compute": "fp16"})
    with pytest.raises(NotEncodable, match="not finite"):
        prepare(g, train, inf, np.array([[0.5, -0.25, 1.0, 0.125]], np.float32))


def test_unexpected_exception_is_the_internal_error_exit(monkeypatch, capsys) -> None:
    """An exception no command anticipated is a bug: the internal-error exit code with the
    traceback, not exit 1 (a verdict) and not 2 (bad input)."""
    from kcverify import cli

    def boom(args: argparse.Namespace) -> int:
        raise ZeroDivisionError("synthetic")

    class Parser:
        def parse_args(self, argv: list[str]) -> argparse.Namespace:
            return argparse.Namespace(func=boom)

    monkeypatch.setattr(cli, "build_parser", Parser)
    assert main(["anything"]) == cli.INTERNAL_EXIT
    err = capsys.readouterr().err
    assert "ZeroDivisionError" in err and "internal error" in err
