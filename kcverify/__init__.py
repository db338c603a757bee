"""kcverify: formal verification of training-inference kernel contracts.

A kernel contract states how far the inference kernel of a model may drift from its training
kernel at identical weights. kcverify decides each clause formally where it can (sound bound
propagation of the drift, SMT for small blocks), falls back to measured evidence elsewhere, and
writes a certificate that an independent checker re-verifies (docs/certificates.md).

The Python API (docs/api.md), imported on first use so that ``import kcverify`` stays light:

    kcverify.load_contract(path)                  -> kcverify.dsl.Contract
    kcverify.prove(contract, model, ...)          -> kcverify.planner.ProveResult
    kcverify.check(cert, model, contract)         -> kcverify.certs.checker.CheckReport
    kcverify.bound(model, contract, inputs, ...)  -> kcverify.api.BoundResult
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

from kcverify.errors import KcverifyError  # noqa: E402

if TYPE_CHECKING:
    from kcverify.api import bound, check, load_contract, prove

_API = ("bound", "check", "load_contract", "prove")

__all__ = ["KcverifyError", "__version__", "bound", "check", "load_contract", "prove"]


def __getattr__(name: str) -> Any:
    """The API functions, from kcverify.api on first access (PEP 562)."""
    if name in _API:
        from kcverify import api

        value = getattr(api, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kcverify' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_API})
