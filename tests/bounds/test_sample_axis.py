"""The sample axis of a dynamic per-sample scale (issue 11, violation 3).

``dynamic_per_tensor`` is one scale per *sample*. The sample axis is axis 0 of the model's
inputs and is tracked through the graph (kcverify.models.blocks.sample_axes), never assumed to be
axis 0 of a MatMul operand: torch exports attention seq-first, where axis 0 is the position. The
bound grouped per position there, and a program with one scale per sample reached 1.43x the
certified bound on a torch-exported nn.TransformerEncoderLayer.
"""

from __future__ import annotations

import io

import ml_dtypes
import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from kcverify.bounds import certify_drift
from kcverify.kernels.realize import run_kernel
from kcverify.kernels.spec import parse_kernel_spec
from kcverify.models.blocks import UNKNOWN, sample_axes, segment
from kcverify.models.ir import from_onnx

FP32 = parse_kernel_spec("train", {"compute": "fp32", "accumulate": "fp32"})
FP8 = parse_kernel_spec("inf", {
    "weights": {"format": "fp8_e4m3", "scale": "per_channel"},
    "activations": {"format": "fp8_e4m3", "scale": "dynamic_per_tensor"},
    "accumulate": "fp32", "compute": "fp32"})


def _seq_first_matmul(b: int, s: int, d: int, n: int, w: np.ndarray):
    """x (b, s, d) batch-first -> Transpose -> (s, b, d) -> MatMul W: the operand's axis 0 is the
    position, its sample axis is 1."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [b, s, d])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [s, b, n])
    nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2]),
             helper.make_node("MatMul", ["xt", "w"], ["y"])]
    graph = helper.make_graph(nodes, "seqfirst", [x], [y],
                              [numpy_helper.from_array(w.astype(np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return from_onnx(onnx.shape_inference.infer_shapes(model))


def _fp8(t: np.ndarray) -> np.ndarray:
    return t.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def _per_sample_program(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Independent of kcverify: one fp32 scale per sample (axis 0 of the model input), fp8
    casts (ml_dtypes), unscaled products summed in float32, rescaled once."""
    xt = np.transpose(x, (1, 0, 2))  # (s, b, d)
    amax = np.abs(xt).max(axis=(0, 2), keepdims=True).astype(np.float32)
    s = (np.maximum(amax, np.float32(1e-12)) / np.float32(448)).astype(np.float32)
    q = _fp8((xt / s).astype(np.float32))
    sw = (np.abs(w).max(axis=0) / np.float32(448)).astype(np.float32)
    qw = _fp8((w / sw).astype(np.float32))
    acc = np.zeros(xt.shape[:2] + (w.shape[1],), np.float32)
    for j in range(w.shape[0]):
        acc = (acc + (q[..., j:j + 1] * qw[j]).astype(np.float32)).astype(np.float32)
    return (acc.astype(np.float64) * (s.astype(np.float64) * sw.astype(np.float64))
            ).astype(np.float32).astype(np.float64)


@pytest.mark.parametrize("batch", [1, 2])
def test_per_sample_scale_on_a_seq_first_operand(batch: int) -> None:
    rng = np.random.default_rng(batch)
    s, d, n = 6, 8, 3
    w = rng.standard_normal((d, n)).astype(np.float32)
    g = _seq_first_matmul(batch, s, d, n, w)
    assert sample_axes(g)["xt"] == 1 and sample_axes(g)["y"] == 1
    x = rng.standard_normal((batch, s, d)).astype(np.float32)
    x[:, 0, :] *= 40.0  # one loud position: per-position and per-sample scales differ
    box = certify_drift(g, FP32, FP8, {"x": x}, domain="interval").outputs["y"]
    y = _per_sample_program(x, w)
    assert np.all(box.inf_lo <= y) and np.all(y <= box.inf_hi)
    yt = run_kernel(g, FP32, {"x": x})["y"].numpy()
    assert np.all(box.drift_lo <= y - yt) and np.all(y - yt <= box.drift_hi)
    # the realizer groups by the same axis
    yi = run_kernel(g, FP8, {"x": x}, order="pairwise")["y"].numpy()
    assert np.all(box.inf_lo <= yi) and np.all(yi <= box.inf_hi)


class _Encoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64,
                                                      dropout=0.0)
        self.head = torch.nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (batch, seq, 32); seq-first inside
        return self.head(self.layer(x.transpose(0, 1)).transpose(0, 1))


@pytest.fixture(scope="module")
def encoder():
    torch.manual_seed(0)
    model = _Encoder().eval()
    f = io.BytesIO()
    torch.onnx.export(model, (torch.randn(1, 6, 32),), f, dynamo=True, opset_version=18,
                      input_names=["x"], output_names=["y"], verbose=False)
    return from_onnx(onnx.load_from_string(f.getvalue()))


def test_torch_encoder_layer_per_sample_scales_inside(encoder) -> None:
    """A torch-exported TransformerEncoderLayer (batch 1, seq-first inside): the attention's
    operands have no usable sample axis after the heads reshape, so with one sample each is one
    group; programs with one scale per sample (the realizer, bound to the graph) lie inside the
    certified sets, value and drift, in several orders."""
    axes = sample_axes(encoder)
    first = next(n for n in encoder.nodes if n.op_type == "MatMul")
    assert axes[first.inputs[0]] == 1  # (seq, batch, d) after the exporter's transpose
    assert UNKNOWN in axes.values()
    x = np.random.default_rng(3).standard_normal((1, 6, 32)).astype(np.float32)
    x[0, 2] *= 30.0
    box = certify_drift(encoder, FP32, FP8, {"x": x}, domain="interval").outputs["y"]
    for order in ("sequential", "pairwise", "reverse"):
        yt = run_kernel(encoder, FP32, {"x": x}, order=order)["y"].numpy()
        yi = run_kernel(encoder, FP8, {"x": x}, order=order)["y"].numpy()
        assert np.all(box.train_lo <= yt) and np.all(yt <= box.train_hi), order
        assert np.all(box.inf_lo <= yi) and np.all(yi <= box.inf_hi), order
        d = yi - yt
        assert np.all(box.drift_lo <= d) and np.all(d <= box.drift_hi), order


def test_blocks_carry_their_inputs_sample_axes(encoder) -> None:
    """A block alone cannot tell which axis of an intermediate tensor is the sample: segment()
    records each block input's axis in the whole model."""
    axes = sample_axes(encoder)
    for b in segment(encoder):
        assert dict(b.sample_axes) == {i: axes[i] for i in b.inputs}


def _product(op: str, x_shape: tuple, w: np.ndarray, x_first: bool, **attrs) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    ins = ["x", "w"] if x_first else ["w", "x"]
    g = helper.make_graph([helper.make_node(op, ins, ["y"], name="p", **attrs)], "g", [x], [y],
                          [numpy_helper.from_array(w, "w")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("op,x_shape,w_shape,x_first,attrs,contracts", [
    ("MatMul", (6, 2), (4, 6), False, {}, True),            # W x: sums over x's samples
    ("MatMul", (2, 6), (6, 4), True, {}, False),            # x W: one row per sample
    ("Gemm", (6, 2), (6, 4), True, {"transA": 1}, True),    # x' W
    ("Gemm", (6, 2), (4, 6), False, {}, True),              # W x: x's k axis is its samples
    ("Gemm", (2, 6), (4, 6), True, {"transB": 1}, False),   # x W'
])
def test_contraction_over_samples_is_refused(op, x_shape, w_shape, x_first, attrs,
                                             contracts) -> None:
    """A product that sums over the samples of a batched activation under a dynamic per-sample
    scale is refused with one line (each term of a dot product carries another sample's scale:
    the enclosures disagreed, InternalError); with the samples on a free axis, or with weights
    alone cast, the same product is bounded."""
    from kcverify.errors import BoundError

    rng = np.random.default_rng(0)
    w = (rng.normal(size=w_shape) * 0.5).astype(np.float32)
    x = rng.normal(size=x_shape).astype(np.float32)
    g = from_onnx(_product(op, x_shape, w, x_first, **attrs))
    if contracts:
        with pytest.raises(BoundError, match="contracts over the sample axis") as e:
            certify_drift(g, FP32, FP8, {"x": x}, domain="interval")
        assert "\n" not in str(e.value)
    else:
        certify_drift(g, FP32, FP8, {"x": x}, domain="interval")
    w8 = parse_kernel_spec("inf", {"weights": {"format": "fp8_e4m3", "scale": "per_channel"},
                                   "accumulate": "fp32", "compute": "fp32"})
    certify_drift(g, FP32, w8, {"x": x}, domain="interval")  # no activation scale: bounded
