"""x @ W with x's r made symbols after the product (zonotope.f_matmul_const_fresh): the same
set as fresh(x) @ W, and it holds x @ W for every x in the input form (the new symbol of input
element (t, j) set to e_tj / r_tj)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kcverify.bounds.zonotope import F64, ZonoTrack, f_matmul_const, f_matmul_const_fresh
from tests.bounds.test_zonotope_local import _eval, _local_form


@pytest.mark.parametrize("local", [True, False])
def test_fresh_after_equals_fresh_before(local: bool) -> None:
    rng = np.random.default_rng(3)
    shape = (2, 3, 5)
    a = _local_form(rng, shape, 3, 1000, [1, 4, 7])
    if not local:
        a = a.dense()
    w = torch.tensor(rng.normal(size=(5, 4)), dtype=F64)
    z1, z2 = ZonoTrack(), ZonoTrack()
    z1.k = z2.k = 100_000
    out = f_matmul_const_fresh(z1, a, w)
    ref = f_matmul_const(z2.fresh(a), w)
    assert out.kl == a.kl + 5  # one kind per contracted index
    assert bool((out.r < 1e-9).all())
    for p, q in zip(out.bounds(), ref.bounds()):
        assert torch.allclose(p, q, rtol=1e-12, atol=1e-12)
    # enclosure: old symbols anywhere, e = delta * r, delta the new symbols
    P = out.P
    rows = P.narrow(-1, 0, 1).reshape(-1)
    for _ in range(30):
        eps = {i: float(rng.uniform(-1, 1)) for i in range(0, 10_000)}
        delta = torch.tensor(rng.uniform(-1, 1, size=shape), dtype=F64)
        x = _eval(a, eps) + delta * a.r
        new = {}
        lb_new = out.lb[a.kl:]
        d2 = delta.reshape(-1, shape[-1])
        for j in range(shape[-1]):
            for k, t in enumerate(rows):
                new[int(lb_new[j]) + int(t)] = float(d2[k, j])
        y = _eval(out, {**eps, **new})
        assert bool(((x @ w - y).abs() <= out.r * (1 + 1e-9) + 1e-12).all())


def test_fresh_after_refuses_shared_positions() -> None:
    """Two rows at one position would share a new symbol: fresh first instead."""
    rng = np.random.default_rng(4)
    shape = (2, 3, 5)
    P = torch.zeros(shape, dtype=torch.int64)  # every row at position 0
    a = _local_form(rng, shape, 2, 1000, [], P=P)
    w = torch.tensor(rng.normal(size=(5, 4)), dtype=F64)
    z1, z2 = ZonoTrack(), ZonoTrack()
    z1.k = z2.k = 100_000
    out, ref = f_matmul_const_fresh(z1, a, w), f_matmul_const(z2.fresh(a), w)
    for p, q in zip(out.bounds(), ref.bounds()):
        assert torch.allclose(p, q, rtol=1e-12, atol=1e-12)
    assert out.kl == ref.kl  # the fallback: fresh(a) @ w itself
