"""The executor against onnxruntime on whole models (max |diff| <= 1e-5 max |output| in fp32),
the arithmetic hook's contract, and its errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from _model_helpers import (
    ACASXU,
    MODELS,
    SHIPPED,
    PassThrough,
    Recorder,
    assert_close,
    two_unknown_ops,
)
from onnx import TensorProto, helper

from kcverify.errors import UnsupportedOpError
from kcverify.kernels.spec import DEFAULT_ULPS
from kcverify.models.executor import ExecutionError, Executor
from kcverify.models.inspection import random_feeds
from kcverify.models.ir import Graph, Node, ValueInfo, from_onnx, load_onnx


def ort_run(path: Path, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


def check_against_ort(path: Path, batch: int, seq: int, seed: int = 0, arithmetic=None) -> None:  # type: ignore[no-untyped-def]
    graph = load_onnx(path)
    feeds = random_feeds(graph, batch=batch, seq=seq, seed=seed)
    ours = Executor(graph, arithmetic=arithmetic).run(feeds)
    ref = ort_run(path, feeds)
    assert set(ours) == set(ref)
    for name, r in ref.items():
        assert_close(ours[name].numpy(), r, rtol=1e-5)
        assert np.abs(r).max() > 0.1  # the comparison is not vacuous


@pytest.mark.parametrize("name", SHIPPED)
@pytest.mark.parametrize("batch,seq", [(1, 5), (3, 16), (2, 32)])
def test_shipped_model_matches_onnxruntime(name: str, batch: int, seq: int) -> None:
    check_against_ort(MODELS / f"{name}.onnx", batch, seq)


@pytest.mark.parametrize("name", ["decoder", "encoder", "decoder_sdpa_tied", "encoder_opset14",
                                  "decoder_opset14"])
def test_torchscript_export_matches_onnxruntime(name: str, torchscript_models) -> None:  # type: ignore[no-untyped-def]
    check_against_ort(torchscript_models[name], 2, 11)


@pytest.mark.parametrize("net", ["1_1", "2_3", "5_9"])
def test_acasxu_matches_onnxruntime(net: str) -> None:
    path = ACASXU / f"ACASXU_run2a_{net}_batch_2000.onnx"
    if not path.exists():
        pytest.skip(f"{path} not available")
    graph = load_onnx(path)
    ex = Executor(graph)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    for _ in range(5):
        x = rng.uniform(-0.5, 0.5, size=(1, 1, 1, 5)).astype(np.float32)
        ours = ex.run({"input": x})
        (ref,) = sess.run(None, {"input": x})
        assert_close(next(iter(ours.values())).numpy(), ref, rtol=1e-5)
    # declared batch 1, run batched: each row as if run alone
    xs = rng.uniform(-0.5, 0.5, size=(7, 1, 1, 5)).astype(np.float32)
    batched = next(iter(ex.run({"input": xs}).values()))
    assert batched.shape == (7, 5)
    for i in range(7):
        (ref,) = sess.run(None, {"input": xs[i:i + 1]})
        assert_close(batched[i:i + 1].numpy(), ref, rtol=1e-5)


def test_minilm_matches_onnxruntime(minilm_path: Path) -> None:
    graph = load_onnx(minilm_path)
    feeds = random_feeds(graph, batch=2, seq=12, seed=3)
    feeds["attention_mask"][1, 7:] = 0  # a padded sequence exercises the mask path
    ours = Executor(graph).run(feeds)
    ref = ort_run(minilm_path, feeds)
    assert_close(ours["hidden"].numpy(), ref["hidden"], rtol=1e-5)


def test_decomposed_arithmetic_matches_onnxruntime() -> None:
    """A non-Exact arithmetic takes the decomposed paths (Gelu, Softmax, LayerNorm): still equal
    to onnxruntime within the fp32 tolerance."""
    for name in ("tiny_decoder", "tiny_encoder"):
        check_against_ort(MODELS / f"{name}.onnx", 2, 16, arithmetic=PassThrough())


def test_every_matmul_goes_through_the_hook_with_roles() -> None:
    graph = load_onnx(MODELS / "tiny_decoder.onnx")
    rec = Recorder()
    Executor(graph, arithmetic=rec).run(random_feeds(graph, 2, 8))
    matmuls = [n.name for n in graph.nodes if n.op_type == "MatMul"]
    assert sorted(name for name, _, _ in rec.matmuls) == sorted(matmuls)
    roles = {(a, b) for _, a, b in rec.matmuls}
    # projections read a constant weight; attention's two products read two activations
    assert roles == {("activations", "weights"), ("activations", "activations")}
    assert sum((a, b) == ("activations", "activations") for _, a, b in rec.matmuls) == 4
    assert rec.inputs == []  # input_ids is not a float input
    prims = {p for _, p in rec.rounds}
    assert prims <= set(DEFAULT_ULPS)
    assert {"add", "mul", "exp", "div", "reduce", "rsqrt", "erf"} <= prims


def test_gemm_and_graph_input_hooks() -> None:
    graph = load_onnx(MODELS / "mlp_small.onnx")
    rec = Recorder()
    Executor(graph, arithmetic=rec).run({"x": np.ones((2, 8), np.float32)})
    assert rec.inputs == ["x"]
    assert [(a, b) for _, a, b in rec.matmuls] == [("activations", "weights")] * 3
    assert ("Gemm", "add") in rec.rounds  # the bias, after the product
    assert not any(op == "Relu" for op, _ in rec.rounds)  # exact ops are not rounded


def test_conv_goes_through_the_hook() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 1, 5, 5])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    w = onnx.numpy_helper.from_array(np.ones((2, 1, 3, 3), np.float32), "w")
    g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], name="c")], "g", [x], [y], [w])
    graph = from_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    rec = Recorder()
    out = Executor(graph, arithmetic=rec).run({"x": np.ones((2, 1, 5, 5), np.float32)})
    assert rec.convs == [("c", "activations", "weights")]
    assert torch.all(out["y"] == 9.0)


def test_float64_executor_agrees_and_is_not_fp32() -> None:
    graph = load_onnx(MODELS / "tiny_decoder.onnx")
    feeds = random_feeds(graph, 2, 16)
    y32 = Executor(graph).run(feeds)["logits"]
    y64 = Executor(graph, dtype=torch.float64).run(feeds)["logits"]
    assert y64.dtype == torch.float64
    assert_close(y32.numpy(), y64.numpy(), rtol=1e-5)
    assert not torch.equal(y32.double(), y64)


def test_keep_returns_intermediates() -> None:
    graph = load_onnx(MODELS / "tiny_decoder.onnx")
    env = Executor(graph).run(random_feeds(graph, 1, 4), keep=True)
    for n in graph.nodes:
        for o in n.outputs:
            assert o in env
    assert "input_ids" in env and "logits" in env


def test_unsupported_ops_are_all_reported_before_anything_runs() -> None:
    graph = from_onnx(two_unknown_ops())
    rec = Recorder()
    ex = Executor(graph, arithmetic=rec)
    with pytest.raises(UnsupportedOpError) as err:
        ex.check_supported()
    msg = str(err.value)
    assert "acme::FancyNorm (nodes: 'fancy_1')" in msg and "acme::Warp (nodes: 'warp_9')" in msg
    assert {m[2] for m in err.value.missing} == {"fancy_1", "warp_9"}
    with pytest.raises(UnsupportedOpError):
        ex.run({"x": np.ones((2, 3), np.float32)})
    assert rec.inputs == [] and rec.matmuls == [] and rec.rounds == []


def test_op_below_its_opset_is_unsupported() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    g = helper.make_graph([helper.make_node("Gelu", ["x"], ["y"], name="g19")], "g", [x], [y])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)])
    with pytest.raises(UnsupportedOpError, match="Gelu"):
        Executor(from_onnx(model)).check_supported()


def test_unknown_attribute_is_reported() -> None:
    graph = Graph("g", [Node("sm", "Softmax", ("x",), ("y",), {"axis": 1, "temperature": 2.0})],
                  [ValueInfo("x", "float32", (2, 3))], [ValueInfo("y", "float32", None)], {},
                  opset=17)
    with pytest.raises(UnsupportedOpError, match="Softmax with attribute temperature"):
        Executor(graph).check_supported()


def test_bad_feeds_are_named() -> None:
    graph = load_onnx(MODELS / "mlp_small.onnx")
    ex = Executor(graph)
    with pytest.raises(ExecutionError, match="missing input 'x'"):
        ex.run({})
    with pytest.raises(ExecutionError, match=r"input 'x' has shape \(2, 7\), expected \('batch', 8\)"):
        ex.run({"x": np.ones((2, 7), np.float32)})


def test_failing_node_is_named() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, None)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "x"], ["y"], name="bad_mm")], "g", [x], [y])
    graph = from_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    with pytest.raises(ExecutionError, match="node 'bad_mm' \\(MatMul\\)"):
        Executor(graph).run({"x": np.ones((2, 3), np.float32)})


@pytest.mark.gpu
def test_runs_on_cuda() -> None:
    graph = load_onnx(MODELS / "tiny_decoder.onnx")
    feeds = random_feeds(graph, 2, 16)
    cpu = Executor(graph).run(feeds)["logits"]
    gpu = Executor(graph, device="cuda").run(feeds)["logits"]
    assert gpu.device.type == "cuda"
    assert_close(gpu.cpu().numpy(), cpu.numpy(), rtol=1e-5)


@pytest.mark.slow
def test_dynamo_opset23_fused_attention(tmp_path: Path, build_module) -> None:  # type: ignore[no-untyped-def]
    """At opset 23 the dynamo exporter emits the fused Attention op for SDPA: the executor
    agrees with onnxruntime and the blocks still follow the layers."""
    from kcverify.models.blocks import run_blocks, segment

    model = build_module.TinyDecoder(sdpa=True, tied=True)
    build_module.init_weights(model, 11, std=0.08)
    path = tmp_path / "dec23.onnx"
    old = build_module.OPSET
    build_module.OPSET = 23
    try:
        build_module.export(model, torch.zeros(2, 16, dtype=torch.int64), path, "input_ids",
                            "logits", {0: "batch", 1: "seq"}, dynamo=True)
    finally:
        build_module.OPSET = old
    graph = load_onnx(path)
    assert graph.op_census().get("Attention") == 2
    check_against_ort(path, 2, 9)
    feeds = random_feeds(graph, 2, 9)
    blocks = segment(graph)
    assert [b.kind for b in blocks] == ["embedding", "layer", "layer", "head"]
    assert torch.equal(run_blocks(blocks, feeds)["logits"], Executor(graph).run(feeds)["logits"])
