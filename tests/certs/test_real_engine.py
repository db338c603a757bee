"""Integration with the real bound engine (kcverify.bounds): certificates from certify_drift are
re-checked by re-running bound_block on each block. Skipped while the engine is not importable."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

bounds = pytest.importorskip("kcverify.bounds")
blocks_mod = pytest.importorskip("kcverify.models.blocks")

from kcverify.certs.checker import check_certificate  # noqa: E402
from kcverify.certs.encoding import decode_array, encode_array  # noqa: E402
from kcverify.certs.statement import CertificateBuilder  # noqa: E402
from kcverify.kernels.spec import parse_kernel_spec  # noqa: E402
from kcverify.models.ir import load_onnx  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "mlp_tiny.onnx"

CONTRACT = """\
contract: mlp-tiny-fp8
version: 1.0.0
model: {onnx: model.onnx}
kernels:
  train: {compute: fp32, accumulate: fp32}
  inf:
    weights: {format: fp8_e4m3, scale: per_channel}
    activations: {format: fp8_e4m3, scale: dynamic_per_tensor}
    accumulate: fp32
    compute: bf16
slices:
  all: {inputs: data.npz}
clauses:
  - {id: N-1, family: numerical, assert: "forall x in all: linf(logits_inf(x) - logits_train(x)) <= 10", level: L2, action: guard}
"""


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, Any]]:
    if not MODEL.exists() or not hasattr(bounds, "certify_drift"):
        pytest.skip("example model or certify_drift not available")
    d = tmp_path_factory.mktemp("real")
    model = d / "model.onnx"
    model.write_bytes(MODEL.read_bytes())
    contract = d / "contract.yaml"
    contract.write_text(CONTRACT)
    try:
        from kcverify.dsl import load_contract

        specs = dict(load_contract(contract).kernels)
    except ImportError:
        import yaml

        raw = yaml.safe_load(CONTRACT)["kernels"]
        specs = {k: parse_kernel_spec(k, v) for k, v in raw.items()}
    graph = load_onnx(model)
    x = np.random.default_rng(0).uniform(-1, 1, size=(3, 4)).astype(np.float32)
    np.savez(d / "data.npz", x=x)
    res = bounds.certify_drift(graph, specs["train"], specs["inf"], {"x": x})
    b = CertificateBuilder(model, contract, specs, {"name": "mlp-tiny-fp8", "version": "1.0.0"},
                           slices={"all": "data.npz"})
    refs = [b.add_block(r) for r in res.blocks]
    out = graph.outputs[0].name
    chain = b.sequential(refs, {"x": bounds.DiffBox.point(x.astype(np.float64))}, [out],
                         slice="all")  # raw inputs: the checker re-derives how kernels store them
    linf = b.apply("linf-from-state", [chain], tensor=out)
    assert np.array_equal([float.fromhex(v) for v in linf["conclusion"]["bounds"]], res.linf)
    b.add_clause("N-1", "numerical", "proved", threshold=10.0, method="interval",
                 proof=b.apply("threshold", [linf], threshold=10.0))
    cert = d / "model.onnx.kcert.json"
    cert.write_text(json.dumps(b.build(), sort_keys=True))
    return model, contract, json.loads(cert.read_text())


def test_real_certificate_checks(real: Any) -> None:
    model, contract, stmt = real[0], real[1], copy.deepcopy(real[2])
    report = check_certificate(stmt, model, contract)  # defaults: DSL, segmentation, bound_block
    assert report.ok, report.problems
    assert not any("not re-run" in n for n in report.notes), report.notes


def test_real_certificate_rejects_a_tightened_block(real: Any) -> None:
    model, contract, stmt = real[0], real[1], copy.deepcopy(real[2])
    blk = stmt["predicate"]["blocks"]["1:layer1"]
    (tensor,) = blk["out_state"]
    box = blk["out_state"][tensor]
    hi = decode_array(box["drift_hi"])
    lo = decode_array(box["drift_lo"])
    mid = (hi + lo) / 2
    box["drift_hi"], box["drift_lo"] = encode_array(mid + (hi - mid) / 2), encode_array(mid - (mid - lo) / 2)
    report = check_certificate(stmt, model, contract)
    assert not report.ok
    assert any("block 'layer1'" in p and "not inside the stored one" in p for p in report.problems)


def test_real_certificate_rejects_other_inputs(real: Any) -> None:
    model, contract, stmt = real[0], real[1], copy.deepcopy(real[2])
    seq = stmt["predicate"]["clauses"][0]["proof"]["premises"][0]["premises"][0]
    assert seq["rule"] == "sequential"
    box = seq["params"]["inputs"]["x"]
    for f in box:
        if f.startswith(("train", "inf")):
            box[f] = encode_array(decode_array(box[f]) + 0.25)
    report = check_certificate(stmt, model, contract)
    assert not report.ok  # the shifted region misses the slice's data ...
    assert any("does not contain the inputs of slice 'all'" in p for p in report.problems)
    report = check_certificate(stmt, model, contract, input_region=lambda s: {})
    assert not report.ok  # ... and is not what the first block assumed
    assert any("does not contain the model-input region" in p for p in report.problems)


def test_real_certificate_is_compared_with_the_slice_data(real: Any) -> None:
    model, contract, stmt = real[0], real[1], copy.deepcopy(real[2])
    data = contract.parent / "data.npz"
    honest = data.read_bytes()
    x = np.load(data)["x"]
    try:
        x[1, 2] += 0.125
        np.savez(data, x=x)
        report = check_certificate(stmt, model, contract)
        assert not report.ok
        assert any(p.startswith("slice 'all': digest mismatch") for p in report.problems)
        assert any("does not contain the inputs of slice 'all'" in p for p in report.problems)
        data.unlink()  # a slice whose data cannot be read fails the check (never a note)
        report = check_certificate(stmt, model, contract)
        assert not report.ok
        assert any(p.startswith("slice 'all':") and "cannot read" in p for p in report.problems)
    finally:
        data.write_bytes(honest)
    assert check_certificate(stmt, model, contract).ok
