"""Session 6: directed tie search against the fp8 enclosures (issue 12's work on zonotope.py /
binpoly.py / casts.py / cases.py). A program's only freedom at a tied activation cast (an
element whose exact quotient x / s and fp32 quotient fl32(x / s) round to different e4m3
values) is which of the two it takes; random per-element flips (test_binpoly_attack) rarely
find the joint choice that drives one output element to its extreme. Here, per model and input:

1. certify (whole-graph ``best``, as ``prove --blocks whole`` does; or the given domain);
2. record every cast's tie set (all-exact and all-fp32 runs);
3. for the output elements whose certified drift is tightest against the baseline programs'
   drift, and each sign, coordinate ascent over the ties: flip one tie at a time (then pairs
   along the cast order), keep it when the element's drift grows; the summation order and the
   rescaling are searched as well (greedy orders, one / two / exact roundings);
4. containment of the final programs (every element: train, inf, drift) and the worst ratio.

Models: the tiny decoder under fp8-deploy (campaign: minutes per certification), and small
ONNX graphs with the shapes issue 12's enclosures target - attention whose scores carry both
per-tensor scales (QK^T, softmax, the P cast, PV), and a head cast under a per-tensor scale
whose amax moves with earlier ties - at inputs tied at e4m3 midpoints +-1 fp32 ulp
(test_binpoly_attack.tied_input).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper

from kcverify.bounds import certify_drift
from tests.soundness.adversarial.harness import (
    SESSION,
    TRAIN,
    Ledger,
    chain_model,
    graph_of,
)
from tests.soundness.adversarial.interp import ProgramRunner
from tests.soundness.adversarial.programs import Program
from tests.soundness.adversarial.test_binpoly_attack import SP, SP_TOKEN, _w, tied_input


@dataclass(frozen=True)
class TieProgram(Program):
    """Cast number n takes the fp32 quotient where ``masks[n]`` is True, the exact one
    elsewhere; ``record`` (a dict) receives each cast's tie mask (qe != q32)."""

    masks: Any = None
    record: Any = None
    calls: Any = None

    def cast(self, x, cs, s, rounding):
        n = len(self.calls)
        self.calls.append(n)
        qe = Program.cast(self.with_(quotient="exact"), x, cs, s, rounding)
        q32 = Program.cast(self.with_(quotient="fp32"), x, cs, s, rounding)
        if self.record is not None:
            self.record[n] = qe != q32
        m = self.masks.get(n) if self.masks is not None else None  # _all_true() is empty
        if m is None:
            return qe
        m = np.asarray(m)
        m = m.reshape(qe.shape) if m.size == qe.size else np.broadcast_to(m, qe.shape)
        return np.where(m, q32, qe)


def tie_prog(sp, masks: dict, order: str, rescale: str, record: dict | None = None,
             label: str = "") -> TieProgram:
    return TieProgram(sp, order=order, row_order=order, rescale=rescale, masks=masks,
                      record=record, calls=[], label=label or f"tie/{order}/{rescale}")


def tie_search(model: onnx.ModelProto, sp, feeds: dict, boxes: dict, out: str,
               n_targets: int = 2, passes: int = 2, budget_runs: int = 400, seed: int = 0
               ) -> tuple[list[str], float, int]:
    """Steps 2-4 of the module doc. Returns (violations, worst obs/cert ratio, runs)."""
    run = ProgramRunner(model)
    rng = np.random.default_rng(seed)
    ties: dict[int, np.ndarray] = {}
    for q in ("exact", "fp32"):
        rec: dict = {}
        base = {} if q == "exact" else None
        p = tie_prog(sp, base if base is not None else _all_true(), "seq", "one", rec)
        with np.errstate(all="ignore"):
            run(p, feeds)
        for n, m in rec.items():
            ties[n] = ties.get(n, np.zeros_like(m)) | m
    tie_list = [(n, i) for n, m in sorted(ties.items()) for i in np.flatnonzero(m.reshape(-1))]
    shapes = {n: m.shape for n, m in ties.items()}
    arrs = boxes[out].arrays()
    dl, dh = arrs[4], arrs[5]
    trains = {o: run(Program(TRAIN, order=o, row_order=o, label=f"train/{o}"), feeds)[out]
              for o in ("greedy_up", "greedy_down", "seq")}
    runs = 0

    def drift_of(masks: dict, order: str, rescale: str, t_order: str) -> np.ndarray:
        nonlocal runs
        runs += 1
        with np.errstate(all="ignore"):
            yi = run(tie_prog(sp, masks, order, rescale), feeds)[out]
        return yi - trains[t_order], yi

    d0, _ = drift_of({}, "seq", "one", "seq")
    half = np.maximum(np.abs(dl), np.abs(dh))
    with np.errstate(divide="ignore", invalid="ignore"):
        score = np.where(half > 0, np.abs(d0) / half, 0)
    targets = np.argsort(-score.reshape(-1))[:n_targets]
    found: list[str] = []
    led = Ledger()
    cls = "s6/fp8/tie-search"
    worst = 0.0
    for t in targets:
        for sign in (1.0, -1.0):
            masks: dict[int, np.ndarray] = {n: rng.random(shapes[n]) < 0.5 for n in shapes}
            order, rescale, t_order = ("greedy_up", "two", "greedy_down") if sign > 0 else (
                "greedy_down", "one", "greedy_up")
            d, yi = drift_of(masks, order, rescale, t_order)
            best = sign * d.reshape(-1)[t]
            for _ in range(passes):
                improved = False
                for n, i in rng.permutation(np.array(tie_list, dtype=object)) if tie_list else []:
                    if runs >= budget_runs:
                        break
                    m = masks[n].reshape(-1)
                    m[i] = ~m[i]
                    d2, y2 = drift_of(masks, order, rescale, t_order)
                    v = sign * d2.reshape(-1)[t]
                    if v > best:
                        best, d, yi, improved = v, d2, y2, True
                    else:
                        m[i] = ~m[i]
                for o2, r2, to2 in (("seq", "exact", "seq"), ("rev", rescale, t_order),
                                    (order, "exact", t_order)):
                    d2, y2 = drift_of(masks, o2, r2, to2)
                    if sign * d2.reshape(-1)[t] > best:
                        best, d, yi = sign * d2.reshape(-1)[t], d2, y2
                        order, rescale, t_order = o2, r2, to2
                if not improved:
                    break
            found += led.check(cls, boxes[out], trains[t_order], yi,
                               f"{cls}: target {int(t)} sign {sign:+.0f} ({order}/{rescale})")
            c = max(abs(dl.reshape(-1)[t]), abs(dh.reshape(-1)[t]))
            if c > 0:
                worst = max(worst, abs(best) / c)
    led[cls].worst_drift = max(led[cls].worst_drift, worst)
    SESSION.merge(led)
    print(cls, f"ties {len(tie_list)}, runs {runs}, worst target obs/cert {worst:.4g}, "
          f"violations {len(found)}")
    return found, worst, runs


def _all_true() -> dict:
    class _All(dict):
        def get(self, n, default=None):
            return True
    return _All()


# --- small graphs -----------------------------------------------------------------------
def attn_scores_net(rng: np.random.Generator, T: int = 4, K: int = 6, D: int = 4):
    """x (1, T, K) -> q = x Wq, k = x Wk (activation casts of x, per-tensor), S = q k^T / 2
    (casts of q and k: the scores carry sQ sK), softmax, P V with v = x Wv (the P cast)."""
    Wq, Wk, Wv = (_w(rng, (K, D), 2.0) for _ in range(3))
    nodes = [helper.make_node("MatMul", ["x", "Wq"], ["q"], name="mq"),
             helper.make_node("MatMul", ["x", "Wk"], ["k"], name="mk"),
             helper.make_node("MatMul", ["x", "Wv"], ["v"], name="mv"),
             helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["q", "kt"], ["s0"], name="qk"),
             helper.make_node("Mul", ["s0", "half"], ["s"]),
             helper.make_node("Softmax", ["s"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["y"], name="pv")]
    model = chain_model(nodes, [("x", (1, T, K)), ("Wq", Wq), ("Wk", Wk), ("Wv", Wv),
                                ("half", np.array(0.5, np.float32))], ["p", "y"], opset=17)
    return model, {"x": tied_input((1, T, K), rng)}


def head_net(rng: np.random.Generator, T: int = 4, K: int = 6, H: int = 16, N: int = 8):
    """x -> h = x W1 (ties of x move h), LayerNorm(h) (per-token noise), the head's cast of
    LN(h) under a per-tensor scale whose amax moves with the ties, y = LN(h) W2."""
    W1 = _w(rng, (K, H), 2.0)
    W2 = _w(rng, (H, N), 1.0)
    g = np.ones(H, np.float32)
    b = np.zeros(H, np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"], name="m1"),
             helper.make_node("LayerNormalization", ["h", "g", "b"], ["n"], axis=-1,
                              epsilon=1e-5),
             helper.make_node("MatMul", ["n", "W2"], ["y"], name="m2")]
    model = chain_model(nodes, [("x", (1, T, K)), ("W1", W1), ("W2", W2), ("g", g), ("b", b)],
                        ["n", "y"], opset=17)
    return model, {"x": tied_input((1, T, K), rng)}


NETS = {"attn": attn_scores_net, "head": head_net}


def small_case(name: str, seed: int, sp, domain: str = "best") -> tuple[list[str], float]:
    rng = np.random.default_rng([seed, len(name)])
    model, feeds = NETS[name](rng)
    boxes = certify_drift(graph_of(model), TRAIN, sp, feeds, domain=domain).outputs
    found, worst, _ = tie_search(model, sp, feeds, boxes, "y", n_targets=2, passes=2,
                                 budget_runs=120, seed=seed)
    return found, worst


@pytest.mark.parametrize("name", sorted(NETS))
def test_tie_search_small(name: str) -> None:
    """Inside; and on the attention net the search reaches the certified drift (0.9998 at
    8005303-580b1b2): a bound 1 % tighter would be caught."""
    found, worst = small_case(name, 1, SP)
    assert not found, "\n".join(found[:3])
    if name == "attn":
        assert worst > 0.95, worst


@pytest.mark.campaign
@pytest.mark.parametrize("domain", ["best", "zonotope"])
@pytest.mark.parametrize("name", sorted(NETS))
def test_tie_search_small_campaign(name: str, domain: str) -> None:
    found = []
    for seed in range(2, 10):
        for sp in (SP, SP_TOKEN):
            f, _ = small_case(name, seed, sp, domain)
            found += f
    assert not found, "\n".join(found[:3])


@pytest.mark.campaign
@pytest.mark.parametrize("index", [0, 1, 5])
def test_tie_search_decoder(index: int) -> None:
    """tiny_decoder under fp8-deploy, the whole graph as one best block (prove --blocks whole)
    at eval input ``index``."""
    from tests.soundness.adversarial.subjects import shipped
    from tests.soundness.adversarial.test_fp8_deploy_models import ROOT, deploy_spec

    sp = deploy_spec()
    ids = np.load(ROOT / "examples" / "data" / "eval.npz")["input_ids"][index:index + 1]
    model = shipped("tiny_decoder")
    kw = {"cut": "whole"}
    try:
        res = certify_drift(graph_of(model), TRAIN, sp, {"input_ids": ids}, domain="best", **kw)
    except TypeError:  # before 580b1b2
        res = certify_drift(graph_of(model), TRAIN, sp, {"input_ids": ids}, domain="best")
    print("decoder eval", index, "certified linf", float(np.max(res.linf)))
    found, _, _ = tie_search(model, sp, {"input_ids": ids}, res.outputs, "logits",
                             n_targets=2, passes=1, budget_runs=160, seed=index)
    assert not found, "\n".join(found[:3])
