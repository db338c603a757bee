"""One rule table for every domain, and the product a Method names (issue 14's architecture):
registration through the one decorator and its aliases, zonotope.py's own rules read through
the table, Method values by name (what block records carry), and the product sharper than the
intervals."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from kcverify.bounds import DiffBox, Region, bound_block, certify_drift
from kcverify.bounds.engine import (
    DOMAIN_NAMES,
    METHODS,
    Method,
    load_rules,
    whole_graph,
)
from kcverify.bounds.linear import LINEAR_RULES
from kcverify.bounds.registry import (
    ATTRS,
    DOMAINS,
    RULES,
    SYMBOLIC,
    ZONOTOPE,
    Domain,
    linear_rule,
    rule,
    zrule,
)
from kcverify.errors import BoundError
from kcverify.kernels.spec import parse_kernel_spec
from kcverify.models.ir import from_onnx

TRAIN = parse_kernel_spec("train", {"compute": "fp32", "accumulate": "fp32"})
W8 = parse_kernel_spec("inf", {"weights": {"format": "fp8_e4m3", "scale": "per_channel"},
                               "accumulate": "fp32", "compute": "fp32"})


def _mlp():
    rng = np.random.default_rng(0)
    w1 = (rng.normal(size=(8, 6)) * 0.5).astype(np.float32)
    w2 = (rng.normal(size=(6, 3)) * 0.5).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "w2"], ["y"], name="mm2")]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                      ["n", 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    return from_onnx(m, "mlp"), rng.normal(size=(1, 8)).astype(np.float32)


def test_domains_follow_the_protocol_and_share_one_table() -> None:
    load_rules()
    assert set(DOMAINS) == {"interval", "symbolic", "zonotope"}
    assert all(isinstance(d, Domain) for d in DOMAINS.values())
    assert {d for (_op, d) in RULES} == set(DOMAINS)
    # zonotope.py's own rules (zrule / ZRULES) are read through the table
    from kcverify.bounds.zonotope import ZRULES

    assert ZONOTOPE.transfer("Softmax") is ZRULES["Softmax"]
    assert SYMBOLIC.transfer("Gemm") is LINEAR_RULES["Gemm"] is RULES[("Gemm", "symbolic")]
    assert SYMBOLIC.transfer("Softmax") is None


def test_one_decorator_and_its_aliases_register_in_the_table() -> None:
    from kcverify.bounds.zonotope import ZRULES

    def fn(*a):  # noqa: ANN002, ANN202
        return None
    keys = [("KcvTestOp", "interval"), ("KcvTestOp", "symbolic"), ("KcvTestOp", "zonotope")]
    try:
        rule("KcvTestOp", attrs={"mode": ("a",)})(fn)
        linear_rule("KcvTestOp")(fn)
        zrule("KcvTestOp", attrs=("k",))(fn)
        assert all(RULES[k] is fn for k in keys)
        assert ZRULES["KcvTestOp"] is fn  # what ZonoTrack.step reads
        assert ATTRS[keys[0]] == {"mode": ("a",)} and ATTRS[keys[1]] == {}
        assert ATTRS[keys[2]] == {"k": None}
    finally:
        for k in keys:
            RULES.pop(k, None)
            ATTRS.pop(k, None)
        ZRULES.pop("KcvTestOp", None)


def test_methods_by_name() -> None:
    assert set(METHODS) == set(DOMAIN_NAMES)
    best = Method.of("best")
    assert best.domains == ("interval", "symbolic", "zonotope") and best.cut == "segments"
    assert Method.of("linear").cut == "whole" and Method.of(best) is best
    assert Method.of("zonotope").domains == ("interval", "zonotope")
    assert Method.of("separate").separate and str(best) == "best"
    with pytest.raises(BoundError, match="unknown bound domain 'bestest'"):
        Method.of("bestest")


def test_a_record_names_the_method_the_checker_reruns() -> None:
    g, x = _mlp()
    res = certify_drift(g, TRAIN, W8, {"x": x}, region=Region(eps=0.05), domain="linear")
    (rec,) = res.blocks
    assert rec.method == "linear" and rec.method_value is METHODS["linear"]
    block = whole_graph(g)[0]
    assert rec.digest == block.digest
    for how in (rec.method, rec.method_value):  # a name and the value re-run alike
        out = bound_block(block, TRAIN, W8, rec.in_state, how)
        assert all(np.array_equal(a, b) for a, b in zip(out["y"].arrays(),
                                                        rec.out_state["y"].arrays()))


@pytest.mark.parametrize("method", ["linear", "best"])
def test_the_product_is_sharper_than_intervals_on_a_region(method: str) -> None:
    """Each relational domain meets its result with the box of its node; end to end the
    product's drift is narrower (not necessarily inside: later interval rules read the tighter
    boxes, and they are not inclusion-monotone after outward rounding)."""
    g, x = _mlp()
    region = Region(eps=0.05)
    box = certify_drift(g, TRAIN, W8, {"x": x}, region=region, domain="interval",
                        cut="whole").outputs["y"]
    prod = certify_drift(g, TRAIN, W8, {"x": x}, region=region, domain=method,
                         cut="whole").outputs["y"]
    assert isinstance(prod, DiffBox)
    assert prod.arrays()[5].max() - prod.arrays()[4].min() \
        < box.arrays()[5].max() - box.arrays()[4].min()
