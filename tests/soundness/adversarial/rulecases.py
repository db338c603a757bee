"""One small graph per bound rule, adversarial inputs per kind, and the attack loop (shared by
test_rules.py, the campaign and bench/adversarial.py).

Input kinds: ``normal``; ``midpoint`` (fp8 rounding midpoints +- one fp32 ulp for the scale the
spec's activation cast computes); ``saturate`` (the amax and just under it: q = 448, and a
quotient the fp32 division may round up to it); ``tiny`` (fp32 subnormals); ``large`` (2e4:
the fp16 range). ``open_finding`` names the combinations an open finding pins down (skipped).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import helper

from kcverify.bounds import Region, certify_drift
from kcverify.errors import BoundError
from kcverify.kernels.spec import KernelSpec
from tests.soundness.adversarial.attacks import (
    SPECS,
    box_points,
    fp8_midpoints,
    normal,
    pairs,
    saturating,
    tiny,
)
from tests.soundness.adversarial.harness import TRAIN, Ledger, chain_model, graph_of, node_model
from tests.soundness.adversarial.interp import ProgramRunner

R = np.random.default_rng(20261124)


def _w(*shape: int, s: float = 0.5) -> np.ndarray:
    return (R.normal(size=shape) * s).astype(np.float32)


@dataclass
class RuleCase:
    id: str
    op: str
    model: onnx.ModelProto
    shapes: dict[str, tuple[int, ...]]  # float graph inputs (batch first)
    positive: tuple[str, ...] = ()  # inputs that must stay > 0 (Sqrt, Log, divisors)
    scale: float = 1.0
    kinds: tuple[str, ...] = ("normal", "midpoint", "saturate", "tiny", "large")
    extra: dict[str, Any] = field(default_factory=dict)


def _node(op: str, ins: list[tuple[str, Any]], attrs: dict | None = None, opset: int = 20,
          **kw) -> RuleCase:
    model = node_model(op, ins, attrs, opset)
    shapes = {n: v for n, v in ins if isinstance(v, tuple)}
    return RuleCase(kw.pop("id", op), op, model, shapes, **kw)


def _cases() -> list[RuleCase]:
    B = 2
    c = [
        _node("MatMul", [("x", (B, 16)), ("w", _w(16, 8))], id="MatMul-weight"),
        _node("MatMul", [("a", (B, 4, 16)), ("b", (B, 16, 6))], id="MatMul-act-act"),
        _node("Gemm", [("a", (B, 12)), ("w", _w(8, 12)), ("c", _w(8))],
              {"transB": 1, "alpha": 0.75, "beta": 2.0}, id="Gemm-transB-alpha-beta"),
        _node("MatMul", [("w", _w(4, 12)), ("b", (B, 12, 8))], id="MatMul-weight-left"),
        _node("Add", [("x", (B, 8)), ("y", (B, 8))]),
        _node("Add", [("x", (B, 8)), ("c", _w(8))], id="Add-const"),
        _node("Sub", [("x", (B, 8)), ("y", (B, 8))]),
        _node("Mul", [("x", (B, 8)), ("y", (B, 8))]),
        _node("Div", [("x", (B, 8)), ("y", (B, 8))], positive=("y",)),
        _node("Sqrt", [("x", (B, 8))], positive=("x",)),
        _node("Exp", [("x", (B, 8))], scale=3.0),
        _node("Log", [("x", (B, 8))], positive=("x",)),
        _node("Tanh", [("x", (B, 8))], scale=2.0),
        _node("Erf", [("x", (B, 8))], scale=2.0),
        _node("Sigmoid", [("x", (B, 8))], scale=3.0),
        _node("Softplus", [("x", (B, 8))], scale=12.0),
        _node("Reciprocal", [("x", (B, 8))], positive=("x",)),
        _node("Pow", [("x", (B, 8)), ("e", np.array(2.0, np.float32))], id="Pow-2"),
        _node("Neg", [("x", (B, 8))]),
        _node("Gelu", [("x", (B, 8))], scale=3.0),
        _node("Gelu", [("x", (B, 8))], {"approximate": "tanh"}, id="Gelu-tanh", scale=3.0),
        _node("Relu", [("x", (B, 8))]),
        _node("LeakyRelu", [("x", (B, 8))], {"alpha": 0.1}),
        _node("Softmax", [("x", (B, 3, 16))], {"axis": -1}, scale=4.0),
        _node("Softmax", [("x", (B, 3, 16))], {"axis": -1}, id="Softmax-masked", scale=4.0,
              extra={"mask": True}),
        _node("LayerNormalization", [("x", (B, 3, 32)), ("g", 1 + _w(32, s=0.1)),
                                     ("b", _w(32, s=0.1))], {"axis": -1}, opset=17,
              id="LayerNormalization"),
        _node("LayerNormalization", [("x", (B, 3, 32)), ("g", 1 + _w(32, s=0.1)),
                                     ("b", _w(32, s=0.1))], {"axis": -1}, opset=17,
              id="LayerNormalization-offset", extra={"offset": 300.0}),
        _node("ReduceSum", [("x", (B, 24)), ("axes", np.array([1]))], {"keepdims": 1},
              opset=13),
        _node("ReduceMean", [("x", (B, 24)), ("axes", np.array([1]))], {"keepdims": 1},
              opset=18),
        _node("ReduceMax", [("x", (B, 24)), ("axes", np.array([1]))], {"keepdims": 1},
              opset=18),
        _node("ReduceMin", [("x", (B, 24)), ("axes", np.array([1]))], {"keepdims": 1},
              opset=18),
        # Conv (group 1): geometries whose windows read every input element (finding 22: a
        # dynamic scale over the unfolded columns misses the elements no window reads)
        _node("Conv", [("x", (B, 2, 6, 6)), ("w", _w(3, 2, 3, 3)), ("b", _w(3, s=0.1))],
              {"strides": [2, 2], "pads": [1, 1, 1, 1]}, id="Conv-strided-padded",
              extra={"conv": True}),
        _node("Conv", [("x", (B, 2, 5, 7)), ("w", _w(2, 2, 2, 3))],
              {"strides": [1, 2], "pads": [0, 1, 0, 1], "dilations": [2, 1]},
              id="Conv-dilated", extra={"conv": True}),
        _node("Conv", [("x", (B, 3, 9)), ("w", _w(4, 3, 3)), ("b", _w(4, s=0.1))],
              {"strides": [2], "auto_pad": "SAME_UPPER"}, id="Conv1d-same",
              extra={"conv": True}),
    ]
    # a Cast to float16 and back rounds; and a Cast-Mul chain
    cast = chain_model([helper.make_node("Cast", ["x"], ["h"], to=onnx.TensorProto.FLOAT16),
                        helper.make_node("Cast", ["h"], ["y0"], to=onnx.TensorProto.FLOAT)],
                       [("x", (B, 8))], ["y0"])
    c.append(RuleCase("Cast-fp16-roundtrip", "Cast", cast, {"x": (B, 8)}))
    return c


CASES = _cases()


def feeds_for(case: RuleCase, kind: str, sp_name: str | KernelSpec, rng: np.random.Generator,
              batch: int | None = None) -> dict[str, np.ndarray]:
    """Inputs of ``kind`` for every float input of the case (batch: override axis 0)."""
    feeds = {}
    sp = SPECS.get(sp_name) if isinstance(sp_name, str) else sp_name
    acts = sp.activations if sp is not None else None
    for name, shape in case.shapes.items():
        if batch is not None:
            shape = (batch, *shape[1:])
        if kind == "normal":
            x = normal(shape, rng, case.scale)
        elif kind == "midpoint":
            fmt = acts.format.name if acts is not None and acts.format.kind == "float" else "fp8_e4m3"
            static = float(acts.value) if acts is not None and acts.scale == "static" else None
            per_token = acts is not None and acts.scale == "dynamic_per_token"
            block = acts.block_size if acts is not None and acts.scale == "dynamic_per_block" else None
            x = np.stack([fp8_midpoints(shape[1:], fmt, rng, amax=float(rng.uniform(0.5, 4)),
                                        group_axis=(len(shape) - 2 if per_token and len(shape) > 1
                                                    else None),
                                        block=block, static=static) for _ in range(shape[0])])
        elif kind == "saturate":
            x = saturating(shape, rng, amax=float(rng.uniform(1, 8)))
        elif kind == "tiny":
            x = tiny(shape, rng, 1e-40)
        elif kind == "large":
            x = normal(shape, rng, 2e4)
        else:
            raise ValueError(kind)
        if name in case.positive:
            x = np.abs(x) + np.float32(0.25 if kind != "tiny" else 1e-38)
        if case.extra.get("offset"):
            x = x + np.float32(case.extra["offset"])
        if case.extra.get("mask"):
            x = x.copy()
            x[..., 1::3] = -np.inf
        feeds[name] = x.astype(np.float32)
    return feeds


# Combinations whose violation a test in test_findings.py pins down while it is open (that test
# is xfail strict; when its fix lands, delete the mark there and the entry here):
# (op, input kind, tag) -> the finding; tag: the compute format, "static" (a static activation
# scale), or "*".
OPEN_FINDINGS: dict[tuple[str, str, str], str] = {
}


def open_finding(case: RuleCase, sp_name: str | KernelSpec, kind: str) -> str | None:
    sp = SPECS[sp_name] if isinstance(sp_name, str) else sp_name
    tags = [sp.compute.name, "*"]
    if sp.activations is not None and sp.activations.scale == "static":
        tags.append("static")
    for t in tags:
        if (case.op, kind, t) in OPEN_FINDINGS:
            return OPEN_FINDINGS[(case.op, kind, t)]
    return None


CONV_ACT_SCALES = ("none", "static", "dynamic_per_tensor", "per_tensor")


def conv_spec(sp) -> bool:
    """Whether a spec's activation cast is one a Conv input may take (docs/bounds.md: per-token
    and per-block activation scales are not defined for a convolution and are refused)."""
    return sp.activations is None or sp.activations.scale in CONV_ACT_SCALES


def run_case(led: Ledger, case: RuleCase, sp_name: str | KernelSpec, kind: str, domain: str,
             n_pairs: int, seed: int, region_eps: float | None = None, n_points: int = 3
             ) -> list[str]:
    """Certify ``case`` at inputs of ``kind`` (a point, or an L-inf box of ``region_eps``) and
    check n_pairs program pairs at the point or at n_points of the box; ``sp_name``: a name of
    attacks.SPECS or a KernelSpec (then named by its own name in the messages)."""
    if open_finding(case, sp_name, kind):
        return []
    sp = SPECS[sp_name] if isinstance(sp_name, str) else sp_name
    label = sp_name if isinstance(sp_name, str) else sp.name
    if case.extra.get("conv") and not conv_spec(sp):
        return []
    rng = np.random.default_rng(seed)
    feeds = feeds_for(case, kind, sp, rng)
    g = graph_of(case.model)
    region = None if region_eps is None else Region("input", "linf", region_eps)
    if region is not None and case.extra.get("mask"):
        return []
    try:
        with np.errstate(all="ignore"):
            res = certify_drift(g, TRAIN, sp, feeds, region=region, domain=domain).outputs
    except BoundError as e:  # a refusal (e.g. Sqrt of a box reaching below 0), not a bound
        if "cannot bound" in str(e):
            return []
        raise
    run = ProgramRunner(case.model)
    progs = pairs(TRAIN, sp, n_pairs, seed, per_sample="axis0")
    points = [feeds] if region is None else [
        dict(zip(feeds, vals)) for vals in zip(*[box_points(rng, v, region_eps, n_points)
                                                 for v in feeds.values()])]
    cls = f"rule/{case.id}"
    found: list[str] = []
    for pt in points:
        for p_t, p_i in progs:
            with np.errstate(all="ignore"):
                yt, yi = run(p_t, pt), run(p_i, pt)
            for name, box in res.items():
                found += led.check(cls, box, yt[name], yi[name],
                                   f"{case.id}/{label}/{kind}/{domain}/eps={region_eps}: "
                                   f"{p_t} | {p_i}")
    return found
