"""A contract whose inference kernel is a QDQ graph (docs/qdq.md): proved on the joint graph,
re-checked by the checker (which re-derives the joint graph), and bad QDQ graphs refused with
the node named (exit 2)."""

from __future__ import annotations

import shutil
from pathlib import Path

import onnx
import pytest
from onnx import helper, numpy_helper

import kcverify
from kcverify.bounds.qdq_graph import bound_problem, joint_graph
from kcverify.cli import main
from kcverify.errors import KernelSpecError, ModelImportError
from kcverify.kernels.spec import parse_kernel_spec
from kcverify.models.ir import from_onnx, load_onnx

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "mlp_tiny.onnx"
QDQ = ROOT / "examples" / "qdq" / "mlp_tiny.int8.qdq.onnx"


def _copy(tmp: Path, qdq: onnx.ModelProto | None = None) -> tuple[Path, Path]:
    """The int8 example contract, its model and data beside each other in ``tmp``."""
    text = (ROOT / "examples" / "contracts" / "mlp-int8-qdq.yaml").read_text()
    text = text.replace("../../models/mlp_tiny.onnx", "mlp_tiny.onnx")
    text = text.replace("../qdq/mlp_tiny.int8.qdq.onnx", "q.onnx")
    text = text.replace("../data/mlp_points.npz", "mlp_points.npz")
    (tmp / "c.yaml").write_text(text)
    shutil.copy(MODEL, tmp / "mlp_tiny.onnx")
    shutil.copy(ROOT / "examples" / "data" / "mlp_points.npz", tmp / "mlp_points.npz")
    onnx.save(qdq if qdq is not None else onnx.load(QDQ), tmp / "q.onnx")
    return tmp / "c.yaml", tmp / "mlp_tiny.onnx"


def test_prove_and_check_a_qdq_contract(tmp_path: Path) -> None:
    contract, model = _copy(tmp_path)
    res = kcverify.prove(contract, model, cert=tmp_path / "c.kcert.json")
    by_id = {c.id: c for c in res.report.clauses}
    assert by_id["N-QDQ-1"].verdict == "proved"
    # the certified bound is the QDQ kernel's drift (0.042), not the fp32 model's (~1e-5)
    assert 0.03 < by_id["N-QDQ-1"].bound < 0.05
    rep = kcverify.check(tmp_path / "c.kcert.json", model, contract)
    assert rep.ok, rep.problems
    # another QDQ graph (the fp8 one) under the same contract: the joint graph's blocks differ
    shutil.copy(ROOT / "examples" / "qdq" / "mlp_tiny.fp8.qdq.onnx", tmp_path / "q.onnx")
    rep = kcverify.check(tmp_path / "c.kcert.json", model, contract)
    assert not rep.ok


def _tampered(edit) -> onnx.ModelProto:  # noqa: ANN001
    m = onnx.load(QDQ)
    edit(m.graph)
    return m


def _relu_to_sigmoid(g: onnx.GraphProto) -> None:
    next(n for n in g.node if n.op_type == "Relu").op_type = "Sigmoid"


def _extra_node(g: onnx.GraphProto) -> None:
    g.node.append(helper.make_node("Identity", ["x"], ["x_copy"], name="extra"))


def _dynamic(g: onnx.GraphProto) -> None:
    q = next(n for n in g.node if n.op_type == "QuantizeLinear")
    i = list(g.node).index(q)
    dq = helper.make_node("DynamicQuantizeLinear", [q.input[0]], ["dq_y", "dq_s", "dq_z"],
                          name="dyn")
    g.node.insert(i, dq)
    q.input[1] = "dq_s"


@pytest.mark.parametrize("edit,match", [
    (_relu_to_sigmoid, r"node '/1/Relu' \(Sigmoid\): has no counterpart in the model"),
    (_extra_node, r"node 'extra' \(Identity\): has no counterpart"),
    (_dynamic, r"node 'dyn' \(DynamicQuantizeLinear\): dynamic QDQ"),
])
def test_a_qdq_graph_that_is_not_the_model_is_refused(edit, match: str) -> None:  # noqa: ANN001
    with pytest.raises(ModelImportError, match=match):
        joint_graph(load_onnx(MODEL), from_onnx(_tampered(edit)))


def test_a_changed_float_constant_is_named() -> None:
    def edit(g: onnx.GraphProto) -> None:  # a quantized weight of another shape than the model's
        init = next(t for t in g.initializer if t.name == "0.weight_quantized")
        arr = numpy_helper.to_array(init)[:4]  # wrong shape
        init.CopyFrom(numpy_helper.from_array(arr, init.name))
    with pytest.raises(ModelImportError, match="weight '0.weight' has shape"):
        joint_graph(load_onnx(MODEL), from_onnx(_tampered(edit), name="t"))


def test_cli_exit_2_and_spec_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    contract, model = _copy(tmp_path, _tampered(_relu_to_sigmoid))
    assert main(["prove", str(contract), str(model), "--cert", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert "has no counterpart in the model" in err and not (tmp_path / "x.json").exists()
    g = load_onnx(MODEL)
    train = parse_kernel_spec("train", {})
    both = parse_kernel_spec("inf", {"onnx": "q.onnx", "weights": "fp8_e4m3"})
    with pytest.raises(KernelSpecError, match="must not also declare weights"):
        bound_problem(g, train, both, tmp_path)
    with pytest.raises(KernelSpecError, match="training kernel given as a second ONNX graph"):
        bound_problem(g, parse_kernel_spec("train", {"onnx": "q.onnx"}), train, tmp_path)
