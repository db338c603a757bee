"""The exact round-to-nearest and the interval cast images against the kernels' own casts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kcverify.bounds.casts import activation_cast, cast_image, rne
from kcverify.kernels.cast import round_to_format
from kcverify.kernels.formats import get_format
from kcverify.kernels.scale import quantize_activation
from kcverify.kernels.spec import CastSpec

F64 = torch.float64


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2", "bf16", "fp16", "fp32"])
def test_rne_matches_kernels(fmt: str) -> None:
    f = get_format(fmt)
    g = torch.Generator().manual_seed(1)
    x = torch.cat([torch.randn(20000, generator=g, dtype=F64) * s for s in (1e-6, 1e-2, 1, 30, 300)])
    x = x[x.abs() < f.max_finite]
    assert torch.equal(rne(x, f), round_to_format(x, f))


def test_rne_ties_to_even_and_overflow() -> None:
    f = get_format("fp8_e4m3")
    t = torch.tensor([1.0625, 1.1875, 460.0, 470.0, -470.0, 0.0], dtype=F64)
    assert rne(t, f).tolist() == [1.0, 1.25, 448.0, float("inf"), -float("inf"), 0.0]


@pytest.mark.parametrize("scale", ["dynamic_per_tensor", "dynamic_per_token", "dynamic_per_block"])
def test_activation_cast_image_contains_every_cast(scale: str) -> None:
    """For x anywhere in [lo, hi], the kernels' Q(x) (with its own dynamic scale) is inside."""
    cs = CastSpec(get_format("fp8_e4m3"), scale, 4 if scale.endswith("block") else None)
    rng = np.random.default_rng(0)
    mid = torch.tensor(rng.normal(size=(3, 5, 8)), dtype=F64)
    rad = torch.tensor(np.abs(rng.normal(size=(3, 5, 8))) * 0.05, dtype=F64)
    lo, hi = activation_cast(mid - rad, mid + rad, cs, "nearest", "left", 2.0**-24)
    for _ in range(200):
        x = mid + rad * torch.tensor(rng.uniform(-1, 1, size=mid.shape), dtype=F64)
        q, _ = quantize_activation(x, cs, -1)
        assert bool(((lo <= q) & (q <= hi)).all())


def test_point_cast_image_is_exact() -> None:
    f = get_format("fp8_e4m3")
    x = torch.tensor([0.3, -1.7, 5.0], dtype=F64)
    lo, hi = cast_image(x, x, 1.0, 1.0, f, "nearest", 0.0)
    q = round_to_format(x, f)
    assert torch.allclose(lo, q, rtol=1e-12) and torch.allclose(hi, q, rtol=1e-12)
    assert bool((hi - lo).max() <= 1e-12)


def test_static_scale_overflow_gives_no_bound() -> None:
    f = get_format("fp8_e4m3")
    x = torch.tensor([1000.0], dtype=F64)
    lo, hi = cast_image(x, x, 1.0, 1.0, f, "nearest", 0.0)
    assert lo.item() == -float("inf") and hi.item() == float("inf")
