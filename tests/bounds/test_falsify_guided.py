"""Gradient-guided roundings (kcverify.bounds.falsify.guided_pair): each rounding is one the spec
admits (within ulps(primitive) u of the exact value, up or down element by element), the gradient
points the right way (the guided pair realizes more drift than the same programs rounded to
nearest, and more than the pair guided the opposite way), and nothing it realizes passes a
certified bound."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from kcverify.bounds import certify_drift
from kcverify.bounds.falsify import _drift, _Guided, falsify, guided_pair
from kcverify.kernels.spec import parse_kernel_spec
from kcverify.models.ir import Node, load_onnx

ROOT = Path(__file__).resolve().parents[2]
TRAIN = parse_kernel_spec("train", {"compute": "fp32", "accumulate": "fp32"})
INF = parse_kernel_spec("inf", {"weights": {"format": "fp8_e4m3", "scale": "per_channel"},
                                "activations": {"format": "fp8_e4m3", "scale": "dynamic_per_tensor"},
                                "compute": "fp32", "accumulate": "fp32"})


def test_each_rounding_is_a_neighbour_the_spec_admits() -> None:
    spec = parse_kernel_spec("k", {"compute": "fp32", "accumulate": "fp32", "ulps": {"exp": 4}})
    v = torch.tensor([1.0 + 2.0**-30, -3.0 - 2.0**-28, 0.1, 7.0, 2.0**-130], dtype=torch.float64)
    d = torch.tensor([1.0, -1.0, 0.0, 1.0, -1.0])
    node = Node("n", "Exp", ("x",), ("y",))
    real = _Guided(spec, {("n", "exp", 0): d})
    r = real.round(node, "exp", v.clone())
    u = 2.0**-24
    assert torch.all((r - v).abs() <= 4 * u * v.abs() + 2.0**-149)
    rn = v.to(torch.float32).to(torch.float64)
    assert r[0] > rn[0] and r[1] < rn[1] and r[2] == rn[2] and r[3] > rn[3]  # up / down / nearest
    assert torch.all(r == r.to(torch.float32).to(torch.float64))  # stored in the compute format
    r2 = real.round(node, "exp", v.clone())  # a second occurrence has no directions: nearest
    assert torch.equal(r2, rn)
    real.reset()
    assert torch.equal(real.round(node, "exp", v.clone()), r)  # a new run starts again


def test_guided_pair_follows_the_gradient_and_stays_below_the_certificate() -> None:
    g = load_onnx(ROOT / "models" / "mlp_small.onnx")
    x = np.random.default_rng(5).normal(size=(4, 8)).astype(np.float32)
    feeds = {g.inputs[0].name: x}
    cert = certify_drift(g, TRAIN, INF, x).linf
    near = _drift(g, (_Guided(TRAIN, {}), _Guided(INF, {})), feeds, "cpu")
    (pair,) = guided_pair(g, TRAIN, INF, feeds, rounds=1)
    guided = _drift(g, pair, feeds, "cpu")
    flipped = (_Guided(TRAIN, {k: -v for k, v in pair[0].directions.items()}),
               _Guided(INF, {k: -v for k, v in pair[1].directions.items()}))
    anti = _drift(g, flipped, feeds, "cpu")
    assert pair[1].directions and all(torch.any(v != 0) for v in pair[1].directions.values())
    assert np.all(guided <= cert)
    assert np.all(guided >= near) and np.any(guided > near)
    assert np.all(guided >= anti) and np.any(guided > anti)


def test_falsify_reports_the_guided_witness_when_it_wins() -> None:
    g = load_onnx(ROOT / "models" / "mlp_small.onnx")
    x = np.random.default_rng(6).normal(size=(3, 8)).astype(np.float32)
    plain = falsify(g, TRAIN, INF, x, programs=3, guided=0)
    f = falsify(g, TRAIN, INF, x, programs=3, guided=2)
    assert np.all(f.best >= plain.best)
    assert f.evaluations == plain.evaluations + 2
    cert = certify_drift(g, TRAIN, INF, x).linf
    assert np.all(f.best <= cert)
