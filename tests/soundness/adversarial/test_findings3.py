"""Violations found by the session-3 adversary (Conv, the proof by cases, this session's
changes), each a minimal reproducer marked ``xfail(strict=True)`` until its fix lands (then the
mark goes and it stays as a regression test). Numbering continues test_findings2.py's.

22. Conv with a dynamic (``dynamic_per_tensor``) activation scale, where some input element
    is read by no window (a stride larger than the kernel's reach, e.g. ResNet's 1x1 stride-2
    shortcut; or trailing rows / columns a stride leaves over): the rule (kcverify/bounds/rules/conv.py) unfolds the input first and hands the columns to the
    MatMul rule, which takes the scale's amax over the columns, so the elements no window reads
    are not in it. A conforming program (and kcverify's own realizer, kernels/realize.py: "the
    input is cast before padding") scales by the amax of the whole input. 1x1 stride 2 on a
    3 x 3 input whose centre (read by no window) is 100, the read elements ~0.3: the programs'
    scale is fl32(100 / 448), theirs 0.31 -> 0.30692 against a certified [0.30999983,
    0.31000020] in interval, linear and best alike (drift 3.1e-3 against 2.5e-7).
    Fixed (rules/conv.py): the elements no window reads go into extra, dropped columns, so the
    MatMul rule's amax is over the whole input.

Each test builds the smallest graph that shows it and checks it against conforming programs
(programs.py, interp.py; the control beside it is inside).
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.soundness.adversarial.attacks import pairs
from tests.soundness.adversarial.harness import SESSION, TRAIN, Ledger, attack, spec
from tests.soundness.adversarial.programs import Program

E4M3_PC = {"format": "fp8_e4m3", "scale": "per_channel"}


def conv_node_model(x_shape: tuple[int, ...], w: np.ndarray, attrs: dict):
    """One Conv node (no bias), the weight an initializer, opset 17."""
    node = helper.make_node("Conv", ["x", "w"], ["y"], name="conv", **attrs)
    g = helper.make_graph([node], "conv",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(w, "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    return m


def _skip_rows(where: str) -> tuple[np.ndarray, np.ndarray, dict]:
    """(x, w, attrs): the largest |x| at an element no window reads (``skipped``), or at one
    every program reads (``read``: the control)."""
    rng = np.random.default_rng(22)
    x = (0.3 + 0.02 * rng.standard_normal((1, 2, 3, 3))).astype(np.float32)
    x[0, 1, 0, 2] = -0.27
    if where == "skipped":
        x[0, 0, 1, 1] = 100.0  # row 1, column 1: between the stride-2 windows
    else:
        x[0, 0, 2, 2] = 100.0
    w = np.array([[[[1.0]], [[0.5]]], [[[-0.75]], [[0.25]]]], np.float32)  # (2, 2, 1, 1)
    return x, w, {"strides": [2, 2]}


def _run(where: str, acts: str, domain: str) -> list[str]:
    sp = spec(weights=E4M3_PC, activations={"format": "fp8_e4m3", "scale": acts},
              accumulate="fp32", compute="fp32")
    x, w, attrs = _skip_rows(where)
    model = conv_node_model(x.shape, w, attrs)
    led = Ledger()
    found = attack(led, f"findings3/conv-skip-{where}", model, TRAIN, sp, {"x": x},
                   [(Program(TRAIN), Program(sp))] + pairs(TRAIN, sp, 4, 0), domain=domain)
    SESSION.merge(led)
    return found


@pytest.mark.parametrize("domain", ["interval", "linear", "best"])
def test_22_conv_scale_over_the_whole_input(domain: str) -> None:
    found = _run("skipped", "dynamic_per_tensor", domain)
    assert not found, found[0]


@pytest.mark.parametrize("domain", ["interval", "linear", "best"])
def test_22_control_amax_read_by_a_window(domain: str) -> None:
    found = _run("read", "dynamic_per_tensor", domain)
    assert not found, found[0]
