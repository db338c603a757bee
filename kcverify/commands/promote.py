"""`kcverify promote CONTRACT --stage ci|shadow|canary|full [--traces T] [--json]`: decide one
stage of the promotion pipeline and append the decision record to the registry's promotion log.

Exit 0 go, 1 no-go (each reason names the clause and slice), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "promote", help="decide one promotion stage (ci, shadow, canary, full) on logged traces",
        description="Decide one stage of the promotion pipeline for CONTRACT: ci (numerical "
                    "clauses offline: traces or the model's certificate), shadow (+ statistical "
                    "on mirrored traffic), canary (+ runtime under live load), full (canary's "
                    "clauses sustained over a stability window). Observability is the "
                    "precondition of every stage. Hard clauses block; soft clauses pass by "
                    "their budget (Clopper-Pearson). The decision record is appended to the "
                    "registry's promotion log. Exit 0 go, 1 no-go, 2 bad input.")
    p.add_argument("contract", help="the contract YAML file")
    p.add_argument("--stage", required=True, choices=["ci", "shadow", "canary", "full"])
    p.add_argument("--traces", action="append", default=[], metavar="FILE",
                   help="trace file (JSONL); repeatable (default: the contract's trace slices)")
    p.add_argument("--build", help="the candidate build, when the traces hold several")
    p.add_argument("--model", help="the ONNX model (default: the contract's model.onnx)")
    p.add_argument("--cert", help="ci without traces: the certificate (default MODEL.kcert.json)")
    p.add_argument("--window", default="300s", help="full: monitor window width (default 300s)")
    p.add_argument("--stability", default="30m",
                   help="full: how long compliance must be sustained (default 30m)")
    p.add_argument("--health-threshold", type=float, default=0.1, metavar="H",
                   help="full: the largest H a compliant window may reach (default 0.1)")
    p.add_argument("--confidence", type=float, default=0.95,
                   help="confidence of the empirical decisions (default 0.95)")
    p.add_argument("--skip-bad", action="store_true",
                   help="skip malformed trace lines with a warning (the stage is then no-go)")
    p.add_argument("--registry", metavar="DIR", help="registry directory (default: "
                   "$KCVERIFY_REGISTRY or ~/.kcverify/registry)")
    p.add_argument("--no-log", action="store_true", help="do not append to the registry's log")
    p.add_argument("--json", action="store_true", help="print the decision record as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kcverify.enforce.promote import PromotionOptions, decide, log_promotion
    from kcverify.enforce.traces import parse_duration

    options = PromotionOptions(
        traces=args.traces, build=args.build, model=args.model, cert=args.cert,
        window_s=parse_duration(args.window), stability_s=parse_duration(args.stability),
        health_threshold=args.health_threshold, confidence=args.confidence,
        skip_bad=args.skip_bad, warn=lambda m: print(m, file=sys.stderr))
    promotion = decide(args.contract, args.stage, options)
    record = promotion.record()
    log_id = None if args.no_log else log_promotion(promotion, args.registry)
    record["log_id"] = log_id
    if args.json:
        print(json.dumps(record, indent=2, sort_keys=True))
        return promotion.exit_code
    w = sys.stdout.write
    k = promotion.kernel
    w(f"stage {promotion.stage}: {promotion.decision.upper()}  contract "
      f"{promotion.contract.name} {promotion.contract.version}, build {k.get('build') or '-'}\n")
    for o in promotion.clauses:
        value = "-" if o.value is None else f"{o.value:.4g}"
        cond = "" if o.threshold is None else f"{o.direction} {o.threshold:g}"
        w(f"  {o.id:<12} {o.family:<13} {o.verdict:<8} {value:>10} {cond:<12} n={o.n}\n")
    for r in promotion.reasons:
        w(f"  no-go: {r}\n")
    if log_id is not None:
        w(f"logged: promotion {log_id} in the registry\n")
    return promotion.exit_code
