"""The proof by cases (kcverify/bounds/cases.py, ``bound --cases N``) attacked leaf by leaf: each
conforming inference program's own activation casts (programs.Program.sites, located by node and
side as a case's site names them, the element's flat index in one sample's operand) must satisfy
every decision of exactly one leaf of its input's case tree (the leaves partition the programs),
the pair must lie in that leaf's own sets (train, inference, drift: the leaf re-run under
cases.forcing with its path), and the leaf's bound must be at most the input's certified one
(the max over the leaves).

Inputs: MatMul chains whose first output lands on the second cast's rounding midpoint exactly
(a tie, to even), one fp32 ulp either side, and by the order (test_stable_casts' straddle), a
dynamic per-tensor scale whose amax straddles an fp32 rounding of amax / 448, activations at
e4m3 midpoints +- one fp32 ulp (the quotient exact or in fp32 splits programs), and mlp_tiny
at midpoints.
"""

from __future__ import annotations

import numpy as np
import pytest

from kcverify.bounds import certify_drift
from kcverify.bounds.engine import whole_graph
from tests.soundness.adversarial.arith import next_down, next_up
from tests.soundness.adversarial.attacks import fp8_midpoints, pairs
from tests.soundness.adversarial.harness import SESSION, TRAIN, Ledger, graph_of, spec
from tests.soundness.adversarial.interp import ProgramRunner
from tests.soundness.adversarial.programs import Program
from tests.soundness.adversarial.test_stable_casts import (
    E4M3_PC,
    _acts,
    _chain,
    _chain_rows,
    amax_straddle_inputs,
    cast_programs,
)

cases = pytest.importorskip("kcverify.bounds.cases")


def program_casts(sites: list, kernel: str) -> dict[tuple[str, str, str], np.ndarray]:
    """{(node, side, kernel): the flat cast values} from a one-sample run's Program.sites."""
    out: dict[tuple[str, str, str], np.ndarray] = {}
    node = None
    for tag, val in sites:
        if tag == "node":
            node = val
        else:
            out[(node, tag, kernel)] = np.asarray(val, np.float64).reshape(-1)
    return out


def named(model):
    """A copy of the model whose every node has a name (what the sites name on both sides)."""
    import onnx

    m = onnx.ModelProto()
    m.CopyFrom(model)
    for k, n in enumerate(m.graph.node):
        if not n.name:
            n.name = f"{n.op_type}_n{k}"
    return m


def _matches(path, casts) -> bool:
    for d in path:
        q = casts.get(tuple(d.site))
        if q is None or d.index >= q.size or q[d.index] != d.value:
            return False
    return True


def leaf_attack(cls: str, model, sp, feeds: dict, progs: list, max_leaves: int = 64,
                domain: str = "interval") -> tuple[list[str], int]:
    """Check every (training, inference) program pair against its own leaf (module doc), the
    cases and each leaf bounded with ``domain``. Returns (violations, the most distinct leaves
    the programs of one input fell in)."""
    model = named(model)
    g = graph_of(model)
    res = cases.certify_cases(g, TRAIN, sp, feeds, max_leaves=max_leaves, domain=domain)
    run = ProgramRunner(model)
    out = model.graph.output[0].name
    led = Ledger()
    found: list[str] = []
    batch = next(iter(feeds.values())).shape[0]
    spread = 0
    for b in range(batch):
        one = {k: np.asarray(v)[b:b + 1] for k, v in feeds.items()}
        leaves = res.leaves[b]
        boxes: dict[int, tuple] = {}
        for pt, pi in progs:
            sites: list = []
            with np.errstate(all="ignore"):
                yi = run(pi.with_(sites=sites), one)[out]
                yt = run(pt, one)[out]
            casts = program_casts(sites, sp.name)
            hit = [j for j, path in enumerate(leaves) if _matches(path, casts)]
            where = f"{cls}: input {b}: {pt} / {pi}"
            if len(hit) != 1:
                found.append(f"{where}: the program's casts satisfy {len(hit)} of "
                             f"{len(leaves)} leaves")
                continue
            j = hit[0]
            if j not in boxes:
                with np.errstate(all="ignore"), cases.forcing([leaves[j]]):
                    # the whole graph as one block, as certify_cases and the checker's
                    # bound_leaf run a leaf (another segmentation is another analysis: under
                    # best it came out 4e-5 above the leaf's own figure, session 5)
                    r = certify_drift(g, TRAIN, sp, one, domain=domain, blocks=whole_graph(g))
                boxes[j] = (r.outputs[out], float(np.asarray(r.linf).reshape(-1)[0]))
                if not boxes[j][1] <= float(res.linf[b]):
                    found.append(f"{where}: leaf {j}'s bound {boxes[j][1]!r} above the "
                                 f"certified max {float(res.linf[b])!r}")
            box, linf = boxes[j]
            spread = max(spread, len(boxes))
            found += led.check(cls, box, yt, yi, f"{where} (leaf {j} {leaves[j]})")
            d = float(np.max(np.abs(yi - yt)))
            if not d <= linf:
                found.append(f"{where}: drift {d!r} above leaf {j}'s bound {linf!r}")
    led[cls].violations += [f for f in found if f not in led[cls].violations]
    SESSION.merge(led)
    return found, spread


def _programs(sp) -> list[tuple[Program, Program]]:
    return ([(Program(TRAIN, order=o), p) for o in ("seq", "rev") for p in cast_programs(sp)]
            + pairs(TRAIN, sp, 6, 5))


def _chain_model_for(kind: str):
    """_chain_rows' x and W1 with the first MatMul's h[0, 0] at the second cast's midpoint 272
    exactly (``tie``), or one fp32 ulp of 272 above / below it (``up`` / ``down``: the product
    2^-9 * (+-2^-6) = +-2^-15, e4m3 values under scale 1)."""
    x, w1 = _chain_rows("tie")
    w1 = w1.copy()
    if kind != "tie":
        x[0, 2] = 2.0**-9
        w1[2, 0] = (2.0**-6) * (1 if kind == "up" else -1)  # h = 272 +- 2^-15 (e4m3 values)
    return x.astype(np.float32), w1.astype(np.float32)


@pytest.mark.parametrize("acts", ["dynamic_per_token", "dynamic_per_tensor"])
@pytest.mark.parametrize("kind", ["straddle", "tie", "up", "down"])
def test_leaves_on_the_midpoint_chain(kind: str, acts: str) -> None:
    """The second cast's input at 272 (an e4m3 midpoint of 256 and 288 under scale 1): by the
    order (straddle), exactly (tie), one fp32 ulp above / below."""
    sp = spec(weights=E4M3_PC, activations=_acts(acts), accumulate="fp32", compute="fp32")
    if kind == "straddle":
        x, w1 = _chain_rows("straddle")
    else:
        x, w1 = _chain_model_for(kind)
    model = _chain(w1, sp)
    found, n = leaf_attack(f"cases/leaves/chain-{kind}", model, sp, {"x": x}, _programs(sp))
    assert not found, "\n".join(found[:3])
    if kind == "straddle":
        assert n >= 2, "the programs must fall in different leaves"


def test_leaves_on_the_amax_straddle() -> None:
    """The per-tensor amax straddles an fp32 rounding of amax / 448 (by the order): elements at
    midpoints of either scale's grid cast apart."""
    x, w1, x2 = amax_straddle_inputs()
    sp = spec(weights=E4M3_PC, activations=_acts("dynamic_per_tensor"), accumulate="fp32",
              compute="fp32")
    found, n = leaf_attack("cases/leaves/amax", _chain(w1, sp, extra=x2.shape[1]), sp,
                           {"x": x, "x2": x2}, _programs(sp))
    assert not found, "\n".join(found[:3])
    assert n >= 2


@pytest.mark.parametrize("acts", ["dynamic_per_token", "dynamic_per_tensor"])
def test_leaves_on_mlp_tiny_midpoints(acts: str) -> None:
    """mlp_tiny (three Gemms) with its input at e4m3 midpoints +- one fp32 ulp."""
    from tests.soundness.adversarial.subjects import shipped

    sp = spec(weights=E4M3_PC, activations=_acts(acts), accumulate="fp32", compute="fp32")
    rng = np.random.default_rng(23)
    x = np.stack([fp8_midpoints((4,), "fp8_e4m3", rng, amax=a) for a in (0.7, 2.9, 1.9)])
    x[1, 1] = next_up(x[1, 1], "fp32")
    x[2, 2] = next_down(x[2, 2], "fp32")
    found, _ = leaf_attack("cases/leaves/mlp_tiny", shipped("mlp_tiny"), sp,
                           {"x": x.astype(np.float32)}, _programs(sp))
    assert not found, "\n".join(found[:3])


@pytest.mark.parametrize("name", ["1x1-stride2", "stride-dil-pad"])
def test_cases_on_a_convolution(name: str) -> None:
    """By cases on a Conv (its sites are the unfolded columns: a decision forces one copy of an
    element, a superset of the programs, which cast every copy alike): inputs at e4m3 midpoints
    +- one fp32 ulp, the amax at an element no window reads (1x1 stride 2); every pair's
    max |drift| within the cases' bound, which is at most the plain interval bound."""
    from tests.soundness.adversarial.test_conv import CONV_SPECS, GEOMS, conv_model

    sp = CONV_SPECS["e4m3_pt_fp32"]
    model = named(conv_model(name))
    rng = np.random.default_rng(31)
    xs = GEOMS[name][0]
    x = np.stack([fp8_midpoints(xs[1:], "fp8_e4m3", rng, amax=a) for a in (1.3, 0.45)])
    if name == "1x1-stride2":
        x[:, 0, 1, 1], x[:, 0, 0, 0] = x[:, 0, 0, 0], x[:, 0, 1, 1]  # amax unread
    x = x.astype(np.float32)
    g = graph_of(model)
    res = cases.certify_cases(g, TRAIN, sp, {"x": x}, max_leaves=16)
    with np.errstate(all="ignore"):
        plain = np.asarray(certify_drift(g, TRAIN, sp, {"x": x}, domain="interval").linf)
    assert np.all(res.linf <= plain * (1 + 1e-12) + 1e-300), (res.linf, plain)
    run = ProgramRunner(model)
    st = SESSION[f"cases/conv/{name}"]
    found = []
    for pt, pi in _programs(sp):
        with np.errstate(all="ignore"):
            d = np.abs(run(pi, {"x": x})["y"] - run(pt, {"x": x})["y"]).reshape(2, -1).max(1)
        st.pairs += 2
        for b in np.nonzero(~(d <= res.linf))[0]:
            found.append(f"input {b}: {pt} / {pi}: drift {d[b]!r} > cases bound {res.linf[b]!r}")
        ok = res.linf > 0
        if np.any(ok):
            st.worst_drift = max(st.worst_drift, float(np.max(d[ok] / res.linf[ok])))
    st.violations += found
    assert not found, "\n".join(found[:3])
