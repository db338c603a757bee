"""`kcverify mlflow admit [--tracking-uri URI] NAME VERSION CONTRACT [--cert CERT] [--alias ALIAS]`:
the MLflow Model Registry gate (kcverify[mlflow]; docs/mlflow.md). Exit 0 admitted, 1 rejected,
2 bad input (nothing written to the registry)."""

from __future__ import annotations

import argparse

from kcverify.api import check_device, dumps


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("mlflow", help="gate MLflow Model Registry versions on a contract",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = p.add_subparsers(dest="mlflow_command", metavar="ACTION", required=True)
    a = actions.add_parser(
        "admit", help="prove (or check) a model version, tag it, and alias it when admitted",
        description="Download model version NAME/VERSION (its ONNX with external data), prove "
                    "CONTRACT on it (or check --cert), log the certificate to the version's run, "
                    "set the kcverify.* version tags, and point --alias at the version only "
                    "when it is admitted. Exit 0 admitted, 1 rejected, 2 bad input.")
    a.add_argument("name", help="registered model name")
    a.add_argument("version", help="model version")
    a.add_argument("contract", help="the contract YAML (its slice files next to it)")
    a.add_argument("--tracking-uri", help="MLflow tracking URI (default: MLFLOW_TRACKING_URI)")
    a.add_argument("--registry-uri", help="MLflow registry URI (default: the tracking URI)")
    a.add_argument("--cert", help="check this certificate instead of proving")
    a.add_argument("--alias", help="alias to point at the version when admitted (e.g. champion)")
    a.add_argument("--require", action="append", default=[], metavar="LEVEL=proved|evidence",
                   help="admission policy override, as for 'kcverify registry admit'")
    a.add_argument("--device", default="cpu", help="torch device for the proof")
    a.add_argument("--json", action="store_true", help="print the decision as strict JSON")
    a.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    a.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kcverify.integrations.mlflow import admit
    from kcverify.progress import ProveProgress

    res = admit(args.name, args.version, args.contract, tracking_uri=args.tracking_uri,
                registry_uri=args.registry_uri, cert=args.cert, alias=args.alias,
                policy=args.require, device=check_device(args.device),
                progress=None if args.quiet else ProveProgress())
    if args.json:
        print(dumps(res.to_json()))
        return res.exit_code
    verdict = "admitted" if res.admitted else "rejected"
    print(f"{res.name} version {res.version}: {verdict} under {res.contract} "
          f"{res.contract_version} (certificate sha256 {res.certificate_sha256[:12]})")
    for r in res.reasons:
        print(f"  reason: {r}")
    for n in res.notes:
        print(f"  note: {n}")
    if res.alias:
        print(f"  alias {res.alias!r} -> version {res.version}")
    for a in res.artifacts:
        print(f"  logged runs:/{res.run_id}/{a}")
    return res.exit_code
