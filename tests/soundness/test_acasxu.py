"""External known-answer suite: ACAS Xu networks (old-opset ONNX) on the VNN-LIB property input
boxes (read by kcverify.dsl.vnnlib). The interval and linear value bounds of the fp32 kernel must
contain the outputs onnxruntime computes (an fp32 program with exact products, so a conforming
one) at sampled points of each case's box; properties with several boxes (a disjunction) check
each."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kcverify.bounds import certify_drift
from kcverify.dsl.vnnlib import load_vnnlib
from kcverify.kernels.spec import parse_kernel_spec
from kcverify.models.ir import load_onnx
from tests.regions.helpers import acas_dir

ACAS = acas_dir() or Path("/nonexistent")
FP32 = parse_kernel_spec("train", {"compute": "fp32", "accumulate": "fp32"})
BF16 = parse_kernel_spec("inf", {"compute": "bf16", "accumulate": "fp32",
                                 "weights": {"format": "fp8_e4m3", "scale": "per_channel"}})

pytestmark = pytest.mark.skipif(acas_dir() is None, reason="ACAS Xu data not available")


def input_boxes(path: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    """(lo, hi) of X_0..X_4 per case of a VNN-LIB property (float64, outward)."""
    return [(np.array(c.lo), np.array(c.hi)) for c in load_vnnlib(path).cases]


def _check(net: str, prop: str, n: int, seed: int) -> int:
    g = load_onnx(ACAS / net)
    return sum(_check_box(g, net, lo, hi, n, seed) for lo, hi in input_boxes(ACAS / prop))


def _check_box(g, net: str, lo: np.ndarray, hi: np.ndarray, n: int,  # noqa: ANN001
               seed: int) -> int:
    import onnxruntime as ort

    shape = (1, 1, 1, 5)
    mid = ((lo + hi) / 2).reshape(shape).astype(np.float32)
    boxes = [certify_drift(g, FP32, BF16, {"input": mid},
                           input_bounds={"input": (lo.reshape(shape), hi.reshape(shape))},
                           domain=d).outputs[g.outputs[0].name] for d in ("interval", "linear")]
    sess = ort.InferenceSession(str(ACAS / net), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(seed)
    pts = rng.uniform(lo, hi, size=(n, 5)).astype(np.float32)
    pts = np.clip(pts, lo.astype(np.float32), hi.astype(np.float32))
    inside = (pts >= lo) & (pts <= hi)
    pts = pts[inside.all(1)]
    for p in pts:
        y = sess.run(None, {"input": p.reshape(shape)})[0].astype(np.float64)
        for box in boxes:
            assert np.all(box.train_lo <= y) and np.all(y <= box.train_hi), (net, lo, hi, p)
    return len(pts)


@pytest.mark.parametrize("net,prop", [("ACASXU_run2a_1_1_batch_2000.onnx", "prop_3.vnnlib"),
                                      ("ACASXU_run2a_2_3_batch_2000.onnx", "prop_4.vnnlib")])
def test_acasxu_value_bounds_contain_onnxruntime(net: str, prop: str) -> None:
    assert _check(net, prop, 200, 0) > 100


@pytest.mark.slow
def test_acasxu_all_properties() -> None:
    nets = sorted(p.name for p in ACAS.glob("ACASXU_run2a_*.onnx"))
    total = 0
    for k, prop in enumerate(sorted(p.name for p in ACAS.glob("prop_*.vnnlib"))):
        for net in nets[k::10]:
            total += _check(net, prop, 100, k)
    assert total > 1000
