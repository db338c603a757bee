"""QDQ graphs: built from a spec, checked by onnx, run by onnxruntime and by the executor with the
same results, and usable as a kernel through ``spec.onnx``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from kcverify.errors import KernelSpecError
from kcverify.kernels.qdq import make_qdq_model, ort_session
from kcverify.kernels.realize import run_kernel
from kcverify.kernels.scale import quantize_weight
from kcverify.kernels.spec import parse_kernel_spec
from kcverify.models.executor import Executor
from kcverify.models.ir import from_onnx, load_onnx

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "models"
pytestmark = pytest.mark.skipif(not (MODELS / "mlp_small.onnx").exists(), reason="example models not built")


def _spec(weights: str = "fp8_e4m3", compute: str = "fp32", **extra: object):  # noqa: ANN202
    raw = {"weights": {"format": weights, "scale": "per_channel"},
           "activations": {"format": "fp8_e4m3", "scale": "dynamic_per_tensor"},
           "accumulate": "fp32", "compute": compute, **extra}
    return parse_kernel_spec("inf", raw)


def _feeds(name: str, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    if name == "mlp_small":
        return {"x": rng.standard_normal((6, 8)).astype(np.float32)}
    return {"input_ids": rng.integers(0, 256, (2, 10))}


@pytest.mark.parametrize("name,weights", [("mlp_small", "fp8_e4m3"), ("mlp_small", "int8"),
                                          ("tiny_decoder", "fp8_e4m3")])
def test_qdq_runs_in_onnxruntime_and_the_executor_alike(name: str, weights: str) -> None:
    graph = load_onnx(MODELS / f"{name}.onnx")
    model = make_qdq_model(graph, _spec(weights), calibration=_feeds(name, seed=1))
    onnx.checker.check_model(model, full_check=True)
    census = from_onnx(model).op_census()
    assert census["DequantizeLinear"] > census["QuantizeLinear"] > 0
    feeds = _feeds(name)
    ort_out = ort_session(model).run(None, feeds)[0]
    g2 = from_onnx(model)
    ours = Executor(g2).run(feeds)[g2.outputs[0].name].numpy()
    scale = np.abs(ort_out).max()
    assert np.abs(ours - ort_out).max() <= 1e-5 * scale
    plain = ort_session(graph.to_onnx()).run(None, feeds)[0]
    assert np.abs(plain - ort_out).max() > 1e-3 * scale  # the casts are really there


def test_qdq_weights_are_exactly_the_realizations_weights() -> None:
    graph = load_onnx(MODELS / "mlp_small.onnx")
    sp = _spec()
    model = make_qdq_model(graph, sp, calibration=_feeds("mlp_small"))
    g2 = from_onnx(model)
    consts = Executor(g2, dtype=torch.float64).constants
    w = graph.initializers["0.weight"]  # Gemm transB=1: (out, in), output feature axis 0
    dq = consts["0.weight__dq"].numpy()
    qw, _ = quantize_weight(torch.from_numpy(w.astype(np.float64)), sp.weights, out_axis=0)
    assert np.array_equal(dq, qw.numpy())


def test_spec_onnx_runs_the_qdq_graph(tmp_path: Path) -> None:
    graph = load_onnx(MODELS / "mlp_small.onnx")
    model = make_qdq_model(graph, _spec(), calibration=_feeds("mlp_small", seed=1))
    onnx.save(model, tmp_path / "mlp_small.qdq.onnx")
    sp = _spec(onnx="mlp_small.qdq.onnx")
    feeds = _feeds("mlp_small")
    out = run_kernel(graph, sp, feeds, base_dir=tmp_path, order="pairwise")["y"].numpy()
    ort_out = ort_session(model).run(None, feeds)[0]
    assert np.abs(out - ort_out).max() <= 1e-5 * np.abs(ort_out).max()
    # the explicit-cast graph, not the spec's casts on the float graph
    direct = run_kernel(graph, _spec(), feeds, order="pairwise")["y"].numpy()
    assert not np.array_equal(out, direct)


def test_qdq_errors_are_clear() -> None:
    graph = load_onnx(MODELS / "mlp_small.onnx")
    with pytest.raises(KernelSpecError, match="calibration"):
        make_qdq_model(graph, _spec())
    block = parse_kernel_spec("b", {"weights": {"format": "fp8_e4m3", "scale": "per_block"}})
    with pytest.raises(KernelSpecError, match="per_block"):
        make_qdq_model(graph, block)
    int4 = parse_kernel_spec("i", {"weights": {"format": "int4", "scale": "per_channel"}})
    with pytest.raises(KernelSpecError, match="int4"):
        make_qdq_model(graph, int4)
    static = parse_kernel_spec("s", {"activations": {"format": "fp8_e5m2", "scale": "static", "value": 0.05}})
    model = make_qdq_model(graph, static)  # static scales need no calibration
    assert from_onnx(model).op_census()["QuantizeLinear"] == 3
