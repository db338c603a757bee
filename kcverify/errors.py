"""The error hierarchy: one root, one type per subpackage, messages that say what, where, and
what would be accepted. The CLI turns any KcverifyError into one ``error: ...`` line and its
``exit_code`` (2: bad input). ``InternalError`` is the exception: a bug in kcverify itself (a bound
rule that returns an empty interval, NaN from finite inputs, a checker component that fails to load)
is not the user's bad input; the CLI prints a traceback and exits with ``INTERNAL_EXIT`` (3).
"""

from __future__ import annotations


class KcverifyError(Exception):
    """Root of every error kcverify reports to a user (bad input, unsupported model, ...)."""

    exit_code = 2

    def render(self) -> str:
        """The single line the CLI prints."""
        return f"error: {self}"


INTERNAL_EXIT = 3


class InternalError(Exception):
    """An internal inconsistency of kcverify (a soundness bug, a broken invariant): never bad input.

    Deliberately not a KcverifyError, so no ``except KcverifyError`` path can turn it into a
    verdict or an exit 2; the CLI reports it with a traceback and exit code ``INTERNAL_EXIT``.
    """

    exit_code = INTERNAL_EXIT


class LocatedError(KcverifyError):
    """An error at a place in a file: rendered ``file:line:col: error: message``."""

    def __init__(self, message: str, file: str | None = None, line: int | None = None,
                 column: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.file = file
        self.line = line
        self.column = column

    def where(self) -> str:
        parts = [self.file or "<input>"]
        if self.line is not None:
            parts.append(str(self.line))
            parts.append(str(self.column if self.column is not None else 1))
        return ":".join(parts)

    def render(self) -> str:
        return f"{self.where()}: error: {self.message}"

    def __str__(self) -> str:
        return self.render()


class ContractError(LocatedError):
    """A contract that does not parse or does not type-check."""


class KernelSpecError(LocatedError):
    """A kernel spec that names an unknown format or scaling, or is inconsistent."""


class InputFileError(KcverifyError):
    """A missing or unreadable data / input file."""


class ModelImportError(KcverifyError):
    """An ONNX file that cannot be read, checked or shape-inferred."""


class UnsupportedOpError(ModelImportError):
    """One or more ops with no implementation; the message lists every one with its node."""

    def __init__(self, missing: list[tuple[str, str, str]], registered: list[str],
                 what: str = "executor") -> None:
        # missing: (op_type, domain, node name)
        self.missing = missing
        by_op: dict[str, list[str]] = {}
        for op, domain, node in missing:
            key = op if domain in ("", "ai.onnx") else f"{domain}::{op}"
            by_op.setdefault(key, []).append(node)
        listing = "; ".join(f"{op} (nodes: {', '.join(repr(n) for n in nodes)})"
                            for op, nodes in sorted(by_op.items()))
        super().__init__(f"unsupported ONNX op(s) for the {what}: {listing}; "
                         f"supported: {', '.join(sorted(registered))}")


class BoundError(KcverifyError):
    """The bound engine cannot bound a node (no rule, no decomposition) or a rule misbehaved."""


class CertificateError(KcverifyError):
    """A certificate that is malformed or does not check."""

    exit_code = 1


class RegistryError(KcverifyError):
    """The registry refused an operation."""
