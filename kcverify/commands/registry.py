"""`kcverify registry` (not implemented yet)."""

from __future__ import annotations

import argparse

from kcverify.errors import KcverifyError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("registry", help="(not implemented yet)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    raise KcverifyError("'kcverify registry' is not implemented yet")
