"""Session 8: the clause-directed proof by cases (kcverify.bounds.cases, ``certify_cases(
threshold=...)``, f929d06), attacked leaf by leaf.

With a threshold a case whose bound is at most it is a leaf, and one above it is split only on
the straddles its bad outputs' drift forms depend on (``drivers`` / ``_choose``); the others stay
binary symbols. Whatever the heuristic picks, the leaves must partition the conforming programs
and each leaf's bound must hold the programs that fall in it. Checked here, per input:

* ``check_tree`` accepts the leaves (complete, graph order);
* every program's own casts (Program.sites) satisfy the decisions of exactly one leaf - with
  the tie programs enumerated *exhaustively* over the first cast's tied elements (each element
  cast with the exact or the fp32 quotient: 2^k programs, k <= 6), crossed with summation
  orders that move the downstream straddles, so a leaf set missing a branch shows up as a
  program in no leaf;
* the pair lies in its leaf's sets (train, inf, drift) re-run under forcing (whole graph, as
  the checker's bound_leaf runs it), the leaf's bound is at most the certified max, and every
  pair's max |drift| is at most the certified bound;
* thresholds: above the plain bound (no split), just below it, between the full tree's bound
  and the plain one, at the full tree's bound, and tiny (split until the budget: the "lost"
  path, whose open cases stay unsplit leaves).

Nets: test_cases_directed's two ties (one or both reaching the output; EXACT_BINARY on and
off), test_cases' midpoint chain (272 +- one fp32 ulp, the tie), the per-tensor amax at a
straddle (test_stable_casts: the scale itself one fp32 ulp either way), and attention with
inputs tied at e4m3 midpoints +- 1 fp32 ulp (test_s7_fp8.attn_net).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kcverify.bounds import certify_drift
from kcverify.bounds.engine import whole_graph
from tests.soundness.adversarial.harness import SESSION, TRAIN, Ledger, graph_of, spec
from tests.soundness.adversarial.interp import ProgramRunner
from tests.soundness.adversarial.programs import Program
from tests.soundness.adversarial.test_binpoly_attack import FlipProgram
from tests.soundness.adversarial.test_cases import _matches, named, program_casts
from tests.soundness.adversarial.test_stable_casts import (
    E4M3_PC,
    _acts,
    _chain,
    _chain_rows,
    amax_straddle_inputs,
)

cases = pytest.importorskip("kcverify.bounds.cases")
if not hasattr(cases, "drivers"):  # before f929d06
    pytest.skip("no clause-directed cases", allow_module_level=True)


def first_cast_ties(model, sp, feeds: dict) -> np.ndarray:
    """Flat indices of the first activation cast's elements whose exact and fp32 quotients
    round apart (a one-sample run)."""
    run = ProgramRunner(model)
    got = {}
    for q in ("exact", "fp32"):
        sites: list = []
        with np.errstate(all="ignore"):
            run(Program(sp, quotient=q, sites=sites), feeds)
        vals = [v for t, v in sites if t != "node"]
        got[q] = np.asarray(vals[0], np.float64).reshape(-1) if vals else np.zeros(0)
    if got["exact"].size == 0:
        return np.zeros(0, int)
    return np.flatnonzero(got["exact"] != got["fp32"])


def exhaustive_programs(model, sp, feeds: dict, k_max: int = 6, orders=("seq", "rev", "desc"),
                        later: str = "exact") -> list[tuple[Program, Program]]:
    """Every assignment of the first cast's ties (up to k_max of them; exact / fp32 quotient per
    element), later casts by ``later`` ("exact" / "fp32"), under each order; training programs
    in the same orders."""
    ties = first_cast_ties(model, sp, feeds)[:k_max]
    out = []
    for order in orders:
        pt = Program(TRAIN, order=order, row_order=order, label=f"train/{order}")
        for bits in itertools.product((False, True), repeat=len(ties)):
            def flips(n, shape, bits=bits):
                if n == 0:
                    m = np.zeros(int(np.prod(shape)), bool)
                    m[ties] = bits
                    return m.reshape(shape)
                return np.full(shape, later == "fp32")
            lab = "".join("1" if b else "0" for b in bits)
            out.append((pt, FlipProgram(sp, order=order, row_order=order, flips=flips, calls=[],
                                        label=f"ties {lab}/{order}/later-{later}")))
    return out


def run_flip(run: ProgramRunner, p, feeds: dict, sites: list | None = None):
    q = p.with_(calls=[]) if isinstance(p, FlipProgram) else p
    if sites is not None:
        q = q.with_(sites=sites)
    with np.errstate(all="ignore"):
        return run(q, feeds)


def mixed_trees(sp, n: int = 8) -> list[tuple[Program, Program]]:
    """Programs whose every dot-product element takes its own extreme summation tree (the
    largest or the least result, at random per element: test_s8_accum.ExtremeProgram), so
    that straddles made by the order go different ways in one program."""
    from tests.soundness.adversarial.test_s8_accum import ExtremeProgram

    return [(ExtremeProgram(TRAIN, pick="rand", seed=100 + k),
             ExtremeProgram(sp, pick="rand", seed=k, quotient=("exact", "fp32")[k % 2],
                            label=f"inf/trees-rand{k}")) for k in range(n)]


def directed_attack(cls: str, model, sp, feeds: dict, progs: list, threshold: float | None,
                    max_leaves: int = 16, domain: str = "best") -> tuple[list[str], dict]:
    """The module doc's checks for one batch-1 input. Returns (violations, figures)."""
    model = named(model)
    g = graph_of(model)
    res = cases.certify_cases(g, TRAIN, sp, feeds, max_leaves=max_leaves, domain=domain,
                              threshold=threshold)
    leaves = res.leaves[0]
    found: list[str] = []
    try:
        cases.check_tree(leaves, cases.site_order(g))
    except cases.CaseError as e:
        found.append(f"{cls}: check_tree refuses the tree certify_cases made: {e}")
    run = ProgramRunner(model)
    out = model.graph.output[0].name
    led = Ledger()
    boxes: dict[int, tuple] = {}
    hits: set[int] = set()
    worst = 0.0
    cert = float(res.linf[0])
    for pt, pi in progs:
        sites: list = []
        yi = run_flip(run, pi, feeds, sites)[out]
        yt = run_flip(run, pt, feeds)[out]
        casts = program_casts(sites, sp.name)
        hit = [j for j, path in enumerate(leaves) if _matches(path, casts)]
        where = f"{cls}: {pt} / {pi}"
        if len(hit) != 1:
            found.append(f"{where}: the program's casts satisfy {len(hit)} of {len(leaves)} "
                         f"leaves")
            continue
        j = hit[0]
        hits.add(j)
        if j not in boxes:
            with np.errstate(all="ignore"), cases.forcing([leaves[j]]):
                r = certify_drift(g, TRAIN, sp, feeds, domain=domain, blocks=whole_graph(g))
            boxes[j] = (r.outputs[out], float(np.asarray(r.linf).reshape(-1)[0]))
            if not boxes[j][1] <= cert:
                found.append(f"{where}: leaf {j}'s bound {boxes[j][1]!r} above the certified "
                             f"{cert!r}")
        box, lb = boxes[j]
        found += led.check(cls, box, yt, yi, f"{where} (leaf {j})")
        d = float(np.max(np.abs(np.asarray(yi, np.float64) - yt)))
        if not d <= cert:
            found.append(f"{where}: drift {d!r} above the certified {cert!r}")
        if cert > 0:
            worst = max(worst, d / cert)
    led[cls].worst_drift = max(led[cls].worst_drift, worst)
    led[cls].violations += [f for f in found if f not in led[cls].violations]
    SESSION.merge(led)
    return found, {"leaves": len(leaves), "hit": len(hits), "bound": cert, "worst": worst,
                   "runs": res.runs}


def thresholds(g, sp, feeds: dict, max_leaves: int = 16, domain: str = "best") -> dict:
    plain = float(certify_drift(g, TRAIN, sp, feeds, domain=domain).linf[0])
    full = float(cases.certify_cases(g, TRAIN, sp, feeds, max_leaves=max_leaves,
                                     domain=domain).linf[0])
    return {"above-plain": 2 * plain, "just-below-plain": plain * (1 - 1e-9),
            "between": 0.5 * (plain + full), "at-full": full, "tiny": 1e-12}


# --- nets -----------------------------------------------------------------------------------
INF_T = spec(activations=_acts("dynamic_per_tensor"), accumulate="fp32", compute="fp32")
SP_PC = spec(weights=E4M3_PC, activations=_acts("dynamic_per_tensor"), accumulate="fp32",
             compute="fp32")


def net(name: str):
    """(model, spec, feeds, program pairs)."""
    from tests.bounds.test_cases import X
    from tests.bounds.test_cases_directed import _two_ties

    if name.startswith("two-ties"):
        read = (0.0, 1.0, 0.0, 0.5) if name.endswith("both") else (0.0, 1.0, 0.0, 0.0)
        model = _two_ties(read)
        feeds = {"x": X}
        sp = INF_T
        prs = [(Program(TRAIN, order=o), Program(sp, order=o, quotient=q))
               for o in ("seq", "rev", "asc", "desc", "greedy_up", "greedy_down")
               for q in ("exact", "fp32")]
        return model, sp, feeds, prs
    if name.startswith("chain"):
        kind = name.split("-", 1)[1]
        from tests.soundness.adversarial.test_cases import _chain_model_for

        x, w1 = (_chain_rows("straddle") if kind == "straddle" else _chain_model_for(kind))
        model = _chain(w1, SP_PC)
        feeds = {"x": np.asarray(x, np.float32)[:1]}
        prs = [(Program(TRAIN, order=o), Program(SP_PC, order=o, quotient=q))
               for o in ("seq", "rev", "asc", "desc", "greedy_up", "greedy_down")
               for q in ("exact", "fp32")]
        return model, SP_PC, feeds, prs
    if name == "amax-straddle":
        x, w1, x2 = amax_straddle_inputs()
        model = _chain(w1, SP_PC, extra=x2.shape[1])
        feeds = {"x": x[:1].astype(np.float32), "x2": x2[:1].astype(np.float32)}
        prs = [(Program(TRAIN, order=o), Program(SP_PC, order=o, quotient=q))
               for o in ("seq", "rev", "asc", "desc", "greedy_up", "greedy_down")
               for q in ("exact", "fp32", "mixed")]
        return model, SP_PC, feeds, prs
    if name.startswith("attn"):
        from tests.soundness.adversarial.test_binpoly_attack import SP
        from tests.soundness.adversarial.test_s7_fp8 import attn_net

        seed = int(name.split("-")[1])
        rng = np.random.default_rng([seed, 17])
        model, feeds = attn_net(rng, T=3, K=4, D=3, sharp=4.0)
        # one output: y (the first output is what the cases bound)
        model.graph.output.pop(0)
        return model, SP, feeds, []
    raise ValueError(name)


NETS = ("two-ties-one", "two-ties-both", "chain-straddle", "chain-up", "chain-tie",
        "amax-straddle", "attn-1")
THRESH = ("above-plain", "just-below-plain", "between", "at-full", "tiny")


def case_run(name: str, th: str, linearised: bool, max_leaves: int = 16
             ) -> tuple[list[str], dict]:
    import kcverify.bounds.zonotope as Z

    model, sp, feeds, prs = net(name)
    prs = prs + exhaustive_programs(model, sp, feeds) + mixed_trees(sp)
    old = Z.EXACT_BINARY
    Z.EXACT_BINARY = not linearised
    try:
        g = graph_of(named(model))
        t = thresholds(g, sp, feeds, max_leaves)[th]
        return directed_attack(f"s8/cases/{name}/{th}/{'lin' if linearised else 'exact'}",
                               model, sp, feeds, prs, t, max_leaves)
    finally:
        Z.EXACT_BINARY = old


@pytest.mark.parametrize(("name", "th", "lin"), [("two-ties-both", "between", True),
                                                 ("chain-straddle", "tiny", False)])
def test_directed_cases_fast(name: str, th: str, lin: bool) -> None:
    found, fig = case_run(name, th, lin)
    assert not found, "\n".join(found[:3])


def test_exhaustive_programs_reach_every_leaf() -> None:
    """Not vacuous: on the two ties (linearised, threshold between) the programs fall in every
    leaf of the directed tree."""
    found, fig = case_run("two-ties-both", "tiny", True)
    assert not found, "\n".join(found[:3])
    assert fig["leaves"] >= 2 and fig["hit"] == fig["leaves"], fig


@pytest.mark.campaign
@pytest.mark.parametrize("lin", [False, True])
@pytest.mark.parametrize("th", THRESH)
@pytest.mark.parametrize("name", NETS)
def test_directed_cases_campaign(name: str, th: str, lin: bool) -> None:
    found, fig = case_run(name, th, lin, max_leaves=32)
    print(f"s8/cases/{name}/{th}/{'lin' if lin else 'exact'}: {fig}")
    assert not found, "\n".join(found[:3])
