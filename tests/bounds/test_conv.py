"""The Conv rule (kcverify/bounds/rules/conv.py) in every domain, by sampling: points and boxes
around them, conforming programs of both kernels (kcverify.kernels.realize: directed and random
roundings, orders, chunkings), and onnxruntime as an independent fp32 program; every observed
value and drift must lie in the certified sets. Plus the geometry against the executor and
onnxruntime, and the refusals (a group, an unknown attribute, per-token scales)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from kcverify.bounds import Region, certify_drift
from kcverify.bounds.rules.conv import col2im, geometry, im2col
from kcverify.errors import BoundError
from kcverify.models.executor import Executor
from kcverify.models.ir import from_onnx
from tests.soundness._helpers import (
    SPECS,
    TRAIN,
    Stats,
    check_contains,
    realizations,
    run,
    sample_box,
)

R = np.random.default_rng(5)
CASES = {  # name: (input shape, weight shape, attributes)
    "strided": ((2, 2, 7, 6), (3, 2, 3, 3), {"strides": [2, 1], "pads": [1, 0, 0, 1],
                                             "dilations": [1, 2]}),
    "same": ((2, 3, 5, 5), (4, 3, 3, 2), {"auto_pad": "SAME_UPPER"}),
    "1d": ((2, 2, 9), (3, 2, 3), {"strides": [2], "pads": [1, 2]}),
}


def conv_model(name: str, bias: bool = True, opset: int = 17, **extra):
    xs, ws, attrs = CASES[name]
    w = (R.normal(size=ws) * 0.4).astype(np.float32)
    inits = [numpy_helper.from_array(w, "w")]
    ins = ["x", "w"]
    if bias:
        inits.append(numpy_helper.from_array((R.normal(size=ws[0]) * 0.1).astype(np.float32), "b"))
        ins.append("b")
    node = helper.make_node("Conv", ins, ["y"], name="conv", **attrs, **extra)
    g = helper.make_graph([node], name, [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                       ["n", *xs[1:]])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 9
    return m, from_onnx(m, name)


def _point(name: str, rng: np.random.Generator) -> np.ndarray:
    return rng.normal(size=CASES[name][0]).astype(np.float32)


@pytest.mark.parametrize("name", sorted(CASES))
def test_unfolding_is_the_executors_conv(name: str) -> None:
    """im2col @ W^T folded back equals the executor's Conv (and onnxruntime's) on random data."""
    import onnxruntime as ort

    m, g = conv_model(name, bias=False)
    x = _point(name, np.random.default_rng(1))
    w = torch.as_tensor(np.array(g.initializers["w"]), dtype=torch.float64)
    from kcverify.bounds.registry import RuleCtx

    ctx = RuleCtx(g.nodes[0], TRAIN, TRAIN, set(g.constant_names()), g.opset)
    geo = geometry(ctx, x.shape, w)
    y = col2im(im2col(torch.as_tensor(x, dtype=torch.float64), geo) @ w.reshape(w.shape[0], -1).T,
               geo)
    ref = Executor(g, dtype=torch.float64).run({"x": x})["y"]
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-12)
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], y.numpy(), rtol=1e-5, atol=1e-5)


def _check(name: str, spec_name: str, domain: str, seed: int, n_real: int) -> Stats:
    import onnxruntime as ort

    m, g = conv_model(name)
    spec = SPECS[spec_name]
    rng = np.random.default_rng(seed)
    x = _point(name, rng)
    stats = Stats()
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    reals_t, reals_i = realizations(TRAIN, n_real, seed), realizations(spec, n_real, seed + 50)
    for region in (None, Region("input", "linf", 0.05)):
        res = certify_drift(g, TRAIN, spec, {"x": x}, region=region, domain=domain)
        box = res.outputs["y"]
        pts = [x] if region is None else sample_box(rng, x, region.eps, 3)
        for p in pts:
            p32 = p.astype(np.float32)  # what onnxruntime and the fp32 kernel store
            for rt, ri in zip(reals_t, reals_i):
                yt, yi = run(g, rt, {"x": p32})["y"], run(g, ri, {"x": p32})["y"]
                check_contains(stats, box, yt.numpy(), yi.numpy(), f"{name}/{spec_name}/{domain}")
            # onnxruntime's fp32 Conv is a conforming training program: its values lie in the
            # training value set (train_lo/hi); against it, the realized inference drift too
            t_ort = sess.run(None, {"x": p32})[0].astype(np.float64)
            a = box.arrays()
            assert np.all((a[0] <= t_ort) & (t_ort <= a[1])), f"onnxruntime outside ({name})"
            check_contains(stats, box, t_ort, run(g, reals_i[0], {"x": p32})["y"].numpy(),
                           f"{name}/{spec_name}/{domain}/onnxruntime")
    return stats


# CI: every case, spec and domain at least once (bf16: compute without casts); the full product
# with more programs is the campaign below
FAST = [("strided", "fp8_bf16", "best"), ("strided", "e5m2_any", "linear"),
        ("same", "e5m2_any", "interval"), ("same", "fp8_bf16", "best"),
        ("1d", "int8_block", "linear"), ("1d", "fp8_bf16", "interval"), ("1d", "bf16", "interval")]


@pytest.mark.parametrize(("name", "spec_name", "domain"), FAST)
def test_conv_sound(name: str, spec_name: str, domain: str) -> None:
    stats = _check(name, spec_name, domain, seed=3, n_real=3)
    assert not stats.violations, "\n".join(stats.violations[:5])
    assert stats.pairs > 0


@pytest.mark.campaign  # 36 runs, ~4 min on the 2-core sandbox
@pytest.mark.parametrize("domain", ["interval", "best", "linear"])
@pytest.mark.parametrize("spec_name", ["fp8_bf16", "e5m2_any", "int8_block", "bf16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_conv_sound_slow(name: str, spec_name: str, domain: str) -> None:
    stats = _check(name, spec_name, domain, seed=17, n_real=8)
    assert not stats.violations, "\n".join(stats.violations[:5])


def test_relational_domains_are_no_looser_and_sharp_on_weight_only() -> None:
    """best / linear meet the interval box, so they are never looser; on a point with weight-only
    fp8 the certified drift is within a small factor of the realized one."""
    from kcverify.kernels.spec import parse_kernel_spec

    w8 = parse_kernel_spec("inf", {"weights": {"format": "fp8_e4m3", "scale": "per_channel"},
                                   "accumulate": "fp32", "compute": "fp32"})
    _, g = conv_model("strided")
    x = _point("strided", np.random.default_rng(9))
    got = {d: certify_drift(g, TRAIN, w8, {"x": x}, domain=d).linf for d in
           ("interval", "best", "linear")}
    assert np.all(got["best"] <= got["interval"]) and np.all(got["linear"] <= got["interval"])
    worst = 0.0
    for rt, ri in zip(realizations(TRAIN, 4, 1), realizations(w8, 4, 2)):
        d = run(g, ri, {"x": x})["y"].numpy() - run(g, rt, {"x": x})["y"].numpy()
        worst = max(worst, float(np.abs(d).max()))
    assert 0 < worst <= float(got["interval"].max()) <= 1.05 * worst


def test_refusals_name_the_node() -> None:
    _, g = conv_model("strided", group=1)
    x = _point("strided", np.random.default_rng(0))
    certify_drift(g, TRAIN, TRAIN, {"x": x}, domain="interval")  # group 1 is fine
    m, _ = conv_model("strided")
    m.graph.node[0].attribute.append(helper.make_attribute("fancy", 1))
    with pytest.raises(BoundError, match=r"Conv node 'conv'.*attribute 'fancy'"):
        certify_drift(from_onnx(m, "c"), TRAIN, TRAIN, {"x": x}, domain="interval")
    with pytest.raises(BoundError, match=r"Conv node 'conv'.*dynamic_per_token"):
        certify_drift(g, TRAIN, SPECS["fp8_fp32"], {"x": x}, domain="interval")
