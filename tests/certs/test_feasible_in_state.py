"""The checker refuses a block record whose in_state describes no execution (a drift interval
disjoint from inf - train at some element) before re-running from it: sound rules may meet
enclosures of an empty set into nothing, which is the certificate's fault, not the engine's."""

from __future__ import annotations

import numpy as np

from kcverify.boxes import DiffBox
from kcverify.certs.recheck import feasible


def _box(t, i, d) -> DiffBox:
    a = [np.array(v, np.float64) for v in (*t, *i, *d)]
    return DiffBox(*a)


def test_prover_like_boxes_pass() -> None:
    assert feasible(_box(([1.0], [1.0]), ([1.5], [1.5]), ([0.5], [0.5])))  # a point, exact
    assert feasible(_box(([0.0], [1.0]), ([0.0], [1.0]), ([-1.0], [-1.0])))  # a corner pair
    assert feasible(_box(([0.1], [0.1]), ([0.3], [0.3]), ([0.1 + 0.1], [0.1 + 0.1])))
    assert feasible(_box(([np.inf], [np.inf]), ([np.inf], [np.inf]), ([-1.0], [1.0])))
    assert feasible(_box(([-np.inf], [np.inf]), ([0.0], [0.0]), ([5.0], [6.0])))


def test_empty_boxes_refused() -> None:
    assert not feasible(_box(([1.0, 1.0], [1.0, 1.0]), ([1.5, 2.0], [1.5, 2.0]),
                             ([0.5, 0.5], [0.5, 0.5])))  # element 1: drift 1.0 only
    assert not feasible(_box(([0.0], [1.0]), ([0.0], [1.0]), ([1.5], [2.0])))
    assert not feasible(_box(([1.0], [0.0]), ([0.0], [1.0]), ([0.0], [0.0])))  # train lo > hi
