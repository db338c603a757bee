"""certify_drift on a model whose output's axis 0 is not the sample axis (brief item: a
seq-first torch-exported TransformerEncoderLayer output, (seq, batch, d) from a (batch, seq, d)
input). The output's sample axis is not tracked through the layer, so every sample is given the
max over the whole output (engine._per_sample_linf): a (batch,) linf, no numpy shape error."""

from __future__ import annotations

import io

import numpy as np
import onnx
import torch

from kcverify.bounds import certify_drift
from kcverify.kernels.spec import parse_kernel_spec
from kcverify.models.ir import from_onnx


class _SeqFirstOut(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32,
                                                      dropout=0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, seq, d) -> (seq, batch, d)
        return self.layer(x.transpose(0, 1))


def test_output_axis_0_is_not_the_batch() -> None:
    torch.manual_seed(0)
    f = io.BytesIO()
    torch.onnx.export(_SeqFirstOut().eval(), (torch.randn(2, 6, 16),), f, dynamo=True,
                      opset_version=18, input_names=["x"], output_names=["y"], verbose=False)
    g = from_onnx(onnx.load_from_string(f.getvalue()))
    train = parse_kernel_spec("train", {"compute": "fp32", "accumulate": "fp32"})
    inf = parse_kernel_spec("inf", {"compute": "bf16", "accumulate": "fp32"})
    x = np.random.default_rng(0).standard_normal((2, 6, 16)).astype(np.float32)
    res = certify_drift(g, train, inf, {"x": x}, domain="interval")
    y = res.outputs["y"]
    assert y.shape == (6, 2, 16) and res.linf.shape == (2,)
    whole = float(np.max(np.maximum(np.abs(y.drift_lo), np.abs(y.drift_hi))))
    assert np.all(res.linf == whole)
