"""Pure speedups of the differential zonotope (docs/bounds.md, "Speed"): the same numbers.

A rewrite of a form operation for speed must give the *same* forms, bit for bit, as the code it
replaces: here each fast path is compared with the reference composition it replaces (kept in
this file) on random forms (positions in row order and permuted, a symbol in both parts of a
form, empty dense parts), and whole graphs are run with the fast path and with the reference
monkeypatched in, every tensor's box compared with ``torch.equal``. Each check is shown to
catch a broken variant (a local coefficient scattered to the wrong position).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kcverify.bounds import zonotope as Z
from kcverify.bounds.zonotope import F64
from tests.bounds.test_zonotope import _block_graph, _ops_graph

_FAST_WRITING = Z._dense_writing


def _ref_merge(Gs: list[torch.Tensor], idss: list[torch.Tensor]
               ) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The join as it was written before (concatenate, then reorder by id)."""
    ids = torch.cat(idss)
    G = torch.cat(Gs, 0)
    u, inv = torch.unique(ids, return_inverse=True)
    if u.numel() == ids.numel():
        order = torch.argsort(ids)
        return G[order], ids[order], False
    out = torch.zeros((u.numel(), *G.shape[1:]), dtype=G.dtype)
    out.index_add_(0, inv, G)
    return out, u, True


def _ref_dense_writing(Gd, idsd, L, lb, P):
    """The dense writing as it was computed before: masked products per kind and position."""
    Ld, lids = Z.local_to_dense(L, lb, P)
    return _ref_merge([Gd, Ld], [idsd, lids])


def _broken_dense_writing(Gd, idsd, L, lb, P):
    """A broken variant: the local coefficients of position t land on position t + 1's row."""
    return _FAST_WRITING(Gd, idsd, L, lb, (P + 1) % (int(P.max()) + 1))


def _random_case(rng: np.random.Generator, trial: int):
    T, d = int(rng.integers(2, 6)), int(rng.integers(1, 5))
    shape = (T, d)
    P = torch.arange(T).reshape(T, 1).expand(shape).clone()
    if trial % 3 == 0:  # positions not in row order
        P = torch.tensor(rng.permutation(T))[P]
    kl = int(rng.integers(1, 4))
    lb = torch.tensor(np.sort(rng.choice(50, kl, replace=False)) * 10 + 100, dtype=torch.int64)
    L = torch.tensor(rng.normal(size=(kl, *shape)), dtype=F64)
    L = L * torch.tensor(rng.uniform(size=L.shape) > 0.2, dtype=F64)  # zero coefficients too
    ids = set(rng.choice(90, int(rng.integers(0, 4)), replace=False).tolist())
    if trial % 4 == 1:  # a dense symbol that is also one of the local ones
        ids.add(int(lb[0] + P.reshape(-1)[0]))
    idsd = torch.tensor(sorted(ids), dtype=torch.int64)
    Gd = torch.tensor(rng.normal(size=(len(ids), *shape)), dtype=F64)
    return Gd, idsd, L, lb, P


def _same(a: tuple, b: tuple) -> bool:
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2]


def test_dense_writing_equals_reference() -> None:
    rng = np.random.default_rng(0)
    merged = 0
    for trial in range(120):
        case = _random_case(rng, trial)
        ref = _ref_dense_writing(*case)
        assert _same(Z._dense_writing(*case), ref), trial
        assert not _same(_broken_dense_writing(*case), ref) or not bool(case[2].any()), trial
        merged += ref[2]
        # the joins of Form._with_rows and Form.dense (distinct ids and shared ones)
        Gd, idsd, L, lb, P = case
        Ld, lids = Z.local_to_dense(L, lb, P)
        assert _same(Z._merge_rows([Gd, Ld], [idsd, lids]), ref), trial
        extra = torch.tensor(rng.normal(size=(2, *Gd.shape[1:])), dtype=F64)
        eids = [torch.tensor([7, 95]), torch.tensor([95, 3])][trial % 2]
        assert _same(Z._merge_rows([Gd.expand(Gd.shape[0], *Gd.shape[1:]), extra], [idsd, eids]),
                     _ref_merge([Gd, extra], [idsd, eids])), trial
    assert merged >= 10  # the shared-symbol path ran


def test_form_dense_uses_fast_writing() -> None:
    """A form's dense() and G read the fast writing, and equal the reference's."""
    rng = np.random.default_rng(1)
    Gd, idsd, L, lb, P = _random_case(rng, 2)
    f = Z.Form(torch.zeros(P.shape, dtype=F64), Gd, torch.zeros(P.shape, dtype=F64), idsd, L, lb, P)
    G, ids, _ = _ref_dense_writing(Gd, idsd, L, lb, P)
    assert torch.equal(f.dense().G, G) and torch.equal(f.dense().ids, ids)


FP8 = {"weights": {"format": "fp8_e4m3", "scale": "per_channel"},
       "activations": {"format": "fp8_e4m3", "scale": "dynamic_per_tensor"},
       "accumulate": "fp32", "compute": "fp32"}


def _graph_boxes(graph, local: bool = True, kernel: dict | None = None,
                 width: float = 0.05) -> dict:
    from kcverify.bounds.box import Box
    from kcverify.bounds.engine import ZonotopeRun, expanded, input_box, load_rules, run_graph
    from kcverify.kernels.spec import parse_kernel_spec
    from tests.soundness._helpers import TRAIN

    load_rules()
    spec = parse_kernel_spec("inf", kernel or {"compute": "bf16", "accumulate": "fp32"})
    x0 = np.random.default_rng(7).normal(size=(2, 3, 8))
    lo, hi = (torch.tensor(x0 + d, dtype=F64) for d in (-width, width))
    every = [o for n in graph.nodes for o in n.outputs if o]
    zt = Z.ZonoTrack(local=local)
    state = {"x": input_box(TRAIN, spec, lo, hi)}
    res = run_graph(expanded(graph, "zonotope"), TRAIN, spec, state, "zonotope",
                    torch.device("cpu"), keep=set(every), runs=(ZonotopeRun(zt),))
    return {k: v for k, v in res.items() if isinstance(v, Box) and k in every}


@pytest.mark.parametrize("which", ["block", "ops"])
def test_graph_bit_identical_to_reference(which: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tensor's box of a graph run is bit-identical with the reference writing; the
    broken writing changes some box (the comparison can fail)."""
    graph = _block_graph() if which == "block" else _ops_graph()
    fast = _graph_boxes(graph)
    with monkeypatch.context() as m:
        m.setattr(Z, "_dense_writing", _ref_dense_writing)
        ref = _graph_boxes(graph)
    with monkeypatch.context() as m:
        m.setattr(Z, "_dense_writing", _broken_dense_writing)
        broken = _graph_boxes(graph)
    assert fast.keys() == ref.keys() and len(fast) >= 5
    for name in fast:
        for p, q in zip(fast[name].parts(), ref[name].parts()):
            assert torch.equal(p, q), name
    assert any(not torch.equal(p, q) for name in fast
               for p, q in zip(fast[name].parts(), broken[name].parts()))


@pytest.mark.parametrize("chunk", [64, 2**16])
def test_cont_rad_equals_copied_rows(chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """_cont_rad sums the continuous rows in place; the number is the copied form's rad()
    (also with chunks of a few rows: the chunks of the rows picked are the copy's chunks)."""
    monkeypatch.setattr(Z, "L1_CHUNK", chunk)
    rng = np.random.default_rng(2)
    for trial in range(40):
        Gd, idsd, L, lb, P = _random_case(rng, trial)
        if trial % 2:
            L = lb = None
            P = None
        Gd = torch.cat([Gd, torch.tensor(rng.normal(size=(300, *Gd.shape[1:])), dtype=F64)])
        idsd = torch.cat([idsd, torch.arange(1000, 1300)])
        c = torch.tensor(rng.normal(size=Gd.shape[1:]), dtype=F64)
        r = torch.tensor(rng.uniform(size=Gd.shape[1:]), dtype=F64)
        f = Z.Form(c, Gd, r, idsd, L, lb, P)
        bm = torch.tensor(rng.uniform(size=int(idsd.numel())) < 0.3)
        if trial == 0:
            bm[:] = True  # no continuous dense row
        part = Z.Form(c, Gd[~bm], r, idsd[~bm], L, lb, P)
        assert torch.equal(Z._cont_rad(f, bm), part.rad()), trial


def _coeff_dict(f: Z.Form) -> dict[int, torch.Tensor]:
    d = f.dense()
    return {int(i): d.G[j] for j, i in enumerate(d.ids) if bool((d.G[j] != 0).any())}


def _drop_smallest(f: Z.Form) -> Z.Form:
    """A broken pruning: also drops the dense row of least magnitude that is not zero."""
    keep = Z._nonzero_rows(f.Gd)
    nz = torch.nonzero(keep).reshape(-1)
    keep[nz[Z._row_l1(f.Gd[nz]).argmin()]] = False
    return Z.Form(f.c, f.Gd[keep], f.r, f.idsd[keep], f.L, f.lb, f.P)


def test_zero_rows_dropped_same_set() -> None:
    """without_zero_rows keeps every symbol with a coefficient, the centre, r and the radius;
    the kept gsum bounds the pruned form's own; a pruning that drops a nonzero row is caught."""
    rng = np.random.default_rng(3)
    dropped = 0
    for trial in range(40):
        Gd, idsd, L, lb, P = _random_case(rng, trial + 1)
        Gd = torch.cat([Gd, torch.tensor(rng.normal(size=(6, *Gd.shape[1:])), dtype=F64)])
        idsd = torch.cat([idsd, torch.arange(2000, 2006)])
        zd = torch.tensor(rng.uniform(size=int(idsd.numel())) < 0.4)
        Gd[zd] = 0.0
        if trial % 3 == 0:
            Gd[zd.nonzero()[:1].reshape(-1)] = -0.0  # a negative zero is a zero too
            L[0] = 0.0
        c = torch.tensor(rng.normal(size=Gd.shape[1:]), dtype=F64)
        r = torch.tensor(rng.uniform(size=Gd.shape[1:]), dtype=F64)
        f = Z.Form(c, Gd, r, idsd, L, lb, P)
        if trial % 2:
            f.gsum()  # known before: kept
        g = f.without_zero_rows()
        dropped += (f.kd + f.kl) - (g.kd + g.kl)
        assert torch.equal(g.c, f.c) and torch.equal(g.r, f.r)
        if trial % 2:
            assert torch.equal(g.rad(), f.rad())
        assert torch.allclose(g.rad(), f.rad(), rtol=1e-14, atol=0)
        fresh = Z.Form(g.c, g.Gd, g.r, g.idsd, g.L, g.lb, g.P)
        assert bool((fresh.gsum() <= g.gsum()).all())
        a, b = _coeff_dict(f), _coeff_dict(g)
        assert a.keys() == b.keys() and all(torch.equal(a[i], b[i]) for i in a), trial
        assert not bool((g.Gd.reshape(g.kd, -1) == 0).all(1).any())
        if g.kd:
            assert _coeff_dict(_drop_smallest(g)).keys() != a.keys()
    assert dropped >= 40


@pytest.mark.parametrize("which", ["block", "ops"])
def test_graph_with_zero_rows_pruned(which: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With fp8 activation casts, a graph's boxes with the matmul operands' all-zero rows
    pruned equal the run that keeps them (to the float64 roundings of the shorter sums: the
    same sets, summed over fewer rows); rows were pruned."""
    graph = _block_graph() if which == "block" else _ops_graph()
    seen = []
    orig = Z.Form.without_zero_rows

    def counted(f: Z.Form) -> Z.Form:
        g = orig(f)
        seen.append((f.kd + f.kl) - (g.kd + g.kl))
        return g
    with monkeypatch.context() as m:
        m.setattr(Z.Form, "without_zero_rows", counted)
        pruned = _graph_boxes(graph, kernel=FP8, width=1e-5)
    assert sum(seen) > 0
    with monkeypatch.context() as m:
        m.setattr(Z, "PRUNE_ZERO_ROWS", False)
        kept = _graph_boxes(graph, kernel=FP8, width=1e-5)
    for name in pruned:
        for p, q in zip(pruned[name].parts(), kept[name].parts()):
            fin = torch.isfinite(q)
            assert torch.equal(torch.isfinite(p), fin), name
            assert torch.allclose(p[fin], q[fin], rtol=1e-12, atol=1e-15), name

    def broken(f: Z.Form) -> Z.Form:  # also drops the least nonzero row: caught
        g = orig(f)
        return _drop_smallest(g) if g.kd > 1 else g
    with monkeypatch.context() as m:
        m.setattr(Z.Form, "without_zero_rows", broken)
        bad = _graph_boxes(graph, kernel=FP8, width=1e-5)
    assert any(not torch.allclose(p, q, rtol=1e-12, atol=1e-15) for name in bad
               for p, q in zip(bad[name].parts(), kept[name].parts()))
