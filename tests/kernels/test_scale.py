"""Scales: group shapes per scheme, values amax / max as float32, zero groups, per-sample
dynamic scales, and exact weight quantization."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from kcverify.kernels.formats import get_format
from kcverify.kernels.scale import (
    activation_scale,
    quantize_activation,
    quantize_weight,
    weight_scale,
)
from kcverify.kernels.spec import CastSpec

E4M3 = get_format("fp8_e4m3")


def cs(scale: str, fmt: str = "fp8_e4m3", block: int | None = None, value: float | None = None) -> CastSpec:
    return CastSpec(get_format(fmt), scale, block, value)


def _w(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


def test_weight_scale_shapes() -> None:
    w = _w(48, 10)  # MatMul B (K, N)
    assert weight_scale(w, cs("per_tensor")).shape == (1, 1)
    assert weight_scale(w, cs("per_channel"), out_axis=-1).shape == (1, 10)
    assert weight_scale(w, cs("per_channel"), out_axis=-2).shape == (48, 1)  # constant left operand
    conv = _w(6, 3, 3, 3)
    assert weight_scale(conv, cs("per_channel"), out_axis=0).shape == (6, 1, 1, 1)
    blk = weight_scale(w, cs("per_block", block=16), out_axis=-1, reduce_axis=-2)
    assert blk.shape == (48, 10)
    # constant within each block of 16 along K, per output feature
    for k0 in (0, 16, 32):
        assert torch.all(blk[k0:k0 + 16] == blk[k0])
    assert weight_scale(w, cs("static", value=0.5)).item() == 0.5
    assert weight_scale(w, cs("none")).item() == 1.0


def test_scale_values_are_float32_amax_over_max() -> None:
    w = _w(32, 7)
    s = weight_scale(w, cs("per_channel"), out_axis=-1)
    ref = (w.double().abs().amax(dim=0) / 448.0).float().double()
    assert torch.equal(s[0], ref)
    s8 = weight_scale(w, cs("per_channel", "int8"), out_axis=-1)
    assert torch.equal(s8[0], (w.double().abs().amax(dim=0) / 127.0).float().double())
    blk = weight_scale(w, cs("per_block", block=10), out_axis=-1, reduce_axis=-2)  # 32 = 10+10+10+2
    assert torch.equal(blk[30:, 3], (w[30:, 3].double().abs().max() / 448.0).float().double().expand(2))


def test_zero_and_subnormal_groups_get_the_floor_scale() -> None:
    """amax is clamped to the spec's floor (default 1e-12) before the float32 division: an
    all-zero or subnormal group gets fl32(floor / 448), a normal float32 scale (issue 11: the
    unclamped fl32(1e-44 / 448) is 0, and 0/0 = NaN)."""
    w = _w(8, 4)
    w[:, 2] = 0
    w[:, 1] = 1e-44
    s = weight_scale(w, cs("per_channel"), out_axis=-1)
    floor = float(torch.tensor(1e-12, dtype=torch.float32))
    want = float(torch.tensor(floor, dtype=torch.float32) / torch.tensor(448.0, dtype=torch.float32))
    assert s[0, 2] == want and s[0, 1] == want and want >= 2.0**-126
    q, _ = quantize_weight(w, cs("per_channel"), out_axis=-1)
    assert torch.all(q[:, 2] == 0) and torch.all(torch.isfinite(q))
    x = torch.full((1, 4), 1e-44, dtype=torch.float64)
    assert activation_scale(x, cs("dynamic_per_tensor")).item() == want
    with_floor = CastSpec(get_format("fp8_e4m3"), "dynamic_per_tensor", amax_floor=2.0**-20)
    assert activation_scale(x, with_floor).item() == float(
        torch.tensor(2.0**-20, dtype=torch.float32) / torch.tensor(448.0, dtype=torch.float32))


def test_activation_scale_shapes() -> None:
    x = _w(3, 5, 40)
    assert activation_scale(x, cs("dynamic_per_tensor")).shape == (3, 1, 1)
    assert activation_scale(x, cs("dynamic_per_token")).shape == (3, 5, 1)
    assert activation_scale(x, cs("dynamic_per_token"), reduce_axis=-2).shape == (3, 1, 40)
    assert activation_scale(x, cs("dynamic_per_block", block=16)).shape == (3, 5, 40)
    assert activation_scale(x, cs("static", value=0.25)).shape == (1, 1, 1)


@pytest.mark.parametrize("scheme", ["dynamic_per_tensor", "dynamic_per_token", "dynamic_per_block"])
def test_dynamic_scales_are_per_sample(scheme: str) -> None:
    x = _w(2, 6, 32, seed=1)
    cast = cs(scheme, block=8 if scheme == "dynamic_per_block" else None)
    q0, s0 = quantize_activation(x, cast)
    y = x.clone()
    y[1] *= 1000.0  # sample 1 changes wildly
    q1, s1 = quantize_activation(y, cast)
    assert torch.equal(q0[0], q1[0]) and torch.equal(s0[0], s1[0])
    assert not torch.equal(q0[1], q1[1])


def test_quantize_weight_is_exact_and_matches_ml_dtypes() -> None:
    w = _w(64, 9, seed=2)
    q, s = quantize_weight(w, cs("per_channel"), out_axis=-1)
    wn, sn = w.double().numpy(), s.numpy()
    # W / s is float64-exact-enough (see cast.py); ml_dtypes rounds the float32-representable part
    steps = (wn / sn).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    assert np.array_equal(q.numpy(), steps * sn)
    assert np.abs(steps).max() == 448.0  # the amax element of each column maps to max
    assert q.dtype == torch.float64
    # |Q(W) - W| <= u |W| + eta * s elementwise
    err = (q - w.double()).abs()
    assert torch.all(err <= E4M3.u * w.double().abs() + E4M3.eta * s)


def test_per_block_quantization_bounds_each_block() -> None:
    w = _w(40, 3, seed=3)
    w[:8] *= 100.0  # one block of large values must not crush the others
    q, s = quantize_weight(w, cs("per_block", "int4", block=8), out_axis=-1, reduce_axis=-2)
    assert torch.all((q - w.double()).abs() <= s / 2 + 1e-12)
    assert s[:8].min() > 10 * s[8:].max()
