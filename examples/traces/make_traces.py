"""Generate the E5 traces: 40 minutes of served requests with a kernel fault at minute 20.

    python examples/traces/make_traces.py                 # writes out/traces/{traces,clean,faulty}.jsonl
    python examples/traces/make_traces.py --fault-at 13 --factor 20 --seed 7 --out out/other

Deterministic: the same arguments give byte-identical files. Requests are drawn (seeded) from
the contract's first slice; both kernels' logits come from conforming programs of the
contract's kernel specs (kcverify.kernels.realize, batch 1), and from --fault-at on a new build
serves them with the drift multiplied by --factor (kcverify.enforce.synthetic). The traces are
split at the fault into the clean and the faulty half for `kcverify promote`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kcverify.enforce.synthetic import FaultPlan, split_at, synthetic_traces

HERE = Path(__file__).resolve().parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contract", default=str(HERE / "contract.yaml"))
    p.add_argument("--out", default="out/traces", help="output directory (default out/traces)")
    p.add_argument("--minutes", type=float, default=40.0)
    p.add_argument("--fault-at", type=float, default=20.0, help="minute of the build change")
    p.add_argument("--factor", type=float, default=50.0, help="drift multiplier of the fault")
    p.add_argument("--rate", type=float, default=30.0, help="requests per minute")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan = FaultPlan(minutes=args.minutes, fault_at=args.fault_at, factor=args.factor,
                     rate=args.rate, seed=args.seed)
    summary = synthetic_traces(args.contract, out / "traces.jsonl", plan)
    clean, faulty = split_at(out / "traces.jsonl", summary["fault_at"], out / "clean.jsonl",
                             out / "faulty.jsonl")
    summary.update(clean=clean, faulty=faulty)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
