"""Every shipped model (models/*.onnx): certified sets must contain what conforming programs of
both kernels compute, for point inputs and regions (MLPs: input-space boxes; token models:
embedding-space boxes), and block by block from realized block inputs (so the transformer blocks
are checked on finite, non-trivial bounds even where whole-model interval bounds blow up)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kcverify.bounds import DiffBox, Region, blocks_of, bound_block, certify_drift
from kcverify.models.ir import load_onnx
from tests.soundness._helpers import (
    SPECS,
    TRAIN,
    Stats,
    check_contains,
    realizations,
    run,
    sample_box,
)

MODELS = Path(__file__).resolve().parents[2] / "models"
SHIPPED = sorted(p.stem for p in MODELS.glob("*.onnx"))
TOKEN = {"tiny_decoder", "tiny_encoder"}


def _feeds(name: str, graph, rng: np.random.Generator, batch: int, seq: int = 8
           ) -> dict[str, np.ndarray]:
    v = graph.inputs[0]
    if name in TOKEN or (v.dtype or "").startswith("int"):
        return {v.name: rng.integers(0, 256, size=(batch, seq))}
    return {v.name: rng.normal(size=(batch, int(v.shape[1]))).astype(np.float64)}


def _whole(name: str, spec_name: str, n_inputs: int, n_real: int, seed: int, seq: int = 8) -> Stats:
    stats = Stats()
    g = load_onnx(MODELS / f"{name}.onnx")
    spec = SPECS[spec_name]
    rng = np.random.default_rng(seed)
    feeds = _feeds(name, g, rng, 2, seq)
    out = g.outputs[0].name
    reals = list(zip(realizations(TRAIN, n_real, seed), realizations(spec, n_real, seed + 7)))
    res = certify_drift(g, TRAIN, spec, feeds)
    for rt, ri in reals:
        check_contains(stats, res.outputs[out], run(g, rt, feeds)[out].numpy(),
                       run(g, ri, feeds)[out].numpy(), f"{name}/{spec_name}/point/{ri}")
    if name not in TOKEN:
        region = Region("input", "linf", 0.02)
        results = {d: certify_drift(g, TRAIN, spec, feeds, region=region, domain=d)
                   for d in ("best", "linear")}
        (k, x), = feeds.items()
        for pt in sample_box(rng, x, region.eps, n_inputs):
            for rt, ri in reals:
                yt, yi = run(g, rt, {k: pt})[out].numpy(), run(g, ri, {k: pt})[out].numpy()
                for d, res in results.items():
                    check_contains(stats, res.outputs[out], yt, yi, f"{name}/{spec_name}/box/{d}/{ri}")
    return stats


def _blockwise(name: str, spec_name: str, n_real: int, seed: int) -> Stats:
    """Each block from the realized inputs of one (train, inf) pair of programs."""
    stats = Stats()
    g = load_onnx(MODELS / f"{name}.onnx")
    spec = SPECS[spec_name]
    rng = np.random.default_rng(seed)
    feeds = _feeds(name, g, rng, 2)
    blocks = blocks_of(g)
    for rt, ri in zip(realizations(TRAIN, n_real, seed), realizations(spec, n_real, seed + 3)):
        vt, vi = run(g, rt, feeds, keep=True), run(g, ri, feeds, keep=True)
        for b in blocks:
            ins = {}
            for nm in b.inputs:
                t, i = vt[nm].double().numpy(), vi[nm].double().numpy()
                d = np.where(np.isfinite(t) & np.isfinite(i), i - t, 0.0)
                ins[nm] = DiffBox(t, t.copy(), i, i.copy(), d, d.copy())
            outs = bound_block(b, TRAIN, spec, ins, "interval")
            for nm, box in outs.items():
                check_contains(stats, box, vt[nm].numpy(), vi[nm].numpy(), f"{name}/{b.name}/{nm}/{ri}")
    return stats


def test_every_model_is_covered() -> None:
    assert {"tiny_decoder", "tiny_encoder", "mlp_small", "mlp_tiny"} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_model_sound_fast(name: str) -> None:
    # token models: their realizations take seconds each, so the block-by-block check is slow-only
    n_real = 1 if name in TOKEN else 4
    stats = _whole(name, "fp8_bf16", n_inputs=3, n_real=n_real, seed=5, seq=4)
    assert not stats.violations, "\n".join(stats.violations[:5])
    if name in TOKEN:
        return
    stats = _blockwise(name, "fp8_fp32", n_real=2, seed=6)
    assert not stats.violations, "\n".join(stats.violations[:5])


def _slow_params() -> list:
    """(model, spec) pairs. The token models' realizations take seconds each, so CI checks each
    spec on one of the two (alternating) and the other pairing is a campaign; MLPs take every
    spec."""
    out = []
    for name in SHIPPED:
        for i, spec_name in enumerate(sorted(SPECS)):
            other = name in TOKEN and (i + sorted(TOKEN).index(name)) % 2 == 1
            out.append(pytest.param(name, spec_name, id=f"{name}-{spec_name}",
                                    marks=[pytest.mark.campaign] if other else []))
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("name", "spec_name"), _slow_params())
def test_model_sound_slow(name: str, spec_name: str) -> None:
    token = name in TOKEN  # their realizations run ~5 s each on a shared CPU
    stats = _whole(name, spec_name, n_inputs=20, n_real=3 if token else 12, seed=15)
    assert not stats.violations, "\n".join(stats.violations[:5])
    stats = _blockwise(name, spec_name, n_real=2 if token else 6, seed=16)
    assert not stats.violations, "\n".join(stats.violations[:5])
