"""The zonotope's per-node trace (zonotope.STEP_TRACE; bench/bounds.py --widths), the tool that
located where MiniLM's bound is lost (docs/bounds.md, "MiniLM-L6"): it must report, for every
output the zonotope kept forms for, the box the engine stored and the forms kept, so that a
width it prints is the width the run had. Checked against the run's own boxes; a hook fed the
wrong box (the interval rule's, before the meet) is caught.
"""

from __future__ import annotations

import pytest
import torch

from kcverify.bounds import zonotope as Z
from tests.bounds.test_zonotope import _block_graph
from tests.bounds.test_zonotope_speed import _graph_boxes


def _traced(monkeypatch: pytest.MonkeyPatch, step=None) -> tuple[dict, dict]:
    seen: dict = {}

    def trace(node, name, box, z) -> None:
        seen[name] = (node.op_type, box, z)

    monkeypatch.setattr(Z, "STEP_TRACE", trace)
    if step is not None:
        monkeypatch.setattr(Z.ZonoTrack, "step", step)
    boxes = _graph_boxes(_block_graph())
    return seen, boxes


def test_step_trace_reports_the_stored_boxes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every traced output's box is the one the run stored, its forms enclose that box (the
    box is their meet with the intervals), and the LayerNormalization output is among them."""
    seen, boxes = _traced(monkeypatch)
    assert seen.get("ln", (None,))[0] == "LayerNormalization"
    assert len(seen) >= 5
    for name, (_, box, z) in seen.items():
        for p, q in zip(box.parts(), boxes[name].parts()):
            assert torch.equal(p, q), name
        tl, th = z.t.bounds()
        dl, dh = z.drift_bounds()
        assert bool((tl <= box.tl).all() and (box.th <= th).all()), name
        assert bool((dl <= box.dl).all() and (box.dh <= dh).all()), name


def test_step_trace_catches_a_wrong_box(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tracker that reports the interval rule's box (before the meet) differs from what the
    run stored on some output: the comparison above can fail."""
    orig = Z.ZonoTrack.step

    def step(self, n, names, ins, results, ctx):
        hook = Z.STEP_TRACE
        Z.STEP_TRACE = None
        try:
            out = orig(self, n, names, ins, results, ctx)
        finally:
            Z.STEP_TRACE = hook
        for o, res in zip(n.outputs, results):  # the boxes before the meet
            if o in self.forms and hook is not None:
                hook(n, o, res, self.forms[o])
        return out

    seen, boxes = _traced(monkeypatch, step)
    assert any(not torch.equal(p, q) for name, (_, box, _z) in seen.items()
               for p, q in zip(box.parts(), boxes[name].parts()))
