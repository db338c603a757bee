"""Hand-computed cases of the joint QuantizeLinear / DequantizeLinear rules (bounds/rules/qdq.py)."""

from __future__ import annotations

import pytest
import torch

from kcverify.bounds.box import Box, Concrete
from kcverify.bounds.qdq_graph import JOINT_DOMAIN
from kcverify.bounds.registry import RuleCtx
from kcverify.bounds.rules.qdq import dequantize_linear, quantize_linear
from kcverify.errors import BoundError
from kcverify.kernels.spec import parse_kernel_spec
from kcverify.models.ir import Node

F = torch.float64
SPEC = parse_kernel_spec("k", {"compute": "fp32"})


def _ctx(op: str, domain: str = JOINT_DOMAIN, **attrs: int) -> RuleCtx:
    a = {"axis": 1, "block_size": 0, "qtype": 3, "stype": 1, "saturate": 1, **attrs}
    return RuleCtx(Node("n", op, ("x", "s", "z"), ("y",), a, domain), SPEC, SPEC, set())


def _point(v: list[float]) -> Box:
    t = torch.tensor(v, dtype=F)
    z = torch.zeros_like(t)
    return Box(t, t.clone(), t.clone(), t.clone(), z, z.clone())


def test_int8_pair_rounds_exactly_and_covers_both_neighbours_at_a_midpoint() -> None:
    s, z = Concrete(torch.tensor(0.5, dtype=F)), Concrete(torch.tensor(0, dtype=torch.int8))
    q = quantize_linear(_ctx("QuantizeLinear"), _point([0.74, 1.25, 100.0, -100.0]), s, z)
    assert q.il.tolist()[:1] == [1.0] and q.ih.tolist()[:1] == [1.0]  # 1.48 -> 1
    assert (q.il[1].item(), q.ih[1].item()) == (2.0, 3.0)  # 2.5: fp32 quotient may tie either way
    assert (q.il[2].item(), q.il[3].item()) == (127.0, -128.0)  # saturated
    y = dequantize_linear(_ctx("DequantizeLinear"), q, s, z)
    assert y.tl[0].item() == pytest.approx(0.74) and y.il[0].item() == 0.5
    assert y.dl[0].item() == pytest.approx(-0.24) and y.dh[0].item() == pytest.approx(-0.24)
    assert y.dl[2].item() == pytest.approx(63.5 - 100.0)  # saturation: the whole error


def test_a_float8_cast_and_a_weight() -> None:
    s = Concrete(torch.tensor(2.0, dtype=F))
    ctx = _ctx("QuantizeLinear", qtype=17)
    q = quantize_linear(ctx, _point([2 * 17.0, 2 * 1000.0]), s, None)
    assert q.il.tolist() == [16.0, 448.0] and q.ih.tolist() == [18.0, 448.0]  # 17: a tie
    w = Concrete(torch.tensor([[0.3]], dtype=torch.float32))
    dq = dequantize_linear(_ctx("DequantizeLinear"), Concrete(torch.tensor([[1.0]], dtype=F)),
                           Concrete(torch.tensor(0.25, dtype=F)), None, w)
    assert dq.il.item() == pytest.approx(0.25, abs=1e-15) and dq.tl.item() == pytest.approx(0.3)


def test_outside_the_joint_graph_and_dynamic_scales_are_refused() -> None:
    s = Concrete(torch.tensor(0.5, dtype=F))
    with pytest.raises(BoundError, match="bounded as the inference kernel of its float model"):
        quantize_linear(_ctx("QuantizeLinear", domain=""), _point([1.0]), s, None)
    with pytest.raises(BoundError, match="only constant scales"):
        quantize_linear(_ctx("QuantizeLinear"), _point([1.0]), _point([0.5]), None)
    with pytest.raises(BoundError, match="positive finite"):
        quantize_linear(_ctx("QuantizeLinear"), _point([1.0]), Concrete(torch.tensor(-1.0)), None)
