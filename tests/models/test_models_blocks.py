"""Block segmentation: composition reproduces the model bitwise, blocks are standalone graphs
(onnxruntime runs each), cuts are single stream tensors, kinds follow the architecture."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from _model_helpers import ACASXU, MODELS, SHIPPED, assert_close

from kcverify.models.blocks import run_blocks, segment
from kcverify.models.executor import Executor
from kcverify.models.inspection import random_feeds
from kcverify.models.ir import Graph, load_onnx


def check_composition(graph: Graph, feeds: dict[str, np.ndarray]) -> list:  # type: ignore[type-arg]
    blocks = segment(graph)
    whole = Executor(graph).run(feeds)
    env = run_blocks(blocks, feeds)
    for name, value in whole.items():
        assert torch.equal(env[name], value), name
    # every node of the model is in exactly one block, constants aside
    const = graph.constant_names()
    dynamic = {n.name for n in graph.nodes if not all(o in const for o in n.outputs if o)}
    placed = [n.name for b in blocks for n in b.graph.nodes if n.name in dynamic]
    assert sorted(placed) == sorted(dynamic)
    return blocks


@pytest.mark.parametrize("name", SHIPPED)
def test_blocks_compose_to_the_model(name: str) -> None:
    graph = load_onnx(MODELS / f"{name}.onnx")
    for batch, seq in ((1, 3), (3, 16)):
        check_composition(graph, random_feeds(graph, batch, seq, seed=seq))


def test_decoder_blocks() -> None:
    graph = load_onnx(MODELS / "tiny_decoder.onnx")
    blocks = segment(graph)
    assert [(b.name, b.kind) for b in blocks] == [
        ("embedding", "embedding"), ("layer0", "layer"), ("layer1", "layer"), ("head", "head")]
    assert len({b.digest for b in blocks}) == 4
    # each layer reads exactly one float stream tensor (the residual), plus int/bool side tensors
    for b in blocks[1:]:
        floats = [i for i in b.inputs if (graph.info(i).dtype or "").startswith("float")]
        assert len(floats) == 1, (b.name, b.inputs)
    # parameters: the two layers have the same architecture
    assert abs(blocks[1].num_params - blocks[2].num_params) <= 8
    assert blocks[3].num_params == 256 * 64 + 2 * 64  # head matrix and the final LayerNorm
    assert blocks[3].outputs == ("logits",)
    # consecutive blocks meet at one stream tensor
    assert blocks[0].stream_in is None and blocks[-1].stream_out == "logits"
    for a, b in zip(blocks, blocks[1:]):
        assert a.stream_out == b.stream_in and a.stream_out in b.inputs and a.stream_out in a.outputs


def test_encoder_and_mlp_blocks() -> None:
    enc = segment(load_onnx(MODELS / "tiny_encoder.onnx"))
    assert [b.kind for b in enc] == ["embedding", "layer", "layer"]
    mlp = segment(load_onnx(MODELS / "mlp_small.onnx"))
    assert [(b.name, [n.op_type for n in b.graph.nodes]) for b in mlp] == [
        ("layer0", ["Gemm", "Relu"]), ("layer1", ["Gemm", "Relu"]), ("head", ["Gemm"])]


def test_each_block_is_a_standalone_onnx_graph() -> None:
    """A block's graph, written back to ONNX, runs in onnxruntime and gives the same tensors."""
    graph = load_onnx(MODELS / "tiny_decoder.onnx")
    feeds = random_feeds(graph, 2, 8)
    env = run_blocks(segment(graph), feeds)
    for b in segment(graph):
        sess = ort.InferenceSession(b.graph.to_onnx().SerializeToString(),
                                    providers=["CPUExecutionProvider"])
        block_feeds = {k: (env[k].numpy() if isinstance(env[k], torch.Tensor) else env[k])
                       for k in b.inputs}
        outs = sess.run(list(b.outputs), block_feeds)
        for name, r in zip(b.outputs, outs):
            assert_close(env[name].numpy(), r, rtol=1e-5)


def test_digest_is_stable_and_weight_sensitive() -> None:
    a = segment(load_onnx(MODELS / "tiny_decoder.onnx"))
    b = segment(load_onnx(MODELS / "tiny_decoder.onnx"))
    assert [x.digest for x in a] == [x.digest for x in b]
    g = load_onnx(MODELS / "tiny_decoder.onnx")
    name = next(k for k in g.initializers if k.startswith("layers.1"))
    g.initializers[name] = g.initializers[name] + np.float32(1e-3)
    c = segment(g)
    assert [x.digest == y.digest for x, y in zip(a, c)] == [True, True, False, True]


@pytest.mark.parametrize("name", ["decoder", "encoder", "decoder_sdpa_tied", "encoder_opset14",
                                  "decoder_opset14"])
def test_torchscript_export_blocks(name: str, torchscript_models) -> None:  # type: ignore[no-untyped-def]
    graph = load_onnx(torchscript_models[name])
    blocks = check_composition(graph, random_feeds(graph, 2, 9))
    assert [b.kind for b in blocks].count("layer") == 3


def test_acasxu_blocks() -> None:
    path = ACASXU / "ACASXU_run2a_1_1_batch_2000.onnx"
    if not path.exists():
        pytest.skip(f"{path} not available")
    graph = load_onnx(path)
    blocks = check_composition(graph, {"input": np.full((1, 1, 1, 5), 0.1, np.float32)})
    assert [b.kind for b in blocks] == ["layer"] * 6 + ["head"]


def test_minilm_blocks(minilm_path: Path) -> None:
    graph = load_onnx(minilm_path)
    feeds = random_feeds(graph, 2, 8, seed=1)
    feeds["attention_mask"][0, 5:] = 0
    blocks = check_composition(graph, feeds)
    assert [b.kind for b in blocks] == ["embedding"] + ["layer"] * 6
    assert len({b.digest for b in blocks}) == 7


def test_graph_without_cuts_is_one_block() -> None:
    """y = x + relu(x) * x: no single tensor separates input from output."""
    from onnx import TensorProto, helper

    from kcverify.models.ir import from_onnx

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Mul", ["r", "x"], ["m"]),
             helper.make_node("Add", ["x", "m"], ["y"])]
    g = from_onnx(helper.make_model(helper.make_graph(nodes, "g", [x], [y]),
                                    opset_imports=[helper.make_opsetid("", 17)]))
    blocks = check_composition(g, {"x": np.arange(6, dtype=np.float32).reshape(2, 3) - 2})
    assert [(b.name, b.kind, b.num_nodes) for b in blocks] == [("model", "other", 3)]


def _random_graph(seed: int) -> Graph:
    """A random DAG of elementwise ops over two inputs (one of them a side input), with skips,
    shape-only reads and one or two outputs."""
    from onnx import TensorProto, helper

    from kcverify.models.ir import from_onnx

    rng = np.random.default_rng(seed)
    avail = ["x"]
    nodes = []
    for k in range(int(rng.integers(4, 18))):
        op = str(rng.choice(["Add", "Mul", "Relu", "Tanh", "Sub", "AddMask", "Softmax"]))
        out = f"t{k}"
        # mostly chain the latest tensors, sometimes reach back (a skip connection)
        pick = lambda: avail[-1 - int(min(rng.geometric(0.6) - 1, len(avail) - 1))]  # noqa: E731
        if op in ("Relu", "Tanh"):
            nodes.append(helper.make_node(op, [pick()], [out]))
        elif op == "Softmax":
            nodes.append(helper.make_node(op, [pick()], [out], axis=-1))
        elif op == "AddMask":
            nodes.append(helper.make_node("Add", [pick(), "mask"], [out]))
        else:
            nodes.append(helper.make_node(op, [pick(), pick()], [out]))
        avail.append(out)
    outs = [avail[-1]] + ([avail[-3]] if len(avail) > 4 and rng.random() < 0.3 else [])
    g = helper.make_graph(
        nodes, f"rand{seed}",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4]),
         helper.make_tensor_value_info("mask", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs])
    return from_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


@pytest.mark.parametrize("seed", range(40))
def test_random_graphs_compose(seed: int) -> None:
    graph = _random_graph(seed)
    rng = np.random.default_rng(seed)
    feeds = {"x": rng.standard_normal((3, 4)).astype(np.float32),
             "mask": rng.standard_normal(4).astype(np.float32)}
    blocks = check_composition(graph, feeds)
    for a, b in zip(blocks, blocks[1:]):  # consecutive blocks meet at their stream tensor
        assert a.stream_out is not None and a.stream_out == b.stream_in
