"""External known-answer suite: ACAS Xu networks (old-opset ONNX) on the VNN-LIB property input
boxes. The interval value bounds of the fp32 kernel must contain the outputs onnxruntime computes
(an fp32 program with exact products, so a conforming one) at sampled points of each box."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from kcverify.bounds import certify_drift
from kcverify.kernels.spec import parse_kernel_spec
from kcverify.models.ir import load_onnx

ACAS = Path("/work/shared/data/acasxu")
FP32 = parse_kernel_spec("train", {"compute": "fp32", "accumulate": "fp32"})
BF16 = parse_kernel_spec("inf", {"compute": "bf16", "accumulate": "fp32",
                                 "weights": {"format": "fp8_e4m3", "scale": "per_channel"}})

pytestmark = pytest.mark.skipif(not ACAS.exists(), reason="ACAS Xu data not available")


def input_box(path: Path) -> tuple[np.ndarray, np.ndarray] | None:
    """(lo, hi) of X_0..X_4 from a VNN-LIB file's top-level (<= X_i c) / (>= X_i c) assertions;
    None for a property whose input set is not one box (a disjunction)."""
    lo, hi = np.full(5, -np.inf), np.full(5, np.inf)
    for op, i, c in re.findall(r"\(assert \((<=|>=) X_(\d+) ([-0-9.eE+]+)\)\)", path.read_text()):
        if op == "<=":
            hi[int(i)] = float(c)
        else:
            lo[int(i)] = float(c)
    if not (np.all(np.isfinite(lo)) and np.all(np.isfinite(hi))):
        return None
    return lo, hi


def _check(net: str, prop: str, n: int, seed: int) -> int:
    import onnxruntime as ort

    g = load_onnx(ACAS / net)
    box_ = input_box(ACAS / prop)
    if box_ is None:
        return 0
    lo, hi = box_
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
            assert np.all(box.train_lo <= y) and np.all(y <= box.train_hi), (net, prop, p)
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
