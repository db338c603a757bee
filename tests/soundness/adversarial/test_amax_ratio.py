"""Dynamic per-tensor casts relative to their own amax (zonotope._normalized_cast,
_scale_branches, _scale_table), attacked with quotients that sit within a few fp32 units of an
e4m3 midpoint *relative to the amax*.

The net: x (1, T, K) -> MatMul W1 -> h -> [Relu] -> MatMul W2 (h's cast is the one attacked).
W1's column 0 is w0, e4m3 values whose largest magnitude is 448 (its per-channel scale is 1),
and column j is w0 r_j: its cast has the same q and the scale fl32(r_j), so h[:, j] / h[:, 0] is
fl32(r_j) up to the programs' rescaling and accumulation roundings. With
r_j = fl32(m_j / 448 (1 + k_j 2^-24)), m_j an e4m3 midpoint and k_j in -3 .. 3, the quotient
h_j / fl32(amax / 448) that the next cast rounds is m_j (1 + O(2^-24)): the place where a
relative enclosure of x / s must refuse, and where programs round apart (quotient exact or fp32,
rescale in one or two roundings, orders). Column 0 is the amax with certainty (``certain``), or
column 1 is r_1 = 1 - 2^-7 (the amax element uncertain when x straddles: ``close``), or x's
first cast straddles (x at e4m3 midpoints: the amax depends on binary symbols, ``straddle``).
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from tests.soundness.adversarial.arith import rnd
from tests.soundness.adversarial.attacks import SPECS, fp8_midpoints
from tests.soundness.adversarial.harness import (
    SESSION,
    TRAIN,
    Ledger,
    attack,
    chain_model,
    ratio_text,
)
from tests.soundness.adversarial.programs import Program
from tests.soundness.adversarial.test_branches import chosen_options

SP, SP_BF16 = SPECS["fp8_tensor_fp32"], SPECS["fp8_tensor_bf16"]
KINDS = ("certain", "close", "straddle")


def ratio_weights(rng: np.random.Generator, K: int, H: int, kind: str) -> np.ndarray:
    grid = np.unique(np.abs(rnd(np.linspace(2.0**-6, 440, 4000), "fp8_e4m3")))
    mids = (grid[:-1] + grid[1:]) / 2
    w0 = rnd(rng.normal(size=K) * 100, "fp8_e4m3")
    w0[int(rng.integers(K))] = 448.0 * rng.choice([-1.0, 1.0])
    w0 = np.where(np.abs(w0) > 448, np.sign(w0) * 448, w0)
    cols = [w0]
    for j in range(1, H):
        if kind == "close" and j == 1:
            r = 1.0 - 2.0**-7
        else:
            m = float(mids[rng.integers(len(mids))])
            r = float(rnd(m / 448.0 * (1 + int(rng.integers(-3, 4)) * 2.0**-24), "fp32"))
        cols.append(w0 * r * rng.choice([-1.0, 1.0]))
    return np.stack(cols, axis=1).astype(np.float32)


def ratio_case(kind: str, seed: int, relu: bool, K: int = 6, T: int = 1, H: int = 8):
    rng = np.random.default_rng([seed, KINDS.index(kind), int(relu)])
    w1 = ratio_weights(rng, K, H, kind)
    w2 = rnd(rng.normal(size=(H, 3)), "fp8_e4m3").astype(np.float32)
    if kind == "straddle":
        x = fp8_midpoints((1, T, K), "fp8_e4m3", rng, amax=float(rng.uniform(0.5, 3.0)))
    else:  # positive, so that column 0 (w0 . x) is large
        x = rnd(np.abs(rng.normal(size=(1, T, K))) + 0.1, "fp32").astype(np.float32)
        x = (x * np.sign(w1[:, 0]).reshape(1, 1, K)).astype(np.float32)
    n = helper.make_node
    nodes = [n("MatMul", ["x", "w1"], ["h"])]
    z = "h"
    if relu:
        nodes.append(n("Relu", ["h"], ["a"]))
        z = "a"
    nodes.append(n("MatMul", [z, "w2"], ["y"]))
    model = chain_model(nodes, [("x", (1, T, K)), ("w1", w1), ("w2", w2)], ["y", "h"])
    return model, {"x": x}


def ratio_programs(sp, seed: int) -> list[tuple[Program, Program]]:
    rows = [("exact", "one", "seq"), ("fp32", "one", "rev"), ("exact", "two", "greedy_up"),
            ("fp32", "two", "greedy_down"), ("mixed", "one", "random"),
            ("mixed", "two", "alt"), ("exact", "exact", "asc"), ("fp32", "exact", "desc")]
    pt = [Program(TRAIN, order=o, seed=seed) for o in ("seq", "greedy_up", "greedy_down")]
    return [(pt[k % 3], Program(sp, quotient=q, rescale=r, order=o, seed=seed + k,
                                label=f"q-{q}/rescale-{r}/{o}"))
            for k, (q, r, o) in enumerate(rows)]


def ratio_attack(led: Ledger, kind: str, seed: int, relu: bool, sp=SP, T: int = 1):
    model, feeds = ratio_case(kind, seed, relu, T=T)
    cls = f"amax-ratio/{kind}" + ("/relu" if relu else "")
    with chosen_options() as counts:
        found = attack(led, cls, model, TRAIN, sp, feeds, ratio_programs(sp, seed))
    return found, counts, cls


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_quotients_at_midpoints_relative_to_the_amax(kind: str, relu: bool) -> None:
    led = Ledger()
    found, _, cls = ratio_attack(led, kind, 0, relu)
    SESSION.merge(led)
    assert led[cls].pairs > 0
    assert not found, ratio_text(led[cls]) + "\n" + "\n".join(found[:3])


def test_ratio_rules_are_reached() -> None:
    """The normalised cast (option 5) or the scale's branches (4, 6) carry some of h's casts,
    and programs cast h apart (the quotients really sit at midpoints)."""
    from tests.soundness.adversarial.interp import ProgramRunner

    hits = 0
    for kind in KINDS:
        _, counts, _ = ratio_attack(Ledger(), kind, 0, False)
        hits += sum(c for (node, opt), c in counts.items() if opt in (4, 5, 6))
    assert hits > 0
    model, feeds = ratio_case("certain", 0, False)
    traces = []
    run = ProgramRunner(model)
    for _, p in ratio_programs(SP, 0):
        tr: list = []
        run(p.with_(trace=tr), feeds)
        traces.append(tr[-1][1])
    assert any(not np.array_equal(traces[0], t) for t in traces[1:])


@pytest.mark.campaign
@pytest.mark.parametrize("kind", KINDS)
def test_quotients_at_midpoints_relative_to_the_amax_campaign(kind: str) -> None:
    led = Ledger()
    found = []
    for seed in range(2, 30):
        for relu in (False, True):
            for sp, T in ((SP, 1), (SP, 3), (SP_BF16, 2)):
                f, _, _ = ratio_attack(led, kind, seed, relu, sp, T)
                found += f
    SESSION.merge(led)
    assert not found, "\n".join(found[:5])


def seq_first_case(kind: str, seed: int, B: int = 2, T: int = 2, K: int = 6, H: int = 8):
    """The ratio net on a batch of B samples (2: the zonotope runs on it; on 3 it did not, so
    that the best domain was the interval one there) with the sample off axis 0 inside the graph
    (torch's seq-first attention layout): x (B, T, K) -> Transpose (T, B, K) -> W1 -> W2 ->
    Transpose back. A per-tensor scale is one per sample: the group [:, b, :]."""
    rng = np.random.default_rng([seed, KINDS.index(kind), 7])
    w1 = ratio_weights(rng, K, H, kind)
    w2 = rnd(rng.normal(size=(H, 3)), "fp8_e4m3").astype(np.float32)
    if kind == "straddle":
        x = np.stack([fp8_midpoints((T, K), "fp8_e4m3", rng, amax=float(rng.uniform(0.5, 3.0)))
                      for _ in range(B)])
    else:
        x = rnd(np.abs(rng.normal(size=(B, T, K))) * rng.uniform(0.2, 4.0, size=(B, 1, 1))
                + 0.1, "fp32")
        x = (x * np.sign(w1[:, 0]).reshape(1, 1, K)).astype(np.float32)
    n = helper.make_node
    nodes = [n("Transpose", ["x"], ["xt"], perm=[1, 0, 2]), n("MatMul", ["xt", "w1"], ["h"]),
             n("MatMul", ["h", "w2"], ["yt"]), n("Transpose", ["yt"], ["y"], perm=[1, 0, 2])]
    model = chain_model(nodes, [("x", (B, T, K)), ("w1", w1), ("w2", w2)], ["y"])
    return model, {"x": x.astype(np.float32)}


@pytest.mark.parametrize("kind", KINDS)
def test_ratio_with_the_sample_off_axis_0(kind: str) -> None:
    """A batch of 2 whose per-tensor groups are [:, b, :] inside the graph: the normalised
    cast and the scale's branches must group by sample, not by the leading axis."""
    led = Ledger()
    cls = f"amax-ratio/seq-first/{kind}"
    model, feeds = seq_first_case(kind, 0)
    with chosen_options() as counts:
        found = attack(led, cls, model, TRAIN, SP, feeds, ratio_programs(SP, 0))
    SESSION.merge(led)
    assert led[cls].pairs > 0
    assert counts, "the zonotope's casts were not reached"
    assert not found, ratio_text(led[cls]) + "\n" + "\n".join(found[:3])
