"""Session 7's findings, one minimal reproducer each (/work/notes/s7/adv_findings.md), marked
xfail(strict=True) while open: the day a fix lands the test passes, strict xfail fails, and the
mark comes off. onnxruntime (fp32, optimizations off) is the conforming training program."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from kcverify.bounds import Region, certify_drift
from kcverify.errors import KcverifyError
from tests.soundness.adversarial.harness import TRAIN, chain_model, graph_of, node_model


def _ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    s = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return [np.asarray(r, np.float64) for r in s.run(None, feeds)]


@pytest.mark.parametrize("domain", ["interval", "best"])
def test_f1_castlike_to_fp16_rounds(domain: str) -> None:
    """CastLike(x, an fp16 tensor) then Cast(float): every program rounds x to fp16 there
    (onnxruntime: 2.341796875 for x = 2.3410372734069824), but the CastLike rule returns its
    input unchanged (rules/shape.cast_like), and the Cast back to float is exact: the train
    box is the point [2.3410372734069824] and misses the value."""
    nodes = [helper.make_node("CastLike", ["x", "like"], ["h"], name="cl"),
             helper.make_node("Cast", ["h"], ["y"], to=TensorProto.FLOAT, name="back")]
    m = chain_model(nodes, [("x", (1, 2)), ("like", np.zeros(1, np.float16))], ["y"], opset=19)
    x = np.array([[2.3410372734069824, -0.1]], np.float32)
    ref = _ort(m, {"x": x})[0]
    assert ref[0, 0] == 2.341796875
    box = certify_drift(graph_of(m), TRAIN, TRAIN, {"x": x}, domain=domain).outputs["y"]
    tl, th = box.arrays()[:2]
    assert np.all((tl <= ref) & (ref <= th)), (tl, th, ref)


@pytest.mark.parametrize("domain", ["interval", "best"])
def test_f3_leakyrelu_negative_alpha_region(domain: str) -> None:
    """LeakyRelu(alpha = -0.5) over the box [-0.5, 1.5] (x = 0.5, linf eps 1): the rule takes
    the function as monotone ([f(lo), f(hi)] = [0.25, 1.5]), but x = 0 is in the box and every
    program gives 0 there. (All-negative boxes give lo > hi: InternalError.)"""
    m = node_model("LeakyRelu", [("x", (1, 1))], {"alpha": -0.5}, opset=16)
    x = np.array([[0.5]], np.float32)
    box = certify_drift(graph_of(m), TRAIN, TRAIN, {"x": x}, region=Region("input", "linf", 1.0),
                        domain=domain).outputs["y0"]
    ref = _ort(m, {"x": np.zeros((1, 1), np.float32)})[0]
    tl, th = box.arrays()[:2]
    assert np.all((tl <= ref) & (ref <= th)), (tl, th, ref)


def _refused_or_bounded(fn) -> None:
    """A refusal must be a KcverifyError (one line); an InternalError or a KeyError is a bug."""
    try:
        fn()
    except KcverifyError as e:
        assert "\n" not in str(e).strip()


def test_f2_gemm_transA_on_batched_activation_is_not_a_crash() -> None:
    """Gemm(a, w, transA=1) with the graph input a of shape (6, 2) (axis 0 the batch: the
    product mixes the samples). Either bounded or refused with one line; the interval rule
    instead meets two enclosures into nothing: InternalError 'two enclosures disagree, a
    soundness bug' (exit 3 from the CLI)."""
    from tests.soundness.adversarial.test_s7_attrs import FP8

    rng = np.random.default_rng(3)
    w = (rng.normal(size=(6, 4)) * 0.5).astype(np.float32)
    m = node_model("Gemm", [("a", (6, 2)), ("w", w)], {"transA": 1}, opset=13)
    a = rng.normal(size=(6, 2)).astype(np.float32)
    _refused_or_bounded(lambda: certify_drift(graph_of(m), TRAIN, FP8, {"a": a},
                                              domain="interval"))


def test_f4_layernorm_mean_output_is_not_a_crash() -> None:
    """LayerNormalization with its optional Mean and InvStdDev outputs as graph outputs: the
    engine raises KeyError('y1') (no state for them) instead of bounding or refusing."""
    g = np.ones(8, np.float32)
    m = node_model("LayerNormalization", [("x", (1, 8)), ("g", g)], {}, opset=17, n_out=3)
    x = np.linspace(-1, 1, 8, dtype=np.float32)[None]
    _refused_or_bounded(lambda: certify_drift(graph_of(m), TRAIN, TRAIN, {"x": x},
                                              domain="interval"))


def test_f5_bfloat16_initializer_is_not_a_crash() -> None:
    """CastLike(x, like) with ``like`` a bfloat16 initializer (ml_dtypes, as onnx's
    numpy_helper reads it): engine.run_graph's torch.as_tensor raises TypeError ("can't convert
    np.ndarray of type ml_dtypes.bfloat16") - neither a bound nor a refusal line."""
    import ml_dtypes

    nodes = [helper.make_node("CastLike", ["x", "like"], ["h"], name="cl"),
             helper.make_node("Cast", ["h"], ["y"], to=TensorProto.FLOAT, name="back")]
    m = chain_model(nodes, [("x", (1, 2)), ("like", np.zeros(1, ml_dtypes.bfloat16))], ["y"],
                    opset=19)
    x = np.array([[2.3410372734069824, -0.1]], np.float32)
    _refused_or_bounded(lambda: certify_drift(graph_of(m), TRAIN, TRAIN, {"x": x},
                                              domain="interval"))


@pytest.mark.parametrize("domain", ["interval", "best"])
def test_f6_gemm_nan_alpha(domain: str) -> None:
    """Gemm(a, w, alpha = NaN): every program (onnxruntime) gives NaN; the box claims
    [-7e-46, 7e-46] in both kernels (the NaN product is lost in the alpha multiplication).
    Sound outcomes: no bound ((-inf, inf), the engine's NaN) or a refusal line."""
    rng = np.random.default_rng(5)
    w = (rng.normal(size=(6, 4)) * 0.5).astype(np.float32)
    m = node_model("Gemm", [("a", (2, 6)), ("w", w)], {"alpha": float("nan")}, opset=13)
    a = rng.normal(size=(2, 6)).astype(np.float32)
    ref = _ort(m, {"a": a})[0]
    assert np.isnan(ref).all()
    try:
        box = certify_drift(graph_of(m), TRAIN, TRAIN, {"a": a}, domain=domain).outputs["y0"]
    except KcverifyError:
        return
    tl, th = box.arrays()[:2]
    assert np.all((tl == -np.inf) & (th == np.inf)), (tl, th)


# attribute values no runtime accepts (onnxruntime: ShapeInferenceError / a NaN result): each
# must be refused with one line; the engine bounds a reinterpretation (axis % rank) or crashes
INVALID = {
    "Softmax-axis5": (lambda: node_model("Softmax", [("x", (1, 3, 5))], {"axis": 5}, opset=13),
                      (1, 3, 5)),
    "LayerNorm-axis5": (lambda: node_model("LayerNormalization",
                                           [("x", (2, 8)), ("g", np.ones(8, np.float32))],
                                           {"axis": 5}, opset=17), (2, 8)),
    "ReduceMean-axes3": (lambda: node_model("ReduceMean", [("x", (2, 6)), ("a", np.array([3]))],
                                            {}, opset=18), (2, 6)),
    "Flatten-axis7": (lambda: node_model("Flatten", [("x", (2, 3, 5))], {"axis": 7}, opset=13),
                      (2, 3, 5)),
    "Slice-step0": (lambda: node_model("Slice", [("x", (2, 7)), ("s", np.array([0])),
                                                 ("e", np.array([5])), ("a", np.array([1])),
                                                 ("st", np.array([0]))], {}, opset=13), (2, 7)),
    "LayerNorm-eps-neg": (lambda: node_model("LayerNormalization",
                                             [("x", (2, 8)), ("g", np.ones(8, np.float32))],
                                             {"epsilon": -1.0}, opset=17), (2, 8)),
    "LeakyRelu-alpha-nan": (lambda: node_model("LeakyRelu", [("x", (2, 6))],
                                               {"alpha": float("nan")}, opset=16), (2, 6)),
}


# axes / steps given as inputs (opset 18 ReduceMean, Slice) are checked by the executor's ops
F7_OPEN: set[str] = set()  # closed: the executor's norm_axis and Slice refuse them


@pytest.mark.parametrize("case", [
    pytest.param(c, marks=pytest.mark.xfail(strict=True, reason="F7 s7: invalid input values"))
    if c in F7_OPEN else c for c in sorted(INVALID)])
def test_f7_invalid_attribute_values_are_refused(case: str) -> None:
    build, shape = INVALID[case]
    m = build()
    x = np.random.default_rng(2).normal(size=shape).astype(np.float32)
    name = m.graph.input[0].name
    with pytest.raises(KcverifyError) as e:
        certify_drift(graph_of(m), TRAIN, TRAIN, {name: x}, domain="interval")
    assert "\n" not in str(e.value).strip()
