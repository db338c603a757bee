"""LayerNorm moments by Welford / Chan trees inside the DEFAULT spec (``moments: any``; issue 11).

The proof in docs/bounds.md ("LayerNorm moments") bounds, for every tree of the family, the
computed mean's error by e_mu and the computed variance's by a (v + eps)
(rules/normalization.py: ``_mean_errors``, ``_var_rel``). Here independent fp32 programs
(tests/bounds/welford_programs.py: chains, reverse chains where a single element absorbs the
rest, chunked and balanced trees, fused updates, random trees of the family's height, and an
emulation of torch's RowwiseMoments that agrees with torch bit for bit on the mean) are checked
against those two numbers on rows built to hurt (large mean against a small spread, sorted,
alternating, a spike, a few ulps apart), then end to end (the LayerNorm's certified interval).
The mutation: the two-pass family's bound alone (``moments: sums``, the old default) is exceeded
by these programs' variances, so the tests fail on it.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from kcverify.bounds import certify_drift
from kcverify.bounds.rules import normalization as nz
from kcverify.errors import KernelSpecError
from kcverify.kernels.spec import DEFAULT_ULPS, parse_kernel_spec
from tests.bounds import welford_programs as wp
from tests.soundness.adversarial.harness import graph_of, node_model

EPS = 1e-5
DEFAULT = parse_kernel_spec("train", {"compute": "fp32", "accumulate": "fp32"})
SUMS = dataclasses.replace(DEFAULT, moments="sums")


def test_moments_default_is_any_and_old_digests_stay() -> None:
    assert DEFAULT.moments == "any" and DEFAULT.canonical()["moments"] == "any"
    for value in ("any", "sums", "welford"):
        spec = parse_kernel_spec("t", {"compute": "fp32", "moments": value})
        assert spec.canonical()["moments"] == value
    # the canonical form a certificate of the old default digested: explicit sums gives it
    old = {"compute": "fp32", "accumulate": "fp32", "rounding": "nearest",
           "ulps": {k: float(v) for k, v in sorted(DEFAULT_ULPS.items())}, "moments": "sums"}
    explicit = parse_kernel_spec("t", {"compute": "fp32", "accumulate": "fp32", "moments": "sums"})
    assert explicit.canonical() == old
    with pytest.raises(KernelSpecError, match="expected one of any, sums, welford"):
        parse_kernel_spec("t", {"compute": "fp32", "moments": "two-pass"})
    assert nz.admits_welford(DEFAULT) and not nz.admits_welford(SUMS)
    # welford names the same family as any: the same bound, another digest
    welford = dataclasses.replace(DEFAULT, moments="welford")
    x = torch.from_numpy(1e3 + np.random.default_rng(0).standard_normal((3, 64)))
    v = x.var(-1, unbiased=False, keepdim=True)
    for a, b in zip(nz.ln_error_parts(DEFAULT, x, x, v, EPS), nz.ln_error_parts(welford, x, x, v, EPS)):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    sums = nz.ln_error_parts(SUMS, x, x, v, EPS)
    assert bool((sums[1] < nz.ln_error_parts(DEFAULT, x, x, v, EPS)[1]).all())


def _rows(rng: np.random.Generator, n: int, mean: float, std: float) -> np.ndarray:
    x = (mean + std * rng.standard_normal((8, n))).astype(np.float32)
    x[1] = np.sort(x[1])
    x[2] = np.sort(x[2])[::-1]
    x[3] = np.where(np.arange(n) % 2, mean + std, mean - std)
    x[4, 0] = mean + 1e3 * std  # a spike
    x[5] = np.abs(x[5])
    if mean:
        x[6] = mean * (1 + 2.0 ** -23 * rng.integers(-4, 5, n))  # a few ulps apart
    x[7, : n // 2], x[7, n // 2:] = -abs(mean) - std, abs(mean) + std  # cancelling halves
    return x.astype(np.float32)


def _exact(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x64 = x.astype(np.float64)
    mu = np.array([math.fsum(r) / len(r) for r in x64])
    v = np.array([math.fsum((r - m) ** 2) / len(r) for r, m in zip(x64, mu)])
    return mu, v


def _proved(spec, x: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The bound's e_mu and a at the point x (the exact variance v as its lower bound)."""
    t = torch.from_numpy(x.astype(np.float64))
    e_s, e_t, k, a_s = nz._mean_errors(spec, t, t)
    welford = nz.admits_welford(spec)
    e = torch.maximum(e_s, e_t) if welford else e_s
    a = nz._var_rel(spec, t, t, torch.from_numpy(v[:, None]), EPS, e_s, e_t, k, a_s, welford)
    return e.numpy().ravel(), a.numpy().ravel()


def _programs(x: np.ndarray, n: int, rng: np.random.Generator) -> dict[str, tuple]:
    """(mean, M2) of every program of the family on x."""
    d = min(nz.welford_depth(n), n - 1)
    out = {name: wp.moments(x, t, form)[1:] for name, (t, form) in wp.trees(n, d, rng).items()}
    out["torch-rowwise"] = wp.torch_rowwise(x, 8)
    return out


def _worst(spec, ns=(8, 33, 64, 256), trials: int = 6, seed: int = 1) -> dict[str, float]:
    """Largest observed / proved, over rows, programs and sizes, of the mean and the variance."""
    rng = np.random.default_rng(seed)
    worst = {"mean": 0.0, "var": 0.0}
    for n in ns:
        for _ in range(trials):
            mean = float(10 ** rng.uniform(0, 6) * rng.choice([-1, 0, 1]))
            x = _rows(rng, n, mean, float(10 ** rng.uniform(-3, 1.5)))
            mu, v = _exact(x)
            e, a = _proved(spec, x, v)
            for m1, m2 in _programs(x, n, rng).values():
                vt = (m2 / np.float32(n)).astype(np.float32).astype(np.float64)
                worst["mean"] = max(worst["mean"], float(np.max(np.abs(m1 - mu) / e)))
                worst["var"] = max(worst["var"], float(np.max(np.abs(vt - v) / (a * (v + EPS)))))
    return worst


def test_welford_trees_inside_the_proved_moments() -> None:
    """Every program of the family: |mu~ - mu| <= e_mu and |v~ - v| <= a (v + eps) under the
    default spec (measured: 0.24 and 0.13 of the bounds at worst)."""
    w = _worst(DEFAULT)
    print(f"\ndefault spec (moments: any), worst observed / proved: mean {w['mean']:.3g}, "
          f"variance {w['var']:.3g}")
    assert w["mean"] <= 1 and w["var"] <= 1, w


def test_two_pass_bound_alone_misses_welford() -> None:
    """The mutation: the old default (two-pass sums only) does not hold these programs'
    variances (measured: up to 63x its bound), so the test above fails on it."""
    w = _worst(SUMS)
    print(f"\nmoments: sums, worst observed / proved: mean {w['mean']:.3g}, variance {w['var']:.3g}")
    assert w["var"] > 1, w


def test_torch_rowwise_emulation_is_torch() -> None:
    """The emulated tree is torch's: the same mean bit for bit (x86, 8 fp32 lanes), and its
    height stays within the family's D."""
    rng = np.random.default_rng(3)
    for n in (7, 64, 100, 1000, 4096):
        x = (1e4 + 3 * rng.standard_normal((4, n))).astype(np.float32)
        _, mean, _ = torch.native_layer_norm(torch.from_numpy(x), (n,), None, None, EPS)
        hits = [lanes for lanes in (8, 16)
                if np.array_equal(wp.torch_rowwise(x, lanes)[0], mean.numpy().ravel())]
        if not hits:
            pytest.skip("this torch build's RowwiseMoments is not the emulated x86 one")
        # height: chunk chain 16, into the stack 1, cascade + drain <= ceil(log2 m) + 1, lanes
        m = -(-(n // 8) // 16)
        assert 16 + 2 + math.ceil(math.log2(max(m, 1))) + 8 <= nz.welford_depth(n)


def test_layernorm_inside_the_default_interval() -> None:
    """End to end: torch's layer_norm and every program's LayerNorm inside the default spec's
    certified training interval (interval domain, point rows)."""
    rng = np.random.default_rng(5)
    worst = 0.0
    for n in (8, 64, 256):
        g = graph_of(node_model("LayerNormalization",
                                [("x", (8, n)), ("g", np.ones(n, np.float32)),
                                 ("b", np.zeros(n, np.float32))],
                                {"axis": -1, "epsilon": EPS}, opset=17))
        for mean, std in ((1e4, 1e-2), (1e2, 30.0), (0.0, 1.0), (3e5, 1.0)):
            x = _rows(rng, n, mean, std)
            box = certify_drift(g, DEFAULT, DEFAULT, {"x": x}, domain="interval").outputs["y0"]
            lo, hi = box.train_lo, box.train_hi
            outs = {"torch": torch.nn.functional.layer_norm(torch.from_numpy(x), (n,),
                                                            eps=EPS).numpy()}
            for name, (m1, m2) in _programs(x, n, rng).items():
                outs[name] = wp.layer_norm(x, m1, m2, EPS)
            for name, y in outs.items():
                y = y.astype(np.float64)
                assert np.all(lo <= y) and np.all(y <= hi), (name, n, mean, std)
                half = np.maximum(0.5 * hi - 0.5 * lo, 1e-300)
                worst = max(worst, float(np.max(np.abs(y - (0.5 * lo + 0.5 * hi)) / half)))
    print(f"\nworst excursion {worst:.3g}")


def test_explicit_sums_keeps_the_old_certificate_digests(tmp_path) -> None:
    """A contract that states ``moments: sums`` gets the kernel digests every certificate had
    under the old default (those of certs/mlp-fp8.kcert.json before ``any``), and its
    certificate checks."""
    import json
    from pathlib import Path

    from kcverify.cli import main

    root = Path(__file__).resolve().parents[2]
    text = (root / "examples/contracts/mlp-fp8.yaml").read_text()
    text = text.replace("../../models/mlp_tiny.onnx", str(root / "models/mlp_tiny.onnx"))
    text = text.replace("../data/mlp_points.npz", str(root / "examples/data/mlp_points.npz"))
    text = text.replace("train: {compute: fp32, accumulate: fp32}",
                        "train: {compute: fp32, accumulate: fp32, moments: sums}")
    text = text.replace("    compute: fp32\nslices:", "    compute: fp32\n    moments: sums\nslices:")
    contract = tmp_path / "mlp-fp8-sums.yaml"
    contract.write_text(text)
    model, cert = str(root / "models/mlp_tiny.onnx"), str(tmp_path / "c.kcert.json")
    assert main(["prove", str(contract), model, "--cert", cert, "--quiet"]) == 0
    kernels = {s["name"]: s["digest"]["sha256"] for s in json.loads(Path(cert).read_text())["subject"]
               if s["name"].startswith("kernel:")}
    assert kernels == {
        "kernel:inf": "88e69b35a6a41f0c2d65f79c812caa68eb38a8c7b4f2babbabf263d0d49c68bf",
        "kernel:train": "5cfbbedc93cf740093def4c31809b408c93a6627ea578bbbc50a841027f7d392"}
    assert main(["check", cert, model, str(contract)]) == 0


def test_realizer_runs_the_family() -> None:
    """kernels/realize.py realizes LayerNorm moments by Welford / Chan trees (``moments``):
    torch's tree gives torch's own mean through the whole op, every tree under every rounding
    lies inside the default interval, a two-pass-only spec refuses them, and
    ``random_realization`` draws them only where the spec admits them."""
    from kcverify.kernels.realize import (
        MOMENT_TREES,
        Realization,
        random_realization,
        run_kernel,
    )

    n = 100
    g, g2 = (graph_of(node_model("LayerNormalization",
                                 [("x", (8, n)), ("g", np.ones(n, np.float32)),
                                  ("b", np.zeros(n, np.float32))],
                                 {"axis": -1, "epsilon": EPS}, opset=17, n_out=k))
             for k in (1, 2))
    rng = np.random.default_rng(7)
    x = _rows(rng, n, 1e4, 0.5)
    _, mean_t, _ = torch.native_layer_norm(torch.from_numpy(x), (n,), None, None, EPS)
    mean_r = run_kernel(g2, DEFAULT, {"x": x}, moments="torch")["y1"].numpy().ravel()
    if np.array_equal(wp.torch_rowwise(x, 8)[0], mean_t.numpy().ravel()):
        assert np.array_equal(mean_r.astype(np.float32), mean_t.numpy().ravel())
    box = certify_drift(g, DEFAULT, DEFAULT, {"x": x}, domain="interval").outputs["y0"]
    for tree in MOMENT_TREES:
        for rounding in ("nearest", "up", "down"):
            y = run_kernel(g, DEFAULT, {"x": x}, moments=tree, rounding=rounding)["y0"].numpy()
            assert np.all(box.train_lo <= y) and np.all(y <= box.train_hi), (tree, rounding)
    with pytest.raises(KernelSpecError, match="two-pass sums only"):
        Realization(SUMS, moments="torch")
    drawn = {random_realization(DEFAULT, s).moments for s in range(40)}
    assert drawn == set(MOMENT_TREES)
    assert {random_realization(SUMS, s).moments for s in range(10)} == {"sums"}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny_encoder", "tiny_decoder"])
def test_models_with_welford_layernorms(name: str) -> None:
    """Whole transformers whose LayerNorms take their moments from each Welford / Chan tree
    (training and inference programs, directed roundings): every block, bounded from the
    realized inputs by the interval domain (sharp at points), holds both programs."""
    from pathlib import Path

    from kcverify.bounds import DiffBox, blocks_of, bound_block
    from kcverify.models.ir import load_onnx
    from tests.soundness._helpers import Stats, _Safe, check_contains, run

    root = Path(__file__).resolve().parents[2]
    g = load_onnx(root / "models" / f"{name}.onnx")
    inf = parse_kernel_spec("inf", {"weights": {"format": "fp8_e4m3", "scale": "per_channel"},
                                    "accumulate": "fp32", "compute": "fp32"})
    feeds = {g.inputs[0].name: np.random.default_rng(11).integers(0, 256, size=(1, 8))}
    stats = Stats()
    pairs = [("torch", "chunks", "up"), ("pairwise", "torch", "down"), ("chunks", "sums", "nearest")]
    for k, (mt, mi, rounding) in enumerate(pairs):
        rt = _Safe(DEFAULT, seed=k, order="pairwise", rounding=rounding, moments=mt)
        ri = _Safe(inf, seed=k + 9, order="sequential", rounding=rounding, moments=mi)
        vt, vi = run(g, rt, feeds, keep=True), run(g, ri, feeds, keep=True)
        for b in blocks_of(g):
            if not any(nd.op_type == "LayerNormalization" for nd in b.graph.nodes):
                continue
            ins = {}
            for nm in b.inputs:
                t, i = vt[nm].double().numpy(), vi[nm].double().numpy()
                d = np.where(np.isfinite(t) & np.isfinite(i), i - t, 0.0)
                ins[nm] = DiffBox(t, t.copy(), i, i.copy(), d, d.copy())
            for nm, box in bound_block(b, DEFAULT, inf, ins, "interval").items():
                check_contains(stats, box, vt[nm].numpy(), vi[nm].numpy(), f"{name}/{b.name}/{nm}/{mt}-{mi}")
    print(f"\n{name}: {stats.report()}")
    assert stats.pairs and not stats.violations, "\n".join(stats.violations[:5])
