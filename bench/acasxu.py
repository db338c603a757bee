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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    a = sub.add_parser("neurodiff")
    a.add_argument("--eps", type=float, nargs="+", default=[0.05, 0.01])
    a.add_argument("--budget", type=float, default=120.0, help="seconds of splitting per net")
    a.add_argument("--nets", help="comma-separated, e.g. 1_1,2_3 (default: all 45)")
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
    if args.cpu:
        import kcverify.regions.plan as plan

        plan.CLOCK = time.process_time
    return neurodiff(args) if args.what == "neurodiff" else vnncomp(args)


if __name__ == "__main__":
    sys.exit(main())
