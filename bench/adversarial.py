"""The adversarial soundness campaign (tests/soundness/adversarial/campaign.py), with its table:
per attack class, (input, conforming program pair) checks, violations, worst observed/certified
drift and worst excursion (distance from the certified interval's centre over its half-width;
> 1 is outside).

    python bench/adversarial.py                 # ~10^6 pairs (tens of minutes on 2 cores)
    python bench/adversarial.py --scale 0.05    # a quick look
    python bench/adversarial.py --parts mlp,rules --depth 4
    python bench/adversarial.py --parts fp8 --scale 0.75 --depth 4   # fp8 activations, ~30 min
    python bench/adversarial.py --parts conv --depth 4                # Conv geometries x specs
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    from tests.soundness.adversarial.campaign import (
        DEFAULT_PARTS,
        PARTS,
        by_family,
        led_total,
        run_campaign,
    )

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=1.0, help="batch sizes and pair counts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parts", default=",".join(DEFAULT_PARTS),
                    help=f"subset of {','.join(PARTS)} (default: {','.join(DEFAULT_PARTS)})")
    ap.add_argument("--depth", type=int, default=3, help="class path components in the table")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    if not commit and (ROOT / "COMMIT").exists():  # an exported tree (git archive) says so
        commit = (ROOT / "COMMIT").read_text().strip() + " (exported)"
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "kcverify"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    commit += " (kcverify/ has uncommitted changes)" if dirty else ""
    t0 = time.perf_counter()
    led = run_campaign(args.scale, args.seed, tuple(args.parts.split(",")),
                       log=lambda s: print(s, file=sys.stderr, flush=True))
    folded = by_family(led, args.depth)
    print(f"# commit {commit}, scale {args.scale}, seed {args.seed}, "
          f"{time.perf_counter() - t0:.0f} s, {torch.get_num_threads()} thread(s)")
    print(folded.report())
    bad = [v for st in led.classes.values() for v in st.violations]
    print(f"TOTAL pairs {led_total(led, 'campaign/')}  violations {len(bad)}")
    for v in bad[:10]:
        print("  " + v[:400])
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
