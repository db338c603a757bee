"""Conv (kcverify/bounds/rules/conv.py) attacked in the interval, linear and best domains with the
independent interpreter's convolution (programs.Program.conv: the input cast as a whole, zero
padded after the cast, each output's C kh kw terms against the weight's row, every order,
split point, accumulator, rescaling and rounding direction programs.py knows), at points and on
L-inf boxes, on inputs at fp8 rounding midpoints, at saturation and in the fp16 range; the
accumulation families (sm90 tensor cores, split-K, tiles, pinned orders) through a 1-D
convolution whose single window is a MatMul row the family attacks were built for.

Geometries whose windows leave an input element unread (a 1x1 stride-2 shortcut, a trailing
column) are attacked under every scale: a dynamic one is the whole input's (finding 22, fixed in
7ce7fd1).
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.soundness.adversarial.attacks import SPECS
from tests.soundness.adversarial.harness import SESSION, TRAIN, Ledger, ratio_text, spec
from tests.soundness.adversarial.interp import ProgramRunner, conv_pads
from tests.soundness.adversarial.programs import Program
from tests.soundness.adversarial.rulecases import RuleCase, conv_spec, run_case

R = np.random.default_rng(20261201)

# name: (input shape (batch first), weight shape, attributes)
GEOMS: dict[str, tuple[tuple[int, ...], tuple[int, ...], dict]] = {
    "stride-dil-pad": ((2, 2, 7, 7), (3, 2, 3, 3), {"strides": [2, 1], "pads": [1, 0, 1, 1],
                                                    "dilations": [1, 2]}),
    "same-upper": ((2, 3, 5, 5), (4, 3, 3, 2), {"auto_pad": "SAME_UPPER", "strides": [2, 2]}),
    "same-lower": ((2, 3, 5, 6), (2, 3, 2, 3), {"auto_pad": "SAME_LOWER", "strides": [1, 2]}),
    "dense-K36": ((2, 4, 4, 4), (2, 4, 3, 3), {"pads": [1, 1, 1, 1]}),
    "1d-pad": ((2, 2, 9), (3, 2, 3), {"strides": [2], "pads": [1, 2]}),
    "1d-dil": ((2, 2, 9), (3, 2, 3), {"auto_pad": "VALID", "dilations": [2]}),
    # windows skip elements: 1x1 stride 2 (a ResNet shortcut), a trailing column left over
    "1x1-stride2": ((2, 3, 5, 5), (2, 3, 1, 1), {"strides": [2, 2]}),
    "trailing": ((2, 2, 5, 6), (2, 2, 3, 3), {"strides": [2, 2]}),
}


def reads_all(name: str) -> bool:
    """Whether every input element lies in some window (the ONNX geometry, computed here)."""
    xs, ws, attrs = GEOMS[name]
    nd = len(ws) - 2
    k, st = list(ws[2:]), list(attrs.get("strides", [1] * nd))
    dl = list(attrs.get("dilations", [1] * nd))
    pb, pe = conv_pads(xs[2:], k, st, dl, attrs.get("pads"), attrs.get("auto_pad", "NOTSET"))
    for size, kk, s, d, b, e in zip(xs[2:], k, st, dl, pb, pe):
        out = (size + b + e - d * (kk - 1) - 1) // s + 1
        read = {o * s + j * d - b for o in range(out) for j in range(kk)}
        if not set(range(size)) <= read:
            return False
    return True


def conv_model(name: str, bias: bool = True):
    xs, ws, attrs = GEOMS[name]
    rng = np.random.default_rng(len(name))
    w = (rng.normal(size=ws) * 0.4).astype(np.float32)
    inits = [numpy_helper.from_array(w, "w")]
    ins = ["x", "w"]
    if bias:
        inits.append(numpy_helper.from_array((rng.normal(size=ws[0]) * 0.1).astype(np.float32),
                                             "b"))
        ins.append("b")
    node = helper.make_node("Conv", ins, ["y"], name="conv", **attrs)
    g = helper.make_graph([node], name,
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(xs))],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    return m


def conv_case(name: str) -> RuleCase:
    return RuleCase(f"conv/{name}", "Conv", conv_model(name), {"x": GEOMS[name][0]},
                    extra={"conv": True})


def test_geometries_say_what_they_read() -> None:
    """reads_all is what it claims (the skipping geometries skip, the others do not)."""
    assert not reads_all("1x1-stride2") and not reads_all("trailing")
    assert all(reads_all(n) for n in GEOMS if n not in ("1x1-stride2", "trailing"))


@pytest.mark.parametrize("name", sorted(GEOMS))
def test_interpreter_conv_is_onnxruntime(name: str) -> None:
    """The interpreter's convolution (one fp32 program, nearest) against onnxruntime's fp32
    Conv, to a few fp32 ulps of the sum of |terms| (both are fp32 dot products)."""
    import onnxruntime as ort

    m = conv_model(name)
    x = R.normal(size=GEOMS[name][0]).astype(np.float32)
    ref = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]
                               ).run(None, {"x": x})[0]
    y = ProgramRunner(m)(Program(TRAIN), {"x": x})["y"]
    assert y.shape == ref.shape
    np.testing.assert_allclose(y, ref, rtol=0, atol=2e-6 * max(1.0, float(np.abs(ref).max())))


def test_interpreter_conv_is_its_matmul() -> None:
    """A 1-D VALID convolution with one window is the MatMul of its row (c, j order): bit for
    bit under a cast spec, every order (so the family attacks below read the row they built)."""
    sp = SPECS["fp8_tensor_bf16"]
    C, k, n_out = 4, 3, 2
    x = R.normal(size=(2, C, k)).astype(np.float32)
    w = (R.normal(size=(n_out, C, k)) * 0.5).astype(np.float32)
    cm = _conv1(w)
    mm = helper.make_model(helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "mm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, C * k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w.reshape(n_out, -1).T.copy(), "w")]),
        opset_imports=[helper.make_opsetid("", 17)])
    for order in ("seq", "rev", "greedy_up", "tree_down"):
        p = Program(sp, order=order, rescale="two")
        yc = ProgramRunner(cm)(p, {"x": x})["y"][..., 0]
        ym = ProgramRunner(mm)(p, {"x": x.reshape(2, -1)})["y"]
        np.testing.assert_array_equal(yc, ym)


def _conv1(w: np.ndarray):
    """One 1-D VALID Conv node over (batch, C, k) inputs: one window."""
    node = helper.make_node("Conv", ["x", "w"], ["y"], name="conv", auto_pad="VALID")
    m = helper.make_model(helper.make_graph(
        [node], "conv1", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                        [None, w.shape[1], w.shape[2]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w")]), opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    return m


# --- every domain, specs of every Conv-compatible cast, adversarial inputs ---------------------
CONV_SPECS = {
    **{n: SPECS[n] for n in ("fp8_tensor_bf16", "e5m2_any_fp16", "fp8_static_block",
                             "int8_block", "bf16_acc_bf16", "fp16_ulps4")},
    "e4m3_pt_fp32": spec(weights={"format": "fp8_e4m3", "scale": "per_tensor"},
                         activations={"format": "fp8_e4m3", "scale": "dynamic_per_tensor"},
                         accumulate="fp32", compute="fp32"),
    "e4m3_any_bf16acc": spec(weights={"format": "fp8_e4m3", "scale": "per_channel"},
                             activations={"format": "fp8_e4m3", "scale": "static",
                                          "value": 0.01},
                             accumulate="bf16", compute="bf16", rounding="any"),
}


def _attack(name: str, sp_name: str, kinds: tuple[str, ...], domains: tuple[str, ...],
            n_pairs: int, eps: float | None = None) -> list[str]:
    sp = CONV_SPECS[sp_name]
    assert conv_spec(sp)
    case = conv_case(name)
    led = Ledger()
    found = []
    for k, kind in enumerate(kinds):
        for domain in domains:
            found += run_case(led, case, sp, kind, domain, n_pairs=n_pairs, seed=40 + k,
                              region_eps=eps)
    SESSION.merge(led)
    assert led[f"rule/{case.id}"].pairs > 0
    return found


FAST = [("stride-dil-pad", "fp8_tensor_bf16"), ("same-lower", "e5m2_any_fp16"),
        ("trailing", "e4m3_pt_fp32"), ("1x1-stride2", "fp8_tensor_bf16"),
        ("dense-K36", "e4m3_any_bf16acc")]


@pytest.mark.parametrize("name,sp_name", FAST, ids=[f"{a}-{b}" for a, b in FAST])
def test_conv_points(name: str, sp_name: str) -> None:
    """Points at fp8 midpoints, interval / linear / best (saturation: the slow sweep)."""
    found = _attack(name, sp_name, ("midpoint",), ("interval", "linear", "best"), 3)
    assert not found, "\n".join(found[:3])


BOXES = [("1d-pad", "e4m3_pt_fp32"), ("1d-dil", "e5m2_any_fp16")]


@pytest.mark.parametrize("name,sp_name", BOXES, ids=[f"{a}-{b}" for a, b in BOXES])
def test_conv_boxes(name: str, sp_name: str) -> None:
    """L-inf boxes (eps 0.02) around midpoint inputs: corners and random points, linear and
    best (the symbolic forms and the zonotope carry the input's symbols through im2col)."""
    found = _attack(name, sp_name, ("midpoint",), ("linear", "best"), 3, eps=0.02)
    assert not found, "\n".join(found[:3])


@pytest.mark.slow
@pytest.mark.parametrize("sp_name", sorted(CONV_SPECS))
@pytest.mark.parametrize("name", sorted(GEOMS))
def test_conv_sweep(name: str, sp_name: str) -> None:
    """Every geometry and spec, every input kind, the three domains at points, linear and best
    on boxes."""
    found = _attack(name, sp_name, ("normal", "midpoint", "saturate", "tiny", "large"),
                    ("interval", "linear", "best"), 4)
    found += _attack(name, sp_name, ("normal", "midpoint"), ("linear", "best"), 3, eps=0.01)
    led = SESSION[f"rule/conv/{name}"]
    assert not found, ratio_text(led) + "\n" + "\n".join(found[:3])


# --- accumulation families through a convolution ------------------------------------------------
def _family_attack(cls: str, sp, rows: np.ndarray, wmat: np.ndarray, k: int, limit: int,
                   domains=("interval", "best")) -> list[str]:
    """rows (R, C k) and wmat (C k, O) as a 1-D VALID Conv over (R, C, k): one window per row."""
    from tests.soundness.adversarial.harness import attack
    from tests.soundness.adversarial.test_families import family_programs

    Kt = rows.shape[1]
    assert Kt % k == 0
    x = rows.reshape(rows.shape[0], Kt // k, k).astype(np.float32)
    w = wmat.T.reshape(wmat.shape[1], Kt // k, k).astype(np.float32)
    model = _conv1(w)
    progs = family_programs(sp, limit)
    train_orders = ("tree_down", "tree_up", "seq")
    pairs = [(Program(TRAIN, order=train_orders[j % 3]), p) for j, p in enumerate(progs)]
    led = Ledger()
    found = []
    for domain in domains:
        found += attack(led, cls, model, TRAIN, sp, {"x": x}, pairs, domain=domain)
    SESSION.merge(led)
    return found


DYN = {"format": "fp8_e4m3", "scale": "dynamic_per_tensor"}
E4M3_PC = {"format": "fp8_e4m3", "scale": "per_channel"}


@pytest.mark.parametrize("acc", [
    {"format": "fp32", "mma": "sm90_fp8", "promote": 32, "split_k": [1, 2]},
    {"format": "fp32", "order": "sequential", "split_k": [1, 3]},
    {"format": "fp32", "order": "tile_k", "tile_k": 8, "split_k": [1, 3]},
    {"format": "fp32", "order": "pairwise"},
], ids=["sm90-split2", "sequential-split3", "tile8-split3", "pairwise"])
def test_conv_families(acc: dict) -> None:
    """The family rows of test_families (sm90: products just under the tensor core's grid;
    orders: one big product among small ones off its grid) as a 1-D convolution: K = 66 terms
    (C = 22 channels, kernel 3), scales pinned to 1 by a 448 column (each sample its own)."""
    from tests.soundness.adversarial.test_families import fam_spec, order_rows, sm90_rows

    sp = fam_spec(acc, E4M3_PC, DYN)
    if acc.get("mma"):
        if sp.accumulation.mma is None:
            pytest.skip("accumulation mma not parsed")
        x, w = sm90_rows(64)
    else:
        x, w = order_rows(np.random.default_rng(7), 3, 64, "fp32")
    found = _family_attack(f"conv/families/{'-'.join(map(str, acc.values()))}", sp, x, w, 3,
                           limit=8)
    assert not found, "\n".join(found[:3])


# --- the amax at an element no window reads (finding 22's regression, boxes included) -----------
def _unread(name: str) -> tuple[int, ...]:
    """The per-sample index (c, [h,] w) of an element no window reads."""
    xs, ws, attrs = GEOMS[name]
    if name == "1x1-stride2":
        return (0, 1, 1)
    assert name == "trailing"
    return (1, xs[2] - 1, xs[3] - 1)


@pytest.mark.parametrize("domain", ["interval", pytest.param("linear", marks=pytest.mark.slow),
                                    "best"])
@pytest.mark.parametrize("name", ["1x1-stride2", "trailing"])
def test_conv_amax_unread(name: str, domain: str) -> None:
    """Each sample's amax at an unread element, e4m3 midpoints of that scale elsewhere and a
    read element 0.005 below the amax: at the point, and (linear, best) on a box of 0.01 where
    either may be the amax (the cast relative to a certain amax element must not pick the read
    one)."""
    from kcverify.bounds import Region, certify_drift
    from tests.soundness.adversarial.attacks import box_points, fp8_midpoints, pairs
    from tests.soundness.adversarial.harness import graph_of

    sp = CONV_SPECS["e4m3_pt_fp32"]
    rng = np.random.default_rng(22)
    xs = GEOMS[name][0]
    x = np.stack([fp8_midpoints(xs[1:], "fp8_e4m3", rng, amax=a) for a in (1.7, 0.6)])
    for b, a in enumerate((1.7, 0.6)):
        x[b].reshape(-1)[0] = np.float32(a - 0.005)
        x[b][_unread(name)] = np.float32(a)
    model = conv_model(name)
    run = ProgramRunner(model)
    progs = pairs(TRAIN, sp, 4, 3, per_sample="axis0")
    regions = [None] + ([Region("input", "linf", 0.01)] if domain != "interval" else [])
    led = Ledger()
    found = []
    for region in regions:
        with np.errstate(all="ignore"):
            box = certify_drift(graph_of(model), TRAIN, sp, {"x": x}, region=region,
                                domain=domain).outputs["y"]
        points = [x] if region is None else box_points(rng, x, 0.01, 6)
        for pt in points:
            for p_t, p_i in progs:
                with np.errstate(all="ignore"):
                    yt, yi = run(p_t, {"x": pt})["y"], run(p_i, {"x": pt})["y"]
                found += led.check(f"conv/amax-unread/{name}", box, yt, yi,
                                   f"{name}/{domain}/{region}: {p_t} | {p_i}")
    SESSION.merge(led)
    assert not found, "\n".join(found[:3])
