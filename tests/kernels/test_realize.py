"""Realizations: every drawn program stays within the spec's error model (sampled against exact
rational arithmetic), different programs give different results, seeds reproduce programs, and
hand-written references agree."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kcverify.errors import KernelSpecError
from kcverify.kernels.cast import cast_to
from kcverify.kernels.formats import gamma, get_format
from kcverify.kernels.realize import ORDERS, Realization, random_realization
from kcverify.kernels.scale import quantize_activation, quantize_weight
from kcverify.kernels.spec import KernelSpec, parse_kernel_spec
from kcverify.models.ir import Node

MM = Node("mm", "MatMul", ("a", "b"), ("y",))


def spec(**raw: object) -> KernelSpec:
    return parse_kernel_spec("k", raw)


def _exact_matmul(a: np.ndarray, b: np.ndarray) -> tuple[list[list[Fraction]], np.ndarray]:
    """Exact A @ B (2-D, float64 entries as rationals) and sum |a_ik b_kj| (float64, rounded up-ish)."""
    fa = [[Fraction(float(x)) for x in row] for row in a]
    fb = [[Fraction(float(x)) for x in row] for row in b]
    m, k, n = a.shape[0], a.shape[1], b.shape[1]
    exact = [[sum((fa[i][t] * fb[t][j] for t in range(k)), Fraction(0)) for j in range(n)] for i in range(m)]
    mag = (np.abs(a) @ np.abs(b)) * (1 + 2.0**-40)
    return exact, mag


def _operands(rng: np.random.Generator, m: int, k: int, n: int, hard: bool) -> tuple[torch.Tensor, torch.Tensor]:
    a = rng.standard_normal((m, k))
    b = rng.standard_normal((k, n))
    if hard:  # wide dynamic range and cancellation: the accumulation order matters
        a *= np.exp2(rng.integers(-8, 9, (m, k)))
        a[:, 1::2] = -a[:, 0::2][:, : a[:, 1::2].shape[1]] * (1 + 2.0**-7)
    return torch.tensor(a, dtype=torch.float32).double(), torch.tensor(b, dtype=torch.float32).double()


SPECS = {
    "fp32": dict(compute="fp64", accumulate="fp32"),
    "bf16acc": dict(compute="fp64", accumulate="bf16"),
    "fp16acc-fp8": dict(compute="fp64", accumulate="fp16",
                        weights={"format": "fp8_e4m3", "scale": "per_channel"},
                        activations={"format": "fp8_e5m2", "scale": "dynamic_per_token"}),
    "bf16acc-fp8-block": dict(compute="fp64", accumulate="bf16",
                              weights={"format": "fp8_e4m3", "scale": "per_block", "block_size": 8},
                              activations={"format": "fp8_e4m3", "scale": "dynamic_per_block", "block_size": 12}),
    "bf16acc-int4-any": dict(compute="fp64", accumulate="bf16", rounding="any",
                             weights={"format": "int4", "scale": "per_channel"},
                             activations={"format": "fp8_e4m3", "scale": "dynamic_per_tensor"}),
}


def _dequantized(sp: KernelSpec, r: Realization, a: torch.Tensor, b: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The operands the realization multiplies, rebuilt from the public casts (exact, float64)."""
    fa = (r._operand(MM, 0, a, "activations", "left"))  # same casts, incl. the seeded rounding
    qa = (fa.q * fa.s).numpy()
    if sp.weights is None:
        qb = cast_to(b, sp.compute).numpy()
    else:
        qb = quantize_weight(b, sp.weights, out_axis=-1, reduce_axis=-2)[0].numpy()
    return qa, qb


@pytest.mark.parametrize("name", sorted(SPECS))
def test_drawn_realizations_stay_within_gamma_n(name: str) -> None:
    sp = spec(**SPECS[name])
    rng = np.random.default_rng(abs(hash(name)) % 1000)
    pick = random.Random(7)
    u = sp.accumulate.u
    worst = 0.0
    overflowed = False
    for draw in range(12):
        k = int(rng.integers(20, 70))
        a, b = _operands(rng, 3, k, 4, hard=bool(draw % 2))
        r = random_realization(sp, pick)
        out = r.matmul(MM, a, b, "activations", "weights").numpy()
        qa, qb = _dequantized(sp, r, a, b)
        exact, mag = _exact_matmul(qa, qb)
        g = gamma(k, u)
        fa = r._operand(MM, 0, a, "activations", "left")
        sb = (quantize_weight(b, sp.weights, out_axis=-1, reduce_axis=-2)[1].numpy()
              if sp.weights is not None else np.ones((1, 1)))
        s_lo = (np.broadcast_to(fa.s.numpy(), qa.shape).min(axis=1, keepdims=True)
                * np.broadcast_to(sb, qb.shape).min(axis=0, keepdims=True))
        for i in range(3):
            for j in range(4):
                if not np.isfinite(out[i, j]):
                    # the unscaled products overflowed the accumulator (fp16: 448 * 57344 >
                    # 65504): allowed exactly where the bound's overflow criterion says so
                    assert mag[i, j] * (1 + g) / s_lo[i, j] >= sp.accumulate.max_finite, (name, i, j)
                    overflowed = True
                    continue
                err = abs(Fraction(float(out[i, j])) - exact[i][j])
                allowed = Fraction(g * mag[i, j]) + Fraction(2.0**-52) * abs(exact[i][j])
                assert err <= allowed, (name, r, i, j, float(err), float(allowed))
                if mag[i, j] > 0:
                    worst = max(worst, float(err) / (g * mag[i, j]))
    # the accumulator really rounds (the check is not vacuous), except where every unscaled sum
    # of fp8 products overflows fp16 (448 * 57344 > 65504: each output is inf)
    assert worst > 0 or name == "fp16acc-fp8"
    assert overflowed == (name == "fp16acc-fp8")


def test_orders_and_seeds_give_different_results() -> None:
    sp = spec(compute="fp32", accumulate="bf16")
    rng = np.random.default_rng(11)
    a, b = _operands(rng, 4, 64, 6, hard=True)
    results = {}
    for order in ORDERS:
        results[order] = Realization(sp, order=order, chunk=8).matmul(MM, a, b, "activations", "weights")
    for seed in range(4):
        results[f"random{seed}"] = Realization(sp, seed=seed, order="random").matmul(MM, a, b, "activations", "weights")
    distinct = {tuple(v.flatten().tolist()) for v in results.values()}
    assert len(distinct) >= 6
    # the same seed is the same program
    again = Realization(sp, seed=2, order="random").matmul(MM, a, b, "activations", "weights")
    assert torch.equal(again, results["random2"])


def test_sequential_fp32_equals_a_numpy_float32_loop() -> None:
    """Hand reference: fp8 casts with unit static scales, products exact, float32 running sum."""
    sp = spec(compute="fp32", accumulate="fp32",
              weights={"format": "fp8_e4m3", "scale": "static", "value": 1.0},
              activations={"format": "fp8_e4m3", "scale": "static", "value": 1.0})
    rng = np.random.default_rng(12)
    a = rng.standard_normal((5, 96)) * np.exp2(rng.integers(-8, 8, (5, 96)))  # products span
    b = rng.standard_normal((96, 7)) * np.exp2(rng.integers(-8, 8, (96, 7)))  # 2^-20..2^16
    a, b = torch.tensor(a, dtype=torch.float32).double(), torch.tensor(b, dtype=torch.float32).double()
    out = Realization(sp, order="sequential").matmul(MM, a, b, "activations", "weights").numpy()
    qa = cast_to(a, "fp8_e4m3").numpy().astype(np.float32)
    qb = cast_to(b, "fp8_e4m3").numpy().astype(np.float32)
    acc = np.zeros((5, 7), dtype=np.float32)
    for t in range(96):
        acc = (acc + np.outer(qa[:, t], qb[t, :])).astype(np.float32)  # fp8*fp8 is float32-exact
    assert np.array_equal(out, acc.astype(np.float64))
    rev = Realization(sp, order="reverse").matmul(MM, a, b, "activations", "weights").numpy()
    assert not np.array_equal(rev, out)


def test_scales_factor_out_and_result_is_rounded_to_compute() -> None:
    sp = spec(compute="bf16", accumulate="fp32",
              weights={"format": "fp8_e4m3", "scale": "per_channel"},
              activations={"format": "fp8_e4m3", "scale": "dynamic_per_tensor"})
    rng = np.random.default_rng(13)
    a = torch.tensor(rng.standard_normal((2, 3, 32)), dtype=torch.float32).double()
    b = torch.tensor(rng.standard_normal((32, 5)), dtype=torch.float32).double()
    out = Realization(sp).matmul(MM, a, b, "activations", "weights")
    assert torch.equal(out, cast_to(out, "bf16"))  # stored in compute format
    qa, _ = quantize_activation(a, sp.activations)
    qb, _ = quantize_weight(b, sp.weights, out_axis=-1)
    ref = qa @ qb
    mag = qa.abs() @ qb.abs()
    u = sp.compute.u
    assert torch.all((out - ref).abs() <= gamma(32, 2.0**-24) * mag + u * ref.abs() * (1 + 1e-6) + 1e-30)


def test_batched_activation_matmul_and_vectors() -> None:
    """Attention-shaped products (both operands activations, broadcast batch) and 1-D operands."""
    sp = spec(compute="fp64", accumulate="bf16",
              activations={"format": "fp8_e4m3", "scale": "dynamic_per_token"})
    rng = np.random.default_rng(14)
    q = torch.tensor(rng.standard_normal((2, 3, 5, 16)))
    kt = torch.tensor(rng.standard_normal((2, 3, 16, 5)))
    r = Realization(sp, order="pairwise")
    out = r.matmul(MM, q, kt, "activations", "activations")
    assert out.shape == (2, 3, 5, 5)
    qq, _ = quantize_activation(q, sp.activations, reduce_axis=-1)
    qk, _ = quantize_activation(kt, sp.activations, reduce_axis=-2)
    ref, mag = qq @ qk, qq.abs() @ qk.abs()
    assert torch.all((out - ref).abs() <= gamma(16, sp.accumulate.u) * mag * (1 + 1e-9))
    v = torch.tensor(rng.standard_normal(16))
    assert r.matmul(MM, q, v, "activations", "activations").shape == (2, 3, 5)
    assert r.matmul(MM, v, kt, "activations", "activations").shape == (2, 3, 5)


def test_dynamic_activation_scales_never_couple_samples() -> None:
    sp = spec(compute="bf16", accumulate="fp32",
              activations={"format": "fp8_e4m3", "scale": "dynamic_per_tensor"},
              weights={"format": "fp8_e4m3", "scale": "per_channel"})
    rng = np.random.default_rng(15)
    x = torch.tensor(rng.standard_normal((2, 4, 24)))
    w = torch.tensor(rng.standard_normal((24, 6)))
    r = Realization(sp, order="random", seed=3)
    y0 = r.matmul(MM, x, w, "activations", "weights")
    x2 = x.clone()
    x2[1] = x2[1] * 50 + 3
    y1 = r.matmul(MM, x2, w, "activations", "weights")
    assert torch.equal(y0[0], y1[0]) and not torch.equal(y0[1], y1[1])


@pytest.mark.parametrize("prim", ["add", "exp", "tanh"])
def test_round_stays_within_ulps(prim: str) -> None:
    sp = spec(compute="bf16", accumulate="fp32", ulps={"exp": 3})
    node = Node("n", "Exp", ("x",), ("y",))
    rng = np.random.default_rng(16)
    v = torch.tensor(rng.standard_normal(4000) * np.exp2(rng.integers(-20, 20, 4000)))
    k = sp.ulp(prim)
    nearest = Realization(sp).round(node, prim, v)
    assert torch.equal(nearest, cast_to(v, "bf16"))
    outs = {}
    for mode in ("up", "down", "random"):
        out = Realization(sp, rounding=mode, seed=1).round(node, prim, v)
        assert torch.equal(out, cast_to(out, "bf16"))
        assert torch.all((out - v).abs() <= k * sp.compute.u * v.abs())
        outs[mode] = out
    assert torch.all(outs["up"] >= nearest) and torch.all(outs["down"] <= nearest)
    assert (outs["up"] != nearest).any() and (outs["down"] != nearest).any()
    assert (outs["random"] == outs["up"]).any() and (outs["random"] == outs["down"]).any()
    if k >= 2:  # beyond the neighbours: up to k ulps
        assert ((outs["up"] - v).abs() > sp.compute.u * v.abs()).any()
    special = torch.tensor([-np.inf, np.inf, np.nan, 0.0, -0.0], dtype=torch.float64)
    for mode in ("nearest", "up", "down", "random"):
        out = Realization(sp, rounding=mode).round(node, prim, special)
        assert out[0] == -np.inf and out[1] == np.inf and torch.isnan(out[2]) and (out[3:] == 0).all()
    ints = torch.arange(5)
    assert Realization(sp, rounding="up").round(node, prim, ints) is ints
    qdq = Node("dq", "DequantizeLinear", ("q", "s"), ("y",))
    assert Realization(sp, rounding="up").round(qdq, "mul", v) is v


def test_graph_input_is_stored_in_compute_format() -> None:
    sp = spec(compute="fp16", accumulate="fp32")
    x = torch.randn(100, dtype=torch.float64)
    y = Realization(sp).graph_input("x", x)
    assert torch.equal(y, cast_to(x, "fp16")) and y.dtype == torch.float64
    assert Realization(sp).graph_input("ids", torch.arange(3)).dtype == torch.int64


def test_weights_are_quantized_once_per_tensor() -> None:
    sp = spec(compute="fp32", accumulate="fp32", weights={"format": "int8", "scale": "per_channel"})
    r = Realization(sp)
    w = torch.randn(16, 4, dtype=torch.float64)
    x = torch.randn(3, 16, dtype=torch.float64)
    r.matmul(MM, x, w, "activations", "weights")
    first = r._weights[("mm", 1)][1]
    r.matmul(MM, x * 2, w, "activations", "weights")
    assert r._weights[("mm", 1)][1] is first
    r.matmul(MM, x, w * 2, "activations", "weights")  # another tensor: re-quantized
    assert r._weights[("mm", 1)][1] is not first


CONV = Node("cv", "Conv", ("x", "w", "b"), ("y",))


@pytest.mark.parametrize("groups,nd", [(1, 2), (2, 2), (1, 1)])
def test_conv_realization_matches_reference_within_gamma(groups: int, nd: int) -> None:
    sp = spec(compute="fp64", accumulate="bf16",
              weights={"format": "fp8_e4m3", "scale": "per_channel"},
              activations={"format": "fp8_e4m3", "scale": "dynamic_per_tensor"})
    rng = np.random.default_rng(17)
    spatial = (7, 6) if nd == 2 else (9,)
    kern = (3, 2) if nd == 2 else (3,)
    x = torch.tensor(rng.standard_normal((2, 4, *spatial)))
    w = torch.tensor(rng.standard_normal((6, 4 // groups, *kern)))
    bias = torch.tensor(rng.standard_normal(6))
    stride = [2, 1][:nd]
    dilation = [1, 2][:nd] if nd == 2 else [1]
    pads = [1, 0, 0, 1] if nd == 2 else [2, 1]
    r = Realization(sp, order="random", seed=5)
    out = r.conv(CONV, x, w, bias, stride, pads, dilation, groups, "activations", "weights")
    qx, _ = quantize_activation(x, sp.activations)
    qw, _ = quantize_weight(w, sp.weights, out_axis=0)
    fn = F.conv2d if nd == 2 else F.conv1d
    padded = F.pad(qx, (pads[1], pads[3], pads[0], pads[2]) if nd == 2 else (pads[0], pads[1]))
    ref = fn(padded, qw, bias, stride, 0, dilation, groups)
    mag = fn(padded.abs(), qw.abs(), None, stride, 0, dilation, groups)
    n = (4 // groups) * int(np.prod(kern))
    assert out.shape == ref.shape
    # conv sum within gamma_n, then one bf16-free fp64 bias add
    assert torch.all((out - ref).abs() <= gamma(n, sp.accumulate.u) * mag + 1e-12 * ref.abs() + 1e-300)
    assert not torch.equal(out, ref)


def test_bad_choices_are_rejected() -> None:
    sp = spec()
    with pytest.raises(KernelSpecError, match="accumulation order"):
        Realization(sp, order="backwards")
    with pytest.raises(KernelSpecError, match="rounding"):
        Realization(sp, rounding="sideways")
    with pytest.raises(KernelSpecError, match="chunk"):
        Realization(sp, chunk=0)


def test_random_realization_draws_every_kind_of_choice() -> None:
    sp = spec()
    rng = random.Random(0)
    draws = [random_realization(sp, rng) for _ in range(60)]
    assert {d.order for d in draws} == set(ORDERS)
    assert {d.rounding for d in draws} == {"nearest", "up", "down", "random"}
    assert len({d.seed for d in draws}) == 60
    g = np.random.default_rng(0)
    assert isinstance(random_realization(sp, g), Realization)
    assert repr(random_realization(sp, 3)) == repr(random_realization(sp, 3))


def test_fp64_format_is_the_identity_and_e4m3_constants() -> None:
    assert get_format("fp8_e4m3").max_finite == 448.0
    x = torch.randn(10, dtype=torch.float64)
    assert torch.equal(cast_to(x, "fp64"), x)


@pytest.mark.gpu
def test_realization_is_device_agnostic() -> None:
    sp = spec(compute="bf16", accumulate="fp32", rounding="any",
              weights={"format": "fp8_e4m3", "scale": "per_block", "block_size": 16},
              activations={"format": "fp8_e4m3", "scale": "dynamic_per_token"})
    rng = np.random.default_rng(18)
    a = torch.tensor(rng.standard_normal((2, 5, 48)))
    b = torch.tensor(rng.standard_normal((48, 7)))
    for order in ORDERS:
        r = Realization(sp, seed=4, order=order, rounding="random")
        cpu = r.matmul(MM, a, b, "activations", "weights")
        r2 = Realization(sp, seed=4, order=order, rounding="random")
        gpu = r2.matmul(MM, a.cuda(), b.cuda(), "activations", "weights")
        assert torch.equal(cpu, gpu.cpu())
        v = torch.tensor(rng.standard_normal(500))
        assert torch.equal(r.round(MM, "exp", v), r2.round(MM, "exp", v.cuda()).cpu())


@pytest.mark.parametrize("acc", ["fp32", "bf16", "fp16"])
def test_native_additions_equal_the_exact_path(acc: str) -> None:
    """torch's own fp32 / bf16 / fp16 additions (taken when the terms are in the format) give the
    same bits as TwoSum + one rounding."""
    sp = spec(compute="fp64", accumulate=acc,
              weights={"format": "fp8_e4m3", "scale": "per_channel"},
              activations={"format": "fp8_e5m2", "scale": "dynamic_per_token"})
    rng = np.random.default_rng(19)
    a, b = _operands(rng, 6, 200, 9, hard=True)
    for order in ORDERS:
        fast = Realization(sp, seed=1, order=order, chunk=7)
        slow = Realization(sp, seed=1, order=order, chunk=7, native=False)
        y_fast = fast.matmul(MM, a, b, "activations", "weights")
        y_slow = slow.matmul(MM, a, b, "activations", "weights")
        # fp16 overflows on unscaled fp8 products: inf - inf = NaN on both paths alike
        same = lambda t: torch.nan_to_num(t, nan=7.0, posinf=math.inf, neginf=-math.inf)  # noqa: E731
        assert torch.equal(same(y_fast), same(y_slow)), order
    # and the native path was really taken: fp8 products are values of the format
    from kcverify.kernels.realize import _Adder

    fp8_products = torch.tensor([[1.125 * 0.75, -3.5 * 1.25, 448.0 * 0.015625]], dtype=torch.float64)
    assert _Adder.for_terms(fp8_products, sp.accumulate, True).dtype is not None
    assert _Adder.for_terms(fp8_products + 2.0**-30, sp.accumulate, True).dtype is None


def test_rounding_any_moves_activation_casts_to_a_neighbour_only() -> None:
    raw = dict(compute="fp64", accumulate="fp32",
               activations={"format": "fp8_e4m3", "scale": "dynamic_per_tensor"})
    rng = np.random.default_rng(20)
    x = torch.tensor(rng.standard_normal((2, 3, 40)))
    casts = {}
    for rounding in ("nearest", "up", "down", "random"):
        r = Realization(spec(rounding="any", **raw), rounding=rounding, seed=3)
        op = r._operand(MM, 0, x, "activations", "left")
        casts[rounding] = op.q * op.s
    q, s = quantize_activation(x, parse_kernel_spec("a", raw).activations, rounding="up")
    inside = (x / s).abs() <= 448  # beyond max (s is fl32(amax/448)) the cast saturates
    assert torch.equal(casts["up"], q)
    assert torch.all((casts["up"] >= x)[inside]) and torch.all((casts["down"] <= x)[inside])
    assert torch.all((casts["random"] == casts["up"]) | (casts["random"] == casts["down"]))
    assert not torch.equal(casts["random"], casts["nearest"])
    # with rounding: nearest in the spec, the realization's choice leaves the casts alone
    strict = Realization(spec(**raw), rounding="up")._operand(MM, 0, x, "activations", "left")
    assert torch.equal(strict.q * strict.s, casts["nearest"])
