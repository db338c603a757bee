"""Welford / Chan moment trees for the adversarial LayerNorm programs, written from the family's
text (kcverify/kernels/spec.py: "Welford / Chan updates combined in a binary tree of height
<= 32 + ceil(log2 n)"; rules/normalization.py's docstring for the update forms) and from
torch's public RowwiseMoments description, not from any other test's programs.

A tree is a leaf index (int) or a pair (a, b); ``a`` is the accumulator of the merge:

    delta = fl(mu_b - mu_a),  c ~ n_b / n,  mu = mu_a + c delta,
    M = M_a + M_b + delta^2 c n_a        (Chan)
    M = M_a + delta fl(x - mu)           (Welford, when b is one element x)

every operation one round-to-nearest in the accumulator format (arith.round3 for sums: exact).
Forms (``Form``): ``mean`` "two" fl(mu_a + fl(c delta)), "fused" one rounding of mu_a + c delta,
"div" fl(mu_a + fl(fl(delta n_b) / n)); ``c`` "div" fl(n_b / n) or "recip" fl(n_b fl(1 / n));
``term`` the association of delta^2 c n_a: "torch" ((delta delta) c) n_a, "na_first"
(delta (delta n_a)) c, "c_first" (delta (c delta)) n_a; ``msum`` "ab" fl(fl(M_a + M_b) + t) or
"bt" fl(M_a + fl(M_b + t)); ``welford``: use Welford's update where b is a leaf (else Chan).

Shapes (``tree``): ``torch`` (Welford chains of 16, a balanced cascade of the chunks, a scalar
tail merged one by one), ``chains<c>`` (chains of c, balanced cascade), ``caterpillar<c>``
(chains of c merged left to right, 16 to a group, the groups by a balanced cascade), ``spine`` / ``spine_a`` (as unbalanced as the height bound
allows: one element split off at each node, on the b / the a side), ``random`` (random split
points within the bound). ``height(tree) <= max_height(n)`` is asserted for every tree built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tests.soundness.adversarial.arith import Fmt, rnd, round3

Tree = int | tuple


def max_height(n: int) -> int:
    return min(32 + math.ceil(math.log2(max(n, 1))), max(n - 1, 0))


def height(t: Tree) -> int:
    return 0 if isinstance(t, int) else 1 + max(height(t[0]), height(t[1]))


def _balanced(parts: list[Tree]) -> Tree:
    while len(parts) > 1:
        parts = [(parts[k], parts[k + 1]) if k + 1 < len(parts) else parts[k]
                 for k in range(0, len(parts), 2)]
    return parts[0]


def _chain(lo: int, hi: int) -> Tree:
    t: Tree = lo
    for j in range(lo + 1, hi):
        t = (t, j)
    return t


def _unbalanced(lo: int, hi: int, budget: int, side: str, rng: np.random.Generator | None
                ) -> Tree:
    n = hi - lo
    if n == 1:
        return lo
    need = math.ceil(math.log2(n - 1)) if n > 2 else (1 if n == 2 else 0)
    if rng is None and budget - 1 >= need:  # split one element off
        if side == "b":
            return (_unbalanced(lo, hi - 1, budget - 1, side, rng), hi - 1)
        return (lo, _unbalanced(lo + 1, hi, budget - 1, side, rng))
    if rng is not None:
        lo_k = max(1, n - 2 ** (budget - 1))  # both sides must fit budget - 1
        hi_k = min(n - 1, 2 ** (budget - 1))
        k = int(rng.integers(lo_k, hi_k + 1))
    else:
        k = (n + 1) // 2
    return (_unbalanced(lo, lo + k, budget - 1, side, rng),
            _unbalanced(lo + k, hi, budget - 1, side, rng))


def build(shape: str, n: int, seed: int = 0) -> Tree:
    if shape == "torch":
        k, t = divmod(n, 16)
        tree = _balanced([_chain(16 * j, 16 * j + 16) for j in range(k)]) if k else None
        for j in range(16 * k, n):
            tree = j if tree is None else (tree, j)
    elif shape.startswith("chains"):
        c = int(shape[6:])
        tree = _balanced([_chain(j, min(n, j + c)) for j in range(0, n, c)])
    elif shape.startswith("caterpillar"):
        c = int(shape[11:])
        groups = []
        for g0 in range(0, n, 16 * c):  # 16 chunks per group, left to right
            parts = [_chain(j, min(n, j + c)) for j in range(g0, min(n, g0 + 16 * c), c)]
            tree = parts[0]
            for p in parts[1:]:
                tree = (tree, p)
            groups.append(tree)
        tree = _balanced(groups)
    elif shape in ("spine", "spine_a"):
        tree = _unbalanced(0, n, max_height(n), "b" if shape == "spine" else "a", None)
    elif shape == "random":
        tree = _unbalanced(0, n, max_height(n), "b", np.random.default_rng(seed))
    else:
        raise ValueError(shape)
    assert height(tree) <= max_height(n), (shape, n, height(tree), max_height(n))
    return tree


@dataclass(frozen=True)
class Form:
    mean: str = "two"
    c: str = "div"
    term: str = "torch"
    msum: str = "ab"
    welford: bool = True


def moments(x: np.ndarray, tree: Tree, form: Form, A: Fmt) -> tuple[np.ndarray, np.ndarray]:
    """(mean, M2) of each row of x (..., n) by the tree, in the accumulator format A."""
    x = np.asarray(x, np.float64)
    z = np.zeros(x.shape[:-1])

    def add(a, b):
        with np.errstate(invalid="ignore", over="ignore"):
            return round3(np.asarray(a, np.float64) + z, np.asarray(b, np.float64) + z, z, A)

    def mul(a, b):
        with np.errstate(invalid="ignore", over="ignore"):
            return rnd(np.asarray(a, np.float64) * np.asarray(b, np.float64), A)

    def go(t: Tree):
        if isinstance(t, int):
            return 1, x[..., t], z
        na, mua, Ma = go(t[0])
        nb, mub, Mb = go(t[1])
        nv = na + nb
        delta = add(mub, -mua)
        if form.c == "div":
            c = rnd(np.float64(nb) / nv, A)
        else:
            c = rnd(nb * rnd(1.0 / nv, A), A)
        if form.mean == "two":
            mu = add(mua, mul(c, delta))
        elif form.mean == "fused":
            hi = c * delta  # <= 48 bits: exact
            mu = round3(mua + z, hi + z, z, A)
        else:
            mu = add(mua, rnd(mul(delta, float(nb)) / nv, A))
        if form.welford and nb == 1 and isinstance(t[1], int):
            t_ = mul(delta, add(x[..., t[1]], -mu))
            M = add(Ma, t_)
        else:
            if form.term == "torch":
                t_ = mul(mul(mul(delta, delta), c), float(na))
            elif form.term == "na_first":
                t_ = mul(mul(delta, mul(delta, float(na))), c)
            else:
                t_ = mul(mul(delta, mul(c, delta)), float(na))
            M = add(add(Ma, Mb), t_) if form.msum == "ab" else add(Ma, add(Mb, t_))
        return nv, mu, M

    _, mu, M = go(tree)
    return mu, M
