"""ACAS Xu campaigns (minutes to hours; not CI): NeuroDiff's table and the VNN-COMP known answers.

    python bench/acasxu.py neurodiff [--eps 0.05 0.01] [--budget 120] [--nets 1_1,2_3] [--cpu]
        `kcverify prove` of examples/contracts/acasxu-fp16{,-tight}.yaml on each of the 45
        networks: the network against itself with fp16 weights over property 1's box; per net
        proved?, certified bound, parts, seconds; then the totals.
    python bench/acasxu.py vnncomp [--timeout 116] [--props 1,2] [--nets ...] [--limit N]
                                   [--every K] [--cpu]
        `kcverify vnnlib` on the 186 instances of ground_truth.csv (47 sat / 139 unsat): per
        instance the answer against the known one; then decided / wrong / unknown / timeout and
        the total time. A wrong answer is a soundness bug: the run says so and exits 1.
        --every K: a sample stratified by property, every K-th instance of each property
        (a property with fewer than K instances gives its first), and the counts extrapolated
        to the 186 (each instance standing for its property's share).

    python bench/acasxu.py rate [--nets 2_7,3_5] [--eps 0.05] [--budget 10]
        Throughput (docs/regions.md, session 9): splits each network for --budget CPU s as
        prove does (no certificate) and prints parts bounded, rounds, parts per CPU second and
        where the CPU went: the slope descent (float32, plain passes and autograd), the sound
        back-substitutions of the value and of the drift (float64, intermediate rows and the
        objective), the cut choice (forward-only bounds of the candidate halves), the rest
        (forward forms, relaxations, the driver).

    python bench/acasxu.py diagnose [--nets 2_7,3_5] [--eps 0.05] [--budget 8] [--parts 4]
        Where the open parts' looseness is (docs/regions.md, session 8; diagnostics, not bounds):
        splits each network for --budget CPU s as prove does, then on its worst open parts
        prints the certified drift bound, the forward-only one (NeuroDiff's forms, no
        back-substitution of intermediate bounds), the bound with the intermediate boxes
        replaced by sampled hulls (an UNSOUND oracle: drift boxes, value boxes, both), the
        sampled drift, the worse half of the best input cut and the worse branch of the best
        single ReLU phase split (the training value's box clamped, every unstable neuron of
        every hidden layer); then over all open parts which output decides them and how much
        volume clipping the box to where the linear bound can exceed eps would remove.

--cpu: budgets (--budget, --timeout) in CPU seconds of this process (time.process_time), not
wall-clock seconds: on a shared machine at nice 10 the wall clock buys 2-20x less CPU, so a
wall budget measures the load as much as the verifier.

The data is read from shared/data/acasxu beside the checkout (else /work/shared/data/acasxu).
Times are wall-clock and CPU seconds of this process (on a shared machine the CPU time is the
steadier figure), torch single-threaded (kcverify.regions does that itself).
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONTRACTS = {0.05: ROOT / "examples" / "contracts" / "acasxu-fp16.yaml",
             0.01: ROOT / "examples" / "contracts" / "acasxu-fp16-tight.yaml"}


def data_dir() -> Path:
    for p in (ROOT / ".." / "shared" / "data" / "acasxu", Path("/work/shared/data/acasxu")):
        if p.is_dir():
            return p.resolve()
    sys.exit("ACAS Xu data not found (shared/data/acasxu beside the checkout)")


def nets(arg: str | None) -> list[str]:
    all_ = [f"{a}_{b}" for a in range(1, 6) for b in range(1, 10)]
    return all_ if not arg else [n for n in arg.split(",") if n]


def load() -> str:
    """The machine's load average (1, 5, 15 min) and cores: the CPU seconds are the steadier
    figure where the load is above the cores."""
    a, b, c = os.getloadavg()
    return f"load average {a:.1f} {b:.1f} {c:.1f} on {os.cpu_count()} cores"


def neurodiff(args: argparse.Namespace) -> int:
    from kcverify.planner.prove import ProveOptions, prove

    acas = data_dir()
    for eps in args.eps:
        if eps not in CONTRACTS:
            sys.exit(f"--eps {eps}: the example contracts are for {sorted(CONTRACTS)}")
        print(f"\nNeuroDiff: |f_fp16(x) - f(x)|_inf <= {eps} over property 1's box "
              f"(kcverify prove, budget {args.budget:g}s per net)")
        print(f"{'net':<6} {'proved':<7} {'bound':>11} {'parts':>7} {'seconds':>8} {'cpu s':>7}")
        total, cpu, proved = 0.0, 0.0, 0
        with tempfile.TemporaryDirectory() as tmp:
            for net in nets(args.nets):
                model = Path(tmp) / f"ACASXU_run2a_{net}_batch_2000.onnx"
                shutil.copy(acas / model.name, model)
                model.chmod(0o644)
                said: list[str] = []
                t0, c0 = time.perf_counter(), time.process_time()
                res = prove(CONTRACTS[eps], model,
                            ProveOptions(region_timeout=args.budget, progress=said.append))
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                (c,) = res.report.clauses
                ok = c.verdict == "proved"
                parts = next((m.group(1) for s in said
                              for m in [re.search(r"split: \w+, (\d+) parts", s)] if m), "?")
                bound = f"{c.bound:.4g}" if c.bound is not None else "-"
                print(f"{net:<6} {'yes' if ok else 'no':<7} {bound:>11} {parts:>7} {dt:>8.1f} "
                      f"{dc:>7.1f}", flush=True)
                total += dt
                cpu += dc
                proved += ok
        print(f"proved {proved}/{len(nets(args.nets))} at eps = {eps} in {total:.0f}s total "
              f"({cpu:.0f} CPU seconds); {load()}")
    return 0


def vnncomp(args: argparse.Namespace) -> int:
    from kcverify.dsl.vnnlib import load_vnnlib
    from kcverify.regions.verify import verify_vnnlib

    acas = data_dir()
    with open(acas / "ground_truth.csv") as f:
        rows = list(csv.DictReader(f))
    want_props = {int(p) for p in args.props.split(",")} if args.props else None
    want_nets = set(nets(args.nets)) if args.nets else None
    picked = []
    for r in rows:
        net = re.search(r"run2a_(\d_\d)_", r["onnx"]).group(1)
        prop = int(re.search(r"prop_(\d+)", r["vnnlib"]).group(1))
        if (want_props is None or prop in want_props) and (want_nets is None or net in want_nets):
            picked.append((net, prop, r))
    weight = {}
    if args.every:
        per: dict[int, list] = {}
        for item in picked:
            per.setdefault(item[1], []).append(item)
        picked = [item for prop in sorted(per) for item in per[prop][::args.every]]
        weight = {prop: len(v) / len(v[::args.every]) for prop, v in per.items()}
    if args.limit:
        picked = picked[:args.limit]
    counts = {"decided": 0, "wrong": 0, "unknown": 0, "timeout": 0}
    est = dict.fromkeys(counts, 0.0)
    total = cpu = 0.0
    clock = time.process_time if args.cpu else time.perf_counter
    print(f"{'instance':<12} {'expected':<8} {'answer':<8} {'seconds':>8} {'cpu s':>7}  parts")
    for net, prop, r in picked:
        t0, c0 = time.perf_counter(), time.process_time()
        res = verify_vnnlib(acas / r["onnx"], load_vnnlib(acas / r["vnnlib"]),
                            timeout=args.timeout, clock=clock)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        total += dt
        cpu += dc
        ans, exp = res.answer, r["expected"]
        key = "decided" if ans in ("sat", "unsat") else ans
        counts[key] += 1
        est[key] += weight.get(prop, 1.0)
        if ans in ("sat", "unsat") and ans != exp:
            counts["wrong"] += 1
            est["wrong"] += weight.get(prop, 1.0)
        flag = "  WRONG" if ans in ("sat", "unsat") and ans != exp else ""
        print(f"{net}/p{prop:<6} {exp:<8} {ans:<8} {dt:>8.1f} {dc:>7.1f}  {res.parts}{flag}",
              flush=True)
    n = len(picked)
    unit = "CPU s" if args.cpu else "s wall"
    print(f"\n{n} instances: decided {counts['decided']} (wrong {counts['wrong']}), unknown "
          f"{counts['unknown']}, timeout {counts['timeout']}; total {total:.0f}s wall, "
          f"{cpu:.0f} CPU s (timeout {args.timeout:g} {unit} each); {load()}")
    if weight:
        whole = sum(len(v) for v in per.values())
        print(f"extrapolated to the {whole} instances (each standing for its property's share): "
              f"decided {est['decided']:.0f} (wrong {est['wrong']:.0f}), unknown "
              f"{est['unknown']:.0f}, timeout {est['timeout']:.0f}")
    return 1 if counts["wrong"] else 0


def _preacts(cb, x, k: int) -> list:  # noqa: ANN001 - ChainBounds, array
    """Kernel k's real-arithmetic pre-activations at every ReLU, then its output (float64, the
    weights as the kernel casts them): what the diagnostics sample."""
    import torch

    v = torch.as_tensor(x, dtype=torch.float64)
    out = []
    for st, m in zip(cb.chain.steps, cb.kernels[k].mats):
        if st.kind == "affine":
            (w, _), b, _ = m
            v = v @ w + (b[0] if b is not None else 0.0)
        elif st.kind == "shift":
            v = v + m[0]
        elif st.kind == "scale":
            v = v * m[0] if st.prim == "mul" else v / m[0]
        else:
            out.append(v.numpy().copy())
            v = v.clamp(min=0)
    return [*out, v.numpy()]


def _hull(v, pad: float = 0.05):  # noqa: ANN001, ANN202 - arrays
    a, b = v.min(0), v.max(0)
    w = pad * (b - a) + 1e-9
    return a - w, b + w


def diagnose(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from kcverify.dsl.vnnlib import load_vnnlib
    from kcverify.kernels.spec import parse_kernel_spec
    from kcverify.models.ir import load_onnx
    from kcverify.regions.chain import ChainBounds, extract_chain, one_thread
    from kcverify.regions.plan import ALPHA_ITERS, BATCH
    from kcverify.regions.property import DriftObjective
    from kcverify.regions.split import branch_and_bound, cut_options

    acas = data_dir()
    train = parse_kernel_spec("train", {"compute": "fp32", "accumulate": "fp32"})
    inf = parse_kernel_spec("inf", {"compute": "fp32", "accumulate": "fp32",
                                    "weights": {"format": "fp16", "scale": "none"}})
    lo, hi = (np.asarray(v, dtype=np.float64) for v in load_vnnlib(acas / "prop_1.vnnlib").box())
    rng = np.random.default_rng(0)
    eps = args.eps
    for net in nets(args.nets):
        g = load_onnx(acas / f"ACASXU_run2a_{net}_batch_2000.onnx")
        cb = ChainBounds(extract_chain(g), train, inf, alpha_iters=ALPHA_ITERS)
        obj = DriftObjective(cb, eps, hi - lo)
        with one_thread(), torch.no_grad():
            out = branch_and_bound(lo, hi, obj, budget_s=args.budget, batch=BATCH,
                                   clock=time.process_time, **cut_options(obj, True))
            print(f"\n{net} at eps {eps}: {out.verdict}, bound {out.bound:.4g}, "
                  f"{out.proved_fraction:.2%} proved, {out.parts_bounded} parts")
            opened = [lf for lf in out.leaves if not lf.proved]
            if not opened:
                continue
            L, H = np.array([lf.lo for lf in opened]), np.array([lf.hi for lf in opened])
            _diag_outputs(obj, L, H, eps)
            order = np.argsort([-lf.value for lf in opened])[:args.parts]
            print(f"{'part':>4} {'bound':>8} {'fwd-only':>9} {'drift smp':>9} {'value smp':>9} "
                  f"{'both smp':>9} {'sampled':>9} {'input cut':>9} {'relu split':>10}")
            for k in order:
                _diag_part(cb, obj, L[k:k + 1], H[k:k + 1], rng)
    return 0


PHASES = ("slope descent", "sound value", "sound drift", "cut choice")


def phase_clock(chain_mod, property_mod, chooser) -> tuple[dict[str, float], list]:  # noqa: ANN001
    """Wrap the domain's phases with CPU timers (a call inside another phase counts for the
    outer one: the descent's plain passes are descent); returns the totals and the undo list."""
    spent = dict.fromkeys(PHASES, 0.0)
    active: list[str] = []
    undo: list = []

    def timed(name: str, f):  # noqa: ANN001, ANN202
        def g(*a, **k):  # noqa: ANN002, ANN003, ANN202
            if active:
                return f(*a, **k)
            active.append(name)
            t = time.process_time()
            try:
                return f(*a, **k)
            finally:
                spent[name] += time.process_time() - t
                active.pop()
        return g
    for mod in (chain_mod, property_mod):
        for attr, name in (("optimise_slopes", "slope descent"), ("backward_value", "sound value"),
                           ("backward_drift", "sound drift")):
            if hasattr(mod, attr):
                undo.append((mod, attr, getattr(mod, attr)))
                setattr(mod, attr, timed(name, getattr(mod, attr)))
    undo.append((chooser, "evaluate", None))
    chooser.evaluate = timed("cut choice", chooser.evaluate)
    return spent, undo


def rate(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    import kcverify.regions.chain as chain_mod
    import kcverify.regions.property as property_mod
    from kcverify.dsl.vnnlib import load_vnnlib
    from kcverify.kernels.spec import parse_kernel_spec
    from kcverify.models.ir import load_onnx
    from kcverify.regions.chain import ChainBounds, extract_chain, one_thread
    from kcverify.regions.plan import ALPHA_ITERS, BATCH
    from kcverify.regions.property import DriftObjective
    from kcverify.regions.split import branch_and_bound, cut_options

    acas = data_dir()
    train = parse_kernel_spec("train", {"compute": "fp32", "accumulate": "fp32"})
    inf = parse_kernel_spec("inf", {"compute": "fp32", "accumulate": "fp32",
                                    "weights": {"format": "fp16", "scale": "none"}})
    lo, hi = (np.asarray(v, dtype=np.float64) for v in load_vnnlib(acas / "prop_1.vnnlib").box())
    print(f"{'net':<6} {'verdict':<8} {'bound':>9} {'parts':>6} {'rounds':>6} {'cpu s':>6} "
          f"{'parts/s':>7}  " + "  ".join(f"{p:>14}" for p in (*PHASES, "rest")))
    for net in nets(args.nets):
        g = load_onnx(acas / f"ACASXU_run2a_{net}_batch_2000.onnx")
        cb = ChainBounds(extract_chain(g), train, inf, alpha_iters=ALPHA_ITERS)
        obj = DriftObjective(cb, args.eps, hi - lo)
        opts = cut_options(obj, True)
        spent, undo = phase_clock(chain_mod, property_mod, opts["chooser"])
        c0 = time.process_time()
        try:
            with one_thread(), torch.no_grad():
                out = branch_and_bound(lo, hi, obj, budget_s=args.budget, batch=BATCH,
                                       clock=time.process_time, **opts)
        finally:
            for mod, attr, f in undo:
                if f is not None:
                    setattr(mod, attr, f)
        dc = time.process_time() - c0
        rest = dc - sum(spent.values())
        print(f"{net:<6} {out.verdict:<8} {out.bound:9.3g} {out.parts_bounded:6d} {out.rounds:6d} "
              f"{dc:6.1f} {out.parts_bounded / dc:7.1f}  "
              + "  ".join(f"{v:6.2f} ({v / dc:4.0%})" for v in (*spent.values(), rest)),
              flush=True)
    print(load())
    return 0


def _diag_outputs(obj, L, H, eps: float) -> None:  # noqa: ANN001 - DriftObjective, arrays
    """Which output decides the open parts, and the volume left by one clip of each part to the
    box hull of {x: the deciding linear bounds can exceed eps} (a clip keeps the whole part when
    every violated bound exceeds eps on the whole part)."""
    import numpy as np

    co: list = []
    mag = obj.bounds(L, H, co).numpy()
    n = mag.shape[1] // 2
    print(f"open parts {len(L)}: deciding output " + str(np.bincount(mag.argmax(1) % n,
                                                                      minlength=n).tolist()))
    lin = co[0].numpy()
    kept = []
    for b in range(len(L)):
        clo, chi = np.full(len(L[b]), np.inf), np.full(len(L[b]), -np.inf)
        for r in np.flatnonzero(mag[b] > eps):
            gap, a = mag[b, r] - eps, lin[b, r]
            lo2, hi2 = L[b].copy(), H[b].copy()
            pos, neg = a > 0, a < 0
            lo2[pos] = np.maximum(L[b][pos], H[b][pos] - gap / a[pos])
            hi2[neg] = np.minimum(H[b][neg], L[b][neg] + gap / -a[neg])
            clo, chi = np.minimum(clo, lo2), np.maximum(chi, hi2)
        w = H[b] - L[b]
        live = w > 0
        kept.append(float(np.prod(((chi - clo) / np.where(live, w, 1))[live]))
                    if np.isfinite(clo).all() else 0.0)
    print(f"one clip keeps {np.mean(kept):.1%} of their volume on average "
          f"(min {np.min(kept):.1%})")


def _diag_part(cb, obj, L, H, rng) -> None:  # noqa: ANN001 - one part (1, n)
    import numpy as np

    base = float(obj.bounds(L, H).amax())
    fwd = float(obj.chooser().bounds(L, H).amax())
    x = L + (H - L) * rng.random((20000, L.shape[1]))
    pt, pi = _preacts(cb, x, 0), _preacts(cb, x, 1)
    sampled = float(np.abs(pi[-1] - pt[-1]).max())
    chans = {"drift": [], "value": [], "both": []}
    for zt, zi in zip(pt[:-1], pi[:-1]):
        (tl, th), (il, ih), (dl, dh) = _hull(zt), _hull(zi), _hull(zi - zt)
        inf = np.full_like(tl, np.inf)
        chans["drift"].append(np.stack([-inf, inf, -inf, inf, dl, dh]))
        chans["value"].append(np.stack([tl, th, il, ih, -inf, inf]))
        chans["both"].append(np.stack([tl, th, il, ih, dl, dh]))
    oracle = {k: float(obj.bounds(L, H, prior=np.stack(v)[None]).amax()) for k, v in
              chans.items()}
    inter: list = []
    obj.bounds(L, H, inter=inter)
    P0 = inter[0].numpy()
    cuts, pri = [], []
    for d in np.flatnonzero(H[0] > L[0]):
        m = L[0, d] + 0.5 * (H[0, d] - L[0, d])
        a, b = np.repeat(L, 2, 0), np.repeat(H, 2, 0)
        a[1, d] = b[0, d] = m
        cuts.append(obj.bounds(a, b, prior=np.repeat(P0, 2, 0)).amax(-1).numpy().max())
    for li in range(P0.shape[1]):  # every unstable training neuron, both phases
        for ni in np.flatnonzero((P0[0, li, 0] < 0) & (P0[0, li, 1] > 0)):
            for ch, v in ((0, 0.0), (1, 0.0)):
                p = P0[0].copy()
                p[li, ch, ni] = v
                pri.append(p)
    relu = np.inf
    for k in range(0, len(pri), 256):
        chunk = np.stack(pri[k:k + 256])
        v = obj.bounds(np.repeat(L, len(chunk), 0), np.repeat(H, len(chunk), 0),
                       prior=chunk).amax(-1).numpy()
        relu = min(relu, float(np.maximum(v[0::2], v[1::2]).min()))
    print(f"{'':>4} {base:8.3g} {fwd:9.3g} {oracle['drift']:9.3g} {oracle['value']:9.3g} "
          f"{oracle['both']:9.3g} {sampled:9.2g} {min(cuts):9.3g} {relu:10.3g}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    a = sub.add_parser("neurodiff")
    a.add_argument("--eps", type=float, nargs="+", default=[0.05, 0.01])
    a.add_argument("--budget", type=float, default=120.0, help="seconds of splitting per net")
    a.add_argument("--nets", help="comma-separated, e.g. 1_1,2_3 (default: all 45)")
    t = sub.add_parser("rate")
    t.add_argument("--eps", type=float, default=0.05)
    t.add_argument("--budget", type=float, default=10.0, help="CPU seconds of splitting per net")
    t.add_argument("--nets", default="2_7,3_5")
    d = sub.add_parser("diagnose")
    d.add_argument("--eps", type=float, default=0.05)
    d.add_argument("--budget", type=float, default=8.0, help="CPU seconds of splitting per net")
    d.add_argument("--nets", default="2_7,3_5")
    d.add_argument("--parts", type=int, default=4, help="worst open parts examined per net")
    b = sub.add_parser("vnncomp")
    b.add_argument("--timeout", type=float, default=116.0)
    b.add_argument("--props", help="comma-separated property numbers (default: all)")
    b.add_argument("--nets", help="comma-separated networks (default: all)")
    b.add_argument("--limit", type=int, default=0)
    b.add_argument("--every", type=int, default=0,
                   help="every K-th instance of each property (a stratified sample)")
    for p in (a, b):
        p.add_argument("--cpu", action="store_true",
                       help="budgets in CPU seconds of this process, not wall-clock")
    args = ap.parse_args()
    if getattr(args, "cpu", False):
        import kcverify.regions.plan as plan

        plan.CLOCK = time.process_time
    if args.what == "diagnose":
        return diagnose(args)
    if args.what == "rate":
        return rate(args)
    return neurodiff(args) if args.what == "neurodiff" else vnncomp(args)


if __name__ == "__main__":
    sys.exit(main())
