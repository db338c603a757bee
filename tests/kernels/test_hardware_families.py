"""Hopper FP8 tensor cores and OCP MX / NVFP4 block scales against programs written from the
public descriptions alone (docs/kernels.md), not from kcverify/kernels/realize.py:

* sm90_fp8 (MMA-Sim's Hopper wgmma model; DeepSeek-V3 §3.3.2): per 32-wide K group the
  accumulator and the products are aligned to the largest exponent (a subnormal fp8 value has
  its format's least exponent), truncated to 13 fraction bits there, summed exactly, and the sum
  rounded toward zero to 13 fraction bits; every ``promote`` products the accumulator is added
  into fp32 (round to nearest) and restarts from zero; split-K parts are accumulated alone.
  Python ints and fractions, one output at a time.
* OCP MX v1.0: X = 2^(floor(log2 amax) - emax_elem) per 32 elements, elements RNE(V / X)
  clamped to the element format's max (ml_dtypes' fp4 / fp6 / fp8 casts).
* NVFP4: S = fl32(amax / (448 * 6)), per 16 elements d = e4m3(amax_b / (6 S)), s = d S.
"""

from __future__ import annotations

import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch

from kcverify.bounds import certify_drift
from kcverify.kernels.realize import Realization, run_kernel
from kcverify.kernels.scale import quantize_weight
from kcverify.kernels.spec import parse_kernel_spec
from tests.helpers import matmul_model

E4M3 = ml_dtypes.float8_e4m3fn
FP32 = parse_kernel_spec("train", {"compute": "fp32", "accumulate": "fp32"})
CASTS = {"weights": {"format": "fp8_e4m3", "scale": "per_channel"},
         "activations": {"format": "fp8_e4m3", "scale": "dynamic_per_tensor"}}
SM90 = parse_kernel_spec("inf", {"compute": "fp32", **CASTS,
                                 "accumulate": {"mma": "sm90_fp8", "promote": 128},
                                 "split_k": [1, 2, 4]})
ANY = parse_kernel_spec("inf", {"compute": "fp32", **CASTS, "accumulate": "fp32"})


def _rn32(v: Fraction) -> Fraction:
    if v == 0:
        return Fraction(0)
    a = abs(v)
    e = max(math.floor(math.log2(a)), -126)
    while Fraction(2) ** e > a:
        e -= 1
    while Fraction(2) ** (e + 1) <= a:
        e += 1
    q = Fraction(2) ** (max(e, -126) - 23)
    n, r = divmod(a, q)
    if r > q / 2 or (r == q / 2 and n % 2):
        n += 1
    return (1 if v > 0 else -1) * n * q


def _exp(x: Fraction, emin: int) -> int | None:
    if x == 0:
        return None
    e = math.frexp(float(abs(x)))[1] - 1
    return max(e, emin)


def _tc_group(c: Fraction, prods: list[tuple[Fraction, int | None]]) -> Fraction:
    terms = [(c, _exp(c, -126))] + prods
    exps = [e for t, e in terms if t != 0 and e is not None]
    if not exps:
        return Fraction(0)
    tau = Fraction(2) ** (max(exps) - 13)
    total = sum(int(t / tau) * tau for t, _ in terms)  # int(): toward zero
    if total == 0:
        return Fraction(0)
    e = _exp(total, -126)
    q = Fraction(2) ** (e - 13)
    return int(total / q) * q


def _sm90_row(qa: list[float], qb: list[float], split: int, promote: int, reverse: bool
              ) -> Fraction:
    k = len(qa)
    step = -(-k // split)
    step = -(-step // 32) * 32
    chunks = []
    for p0 in range(0, k, step):
        p1 = min(k, p0 + step)
        for c0 in range(p0, p1, promote):
            c1 = min(p1, c0 + promote)
            acc = Fraction(0)
            for g0 in range(c0, c1, 32):
                prods = [(Fraction(qa[i]) * Fraction(qb[i]),
                          None if qa[i] * qb[i] == 0 else
                          _exp(Fraction(qa[i]), -6) + _exp(Fraction(qb[i]), -6))
                         for i in range(g0, min(c1, g0 + 32))]
                acc = _tc_group(acc, prods)
            chunks.append(acc)
    if reverse:
        chunks = chunks[::-1]
    total = _rn32(chunks[0])
    for v in chunks[1:]:
        total = _rn32(total + v)
    return total


def _quant(x: np.ndarray, w: np.ndarray):
    sx = float(np.float32(np.float32(np.abs(x).max()) / np.float32(448)))
    sw = (np.abs(w).max(axis=0).astype(np.float32) / np.float32(448)).astype(np.float64)
    return sx, (x / sx).astype(E4M3).astype(np.float64), sw, (w / sw).astype(E4M3).astype(np.float64)


def _programs(x: np.ndarray, w: np.ndarray, splits, reverse: bool) -> dict[int, np.ndarray]:
    sx, qx, sw, qw = _quant(x, w)
    out = {}
    for split in splits:
        y = np.empty(w.shape[1])
        for j in range(w.shape[1]):
            acc = _sm90_row(list(qx), list(qw[:, j]), split, 128, reverse)
            y[j] = float(_rn32(Fraction(sx) * Fraction(float(sw[j])) * acc))
        out[split] = y
    return out


def _data(seed: int, k: int = 320, n: int = 6):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
    x = rng.standard_normal((1, k)) * np.exp(rng.uniform(-4, 2, size=(1, k)))  # wide exponents
    return x.astype(np.float32), w


@pytest.mark.parametrize("seed", [0, 1])
def test_sm90_realization_is_the_hardware_model(seed: int) -> None:
    x, w = _data(seed)
    g = matmul_model(w)
    want = _programs(x[0].astype(np.float64), w.astype(np.float64), (1, 2, 4), reverse=False)
    for split in (1, 2, 4):
        got = run_kernel(g, SM90, {"x": x}, order="sequential", split=split)["y"][0].numpy()
        assert np.array_equal(got, want[split]), (split, got - want[split])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sm90_programs_lie_in_the_sm90_bound_and_not_in_the_fp32_one(seed: int) -> None:
    x, w = _data(seed)
    g = matmul_model(w)
    res = certify_drift(g, FP32, SM90, {"x": x}, domain="interval")
    any_res = certify_drift(g, FP32, ANY, {"x": x}, domain="interval")
    lo, hi = res.outputs["y"].inf_lo[0], res.outputs["y"].inf_hi[0]
    a_lo, a_hi = any_res.outputs["y"].inf_lo[0], any_res.outputs["y"].inf_hi[0]
    escaped = 0
    for reverse in (False, True):
        for y in _programs(x[0].astype(np.float64), w.astype(np.float64), (1, 2, 4),
                           reverse).values():
            assert np.all(lo <= y) and np.all(y <= hi), (lo - y, y - hi)
            escaped += int(np.sum((y < a_lo) | (y > a_hi)))
    # the fp32-any-order family does not contain the tensor cores (the issue's unsoundness)
    assert escaped > 0
    assert float(np.median((hi - lo) / (a_hi - a_lo))) > 10


def test_sm90_truncation_is_one_sided_toward_zero() -> None:
    """32 equal products 1 + 2^-7 and one 2^8 in a group: each small term loses its low bits."""
    big = [(Fraction(256), 8)]
    small = [(Fraction(1) + Fraction(1, 128), 0)] * 31
    got = _tc_group(Fraction(0), big + small)
    exact = 256 + 31 * (1 + Fraction(1, 128))
    assert got < exact and exact - got < 32 * Fraction(2) ** (8 - 13)
    r = Realization(SM90, order="sequential", split=1)
    del r
    from kcverify.kernels.realize import sm90_step

    p = torch.tensor([[float(t) for t, _ in big + small]], dtype=torch.float64)
    e = torch.tensor([[float(e) for _, e in big + small]], dtype=torch.float64)
    assert float(sm90_step(torch.zeros(1, dtype=torch.float64), p, e)[0]) == float(got)


# --- OCP MX and NVFP4 ---------------------------------------------------------------------------
_ML = {"fp4_e2m1": ml_dtypes.float4_e2m1fn, "fp6_e2m3": ml_dtypes.float6_e2m3fn,
       "fp6_e3m2": ml_dtypes.float6_e3m2fn, "fp8_e4m3": ml_dtypes.float8_e4m3fn}
_MAX = {"fp4_e2m1": 6.0, "fp6_e2m3": 7.5, "fp6_e3m2": 28.0, "fp8_e4m3": 448.0}
_EMAX = {"fp4_e2m1": 2, "fp6_e2m3": 2, "fp6_e3m2": 4, "fp8_e4m3": 8}


def _mx_reference(w: np.ndarray, fmt: str, block: int = 32) -> np.ndarray:
    """OCP MX v1.0 §6.3 on the columns of w (K, N), blocks along K."""
    out = np.empty_like(w, dtype=np.float64)
    for j in range(w.shape[1]):
        for k0 in range(0, w.shape[0], block):
            v = w[k0:k0 + block, j].astype(np.float64)
            amax = float(np.abs(v).max())
            e = -127 if amax == 0 else min(127, max(-127, math.floor(math.log2(amax)) - _EMAX[fmt]))
            x = 2.0 ** e
            p = np.clip(v / x, -_MAX[fmt], _MAX[fmt]).astype(_ML[fmt]).astype(np.float64)
            out[k0:k0 + block, j] = p * x
    return out


def _nv_reference(w: np.ndarray, block: int = 16) -> np.ndarray:
    s_t = float(np.float32(np.float32(np.abs(w).max()) / np.float32(2688.0)))
    out = np.empty_like(w, dtype=np.float64)
    for j in range(w.shape[1]):
        for k0 in range(0, w.shape[0], block):
            v = w[k0:k0 + block, j].astype(np.float64)
            d = float(np.array(np.abs(v).max() / (6.0 * s_t)).astype(E4M3))
            s = d * s_t
            p = np.zeros_like(v) if s == 0 else np.clip(v / s, -6, 6).astype(
                ml_dtypes.float4_e2m1fn).astype(np.float64)
            out[k0:k0 + block, j] = p * s
    return out


@pytest.mark.parametrize("fmt", ["fp4_e2m1", "fp6_e2m3", "fp6_e3m2", "fp8_e4m3"])
def test_mx_weights_match_the_ocp_rules_on_every_block(fmt: str) -> None:
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((256, 12)) * np.exp(rng.uniform(-6, 6, size=(256, 12)))).astype(np.float32)
    w[:32, 0] = 0.0  # an all-zero block
    cs = parse_kernel_spec("k", {"weights": {"format": fmt, "scale": "mx"}}).weights
    q, _ = quantize_weight(torch.from_numpy(w.astype(np.float64)), cs, out_axis=-1, reduce_axis=-2)
    assert np.array_equal(q.numpy(), _mx_reference(w, fmt))


def test_nvfp4_weights_match_the_recipe_on_every_block() -> None:
    rng = np.random.default_rng(8)
    w = (rng.standard_normal((128, 10)) * np.exp(rng.uniform(-3, 3, size=(128, 10)))).astype(np.float32)
    cs = parse_kernel_spec("k", {"weights": {"format": "fp4_e2m1", "scale": "nv"}}).weights
    q, _ = quantize_weight(torch.from_numpy(w.astype(np.float64)), cs, out_axis=-1, reduce_axis=-2)
    assert np.array_equal(q.numpy(), _nv_reference(w))


@pytest.mark.parametrize("weights", [{"format": "fp4_e2m1", "scale": "mx"},
                                     {"format": "fp4_e2m1", "scale": "nv"},
                                     {"format": "fp6_e3m2", "scale": "mx"}])
@pytest.mark.parametrize("acts", [None, {"format": "fp8_e4m3", "scale": "mx"},
                                  {"format": "fp4_e2m1", "scale": "nv"}])
def test_block_scaled_realizations_lie_in_the_bounds(weights: dict, acts: dict | None) -> None:
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((64, 5)) * 0.2).astype(np.float32)
    x = (rng.standard_normal((3, 64)) * np.exp(rng.uniform(-2, 2, size=(3, 64)))).astype(np.float32)
    raw = {"compute": "fp32", "accumulate": "fp32", "weights": weights}
    if acts is not None:
        raw["activations"] = acts
    spec = parse_kernel_spec("inf", raw)
    g = matmul_model(w)
    res = certify_drift(g, FP32, spec, {"x": x}, domain="interval")
    box = res.outputs["y"]
    assert np.all(np.isfinite(res.linf))
    ref = x.astype(np.float64) @ w.astype(np.float64)
    for order in ("sequential", "reverse", "pairwise", "sorted"):
        y = run_kernel(g, spec, {"x": x}, order=order)["y"].numpy()
        assert np.all(box.inf_lo <= y) and np.all(y <= box.inf_hi), order
        assert np.all(np.abs(y - ref) <= res.linf[:, None] + np.abs(ref) * 2**-20 + 1e-30)
