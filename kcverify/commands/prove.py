"""`kcverify prove CONTRACT MODEL`: decide every clause, write the certificate and reports."""

from __future__ import annotations

import argparse
from pathlib import Path

from kcverify.api import check_device, dumps
from kcverify.distributed import executor_for
from kcverify.planner import ProveOptions, prove
from kcverify.progress import ProveProgress


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "prove", help="decide a contract on a model and write its certificate",
        description="Decide every clause of CONTRACT on MODEL: proved / refuted (with a replayed "
                    "counterexample) / unknown formally, passed / failed empirically. Writes the "
                    "certificate next to the model (MODEL.kcert.json) unless --embed or --no-cert; "
                    "a certificate of another contract there is not replaced without --force. "
                    "Exit 0 when no clause is violated, 1 when a clause is refuted or failed, "
                    "2 for bad input.")
    p.add_argument("contract", help="the contract YAML file")
    p.add_argument("model", help="the ONNX model")
    p.add_argument("--report", type=Path, help="write the JSON report here")
    p.add_argument("--html", type=Path, help="write the self-contained HTML report here")
    p.add_argument("--cert", type=Path, help="certificate path (default MODEL.kcert.json)")
    p.add_argument("--embed", action="store_true",
                   help="embed the certificate in the ONNX metadata instead of a sidecar file")
    p.add_argument("--no-cert", action="store_true", help="do not write a certificate")
    p.add_argument("--force", action="store_true",
                   help="replace a certificate of another contract at the certificate's path "
                        "(default: refuse before proving, exit 2)")
    p.add_argument("--domain", default="best", choices=["interval", "linear", "best"],
                   help="bound domain (default best: the tightest of those available)")
    p.add_argument("--device", default="cpu", help="torch device for bounds and kernels")
    p.add_argument("--memory", metavar="SIZE",
                   help="memory budget of the bound engine (e.g. 4G, 512M, 50%%; default half "
                        "of physical memory): a method that cannot fit is replaced by intervals, "
                        "with a note")
    p.add_argument("--blocks", default="auto", choices=["auto", "segments", "whole"],
                   help="the blocks best bounds (docs/bounds.md, 'Block boundaries'): segments "
                        "(the segmenter's, boxes between them), whole (the whole graph as one "
                        "block, one input per run: tighter, minutes per input on transformers), "
                        "auto (default: segments, then the whole graph per input where a "
                        "clause's bound misses on a point slice of at most 16 inputs)")
    p.add_argument("--cases", type=int, default=0, metavar="N",
                   help="where a certified bound misses its threshold on point inputs with "
                        "unstable fp8 casts, prove it by cases over those casts, up to N cases "
                        "per input (kcverify.bounds.cases; the checker re-runs every case)")
    p.add_argument("--realizations", type=int, default=2,
                   help="conforming inference programs drawn per slice for counterexample search "
                        "and evidence (default 2)")
    p.add_argument("--confidence", type=float, default=0.95,
                   help="confidence of empirical decisions (default 0.95)")
    p.add_argument("--rules", action="append", default=[], metavar="MODULE",
                   help="a module or .py file registering extra composition rules (a rule with "
                        "'derives = QUANTITY' lets prove certify that quantity); repeatable")
    p.add_argument("--json", action="store_true", help="print the JSON report instead of a table")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--workers", type=int, metavar="N",
                   help="bound the slices in parallel on a local Ray with N workers "
                        "(kcverify[ray]); the certificate is the serial run's, byte for byte")
    p.add_argument("--ray-address", metavar="ADDR",
                   help="bound the slices on an existing Ray cluster (ray://host:10001, auto)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kcverify.bounds.memory import parse_size
    from kcverify.certs.rules import load_rule_modules
    from kcverify.report.page import write_report_html
    from kcverify.report.table import render_table
    from kcverify.report.writer import report_json, write_report_json

    load_rule_modules(args.rules)
    options = ProveOptions(memory=None if args.memory is None else parse_size(args.memory),
                           domain=args.domain, device=check_device(args.device),
                           blocks=args.blocks,
                           cases=args.cases,
                           realizations=args.realizations, confidence=args.confidence,
                           cert_path=args.cert, embed=args.embed,
                           write_certificate=not args.no_cert, force=args.force,
                           progress=None if args.quiet else ProveProgress())
    with executor_for(args.workers, args.ray_address, options.device) as options.executor:
        result = prove(args.contract, args.model, options)
    if args.json:
        print(dumps(report_json(result.report)))
    else:
        print(render_table(result.report))
        if result.cert_path is not None:
            print(f"certificate: {result.cert_path} ({result.report.summary()})")
    if args.report is not None:
        write_report_json(result.report, args.report)
        if not args.json:
            print(f"report: {args.report}")
    if args.html is not None:
        write_report_html(result.report, args.html)
        if not args.json:
            print(f"html report: {args.html}")
    return result.exit_code
