"""The chain domain (kcverify.regions.chain) against concrete conforming programs.

Each test draws boxes and points inside them, runs real conforming programs of both kernel specs
(kcverify.kernels.realize: several summation orders, nearest and directed roundings) and
onnxruntime, and requires every observed value and drift inside the certified sets: the forward
boxes, and the back-substituted (CROWN) bounds of values, drifts and linear objectives."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kcverify.kernels.realize import run_kernel
from kcverify.kernels.spec import parse_kernel_spec
from kcverify.models.ir import load_onnx
from kcverify.regions.chain import (
    ChainBounds,
    NotAChain,
    backward_drift,
    backward_value,
    extract_chain,
    optimise_slopes,
)
from kcverify.regions.property import DriftObjective
from tests.regions.helpers import mlp_onnx

FP32 = parse_kernel_spec("train", {"compute": "fp32", "accumulate": "fp32"})
FP16W = parse_kernel_spec("inf", {"compute": "fp32", "accumulate": "fp32",
                                  "weights": {"format": "fp16", "scale": "none"}})
BF16 = parse_kernel_spec("inf", {"compute": "bf16", "accumulate": "fp32",
                                 "weights": {"format": "int8", "scale": "per_channel"}})
BF16ACC = parse_kernel_spec("inf", {"compute": "bf16", "accumulate": "bf16"})
PAIRS = (({"order": "sequential"}, {"order": "pairwise", "rounding": "up"}),
         ({"order": "reverse", "rounding": "down"}, {"order": "chunked", "chunk": 4}),
         ({"order": "random", "seed": 3, "rounding": "random"},
          {"order": "random", "seed": 5, "rounding": "down"}))


def _points(lo: np.ndarray, hi: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """k float32 points per box, inside it (corners among them)."""
    out = []
    for a, b in zip(lo, hi):
        pts = np.clip(np.concatenate([[a, b], rng.uniform(a, b, (k - 2, len(a)))]), a, b)
        pts = pts.astype(np.float32)  # rounding may leave the box: such points are dropped
        ok = (pts >= a).all(1) & (pts <= b).all(1)
        out.append(pts[ok][:k] if ok.any() else np.zeros((0, len(a)), np.float32))
    return out


def _check(graph, chain, train, inf, lo, hi, seed: int = 0, crown: bool = True,  # noqa: ANN001
           alpha: int = 0) -> int:
    cb = ChainBounds(chain, train, inf, alpha_iters=alpha)
    cb.crown = crown
    r = cb.bound(lo, hi)
    B, n = len(lo), chain.n_out
    eye = torch.eye(n, dtype=torch.float64).expand(B, n, n)
    both = torch.cat([eye, -eye], 1)
    d_back = backward_drift(cb, r, both)
    t_back = backward_value(cb, r, 0, both)
    i_back = backward_value(cb, r, 1, both)
    rng = np.random.default_rng(seed)
    C = torch.as_tensor(rng.normal(size=(B, 3, n)))
    obj = backward_value(cb, r, 0, C)
    # what a split bounds a part by: with alpha, the objective's own optimised slopes too
    mag = DriftObjective(cb, 0.0, hi[0] - lo[0]).bounds(lo, hi) if alpha else \
        torch.cat([d_back[:, :n], d_back[:, n:]], 1)
    assert not bool(r.overflow.any())
    checked = 0
    for b, pts in enumerate(_points(lo, hi, 5, rng)):
        if not len(pts):
            continue
        feeds = {graph.inputs[0].name: pts.reshape(len(pts), *chain.input_shape)}
        for ct, ci in PAIRS:
            yt = run_kernel(graph, train, feeds, **ct)[chain.output].numpy().reshape(len(pts), -1)
            yi = run_kernel(graph, inf, feeds, **ci)[chain.output].numpy().reshape(len(pts), -1)
            d = yi - yt
            for name, v, lo_, hi_ in (("train", yt, r.lo[0][b], r.hi[0][b]),
                                      ("inf", yi, r.lo[1][b], r.hi[1][b]),
                                      ("drift", d, r.dlo[b], r.dhi[b]),
                                      ("drift back", d, -d_back[b, n:], d_back[b, :n]),
                                      ("drift objective", d, -mag[b, n:], mag[b, :n]),
                                      ("train back", yt, -t_back[b, n:], t_back[b, :n]),
                                      ("inf back", yi, -i_back[b, n:], i_back[b, :n])):
                assert np.all(v >= lo_.numpy()) and np.all(v <= hi_.numpy()), (name, b, ct, ci)
            assert np.all(yt @ C[b].numpy().T <= obj[b].numpy()), ("objective", b)
            checked += len(pts)
    return checked


def test_acas_fp16_weights_sound(acas: Path) -> None:
    g = load_onnx(acas / "ACASXU_run2a_1_1_batch_2000.onnx")
    chain = extract_chain(g)
    assert [s.kind for s in chain.steps][:3] == ["shift", "affine", "relu"]
    lo0 = np.array([0.6, -0.5, -0.5, 0.45, -0.5])
    hi0 = np.array([0.679857769, 0.5, 0.5, 0.5, -0.45])
    rng = np.random.default_rng(1)
    c = rng.uniform(lo0, hi0, (5, 5))
    lo = np.concatenate([lo0[None], np.maximum(lo0, c - (hi0 - lo0) / 16)])
    hi = np.concatenate([hi0[None], np.minimum(hi0, c + (hi0 - lo0) / 16)])
    assert _check(g, chain, FP32, FP16W, lo, hi) > 50
    assert _check(g, chain, FP32, FP16W, lo[:2], hi[:2], seed=1, alpha=2) > 15  # alpha-CROWN


def test_mlp_bf16_int8_sound(tmp_path: Path) -> None:
    for gemm in (True, False):
        path = mlp_onnx(tmp_path / f"m{int(gemm)}.onnx", seed=int(gemm), gemm=gemm)
        g = load_onnx(path)
        chain = extract_chain(g)
        assert {s.kind for s in chain.steps} >= {"shift", "scale", "affine", "relu"}
        rng = np.random.default_rng(2)
        c = rng.uniform(-2, 2, (6, 3))
        w = rng.uniform(0.0, 1.0, (6, 3))
        w[0] = 0  # a point box
        for crown, inf, alpha in ((True, BF16, 0), (False, BF16, 0), (True, BF16ACC, 0),
                                  (True, BF16, 3)):
            assert _check(g, chain, FP32, inf, c - w, c + w, crown=crown, alpha=alpha) > 40


def test_onnxruntime_inside_training_box(acas: Path) -> None:
    import onnxruntime as ort

    path = acas / "ACASXU_run2a_2_3_batch_2000.onnx"
    chain = extract_chain(load_onnx(path))
    lo = np.array([[-0.3, -0.01, 0.49, 0.3, 0.3]])
    hi = np.array([[-0.29, 0.01, 0.5, 0.5, 0.5]])
    r = ChainBounds(chain, FP32).bound(lo, hi, drift=False)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    pts = np.random.default_rng(0).uniform(lo, hi, (300, 5)).astype(np.float32)
    pts = pts[((pts >= lo) & (pts <= hi)).all(1)]
    for p in pts:
        y = sess.run(None, {"input": p.reshape(1, 1, 1, 5)})[0].reshape(-1)
        assert np.all(y >= r.lo[0][0].numpy()) and np.all(y <= r.hi[0][0].numpy())


def test_back_substitution_tightens(acas: Path) -> None:
    """CROWN intermediate bounds and the final back-substitution are never looser than the
    forward forms alone, and on the ACAS box they are markedly tighter."""
    g = load_onnx(acas / "ACASXU_run2a_1_1_batch_2000.onnx")
    chain = extract_chain(g)
    lo = np.array([[0.6, -0.5, -0.5, 0.45, -0.5]])
    hi = np.array([[0.68, -0.25, -0.25, 0.5, -0.45]])
    widths = []
    for crown in (False, True):
        cb = ChainBounds(chain, FP32, FP16W)
        cb.crown = crown
        r = cb.bound(lo, hi)
        widths.append(float((r.dhi - r.dlo).max()))
    assert widths[1] < 0.5 * widths[0]


def test_optimised_slopes_tighten(acas: Path) -> None:
    """alpha-CROWN: the optimised lower slopes lie in [0, 1] (stable neurons keep their exact
    0 / 1), and on a steep part of ACAS Xu 2_7 (where CROWN leaves every neuron of the last
    hidden layer unstable) they shrink the deep pre-activation boxes and the drift bound; the
    plain (rounding-free) objective they descend is within rounding of the sound bound."""
    chain = extract_chain(load_onnx(acas / "ACASXU_run2a_2_7_batch_2000.onnx"))
    lo = np.array([[0.6, 0.125, -0.25, 0.45, -0.5]])
    hi = np.array([[0.6798577687, 0.25, -0.125, 0.5, -0.45]])
    r0 = ChainBounds(chain, FP32, FP16W).bound(lo, hi)
    cb = ChainBounds(chain, FP32, FP16W, alpha_iters=2)
    r2 = cb.bound(lo, hi)
    i0, i2 = r0.intermediates(chain.steps), r2.intermediates(chain.steps)
    w0 = (i0[:, -1, 1] - i0[:, -1, 0]).sum(-1)  # the last ReLU's training-value widths
    w2 = (i2[:, -1, 1] - i2[:, -1, 0]).sum(-1)
    assert bool((w2 < 0.7 * w0).all()), (w0, w2)
    assert bool((r2.dhi - r2.dlo < r0.dhi - r0.dlo).all())
    # the slopes themselves, on the objective of the last ReLU's pre-activations
    j = max(i for i, st in enumerate(chain.steps) if st.kind == "relu")
    n = r2.trace[j]["lo"][0].shape[1]
    eye = torch.eye(n, dtype=torch.float64).expand(1, n, n)
    slopes = optimise_slopes(cb, r2, 0, eye, j, 2)
    assert slopes and all(bool(((a >= 0) & (a <= 1)).all()) for a in slopes.values())
    for i, a in slopes.items():
        lo_, hi_ = r2.trace[i]["lo"][0], r2.trace[i]["hi"][0]
        on, off = (lo_ >= 0)[:, None, :].expand_as(a), (hi_ <= 0)[:, None, :].expand_as(a)
        assert bool((a[on] == 1).all()) and bool((a[off] == 0).all())
    sound = backward_value(cb, r2, 0, eye, j, slopes=slopes)
    plain = backward_value(cb, r2, 0, eye, j, slopes=slopes, plain=True)
    crown = backward_value(cb, r2, 0, eye, j)
    assert bool((sound >= plain).all()) and bool((sound <= plain + 1e-9 * plain.abs() + 1e-9).all())
    assert float(sound.sum()) < 0.8 * float(crown.sum())


def test_slope_descent_in_float32(acas: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The slope descent runs in float32 (chain.SLOPE_DTYPE: 1.45x less CPU per part on ACAS
    Xu); its slopes come back float64 for the sound bound, which is then within 1e-5 (relative)
    of the bound with slopes descended in float64 and far below CROWN's (a descent that silently went
    wrong in float32, e.g. float64 zeros promoting it or a tiny step floor of 0, fails)."""
    import kcverify.regions.chain as chain_mod

    chain = extract_chain(load_onnx(acas / "ACASXU_run2a_2_7_batch_2000.onnx"))
    lo = np.array([[0.6, 0.125, -0.25, 0.45, -0.5], [0.6, -0.5, 0.25, 0.45, -0.5]])
    hi = np.array([[0.6798577687, 0.25, -0.125, 0.5, -0.45], [0.64, -0.25, 0.5, 0.47, -0.45]])
    cb = ChainBounds(chain, FP32, FP16W, alpha_iters=2)
    r = cb.bound(lo, hi)
    j = max(i for i, st in enumerate(chain.steps) if st.kind == "relu")
    n = r.trace[j]["lo"][0].shape[1]
    eye = torch.eye(n, dtype=torch.float64).expand(2, n, n)
    got = {}
    for dt in (torch.float32, torch.float64):
        monkeypatch.setattr(chain_mod, "SLOPE_DTYPE", dt)
        slopes = optimise_slopes(cb, r, 0, eye, j, 2)
        assert all(a.dtype == torch.float64 for a in slopes.values())
        got[dt] = backward_value(cb, r, 0, eye, j, slopes=slopes)
    crown = backward_value(cb, r, 0, eye, j)
    d = (got[torch.float32] - got[torch.float64]).abs() / got[torch.float64].abs().clamp(min=1)
    assert float(d.max()) < 1e-5 and float(d.median()) < 1e-6  # measured 3.5e-6 and 2e-8
    assert float(got[torch.float32].sum()) < float(crown.sum()) - 1000  # -2221 against 6157


def test_not_a_chain(root: Path, tmp_path: Path) -> None:
    with pytest.raises(NotAChain, match="one float input"):
        extract_chain(load_onnx(root / "models" / "tiny_decoder.onnx"))
    with pytest.raises(NotAChain, match="op Sigmoid is not an affine-ReLU chain step"):
        extract_chain(load_onnx(mlp_onnx(tmp_path / "s.onnx", act="Sigmoid")))


def test_any_order_accumulation_is_covered(tmp_path: Path) -> None:
    """1 + 63 * 2^-9 summed left to right in bf16 stays 1 (each small term is lost): the
    certified value set of that point must hold the sequential program's 1, not only the exact
    1.123."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    n = 64
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "sum",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, n])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 1])],
                          [numpy_helper.from_array(np.ones((n, 1), np.float32), "W")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, tmp_path / "sum.onnx")
    graph = load_onnx(tmp_path / "sum.onnx")
    spec = parse_kernel_spec("inf", {"compute": "bf16", "accumulate": "bf16"})
    x = np.full((1, n), 2.0 ** -9)
    x[0, 0] = 1.0
    seq = run_kernel(graph, spec, {"x": x.astype(np.float32)}, order="sequential")["y"]
    assert float(seq) == 1.0
    r = ChainBounds(extract_chain(graph), spec).bound(x, x, drift=False)
    assert float(r.lo[0]) <= 1.0 <= float(r.hi[0])
    top = backward_value(ChainBounds(extract_chain(graph), spec), r, 0,
                         torch.tensor([[[-1.0]]], dtype=torch.float64))
    assert -float(top) <= 1.0
