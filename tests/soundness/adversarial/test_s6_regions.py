"""Session 6: the regions split with quartered parts (babc86e: parts above 3 eps cut twice on
their chosen dimension, the halves between not bounded, tree entries -2 - d) on ACAS Xu under
the NeuroDiff kernel (fp16 weights, fp32 compute and accumulation, any order) and on random
MLPs with kinks at the box centre. Every proved leaf's claim is attacked at its corners, at
random points and at points found by projected sign-gradient ascent on |f'_j - f_j| (f' the
network with its weights rounded to fp16, in float64: a model of the drift written here from
the ONNX file, not from kcverify), each point then run by conforming programs (programs.py:
greedy and reversed summation orders, directed roundings); and the tree is replayed as the
checker does (kcverify.regions.plan.tree_bounds, batch 7 and 64): a replayed value above a
proved claim is a false refusal.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from tests.soundness.adversarial.arith import next_down, next_up, rnd
from tests.soundness.adversarial.attacks import pairs
from tests.soundness.adversarial.harness import SESSION, TRAIN, graph_of, spec
from tests.soundness.adversarial.interp import ProgramRunner
from tests.soundness.adversarial.test_alpha_corners import random_mlp
from tests.soundness.adversarial.test_chain import _acas

FP16W = spec(weights={"format": "fp16", "scale": "none"}, compute="fp32", accumulate="fp32")


class Drift:
    """f and f' of a Sub / Flatten / Reshape / MatMul / Gemm / Add / Relu / Identity chain in
    float64 torch: f with the weights as stored, f' with every MatMul / Gemm weight rounded to
    fp16 (round to nearest even: what ``weights: {format: fp16, scale: none}`` does)."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.inits = {i.name: numpy_helper.to_array(i).astype(np.float64)
                      for i in model.graph.initializer}
        self.inp = next(i.name for i in model.graph.input if i.name not in self.inits)

    def run(self, x: torch.Tensor, quant: bool) -> torch.Tensor:
        env = {self.inp: x}

        def val(name: str, weight: bool = False) -> torch.Tensor:
            if name in env:
                return env[name]
            a = self.inits[name]
            if weight and quant:
                a = rnd(a, "fp16")
            return torch.from_numpy(np.asarray(a, np.float64))

        for n in self.model.graph.node:
            op = n.op_type
            if op == "Sub":
                y = val(n.input[0]) - val(n.input[1])
            elif op == "Add":
                y = val(n.input[0]) + val(n.input[1])
            elif op in ("Flatten", "Reshape"):
                y = val(n.input[0]).reshape(x.shape[0], -1)
            elif op == "MatMul":
                y = val(n.input[0]) @ val(n.input[1], weight=True)
            elif op == "Gemm":
                b = val(n.input[1], weight=True)
                trans = any(a.name == "transB" and a.i for a in n.attribute)
                y = val(n.input[0]) @ (b.T if trans else b)
                if len(n.input) > 2:
                    y = y + val(n.input[2])
            elif op == "Relu":
                y = torch.relu(val(n.input[0]))
            elif op == "Identity":
                y = val(n.input[0])
            else:
                raise NotImplementedError(op)
            env[n.output[0]] = y
        return env[self.model.graph.output[0].name].reshape(x.shape[0], -1)

    def ascend(self, lo: np.ndarray, hi: np.ndarray, starts: int, steps: int,
               rng: np.random.Generator) -> np.ndarray:
        """Points of [lo, hi] (flat) maximising |f'_j - f_j| for each output j and sign, by
        projected sign-gradient steps from random starts (batch: starts x 2 n_out)."""
        lo_t, hi_t = torch.from_numpy(lo), torch.from_numpy(hi)
        n_out = self.run(lo_t[None], False).shape[1]
        k = starts * 2 * n_out
        x = lo_t + (hi_t - lo_t) * torch.from_numpy(rng.random((k, lo.size)))
        which = torch.arange(k) % n_out
        sign = torch.where((torch.arange(k) // n_out) % 2 == 0, 1.0, -1.0).double()
        step = (hi_t - lo_t) / 8
        for s in range(steps):
            x = x.detach().requires_grad_(True)
            d = self.run(x, True) - self.run(x, False)
            obj = (sign * d[torch.arange(k), which]).sum()
            (g,) = torch.autograd.grad(obj, x)
            with torch.no_grad():
                x = torch.minimum(torch.maximum(x + step * torch.sign(g), lo_t), hi_t)
            if s % 8 == 7:
                step = step / 2
        return x.detach().numpy()


def attack_split(cls: str, model: onnx.ModelProto, lo: np.ndarray, hi: np.ndarray,
                 shape: tuple[int, ...], eps: float, budget: float, seed: int,
                 max_leaves: int = 24, n_pairs: int = 3) -> tuple[list[str], dict]:
    from kcverify.regions.chain import ChainBounds, chain_method, extract_chain
    from kcverify.regions.plan import ALPHA_ITERS, tree_bounds
    from kcverify.regions.property import DriftObjective
    from kcverify.regions.split import branch_and_bound, cut_options

    alpha = ALPHA_ITERS or 2
    g = graph_of(model)
    cb = ChainBounds(extract_chain(g), TRAIN, FP16W, alpha_iters=alpha)
    obj = DriftObjective(cb, eps, hi - lo)
    with torch.no_grad():
        out = branch_and_bound(lo, hi, obj, budget_s=budget, batch=64, **cut_options(obj, True))
    stats = {"quartered": sum(1 for d in out.tree if d <= -2), "leaves": len(out.leaves),
             "proved": sum(lf.proved for lf in out.leaves), "bound": out.bound}
    claims = np.array([lf.value for lf in out.leaves])
    proved = np.array([lf.proved for lf in out.leaves])
    found: list[str] = []
    st = SESSION[cls + "/replay"]
    for batch in (7, 64):
        again = tree_bounds(g, TRAIN, FP16W, chain_method(alpha), "x" if "x" in
                            {i.name for i in model.graph.input} else "input", shape, lo, hi,
                            out.tree, batch=batch)
        st.pairs += int(proved.sum())
        for k in np.flatnonzero(proved & ~(again <= claims))[:3]:
            found.append(f"{cls}: leaf {k}: replay (batch {batch}) {again[k]!r} above its claim "
                         f"{claims[k]!r} (a false refusal)")
        ok = proved & np.isfinite(again) & (claims > 0)
        if np.any(ok):
            st.worst_drift = max(st.worst_drift, float(np.max(again[ok] / claims[ok])))
    st.violations += found
    rng = np.random.default_rng(seed)
    idx = np.flatnonzero(proved)
    if len(idx) > max_leaves:
        idx = np.sort(rng.choice(idx, size=max_leaves, replace=False))
    dr = Drift(model)
    run = ProgramRunner(model)
    inp = dr.inp
    progs = pairs(TRAIN, FP16W, n_pairs, seed)
    st = SESSION[cls + "/leaves"]
    worst_model = 0.0
    for k in idx:
        lf = out.leaves[int(k)]
        pts = dr.ascend(lf.lo, lf.hi, 2, 24, rng)
        with torch.no_grad():
            dm = (dr.run(torch.from_numpy(pts), True) - dr.run(torch.from_numpy(pts), False))
        dm = dm.abs().max(1).values.numpy()
        best = pts[np.argsort(-dm)[:3]]
        corner = np.where(rng.random(lf.lo.shape) < 0.5, lf.lo, lf.hi)
        for p in [*best, corner]:
            # a float32 input inside the leaf (rounded inward where fp32 rounding left it)
            q = rnd(p, "fp32")
            q = np.where(q > lf.hi, next_down(q, "fp32"), q)
            q = np.where(q < lf.lo, next_up(q, "fp32"), q)
            if np.any(q > lf.hi) or np.any(q < lf.lo):
                continue
            feeds = {inp: q.reshape(shape).astype(np.float32)}
            for pt, pi in progs:
                with np.errstate(all="ignore"):
                    yt = run(pt, feeds)[model.graph.output[0].name]
                    yi = run(pi, feeds)[model.graph.output[0].name]
                d = float(np.max(np.abs(yi - yt)))
                st.pairs += 1
                if lf.value > 0:
                    st.worst_drift = max(st.worst_drift, d / lf.value)
                if not d <= lf.value:
                    msg = (f"{cls}: leaf {int(k)} x={q.tolist()}: {pt} | {pi}: drift {d!r} above "
                           f"the claim {lf.value!r}")
                    st.violations.append(msg)
                    found.append(msg)
        worst_model = max(worst_model, float(dm.max()) / lf.value if lf.value > 0 else 0.0)
    stats["attacked"] = len(idx)
    stats["worst_model_ratio"] = worst_model
    stats["worst_program_ratio"] = st.worst_drift
    print(cls, stats)
    return found, stats


def test_quartered_split_random_mlp() -> None:
    """A random MLP with every kink at the box centre (its drift large against eps, so parts
    are quartered), 3 s of splitting."""
    rng = np.random.default_rng(11)
    c = rnd(rng.uniform(-0.5, 0.5, size=4), "fp32")
    model = random_mlp(11, centre=c)
    lo, hi = rnd(c - 0.1, "fp32"), rnd(c + 0.1, "fp32")
    found, stats = attack_split("s6/regions/quad/mlp", model, lo, hi, (1, 4), eps=0.005,
                                budget=2.0, seed=1, max_leaves=6, n_pairs=2)
    assert stats["proved"] > 0, stats
    assert not found, "\n".join(found[:3])


@pytest.mark.campaign
@pytest.mark.parametrize("net", ["2_7", "3_3", "2_6", "1_9"])
def test_quartered_split_acas(net: str) -> None:
    model = _acas(net)
    rng = np.random.default_rng(int(net.replace("_", "")))
    found = []
    for eps, half in ((0.05, 0.04), (0.01, 0.02)):
        c = rnd(rng.uniform(-0.3, 0.3, size=5), "fp32")
        lo, hi = rnd(c - half, "fp32"), rnd(c + half, "fp32")
        f, stats = attack_split(f"s6/regions/quad/acas-{eps}", model, lo, hi, (1, 1, 1, 5),
                                eps=eps, budget=20.0, seed=3, max_leaves=24, n_pairs=3)
        found += f
    assert not found, "\n".join(found[:3])


@pytest.mark.campaign
def test_sat_instances_never_unsat(tmp_path) -> None:
    """ground_truth.csv's sat instances outside prop_2 (the hard-to-falsify ones: props 3, 4, 7,
    8) and every fifth prop_2 one, ``kcverify vnnlib`` at 10 s each: never ``unsat``."""
    import csv
    import subprocess
    import sys

    from tests.regions.helpers import acas_dir

    acas = acas_dir()
    if acas is None or not (acas / "ground_truth.csv").exists():
        pytest.skip("ACAS Xu data not available")
    with open(acas / "ground_truth.csv") as f:
        sat = [r for r in csv.DictReader(f) if r["expected"] == "sat"]
    pick = [r for r in sat if r["vnnlib"] != "prop_2.vnnlib"]
    pick += [r for r in sat if r["vnnlib"] == "prop_2.vnnlib"][::5]
    wrong, answers = [], {}
    for r in pick:
        out = tmp_path / "res.txt"
        p = subprocess.run([sys.executable, "-m", "kcverify", "vnnlib", str(acas / r["onnx"]),
                            str(acas / r["vnnlib"]), "--timeout", "10", "--out", str(out)],
                           capture_output=True, text=True, timeout=300)
        ans = out.read_text().split()[0] if out.exists() else f"exit {p.returncode}"
        answers[ans] = answers.get(ans, 0) + 1
        if ans == "unsat":
            wrong.append(f"{r['onnx']} {r['vnnlib']}: unsat, expected sat")
    print("sat instances:", len(pick), answers)
    assert not wrong, "\n".join(wrong)
