"""Clause-directed proof by cases (kcverify.bounds.cases, ``certify_cases(threshold=...)``).

A case is split only while its bound exceeds the clause's threshold, and only on the straddles
the bad output elements' drift forms depend on (the zonotope's base binary symbols, ``drivers``);
the other straddles stay binary symbols. The tree must still cover every conforming program:
``check_tree`` accepts it (complete, graph order), a dropped leaf is refused, each leaf holds
the programs that round its way, and the ``_choose`` rule never splits at a site earlier than a
path's last decision (a decision there would be checked under a forcing its programs need not
satisfy)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

import kcverify.bounds.zonotope as Z
from kcverify.bounds import cases, certify_drift
from kcverify.bounds.cases import (
    CaseError,
    Decision,
    _choose,
    certify_cases,
    check_tree,
    site_order,
)
from kcverify.bounds.engine import whole_graph
from tests.bounds.test_cases import INF, TRAIN, X
from tests.soundness.adversarial.harness import chain_model, graph_of
from tests.soundness.adversarial.interp import ProgramRunner
from tests.soundness.adversarial.programs import Program

A = 5 * 2.0**-22


def _two_ties(read: tuple[float, ...] = (0.0, 1.0, 0.0, 0.0)):
    """test_cases' tie twice: y = x @ W1 with y1 = y3 = 21 + {0, 2^-19} by the summation order
    (the e4m3 midpoint of 20 and 22: both straddle), y0 = 448 (the amax: scale 1), y2 = 3.5.
    z = y @ read; out = (z z - z z) + z / 1024: z z - z z is 0 in every program, which a domain
    holding z over a straddle as one set loses (functions of binary symbols linearised below:
    the loss goes to the noise), and z / 1024 keeps the straddles' rows in out's form (their
    drift, 2^-10 per unit, is far below the threshold); ``read`` picks which ties reach out."""
    w1 = np.array([[256, 12, 2, 12], [0, A, 0, A], [0, A, 0, A], [0, -2 * A, 0, -2 * A]],
                  np.float32)
    w2 = np.array(read, np.float32).reshape(4, 1)
    k = np.array(2.0**-10, np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["y"]),
             helper.make_node("MatMul", ["y", "w2"], ["z"]),
             helper.make_node("Mul", ["z", "z"], ["p"]),
             helper.make_node("Mul", ["z", "z"], ["q"]),
             helper.make_node("Sub", ["p", "q"], ["d"]),
             helper.make_node("Mul", ["z", "k"], ["s"]),
             helper.make_node("Add", ["d", "s"], ["out"])]
    return chain_model(nodes, [("x", (1, 4)), ("w1", w1), ("w2", w2), ("k", k)], ["out"],
                       opset=17)


@pytest.fixture
def linearised(monkeypatch):  # type: ignore[no-untyped-def]
    # binpoly would keep z z - z z exact over the flip (b^2 = 1) and need no case
    monkeypatch.setattr(Z, "EXACT_BINARY", False)


def _programs(model, x=X) -> list[float]:  # type: ignore[no-untyped-def]
    """The drift of conforming pairs: every order, the quotient exact or in fp32."""
    run = ProgramRunner(model)
    out = []
    for order in ("seq", "rev", "asc", "desc", "greedy_up", "greedy_down"):
        for quotient in ("exact", "fp32"):
            zt = run(Program(TRAIN, order=order), {"x": x})["out"]
            zi = run(Program(INF, order=order, quotient=quotient), {"x": x})["out"]
            out.append(float(np.abs(zi.astype(np.float64) - zt).max()))
    return out


def test_only_the_tie_that_reaches_the_output_is_split(linearised) -> None:  # type: ignore[no-untyped-def]
    model = _two_ties()
    g = graph_of(model)
    plain = float(certify_drift(g, TRAIN, INF, {"x": X}, domain="best").linf[0])
    assert plain > 0.5, plain
    # the first-site rule splits both straddles of y (4 leaves)
    full = certify_cases(g, TRAIN, INF, {"x": X}, max_leaves=16, domain="best")
    assert len(full.leaves[0]) == 4
    # clause-directed: y3 reaches no output, so only y1 is split (2 leaves), and the bound holds
    res = certify_cases(g, TRAIN, INF, {"x": X}, max_leaves=16, domain="best", threshold=0.5)
    assert len(res.leaves[0]) == 2, res.leaves
    assert {p[0].index for p in res.leaves[0]} == {1}
    assert res.linf[0] <= 0.5
    check_tree(res.leaves[0], site_order(g))
    for d in _programs(model):
        assert d <= res.linf[0]


def test_a_case_under_the_threshold_is_not_split(linearised) -> None:  # type: ignore[no-untyped-def]
    g = graph_of(_two_ties())
    plain = float(certify_drift(g, TRAIN, INF, {"x": X}, domain="best").linf[0])
    res = certify_cases(g, TRAIN, INF, {"x": X}, max_leaves=16, domain="best",
                        threshold=2 * plain)
    assert res.leaves[0] == [[]] and res.runs == 1 and res.linf[0] == plain


# x as test_cases has it (y1 = y3 = 21 exactly, a tie), and x1 one fp32 ulp above / below 1:
# y1 = 21 +- 5 2^-45 in exact arithmetic, the midpoint moved by far less than an fp32 ulp of the
# sums: the orders still round it both ways (measured: seq / desc to 22, rev / asc to 20)
X_ULP = [X, np.array([[1.75, np.nextafter(np.float32(1), np.float32(2)), 1.0, 1.0]], np.float32),
         np.array([[1.75, np.nextafter(np.float32(1), np.float32(0)), 1.0, 1.0]], np.float32)]


@pytest.mark.parametrize("k", range(len(X_ULP)))
def test_both_ties_split_when_both_reach_the_output(linearised, k: int) -> None:  # type: ignore[no-untyped-def]
    x = X_ULP[k]
    model = _two_ties((0.0, 1.0, 0.0, 0.5))
    g = graph_of(model)
    res = certify_cases(g, TRAIN, INF, {"x": x}, max_leaves=16, domain="best", threshold=0.5)
    assert len(res.leaves[0]) == 4 and res.linf[0] <= 0.5
    check_tree(res.leaves[0], site_order(g))
    for d in _programs(model, x):
        assert d <= res.linf[0]
    # each leaf's bound holds the programs that cast y1 and y3 its way (a leaf that forced the
    # other value would miss them): run every leaf against programs of both orders
    run = ProgramRunner(model)
    hit, apart = set(), 0
    for leaf in res.leaves[0]:
        with cases.forcing([leaf]):
            one = certify_drift(g, TRAIN, INF, {"x": x}, domain="best", blocks=whole_graph(g))
        box = one.outputs["out"]
        for order in ("seq", "rev", "asc", "desc"):
            for quotient in ("exact", "fp32"):
                p = Program(INF, order=order, quotient=quotient, trace=[])
                zi = run(p, {"x": x})["out"].astype(np.float64)
                # the casts traced: x's at the first MatMul, then y's at the second (w1, w2
                # are weights: not traced)
                got = np.asarray(p.trace[1][1]).reshape(-1)
                if any(float(got[d.index]) != d.value for d in leaf):
                    # a program of another case: the leaf with y1 the other way misses it (a
                    # partition with the values swapped would fail the check below)
                    if float(got[1]) != leaf[0].value and leaf[0].index == 1:
                        apart += int(not (np.all(box.inf_lo <= zi) and np.all(zi <= box.inf_hi)))
                    continue
                hit.add(tuple(d.value for d in leaf))
                assert np.all(box.inf_lo <= zi) and np.all(zi <= box.inf_hi), (leaf, zi)
    assert hit, "no program fell in any leaf: the trace did not give the casts"
    assert apart > 0, "the leaves' boxes do not tell y1's cases apart: the check cannot fail"


def _with_y(model):  # type: ignore[no-untyped-def]
    m = type(model)()
    m.CopyFrom(model)
    m.graph.output.append(helper.make_tensor_value_info("y", 1, None))
    return m


def test_a_directed_tree_missing_a_branch_is_refused(linearised) -> None:  # type: ignore[no-untyped-def]
    g = graph_of(_two_ties((0.0, 1.0, 0.0, 0.5)))
    res = certify_cases(g, TRAIN, INF, {"x": X}, max_leaves=16, domain="best", threshold=0.5)
    paths = res.leaves[0]
    for k in range(len(paths)):
        with pytest.raises(CaseError):
            check_tree(paths[:k] + paths[k + 1:], site_order(g))
    # a leaf that forces a value the analysis does not admit there is refused on its re-run
    d = paths[0][0]
    bad = [Decision(d.site, d.index, d.value, d.value + 64.0)] + paths[0][1:]
    with pytest.raises(CaseError, match="covers"):
        with cases.forcing([bad]):
            certify_drift(g, TRAIN, INF, {"x": X}, domain="best", blocks=whole_graph(g))


def test_choose_keeps_graph_order_and_prefers_the_heaviest() -> None:
    order = {"a": 0, "b": 1, "c": 2}
    sa, sb, sc = ("a", "left", "inf"), ("b", "left", "inf"), ("c", "left", "inf")
    seen = {sa: [(0, 1.0, 1.125), (5, 2.0, 2.25)], sb: [(1, 4.0, 4.5), (2, 8.0, 9.0)],
            sc: [(3, 16.0, 18.0)]}
    w = {(sa, 5): 2.0, (sb, 2): 3.0, (sb, 1): 1.0, (sc, 3): 9.0}
    # the earliest weighted site, its heaviest elements first
    assert _choose([], seen, w, order, 1) == (sa, [(5, 2.0, 2.25)])
    # a path decided at b: site a is closed, b's heaviest first
    path = [Decision(sb, 7, 1.0, 1.125)]
    assert _choose(path, seen, w, order, 2) == (sb, [(2, 8.0, 9.0), (1, 4.0, 4.5)])
    # weights only before the last decision: nothing to split (no fallback onto unweighted ones)
    assert _choose([Decision(sc, 9, 1.0, 1.125)], {sa: seen[sa], sc: []}, w, order, 3) is None
    # no weights at all (the interval domain): the first open site, as without a threshold
    assert _choose(path, seen, {}, order, 3) == (sb, seen[sb])
    # a driver far lighter than the heaviest (under DRIVER_SHARE of it) does not hold the
    # split at its earlier site: site a's 0.1 against c's 9.0 leaves a open for b's 1.0 / 3.0
    assert _choose([], seen, {(sa, 5): 0.1, (sb, 1): 1.0, (sc, 3): 9.0}, order, 2) == (
        sb, [(1, 4.0, 4.5)])


def test_a_directed_tree_is_certified_and_rechecked(tmp_path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """prove --cases directs the split by the clause's threshold: the certificate's case-split
    leaf holds the 2-leaf tree over y1 alone (y3 reaches no output), the checker re-runs it,
    and the tree with a leaf dropped, or with y3 split instead, is refused."""
    import json

    import onnx

    from kcverify.certs.encoding import fx
    from kcverify.cli import main
    from tests.planner.test_prove_cases import CONTRACT, _leaf

    monkeypatch.setattr(Z, "EXACT_BINARY", False)
    onnx.save(_two_ties(), tmp_path / "tie.onnx")
    np.savez(tmp_path / "x.npz", x=X)
    contract, model = tmp_path / "tie.yaml", tmp_path / "tie.onnx"
    contract.write_text(CONTRACT.format(tau="0.5"))
    cert, report = tmp_path / "tie.kcert.json", tmp_path / "r.json"
    args = [str(contract), str(model), "--cert", str(cert), "--report", str(report), "--quiet",
            "--domain", "best", "--cases", "8"]
    assert main(["prove", *args]) == 0
    assert json.loads(report.read_text())["clauses"][0]["verdict"] == "proved"
    stmt = json.loads(cert.read_text())
    leaves = _leaf(stmt)["params"]["leaves"][0]
    assert len(leaves) == 2 and {p[0][1] for p in leaves} == {1}, leaves
    assert main(["check", str(cert), str(model), str(contract)]) == 0
    original = json.dumps(stmt)

    def forged(edit) -> str:  # type: ignore[no-untyped-def]
        st = json.loads(original)
        edit(_leaf(st)["params"])
        cert.write_text(json.dumps(st))
        capsys.readouterr()
        assert main(["check", str(cert), str(model), str(contract)]) == 1
        return capsys.readouterr().out

    def drop(p):  # type: ignore[no-untyped-def]
        p["leaves"][0].pop()
        p["claims"][0].pop()
    assert "lacks the branch" in forged(drop)

    def other_tie(p):  # type: ignore[no-untyped-def]
        # split y3 instead: a complete tree, but its leaves leave y1 free and re-bound above
        # the claims (the claims were y1's cases)
        for path in p["leaves"][0]:
            path[0][1] = 3
    assert "above its claim" in forged(other_tie)

    def half_claims(p):  # type: ignore[no-untyped-def]
        p["claims"][0] = [fx(float.fromhex(v) * 0.5) for v in p["claims"][0]]
    assert "above its claim" in forged(half_claims)


def test_bound_cli_threshold_directs_the_cases(tmp_path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`kcverify bound --cases N --threshold T` runs the clause-directed tree (progress a line
    per case on stderr) and bounds the input at most T here; the same tree without a threshold
    splits both ties (the first-site rule); --threshold without --cases is one error line."""
    import json

    import onnx

    from kcverify.cli import main
    from tests.planner.test_prove_cases import CONTRACT

    monkeypatch.setattr(Z, "EXACT_BINARY", False)
    onnx.save(_two_ties(), tmp_path / "tie.onnx")
    np.savez(tmp_path / "x.npz", x=X)
    contract, model = tmp_path / "tie.yaml", tmp_path / "tie.onnx"
    contract.write_text(CONTRACT.format(tau="0.5"))
    base = ["bound", str(model), str(contract), "--inputs", str(tmp_path / "x.npz"),
            "--domain", "best", "--json", "--cases", "8"]
    assert main([*base, "--threshold", "0.5"]) == 0
    out = capsys.readouterr()
    res = json.loads(out.out)
    assert res["bounds"][0]["linf"] <= 0.5 and "threshold=0.5" in res["blocks"][0]["method"]
    directed = out.err.count("bounded (")
    assert directed >= 2, out.err
    assert main(base) == 0
    full = capsys.readouterr().err.count("bounded (")
    assert full > directed, (full, directed)
    assert main([*base[:-2], "--threshold", "0.5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--cases" in err[0], err
