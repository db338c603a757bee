"""Realizations of whole models: the FP8 kernel of the tiny decoder differs from fp32, and its
first MLP MatMul equals a hand-written numpy + ml_dtypes reference bit for bit."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

from kcverify.kernels.realize import Realization, run_kernel
from kcverify.kernels.spec import parse_kernel_spec
from kcverify.models.executor import Executor
from kcverify.models.ir import load_onnx

ROOT = Path(__file__).resolve().parents[2]
DECODER = ROOT / "models" / "tiny_decoder.onnx"
pytestmark = pytest.mark.skipif(not DECODER.exists(), reason="models/tiny_decoder.onnx not built")

TRAIN = parse_kernel_spec("train", {"compute": "fp32", "accumulate": "fp32"})
FP8 = parse_kernel_spec("inf", {
    "weights": {"format": "fp8_e4m3", "scale": "per_channel"},
    "activations": {"format": "fp8_e4m3", "scale": "dynamic_per_tensor"},
    "accumulate": "fp32", "compute": "bf16"})


@pytest.fixture(scope="module")
def decoder():  # noqa: ANN201
    return load_onnx(DECODER)


@pytest.fixture(scope="module")
def ids() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, size=(2, 12))


def test_fp8_realization_differs_from_fp32(decoder, ids: np.ndarray) -> None:  # noqa: ANN001
    exact = Executor(decoder, dtype=torch.float64).run({"input_ids": ids})["logits"]
    train = run_kernel(decoder, TRAIN, {"input_ids": ids}, order="pairwise")["logits"]
    inf = run_kernel(decoder, FP8, {"input_ids": ids}, order="random", seed=1)["logits"]
    assert torch.isfinite(inf).all()
    scale = exact.abs().max()
    assert (train - exact).abs().max() < 1e-5 * scale  # fp32 kernels stay close to exact
    drift = (inf - train).abs().max()
    assert drift > 1e-3 * scale  # fp8 casts move the logits
    assert drift < 0.5 * scale  # ... but it is still the same model
    again = run_kernel(decoder, FP8, {"input_ids": ids}, order="random", seed=1)["logits"]
    assert torch.equal(inf, again)
    # another conforming program: other order, every op result rounded at random within its ulps
    other = run_kernel(decoder, FP8, {"input_ids": ids}, order="chunked", chunk=8,
                       rounding="random", seed=2)["logits"]
    assert torch.isfinite(other).all() and not torch.equal(other, inf)
    assert (other - inf).abs().max() < 0.1 * scale


def _fp8_grid() -> np.ndarray:
    v = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return np.unique(v[np.isfinite(v)])  # sorted; ml_dtypes' decoding of every code


def _rne_grid(q: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Nearest grid value, ties to the even code (float64 quotients of float32 numbers never sit
    within 2^-49 of a midpoint unless on it, so float64 comparisons decide exactly)."""
    q = np.clip(q, grid[0], grid[-1])  # saturating cast
    i = np.clip(np.searchsorted(grid, q), 1, len(grid) - 1)
    lo, hi = grid[i - 1], grid[i]
    lo_even = lo.astype(np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8) % 2 == 0
    mid = (lo + hi) / 2
    out = np.where(q < mid, lo, hi)
    return np.where(q == mid, np.where(lo_even, lo, hi), out)


def _bf16_rne_exact(values: list[Fraction]) -> np.ndarray:
    """Round exact rationals to bfloat16, nearest-even, via float32 bit patterns."""
    out = []
    for v in values:
        c = np.float32(float(v))  # within a float32 ulp of v: the bf16 neighbours bracket it
        bits = int(np.array(abs(c), dtype=np.float32).view(np.uint32))
        lo_bits = bits & ~0xFFFF
        lo = Fraction(float(np.array(lo_bits, dtype=np.uint32).view(np.float32)))
        step = Fraction(float(np.array(lo_bits + 0x10000, dtype=np.uint32).view(np.float32))) - lo
        a = abs(v)
        while lo > a:
            lo -= step
        while lo + step < a:
            lo += step
        hi = lo + step
        if a - lo < hi - a:
            r = lo
        elif a - lo > hi - a:
            r = hi
        else:  # tie: the even bf16 pattern
            r = lo if ((int(np.array(float(lo), dtype=np.float32).view(np.uint32)) >> 16) % 2 == 0) else hi
        out.append(float(r) if v >= 0 else -float(r))
    return np.array(out)


def test_first_mlp_matmul_equals_hand_reference(decoder, ids: np.ndarray) -> None:  # noqa: ANN001
    node = next(n for n in decoder.nodes if n.op_type == "MatMul"
                and decoder.info(n.inputs[1]).shape == (64, 256))  # the first MLP up-projection
    x_name, w_name = node.inputs
    ex = Executor(decoder, dtype=torch.float64, arithmetic=Realization(FP8, order="sequential"))
    env = ex.run({"input_ids": ids}, keep=True)
    x = env[x_name].numpy()  # what the kernel feeds the MatMul (already bf16 values)
    y = env[node.outputs[0]].numpy()
    w = decoder.initializers[w_name].astype(np.float64)
    grid = _fp8_grid()
    # weights: per output channel (last axis) scale fl32(amax / 448)
    sw = (np.abs(w).max(axis=0, keepdims=True) / 448.0).astype(np.float32).astype(np.float64)
    qw = _rne_grid(w / sw, grid)
    # activations: one scale per sample over all its entries
    sx = (np.abs(x).max(axis=(1, 2), keepdims=True) / 448.0).astype(np.float32).astype(np.float64)
    qx = _rne_grid(x / sx, grid)
    # products of fp8 values are float32-exact; accumulate left to right in float32
    acc = np.zeros((x.shape[0], x.shape[1], w.shape[1]), dtype=np.float32)
    for k in range(w.shape[0]):
        acc = (acc + (qx[:, :, k, None] * qw[None, None, k, :]).astype(np.float32)).astype(np.float32)
    exact = [Fraction(float(a)) * Fraction(float(b)) * Fraction(float(c)) for a, b, c in
             zip(np.broadcast_to(sx, acc.shape).ravel(), np.broadcast_to(sw, acc.shape).ravel(),
                 acc.ravel())]
    ref = _bf16_rne_exact(exact).reshape(acc.shape)
    assert np.array_equal(y, ref)
    # and the cast really mattered: the unquantized product is different
    assert not np.allclose(y, x @ w, rtol=1e-3, atol=0)


def test_conv_model_through_the_executor() -> None:
    from onnx import TensorProto, helper, numpy_helper

    from kcverify.models.ir import from_onnx

    rng = np.random.default_rng(3)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[1, 1, 1, 1], strides=[2, 2])
    graph = helper.make_graph([node], "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    g = from_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    exact = Executor(g, dtype=torch.float64).run({"x": x})["y"]
    train = run_kernel(g, TRAIN, {"x": x}, order="random", seed=2)["y"]
    inf = run_kernel(g, FP8, {"x": x}, order="random", seed=2)["y"]
    assert exact.shape == train.shape == inf.shape == (2, 4, 4, 4)
    assert (train - exact).abs().max() <= 1e-5 * exact.abs().max()
    assert (inf - exact).abs().max() > 1e-3 * exact.abs().max()
    assert (inf - exact).abs().max() < 0.2 * exact.abs().max()


def test_a_samples_result_never_depends_on_its_batch(decoder) -> None:  # noqa: ANN001
    rng = np.random.default_rng(4)
    ids = rng.integers(0, 256, size=(2, 8))
    other = ids.copy()
    other[1] = rng.integers(0, 256, size=8)
    choices = dict(order="random", rounding="random", seed=9)
    a = run_kernel(decoder, FP8, {"input_ids": ids}, **choices)["logits"]
    b = run_kernel(decoder, FP8, {"input_ids": other}, **choices)["logits"]
    alone = run_kernel(decoder, FP8, {"input_ids": ids[:1]}, **choices)["logits"]
    assert torch.equal(a[0], b[0]) and not torch.equal(a[1], b[1])
    assert torch.equal(a[0], alone[0])
