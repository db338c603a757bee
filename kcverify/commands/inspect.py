"""`kcverify inspect` (not implemented yet)."""

from __future__ import annotations

import argparse

from kcverify.errors import KcverifyError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="(not implemented yet)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    raise KcverifyError("'kcverify inspect' is not implemented yet")
