"""Position-local symbols of the differential zonotope (zonotope.py, "Position-local symbols").

A form's local part (L, lb, P) stands for the dense rows lb[j] + t = L[j] where P == t. Every
primitive that keeps the local part must give the same affine function as the same primitive on
the dense form: here each one is run on random forms with local parts and on their ``dense()``
writing, and the results compared symbol by symbol (coefficients, centre and r to 1e-12
relative), and the local result must enclose the exact op's value at sampled symbol values and
noise. The checker is shown to fail on a form whose positions are wrong (a movement that forgot
to move P). Graphs: every tensor's box with local symbols equals the dense run's (ZonoTrack's
``local=False``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kcverify.bounds.zonotope import (
    F64,
    Form,
    ZonoTrack,
    ZState,
    _moved,
    _row_positions,
    f_add,
    f_matmul_const,
    f_mul,
    f_scale,
    f_shift,
    f_smooth,
    f_sum,
)
from tests.bounds.test_zonotope import _block_graph, _ops_graph

REL = 1e-12


def _local_form(rng: np.random.Generator, shape: tuple[int, ...], kinds: int, base: int,
                dense_ids: list[int], P: torch.Tensor | None = None, g: float = 0.3) -> Form:
    """A random form with ``kinds`` local kinds (bases from ``base``) and dense rows."""
    P = _row_positions(shape) if P is None else P
    T = int(P.max()) + 1
    c = torch.tensor(rng.normal(size=shape), dtype=F64)
    L = torch.tensor(rng.normal(size=(kinds, *shape)) * g, dtype=F64)
    L = L * torch.tensor(rng.uniform(size=(kinds, *shape)) > 0.1, dtype=F64)
    G = torch.tensor(rng.normal(size=(len(dense_ids), *shape)) * g, dtype=F64)
    r = torch.tensor(rng.uniform(0, 0.05, size=shape), dtype=F64)
    lb = base + torch.arange(kinds, dtype=torch.int64) * T
    return Form(c, G, r, torch.tensor(sorted(dense_ids), dtype=torch.int64), L, lb, P)


def _coeffs(f: Form) -> dict[int, torch.Tensor]:
    d = f.dense()
    return {int(i): d.G[j] for j, i in enumerate(d.ids)}


def _same(a: Form, b: Form, split: bool = False) -> None:
    """The same affine function (every symbol's coefficients, the centre) and the same bounds
    (``split``: a symbol may sit in both parts of ``a``, whose bounds then add |g_dense| +
    |g_local| where the dense writing has |g_dense + g_local|: only at least as wide)."""
    ca, cb = _coeffs(a), _coeffs(b)
    mag = max(1.0, float(a.c.abs().max()))
    for i in set(ca) | set(cb):
        x, y = ca.get(i), cb.get(i)
        x = torch.zeros_like(a.c) if x is None else x.expand(a.shape)
        y = torch.zeros_like(a.c) if y is None else y.expand(a.shape)
        assert torch.allclose(x, y, rtol=REL, atol=REL * mag), f"symbol {i}"
    assert torch.allclose(a.c, b.c, rtol=REL, atol=REL * mag)
    (lo, hi), (rlo, rhi) = a.bounds(), b.bounds()
    if split:
        tol = REL * (rhi - rlo).abs().max()  # the float64 sum factors differ by ~1e-15
        assert bool((lo <= rlo + tol).all()) and bool((hi >= rhi - tol).all())
        assert float(((hi - lo) - (rhi - rlo)).max()) > 1e-3  # wider somewhere: not vacuous
        return
    for p, q in ((lo, rlo), (hi, rhi)):
        assert torch.allclose(p, q, rtol=REL, atol=REL * mag)
    assert torch.allclose(a.dense().r, b.dense().r, rtol=1e-9, atol=REL * mag)


def _eval(f: Form, eps: dict[int, float], noise: torch.Tensor | None = None) -> torch.Tensor:
    """c + sum G eps + sum_j L[j] eps_{lb_j + P} (+ noise within r), from the parts directly."""
    v = f.c.clone()
    for j, i in enumerate(f.idsd):
        v = v + f.Gd[j] * eps.get(int(i), 0.0)
    if f.L is not None:
        for j, b in enumerate(f.lb):
            e = torch.tensor([eps.get(int(b) + int(t), 0.0) for t in f.P.reshape(-1)], dtype=F64)
            v = v + f.L[j] * e.reshape(f.shape)
    return v if noise is None else v + noise * f.r


def _encloses(out: Form, ins: list[Form], op, rng: np.random.Generator, n: int = 30) -> None:
    ids = set()
    for f in [out, *ins]:
        d = f.dense()
        ids |= {int(i) for i in d.ids}
    for _ in range(n):
        eps = {i: float(rng.choice([-1.0, 1.0]) if rng.uniform() < 0.3 else rng.uniform(-1, 1))
               for i in ids}
        vals = [_eval(f, eps, torch.tensor(rng.uniform(-1, 1, size=f.shape), dtype=F64))
                for f in ins]
        y = op(*vals)
        resid = (y - _eval(out, eps)).abs()
        lim = out.r * (1 + 1e-9) + 1e-12 * (y.abs() + 1)
        assert bool((resid <= lim).all()), float((resid - lim).max())


SHAPE = (2, 3, 5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_primitives_local_equals_dense(seed: int) -> None:
    rng = np.random.default_rng(seed)
    a = _local_form(rng, SHAPE, 3, 1000, [1, 4, 7])
    b = _local_form(rng, SHAPE, 2, 1000, [4, 9])  # kinds shared with a (same bases)
    b2 = _local_form(rng, SHAPE, 2, 5000, [2])  # other kinds
    w = torch.tensor(rng.normal(size=(5, 4)), dtype=F64)
    wl = torch.tensor(rng.normal(size=(4, 3)), dtype=F64)
    s = torch.tensor(rng.normal(size=(5,)), dtype=F64)
    cases = [
        ("add", lambda x, y: f_add(x, y), [a, b], lambda x, y: x + y),
        ("sub", lambda x, y: f_add(x, y, -1.0), [a, b2], lambda x, y: x - y),
        ("mul", f_mul, [a, b], lambda x, y: x * y),
        ("scale", lambda x: f_scale(x, s), [a], lambda x: x * s),
        ("shift", lambda x: f_shift(x, s), [a], lambda x: x + s),
        ("matmul_w", lambda x: f_matmul_const(x, w), [a], lambda x: x @ w),
        ("matmul_left", lambda x: f_matmul_const(x, wl, left=True), [a], lambda x: wl @ x),
        ("sum_last", lambda x: f_sum(x, -1), [a], lambda x: x.sum(-1, keepdim=True)),
        ("sum_rows", lambda x: f_sum(x, 1), [a], lambda x: x.sum(1, keepdim=True)),
        ("exp", lambda x: f_smooth(x, *x.bounds(), torch.exp, torch.exp,
                                   lambda p, q: (torch.exp(p), torch.exp(q))), [a], torch.exp),
    ]
    for name, fn, ins, exact in cases:
        out = fn(*ins)
        ref = fn(*[f.dense() for f in ins])
        _same(out, ref)
        _encloses(out, ins, exact, rng)
        if name in ("add", "mul", "scale", "matmul_w", "sum_last", "exp"):
            assert out.L is not None, name  # the hot rules keep the local part


def test_local_pair_other_positions() -> None:
    """Two forms whose positions differ: one is written densely first (same set)."""
    rng = np.random.default_rng(3)
    a = _local_form(rng, SHAPE, 2, 1000, [1])
    perm = torch.tensor(rng.permutation(6)).reshape(2, 3, 1).expand(SHAPE)
    b = _local_form(rng, SHAPE, 2, 1000, [1], P=perm)  # the same bases, other positions
    for fn, exact in ((lambda x, y: f_add(x, y), lambda x, y: x + y), (f_mul, lambda x, y: x * y)):
        out = fn(a, b)
        _same(out, fn(a.dense(), b.dense()))
        _same(out, fn(a, b.dense()))  # a local symbol dense in the other form: merged densely
        _encloses(out, [a, b], exact, rng)
    split = Form(a.c, b.dense().Gd, a.r, b.dense().idsd, a.L, a.lb, a.P)  # both parts: wider
    _same(split, split.dense(), split=True)


def test_movement_moves_positions_and_checker_catches_a_wrong_map() -> None:
    rng = np.random.default_rng(4)
    a = _local_form(rng, SHAPE, 3, 1000, [2])
    for move, exact in ((lambda t: t.transpose(-1, -2), lambda x: x.transpose(-1, -2)),
                        (lambda t: t.reshape(6, 5), lambda x: x.reshape(6, 5)),
                        (lambda t: t[:, 1:, ::2], lambda x: x[:, 1:, ::2])):
        out = _moved(a, move)
        _same(out, _moved(a.dense(), move))
        _encloses(out, [a], exact, rng)
    # a movement that forgets the positions: the checker must see it
    out = _moved(a, lambda t: t.transpose(0, 1))
    bad = Form(out.c, out.Gd, out.r, out.idsd, out.L, out.lb,
               a.P.transpose(0, 1).flip(0).contiguous())
    with pytest.raises(AssertionError):
        _same(bad, _moved(a.dense(), lambda t: t.transpose(0, 1)))
    with pytest.raises(AssertionError):
        _encloses(bad, [a], lambda x: x.transpose(0, 1), rng, n=10)


def test_drift_and_cap_local_equals_dense() -> None:
    rng = np.random.default_rng(5)
    t = _local_form(rng, SHAPE, 3, 1000, [1, 2])
    i = _local_form(rng, SHAPE, 3, 1000, [2, 3])
    i = Form(t.c + i.c * 1e-3, t.Gd + i.Gd * 1e-3, i.r * 1e-3, t.idsd, t.L + i.L * 1e-3, t.lb,
             t.P)
    lo, hi = ZState(t, i).drift_bounds()
    rlo, rhi = ZState(t.dense(), i.dense()).drift_bounds()
    assert torch.allclose(lo, rlo, rtol=REL, atol=1e-15) and torch.allclose(hi, rhi, rtol=REL)
    # both parts cancel: much narrower than the kernels' own radii
    assert float((hi - lo).max()) < 0.5 * float(t.rad().min())
    far = Form(i.c, i.Gd, i.r, i.idsd, i.L, i.lb + 100_000, i.P)  # other kinds: no cancelling
    flo, fhi = ZState(t, far).drift_bounds()
    rlo, rhi = ZState(t.dense(), far.dense()).drift_bounds()
    assert torch.allclose(flo, rlo, rtol=REL) and torch.allclose(fhi, rhi, rtol=REL)
    assert float((fhi - flo).min()) > float(t.rad().min())
    capped = i.cap(3)
    assert capped.kd + capped.kl == 3
    _encloses(capped, [i], lambda x: x, rng)


def test_fresh_and_row_symbols_local() -> None:
    """New per-element and per-row symbols: local kinds, distinct from every earlier symbol, the
    same set as the dense tracker's (up to the symbols' names)."""
    rng = np.random.default_rng(6)
    f = _local_form(rng, SHAPE, 2, 0, [])
    zl, zd = ZonoTrack(), ZonoTrack(local=False)
    zl.k = zd.k = 10_000
    out, ref = zl.fresh(f), zd.fresh(f.dense())
    assert out.kl == 2 + 5 and bool((out.r == 0).all())
    assert not set(map(int, out.dense().ids)) & set(range(zl.k, zl.k + 100))
    for p, q in zip(out.bounds(), ref.bounds()):
        assert torch.allclose(p, q, rtol=REL)
    d = out.dense()
    new = d.ids >= 10_000  # each new symbol: one element's r, nowhere else
    assert bool(((d.G[new] != 0).reshape(int(new.sum()), -1).sum(1) <= 1).all())
    assert torch.equal(d.G[new].abs().sum(0), f.r)
    old = Form(d.c, d.G[~new], d.r, d.ids[~new])
    _same(old, f.dense().with_r(torch.zeros_like(f.r)))
    coef = torch.tensor(rng.normal(size=SHAPE), dtype=F64)
    k0 = zl.k
    rows = zl.row_symbols(out, [coef])
    rref = zd.row_symbols(ref, [coef])
    for p, q in zip(rows.bounds(), rref.bounds()):
        assert torch.allclose(p, q, rtol=REL)
    # one symbol per row: a row's elements move together with the new symbol
    d = rows.dense()
    new = [j for j, i in enumerate(d.ids) if int(i) >= k0]
    assert len(new) == 6
    for j in new:
        nz = (d.G[j] != 0).reshape(6, 5)
        assert int(nz.any(1).sum()) == 1


@pytest.mark.parametrize("which", ["block", "ops"])
def test_graph_local_equals_dense(which: str) -> None:
    """Every tensor's box from a run with local symbols equals the dense run's."""
    from kcverify.bounds.box import Box
    from kcverify.bounds.engine import ZonotopeRun, expanded, input_box, load_rules, run_graph
    from kcverify.kernels.spec import parse_kernel_spec
    from tests.soundness._helpers import TRAIN

    load_rules()
    graph = _block_graph() if which == "block" else _ops_graph()
    spec = parse_kernel_spec("inf", {"compute": "bf16", "accumulate": "fp32"})
    x0 = np.random.default_rng(7).normal(size=(2, 3, 8))
    lo, hi = (torch.tensor(x0 + d, dtype=F64) for d in (-0.05, 0.05))
    every = [o for n in graph.nodes for o in n.outputs if o]
    res = {}
    for local in (True, False):
        zt = ZonoTrack(local=local)
        state = {"x": input_box(TRAIN, spec, lo, hi)}
        res[local] = run_graph(expanded(graph, "zonotope"), TRAIN, spec, state, "zonotope",
                               torch.device("cpu"), keep=set(every), runs=(ZonotopeRun(zt),))
        if local:
            assert any(z.t.L is not None for z in zt.forms.values())
    n = 0
    for name in every:
        a, b = res[True].get(name), res[False].get(name)
        if not isinstance(a, Box):
            continue
        for p, q in zip(a.parts(), b.parts()):
            fin = torch.isfinite(q)
            assert torch.equal(torch.isfinite(p), fin), name
            assert torch.allclose(p[fin], q[fin], rtol=1e-10, atol=1e-13), name
        n += 1
    assert n >= 5
