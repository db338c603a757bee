"""`kcverify check CERT MODEL CONTRACT`: re-check a certificate independently of the run that made
it. Exit 0 when it checks, 1 when it does not (each problem printed), 2 for bad input, 3 for an
internal error of kcverify (a bug: a checker component that cannot load; the traceback is
printed).

CERT may be the sidecar JSON, or the ONNX model itself when the certificate is embedded in it.
--json prints one strict JSON object (no NaN or Infinity: an infinite bound is the string "inf").
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check", help="re-check a certificate against its model and contract",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cert", help="certificate (MODEL.kcert.json), or an ONNX file that embeds one")
    p.add_argument("model", help="the ONNX model")
    p.add_argument("contract", help="the contract (YAML)")
    p.add_argument("--rules", action="append", default=[], metavar="MODULE",
                   help="import a module (dotted name or .py file) that registers extra "
                   "composition rules; repeatable")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also print notes and each clause's proof tree")
    p.add_argument("--json", action="store_true",
                   help="print the outcome as one JSON object (ok, problems, notes, clauses)")
    p.set_defaults(func=run)


def _number(v: Any) -> Any:
    """A certificate float (hex string) as a JSON number; infinities as "inf" / "-inf"."""
    if v is None:
        return None
    from kcverify.certs.encoding import unfx

    f = unfx(v)
    return f if math.isfinite(f) else ("inf" if f > 0 else "-inf")


def report_json(report: Any) -> dict[str, Any]:
    """The check's outcome as strict JSON: ok, problems, notes, and each clause's id, family,
    hardness, verdict, method, bound, threshold and comparison."""
    clauses = []
    if report.statement is not None:
        for c in report.statement["predicate"]["clauses"]:
            clauses.append({"id": c["id"], "family": c["family"], "hard": c["hard"],
                            "verdict": c["verdict"], "method": c["method"],
                            "bound": _number(c.get("bound")),
                            "threshold": _number(c.get("threshold")), "op": c.get("op")})
    return {"ok": report.ok, "problems": list(report.problems), "notes": list(report.notes),
            "clauses": clauses}


def run(args: argparse.Namespace) -> int:
    from kcverify.certs.checker import check_certificate
    from kcverify.certs.rules import load_rule_modules

    load_rule_modules(args.rules)
    report = check_certificate(args.cert, args.model, args.contract)
    if args.json:
        print(json.dumps(report_json(report), indent=1, sort_keys=True, allow_nan=False))
        return 0 if report.ok else 1
    if args.verbose and report.statement is not None:
        from kcverify.certs.describe import describe_certificate

        print("\n".join(describe_certificate(report.statement)))
    if args.verbose or not report.ok:
        for note in report.notes:
            print(f"note: {note}")
    if report.ok:
        n = len(report.statement["predicate"]["clauses"]) if report.statement else 0
        print(f"ok: certificate checks ({n} clauses)")
        return 0
    for p in report.problems:
        print(f"FAIL: {p}")
    print(f"certificate does not check: {len(report.problems)} problem(s)")
    return 1
