"""LayerNorm's moments as real runtimes compute them, against the DEFAULT training spec
(``moments: sums``): torch's fp32 CPU layer_norm (RowwiseMoments: Welford / Chan updates),
onnxruntime's LayerNormalization, and an independent fp32 Welford / Chan program with
adversarial chunking (a sequential chain, chains of 16 merged pairwise, and one chain per
element merged pairwise). Rows with a large mean against a small spread (1e2..1e6 against
1e-2..30), alternating and sorted rows, a cancelling row and rows one ulp apart, n up to 4096.

What it measures (the spec's worst excursion: distance from the certified interval's centre
over its half-width, > 1 outside) is printed; the assertion is containment. This is evidence,
not the proof that Welford trees stay inside the two-pass family's sets (the ``welford``
option's wider bound is the proved one; docs/bounds.md).
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from kcverify.bounds import certify_drift
from tests.soundness.adversarial.harness import TRAIN, graph_of, node_model

F32 = np.float32


def _welford(x: np.ndarray, chain: int | None) -> tuple[np.ndarray, np.ndarray]:
    """fp32 Welford chains of length ``chain`` (None: one chain) merged pairwise by Chan's
    update, every operation rounded to fp32: the row means and M2 sums."""
    rows, n = x.shape
    chain = n if chain is None else chain
    parts = []
    for k0 in range(0, n, chain):
        mu = np.zeros(rows, F32)
        m2 = np.zeros(rows, F32)
        for k, j in enumerate(range(k0, min(n, k0 + chain)), start=1):
            d = (x[:, j] - mu).astype(F32)
            mu = (mu + (d / F32(k)).astype(F32)).astype(F32)
            m2 = (m2 + (d * (x[:, j] - mu).astype(F32)).astype(F32)).astype(F32)
        parts.append((F32(min(n, k0 + chain) - k0), mu, m2))
    while len(parts) > 1:
        nxt = []
        for a, b in zip(parts[0::2], parts[1::2]):
            (na, ma, sa), (nb, mb, sb) = a, b
            nn = F32(na + nb)
            d = (mb - ma).astype(F32)
            c = F32(nb / nn)
            mu = (ma + (d * c).astype(F32)).astype(F32)
            w = F32(F32(na * nb) / nn)
            m2 = (sa + sb + ((d * d).astype(F32) * w).astype(F32)).astype(F32)
            nxt.append((nn, mu, m2))
        if len(parts) % 2:
            nxt.append(parts[-1])
        parts = nxt
    return parts[0][1], parts[0][2]


def _welford_ln(x: np.ndarray, chain: int | None, eps: float) -> np.ndarray:
    mu, m2 = _welford(x, chain)
    var = (m2 / F32(x.shape[1])).astype(F32)
    r = (F32(1) / np.sqrt((var + F32(eps)).astype(F32))).astype(F32)
    return ((x - mu[:, None]).astype(F32) * r[:, None]).astype(F32)


def _rows(rng: np.random.Generator, n: int, mean: float, std: float) -> np.ndarray:
    x = (mean + std * rng.standard_normal((6, n))).astype(F32)
    x[1] = np.where(np.arange(n) % 2, mean + std, mean - std)
    x[2, : n // 2], x[2, n // 2:] = -mean, mean  # cancelling halves
    x[3] = np.sort(x[3])
    x[4] = np.sort(x[4])[::-1]
    x[5] = (mean * (1 + 2.0**-23 * rng.integers(-4, 5, n))).astype(F32)  # a few ulps apart
    return x.astype(F32)


@pytest.mark.slow
@pytest.mark.parametrize("n", [64, 1000, 4096])
def test_layernorm_runtimes_inside_the_default_spec(n: int) -> None:
    rng = np.random.default_rng(n)
    eps = 1e-5
    g, b = np.ones(n, F32), np.zeros(n, F32)
    model = node_model("LayerNormalization", [("x", (6, n)), ("g", g), ("b", b)],
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
            runs = {
                "torch": torch.nn.functional.layer_norm(torch.from_numpy(x), (n,),
                                                        torch.from_numpy(g),
                                                        torch.from_numpy(b), eps).numpy(),
                "onnxruntime": sess.run(None, {"x": x})[0],
                "welford-seq": _welford_ln(x, None, eps),
                "welford-16-chan": _welford_ln(x, 16, eps),
                "chan-pairwise": _welford_ln(x, 1, eps),
            }
            for name, y in runs.items():
                y = y.astype(np.float64)
                half = np.maximum(0.5 * hi - 0.5 * lo, 1e-300)
                exc = float(np.max(np.abs(y - (0.5 * lo + 0.5 * hi)) / half))
                worst[name] = max(worst.get(name, 0.0), exc)
                if not (np.all(lo <= y) and np.all(y <= hi)):
                    bad.append(f"{name} n={n} mean={mean} std={std}: excursion {exc:.3g}")
    print(f"\nLayerNorm n={n}, default spec (moments: sums), worst excursion: "
          + ", ".join(f"{k} {v:.3g}" for k, v in sorted(worst.items())))
    assert not bad, bad[:5]
