"""The falsifier realizes drifts with conforming programs: never above a certified bound, and
(on points with an fp32 compute format) within a hair of the sharp interval certificate."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kcverify.bounds import Region, certify_drift
from kcverify.bounds.falsify import falsify, program_pairs
from kcverify.kernels.spec import parse_kernel_spec
from kcverify.models.ir import load_onnx

ROOT = Path(__file__).resolve().parents[2]
TRAIN = parse_kernel_spec("train", {"compute": "fp32", "accumulate": "fp32"})
INF = parse_kernel_spec("inf", {"weights": {"format": "fp8_e4m3", "scale": "per_channel"},
                                "activations": {"format": "fp8_e4m3", "scale": "dynamic_per_tensor"},
                                "compute": "fp32", "accumulate": "fp32"})


def test_falsifier_below_certificate_and_sharp_on_points() -> None:
    g = load_onnx(ROOT / "models" / "mlp_small.onnx")
    x = np.random.default_rng(1).normal(size=(3, 8)).astype(np.float32)
    cert = certify_drift(g, TRAIN, INF, x).linf
    f = falsify(g, TRAIN, INF, x, programs=4)
    assert np.all(f.best <= cert)
    assert np.all(cert <= 1.01 * f.best)  # semantics §5: exact-cast intervals are sharp on points
    assert all(w[0] and w[1] for w in f.witness)


def test_falsifier_searches_the_region() -> None:
    g = load_onnx(ROOT / "models" / "mlp_tiny.onnx")
    x = np.random.default_rng(2).normal(size=(2, 4)).astype(np.float32)
    region = Region("input", "linf", 0.05)
    cert = certify_drift(g, TRAIN, INF, x, region=region).linf
    point = falsify(g, TRAIN, INF, x, programs=2).best
    f = falsify(g, TRAIN, INF, x, region=region, programs=2, steps=3)
    assert np.all(f.best <= cert)
    assert np.all(f.best >= point * 0.5) and f.evaluations >= 10


def test_program_pairs_are_adversarial_first() -> None:
    pairs = program_pairs(TRAIN, INF, 5, seed=3)
    assert (pairs[0][0].rounding, pairs[0][1].rounding) == ("down", "up")
    assert len(pairs) == 5
