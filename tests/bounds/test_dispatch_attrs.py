"""The dispatcher refuses a node carrying an attribute, or an attribute value, that its rule does
not declare (registry.check_attributes): one BoundError naming the node, the op and the
attribute, where rules used to ignore it (a Gelu with an unknown ``approximate`` was bounded as
the erf form; an Add with a legacy ``broadcast`` attribute as a plain Add)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from kcverify.bounds import Region, certify_drift
from kcverify.bounds.engine import load_rules
from kcverify.bounds.registry import ATTRS, EXECUTOR, RULES
from kcverify.errors import BoundError
from kcverify.kernels.spec import parse_kernel_spec
from kcverify.models.ir import from_onnx

TRAIN = parse_kernel_spec("train", {"compute": "fp32", "accumulate": "fp32"})
INF = parse_kernel_spec("inf", {"compute": "bf16", "accumulate": "fp32"})


def _graph(op: str, n_in: int = 1, opset: int = 20, **attrs):
    names = [f"x{k}" for k in range(n_in)]
    ins = [helper.make_tensor_value_info(nm, TensorProto.FLOAT, [1, 4]) for nm in names]
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    node = helper.make_node(op, names, ["y"], name="n0", **attrs)
    g = helper.make_graph([node], op, ins, [out])
    return from_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]), op)


def _feeds(n_in: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {f"x{k}": rng.normal(size=(1, 4)).astype(np.float32) for k in range(n_in)}


@pytest.mark.parametrize("domain", ["interval", "best"])
def test_an_unhandled_attribute_value_is_refused(domain: str) -> None:
    g = _graph("Gelu", approximate="fast")
    with pytest.raises(BoundError) as e:
        certify_drift(g, TRAIN, INF, _feeds(1), region=Region(eps=0.01), domain=domain)
    msg = str(e.value)
    assert "Gelu" in msg and "'n0'" in msg and "'approximate'" in msg and "'fast'" in msg


@pytest.mark.parametrize("domain", ["interval", "linear", "zonotope"])
def test_an_undeclared_attribute_is_refused(domain: str) -> None:
    g = _graph("Add", 2, broadcast=1)
    with pytest.raises(BoundError) as e:
        certify_drift(g, TRAIN, INF, _feeds(2), region=Region(eps=0.01), domain=domain)
    msg = str(e.value)
    assert "Add node 'n0'" in msg and "'broadcast'" in msg and "handled: none" in msg


def test_declared_attributes_and_values_are_bounded() -> None:
    for approx in ("none", "tanh"):
        g = _graph("Gelu", approximate=approx)
        res = certify_drift(g, TRAIN, INF, _feeds(1), region=Region(eps=0.01), domain="best")
        assert np.isfinite(res.linf).all() and (res.linf > 0).all()
    g = _graph("Softmax", axis=-1)
    assert np.isfinite(certify_drift(g, TRAIN, INF, _feeds(1), domain="zonotope").linf).all()


def test_every_rule_declares_its_attributes() -> None:
    load_rules()
    undeclared = sorted(k for k in RULES if k not in ATTRS)
    assert not undeclared, f"rules without an attribute declaration: {undeclared}"
    for key, spec in ATTRS.items():
        assert spec == EXECUTOR or isinstance(spec, dict), (key, spec)


@pytest.mark.parametrize("keepdims,shape", [(0, (1,)), (1, (1, 1)), (2, None)])
def test_reduce_keepdims_values(keepdims: int, shape) -> None:
    """keepdims is 0 or 1: onnxruntime reads 2 as 0 (drops the axis) where the rule read it as
    true (kept it), so 2 is refused with one line."""
    g = _graph("ReduceSum", opset=11, axes=[1], keepdims=keepdims)
    x = {"x0": np.arange(4, dtype=np.float32)[None]}
    if shape is None:
        with pytest.raises(BoundError, match="'keepdims' = 2"):
            certify_drift(g, TRAIN, INF, x, domain="interval")
    else:
        assert certify_drift(g, TRAIN, INF, x, domain="interval").outputs["y"].shape == shape
