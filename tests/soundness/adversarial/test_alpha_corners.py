"""alpha-CROWN slopes in the regions chain domain (kcverify/regions/chain.py ``optimise_slopes``,
method ``chain:alpha<ALPHA_ITERS>``, the prover's setting in kcverify/regions/plan.py) against conforming programs of fp16 / e4m3-weight kernels.

Claims attacked: every ReLU's pre-activation boxes (both kernels and the drift; these are what
the optimised slopes tighten, ``ChainBounds._tighten``), the output sets, and the split
objective's per-part L-inf drift bound (``DriftObjective.bounds``, the training value's slopes
optimised too). Points: every corner of each box, edge points (all coordinates at a corner but
one), random points, and points on a ReLU kink of *every* layer (a pre-activation solved to 0 by
bisection along a segment of the box, so the intermediate bounds' unstable neurons are hit
where their relaxation is loosest), for the boxes and for their halves bounded under the
parent's boxes (``prior``). Networks: ACAS Xu (beside the checkout) and small random MLPs with
adversarial weights (magnitudes 2^-2 .. 2^3, biases that put every neuron's kink at the box
centre). The split-cover certificate: a short split with the alpha method, its tree replayed as
the checker does (``plan.tree_bounds``: a claim below the re-derived bound is a false refusal)
and every proved leaf attacked at its corners and kinks (a drift above its claim is a false
proof).
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from kcverify.regions.plan import ALPHA_ITERS  # the steps the prover uses
from tests.soundness.adversarial.arith import rnd
from tests.soundness.adversarial.attacks import pairs
from tests.soundness.adversarial.harness import SESSION, TRAIN, Ledger, graph_of, ratio_text
from tests.soundness.adversarial.interp import ProgramRunner
from tests.soundness.adversarial.test_chain import SPECS, _acas

ALPHA = ALPHA_ITERS or 2


def with_preactivations(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """A copy whose every Relu input is also a graph output (the interpreter returns them)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    names = [n.input[0] for n in m.graph.node if n.op_type == "Relu"]
    for nm in names:
        m.graph.output.append(helper.make_tensor_value_info(nm, TensorProto.FLOAT, None))
    return m, names


def random_mlp(seed: int, sizes: tuple[int, ...] = (4, 12, 12, 12, 3),
               centre: np.ndarray | None = None) -> onnx.ModelProto:
    """MatMul + Add + Relu layers, weights N(0, 1) 2^U(-2, 3) (fp32), biases placing each
    neuron's kink at the network's value at ``centre`` (zero pre-activation there)."""
    rng = np.random.default_rng(seed)
    c = np.zeros(sizes[0]) if centre is None else centre
    nodes, inits = [], []
    cur, v = "x", c.astype(np.float64)
    for k, (a, b) in enumerate(zip(sizes, sizes[1:])):
        W = (rng.normal(size=(a, b)) * 2.0 ** rng.uniform(-2, 3, size=(a, b)))
        W = rnd(W / np.sqrt(a), "fp32")
        pre = v @ W
        last = k == len(sizes) - 2
        bias = rnd(-pre + rng.normal(size=b) * 0.01 if not last else rng.normal(size=b), "fp32")
        inits += [numpy_helper.from_array(W.astype(np.float32), f"W{k}"),
                  numpy_helper.from_array(bias.astype(np.float32), f"b{k}")]
        nodes += [helper.make_node("MatMul", [cur, f"W{k}"], [f"m{k}"]),
                  helper.make_node("Add", [f"m{k}", f"b{k}"], [f"a{k}"])]
        cur = f"a{k}"
        v = pre + bias
        if not last:
            nodes.append(helper.make_node("Relu", [cur], [f"r{k}"]))
            cur = f"r{k}"
            v = np.maximum(v, 0)
    nodes.append(helper.make_node("Identity", [cur], ["y"]))
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                         [1, sizes[0]])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, sizes[-1]])],
                          inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


class _Sets:
    """Six arrays (train lo/hi, inf lo/hi, drift lo/hi) of one box, as Ledger.check reads."""

    def __init__(self, a) -> None:
        self.a = tuple(np.asarray(t, np.float64) for t in a)

    def arrays(self):
        return self.a


def _row(t, b: int) -> np.ndarray:
    return (t[b:b + 1].numpy() if isinstance(t, torch.Tensor) else np.asarray(t)[b:b + 1])


class Reference:
    """The float32 network (onnx's reference evaluator) with its pre-activations: what the kink
    search bisects on (not a program: only a locator)."""

    def __init__(self, model: onnx.ModelProto, shape: tuple[int, ...]) -> None:
        from onnx.reference import ReferenceEvaluator

        self.m, self.pre = with_preactivations(model)
        self.sess = ReferenceEvaluator(self.m)
        self.inp = [i.name for i in model.graph.input
                    if i.name not in {t.name for t in model.graph.initializer}][0]
        self.shape = shape

    def pre_acts(self, x: np.ndarray) -> list[np.ndarray]:
        res = self.sess.run(self.pre, {self.inp: x.reshape(self.shape).astype(np.float32)})
        return [np.asarray(r, np.float64).reshape(-1) for r in res]


def kink_points(ref: Reference, lo: np.ndarray, hi: np.ndarray, rng: np.random.Generator,
                per_layer: int) -> list[np.ndarray]:
    """Points of [lo, hi] on a kink of each ReLU layer: a neuron whose pre-activation changes
    sign between two random points of the box, bisected to its zero (float32 input)."""
    out = []
    n_layers = len(ref.pre)
    for layer in range(n_layers):
        found = 0
        for _ in range(40):
            p, q = rng.uniform(lo, hi), rng.uniform(lo, hi)
            a, b = ref.pre_acts(p)[layer], ref.pre_acts(q)[layer]
            cross = np.flatnonzero(np.sign(a) * np.sign(b) < 0)
            if not len(cross):
                continue
            j = int(rng.choice(cross))
            s_p = np.sign(a[j])
            for _ in range(40):
                m = 0.5 * (p + q)
                if np.sign(ref.pre_acts(m)[layer][j]) == s_p:
                    p = m
                else:
                    q = m
            out.append(np.clip(rnd(0.5 * (p + q), "fp32"), lo, hi))
            found += 1
            if found == per_layer:
                break
    return out


def box_points(ref: Reference, lo: np.ndarray, hi: np.ndarray, rng: np.random.Generator,
               n_random: int, per_layer: int, corners: bool = True) -> list[np.ndarray]:
    pts = []
    if corners:
        pts += [np.where(np.array(c, bool), hi, lo)
                for c in itertools.product((0, 1), repeat=len(lo))]
    for _ in range(n_random):  # an edge point, then a random one
        e = np.where(rng.integers(0, 2, size=len(lo)).astype(bool), hi, lo)
        d = int(rng.integers(len(lo)))
        e[d] = rng.uniform(lo[d], hi[d])
        pts += [e, rng.uniform(lo, hi)]
    pts += kink_points(ref, lo, hi, rng, per_layer)
    return [np.clip(rnd(p, "fp32"), lo, hi) for p in pts]


def alpha_attack(cls: str, model: onnx.ModelProto, sp, lo: np.ndarray, hi: np.ndarray,
                 shape: tuple[int, ...], prior=None, seed: int = 0, n_random: int = 3,
                 per_layer: int = 2, n_pairs: int = 4, alpha: int = ALPHA, led=None):
    """Bound the boxes (batch, n) with the alpha chain domain and its drift objective, then
    check every program pair at each box's points (module doc). Returns (violations, Bounds,
    ChainBounds, objective bounds)."""
    from kcverify.regions.chain import ChainBounds, extract_chain
    from kcverify.regions.property import DriftObjective

    g = graph_of(model)
    cb = ChainBounds(extract_chain(g), TRAIN, sp, alpha_iters=alpha)
    with torch.no_grad():
        r = cb.bound(lo, hi, prior=prior)
        obj = DriftObjective(cb, 0.0, hi[0] - lo[0], margin=0.0).bounds(lo, hi, prior=prior)
    n_out = cb.chain.n_out
    mdl, pre_names = with_preactivations(model)
    run = ProgramRunner(mdl)
    ref = Reference(model, shape)
    out_name = model.graph.output[0].name
    relu_steps = [j for j, st in enumerate(cb.chain.steps) if st.kind == "relu"]
    assert len(relu_steps) == len(pre_names)
    rng = np.random.default_rng(seed)
    led = led if led is not None else Ledger()
    found = []
    progs = pairs(TRAIN, sp, n_pairs, seed)
    for b in range(lo.shape[0]):
        out_sets = _Sets(tuple(_row(t, b) for t in (r.lo[0], r.hi[0], r.lo[1], r.hi[1],
                                                     r.dlo, r.dhi)))
        pre_sets = []
        for j in relu_steps:
            tr = r.trace[j]
            pre_sets.append(_Sets(tuple(_row(t, b) for t in (tr["lo"][0], tr["hi"][0],
                                                             tr["lo"][1], tr["hi"][1],
                                                             tr["dlo"], tr["dhi"]))))
        up, dn = obj[b, :n_out].numpy(), obj[b, n_out:].numpy()
        st = led[cls + "/objective"]
        for p in box_points(ref, lo[b], hi[b], rng, n_random, per_layer):
            feeds = {run.inputs[0]: p.reshape(shape).astype(np.float32)}
            for pt, pi in progs:
                with np.errstate(all="ignore"):
                    yt, yi = run(pt, feeds), run(pi, feeds)
                where = f"{cls}: box {b} x={p.tolist()}: {pt} | {pi}"
                t, i = yt[out_name].reshape(1, -1), yi[out_name].reshape(1, -1)
                found += led.check(cls + "/outputs", out_sets, t, i, where)
                for k, (nm, sets) in enumerate(zip(pre_names, pre_sets)):
                    found += led.check(cls + "/preact", sets, yt[nm].reshape(1, -1),
                                       yi[nm].reshape(1, -1), f"{where} [relu {k}]")
                d = (i - t).reshape(-1)
                bad = ~((d <= up) & (-d <= dn))
                st.pairs += 1
                cert = np.maximum(up, dn).max()
                if np.isfinite(cert) and cert > 0:
                    st.worst_drift = max(st.worst_drift, float(np.abs(d).max() / cert))
                if np.any(bad):
                    k = int(np.flatnonzero(bad)[0])
                    msg = (f"{where}: drift {d[k]!r} outside the objective's "
                           f"[-{dn[k]!r}, {up[k]!r}] at output {k}")
                    st.violations.append(msg)
                    found.append(msg)
    return found, r, cb, obj


def _halves(lo: np.ndarray, hi: np.ndarray, d: int) -> tuple[np.ndarray, np.ndarray]:
    mid = lo[:, d] + (hi[:, d] - lo[:, d]) / 2
    clo, chi = np.concatenate([lo, lo]), np.concatenate([hi, hi])
    chi[: len(lo), d] = mid
    clo[len(lo):, d] = mid
    return clo, chi


def boxes_then_halves(cls: str, model, sp, lo, hi, shape, seed: int, **kw) -> list[str]:
    led = Ledger()
    found, r, cb, _ = alpha_attack(cls, model, sp, lo, hi, shape, seed=seed, led=led, **kw)
    prior = r.intermediates(cb.chain.steps)
    d = int(np.argmax(hi[0] - lo[0]))
    clo, chi = _halves(lo, hi, d)
    f2, *_ = alpha_attack(cls + "/halves", model, sp, clo, chi, shape,
                          prior=torch.cat([prior, prior]), seed=seed + 1, led=led, **kw)
    SESSION.merge(led)
    return found + f2


def _mlp_boxes(seed: int, n_in: int, eps: float, n: int = 2):
    rng = np.random.default_rng(seed)
    c = rnd(rng.uniform(-0.5, 0.5, size=n_in), "fp32")
    # boxes around the kink centre and one shifted by eps / 2
    cs = np.stack([c] + [rnd(c + rng.uniform(-eps, eps, size=n_in) / 2, "fp32")
                         for _ in range(n - 1)])
    return c, rnd(cs - eps, "fp32"), rnd(cs + eps, "fp32")


@pytest.mark.parametrize("sp_name", [pytest.param(n, marks=pytest.mark.slow) if n != "fp16"
                                     else n for n in sorted(SPECS)])
def test_alpha_random_mlp_adversarial_weights(sp_name: str) -> None:
    """Random MLPs whose every neuron has its kink at the box centre (all unstable)."""
    c, lo, hi = _mlp_boxes(0, 4, 0.05)
    model = random_mlp(0, centre=c)
    found = boxes_then_halves(f"alpha/mlp/{sp_name}", model, SPECS[sp_name], lo, hi, (1, 4), 0,
                              n_random=1, per_layer=1, n_pairs=2)
    assert not found, "\n".join(found[:3])


@pytest.mark.slow  # ~35 s
def test_alpha_acas_boxes_and_halves() -> None:
    """ACAS Xu 2_7 (stalled parts in docs/regions.md): two boxes of radius 0.02 and halves."""
    model = _acas("2_7")
    rng = np.random.default_rng(27)
    c = rnd(rng.uniform(-0.3, 0.5, size=(2, 5)), "fp32")
    lo, hi = rnd(c - 0.02, "fp32"), rnd(c + 0.02, "fp32")
    found = boxes_then_halves("alpha/acas/fp16", model, SPECS["fp16"], lo, hi, (1, 1, 1, 5), 7,
                              n_random=2, per_layer=1, n_pairs=2)
    assert not found, "\n".join(found[:3])


def test_alpha_slopes_tighten_here() -> None:
    """The attack is on the optimised slopes, not on CROWN's: on these boxes alpha2's
    objective bound differs from (is below) CROWN's somewhere."""
    from kcverify.regions.chain import ChainBounds, extract_chain
    from kcverify.regions.property import DriftObjective

    c, lo, hi = _mlp_boxes(0, 4, 0.05)
    g = graph_of(random_mlp(0, centre=c))
    vals = []
    for a in (0, ALPHA):
        cb = ChainBounds(extract_chain(g), TRAIN, SPECS["fp16"], alpha_iters=a)
        with torch.no_grad():
            vals.append(DriftObjective(cb, 0.0, hi[0] - lo[0], margin=0.0).bounds(lo, hi)
                        .amax(-1).numpy())
    assert np.all(vals[1] <= vals[0] * (1 + 1e-9))
    assert np.any(vals[1] < vals[0] * (1 - 1e-6)), vals


# --- the split-cover certificate ------------------------------------------------------------
def split_cover_attack(cls: str, model, sp, lo: np.ndarray, hi: np.ndarray, shape, eps: float,
                       budget: float, seed: int = 0, max_leaves: int | None = None,
                       n_corners: int = 6) -> tuple[list[str], int]:
    """A split with the alpha method; its tree replayed as the checker does; the proved leaves
    (at most ``max_leaves`` of them, chosen at random; every corner of the first ``n_corners``)
    attacked. Returns (violations, proved leaves attacked)."""
    from kcverify.regions.chain import ChainBounds, chain_method, extract_chain
    from kcverify.regions.plan import tree_bounds
    from kcverify.regions.property import DriftObjective
    from kcverify.regions.split import branch_and_bound, cut_options

    g = graph_of(model)
    cb = ChainBounds(extract_chain(g), TRAIN, sp, alpha_iters=ALPHA)
    obj = DriftObjective(cb, eps, hi - lo)
    with torch.no_grad():
        # the budget in CPU seconds of this process: a wall budget on a loaded machine proved
        # nothing (the leaves then go unattacked and the test fails)
        out = branch_and_bound(lo, hi, obj, budget_s=budget, batch=64, clock=time.process_time,
                               **cut_options(obj, True))
    claims = np.array([lf.value for lf in out.leaves])
    found = []
    st = SESSION[cls + "/replay"]
    for batch in (7, 64):
        again = tree_bounds(g, TRAIN, sp, chain_method(ALPHA), "x", shape, lo, hi, out.tree,
                            batch=batch)
        proved = np.array([lf.proved for lf in out.leaves])
        st.pairs += int(proved.sum())
        bad = proved & ~(again <= claims)
        for k in np.flatnonzero(bad)[:3]:
            found.append(f"{cls}: leaf {k}: replay (batch {batch}) {again[k]!r} above its "
                         f"claim {claims[k]!r} (a false refusal)")
        st.violations += found
        ok = proved & np.isfinite(again) & (claims > 0)
        if np.any(ok):
            st.worst_drift = max(st.worst_drift, float(np.max(again[ok] / claims[ok])))
    mdl = with_preactivations(model)[0]
    run = ProgramRunner(mdl)
    ref = Reference(model, shape)
    rng = np.random.default_rng(seed)
    st = SESSION[cls + "/leaves"]
    progs = pairs(TRAIN, sp, 2, seed)
    n_proved = 0
    idx = [k for k, lf in enumerate(out.leaves) if lf.proved]
    if max_leaves is not None and len(idx) > max_leaves:
        idx = sorted(rng.choice(idx, size=max_leaves, replace=False).tolist())
    for k in idx:
        lf = out.leaves[k]
        n_proved += 1
        for p in box_points(ref, lf.lo, lf.hi, rng, 1, 1, corners=n_proved <= n_corners):
            feeds = {"x": p.reshape(shape).astype(np.float32)}
            for pt, pi in progs:
                with np.errstate(all="ignore"):
                    d = float(np.max(np.abs(run(pi, feeds)["y"] - run(pt, feeds)["y"])))
                st.pairs += 1
                if lf.value > 0:
                    st.worst_drift = max(st.worst_drift, d / lf.value)
                if not d <= lf.value:
                    msg = (f"{cls}: leaf {k} [{lf.lo.tolist()}, {lf.hi.tolist()}] x={p.tolist()}"
                           f": {pt} | {pi}: drift {d!r} above the claim {lf.value!r}")
                    st.violations.append(msg)
                    found.append(msg)
    return found, n_proved


def test_split_cover_replay_and_leaves() -> None:
    """A random adversarial MLP's box split with chain:alpha2 for 4 s: the checker's replay
    (batch 7 and 64) never above a proved leaf's claim, and no program above it."""
    c, lo, hi = _mlp_boxes(3, 4, 0.1, n=1)
    model = random_mlp(3, centre=c)
    found, n = split_cover_attack("alpha/split-cover/mlp", model, SPECS["fp16"], lo[0], hi[0],
                                  (1, 4), eps=0.02, budget=3.0, max_leaves=8, n_corners=2)
    assert n > 0, "the split proved nothing: the leaves were not attacked"
    assert not found, "\n".join(found[:3])


@pytest.mark.campaign
@pytest.mark.parametrize("net", ["1_1", "2_2", "3_3", "4_5"])
def test_alpha_acas_campaign(net: str) -> None:
    model = _acas(net)
    rng = np.random.default_rng(int(net.replace("_", "")))
    c = rnd(rng.uniform(-0.3, 0.5, size=(3, 5)), "fp32")
    found = []
    for eps, sp_name in ((0.01, "fp16"), (0.05, "fp16acc"), (0.03, "e4m3w-fp16")):
        lo, hi = rnd(c - eps, "fp32"), rnd(c + eps, "fp32")
        found += boxes_then_halves(f"alpha/acas-campaign/{sp_name}", model, SPECS[sp_name], lo,
                                   hi, (1, 1, 1, 5), 11, n_random=2, per_layer=1, n_pairs=2)
    assert not found, "\n".join(found[:3])


@pytest.mark.campaign
def test_alpha_mlp_and_split_campaign() -> None:
    found = []
    for seed in range(2, 8):
        c, lo, hi = _mlp_boxes(seed, 4, float(np.random.default_rng(seed).uniform(0.02, 0.2)))
        model = random_mlp(seed, centre=c)
        for sp_name, sp in SPECS.items():
            found += boxes_then_halves(f"alpha/mlp-campaign/{sp_name}", model, sp, lo, hi,
                                       (1, 4), seed, n_random=2, per_layer=2, n_pairs=2)
        f, _ = split_cover_attack("alpha/split-cover/mlp-campaign", model, SPECS["fp16"],
                                  lo[0], hi[0], (1, 4), eps=0.02, budget=6.0, seed=seed,
                                  max_leaves=16, n_corners=4)
        found += f
    print(ratio_text(SESSION["alpha/split-cover/mlp-campaign/leaves"]))
    assert not found, "\n".join(found[:3])
