"""`kcverify replay TRACE_RECORD MODEL CONTRACT [--json]`: re-run one logged request under both
kernels with the executor, check its replay signature, and attribute its drift to sources.

TRACE_RECORD is FILE:LINE, FILE#REQUEST_ID, or a file holding one record. Exit 0 when the
signature reproduces and the drift is within the contract's certified bound, 1 otherwise (no
signature, a differing hash, or an unexplained drift), 2 for bad input.
"""

from __future__ import annotations

import argparse
import json
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "replay", help="replay a logged request under both kernels; attribute its drift",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("record", metavar="TRACE_RECORD",
                   help="FILE:LINE, FILE#REQUEST_ID, or a file holding one record")
    p.add_argument("model", help="the ONNX model")
    p.add_argument("contract", help="the contract YAML file (its kernels train and inf)")
    p.add_argument("--domain", default="interval", choices=["interval", "linear", "best"],
                   help="bound domain for the attribution (default interval: exact casts at a "
                        "point input, sharp on ReLU MLPs; best for transformers)")
    p.add_argument("--no-attribution", action="store_true", help="only check the signature")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kcverify.dsl import load_contract
    from kcverify.enforce.replay import find_record, replay_record

    contract = load_contract(args.contract)
    record = find_record(args.record)
    res = replay_record(record, args.model, contract, attribute=not args.no_attribution,
                        domain=args.domain)
    if args.json:
        print(json.dumps(res.to_json(), indent=2, sort_keys=True))
        return 0 if res.ok else 1
    w = sys.stdout.write
    w(f"{record.where}: request {record.request_id}, kernel {record.kernel_name}, build "
      f"{record.build}\n")
    for side, s in res.sides.items():
        if not s.signed:
            w(f"  {side:<5} no replay signature\n")
        else:
            state = ("reproduced" if s.reproducible else
                     f"diverges at audit point {s.first_divergence!r}")
            w(f"  {side:<5} {state} ({sum(a.match for a in s.audit)}/{len(s.audit)} audit "
              f"points match; program {s.program})\n")
        if s.logits_max_abs_diff is not None:
            w(f"        recorded vs replayed logits: max |diff| = {s.logits_max_abs_diff:.6g}\n")
        for pr in s.problems:
            w(f"        problem: {pr}\n")
    a = res.attribution
    if a is not None:
        w(f"  drift {a.verdict()}\n")
        for src in a.sources:
            b = "-" if src.bound is None else f"{src.bound:.6g}"
            w(f"    {src.source:<24} bound {b:>12}  {'could explain' if src.explains else 'cannot explain'}"
              f"{'  (' + src.note + ')' if src.note else ''}\n")
    w(f"replay: {'ok' if res.ok else 'NOT OK'}\n")
    return 0 if res.ok else 1
