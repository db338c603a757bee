"""The bound engine never bounds a kernel given as a second ONNX graph as if it were the model:
before the joint graph existed, certify_drift certified the fp32 drift of the model under a QDQ
inference kernel (1.4e-5 on mlp_tiny, where onnxruntime realizes 0.18)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kcverify.bounds import bound_block, certify_drift
from kcverify.bounds.engine import blocks_of
from kcverify.errors import BoundError
from kcverify.kernels.spec import parse_kernel_spec
from kcverify.models.ir import load_onnx

ROOT = Path(__file__).resolve().parents[2]


def test_certify_drift_refuses_a_second_graph() -> None:
    g = load_onnx(ROOT / "models" / "mlp_tiny.onnx")
    train = parse_kernel_spec("train", {"compute": "fp32"})
    inf = parse_kernel_spec("inf", {"compute": "fp32", "onnx": "mlp_tiny.qdq.onnx"})
    x = np.zeros((1, 4), np.float32)
    with pytest.raises(BoundError, match="second ONNX graph"):
        certify_drift(g, train, inf, {"x": x})
    with pytest.raises(BoundError, match="second ONNX graph"):
        bound_block(blocks_of(g)[0], train, inf, {}, domain="interval")
