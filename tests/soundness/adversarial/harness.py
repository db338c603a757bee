"""Compare what conforming programs compute with what the engine certifies, per attack class.

    led = Ledger()
    certified = certify(graph, train, inf, feeds)          # kcverify.bounds.certify_drift
    led.check("softmax/row-sum", box, t, i, where="...")   # every (input, program pair) counted
    led["softmax/row-sum"].violations, .worst_drift, .worst_excursion

Containment is elementwise: tl <= t <= th, il <= i <= ih, dl <= i - t <= dh. A NaN is inside an
interval only when that interval is (-inf, inf) (the engine's "no bound"); two equal infinities
have drift 0. Figures: ``worst_drift`` = max |i - t| / max(|dl|, |dh|) where that is finite and
positive (the brief's observed / certified), ``worst_excursion`` = max over the three sets of the
distance from the interval's centre over its half-width (> 1 exactly when outside).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from kcverify.bounds import DiffBox, certify_drift
from kcverify.kernels.spec import KernelSpec, parse_kernel_spec
from kcverify.models.ir import Graph, from_onnx

TRAIN = parse_kernel_spec("train", {"compute": "fp32", "accumulate": "fp32"})


def spec(**raw: Any) -> KernelSpec:
    """An inference KernelSpec from its YAML mapping (names as in a contract)."""
    return parse_kernel_spec("inf", raw)


@dataclass
class ClassStats:
    pairs: int = 0
    violations: list[str] = field(default_factory=list)
    worst_drift: float = 0.0
    worst_excursion: float = 0.0
    errors: list[str] = field(default_factory=list)  # the engine raised instead of bounding

    def line(self, name: str) -> str:
        err = f"  engine errors {len(self.errors)}" if self.errors else ""
        return (f"{name:40s} pairs {self.pairs:9d}  violations {len(self.violations):6d}  "
                f"worst obs/cert drift {self.worst_drift:9.4g}  worst excursion "
                f"{self.worst_excursion:9.4g}{err}")


def _inside(v: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    nan_ok = np.isnan(v) & (lo == -np.inf) & (hi == np.inf)
    return nan_ok | ((lo <= v) & (v <= hi))


def _excursion(v: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> float:
    fin = np.isfinite(lo) & np.isfinite(hi)
    if not np.any(fin):
        return 0.0
    mid = 0.5 * lo + 0.5 * hi
    half = 0.5 * hi - 0.5 * lo
    with np.errstate(invalid="ignore", divide="ignore"):
        r = np.abs(v - mid) / half
    r = np.where(np.isnan(v) & fin, np.inf, r)
    r = np.where(fin & (half == 0) & (v == mid), 0.0, r)
    return float(np.max(np.where(fin, r, 0.0)))


class Ledger:
    """Pairs, violations and worst ratios per attack class (module doc)."""

    def __init__(self) -> None:
        self.classes: dict[str, ClassStats] = {}

    def __getitem__(self, name: str) -> ClassStats:
        return self.classes.setdefault(name, ClassStats())

    def check(self, cls: str, box: DiffBox, t: np.ndarray, i: np.ndarray, where: str,
              sample: int | slice | None = None) -> list[str]:
        """Count the pair(s) (one per sample row of t) and record every containment failure."""
        st = self[cls]
        arrs = box.arrays()
        if sample is not None:
            arrs = tuple(a[sample] for a in arrs)
        t = np.asarray(t, np.float64)
        i = np.asarray(i, np.float64)
        with np.errstate(invalid="ignore"):
            d = i - t
        d = np.where(np.isinf(t) & (t == i), 0.0, d)
        found = []
        for name, v, lo, hi in (("train", t, arrs[0], arrs[1]), ("inf", i, arrs[2], arrs[3]),
                                ("drift", d, arrs[4], arrs[5])):
            bad = ~_inside(v, lo, hi)
            if np.any(bad):
                k = tuple(np.argwhere(bad)[0])
                found.append(f"{where}: {name} value {v[k]!r} outside [{lo[k]!r}, {hi[k]!r}] "
                             f"at {list(map(int, k))} ({int(bad.sum())} elements)")
            st.worst_excursion = max(st.worst_excursion, _excursion(v, lo, hi))
        cert = np.maximum(np.abs(arrs[4]), np.abs(arrs[5]))
        ok = np.isfinite(cert) & (cert > 0)
        if np.any(ok):
            with np.errstate(invalid="ignore"):
                r = np.abs(d)[ok] / cert[ok]
            r = np.where(np.isnan(r), np.inf, r)
            st.worst_drift = max(st.worst_drift, float(np.max(r)))
        st.pairs += int(t.shape[0]) if t.ndim and sample is None else 1
        st.violations.extend(found)
        return found

    def report(self) -> str:
        return "\n".join(st.line(n) for n, st in sorted(self.classes.items()))

    def merge(self, other: Ledger) -> None:
        for n, st in other.classes.items():
            me = self[n]
            me.pairs += st.pairs
            me.violations.extend(st.violations)
            me.worst_drift = max(me.worst_drift, st.worst_drift)
            me.worst_excursion = max(me.worst_excursion, st.worst_excursion)
            me.errors.extend(st.errors)


# one ledger for the session: conftest prints it at the end
SESSION = Ledger()


def certify(graph: Graph, train: KernelSpec, inf: KernelSpec, feeds: Mapping[str, np.ndarray],
            domain: str = "best") -> dict[str, DiffBox]:
    return certify_drift(graph, train, inf, dict(feeds), domain=domain).outputs


# --- small graphs ---------------------------------------------------------------------------
def node_model(op: str, inputs: list[tuple[str, Any]], attrs: Mapping[str, Any] | None = None,
               opset: int = 20, n_out: int = 1) -> onnx.ModelProto:
    """One node: (name, shape) are float graph inputs, (name, ndarray) initializers (weights);
    (name, None) an omitted optional input."""
    ins, inits, names = [], [], []
    for nm, v in inputs:
        names.append("" if v is None else nm)
        if v is None:
            continue
        if isinstance(v, np.ndarray):
            inits.append(numpy_helper.from_array(v, nm))
        else:
            ins.append(helper.make_tensor_value_info(nm, TensorProto.FLOAT, list(v)))
    outs = [helper.make_tensor_value_info(f"y{k}", TensorProto.FLOAT, None) for k in range(n_out)]
    node = helper.make_node(op, names, [f"y{k}" for k in range(n_out)], name="n0",
                            **dict(attrs or {}))
    g = helper.make_graph([node], op, ins, outs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def chain_model(nodes: list[onnx.NodeProto], inputs: list[tuple[str, Any]], outputs: list[str],
                opset: int = 20) -> onnx.ModelProto:
    ins, inits = [], []
    for nm, v in inputs:
        if isinstance(v, np.ndarray):
            inits.append(numpy_helper.from_array(v, nm))
        else:
            ins.append(helper.make_tensor_value_info(nm, TensorProto.FLOAT, list(v)))
    outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs]
    g = helper.make_graph(nodes, "chain", ins, outs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def graph_of(model: onnx.ModelProto) -> Graph:
    return from_onnx(model, model.graph.name or "model")


def ratio_text(st: ClassStats) -> str:
    return (f"{st.pairs} pairs, {len(st.violations)} violations, worst drift "
            f"{st.worst_drift:.4g}, excursion {st.worst_excursion:.4g}"
            + ("" if not st.violations else f"; first: {st.violations[0]}"))


def finite(x: float) -> bool:
    return math.isfinite(x)


class Runtime:
    """A black-box program (torch, onnxruntime): ``fn(feeds) -> {output: array}``, named."""

    def __init__(self, label: str, fn) -> None:
        self.label, self.fn = label, fn

    def __call__(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.fn(feeds)

    def __str__(self) -> str:
        return self.label


def attack(led: Ledger, cls: str, model: onnx.ModelProto, train: KernelSpec, inf: KernelSpec,
           feeds: Mapping[str, np.ndarray], pairs: list[tuple[Any, Any]], domain: str = "best",
           graph: Graph | None = None, outputs: Mapping[str, DiffBox] | None = None
           ) -> list[str]:
    """Certify ``model`` at ``feeds`` once, run every (training program, inference program)
    pair (programs.Program, or a Runtime) and check containment."""
    from tests.soundness.adversarial.interp import ProgramRunner

    g = graph if graph is not None else graph_of(model)
    boxes = outputs if outputs is not None else certify(g, train, inf, feeds, domain)
    run = ProgramRunner(model)
    found = []
    memo: dict[int, dict[str, np.ndarray]] = {}

    def values(p) -> dict[str, np.ndarray]:
        if id(p) not in memo:
            with np.errstate(all="ignore"):
                memo[id(p)] = p(feeds) if isinstance(p, Runtime) else run(p, feeds)
        return memo[id(p)]
    for pt, pi in pairs:
        yt, yi = values(pt), values(pi)
        for name, box in boxes.items():
            found += led.check(cls, box, yt[name], yi[name], f"{cls}: {pt} / {pi} [{name}]")
    return found
