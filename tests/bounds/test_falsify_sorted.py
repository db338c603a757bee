"""The falsifier's adversarial per-element summation order (realize.py's ``sorted``): a
permutation of each row, rounded like any conforming order, and inside the certified sets."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from kcverify.bounds import certify_drift
from kcverify.bounds.falsify import falsify, program_pairs
from kcverify.kernels.realize import ORDERS, Realization, _sorted_terms
from kcverify.kernels.spec import parse_kernel_spec
from kcverify.models.ir import load_onnx

ROOT = Path(__file__).resolve().parents[2]
TRAIN = parse_kernel_spec("train", {"compute": "fp32", "accumulate": "fp32"})
INF = parse_kernel_spec("inf", {"weights": {"format": "fp8_e4m3", "scale": "per_channel"},
                                "activations": {"format": "fp8_e4m3", "scale": "dynamic_per_tensor"},
                                "compute": "fp32", "accumulate": "fp32"})
BF16 = parse_kernel_spec("acc", {"compute": "fp32", "accumulate": "bf16"})


def test_sorted_is_a_per_row_permutation() -> None:
    t = torch.tensor([[0.5, -3.0, 2.0, 1.0], [-1.0, -4.0, 0.25, 2.0]], dtype=torch.float64)
    got = _sorted_terms(t)
    assert got.tolist() == [[2.0, 1.0, 0.5, -3.0], [-4.0, -1.0, 2.0, 0.25]]
    assert "sorted" in ORDERS  # a conforming order like the others (random programs draw it)


def test_sorted_absorbs_small_terms_where_another_order_is_exact() -> None:
    # bf16 accumulator (8 bits): 1 + 8 * 2^-9 = 1 + 2^-6 is exact when the small terms go first
    terms = torch.tensor([[2.0**-9] * 8 + [1.0]], dtype=torch.float64)
    seq = Realization(BF16, order="sequential")._accumulate(terms, {}, torch.Generator())
    adv = Realization(BF16, order="sorted")._accumulate(terms, {}, torch.Generator())
    assert seq.item() == 1 + 2.0**-6 and adv.item() == 1.0
    n, u = terms.shape[-1], 2.0**-8
    assert abs(adv.item() - (1 + 2.0**-6)) <= (n - 1) * u * float(terms.abs().sum())


def test_sorted_pairs_stay_inside_the_certified_sets() -> None:
    g = load_onnx(ROOT / "models" / "mlp_small.onnx")
    x = np.random.default_rng(3).normal(size=(3, 8)).astype(np.float32)
    cert = certify_drift(g, TRAIN, INF, x).linf
    pairs = program_pairs(TRAIN, INF, 5)
    assert [p[0].order for p in pairs[3:5]] == ["sorted", "sorted"]
    old = falsify(g, TRAIN, INF, x, programs=3)
    new = falsify(g, TRAIN, INF, x, programs=5)
    assert np.all(new.best <= cert) and np.all(new.best >= old.best)
