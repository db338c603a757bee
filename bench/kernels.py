"""Accumulation families, measured in one run (docs/kernels.md).

    .venv/bin/python bench/kernels.py [--k 4096]

1. Pinned schedule, sharp: both kernels ``order: sequential`` on models/mlp_tiny.onnx at the
   example points (fp32 training, fp8 e4m3 serving), certified / realized drift of the
   sequential realization.
2. Hopper family: a MatMul x (1, K) @ W (K, 64), fp8 e4m3 operands, certified drift bound and
   value-set width under ``{mma: sm90_fp8, promote: 128}`` (split_k [1, 2, 4]) and under
   ``promote`` unset (cuBLAS fast accumulation: never promoted) against ``fp32`` any order; and
   the realized error of the tensor-core programs against the same casts accumulated in fp32.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kcverify.bounds import certify_drift  # noqa: E402
from kcverify.kernels.realize import run_kernel  # noqa: E402
from kcverify.kernels.spec import parse_kernel_spec  # noqa: E402
from kcverify.models.ir import load_onnx  # noqa: E402
from tests.helpers import matmul_model  # noqa: E402

SEQ = {"format": "fp32", "order": "sequential"}
CASTS = {"weights": {"format": "fp8_e4m3", "scale": "per_channel"},
         "activations": {"format": "fp8_e4m3", "scale": "dynamic_per_tensor"}}


def pinned() -> None:
    g = load_onnx(ROOT / "models/mlp_tiny.onnx")
    xs = np.load(ROOT / "examples/data/mlp_points.npz")["x"].astype(np.float32)
    train = parse_kernel_spec("train", {"compute": "fp32", "accumulate": SEQ})
    inf = parse_kernel_spec("inf", {"compute": "fp32", "accumulate": SEQ, **CASTS})
    res = certify_drift(g, train, inf, {"x": xs}, domain="interval")
    out = g.outputs[0].name
    yt = run_kernel(g, train, {"x": xs}, order="sequential")[out].numpy()
    yi = run_kernel(g, inf, {"x": xs}, order="sequential")[out].numpy()
    drift = np.abs(yi - yt).max(axis=-1)
    r = res.linf / drift
    print(f"pinned sequential, mlp_tiny, {len(xs)} points: certified / realized drift "
          f"min {r.min():.6f} median {np.median(r):.6f} max {r.max():.6f}")


def hopper(k: int) -> None:
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((k, 64)) * 0.05).astype(np.float32)
    x = (rng.standard_normal((1, k)) * np.exp(rng.uniform(-3, 1, size=(1, k)))).astype(np.float32)
    g = matmul_model(w)
    fp32 = parse_kernel_spec("train", {"compute": "fp32", "accumulate": "fp32"})
    specs = {
        "fp32 any order": parse_kernel_spec("inf", {"compute": "fp32", "accumulate": "fp32", **CASTS}),
        "sm90_fp8 promote 128, split_k 1/2/4": parse_kernel_spec("inf", {
            "compute": "fp32", "accumulate": {"mma": "sm90_fp8", "promote": 128},
            "split_k": [1, 2, 4], **CASTS}),
        "sm90_fp8 never promoted": parse_kernel_spec("inf", {
            "compute": "fp32", "accumulate": {"mma": "sm90_fp8"}, **CASTS}),
    }
    base = None
    for name, spec in specs.items():
        t0 = time.perf_counter()
        res = certify_drift(g, fp32, spec, {"x": x}, domain="interval")
        dt = time.perf_counter() - t0
        box = res.outputs["y"]
        width = float(np.median(box.inf_hi - box.inf_lo))
        drift = float(res.linf[0])
        if base is None:
            base = (width, drift)
        line = (f"K={k} {name:38s} drift bound {drift:.4g} ({drift / base[1]:.1f}x), "
                f"value width median {width:.3g} ({width / base[0]:.1f}x), {dt:.2f}s")
        if spec.accumulation.mma is not None:
            # the same casts accumulated in fp32: the tensor cores' own error, not the fp8 casts'
            exact = run_kernel(g, specs["fp32 any order"], {"x": x}, order="pairwise")["y"].numpy()
            errs = []
            for split in spec.accumulation.split_k:
                y = run_kernel(g, spec, {"x": x}, order="sequential", split=split)["y"].numpy()
                errs.append(float(np.max(np.abs(y - exact) / np.abs(exact).max())))
            line += f"; realized accumulation error / max|y| {max(errs):.3g}"
        print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--k", type=int, nargs="*", default=[1024, 4096])
    a = ap.parse_args()
    pinned()
    for k in a.k:
        hopper(k)


if __name__ == "__main__":
    main()
