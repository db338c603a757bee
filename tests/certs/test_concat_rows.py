"""Slices proved in chunks: the sequential rule's rows param and the concat-rows rule."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kcverify.boxes import DiffBox
from kcverify.certs.encoding import fx, unfx
from kcverify.certs.records import BlockData, encode_state
from kcverify.certs.rules import RuleContext, RuleError, get_rule

X = np.array([[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]])  # a slice of 3 inputs


def point(x: np.ndarray) -> DiffBox:
    z = np.zeros_like(x)
    return DiffBox(x, x, x, x, z, z)


def ctx_for(rows: tuple[int, int]) -> RuleContext:
    """One block from input x to logits y = x (drift +-0.1), over rows ``rows`` of X."""
    x = X[rows[0]:rows[1]]
    y = DiffBox(x, x, x - 0.1, x + 0.1, -0.1 + 0 * x, 0.1 + 0 * x)
    blk = BlockData("c:0", "b0", "d" * 64, "interval", {"x": point(x)}, {"y": y}, {})
    return RuleContext(blocks={"c:0": blk}, input_region=lambda sl: {"x": point(X)},
                       expected_chain=[("b0", "d" * 64)])


def chain(ctx: RuleContext, rows: tuple[int, int] | None, box_rows: tuple[int, int]
          ) -> dict[str, Any]:
    params: dict[str, Any] = {"inputs": encode_state({"x": point(X[box_rows[0]:box_rows[1]])}),
                              "outputs": ["y"], "slice": "all"}
    if rows is not None:
        params["rows"] = list(rows)
    return get_rule("sequential").conclude([{"kind": "block", "ref": "c:0"}], params, ctx)


def linf(rows: list[int] | None, *deltas: float, sl: str = "all") -> dict[str, Any]:
    out: dict[str, Any] = {"quantity": "linf_drift", "direction": "upper", "tensor": "y",
                           "slice": sl, "bounds": [fx(d) for d in deltas]}
    if rows is not None:
        out["rows"] = rows
    return out


def test_sequential_checks_the_rows_it_names() -> None:
    ctx = ctx_for((1, 3))
    st = chain(ctx, (1, 3), (1, 3))
    assert st["rows"] == [1, 3] and st["slice"] == "all"
    with pytest.raises(RuleError, match="does not contain the inputs"):
        chain(ctx, None, (1, 3))  # without rows the chain must cover the whole slice
    with pytest.raises(RuleError, match="does not contain the inputs"):
        chain(ctx, (0, 2), (1, 3))  # rows it does not assume
    with pytest.raises(RuleError, match="exceed the 3 inputs"):
        chain(ctx, (1, 4), (1, 3))
    with pytest.raises(RuleError, match="rows must be"):
        chain(ctx, (2, 2), (1, 3))
    lin = get_rule("linf-from-state").conclude([st], {"tensor": "y"}, ctx)
    assert lin["rows"] == [1, 3] and [unfx(b) for b in lin["bounds"]] == [0.1, 0.1]


def test_concat_rows_tiles_the_slice_once_in_order() -> None:
    ctx = ctx_for((0, 3))
    rule = get_rule("concat-rows")
    got = rule.conclude([linf([0, 1], 0.5), linf([1, 3], 0.25, 0.125)], {"n": 3}, ctx)
    assert "rows" not in got and got["slice"] == "all"
    assert [unfx(b) for b in got["bounds"]] == [0.5, 0.25, 0.125]
    for premises, n, why in [
        ([linf([0, 1], 0.5), linf([2, 3], 0.1)], 3, "start at 1"),  # a gap
        ([linf([0, 2], 0.5, 0.5), linf([1, 3], 0.1, 0.1)], 3, "start at 2"),  # overlap
        ([linf([1, 3], 0.1, 0.1), linf([0, 1], 0.5)], 3, "start at 0"),  # out of order
        ([linf([0, 1], 0.5), linf([1, 2], 0.1)], 3, "cover rows \\[0, 2\\)"),  # short
        ([linf([0, 1], 0.5), linf([1, 2], 0.1)], 2, "has \\[3\\] inputs"),  # n is not the slice's
        ([linf([0, 1], 0.5), linf([1, 3], 0.1, 0.1, sl="other")], 3, "another quantity"),
        ([linf([0, 1], 0.5), linf(None, 0.1, 0.1)], 3, "carries no rows"),
        ([linf([0, 1], 0.5), linf([1, 3], 0.1)], 3, "one entry per row"),
    ]:
        with pytest.raises(RuleError, match=why):
            rule.conclude(premises, {"n": n}, ctx)


def test_a_chunk_alone_cannot_decide_the_slice() -> None:
    with pytest.raises(RuleError, match="concat-rows"):
        get_rule("aggregate").conclude([linf([0, 1], 0.5)], {"stat": "max"}, RuleContext())


def test_top1_from_margin_needs_bounds_and_state_of_the_same_rows() -> None:
    ctx = ctx_for((1, 3))
    st = chain(ctx, (1, 3), (1, 3))
    ok = get_rule("top1-from-margin").conclude([linf([1, 3], 0.1, 0.1), st], {}, ctx)
    assert ok["rows"] == [1, 3]
    with pytest.raises(RuleError, match="different slices or rows"):
        get_rule("top1-from-margin").conclude([linf([0, 2], 0.1, 0.1), st], {}, ctx)
