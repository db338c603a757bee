"""QDQ inference kernels (docs/qdq.md): every program the certificate covers stays inside it.

For the shipped QDQ graphs of mlp_tiny (kcverify's fp8 export, onnxruntime's int8 quantize_static)
the bound of the joint graph is compared, input by input, with the drift realized by
onnxruntime running the QDQ graph against the training kernel (onnxruntime on the float model,
and realizations in several summation orders), and with the realizer running the QDQ graph.
Inputs: the slice, random points, and adversarial ones - the first activation quantizer's
rounding midpoints (both neighbours must be covered: onnxruntime divides in float32) and
inputs that saturate it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from kcverify.bounds import certify_drift
from kcverify.bounds.qdq_graph import bound_problem
from kcverify.kernels.qdq import ort_session
from kcverify.kernels.realize import run_kernel
from kcverify.kernels.spec import parse_kernel_spec
from kcverify.models.ir import load_onnx

ROOT = Path(__file__).resolve().parents[2]
QDQ = ROOT / "examples" / "qdq"
TRAIN = parse_kernel_spec("train", {"compute": "fp32", "accumulate": "fp32"})
# the rules these tests sample (joint-graph nodes have no single-node case in cases.py: the
# executor runs Q/DQ as the inference kernel only); test_rules' gate counts them as covered
COVERED_OPS = frozenset({"QuantizeLinear", "DequantizeLinear"})


def _inputs(name: str) -> np.ndarray:
    """Slice points, random points, midpoints and saturating inputs of the first quantizer."""
    rng = np.random.default_rng(7)
    pts = np.load(ROOT / "examples" / "data" / "mlp_points.npz")["x"].astype(np.float32)
    gq = load_onnx(QDQ / name)
    q = next(n for n in gq.nodes if n.op_type == "QuantizeLinear" and n.inputs[0] == "x")
    s = float(np.asarray(gq.initializers[q.inputs[1]]).reshape(-1)[0])
    zp = np.asarray(gq.initializers[q.inputs[2]])
    if zp.dtype.kind in "iu":  # integer steps: (k + 1/2) s is a midpoint
        k = rng.integers(-20, 20, (16, 4)).astype(np.float64)
        mid = ((k + 0.5) * s).astype(np.float32)
        top = 127
    else:  # float8 e4m3: the midpoint of two neighbouring grid values, times s
        import ml_dtypes

        g = rng.uniform(0.02, 300, (16, 4)).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
        nxt = np.nextafter(g.astype(ml_dtypes.float8_e4m3fn), np.array(448, ml_dtypes.float8_e4m3fn))
        mid = (0.5 * (g + nxt.astype(np.float64)) * s).astype(np.float32)
        top = 448
    sat = (rng.choice([-1.0, 1.0], (8, 4)) * rng.uniform(1.0, 3.0, (8, 4)) * top * s)
    rand = rng.standard_normal((16, 4)) * np.abs(pts).max()
    return np.concatenate([pts, mid, sat.astype(np.float32), rand.astype(np.float32)])


@pytest.mark.parametrize("name", ["mlp_tiny.fp8.qdq.onnx", "mlp_tiny.int8.qdq.onnx"])
def test_onnxruntime_and_the_realizer_stay_inside_the_certified_drift(name: str) -> None:
    g = load_onnx(ROOT / "models" / "mlp_tiny.onnx")
    inf = parse_kernel_spec("inf", {"onnx": name, "compute": "fp32", "accumulate": "fp32"})
    x = _inputs(name)
    jg, tr, inf_j = bound_problem(g, TRAIN, inf, QDQ)
    bound = certify_drift(jg, tr, inf_j, {"x": x}, domain="interval").linf
    assert np.all(np.isfinite(bound[:64]))
    ort_q = ort_session(onnx.load(QDQ / name)).run(None, {"x": x})[0].astype(np.float64)
    ort_f = ort_session(onnx.load(ROOT / "models" / "mlp_tiny.onnx")).run(None, {"x": x})[0]
    trains = [ort_f.astype(np.float64)] + [
        run_kernel(g, TRAIN, {"x": x}, order=o)["y"].numpy() for o in ("sequential", "reverse")]
    infs = [ort_q] + [run_kernel(g, inf, {"x": x}, base_dir=QDQ, order=o, seed=3)["y"].numpy()
                      for o in ("pairwise", "sorted", "random")]
    worst = np.zeros(len(x))
    for t in trains:
        for i in infs:
            worst = np.maximum(worst, np.abs(i - t).max(axis=1))
    assert np.all(worst <= bound), (worst - bound).max()
    # the bound is sharp on the slice's points, not vacuous: within 1% of onnxruntime's drift
    real = np.abs(ort_q - ort_f).max(axis=1)[:64]
    assert np.all(bound[:64] <= 1.01 * real + 1e-4)
    # and the adversarial inputs do move the casts: the midpoints hit both rounding neighbours
    assert worst[64:80].max() > 0


@pytest.mark.parametrize("domain", ["linear", "zonotope"])
def test_relational_domains_on_a_box_contain_sampled_programs(domain: str) -> None:
    from kcverify.bounds import Region

    name = "mlp_tiny.int8.qdq.onnx"
    g = load_onnx(ROOT / "models" / "mlp_tiny.onnx")
    inf = parse_kernel_spec("inf", {"onnx": name, "compute": "fp32", "accumulate": "fp32"})
    x = np.load(ROOT / "examples" / "data" / "mlp_points.npz")["x"][:2].astype(np.float32)
    eps = 0.02
    jg, tr, inf_j = bound_problem(g, TRAIN, inf, QDQ)
    bound = certify_drift(jg, tr, inf_j, {"x": x}, domain=domain, region=Region(eps=eps)).linf
    rng = np.random.default_rng(1)
    sq = ort_session(onnx.load(QDQ / name))
    sf = ort_session(onnx.load(ROOT / "models" / "mlp_tiny.onnx"))
    for k in range(2):
        z = (x[k] + rng.uniform(-eps, eps, (256, 4))).astype(np.float32)
        d = np.abs(sq.run(None, {"x": z})[0].astype(np.float64) - sf.run(None, {"x": z})[0]).max()
        assert d <= bound[k]
