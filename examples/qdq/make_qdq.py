"""Build the QDQ graphs of models/mlp_tiny.onnx that examples/contracts/mlp-*-qdq.yaml prove
(docs/qdq.md). Deterministic; run from the repository root:

    python examples/qdq/make_qdq.py

* mlp_tiny.fp8.qdq.onnx: kcverify.kernels.qdq.make_qdq_model, fp8_e4m3 weights per channel and
  fp8_e4m3 activations with static per-tensor scales calibrated on examples/data/mlp_points.npz;
* mlp_tiny.int8.qdq.onnx: onnxruntime.quantization.quantize_static in QDQ format, int8 weights
  per channel, int8 symmetric activations (MinMax calibration on the same points).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
MODEL = ROOT / "models" / "mlp_tiny.onnx"
POINTS = ROOT / "examples" / "data" / "mlp_points.npz"


def fp8() -> onnx.ModelProto:
    from kcverify.kernels.qdq import make_qdq_model
    from kcverify.kernels.spec import parse_kernel_spec
    from kcverify.models.ir import load_onnx

    spec = parse_kernel_spec("inf", {"weights": {"format": "fp8_e4m3", "scale": "per_channel"},
                                     "activations": {"format": "fp8_e4m3",
                                                     "scale": "dynamic_per_tensor"}})
    return make_qdq_model(load_onnx(MODEL), spec, calibration={"x": np.load(POINTS)["x"]})


def int8(out: Path) -> None:
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    class Points(CalibrationDataReader):
        def __init__(self) -> None:
            self.rows = iter(np.load(POINTS)["x"][:, None, :])

        def get_next(self) -> dict[str, np.ndarray] | None:
            x = next(self.rows, None)
            return None if x is None else {"x": x}

    quantize_static(str(MODEL), str(out), Points(), quant_format=QuantFormat.QDQ,
                    per_channel=True, activation_type=QuantType.QInt8,
                    weight_type=QuantType.QInt8,
                    extra_options={"ActivationSymmetric": True, "WeightSymmetric": True})


if __name__ == "__main__":
    onnx.save(fp8(), HERE / "mlp_tiny.fp8.qdq.onnx")
    int8(HERE / "mlp_tiny.int8.qdq.onnx")
    print("wrote", *sorted(p.name for p in HERE.glob("*.qdq.onnx")))
