"""Command line: parse arguments, call the library, render. No logic lives here.

Each sub-command is a module in kcverify.commands exposing ``register(subparsers)``, which adds
its parser and sets ``func(args) -> int``. Exit codes: 0 success, 1 a clause/certificate does not
hold, 2 bad input (one ``error:`` line, no traceback), 3 an internal error of kcverify itself (a
bug: the traceback is printed).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback
from collections.abc import Sequence

from kcverify import __version__
from kcverify.errors import INTERNAL_EXIT, InternalError, KcverifyError

COMMANDS = ("lint", "inspect", "bound", "prove", "check", "registry", "mlflow", "monitor",
            "promote", "replay", "vnnlib")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kcverify", description="Prove or refute training-inference kernel contracts.")
    parser.add_argument("--version", action="version", version=f"kcverify {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        module = importlib.import_module(f"kcverify.commands.{name}")
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    try:
        return int(args.func(args))
    except KcverifyError as e:
        print(e.render(), file=sys.stderr)
        return e.exit_code
    except InternalError:
        traceback.print_exc()
        print("error: internal error in kcverify (a bug, not bad input); please report it with the "
              "traceback above", file=sys.stderr)
        return INTERNAL_EXIT
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception:  # anything else escaping a command is a bug too, never "bad input"
        traceback.print_exc()
        print("error: internal error in kcverify (an unexpected exception, not bad input); "
              "please report it with the traceback above", file=sys.stderr)
        return INTERNAL_EXIT


if __name__ == "__main__":
    sys.exit(main())
