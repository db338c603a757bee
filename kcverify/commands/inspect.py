"""`kcverify inspect MODEL [--json] [--against-ort]`: op census, unsupported ops, blocks with
digests and sizes, and optionally the executor's agreement with onnxruntime."""

from __future__ import annotations

import argparse

from kcverify.api import dumps
from kcverify.models.inspection import inspect_model, render


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="show a model's ops, unsupported ops and blocks",
                       description=__doc__)
    p.add_argument("model", help="ONNX file")
    p.add_argument("--json", action="store_true", help="print the report as strict JSON")
    p.add_argument("--against-ort", action="store_true",
                   help="compare the executor with onnxruntime on random inputs")
    p.add_argument("--batch", type=int, default=2, help="batch size of the random inputs")
    p.add_argument("--seq", type=int, default=16, help="length of symbolic non-batch dims")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    report = inspect_model(args.model, check_ort=args.against_ort, batch=args.batch,
                           seq=args.seq, seed=args.seed)
    print(dumps(report) if args.json else render(report))
    ort_rep = report.get("against_ort")
    return 1 if ort_rep is not None and not ort_rep["ok"] else 0
