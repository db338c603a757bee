"""LayerNorm's moments as real runtimes compute them, against the DEFAULT training spec
(``moments: any``: two-pass sums or Welford / Chan trees, docs/bounds.md "LayerNorm moments"):
torch's fp32 CPU layer_norm (RowwiseMoments: Welford chains merged by Chan's update),
onnxruntime's LayerNormalization (two-pass), and independent fp32 Welford / Chan programs
(tests/bounds/welford_programs.py: a sequential chain, chains of 16 merged pairwise, reverse
chains where one element absorbs the rest, a balanced tree with fused updates, and torch's own
tree emulated). Rows with a large mean against a small spread (1e2..1e6 against 1e-2..30),
alternating, sorted, spiked, cancelling rows and rows a few ulps apart, n up to 4096.

Two checks: end to end (each output inside the certified interval: the worst excursion, the
distance from the interval's centre over its half-width, > 1 outside, is printed), and for torch
the proof's own claims on its moments (|mean - mu| <= e_mu, |rstd / r - 1| <= rho_r of
``ln_error_parts``), which the two-pass family's bound alone does not give.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import onnxruntime as ort
import pytest
import torch

from kcverify.bounds import certify_drift
from kcverify.bounds.rules.normalization import ln_error_parts, welford_depth
from tests.bounds import welford_programs as wp
from tests.soundness.adversarial.harness import TRAIN, graph_of, node_model

F32 = np.float32


def _rows(rng: np.random.Generator, n: int, mean: float, std: float) -> np.ndarray:
    x = (mean + std * rng.standard_normal((7, n))).astype(F32)
    x[1] = np.where(np.arange(n) % 2, mean + std, mean - std)
    x[2, : n // 2], x[2, n // 2:] = -mean, mean  # cancelling halves
    x[3] = np.sort(x[3])
    x[4] = np.sort(x[4])[::-1]
    x[5] = (mean * (1 + 2.0**-23 * rng.integers(-4, 5, n))).astype(F32)  # a few ulps apart
    x[6, 0] = mean + 1e3 * std  # a spike
    return x.astype(F32)


def _programs(x: np.ndarray, n: int, eps: float) -> dict[str, np.ndarray]:
    idx = list(range(n))
    progs = {
        "welford-16-pairwise": (wp.chunked(idx, 16, wp.chain, wp.pairwise), "recip"),
        "reverse-16-pairwise": (wp.chunked(idx, 16, wp.reverse_chain, wp.pairwise), "mul"),
        "chan-pairwise-fma": (wp.pairwise(idx), "fma"),
    }
    if n - 1 <= welford_depth(n):
        progs["welford-seq"] = (wp.chain(idx), "div")
    out = {name: wp.layer_norm(x, *wp.moments(x, t, form)[1:], eps)
           for name, (t, form) in progs.items()}
    out["torch-emulated"] = wp.layer_norm(x, *wp.torch_rowwise(x, 8), eps)
    return out


def _exact(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x64 = x.astype(np.float64)
    mu = np.array([math.fsum(r) / len(r) for r in x64])
    return mu, np.array([math.fsum((r - m) ** 2) / len(r) for r, m in zip(x64, mu)])


@pytest.mark.slow
@pytest.mark.parametrize("n", [64, 1000, 4096])
def test_layernorm_runtimes_inside_the_default_spec(n: int) -> None:
    rng = np.random.default_rng(n)
    eps = 1e-5
    g, b = np.ones(n, F32), np.zeros(n, F32)
    model = node_model("LayerNormalization", [("x", (7, n)), ("g", g), ("b", b)],
                       {"axis": -1, "epsilon": eps}, opset=17)
    graph = graph_of(model)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    worst: dict[str, float] = {}
    bad = []
    for mean in (1e2, 1e4, 3e5, 1e6):
        for std in (1e-2, 1.0, 30.0):
            x = _rows(rng, n, mean, std)
            box = certify_drift(graph, TRAIN, TRAIN, {"x": x}, domain="interval").outputs["y0"]
            lo, hi = box.train_lo, box.train_hi
            y_t, mean_t, rstd_t = torch.native_layer_norm(torch.from_numpy(x), (n,),
                                                          torch.from_numpy(g),
                                                          torch.from_numpy(b), eps)
            runs = {"torch": y_t.numpy(), "onnxruntime": sess.run(None, {"x": x})[0],
                    **_programs(x, n, eps)}
            for name, y in runs.items():
                y = y.astype(np.float64)
                half = np.maximum(0.5 * hi - 0.5 * lo, 1e-300)
                exc = float(np.max(np.abs(y - (0.5 * lo + 0.5 * hi)) / half))
                worst[name] = max(worst.get(name, 0.0), exc)
                if not (np.all(lo <= y) and np.all(y <= hi)):
                    bad.append(f"{name} n={n} mean={mean} std={std}: excursion {exc:.3g}")
            # torch's moments against the proof's bounds (the default spec, and sums alone)
            mu, v = _exact(x)
            t = torch.from_numpy(x.astype(np.float64))
            r = (v + eps) ** -0.5
            obs_mu = np.abs(mean_t.numpy().ravel().astype(np.float64) - mu)
            obs_r = np.abs(rstd_t.numpy().ravel().astype(np.float64) / r - 1)
            for tag, spec in (("any", TRAIN), ("sums", dataclasses.replace(TRAIN, moments="sums"))):
                e_mu, rho_r, ok, _ = ln_error_parts(spec, t, t, torch.from_numpy(v[:, None]), eps)
                e_mu, rho_r = e_mu.numpy().ravel(), rho_r.numpy().ravel()
                ok = ok.numpy().ravel()
                q_mu = float(np.max(obs_mu / e_mu))
                q_r = float(np.max(np.where(ok, obs_r / rho_r, 0.0)))
                worst[f"torch-mean/{tag}"] = max(worst.get(f"torch-mean/{tag}", 0.0), q_mu)
                worst[f"torch-rstd/{tag}"] = max(worst.get(f"torch-rstd/{tag}", 0.0), q_r)
                if tag == "any" and (q_mu > 1 or q_r > 1):
                    bad.append(f"torch moments n={n} mean={mean} std={std}: {q_mu:.3g} {q_r:.3g}")
    print(f"\nLayerNorm n={n}, default spec (moments: any), worst excursion / observed over "
          "proved: " + ", ".join(f"{k} {v:.3g}" for k, v in sorted(worst.items())))
    assert not bad, bad[:5]
