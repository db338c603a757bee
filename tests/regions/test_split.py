"""The split driver's choice of cut (kcverify.regions.split.branch_and_bound): strong branching
bounds both halves of every candidate cut and keeps the one whose worse half is smaller; a
``chooser`` objective bounds the candidates and the objective only the chosen halves."""

from __future__ import annotations

import numpy as np

from kcverify.regions.split import PartEval, branch_and_bound, leaves_of


class WidthObjective:
    """Proved where the part's width in ``dim`` is at most ``limit``; its value is that width.
    Its own split hint is always ``hint`` (a dimension that does not help)."""

    def __init__(self, dim: int, limit: float = 0.25, hint: int = 0) -> None:
        self.dim, self.limit, self.hint = dim, limit, hint
        self.seen: list[np.ndarray] = []

    def evaluate(self, lo: np.ndarray, hi: np.ndarray, prior: object = None) -> PartEval:
        self.seen.append(hi - lo)
        w = hi[:, self.dim] - lo[:, self.dim]
        return PartEval(w <= self.limit, w.copy(), np.full(len(lo), self.hint))


LO, HI = np.zeros(3), np.ones(3)


def test_strong_branching_finds_the_cut_that_proves() -> None:
    out = branch_and_bound(LO, HI, WidthObjective(dim=1), budget_s=30, max_parts=200)
    assert out.verdict == "proved"
    assert out.tree == [1, 1, -1, -1, 1, -1, -1]  # two levels of cuts on dimension 1
    lo, hi = leaves_of(LO, HI, out.tree)
    assert np.array_equal(lo, np.array([lf.lo for lf in out.leaves]))
    assert np.array_equal(hi, np.array([lf.hi for lf in out.leaves]))


def test_the_hint_alone_does_not_prove() -> None:
    """The same objective with one cut per part (the objective's hint, dimension 0): the parts
    never get thinner in dimension 1, so the budget ends first."""
    out = branch_and_bound(LO, HI, WidthObjective(dim=1), budget_s=30, max_parts=200, strong=0)
    assert out.verdict == "unknown" and out.stopped == "part budget"
    assert out.bound == 1.0 and out.proved_fraction == 0.0


def test_chooser_picks_the_cut_and_the_objective_bounds_only_its_halves() -> None:
    main, cheap = WidthObjective(dim=2), WidthObjective(dim=2)
    out = branch_and_bound(LO, HI, main, budget_s=30, max_parts=200, chooser=cheap)
    assert out.verdict == "proved"
    assert set(d for d in out.tree if d >= 0) == {2}
    # the objective saw the root and the chosen halves only: 1 + 2 + 4 parts
    assert out.parts_bounded == 7 == sum(len(w) for w in main.seen)
    for w in main.seen[1:]:  # every half it bounded was cut along dimension 2 only
        assert np.all(w[:, 0] == 1.0) and np.all(w[:, 1] == 1.0)
    assert sum(len(w) for w in cheap.seen) == 2 * 3 * (1 + 2)  # 3 cuts x 2 halves per parent


def test_a_point_stays_open() -> None:
    """A degenerate box cannot be cut: unknown, not an endless loop."""
    pt = np.full(3, 0.5)
    out = branch_and_bound(pt, pt, WidthObjective(dim=0, limit=-1.0), budget_s=30)
    assert out.verdict == "unknown" and out.stopped == "parts that cannot be split further"
    assert out.tree == [-1]
