"""The shared soundness check: sample concrete executions inside the set a bound speaks about,
run conforming programs of both kernels (kcverify.kernels.realize), and measure how close the
observations come to the certified sets. A value outside is a violation, never a figure.

    stats = Stats()
    check_contains(stats, box, train_value, inf_value, where="...")
    stats.pairs, stats.worst_ratio    # largest observed drift / certified drift
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import torch

from kcverify.bounds import DiffBox
from kcverify.kernels.realize import Realization, random_realization
from kcverify.kernels.spec import KernelSpec, parse_kernel_spec
from kcverify.models.executor import Executor
from kcverify.models.ir import Graph

TRAIN = parse_kernel_spec("train", {"compute": "fp32", "accumulate": "fp32"})
SPECS: dict[str, KernelSpec] = {
    "fp8_bf16": parse_kernel_spec("inf", {
        "weights": {"format": "fp8_e4m3", "scale": "per_channel"},
        "activations": {"format": "fp8_e4m3", "scale": "dynamic_per_tensor"},
        "accumulate": "fp32", "compute": "bf16"}),
    "fp8_fp32": parse_kernel_spec("inf", {
        "weights": {"format": "fp8_e4m3", "scale": "per_channel"},
        "activations": {"format": "fp8_e4m3", "scale": "dynamic_per_token"},
        "accumulate": "fp32", "compute": "fp32"}),
    "e5m2_any": parse_kernel_spec("inf", {
        "weights": {"format": "fp8_e5m2", "scale": "per_tensor"},
        "activations": {"format": "fp8_e5m2", "scale": "dynamic_per_tensor"},
        "accumulate": "fp32", "compute": "fp16", "rounding": "any"}),
    "int8_block": parse_kernel_spec("inf", {
        "weights": {"format": "int8", "scale": "per_block", "block_size": 4},
        "accumulate": "fp32", "compute": "bf16"}),
    "bf16": parse_kernel_spec("inf", {"compute": "bf16", "accumulate": "fp32"}),
}


TOTAL: dict[str, float] = {"pairs": 0, "worst_ratio": 0.0}


@dataclass
class Stats:
    pairs: int = 0
    worst_ratio: float = 0.0
    violations: list[str] = field(default_factory=list)

    def report(self) -> str:
        return f"{self.pairs} (input, realization) pairs, worst observed/certified drift {self.worst_ratio:.4f}"


class _Safe(Realization):
    """Works around realize.py's directed rounding of an infinite value (-inf + inf = NaN in
    its nextafter step, e.g. a masked attention logit): an infinite exact value stays itself,
    which is what every conforming program computes."""

    def round(self, node, primitive, value):  # noqa: ANN001, ANN201
        out = super().round(node, primitive, value)
        return torch.where(torch.isinf(value), value, out)


def _safe(r: Realization) -> Realization:
    return _Safe(r.spec, seed=r.seed, order=r.order, chunk=r.chunk, rounding=r.rounding,
                 moments=r.moments)


def realizations(spec: KernelSpec, n: int, seed: int) -> list[Realization]:
    """Adversarial (all-up, all-down, nearest) then random conforming programs."""
    out = [Realization(spec, seed=seed, order="pairwise", rounding="up"),
           Realization(spec, seed=seed + 1, order="chunked", chunk=16, rounding="down"),
           Realization(spec, seed=seed + 2, order="sequential", rounding="nearest"),
           Realization(spec, seed=seed + 3, order="reverse", rounding="random",
                       moments="sums" if spec.moments == "sums" else "torch")]
    rng = random.Random(seed)
    while len(out) < n:
        out.append(random_realization(spec, rng))
    return [_safe(r) for r in out[:n]]


def run(graph: Graph, real: Realization, feeds: dict[str, np.ndarray], keep: bool = False,
        axes: dict | None = None) -> dict[str, torch.Tensor]:
    """Run ``real`` on ``graph`` with its per-sample scales grouped by the sample axes of the
    graph (``axes``: the sample axes of a block's inputs in the whole model)."""
    from kcverify.models.blocks import sample_axes

    real.sample_axes = sample_axes(graph, axes)
    ex = Executor(graph, dtype=torch.float64, arithmetic=real)
    return ex.run(feeds, keep=keep)


def check_contains(stats: Stats, box: DiffBox, t: np.ndarray, i: np.ndarray, where: str,
                   sample: slice | int | None = None) -> None:
    """Observed train value t, inference value i (arrays of the box's shape, or of one sample's
    when ``sample`` indexes the box's batch) must lie in the box."""
    arrs = box.arrays()
    if sample is not None:
        arrs = tuple(a[sample] for a in arrs)
    t = np.asarray(t, dtype=np.float64)
    i = np.asarray(i, dtype=np.float64)
    d = i - t
    same_inf = ~np.isfinite(t) & (t == i)
    d = np.where(same_inf, 0.0, d)
    for name, v, lo, hi in (("train", t, arrs[0], arrs[1]), ("inf", i, arrs[2], arrs[3]),
                            ("drift", d, arrs[4], arrs[5])):
        bad = ~((lo <= v) & (v <= hi))
        if np.any(bad):
            k = np.argwhere(bad)[0]
            stats.violations.append(
                f"{where}: {name} value {v[tuple(k)]!r} outside [{lo[tuple(k)]!r}, {hi[tuple(k)]!r}] at {k.tolist()}")
    stats.pairs += 1
    TOTAL["pairs"] += 1
    cert = np.maximum(np.abs(arrs[4]), np.abs(arrs[5]))
    # the ratio is reported where the drift is not known exactly (data movement, exact ops)
    fin = np.isfinite(cert) & (cert > 0) & ((arrs[5] - arrs[4]) > 1e-9 * cert)
    if np.any(fin):
        stats.worst_ratio = max(stats.worst_ratio, float(np.max(np.abs(d)[fin] / cert[fin])))
        TOTAL["worst_ratio"] = max(TOTAL["worst_ratio"], stats.worst_ratio)


def sample_box(rng: np.random.Generator, center: np.ndarray, eps: float, n: int, norm: str = "linf"
               ) -> list[np.ndarray]:
    """n points of the L-inf (or L2) ball: corners and random interior points."""
    pts = []
    for k in range(n):
        if norm == "l2":
            v = rng.normal(size=center.shape)
            v = v / max(np.linalg.norm(v.reshape(-1)), 1e-12) * eps * rng.uniform() ** (1 / v.size)
        elif k % 3 == 0:
            v = eps * rng.choice([-1.0, 1.0], size=center.shape)
        else:
            v = rng.uniform(-eps, eps, size=center.shape)
        pts.append((center.astype(np.float64) + v).astype(np.float64))
    return pts
