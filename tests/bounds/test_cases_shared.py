"""Prefix sharing and per-element case trees (kcverify.bounds.cases).

Prefix sharing (``PrefixCache``, engine.RUN_HOOK): a case resumed from the engine state another
case's run left before the first node its own decisions touch must give the unshared run's
values bit for bit. Per-element trees (``certify_cases(per_element=True)``): each output element
is covered by its own complete case tree (``check_cover``); on a model whose two output
positions each depend on one tie, the trees are a sum (each position splits its own tie), not a
product, and the checker (rule case-split with ``masks``) re-runs them and refuses a tree with
an element left uncovered."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

import kcverify.bounds.zonotope as Z
from kcverify.bounds import certify_drift
from kcverify.bounds.cases import (
    CaseError,
    Decision,
    PrefixCache,
    certify_cases,
    check_cover,
    decode_mask,
    decode_masks,
    encode_mask,
    forcing,
    node_drifts,
    output_elements,
    site_order,
)
from kcverify.bounds.engine import RUN_HOOK, whole_graph
from tests.bounds.test_cases import INF, TRAIN, X
from tests.bounds.test_cases_directed import _programs, _two_ties
from tests.soundness.adversarial.harness import chain_model, graph_of

A = 5 * 2.0**-22


def _two_positions(w2=((0, 0), (1, 0), (0, 0), (0, 1))):  # type: ignore[no-untyped-def]
    """test_cases_directed's two ties y1 and y3, read by two output positions: out[0, p, 0]
    holds z_p = (y @ w2)_p through (z z - z z) + z / 1024 (the linearised product loses what
    the case split recovers); by default position p reads tie y_(2p+1) alone."""
    w1 = np.array([[256, 12, 2, 12], [0, A, 0, A], [0, A, 0, A], [0, -2 * A, 0, -2 * A]],
                  np.float32)
    w2 = np.array(w2, np.float32)
    k = np.array(2.0**-10, np.float32)
    shape = np.array([1, 2, 1], np.int64)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["y"]),
             helper.make_node("MatMul", ["y", "w2"], ["z"]),
             helper.make_node("Mul", ["z", "z"], ["p"]),
             helper.make_node("Mul", ["z", "z"], ["q"]),
             helper.make_node("Sub", ["p", "q"], ["d"]),
             helper.make_node("Mul", ["z", "k"], ["s"]),
             helper.make_node("Add", ["d", "s"], ["o"]),
             helper.make_node("Reshape", ["o", "shape"], ["out"])]
    return chain_model(nodes, [("x", (1, 4)), ("w1", w1), ("w2", w2), ("k", k),
                               ("shape", shape)], ["out"], opset=17)


@pytest.fixture
def linearised(monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setattr(Z, "EXACT_BINARY", False)


def _run(g, path, cache=None):  # type: ignore[no-untyped-def]
    tok = RUN_HOOK.set(cache) if cache is not None else None
    try:
        with forcing([path]):
            res = certify_drift(g, TRAIN, INF, {"x": X}, domain="best", blocks=whole_graph(g))
    finally:
        if tok is not None:
            RUN_HOOK.reset(tok)
    return res


def _same(a, b) -> bool:  # type: ignore[no-untyped-def]
    return all(np.array_equal(getattr(a.outputs[k], f), getattr(b.outputs[k], f), equal_nan=True)
               for k in a.outputs for f in ("drift_lo", "drift_hi")) and \
        np.array_equal(a.unstable_casts, b.unstable_casts)


def test_a_resumed_case_is_the_unshared_run_bit_for_bit(linearised) -> None:  # type: ignore[no-untyped-def]
    g = graph_of(_two_ties((0.0, 1.0, 0.0, 1.0)))
    cache = PrefixCache()
    cache.nodes = {n.name for n in g.nodes if n.op_type == "MatMul"}
    root = _run(g, [], cache)
    assert _same(root, _run(g, []))
    assert cache.taken >= 2  # before each MatMul, nothing decided upstream
    site = ([n.name for n in g.nodes if n.op_type == "MatMul"][1], "left", "inf")  # y's cast
    paths = [[Decision(site, 1, 20.0, 22.0)],
             [Decision(site, 1, 22.0, 20.0), Decision(site, 3, 20.0, 22.0)]]
    for path in paths:
        shared = _run(g, path, cache)
        assert cache.resumed_at > 0  # it did resume (the test would prove nothing otherwise)
        assert _same(shared, _run(g, path))
    # a second resume from the same snapshot: the first did not write into it
    again = _run(g, paths[0], cache)
    assert cache.resumed_at > 0 and _same(again, _run(g, paths[0]))


def test_prune_keeps_only_what_an_open_case_can_resume_from(linearised) -> None:  # type: ignore[no-untyped-def]
    g = graph_of(_two_ties((0.0, 1.0, 0.0, 1.0)))
    cache = PrefixCache()
    second = [n.name for n in g.nodes if n.op_type == "Mul"][0]  # downstream of the site
    cache.nodes = {second}
    site = ([n.name for n in g.nodes if n.op_type == "MatMul"][1], "left", "inf")
    a = [Decision(site, 1, 20.0, 22.0)]
    b = [Decision(site, 1, 22.0, 20.0)]
    _run(g, a, cache)
    _run(g, b, cache)
    assert len(cache.snaps) == 2 and cache.bytes() > 0
    cache.prune([a])  # b's snapshot: no open case has b's decisions upstream of the Mul
    assert len(cache.snaps) == 1
    assert _same(_run(g, a, cache), _run(g, a)) and cache.resumed_at > 0
    # a case below a with a further decision upstream of the Mul cannot resume there
    cache.prune([a + [Decision(site, 3, 20.0, 22.0)]])
    assert not cache.snaps
    tiny = PrefixCache(max_bytes=1)  # the memory bound: nothing kept, runs still start at 0
    tiny.nodes = {second}
    assert _same(_run(g, a, tiny), _run(g, a)) and not tiny.snaps


def test_shared_search_equals_unshared(linearised) -> None:  # type: ignore[no-untyped-def]
    g = graph_of(_two_positions())
    runs = {}
    for share in (False, True):
        runs[share] = certify_cases(g, TRAIN, INF, {"x": X}, max_leaves=16, domain="best",
                                    threshold=0.5, per_element=True, share=share)
    a, b = runs[False], runs[True]
    assert a.leaves == b.leaves and a.masks == b.masks
    assert [[v.hex() for v in c] for c in a.leaf_linf] == [[v.hex() for v in c] for c in b.leaf_linf]
    assert b.resumed > 0


def test_per_element_trees_are_a_sum(linearised) -> None:  # type: ignore[no-untyped-def]
    model = _two_positions()
    g = graph_of(model)
    plain = float(certify_drift(g, TRAIN, INF, {"x": X}, domain="best").linf[0])
    assert plain > 0.5, plain
    joint = certify_cases(g, TRAIN, INF, {"x": X}, max_leaves=16, domain="best", threshold=0.5,
                          per_split=1)
    res = certify_cases(g, TRAIN, INF, {"x": X}, max_leaves=16, domain="best", threshold=0.5,
                        per_split=1, per_element=True)
    assert len(joint.leaves[0]) == 4 and joint.runs == 7
    assert res.runs == 5 and len(res.leaves[0]) == 4  # root + each position's two cases
    assert res.linf[0] <= 0.5
    assert {len(p) for p in res.leaves[0]} == {1}
    assert {p[0].index for p in res.leaves[0]} == {1, 3}
    for d in _programs(model):
        assert d <= res.linf[0]
    order = site_order(g)
    sizes = {"out": 2}
    nodes = [(p, decode_masks(m, sizes)) for p, m in zip(res.leaves[0], res.masks[0])]
    check_cover(nodes, sizes, order)
    with pytest.raises(CaseError, match="credited to no case|lacks the branch"):
        check_cover(nodes[1:], sizes, order)
    # position 0's cases credited with position 1 as well: a leaf beside a split
    bad = [(p, {"out": np.ones(2, bool)}) for p, _ in nodes]
    with pytest.raises(CaseError):
        check_cover(bad, sizes, order)


def test_groups_that_need_the_same_ties_share_one_tree(linearised, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Both positions read both ties (y1 + y3 / 2 and y1 / 2 + y3): each group alone would split
    its heavier tie first, two trees of 4 leaves (13 runs); joint first (JOINT_FIRST), both
    follow the whole goal's split and share one tree (4 leaves, 7 runs, the joint tree's)."""
    from kcverify.bounds import cases

    g = graph_of(_two_positions(((0, 0), (1, 0.5), (0, 0), (0.5, 1))))
    kw = dict(max_leaves=32, domain="best", threshold=0.5, per_split=1)
    joint = certify_cases(g, TRAIN, INF, {"x": X}, **kw)
    res = certify_cases(g, TRAIN, INF, {"x": X}, per_element=True, **kw)
    assert res.runs == joint.runs == 7 and len(joint.leaves[0]) == 4
    assert res.linf[0] <= 0.5 and joint.linf[0] <= 0.5
    # one tree: every per-element leaf is a joint leaf or a prefix of one (a group proved
    # higher up stops there: with session 9's sharper zonotope one position is proved after
    # one split, 0.2545, so its leaves are that split's two children)
    key = [[(d.site, d.index, d.value) for d in p] for p in joint.leaves[0]]
    for p in res.leaves[0]:
        q = [(d.site, d.index, d.value) for d in p]
        assert any(k[:len(q)] == q for k in key), q
    monkeypatch.setattr(cases, "JOINT_FIRST", False)
    own = certify_cases(g, TRAIN, INF, {"x": X}, per_element=True, **kw)
    # each group alone: measured 13 runs / 8 leaves before session 9's second-order zonotope
    # rules, 5 / 4 after them (its groups now prove after fewer splits); it must still prove
    assert own.linf[0] <= 0.5 and own.runs <= 13
    for d in _programs(_two_positions(((0, 0), (1, 0.5), (0, 0), (0.5, 1)))):
        assert d <= min(res.linf[0], own.linf[0])


def test_masks_round_trip_and_refuse_padding() -> None:
    m = np.array([1, 0, 1, 1, 0, 0, 0, 0, 1], bool)
    assert np.array_equal(decode_mask(encode_mask(m), 9), m)
    with pytest.raises(CaseError):
        decode_mask(encode_mask(m), 8)
    with pytest.raises(CaseError):
        decode_mask("ffff", 9)  # bits beyond the 9 elements
    with pytest.raises(CaseError):
        decode_mask("zz00", 9)
    with pytest.raises(CaseError):
        decode_masks({"nope": "00"}, {"out": 2})


def test_node_drifts_reads_every_output_element(linearised) -> None:  # type: ignore[no-untyped-def]
    g = graph_of(_two_positions())
    res = _run(g, [])
    d = node_drifts(res, output_elements(g))
    assert d["out"].shape == (1, 2, 1)
    assert float(np.nanmax(d["out"])) == float(res.linf[0])


def test_per_element_trees_are_certified_and_rechecked(tmp_path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """prove --cases with per-element trees: the case-split leaf carries one mask per leaf,
    the checker re-runs every leaf and accepts; a leaf dropped, a leaf's mask emptied (its
    elements then covered by no tree), a mask that credits a leaf with the other position's
    elements, and halved claims are each refused."""
    import functools
    import json

    import onnx

    from kcverify.bounds import cases
    from kcverify.certs.encoding import fx
    from kcverify.cli import main
    from tests.planner.test_prove_cases import CONTRACT, _leaf

    monkeypatch.setattr(Z, "EXACT_BINARY", False)
    monkeypatch.setattr(cases, "certify_cases",
                        functools.partial(cases.certify_cases, per_element=True))
    onnx.save(_two_positions(), tmp_path / "tie.onnx")
    np.savez(tmp_path / "x.npz", x=X)
    contract, model = tmp_path / "tie.yaml", tmp_path / "tie.onnx"
    contract.write_text(CONTRACT.format(tau="0.5"))
    cert, report = tmp_path / "tie.kcert.json", tmp_path / "r.json"
    args = [str(contract), str(model), "--cert", str(cert), "--report", str(report), "--quiet",
            "--domain", "best", "--cases", "8"]
    assert main(["prove", *args]) == 0
    assert json.loads(report.read_text())["clauses"][0]["verdict"] == "proved"
    stmt = json.loads(cert.read_text())
    params = _leaf(stmt)["params"]
    assert len(params["leaves"][0]) == 4 and len(params["masks"][0]) == 4, params["leaves"]
    assert main(["check", str(cert), str(model), str(contract)]) == 0
    original = json.dumps(stmt)

    def forged(edit) -> str:  # type: ignore[no-untyped-def]
        st = json.loads(original)
        edit(_leaf(st)["params"])
        cert.write_text(json.dumps(st))
        capsys.readouterr()
        assert main(["check", str(cert), str(model), str(contract)]) == 1
        return capsys.readouterr().out

    msgs: dict[str, str] = {}

    def drop(p):  # type: ignore[no-untyped-def]
        for k in ("leaves", "claims", "masks"):
            p[k][0].pop()
    assert "lacks the branch" in forged(drop)

    def empty(p):  # type: ignore[no-untyped-def]
        p["masks"][0][0] = {}
    msgs["empty"] = forged(empty)

    def swap(p):  # type: ignore[no-untyped-def]
        p["masks"][0][0], p["masks"][0][-1] = p["masks"][0][-1], p["masks"][0][0]
    msgs["swap"] = forged(swap)

    def half_claims(p):  # type: ignore[no-untyped-def]
        p["claims"][0] = [fx(float.fromhex(v) * 0.5) for v in p["claims"][0]]
    assert "above its claim" in forged(half_claims)

    def no_masks(p):  # type: ignore[no-untyped-def]
        del p["masks"]  # read as one tree over every element: not complete
    msgs["no_masks"] = forged(no_masks)
    assert "lacks the branch" in msgs["empty"], msgs
    assert "split on different elements" in msgs["swap"], msgs
    assert "split on different elements" in msgs["no_masks"], msgs


def test_the_joint_directed_tree_shares_prefixes_too(linearised) -> None:  # type: ignore[no-untyped-def]
    """certify_cases without per_element (one tree, session 8's rule) with and without prefix
    sharing: the same leaves and the same claims, bit for bit, and some run resumed."""
    g = graph_of(_two_ties((0.0, 1.0, 0.0, 1.0)))
    a, b = (certify_cases(g, TRAIN, INF, {"x": X}, max_leaves=16, domain="best", threshold=0.001,
                          per_split=1, share=share) for share in (False, True))
    assert len(a.leaves[0]) == 4 and a.leaves == b.leaves
    assert [[v.hex() for v in c] for c in a.leaf_linf] == [[v.hex() for v in c] for c in b.leaf_linf]
    assert a.resumed == 0 and b.resumed > 0


@pytest.mark.campaign
def test_decoder_layer2_split_resumed_bit_for_bit() -> None:
    """The demo's decoder, eval input 0, whole-graph best (~60 CPU s): the case forcing layer-1
    tie 415 and position 1's layer-2 tie 106, resumed from the snapshots its parent's run left
    (before the layer-1 and layer-2 out-projections), equals the unshared run bit for bit, and
    the resume skips at least the first 40 % of the nodes."""
    from pathlib import Path

    from kcverify.api import kernels_of
    from kcverify.models.ir import load_onnx

    root = Path(__file__).resolve().parents[2]
    train, inf = kernels_of(root / "examples/contracts/fp8-deploy.yaml")
    g = load_onnx(root / "models/tiny_decoder.onnx")
    x = {"input_ids": np.load(root / "examples/data/eval.npz")["input_ids"][0:1]}
    blks = whole_graph(g)

    def run(path, cache=None):  # type: ignore[no-untyped-def]
        tok = RUN_HOOK.set(cache) if cache is not None else None
        try:
            with forcing([path]) as r:
                res = certify_drift(g, train, inf, x, domain="best", blocks=blks)
        finally:
            if tok is not None:
                RUN_HOOK.reset(tok)
        return res, r

    cache = PrefixCache()
    cache.nodes = {"node_MatMul_47", "node_MatMul_87"}
    s47 = ("node_MatMul_47", "left", "inf")
    s87 = ("node_MatMul_87", "left", "inf")
    _, r1 = run([Decision(s47, 415, 28.0, 30.0)], cache)
    e = [t for t in r1.seen[s87].rows[0] if t[0] == 106][0]
    path = [Decision(s47, 415, 28.0, 30.0), Decision(s87, 106, e[1], e[2])]
    shared, _ = run(path, cache)
    n87 = [n.name for n in g.nodes].index("node_MatMul_87")
    assert cache.resumed_at >= 0.4 * len(g.nodes) and cache.resumed_at >= n87 - 5
    plain, _ = run(path)
    assert _same(shared, plain)
