"""Violations this suite found beyond issue 11's list, each a minimal reproducer: a conforming
program (or a real runtime that must conform) outside the certified sets. 1-9 failed on the
code they were found on (marked xfail strict there) and pass since e3ce798 / 019c83c / 98c8b53,
which fixed them at their causes: regression tests now. An open one carries
``xfail(strict=True)`` until its fix lands, and its combination is listed in
rulecases.OPEN_FINDINGS (skipped by the generic sweeps) until then.

1. ``Cast`` to float16 / bfloat16 is bounded as the identity ("the kernel stores tensors in
   its compute format anyway"), but a runtime executing the graph rounds there: onnxruntime's
   fp32 run of Cast(fp16) -> Cast(fp32) lies outside the certified training value (a point
   interval that ignores the rounding), as does every conforming program that executes the
   graph's Cast.
2. A standalone ReduceSum accumulated in fp16 in a conforming order overflows in a partial sum
   (40000 + 40000 = inf) although the exact sum (10010) is in range: the rule bounds the final
   value only.
3. LayerNorm in fp16 compute: the spec stores a row sum in the compute format ("then stored in
   the compute format with ulps["reduce"]"); the sum of squares of a row with n sigma^2 > 65504
   overflows there (inf, then r = 0, y = b), outside the certified interval.
4. ``rounding: any`` with a dynamic e5m2 scale: fl32(amax / 57344) may round down, so the amax
   element's quotient exceeds 57344; rounded toward -inf / +inf (a neighbour, IEEE's overflow
   rule) it becomes an infinity, and the MatMul's output NaN; the engine assumes a dynamic
   scale cannot overflow.
5. Overflow in the compute format (fp16: 40000 + 30000 = inf): the interval domain's drift
   interval stays finite although the value interval admits inf; ``best`` (the zonotope) even
   certifies a finite value interval beyond 65504.
6. A static activation scale whose quotient overflows: NaN inside the MatMul rule; a Gemm with
   alpha and a bias then certifies the bias alone as a point (plain MatMul: InternalError).
7. fp16 underflow to 0: a divisor (1e-9) or LayerNorm's var + eps (BERT's eps = 1e-12 on a
   constant row): 0/0 or 0 * inf = NaN, certified finite.
8. (minor) A fully masked softmax row: NaN in torch / onnxruntime, value interval [-eta, inf].
9. Sigmoid below -36.7 in a bf16 kernel: the derivative enclosure s (1 - s) cancels to 0 in
   float64, the drift is certified ~14x too small on a box (found by the campaign as an
   InternalError at a point; fixed in 98c8b53).
10. ReduceMean in fp16: the sum stored in the compute format before the division overflows
    (fixed in 989cb01).
11. (minor) Both kernels certainly overflow (exp of 5e3): the drift interval is [inf, inf]
    (fp16) or [-inf, -inf] (bf16) (fixed in f2ec145: the same infinity is drift 0).
12. A static activation scale that may overflow, on a region: the interval domain says inf, the
    linear domain (symbolic intervals) certifies the unsaturated product, and ``best`` keeps
    it (fixed in 4dff158).
13. A softmax row holding +inf (fp16 storage or logits overflowing): NaN in every runtime,
    certified finite (found by the campaign; fixed in b5f3a06).

Each test names the smallest input that shows it.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from tests.soundness.adversarial.harness import (
    SESSION,
    TRAIN,
    Ledger,
    Runtime,
    attack,
    certify,
    chain_model,
    graph_of,
    node_model,
    ratio_text,
    spec,
)
from tests.soundness.adversarial.programs import Program


def _ok(led: Ledger, cls: str, found: list[str]) -> None:
    SESSION.merge(led)
    assert not found, ratio_text(led[cls])


def _ort(model: onnx.ModelProto) -> Runtime:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in model.graph.output]
    return Runtime("onnxruntime", lambda f: dict(zip(names, sess.run(None, f))))


def test_cast_to_float16_rounds() -> None:
    led = Ledger()
    nodes = [helper.make_node("Cast", ["x"], ["h"], to=onnx.TensorProto.FLOAT16),
             helper.make_node("Cast", ["h"], ["y"], to=onnx.TensorProto.FLOAT)]
    model = chain_model(nodes, [("x", (1, 4))], ["y"])
    x = np.array([[0.1, 1 / 3, 1000.1, 3e-6]], np.float32)
    found = attack(led, "finding/cast-fp16", model, TRAIN, TRAIN, {"x": x},
                   [(_ort(model), Program(TRAIN))], domain="best")
    _ok(led, "finding/cast-fp16", found)


def test_reduce_sum_partial_sum_overflow_in_fp16() -> None:
    led = Ledger()
    f16 = spec(compute="fp16", accumulate="fp16")
    model = node_model("ReduceSum", [("x", (1, 8)), ("axes", np.array([1]))], {"keepdims": 0},
                       opset=13)
    x = np.array([[40000, 40000, -40000, -30000, 1, 2, 3, 4]], np.float32)
    found = attack(led, "finding/reduce-overflow", model, TRAIN, f16, {"x": x},
                   [(Program(TRAIN), Program(f16, order="seq"))], domain="best")
    _ok(led, "finding/reduce-overflow", found)


def test_layernorm_row_sum_stored_in_fp16_overflows() -> None:
    led = Ledger()
    f16 = spec(compute="fp16", accumulate="fp32")
    n = 1024
    model = node_model("LayerNormalization", [("x", (1, n)), ("g", np.ones(n, np.float32)),
                                              ("b", np.zeros(n, np.float32))],
                       {"axis": -1}, opset=17)
    x = (9.0 * np.random.default_rng(0).normal(size=(1, n))).astype(np.float32)  # n s^2 ~ 83000
    found = attack(led, "finding/ln-fp16-sum", model, TRAIN, f16, {"x": x},
                   [(Program(TRAIN), Program(f16, ln_form="two_pass"))], domain="best")
    _ok(led, "finding/ln-fp16-sum", found)


def test_rounding_any_dynamic_scale_overflow() -> None:
    led = Ledger()
    e5 = spec(activations={"format": "fp8_e5m2", "scale": "dynamic_per_tensor"},
              accumulate="fp32", compute="fp32", rounding="any")
    rng = np.random.default_rng(1)
    w = (0.5 * rng.normal(size=(16, 8))).astype(np.float32)
    model = node_model("MatMul", [("x", (1, 16)), ("w", w)])
    x = (rng.normal(size=(1, 16))).astype(np.float32)
    x[0, 0] = -2.3  # the amax: fl32(2.3 / 57344) rounds down, so 2.3 / s > 57344
    prog = Program(e5, cast_rounding="down", sat=False)
    found = attack(led, "finding/any-overflow", model, TRAIN, e5, {"x": x},
                   [(Program(TRAIN), prog)], domain="best")
    _ok(led, "finding/any-overflow", found)


@pytest.mark.parametrize("domain", ["interval", "best"])
def test_overflow_in_the_compute_format(domain: str) -> None:
    """fp16 compute, 40000 + 30000 = 70000 > 65504: the program's sum is inf. interval: the value
    interval admits inf, the drift interval stays [-34, 34]; best: the value interval itself is
    [69966, 70034], values no fp16 program can produce (the zonotope has no overflow)."""
    led = Ledger()
    f16 = spec(compute="fp16", accumulate="fp32")
    found = []
    for op, ins, feeds in (
            ("Add", [("x", (1, 2)), ("y", (1, 2))],
             {"x": np.array([[40000, 30000]], np.float32), "y": np.array([[30000, 35000]], np.float32)}),
            ("Mul", [("x", (1, 2)), ("y", (1, 2))],
             {"x": np.array([[300, 400]], np.float32), "y": np.array([[300, 200]], np.float32)}),
            ("Exp", [("x", (1, 2))], {"x": np.array([[11.1, 12.0]], np.float32)})):
        found += attack(led, "finding/fp16-overflow", node_model(op, ins), TRAIN, f16, feeds,
                        [(Program(TRAIN), Program(f16))], domain=domain)
    _ok(led, "finding/fp16-overflow", found)


def test_static_scale_overflow_in_gemm() -> None:
    """A static activation scale 0.02 and an input 10: 10 / 0.02 = 500 > 448, the cast
    saturates (or gives NaN). The MatMul rule's value is NaN inside the Gemm rule, and with
    alpha != 1 and a bias the certified inference value is the bias alone, a point (1.0), while
    a saturating program computes 4.165. (A plain MatMul / Gemm raises InternalError instead of
    the documented infinite bound.)"""
    led = Ledger()
    st = spec(activations={"format": "fp8_e4m3", "scale": "static", "value": 0.02},
              accumulate="fp32", compute="fp32")
    w = np.array([[0.5], [-0.25]], np.float32)
    model = node_model("Gemm", [("x", (1, 2)), ("w", w), ("c", np.array([1.0], np.float32))],
                       {"alpha": 0.75})
    found = attack(led, "finding/static-overflow", model, TRAIN, st,
                   {"x": np.array([[10.0, 1.0]], np.float32)},
                   [(Program(TRAIN), Program(st)), (Program(TRAIN), Program(st, sat=False))],
                   domain="best")
    _ok(led, "finding/static-overflow", found)


def test_underflow_to_zero_in_fp16() -> None:
    """fp16 stores 1e-9 as 0: x / y is 0/0 = NaN (or 1/0 = inf); and a LayerNorm with BERT's
    eps = 1e-12 on a constant row: var = 0, var + eps is 0 in fp16 (or 1e-12 in fp32, whose
    rsqrt 1e6 overflows fp16), r = inf, (x - mu) r = 0 * inf = NaN. Certified finite."""
    led = Ledger()
    f16 = spec(compute="fp16", accumulate="fp32")
    found = attack(led, "finding/fp16-underflow", node_model("Div", [("x", (1, 2)), ("y", (1, 2))]),
                   TRAIN, f16, {"x": np.array([[1e-9, 1.0]], np.float32),
                                "y": np.array([[1e-9, 1e-9]], np.float32)},
                   [(Program(TRAIN), Program(f16))], domain="best")
    n = 16
    ln = node_model("LayerNormalization", [("x", (1, n)), ("g", np.ones(n, np.float32)),
                                           ("b", np.zeros(n, np.float32))],
                    {"axis": -1, "epsilon": 1e-12}, opset=17)
    found += attack(led, "finding/fp16-underflow", ln, TRAIN, f16,
                    {"x": np.full((1, n), 0.5, np.float32)},
                    [(Program(TRAIN), Program(f16, ln_form=f)) for f in ("two_pass", "two_pass_acc")],
                    domain="best")
    _ok(led, "finding/fp16-underflow", found)


def test_fully_masked_softmax_row() -> None:
    """A row of -inf (a padding row under an additive -inf mask): torch, onnxruntime and every
    program that subtracts its row max compute (-inf) - (-inf) = NaN. Certified: values in
    [-eta, inf] (not the no-bound (-inf, inf) that NaN needs); the drift is (-inf, inf), so no
    finite linf is claimed. Minor, but a value interval that excludes what runtimes return."""
    import torch

    led = Ledger()
    model = node_model("Softmax", [("x", (1, 2, 4))], {"axis": -1}, opset=13)
    x = np.array([[[-np.inf] * 4, [0, 1, -np.inf, 2]]], np.float32)
    torch_sm = Runtime("torch.softmax", lambda f: {
        "y0": torch.softmax(torch.from_numpy(f["x"]), -1).numpy()})
    found = attack(led, "finding/masked-row", model, TRAIN, TRAIN, {"x": x},
                   [(torch_sm, _ort(model))], domain="best")
    _ok(led, "finding/masked-row", found)


def test_sigmoid_far_negative_in_bf16() -> None:
    """Sigmoid's derivative enclosure is s (1 - s) with s = sigmoid(|x|): 1 - s is 0 in float64
    for |x| > 36.7, so the mean-value drift of a bf16 kernel (whose input storage moves x by up
    to 2^-8 |x|) is dropped. On an L-inf box around -40 the certified drift is ~14x too small
    (silently); at a point the two enclosures disagree and the rule raises InternalError. SiLU
    (x sigmoid(x)) in bf16 inherits it."""
    from kcverify.bounds import Region, certify_drift
    from tests.soundness.adversarial.attacks import box_points
    from tests.soundness.adversarial.harness import graph_of
    from tests.soundness.adversarial.interp import ProgramRunner

    led = Ledger()
    bf = spec(compute="bf16", accumulate="fp32")
    model = node_model("Sigmoid", [("x", (1, 4))])
    x = np.full((1, 4), -40.0, np.float32)
    boxes = certify_drift(graph_of(model), TRAIN, bf, {"x": x},
                          region=Region("input", "linf", 0.5), domain="best").outputs
    run = ProgramRunner(model)
    found = []
    for pt in box_points(np.random.default_rng(0), x, 0.5, 6):
        yt, yi = run(Program(TRAIN), {"x": pt}), run(Program(bf), {"x": pt})
        found += led.check("finding/sigmoid", boxes["y0"], yt["y0"], yi["y0"], "sigmoid -40")
    found += attack(led, "finding/sigmoid", model, TRAIN, bf,
                    {"x": np.array([[-38.79393387, -45.2, -60.7, 35.0]], np.float32)},
                    [(Program(TRAIN), Program(bf))], domain="best")
    _ok(led, "finding/sigmoid", found)


@pytest.mark.parametrize("domain", ["interval", "linear", "best"])
def test_reduce_mean_stored_sum_overflows_in_fp16(domain: str) -> None:
    """The spec stores a reduction's sum in the compute format before the division; in fp16
    30000 + 30000 + 20000 + 10000 = 90000 is inf there, so the mean is inf. Certified
    [22478, 22522] in every domain (finding 3's sibling; e3ce798 fixed LayerNorm's). A row
    whose stored sum stays in range keeps a finite bound."""
    led = Ledger()
    f16 = spec(compute="fp16", accumulate="fp32")
    model = node_model("ReduceMean", [("x", (2, 4)), ("axes", np.array([1]))], {"keepdims": 1},
                       opset=18)
    x = np.array([[30000, 30000, 20000, 10000], [30000, 30000, -20000, 10000]], np.float32)
    found = attack(led, "finding/reduce-mean-fp16", model, TRAIN, f16, {"x": x},
                   [(Program(TRAIN), Program(f16, order=o)) for o in ("seq", "rev")],
                   domain=domain)
    box = certify(graph_of(model), TRAIN, f16, {"x": x}, domain)["y0"]
    assert box.inf_hi[0, 0] == np.inf and np.isfinite(box.linf()[1])
    _ok(led, "finding/reduce-mean-fp16", found)


def test_both_kernels_overflow() -> None:
    """exp(5339.5) is +inf in both kernels (fp32 and fp16); the drift interval was [inf, inf]
    (fp16; [-inf, -inf] in bf16), which no execution satisfies: the project's convention
    (semantics §1.1, kcverify.boxes) counts the same infinity in both kernels as drift 0, so
    the drift interval must hold 0 there (engine.infinite_drift, DiffBox). linf stays inf: no
    finite bound is claimed."""
    led = Ledger()
    f16 = spec(compute="fp16", accumulate="fp32", ulps={"exp": 4})
    x = np.array([[5339.517, 2.0, -5339.517, 0.5], [27194.951, 1.0, 20922.865, -3.0]],
                 np.float32)
    model = node_model("Exp", [("x", (2, 4))])
    found = []
    for sp in (f16, spec(compute="bf16", accumulate="fp32")):
        for domain in ("interval", "linear", "best"):
            found += attack(led, "finding/both-overflow", model, TRAIN, sp, {"x": x},
                            [(Program(TRAIN), Program(sp))], domain=domain)
            assert np.all(certify(graph_of(model), TRAIN, sp, {"x": x}, domain)["y0"].linf()
                          == np.inf)
    _ok(led, "finding/both-overflow", found)


def test_static_scale_overflow_in_the_linear_domain() -> None:
    """Static scale 0.02, x = 10 +- 0.01: 10 / 0.02 = 500 saturates at 448 (8.96). Certified by
    ``linear`` and ``best`` on the box: inference value [4.417, 5.083], drift +-0.325; a
    saturating program computes 4.165 (drift -0.835). interval: inf (right). Now the forms
    tighten a box only where its value sets are finite (linear.tighten)."""
    from kcverify.bounds import Region, certify_drift
    from tests.soundness.adversarial.attacks import box_points
    from tests.soundness.adversarial.interp import ProgramRunner

    led = Ledger()
    st = spec(activations={"format": "fp8_e4m3", "scale": "static", "value": 0.02},
              accumulate="fp32", compute="fp32")
    model = node_model("MatMul", [("x", (1, 2)), ("w", np.array([[0.5], [-0.25]], np.float32))])
    x = np.array([[10.0, 1.0]], np.float32)
    run = ProgramRunner(model)
    found = []
    for domain in ("interval", "linear", "best"):
        boxes = certify_drift(graph_of(model), TRAIN, st, {"x": x},
                              region=Region("input", "linf", 0.01), domain=domain).outputs
        assert boxes["y0"].linf()[0] == np.inf, domain
        for pt in box_points(np.random.default_rng(0), x, 0.01, 3):
            found += led.check("finding/static-linear", boxes["y0"], run(Program(TRAIN), {"x": pt})["y0"],
                               run(Program(st), {"x": pt})["y0"], f"static {domain}")
    _ok(led, "finding/static-linear", found)


@pytest.mark.parametrize("domain", ["interval", "linear", "best"])
def test_softmax_of_an_overflowed_row(domain: str) -> None:
    """fp16 stores 70000 as +inf (and an fp16 MatMul's logits may overflow to +inf: QK^T in
    attention); a softmax row holding +inf is inf - inf = NaN in torch, onnxruntime and every
    program that subtracts its row max. Certified: inference values in [-3e-8, 2.0], drift
    +-1.008 (found by the campaign, kind 'large', spec e5m2_any_fp16). Now no bound on such a
    row (softmax.nan_rows), and only there: the finite row keeps its bound."""
    led = Ledger()
    f16 = spec(compute="fp16", accumulate="fp32")
    sm = node_model("Softmax", [("x", (1, 2, 4))], {"axis": -1}, opset=13)
    x = np.array([[[70000, 1, 2, 3], [-70000, 1, 2, 3]]], np.float32)
    found = attack(led, "finding/softmax-inf", sm, TRAIN, f16, {"x": x},
                   [(Program(TRAIN), Program(f16))], domain=domain)
    box = certify(graph_of(sm), TRAIN, f16, {"x": x}, domain)["y0"]
    assert np.all(np.isfinite(box.drift_hi[0, 1])) and np.all(box.drift_hi[0, 0] == np.inf)
    w = np.full((2, 4), 300.0, np.float32)  # logits up to 2 * 40000 * 300: beyond fp16
    nodes = [helper.make_node("MatMul", ["q", "w"], ["s"]),
             helper.make_node("Softmax", ["s"], ["y"], axis=-1)]
    attn = chain_model(nodes, [("q", (1, 2)), ("w", w)], ["y"], opset=13)
    found += attack(led, "finding/softmax-inf", attn, TRAIN, f16,
                    {"q": np.array([[200.0, 30.0]], np.float32)},
                    [(Program(TRAIN), Program(f16))], domain=domain)
    _ok(led, "finding/softmax-inf", found)
