"""Benchmark of the SMT engine (issue 6): solve time against the number of unstable ReLUs.

    python bench/smt.py [--model models/mlp_tiny.onnx] [--eps 0,0.001,0.01,0.03,0.1,0.2]
                        [--timeout 60] [--bitprecise]

For each input-box radius eps around one fixed input it prints: the ReLUs the bound engine's
intervals leave unstable (both kernels counted), the neurons and error variables of the encoding,
z3's solve time for the exact maximum drift (Optimize, one objective per output and sign),
the bound engine's certified bound, the SMT maximum, and their ratio (interval / SMT, >= 1: how
much tightness the interval domain leaves on the table; 'timeout' when z3 ran out of time).
Kernels: fp32 training vs fp8_e4m3 inference (per-channel weights, dynamic per-tensor
activations), fp32 accumulation in any order.

--bitprecise adds the bit-precise row: on a tiny fp16/bf16 block, the maximum drift of the two
sequential programs (z3's floating-point theory, checked against enumerating the box) against
the error model's maximum over every order; the ratio shows how loose the error model itself is.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kcverify.bounds import Region, certify_drift  # noqa: E402
from kcverify.kernels.spec import parse_kernel_spec  # noqa: E402
from kcverify.models.ir import load_onnx  # noqa: E402
from kcverify.smt.decide import max_problem  # noqa: E402
from kcverify.smt.encode import prepare  # noqa: E402
from kcverify.smt.testing import fp8_specs  # noqa: E402


def unstable_rows(model: str, eps_list: list[float], timeout: float) -> None:
    g = load_onnx(ROOT / model if not Path(model).is_absolute() else model)
    train, inf = fp8_specs()
    n_in = int(g.inputs[0].shape[-1])
    x = np.random.default_rng(0).uniform(-1, 1, (1, n_in)).astype(np.float32)
    print(f"{model}: fp32 train vs fp8_e4m3 inference, one input, L-inf box of radius eps")
    print(f"{'eps':>7} {'unstable':>8} {'neurons':>7} {'errvars':>7} {'solve s':>8} "
          f"{'interval':>10} {'smt max':>10} {'int/smt':>8}")
    for eps in eps_list:
        engine = float(certify_drift(g, train, inf, x, region=Region(eps=eps) if eps else None).linf[0])
        p = prepare(g, train, inf, x, eps)
        t0 = time.perf_counter()
        m = max_problem(p, timeout_s=timeout)
        dt = time.perf_counter() - t0
        if m.exact:
            smt, ratio = f"{float(m.value):10.4g}", f"{engine / float(m.value):8.3f}"
        else:
            lo = f"{float(m.lower):.3g}" if m.lower is not None else "-"
            smt, ratio = f"{'>=' + lo:>10}", f"{'timeout':>8}"
        print(f"{eps:7.3g} {p.unstable_relus():8d} {p.neurons():7d} {m.stats['error_vars']:7d} "
              f"{dt:8.2f} {engine:10.4g} {smt} {ratio}", flush=True)


def bitprecise_rows(timeout: float) -> None:
    from kcverify.smt.bitprecise import bitprecise_max, enumerated_max, fp_box_model

    print("\nbit-precise (one sequential order) vs the error model (every order), tiny block "
          "2-2-1 (fp-valued weights), box radius 2^-7 around (0.5, -0.25)")
    print(f"{'compute':>7} {'fp8':>9} {'bitprecise':>11} {'z3 s':>6} {'model max':>10} "
          f"{'model/bit':>9}")
    for comp in ("fp16", "bf16"):
        for fmt8 in ("fp8_e5m2", "fp8_e4m3"):
            train = parse_kernel_spec("train", {"compute": comp, "accumulate": comp})
            inf = parse_kernel_spec("inf", {"compute": comp, "accumulate": comp,
                                            "weights": {"format": fmt8},
                                            "activations": {"format": fmt8}})
            g = fp_box_model((2, 2, 1), 0, comp)
            x0 = np.array([[0.5, -0.25]], np.float32)
            eps = 2.0**-7
            enum, _ = enumerated_max(g, train, inf, x0, eps)
            model = max_problem(prepare(g, train, inf, x0, eps), timeout_s=timeout)
            b = bitprecise_max(g, train, inf, x0, eps, upper=float(model.upper) * 1.001,
                               lower=enum, timeout_s=timeout)
            exact = "" if b.lower == b.upper else "?"
            print(f"{comp:>7} {fmt8:>9} {b.lower:10.5g}{exact:1} {b.seconds:6.2f} "
                  f"{float(model.upper):10.5g} {float(model.upper) / b.lower:9.3f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/mlp_tiny.onnx")
    ap.add_argument("--eps", default="0,0.001,0.01,0.03,0.1,0.2")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--bitprecise", action="store_true")
    a = ap.parse_args(argv)
    unstable_rows(a.model, [float(e) for e in a.eps.split(",")], a.timeout)
    if a.bitprecise:
        bitprecise_rows(a.timeout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
