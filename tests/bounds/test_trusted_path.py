"""The trusted path never falls back silently (issue 11): a segmenter or symbolic-rule failure
is an InternalError, not a quiet switch to the whole graph or to the intervals; the checker's
re-run rebuilds blocks exactly as the prover cut them (the segmenter's blocks and the whole
graph, by digest), and prove -> check is exercised for every domain."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from kcverify.bounds import certify_drift
from kcverify.bounds import engine as engine_mod
from kcverify.bounds import registry as registry_mod
from kcverify.bounds.engine import Region, blocks_of, whole_graph
from kcverify.bounds.registry import SYMBOLIC
from kcverify.certs.recheck import default_recheck, model_blocks
from kcverify.cli import main
from kcverify.errors import InternalError
from kcverify.kernels.spec import parse_kernel_spec
from kcverify.models import blocks as blocks_mod
from kcverify.models.blocks import segment
from kcverify.models.ir import load_onnx

ROOT = Path(__file__).resolve().parents[2]
FP32 = parse_kernel_spec("train", {"compute": "fp32", "accumulate": "fp32"})
W8 = parse_kernel_spec("inf", {"weights": {"format": "fp8_e4m3", "scale": "per_channel"}})


def test_segmenter_failure_is_an_internal_error(monkeypatch: pytest.MonkeyPatch) -> None:
    g = load_onnx(ROOT / "models" / "mlp_tiny.onnx")

    def broken(graph):  # noqa: ANN001, ANN202
        raise RuntimeError("cannot cut")
    monkeypatch.setattr(blocks_mod, "segment", broken)
    with pytest.raises(InternalError, match="cannot cut"):
        blocks_of(g)


def test_symbolic_rule_failure_is_an_internal_error(monkeypatch: pytest.MonkeyPatch) -> None:
    g = load_onnx(ROOT / "models" / "mlp_tiny.onnx")

    def broken(*args):  # noqa: ANN002, ANN202
        raise ValueError("shape bug")
    engine_mod.load_rules()  # registered first, or the import would overwrite the patch
    monkeypatch.setitem(registry_mod.RULES, ("Gemm", SYMBOLIC.name), broken)
    x = np.zeros((1, 4), np.float32)
    with pytest.raises(InternalError, match="symbolic-interval rule failed"):  # a box: symbols
        certify_drift(g, FP32, W8, {"x": x}, domain="best", region=Region("input", "linf", 0.01))
    assert engine_mod  # the engine module is the one that reports it


def test_recheck_knows_both_cuts() -> None:
    """The linear domain bounds the whole graph as one block, the others the segmenter's blocks:
    both are blocks of the model for the checker's re-run."""
    g = load_onnx(ROOT / "models" / "mlp_tiny.onnx")
    known = model_blocks(g)
    assert whole_graph(g)[0].digest in known
    assert all(b.digest in known for b in segment(g))
    hook, why = default_recheck(ROOT / "models" / "mlp_tiny.onnx", {"train": FP32, "inf": W8})
    assert hook is not None and why is None
    res = certify_drift(g, FP32, W8, {"x": np.ones((1, 4), np.float32)}, domain="linear")
    from kcverify.certs.records import BlockData

    for r in res.blocks:
        data = BlockData("0", r.name, r.digest, r.method, r.in_state, r.out_state, {})
        assert hook(data) == [], r.name


def _workspace(tmp_path: Path) -> tuple[Path, Path]:
    shutil.copy(ROOT / "models" / "mlp_tiny.onnx", tmp_path / "mlp_tiny.onnx")
    text = (ROOT / "examples" / "contracts" / "mlp-fp8.yaml").read_text()
    text = text.replace("../../models/mlp_tiny.onnx", "mlp_tiny.onnx")
    data = tmp_path / "points.npz"
    shutil.copy(ROOT / "examples" / "data" / "mlp_points.npz", data)
    text = text.replace("../data/mlp_points.npz", "points.npz")
    contract = tmp_path / "c.yaml"
    contract.write_text(text)
    return contract, tmp_path / "mlp_tiny.onnx"


@pytest.mark.parametrize("domain", [
    "interval", "best", "linear"])
def test_prove_then_check_for_every_domain(tmp_path: Path, domain: str) -> None:
    contract, model = _workspace(tmp_path)
    assert main(["prove", str(contract), str(model), "--domain", domain, "--quiet",
                 "--realizations", "2", "--report", str(tmp_path / "r.json")]) == 0
    cert = Path(str(model) + ".kcert.json")
    assert main(["check", str(cert), str(model), str(contract)]) == 0
