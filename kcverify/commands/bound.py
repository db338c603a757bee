"""`kcverify bound MODEL CONTRACT --inputs FILE [--domain D] [--device cpu|cuda] [--json]`:
certified drift bounds between the contract's kernels ``train`` and ``inf``, one per input.

``--json`` prints strict JSON (schema kcverify/schemas/bound.schema.json): an infinite bound is
the string "inf"."""

from __future__ import annotations

import argparse
import sys

from kcverify.api import bound, check_device, dumps, kernels_of

load_kernels = kernels_of  # the contract's kernels 'train' and 'inf' (bench/, tests)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bound", help="certified drift bounds between the contract's two kernels",
                       description="Bound max |z_inf - z_train| over the model's output for each "
                                   "input, for every pair of programs conforming to the "
                                   "contract's kernels 'train' and 'inf'.")
    p.add_argument("model", help="the ONNX model")
    p.add_argument("contract", help="the contract YAML file (its kernels 'train' and 'inf')")
    p.add_argument("--inputs", required=True,
                   help=".npy (a batch for the model's single input) or .npz keyed by input name")
    p.add_argument("--domain", default="best", choices=["interval", "linear", "best"],
                   help="abstract domain (default: best)")
    p.add_argument("--device", default="cpu", help="torch device for the bound computation")
    p.add_argument("--memory", metavar="SIZE",
                   help="memory budget of the bound engine (e.g. 4G, 512M, 50%%; default half "
                        "of physical memory): a method that cannot fit is replaced by intervals, "
                        "with a note")
    p.add_argument("--eps", type=float, default=0.0,
                   help="bound over a box (L-inf ball) of this radius around each input")
    p.add_argument("--space", default="input", choices=["input", "embedding"],
                   help="where the --eps box lives (token models: embedding)")
    p.add_argument("--workers", type=int, metavar="N",
                   help="bound the inputs in parallel on a local Ray with N workers "
                        "(kcverify[ray]; the relational domains bound one input per task)")
    p.add_argument("--ray-address", metavar="ADDR",
                   help="bound the inputs on an existing Ray cluster (ray://host:10001, auto)")
    p.add_argument("--cases", type=int, default=0, metavar="N",
                   help="prove each input by cases over its unstable fp8 casts, up to N cases per "
                        "input (interval or best domain, point inputs; docs/bounds.md)")
    p.add_argument("--threshold", type=float, metavar="T",
                   help="with --cases: split a case only while its bound exceeds T, on the casts "
                        "that drive the output elements above T (a clause's threshold)")
    p.add_argument("--json", action="store_true",
                   help="print strict JSON (an infinite bound is the string \"inf\")")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kcverify.bounds.memory import parse_size
    from kcverify.progress import Bar

    check_device(args.device)
    bar: Bar | None = None

    def progress(done: int, total: int) -> None:
        """Inputs bounded so far: a bar with ETA on a terminal, else a line per input. By cases:
        a line per case bounded (the tree grows as it goes: no total to show a bar against)."""
        nonlocal bar
        if args.cases:
            sys.stderr.write(f"kcverify bound: case {done} bounded ({total} cases so far)\n")
        elif total > 1:
            bar = bar or Bar("kcverify bound: input", total, unit="input")
            bar.update(done)

    try:
        res = bound(args.model, args.contract, args.inputs, domain=args.domain,
                    device=args.device, eps=args.eps, space=args.space, workers=args.workers,
                    ray_address=args.ray_address, progress=progress, cases=args.cases,
                    threshold=args.threshold,
                    memory=None if args.memory is None else parse_size(args.memory))
    finally:
        if bar is not None:
            bar.close()
    for note in res.notes:
        sys.stderr.write(f"kcverify bound: memory: {note}\n")
    if args.json:
        print(dumps(res.to_json()))
        return 0
    w = sys.stdout.write
    how = res.domain if not args.cases else f"{res.domain} by cases, <= {args.cases} per input"
    if args.cases and args.threshold is not None:
        how += f", split while above {args.threshold:g}"
    w(f"{args.model}: certified drift bounds (kernels train -> inf, domain {how}, "
      f"{len(res.blocks)} blocks, {res.seconds:.2f} s)\n")
    for k, v in enumerate(res.linf):
        unstable = ("" if res.unstable_casts is None
                    else f"   unstable casts {int(res.unstable_casts[k])}")
        w(f"  input {k:>4}  linf <= {float(v):.6g}{unstable}\n")
    return 0
