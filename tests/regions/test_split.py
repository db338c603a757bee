"""The split driver's choice of cut (kcverify.regions.split.branch_and_bound): strong branching
bounds both halves of every candidate cut and keeps the one whose worse half is smaller; a
``chooser`` objective bounds the candidates and the objective only the chosen halves."""

from __future__ import annotations

import numpy as np
import pytest

from kcverify.regions.split import PartEval, branch_and_bound, leaves_of, replay, tree_nodes


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


class PriorObjective(WidthObjective):
    """A WidthObjective that records the prior each part got and passes its own row id on."""

    def __init__(self, dim: int, limit: float = 0.25) -> None:
        super().__init__(dim, limit, hint=dim)
        self.priors: list[object] = []
        self.count = 0

    def evaluate(self, lo: np.ndarray, hi: np.ndarray, prior: object = None) -> PartEval:
        ev = super().evaluate(lo, hi, prior)
        self.priors.append(None if prior is None else np.asarray(prior).copy())
        ev.inherit = np.arange(self.count, self.count + len(lo), dtype=float)[:, None]
        self.count += len(lo)
        return ev


def test_far_parts_are_quartered_without_bounding_the_halves() -> None:
    """quad: a part whose value is above it has its chosen cut's halves cut again on the same
    dimension; the four quarters are bounded at once, the halves between never (recorded as
    -2 - d), and the quarters inherit the part's own boxes."""
    main, cheap = PriorObjective(dim=1, limit=0.125), WidthObjective(dim=1)
    out = branch_and_bound(LO, HI, main, budget_s=30, max_parts=200, chooser=cheap, quad=0.5)
    assert out.verdict == "proved"
    # the root (width 1 > 0.5) is quartered; each quarter (0.25 <= 0.5) is halved
    assert out.tree == [1, -3, 1, -1, -1, 1, -1, -1, -3, 1, -1, -1, 1, -1, -1]
    assert [len(w) for w in main.seen] == [1, 4, 8]
    assert np.allclose(main.seen[1][:, 1], 0.25)  # quarters, not halves
    assert np.array_equal(main.priors[1], np.zeros((4, 1)))  # the root's boxes
    lo, hi = leaves_of(LO, HI, out.tree)
    assert np.array_equal(lo, np.array([lf.lo for lf in out.leaves]))
    assert np.array_equal(hi, np.array([lf.hi for lf in out.leaves]))
    assert len(lo) == 8 and np.isclose(np.prod(hi - lo, axis=1).sum(), 1.0)
    # the checker's replay bounds what the split bounded, with the same priors
    again = PriorObjective(dim=1, limit=0.125)
    vals = replay(LO, HI, out.tree, again)
    assert np.array_equal(vals, [lf.value for lf in out.leaves])
    assert [len(w) for w in again.seen] == [1, 4, 8]
    assert np.array_equal(again.priors[1], np.zeros((4, 1)))


def test_without_quad_nothing_is_quartered() -> None:
    main = PriorObjective(dim=1, limit=0.125)
    out = branch_and_bound(LO, HI, main, budget_s=30, max_parts=200,
                           chooser=WidthObjective(dim=1))
    assert out.verdict == "proved" and min(out.tree) == -1
    assert [len(w) for w in main.seen] == [1, 2, 4, 8]


@pytest.mark.parametrize("tree", [[-5, -1, -1], [-2 - 3, -1, -1], [True, -1, -1], [-3, -1]])
def test_malformed_unbounded_entries_are_refused(tree: list) -> None:
    with pytest.raises(ValueError, match="tree"):
        leaves_of(LO, HI, tree)
    with pytest.raises(ValueError, match="tree"):
        tree_nodes(LO, HI, tree)


def test_unbounded_node_cuts_like_a_bounded_one() -> None:
    for d in range(3):
        a, b = leaves_of(LO, HI, [d, -1, -1]), leaves_of(LO, HI, [-2 - d, -1, -1])
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    nodes = tree_nodes(LO, HI, [-3, -1, -1])
    assert list(nodes.bounded) == [False, True, True]


def test_farther_parts_are_cut_in_eighths() -> None:
    """deeper: a part above quad x deeper gets one more level of cuts (eighths), the inner
    nodes of that subtree all unbounded; the replay bounds exactly the eighths."""
    main = PriorObjective(dim=1, limit=0.125)
    out = branch_and_bound(LO, HI, main, budget_s=30, max_parts=200,
                           chooser=WidthObjective(dim=1), quad=0.1, deeper=2.0)
    assert out.verdict == "proved"
    sub = [-3, -3, -1, -1, -3, -1, -1]
    assert out.tree == [1, *sub, *sub]
    assert [len(w) for w in main.seen] == [1, 8]
    assert np.allclose(main.seen[1][:, 1], 0.125)
    again = PriorObjective(dim=1, limit=0.125)
    assert np.array_equal(replay(LO, HI, out.tree, again), [lf.value for lf in out.leaves])
    assert [len(w) for w in again.seen] == [1, 8]
    assert np.array_equal(again.priors[1], np.zeros((8, 1)))


def test_the_budget_is_measured_on_the_given_clock() -> None:
    """``clock``: the budget in its seconds (bench/acasxu.py --cpu passes time.process_time).
    A clock that advances 1 s per reading ends a 2.5 s budget after the root and two rounds,
    whatever the wall clock says; the wall clock with the same budget runs to the part limit."""
    ticks = iter(range(10_000))
    out = branch_and_bound(LO, HI, WidthObjective(dim=1, limit=-1.0), budget_s=2.5,
                           max_parts=60, clock=lambda: float(next(ticks)))
    assert out.verdict == "unknown" and out.stopped == "time budget"
    assert out.rounds == 3 and out.seconds == 4.0
    wall = branch_and_bound(LO, HI, WidthObjective(dim=1, limit=-1.0), budget_s=2.5,
                            max_parts=60)
    assert wall.stopped == "part budget"
