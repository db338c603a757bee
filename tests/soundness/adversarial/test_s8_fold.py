"""Session 8: the zonotope's symbol budget (folding / consolidation, issue 14) on deep chains.

A form that keeps at most ``K_MAX`` symbols and ``ELEMENT_BUDGET`` generator entries folds the
rest into its box term r (and, with the MiniLM helper's consolidation, into fresh per-element
symbols). Whatever is folded, every value and drift must stay enclosed. Attacked on chains of
pre-LayerNorm attention layers (x + Attn(LN(x)) Wo, then x + FFN(LN(x)), L = 2..4 layers, a
final LayerNorm and head), all intermediate layer outputs also graph outputs, under the w8 and
fp8-deploy kernels, with the budgets squeezed (K_MAX 4 / 16 / 64, ELEMENT_BUDGET 2^8 .. 2^12:
most symbols folded at every layer) and at their defaults; the whole graph as one block
(``cut="whole"``, what prove --blocks whole runs), ``best`` and ``zonotope``. Programs:
attacks.pairs (extreme orders / roundings crossed) and per-element extreme summation trees
(test_s8_accum.ExtremeProgram); inputs generic and tied at e4m3 midpoints +- 1 fp32 ulp.
Containment per element of every output (train, inf, drift).

``budget`` also reads the knobs a consolidation adds, when present (``CONSOLIDATE_K``: kept as
it is when the module lacks it), so the same cases run against it once it lands.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest
from onnx import helper

from kcverify.bounds import certify_drift
from tests.soundness.adversarial.attacks import pairs
from tests.soundness.adversarial.harness import (
    SESSION,
    TRAIN,
    Ledger,
    attack,
    chain_model,
    graph_of,
    ratio_text,
    spec,
)
from tests.soundness.adversarial.test_binpoly_attack import _w, tied_input

W8 = spec(weights={"format": "fp8_e4m3", "scale": "per_channel"}, accumulate="fp32",
          compute="fp32")
DEPLOY = spec(weights={"format": "fp8_e4m3", "scale": "per_channel"},
              activations={"format": "fp8_e4m3", "scale": "dynamic_per_tensor"},
              accumulate="fp32", compute="fp32", moments="sums")
SPECS = {"w8": W8, "deploy": DEPLOY}


def deep_net(rng: np.random.Generator, L: int = 3, T: int = 4, D: int = 8, F: int = 16,
             V: int = 6, causal: bool = True):
    """x (1, T, D) -> L pre-LN layers (attention with a causal -inf mask, then a GELU FFN),
    each layer's output a graph output too -> LayerNorm -> head (V)."""
    n = helper.make_node
    nodes = []
    inits: list = [("x", (1, T, D)), ("c", np.array(1 / np.sqrt(D), np.float32)),
                   ("g", np.ones(D, np.float32)), ("b", np.zeros(D, np.float32))]
    if causal:
        m = np.where(np.triu(np.ones((T, T), bool), 1), -np.inf, 0.0).astype(np.float32)[None]
        inits.append(("mask", m))
    src = "x"
    outs = []
    for li in range(L):
        p = f"l{li}_"
        for nm, shape in (("wq", (D, D)), ("wk", (D, D)), ("wv", (D, D)), ("wo", (D, D)),
                          ("w1", (D, F)), ("w2", (F, D))):
            inits.append((p + nm, _w(rng, shape, 0.5)))
        nodes += [n("LayerNormalization", [src, "g", "b"], [p + "h"], axis=-1, epsilon=1e-5),
                  n("MatMul", [p + "h", p + "wq"], [p + "q"], name=p + "mq"),
                  n("MatMul", [p + "h", p + "wk"], [p + "k"], name=p + "mk"),
                  n("MatMul", [p + "h", p + "wv"], [p + "v"], name=p + "mv"),
                  n("Transpose", [p + "k"], [p + "kt"], perm=[0, 2, 1]),
                  n("MatMul", [p + "q", p + "kt"], [p + "s0"], name=p + "qk"),
                  n("Mul", [p + "s0", "c"], [p + "s1"])]
        s = p + "s1"
        if causal:
            nodes.append(n("Add", [s, "mask"], [p + "s2"]))
            s = p + "s2"
        nodes += [n("Softmax", [s], [p + "pr"], axis=-1),
                  n("MatMul", [p + "pr", p + "v"], [p + "a"], name=p + "pv"),
                  n("MatMul", [p + "a", p + "wo"], [p + "o"], name=p + "mo"),
                  n("Add", [src, p + "o"], [p + "r1"]),
                  n("LayerNormalization", [p + "r1", "g", "b"], [p + "h2"], axis=-1,
                    epsilon=1e-5),
                  n("MatMul", [p + "h2", p + "w1"], [p + "f1"], name=p + "m1"),
                  n("Gelu", [p + "f1"], [p + "f2"]),
                  n("MatMul", [p + "f2", p + "w2"], [p + "f3"], name=p + "m2"),
                  n("Add", [p + "r1", p + "f3"], [p + "out"])]
        src = p + "out"
        outs.append(src)
    inits.append(("wh", _w(rng, (D, V), 0.5)))
    nodes += [n("LayerNormalization", [src, "g", "b"], ["hf"], axis=-1, epsilon=1e-5),
              n("MatMul", ["hf", "wh"], ["logits"], name="head")]
    model = chain_model(nodes, inits, ["logits", *outs], opset=20)
    return model


@contextmanager
def budget(k_max: int | None, elements: int | None, consolidate: int | None = None):
    from kcverify.bounds import zonotope as Z

    old = {}
    for name, v in (("K_MAX", k_max), ("ELEMENT_BUDGET", elements),
                    ("CONSOLIDATE_K", consolidate)):
        if v is not None and hasattr(Z, name):
            old[name] = getattr(Z, name)
            setattr(Z, name, v)
    try:
        yield
    finally:
        for name, v in old.items():
            setattr(Z, name, v)


BUDGETS = {"default": (None, None), "k4": (4, None), "k16-e256": (16, 2**8),
           "k64-e4096": (64, 2**12)}


def fold_case(sp_name: str, bud: str, seed: int, L: int = 3, inp: str = "tied",
              domain: str = "best", n_pairs: int = 6, n_trees: int = 3
              ) -> tuple[list[str], Ledger]:
    from tests.soundness.adversarial.test_s8_accum import ExtremeProgram

    rng = np.random.default_rng([seed, L, 3])
    model = deep_net(rng, L=L)
    shape = (1, 4, 8)
    x = (tied_input(shape, rng, amax=1.7) if inp == "tied"
         else (rng.normal(size=shape)).astype(np.float32))
    sp = SPECS[sp_name]
    g = graph_of(model)
    k, e = BUDGETS[bud]
    with budget(k, e), np.errstate(all="ignore"):
        boxes = certify_drift(g, TRAIN, sp, {"x": x}, domain=domain, cut="whole").outputs
    prs = pairs(TRAIN, sp, n_pairs, seed)
    prs += [(ExtremeProgram(TRAIN, pick="rand", seed=seed + 50),
             ExtremeProgram(sp, pick=pk, seed=seed, quotient=q, label=f"inf/trees-{pk}/{q}"))
            for pk, q in (("max", "exact"), ("min", "fp32"), ("rand", "mixed"))[:n_trees]]
    led = Ledger()
    cls = f"s8/fold/{sp_name}/{bud}/{domain}"
    found = attack(led, cls, model, TRAIN, sp, {"x": x}, prs, outputs=boxes, graph=g)
    SESSION.merge(led)
    return found, led


@pytest.mark.parametrize(("sp_name", "bud"), [("deploy", "k4")])
def test_fold_fast(sp_name: str, bud: str) -> None:
    found, led = fold_case(sp_name, bud, 1, L=1, n_pairs=2, n_trees=1)
    assert not found, "\n".join(found[:3]) + "\n" + ratio_text(
        led[f"s8/fold/{sp_name}/{bud}/best"])


def test_the_budget_is_reached() -> None:
    """Not vacuous: K_MAX 4 changes the whole-graph zonotope's bound of the one-layer net (the
    folding runs), which the fast case above then attacks."""
    rng = np.random.default_rng([1, 1, 3])
    model = deep_net(rng, L=1)
    x = tied_input((1, 4, 8), rng, amax=1.7)
    g = graph_of(model)
    got = {}
    for bud in ("default", "k4"):
        k, e = BUDGETS[bud]
        with budget(k, e), np.errstate(all="ignore"):
            res = certify_drift(g, TRAIN, DEPLOY, {"x": x}, domain="zonotope", cut="whole")
        got[bud] = float(np.max(res.linf))
    assert got["k4"] != got["default"], got


@pytest.mark.campaign
@pytest.mark.parametrize("domain", ["best", "zonotope"])
@pytest.mark.parametrize("bud", sorted(BUDGETS))
@pytest.mark.parametrize("sp_name", sorted(SPECS))
def test_fold_campaign(sp_name: str, bud: str, domain: str) -> None:
    found: list[str] = []
    led = Ledger()
    for seed in range(1, 4):
        for inp in ("tied", "normal"):
            f, lg = fold_case(sp_name, bud, seed, L=2 + seed % 3, inp=inp, domain=domain)
            found += f
            led.merge(lg)
    print(led.report())
    assert not found, "\n".join(found[:3])
