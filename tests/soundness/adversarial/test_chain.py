"""The regions chain domain (kcverify/regions/chain.py: symbolic differential bounds over input
boxes, and a split's children inheriting their parent's pre-activation boxes) against
conforming programs of fp16-weight kernels (fp16 compute with fp32 or fp16 accumulation, e4m3
weights in fp16) on ACAS Xu networks: at every corner of each box, at random points, and at
points on first-layer ReLU kinks (a pre-activation solved to 0 along one coordinate), for the
parent boxes and for their halves bounded with the parent's boxes as ``prior``.
Skips when the ACAS Xu data is not beside the checkout (tests/regions/helpers.acas_dir).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tests.soundness.adversarial.arith import rnd
from tests.soundness.adversarial.attacks import pairs
from tests.soundness.adversarial.harness import SESSION, TRAIN, Ledger, graph_of, spec
from tests.soundness.adversarial.interp import ProgramRunner

SPECS = {
    "fp16": spec(compute="fp16", accumulate="fp32"),
    "fp16acc": spec(compute="fp16", accumulate="fp16"),
    "e4m3w-fp16": spec(weights={"format": "fp8_e4m3", "scale": "per_channel"}, compute="fp16",
                       accumulate="fp32"),
}


class _Sets:
    """A chain Bounds row as the six arrays Ledger.check reads."""

    def __init__(self, r, b: int) -> None:
        self.a = tuple(t[b:b + 1].numpy() for t in (r.lo[0], r.hi[0], r.lo[1], r.hi[1],
                                                     r.dlo, r.dhi))

    def arrays(self):
        return self.a


def _acas(net: str):
    import onnx

    from tests.regions.helpers import acas_dir

    d = acas_dir()
    if d is None:
        pytest.skip("ACAS Xu data not available")
    return onnx.load(str(d / f"ACASXU_run2a_{net}_batch_2000.onnx"))


def kink_points(model, lo: np.ndarray, hi: np.ndarray, rng: np.random.Generator, k: int
                ) -> list[np.ndarray]:
    """Points of [lo, hi] where a first-layer pre-activation (x - mean) W1 + b1 is 0 (solved
    along one coordinate, in float64, then stored in fp32)."""
    from onnx import numpy_helper

    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    mean = inits["input_AvgImg"].reshape(-1).astype(np.float64)
    W = inits["Operation_1_MatMul_W"].astype(np.float64)
    b = inits["Operation_1_Add_B"].astype(np.float64)
    out = []
    for _ in range(200):
        p = rng.uniform(lo, hi)
        j = int(rng.integers(W.shape[1]))
        d = int(rng.integers(W.shape[0]))
        pre = (p - mean) @ W[:, j] + b[j]
        if W[d, j] == 0:
            continue
        v = p[d] - pre / W[d, j]
        if lo[d] <= v <= hi[d]:
            p[d] = v
            out.append(rnd(p, "fp32"))
        if len(out) == k:
            break
    return out


def chain_attack(cls: str, model, sp, lo: np.ndarray, hi: np.ndarray, prior=None,
                 n_random: int = 4, n_kinks: int = 4, seed: int = 0):
    """Bound the boxes (batch, 5), run program pairs at each box's corners, random and kink
    points; returns (violations, the Bounds)."""
    from kcverify.regions.chain import ChainBounds, extract_chain

    g = graph_of(model)
    chain = extract_chain(g)
    cb = ChainBounds(chain, TRAIN, sp)
    r = cb.bound(lo, hi, prior=prior)
    run = ProgramRunner(model)
    name = run.inputs[0]
    progs = pairs(TRAIN, sp, 4, seed)
    rng = np.random.default_rng(seed)
    led = Ledger()
    found = []
    for b in range(lo.shape[0]):
        pts = [rnd(np.where(np.array(c, bool), hi[b], lo[b]), "fp32")
               for c in itertools.product((0, 1), repeat=lo.shape[1])]
        pts += [rnd(rng.uniform(lo[b], hi[b]), "fp32") for _ in range(n_random)]
        pts += kink_points(model, lo[b], hi[b], rng, n_kinks)
        sets = _Sets(r, b)
        for p in pts:
            p = np.clip(p, lo[b], hi[b])  # an fp32 rounding pulled back into the box
            feeds = {name: p.reshape(1, 1, 1, -1).astype(np.float32)}
            for pt, pi in progs:
                with np.errstate(all="ignore"):
                    yt = run(pt, feeds)[model.graph.output[0].name].reshape(1, -1)
                    yi = run(pi, feeds)[model.graph.output[0].name].reshape(1, -1)
                found += led.check(cls, sets, yt, yi, f"{cls}: box {b}: {pt} | {pi}")
    SESSION.merge(led)
    return found, r, cb


def _boxes(rng: np.random.Generator, n: int, eps: float) -> tuple[np.ndarray, np.ndarray]:
    c = rng.uniform(-0.3, 0.5, size=(n, 5))
    c = rnd(c, "fp32")
    return rnd(c - eps, "fp32"), rnd(c + eps, "fp32")


@pytest.mark.parametrize("sp_name", sorted(SPECS))
def test_acas_boxes_and_halves(sp_name: str) -> None:
    """ACAS Xu 1_1: two boxes of radius 0.02, then each box's halves along its widest-effect
    coordinate (0) bounded with the parent's pre-activation boxes as prior."""
    model = _acas("1_1")
    sp = SPECS[sp_name]
    rng = np.random.default_rng(len(sp_name))
    lo, hi = _boxes(rng, 2, 0.02)
    found, r, cb = chain_attack(f"chain/acas/{sp_name}", model, sp, lo, hi, seed=1)
    mid = rnd(0.5 * (lo[:, 0] + hi[:, 0]), "fp32")
    clo = np.concatenate([lo, lo]).copy()
    chi = np.concatenate([hi, hi]).copy()
    chi[:2, 0] = mid
    clo[2:, 0] = mid
    prior = r.intermediates(cb.chain.steps)
    prior = np.concatenate([prior, prior]) if isinstance(prior, np.ndarray) else \
        __import__("torch").cat([prior, prior])
    f2, _, _ = chain_attack(f"chain/acas-halves/{sp_name}", model, sp, clo, chi, prior=prior,
                            seed=2)
    found += f2
    assert not found, "\n".join(found[:3])


@pytest.mark.campaign  # ~100 s each (session 3); CI keeps the shorter rows / boxes
@pytest.mark.parametrize("net", ["2_3", "3_5", "5_9"])
def test_acas_more_networks(net: str) -> None:
    model = _acas(net)
    rng = np.random.default_rng(int(net.replace("_", "")))
    lo, hi = _boxes(rng, 3, 0.05)
    found = []
    for sp_name, sp in SPECS.items():
        found += chain_attack(f"chain/acas/{sp_name}", model, sp, lo, hi, seed=3)[0]
    assert not found, "\n".join(found[:3])
