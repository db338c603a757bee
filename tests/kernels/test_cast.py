"""Exact casts: every fp8 code and every tie against ml_dtypes bit patterns, bf16/fp16 against
ml_dtypes/numpy, int8/int4, overflow, the rounding modes, and exactness of cast(t / s)."""

from __future__ import annotations

from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch

from kcverify.errors import KernelSpecError
from kcverify.kernels.cast import (
    add_nearest,
    cast_grid,
    cast_to,
    mul_nearest,
    round_to_format,
)
from kcverify.kernels.formats import get_format

FP8 = [("fp8_e4m3", ml_dtypes.float8_e4m3fn, torch.float8_e4m3fn),
       ("fp8_e5m2", ml_dtypes.float8_e5m2, torch.float8_e5m2)]


def _codes(mld: type) -> np.ndarray:
    """All 256 codes decoded by ml_dtypes, as float64."""
    return np.arange(256, dtype=np.uint8).view(mld).astype(np.float64)


def _bits(values: np.ndarray, mld: type) -> np.ndarray:
    """ml_dtypes bit patterns of float32-representable values (single rounding from float32)."""
    return values.astype(np.float32).astype(mld).view(np.uint8)


def _cast_bits(values: np.ndarray, name: str, mld: type) -> np.ndarray:
    out = cast_to(torch.tensor(values, dtype=torch.float64), name, saturate=False).numpy()
    return out.astype(np.float32).astype(mld).view(np.uint8)


@pytest.mark.parametrize("name,mld,tdt", FP8)
def test_every_fp8_code_is_a_fixed_point(name: str, mld: type, tdt: torch.dtype) -> None:
    v = _codes(mld)
    fin = np.isfinite(v)
    codes = np.arange(256, dtype=np.uint8)[fin]
    assert np.array_equal(_cast_bits(v[fin], name, mld), codes)  # bit-exact, -0 included


@pytest.mark.parametrize("name,mld,tdt", FP8)
def test_fp8_ties_and_near_ties_match_ml_dtypes(name: str, mld: type, tdt: torch.dtype) -> None:
    v = _codes(mld)
    pos = np.unique(v[np.isfinite(v) & (v >= 0)])
    lo, hi = pos[:-1], pos[1:]
    mid = (lo + hi) / 2  # exact, and float32-representable: ml_dtypes rounds it once
    for sign in (1.0, -1.0):
        m = sign * mid
        assert np.array_equal(_cast_bits(m, name, mld), _bits(m, mld))
        # ties go to the neighbour with an even code
        assert np.all(_cast_bits(m, name, mld) % 2 == 0)
        # one float32 ulp either side: ml_dtypes rounds these once, too
        up = np.nextafter(m.astype(np.float32), np.float32(np.inf)).astype(np.float64)
        dn = np.nextafter(m.astype(np.float32), np.float32(-np.inf)).astype(np.float64)
        for w in (up, dn):
            assert np.array_equal(_cast_bits(w, name, mld), _bits(w, mld))
    # float64 nudges below float32 resolution: the exact neighbour (ml_dtypes, like torch, goes
    # through float32 and would round these twice)
    r_up = cast_to(torch.tensor(mid * (1 + 2.0**-40)), name).numpy()
    r_dn = cast_to(torch.tensor(mid * (1 - 2.0**-40)), name).numpy()
    assert np.array_equal(r_up, hi) and np.array_equal(r_dn, lo)


@pytest.mark.parametrize("name,mld,tdt", FP8)
def test_torch_fp8_casts_from_float32_agree_with_ml_dtypes(name: str, mld: type, tdt: torch.dtype) -> None:
    v = _codes(mld)
    pos = np.unique(v[np.isfinite(v) & (v >= 0)])
    pts = np.concatenate([pos, (pos[1:] + pos[:-1]) / 2])
    pts = np.concatenate([pts, -pts]).astype(np.float32)
    ours = cast_to(torch.tensor(pts), name).numpy()
    via_torch = torch.tensor(pts).to(tdt).to(torch.float64).numpy()
    assert np.array_equal(ours, via_torch)
    assert np.array_equal(ours, pts.astype(mld).astype(np.float64))


def test_torch_and_ml_dtypes_round_twice_from_float64_but_cast_to_does_not() -> None:
    x = 1.0 + 2.0**-8 + 2.0**-40  # just above the bf16 midpoint between 1 and 1 + 2^-7
    assert cast_to(torch.tensor([x], dtype=torch.float64), "bf16").item() == 1.0 + 2.0**-7
    assert torch.tensor([x], dtype=torch.float64).to(torch.bfloat16).item() == 1.0  # float32 first


@pytest.mark.parametrize("name,ref", [("bf16", ml_dtypes.bfloat16), ("fp16", np.float16)])
def test_bf16_fp16_match_reference_on_float32(name: str, ref: type) -> None:
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(20000) * np.exp2(rng.integers(-30, 30, 20000))).astype(np.float32)
    fmt = get_format(name)
    x = x[np.abs(x) < fmt.max_finite]
    ours = cast_to(torch.tensor(x), name).numpy()
    assert np.array_equal(ours, x.astype(ref).astype(np.float64))
    # ties between neighbours (float32-exact) go to even as in the reference
    g = np.unique(ours[np.isfinite(ours)])
    mid = ((g[1:] + g[:-1]) / 2).astype(np.float32)
    assert np.array_equal(cast_to(torch.tensor(mid), name).numpy(), mid.astype(ref).astype(np.float64))


def test_fp16_subnormals_and_fp32_from_float64() -> None:
    tiny = np.array([2.0**-25, 3 * 2.0**-25, 2.0**-24 * 1.5, 2.0**-26], dtype=np.float64)
    assert np.array_equal(cast_to(torch.tensor(tiny), "fp16").numpy(), tiny.astype(np.float16).astype(np.float64))
    rng = np.random.default_rng(2)
    y = rng.standard_normal(5000) * 1e3
    assert np.array_equal(cast_to(torch.tensor(y), "fp32").numpy(), y.astype(np.float32).astype(np.float64))


def test_overflow_saturates_fp8_by_default_and_follows_the_format_otherwise() -> None:
    x = torch.tensor([447.0, 460.0, 464.0, 470.0, 1e6, np.inf, -1e6, -np.inf])
    sat = cast_to(x, "fp8_e4m3").numpy()
    assert np.array_equal(sat, [448, 448, 448, 448, 448, 448, -448, -448])
    raw = cast_to(x, "fp8_e4m3", saturate=False).numpy()
    assert np.array_equal(raw[:3], [448, 448, 448]) and np.isnan(raw[3:]).all()
    # ml_dtypes agrees on the non-saturating e4m3fn behaviour (float32-exact inputs)
    ref = x.numpy().astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    assert np.array_equal(np.isnan(ref), np.isnan(raw))
    e5 = cast_to(torch.tensor([61439.0, 61440.0, -1e9]), "fp8_e5m2", saturate=False).numpy()
    assert e5[0] == 57344 and e5[1] == np.inf and e5[2] == -np.inf
    assert cast_to(torch.tensor([1e9]), "fp8_e5m2").item() == 57344
    # IEEE directed rounding toward zero stops at max
    assert cast_to(torch.tensor([70000.0]), "fp16", rounding="down").item() == 65504
    assert cast_to(torch.tensor([70000.0]), "fp16", rounding="up").item() == np.inf
    assert np.isnan(cast_to(torch.tensor([np.nan]), "fp8_e4m3").item())


@pytest.mark.parametrize("name,q", [("int8", 127), ("int4", 7)])
def test_int_casts_are_symmetric_round_half_even(name: str, q: int) -> None:
    rng = np.random.default_rng(3)
    s = np.float32(0.037)
    t = (rng.standard_normal(4000) * 4).astype(np.float32)
    t[:6] = s * np.array([0.5, 1.5, 2.5, -0.5, -2.5, 3 * q])  # ties and overflow
    ours = cast_to(torch.tensor(t), name, float(s)).numpy()
    ref = np.float64(s) * np.clip(np.round(t.astype(np.float64) / np.float64(s)), -q, q)
    assert np.array_equal(ours, ref)
    steps = cast_grid(torch.tensor(t), name, float(s)).numpy()
    assert steps.min() >= -q and steps.max() <= q and np.all(steps == np.round(steps))
    if name == "int4":
        assert np.array_equal(steps, steps.astype(ml_dtypes.int4).astype(np.float64))


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2", "bf16", "fp16", "int8"])
def test_directed_and_random_rounding_pick_a_neighbour(name: str) -> None:
    rng = np.random.default_rng(4)
    x = torch.tensor(rng.standard_normal(3000) * 3)
    nearest = cast_to(x, name)
    up = cast_to(x, name, rounding="up")
    down = cast_to(x, name, rounding="down")
    assert torch.all(down <= x) and torch.all(x <= up)
    assert torch.all((nearest == up) | (nearest == down))
    inexact = up != down
    assert inexact.any()
    # up and down are adjacent: nothing representable strictly between them
    assert torch.all(cast_to((up + down) / 2, name, rounding="down")[inexact] == down[inexact])
    g = torch.Generator().manual_seed(0)
    rnd = cast_to(x, name, rounding="random", generator=g)
    assert torch.all((rnd == up) | (rnd == down))
    assert (rnd[inexact] == up[inexact]).any() and (rnd[inexact] == down[inexact]).any()
    with pytest.raises(KernelSpecError):
        cast_to(x, name, rounding="sideways")


def _exact_rne(value: Fraction, grid: list[Fraction]) -> Fraction:
    """Round-to-nearest-even of a rational on a sorted grid of fp8 values (codes alternate parity)."""
    import bisect

    i = bisect.bisect_left(grid, value)
    if i < len(grid) and grid[i] == value:
        return value
    lo, hi = grid[i - 1], grid[i]
    if value - lo < hi - value:
        return lo
    if value - lo > hi - value:
        return hi
    return lo if (i - 1) % 2 == 0 else hi  # with the sorted non-negative grid, even index = even code


def test_cast_of_float32_quotient_is_the_exact_cast() -> None:
    """cast(t / s) with the quotient in float64 equals the cast of the rational t / s."""
    v = _codes(ml_dtypes.float8_e4m3fn)
    grid = sorted({Fraction(float(a)) for a in v[np.isfinite(v) & (v >= 0)]})
    rng = np.random.default_rng(5)
    s = np.float32(rng.uniform(0.001, 0.1))
    # values placed on and near scaled midpoints, in float32
    mids = [(grid[i] + grid[i + 1]) / 2 for i in range(len(grid) - 1)]
    t = np.array([float(m) * float(s) for m in mids], dtype=np.float32)
    t = np.concatenate([t, np.nextafter(t, np.float32(1e9)), np.nextafter(t, np.float32(0)),
                        rng.uniform(0, 448 * float(s), 500).astype(np.float32)])
    got = cast_grid(torch.tensor(t), "fp8_e4m3", float(s)).numpy()
    for ti, gi in zip(t, got):
        q = Fraction(float(ti)) / Fraction(float(s))
        if q > grid[-1]:
            continue
        assert Fraction(float(gi)) == _exact_rne(q, grid), (ti, gi)


def test_error_free_add_and_mul_round_once() -> None:
    fp32 = get_format("fp32")
    # 1 + (2^-24 + 2^-71): float64 alone would drop 2^-71 and land on the fp32 midpoint
    a = torch.tensor([1.0])
    b = torch.tensor([2.0**-24 + 2.0**-71], dtype=torch.float64)
    assert add_nearest(a.double(), b, fp32).item() == 1.0 + 2.0**-23
    assert round_to_format(a.double() + b, fp32).item() == 1.0  # the double rounding avoided above
    x = torch.tensor([1.0 + 2.0**-23], dtype=torch.float64)
    y = torch.tensor([1.0 + 2.0**-30], dtype=torch.float64)
    exact = Fraction(1 + 2**-23) * Fraction(1 + 2**-30)
    got = mul_nearest(x, y, fp32).item()
    assert abs(Fraction(got) - exact) <= Fraction(2**-24) * exact


def test_fast_integer_rounding_is_half_to_even() -> None:
    from kcverify.kernels.cast import _floor, _rne

    rng = np.random.default_rng(6)
    y = rng.standard_normal(20000) * np.exp2(rng.integers(-5, 60, 20000))
    y[:8] = [0.5, 1.5, 2.5, -0.5, -2.5, 2.0**51 + 0.5, 2.0**51 + 1.5, -(2.0**52) - 1]
    t = torch.tensor(y)
    assert torch.equal(_rne(t), torch.round(t)) and torch.equal(_floor(t), torch.floor(t))
    assert torch.signbit(_rne(torch.tensor([-0.25], dtype=torch.float64))).item()
    from kcverify.kernels.cast import _ceil

    assert torch.equal(_ceil(t), torch.ceil(t))
    z = torch.tensor([-0.0, 0.0, -0.5, 0.5], dtype=torch.float64)
    assert torch.equal(_floor(z), torch.floor(z)) and torch.equal(_ceil(z), torch.ceil(z))


def test_fp32_fast_path_agrees_with_the_grid_rounding() -> None:
    from kcverify.kernels.cast import _round_nearest_dd_fp32, _round_nearest_dd_grid, two_sum

    fp32 = get_format("fp32")
    rng = np.random.default_rng(8)
    a = rng.standard_normal(50000) * np.exp2(rng.integers(-140, 120, 50000))
    b = rng.standard_normal(50000) * np.exp2(rng.integers(-140, 120, 50000))
    # exact fp32 midpoints nudged by tiny float64 parts, and overflow
    m32 = rng.standard_normal(1000).astype(np.float32)
    m = (m32.astype(np.float64) + np.nextafter(m32, np.float32(np.inf)).astype(np.float64)) / 2
    a[:1000], b[:1000] = m, rng.choice([-1.0, 0.0, 1.0], 1000) * np.abs(m) * 2.0**-60
    a[1000:1010], b[1000:1010] = 3.4e38, 1e37
    hi, lo = two_sum(torch.tensor(a), torch.tensor(b))
    fast = _round_nearest_dd_fp32(hi, lo)
    grid = _round_nearest_dd_grid(hi, lo, fp32)
    assert torch.equal(fast, grid)
    assert torch.isinf(fast[1000:1010]).all()
