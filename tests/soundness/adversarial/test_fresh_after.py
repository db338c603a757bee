"""x @ W with a constant W, x's leftover noise made symbols *after* the product
(zonotope.f_matmul_const_fresh: one position-local kind per contracted index), attacked end to
end with the independent programs.

The rule is sound only if no two rows of x that share a position (a broadcast copy, a
transposed or expanded tensor, a batched rank-3 / rank-4 operand) get one symbol for two
independent errors. Shapes: an MLP (LayerNorm -> W1 (d x 4d) -> Relu -> W2 -> residual), rank-4
(1, H, T, d) operands, an Expand along a head axis (rows that share positions: the fallback), a
transposed input, a Gemm with transB, an attention block (softmax(q k^T) v -> Wo); weights
negative and huge (2^6 times e4m3 values) or of mixed magnitudes; inputs at e4m3 midpoints +- one
fp32 ulp and Gaussian; specs with bf16 / fp16 compute (so the operand carries rounding noise),
``rounding: any``. Every pair checked elementwise on every output; calls of the rule (and of its
shared-position fallback) counted so that the attack provably reaches it.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest
import torch
from onnx import helper

import kcverify.bounds.zonotope as Z
from tests.soundness.adversarial.arith import rnd
from tests.soundness.adversarial.attacks import SPECS, fp8_midpoints, normal, pairs
from tests.soundness.adversarial.harness import (
    SESSION,
    TRAIN,
    Ledger,
    attack,
    chain_model,
    ratio_text,
    spec,
)

FRESH_SPECS = {
    "fp8_tensor_bf16": SPECS["fp8_tensor_bf16"],
    "fp8_token_bf16": spec(weights={"format": "fp8_e4m3", "scale": "per_channel"},
                           activations={"format": "fp8_e4m3", "scale": "dynamic_per_token"},
                           accumulate="fp32", compute="bf16"),
    "e5m2_any_fp16": SPECS["e5m2_any_fp16"],
    "bf16_acc_bf16": SPECS["bf16_acc_bf16"],
}


def _w(rng: np.random.Generator, shape: tuple[int, ...], kind: str) -> np.ndarray:
    w = rng.normal(size=shape)
    if kind == "huge":
        w = -np.abs(w) * 2.0**6
    elif kind == "mixed":
        w = w * 2.0 ** rng.integers(-6, 7, size=shape)
    return rnd(w, "fp8_e4m3").astype(np.float32)


def fresh_model(name: str, rng: np.random.Generator, wkind: str, T: int = 3, D: int = 4,
                H: int = 2):
    """(model, input shape) of one geometry (module doc)."""
    n = helper.make_node
    if name == "mlp":
        g = np.ones(D, np.float32)
        b = np.zeros(D, np.float32)
        nodes = [n("LayerNormalization", ["x", "g", "b"], ["ln"], axis=-1, epsilon=1e-5),
                 n("MatMul", ["ln", "w1"], ["h"]), n("Relu", ["h"], ["a"]),
                 n("MatMul", ["a", "w2"], ["m"]), n("Add", ["m", "x"], ["y"])]
        ins = [("g", g), ("b", b), ("w1", _w(rng, (D, 4 * D), wkind)),
               ("w2", _w(rng, (4 * D, D), wkind))]
        return chain_model(nodes, [("x", (1, T, D)), *ins], ["y"]), (1, T, D)
    if name == "rank4":
        c = (rng.uniform(0.3, 3.0, size=(1, H, 1, D))).astype(np.float32)
        nodes = [n("Mul", ["x", "c"], ["u"]), n("MatMul", ["u", "w"], ["v"]),
                 n("Relu", ["v"], ["a"]), n("MatMul", ["a", "w2"], ["y"])]
        return chain_model(nodes, [("x", (1, H, T, D)), ("c", c),
                                   ("w", _w(rng, (D, 2 * D), wkind)),
                                   ("w2", _w(rng, (2 * D, 3), wkind))], ["y"]), (1, H, T, D)
    if name == "expand":
        c = rng.uniform(-1, 1, size=(1, 1, T, D)).astype(np.float32)
        shape = np.array([1, H, T, D], np.int64)
        nodes = [n("Add", ["x", "c"], ["u"]), n("Expand", ["u", "shape"], ["e"]),
                 n("MatMul", ["e", "w"], ["v"]), n("Mul", ["v", "v"], ["s"]),
                 n("MatMul", ["s", "w2"], ["y"])]
        return chain_model(nodes, [("x", (1, 1, T, D)), ("c", c), ("shape", shape),
                                   ("w", _w(rng, (D, D), wkind)),
                                   ("w2", _w(rng, (D, 2), wkind))], ["y"]), (1, 1, T, D)
    if name == "transposed":
        c = rng.uniform(0.5, 2.0, size=(1, T, D)).astype(np.float32)
        nodes = [n("Transpose", ["x"], ["xt"], perm=[0, 2, 1]), n("Mul", ["xt", "c"], ["u"]),
                 n("Transpose", ["wt"], ["w"], perm=[1, 0]), n("MatMul", ["u", "w"], ["v"]),
                 n("Relu", ["v"], ["a"]), n("MatMul", ["a", "w2"], ["y"])]
        return chain_model(nodes, [("x", (1, D, T)), ("c", c),
                                   ("wt", _w(rng, (2 * D, D), wkind)),
                                   ("w2", _w(rng, (2 * D, 2), wkind))], ["y"]), (1, D, T)
    if name == "gemm_tb":
        nodes = [n("Gemm", ["x", "wt", "b1"], ["h"], transB=1), n("Relu", ["h"], ["a"]),
                 n("Gemm", ["a", "w2t", "b2"], ["y"], transB=1)]
        return chain_model(nodes, [("x", (1, D)), ("wt", _w(rng, (2 * D, D), wkind)),
                                   ("b1", rng.normal(size=2 * D).astype(np.float32)),
                                   ("w2t", _w(rng, (3, 2 * D), wkind)),
                                   ("b2", np.zeros(3, np.float32))], ["y"]), (1, D)
    if name == "attn":
        nodes = [n("MatMul", ["x", "wq"], ["q"]), n("MatMul", ["x", "wk"], ["k"]),
                 n("MatMul", ["x", "wv"], ["v"]), n("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
                 n("MatMul", ["q", "kt"], ["s"]), n("Softmax", ["s"], ["p"], axis=-1),
                 n("MatMul", ["p", "v"], ["o"]), n("MatMul", ["o", "wo"], ["y"])]
        ws = [(nm, _w(rng, (D, D), wkind if nm == "wo" else "plain"))
              for nm in ("wq", "wk", "wv", "wo")]
        return chain_model(nodes, [("x", (1, T, D)), *ws], ["y"]), (1, T, D)
    raise ValueError(name)


GEOMETRIES = ("mlp", "rank4", "expand", "transposed", "gemm_tb", "attn")


@contextmanager
def fresh_calls():
    """Count f_matmul_const_fresh's calls and those whose rows share positions (fallback)."""
    calls = {"fresh": 0, "shared": 0}
    orig = Z.f_matmul_const_fresh

    def wrapped(zt, a, w):
        calls["fresh"] += 1
        P = a.P if a.L is not None and Z._constant_along(a.P, -1) else None
        if P is None and a.L is None:
            P = Z._row_positions(a.shape)
        if P is not None:
            rows = P.narrow(-1, 0, 1)
            if torch.unique(rows).numel() != rows.numel():
                calls["shared"] += 1
        return orig(zt, a, w)
    Z.f_matmul_const_fresh = wrapped
    try:
        yield calls
    finally:
        Z.f_matmul_const_fresh = orig


def _inputs(shape: tuple[int, ...], kind: str, rng: np.random.Generator) -> np.ndarray:
    if kind == "midpoints":
        return fp8_midpoints(shape, "fp8_e4m3", rng, amax=float(rng.uniform(0.5, 3.0)))
    return normal(shape, rng, scale=float(rng.uniform(0.3, 3.0)))


def fresh_attack(led: Ledger, geom: str, sp_name: str, wkind: str, xkind: str, seed: int,
                 n_pairs: int = 8) -> tuple[list[str], dict]:
    rng = np.random.default_rng([seed, GEOMETRIES.index(geom), len(sp_name), len(wkind)])
    model, shape = fresh_model(geom, rng, wkind)
    x = _inputs(shape, xkind, rng)
    sp = FRESH_SPECS[sp_name]
    cls = f"fresh-after/{geom}"
    with fresh_calls() as calls:
        found = attack(led, cls, model, TRAIN, sp, {"x": x}, pairs(TRAIN, sp, n_pairs, seed),
                       domain="best")
    return found, calls


WKINDS = ("plain", "huge", "mixed")
XKINDS = ("midpoints", "normal")
# every geometry under every spec once, the weight and input kinds in rotation
ALL = [(g, s, WKINDS[(i + j) % 3], XKINDS[(i + j) % 2]) for i, g in enumerate(GEOMETRIES)
       for j, s in enumerate(FRESH_SPECS)]
# each geometry once in CI, the specs in rotation (the rest slow; every combination in the
# campaign)
FAST = [("mlp", "fp8_tensor_bf16", "plain", "midpoints"),
        ("rank4", "fp8_token_bf16", "mixed", "midpoints"),
        ("expand", "fp8_token_bf16", "plain", "midpoints"),
        ("transposed", "bf16_acc_bf16", "mixed", "normal"),
        ("gemm_tb", "fp8_token_bf16", "plain", "normal"),
        ("attn", "fp8_tensor_bf16", "mixed", "midpoints")]
SLOW = [c for c in ALL if c not in FAST]


@pytest.mark.parametrize(("geom", "sp_name", "wkind", "xkind"), FAST)
def test_fresh_after_product(geom: str, sp_name: str, wkind: str, xkind: str) -> None:
    _fresh(geom, sp_name, wkind, xkind)


@pytest.mark.slow
@pytest.mark.parametrize(("geom", "sp_name", "wkind", "xkind"), SLOW)
def test_fresh_after_product_slow(geom: str, sp_name: str, wkind: str, xkind: str) -> None:
    _fresh(geom, sp_name, wkind, xkind)


def _fresh(geom: str, sp_name: str, wkind: str, xkind: str) -> None:
    led = Ledger()
    found, _ = fresh_attack(led, geom, sp_name, wkind, xkind, 0)
    SESSION.merge(led)
    st = led[f"fresh-after/{geom}"]
    assert st.pairs > 0
    assert not found, ratio_text(st) + "\n" + "\n".join(found[:3])


def test_fresh_rule_and_fallback_are_reached() -> None:
    """The geometries reach the rule, and the expanded one its shared-position fallback."""
    led = Ledger()
    _, mlp = fresh_attack(led, "mlp", "fp8_tensor_bf16", "plain", "midpoints", 1, n_pairs=2)
    _, exp = fresh_attack(led, "expand", "fp8_tensor_bf16", "plain", "normal", 1, n_pairs=2)
    assert mlp["fresh"] > 0
    assert exp["fresh"] > 0 and exp["shared"] > 0, exp


@pytest.mark.campaign
@pytest.mark.parametrize("geom", GEOMETRIES)
def test_fresh_after_product_campaign(geom: str) -> None:
    led = Ledger()
    found = []
    calls = 0
    for seed in range(1, 4):
        for sp_name in FRESH_SPECS:
            for wkind in WKINDS:
                for xkind in XKINDS:
                    f, c = fresh_attack(led, geom, sp_name, wkind, xkind, seed, n_pairs=10)
                    found += f
                    calls += c["fresh"]
    SESSION.merge(led)
    assert calls > 0
    assert not found, "\n".join(found[:5])
