"""`kcverify lint CONTRACT [--json]`: validate a contract on its own (no model or data files)."""

from __future__ import annotations

import argparse
import json

from kcverify.dsl import load_contract
from kcverify.dsl.describe import describe
from kcverify.dsl.quantities import query_text


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("lint", help="validate a contract and print its clauses in normal form",
                       description="Validate a contract alone (never opens the model or data "
                                   "files); print each clause in normal form with its class.")
    p.add_argument("contract", help="the contract YAML file")
    p.add_argument("--json", action="store_true", help="print a JSON summary instead")
    p.set_defaults(func=run)


def _kernel(spec: dict) -> str:
    parts = [f"compute {spec['compute']}", f"accumulate {spec['accumulate']}"]
    for role in ("weights", "activations"):
        if role in spec:
            parts.append(f"{role} {spec[role]['format']}/{spec[role]['scale']}")
    if spec.get("rounding") != "nearest":
        parts.append(f"rounding {spec['rounding']}")
    return ", ".join(parts)


def run(args: argparse.Namespace) -> int:
    info = describe(load_contract(args.contract))
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True))
        return 0
    print(f"{args.contract}: contract {info['contract']} {info['version']} "
          f"(sha256 {info['sha256'][:12]}): ok")
    for name, spec in info["kernels"].items():
        print(f"  kernel {name:<6} {_kernel(spec)}")
    for name, s in info["slices"].items():
        extra = f"  where {s['where']}" if s["where"] else ""
        if s["region"]:
            r = s["region"]
            extra += f"  region {r['space']} {r['norm']} eps={r['eps']:g}"
        print(f"  slice  {name:<10} {s['inputs']}{extra}")
    for c in info["clauses"]:
        soft = "hard" if c["hard"] else f"budget {c['budget']:g}"
        print(f"  {c['id']}: [{c['class']}] {c['family']}, {c['level']} -> {c['action']}, "
              f"{soft}")
        print(f"      {c['condition']}")
        for q in c["queries"]:
            print(f"      certify: {query_text(q)}")
    return 0
