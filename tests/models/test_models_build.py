"""The committed example models and data: sizes, interfaces, determinism of models/build.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from _model_helpers import MODELS, ROOT, SHIPPED

from kcverify.models.executor import Executor
from kcverify.models.ir import load_onnx


@pytest.mark.parametrize("name", SHIPPED)
def test_committed_model_is_small_and_loads(name: str) -> None:
    path = MODELS / f"{name}.onnx"
    assert path.stat().st_size < 2 * 1024 * 1024
    Executor(load_onnx(path)).check_supported()


def test_decoder_interface_and_causality() -> None:
    g = load_onnx(MODELS / "tiny_decoder.onnx")
    assert [(v.name, v.dtype, v.shape) for v in g.inputs] == [("input_ids", "int64", ("batch", "seq"))]
    assert [(v.name, v.dtype, v.shape) for v in g.outputs] == [
        ("logits", "float32", ("batch", "seq", 256))]
    assert sum(n.op_type in ("LayerNormalization",) for n in g.nodes) == 5  # 2 per layer + final
    ex = Executor(g)
    ids = np.random.default_rng(0).integers(0, 256, (2, 12))
    a = ex.run({"input_ids": ids})["logits"]
    ids2 = ids.copy()
    ids2[:, 8:] = (ids2[:, 8:] + 1) % 256
    b = ex.run({"input_ids": ids2})["logits"]
    assert (a[:, :8] == b[:, :8]).all()  # causal: later tokens do not change earlier logits
    assert (a[:, 8:] - b[:, 8:]).abs().max() > 1e-2
    assert a.std() > 0.2  # non-trivial weights: logits spread


def test_encoder_is_bidirectional() -> None:
    ex = Executor(load_onnx(MODELS / "tiny_encoder.onnx"))
    ids = np.random.default_rng(0).integers(0, 256, (1, 10))
    a = ex.run({"input_ids": ids})["hidden"]
    ids[0, -1] = (ids[0, -1] + 1) % 256
    b = ex.run({"input_ids": ids})["hidden"]
    assert (a[:, 0] - b[:, 0]).abs().max() > 1e-4


def test_example_data() -> None:
    for name, n in (("eval", 8), ("safety", 4)):
        with np.load(ROOT / "examples" / "data" / f"{name}.npz") as z:
            ids = z["input_ids"]
        assert ids.dtype == np.int64 and ids.shape == (n, 16)
        assert 0 <= ids.min() and ids.max() < 256


@pytest.mark.slow
def test_build_is_byte_identical(tmp_path: Path, build_module) -> None:  # type: ignore[no-untyped-def]
    written = build_module.build_all(tmp_path / "m", tmp_path / "d")
    for p in written:
        committed = (MODELS if p.suffix == ".onnx" else ROOT / "examples" / "data") / p.name
        assert p.read_bytes() == committed.read_bytes(), p.name


def test_mlp_build_is_byte_identical(tmp_path: Path, build_module) -> None:  # type: ignore[no-untyped-def]
    """The fast part of the determinism check: the MLPs (TorchScript exporter)."""
    for name in build_module.MLPS:
        out = build_module.build_mlp(name, tmp_path)
        assert out.read_bytes() == (MODELS / f"{name}.onnx").read_bytes()
