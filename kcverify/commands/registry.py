"""`kcverify registry admit|list|show|verify|revoke|log`: the admission gate and its store.

The registry lives in --registry DIR, else $KCVERIFY_REGISTRY, else ~/.kcverify/registry.
admit: exit 0 admitted, 1 rejected (the reasons are printed and logged), 2 bad input.
  The policy: hard numerical clauses at L2 and L3 must be proved, at L0 and L1 evidence
  (passed) suffices; --require LEVEL=proved|evidence changes one level (repeatable).
verify: exit 0 when every admitted entry re-checks (from its stored files, under the policy it
  was admitted with), 1 otherwise.
Every action: 3 for an internal error of kcverify (a bug; the traceback is printed).
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("registry", help="admit certified models; list, show, verify, revoke",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--registry", metavar="DIR", help="registry directory (default: "
                   "$KCVERIFY_REGISTRY or ~/.kcverify/registry)")
    p.add_argument("--rules", action="append", default=[], metavar="MODULE",
                   help="import a module (dotted name or .py file) that registers extra "
                   "composition rules; repeatable")
    rs = p.add_subparsers(dest="registry_command", metavar="ACTION", required=True)
    a = rs.add_parser("admit", help="admit MODEL CONTRACT CERT if the certificate checks and "
                      "every hard clause holds")
    a.add_argument("model")
    a.add_argument("contract")
    a.add_argument("cert", nargs="?", help="certificate JSON, or the ONNX model when it is "
                   "embedded (default: MODEL.kcert.json, else the certificate embedded in MODEL)")
    a.add_argument("--require", action="append", default=[], metavar="LEVEL=proved|evidence",
                   help="what a hard numerical clause of LEVEL needs: a proof, or evidence "
                   "(passed) suffices; repeatable (default: L2=proved L3=proved, L0 and L1 "
                   "evidence)")
    a.set_defaults(func=_admit)
    ls = rs.add_parser("list", help="list entries")
    ls.add_argument("--all", action="store_true", help="include revoked entries")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=_list)
    sh = rs.add_parser("show", help="show one entry, its clauses and its decisions")
    sh.add_argument("id")
    sh.add_argument("--json", action="store_true")
    sh.set_defaults(func=_show)
    v = rs.add_parser("verify", help="re-check every admitted entry (or one) from the store")
    v.add_argument("id", nargs="?")
    v.set_defaults(func=_verify)
    r = rs.add_parser("revoke", help="revoke an entry")
    r.add_argument("id")
    r.add_argument("--reason", required=True)
    r.set_defaults(func=_revoke)
    lg = rs.add_parser("log", help="the decision log (admit, reject, revoke) with reasons, and the "
                                   "promotion decisions of kcverify promote")
    lg.add_argument("--json", action="store_true")
    lg.set_defaults(func=_log)


def _registry(args: argparse.Namespace) -> Any:
    from kcverify.certs.rules import load_rule_modules
    from kcverify.registry import Registry

    load_rule_modules(args.rules)
    return Registry(args.registry)


def _admit(args: argparse.Namespace) -> int:
    from kcverify.registry.store import parse_policy, policy_text

    policy = parse_policy(args.require)  # bad --require: one error line, exit 2, nothing logged
    cert = args.cert
    if cert is None:
        from kcverify.certs.attach import find_certificate

        cert = find_certificate(args.model)[0]
    d = _registry(args).admit(args.model, args.contract, cert, policy)
    if d.admitted:
        print(f"admitted: entry {d.entry_id}" + (" (already admitted)" if d.duplicate else "")
              + f" under policy {policy_text(policy)}")
        return 0
    print(f"rejected (policy {policy_text(policy)}):")
    for r in d.reasons:
        print(f"  - {r}")
    return 1


def _list(args: argparse.Namespace) -> int:
    entries = _registry(args).entries(None if args.all else "admitted")
    if args.json:
        print(json.dumps(entries, indent=1, sort_keys=True))
        return 0
    if not entries:
        print("(no entries)")
    for e in entries:
        print(f"{e['id']:>4}  {e['status']:<8}  {e['contract_id']}@{e['contract_version']:<10}  "
              f"{e['model_name']}  model {e['model_sha256'][:12]}  cert "
              f"{e['certificate_sha256'][:12]}  {e['admitted_at']}")
    return 0


def _show(args: argparse.Namespace) -> int:
    reg = _registry(args)
    e = reg.entry(args.id)
    decisions = reg.decisions(e["id"])
    if args.json:
        print(json.dumps({"entry": e, "decisions": decisions}, indent=1, sort_keys=True))
        return 0
    print(f"entry {e['id']}: {e['status']}" +
          (f" ({e['revoke_reason']}, {e['revoked_at']})" if e["status"] == "revoked" else ""))
    print(f"  contract  {e['contract_id']}@{e['contract_version']}  {e['contract_name']}  "
          f"{e['contract_sha256']}")
    print(f"  model     {e['model_name']}  {e['model_sha256']}")
    for k, dg in sorted(e["kernel_digests"].items()):
        print(f"  kernel    {k}  {dg}")
    print(f"  cert      {e['certificate_sha256']}")
    print(f"  policy    {e['policy'] or '(none recorded)'}")
    for f in e["files"]:
        print(f"  file      {f['role']:<10} {f['path']}  {f['sha256']}")
    for c in e["clauses"]:
        print(f"  clause    {c['id']:<12} {'hard' if c['hard'] else 'soft'}  {c['verdict']}")
    for d in decisions:
        print(f"  {d['at']}  {d['action']}: {d['reason']}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    results = _registry(args).verify(args.id)
    bad = [r for r in results if not r.ok]
    for r in results:
        print(f"entry {r.entry_id}: {'ok' if r.ok else 'FAIL'}")
        for p in r.problems:
            print(f"  - {p}")
    print(f"{len(results) - len(bad)} of {len(results)} entries re-check")
    return 1 if bad else 0


def _revoke(args: argparse.Namespace) -> int:
    e = _registry(args).revoke(args.id, args.reason)
    print(f"revoked: entry {e['id']} ({e['revoke_reason']})")
    return 0


def _log(args: argparse.Namespace) -> int:
    reg = _registry(args)
    ds, ps = reg.decisions(), reg.promotions()
    if args.json:
        print(json.dumps({"decisions": ds, "promotions": ps}, indent=1, sort_keys=True))
        return 0
    for d in ds:
        entry = f"entry {d['entry_id']}" if d["entry_id"] is not None else "no entry"
        print(f"{d['id']:>4}  {d['at']}  {d['action']:<6}  {entry}: {d['reason']}")
    for p in ps:
        model = (p.get("model_sha256") or "?")[:12]
        print(f"   p{p['id']:<3} {p['at']}  promote {p['stage']:<6} {p['decision']:<5}  model {model}")
    return 0
