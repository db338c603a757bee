"""The typed contract model (frozen dataclasses) that `load_contract` builds."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kcverify.dsl.ast import Expr, to_text
from kcverify.kernels.spec import KernelSpec

LEVELS = ("L0", "L1", "L2", "L3")
ACTIONS = ("log", "warn", "guard", "fallback", "block")
DEFAULT_ESCALATION = {"L0": "log", "L1": "log", "L2": "guard", "L3": "fallback"}
FAMILIES = ("numerical", "statistical", "behavioral", "runtime", "observability")
CLASSES = ("certifiable", "empirical", "static")
REGION_SPACES = ("input", "embedding")
REGION_NORMS = ("linf", "l2")


def _pos() -> Any:
    return field(default=None, compare=False, repr=False, kw_only=True)


@dataclass(frozen=True)
class ModelRef:
    """The model a contract is about: an ONNX path (relative to the contract) and its digest."""

    onnx: str | None = None
    sha256: str = "auto"  # "auto": digest taken when proving; else 64 hex digits to match


@dataclass(frozen=True)
class Region:
    """A continuous neighbourhood of every slice input: {x' : ||x' - x||_norm <= eps} in space."""

    space: str
    norm: str
    eps: float


@dataclass(frozen=True)
class Slice:
    """A finite set of inputs (an .npz file), optionally filtered, optionally thickened to a region.

    ``where`` is a condition over ``len`` (the input's token count); ``inputs`` is as written,
    relative to the contract file (see Contract.resolve). ``traces``: a JSONL trace file whose
    records all belong to this slice (kcverify monitor / promote, docs/enforcement.md); a slice
    given only by traces has ``inputs`` "" and cannot be evaluated offline.
    """

    name: str
    inputs: str
    where: Expr | None = None
    region: Region | None = None
    traces: str | None = None
    line: int | None = _pos()
    column: int | None = _pos()


@dataclass(frozen=True)
class Clause:
    """One clause in normal form: ``expr`` is the explicit first-order condition.

    klass: certifiable | empirical | static (semantics §1.2). hard: no budget (must hold outright).
    budget: for a soft clause, the fraction of units (inputs, or timed calls) allowed to violate
    the threshold; kcverify.empirical decides the exceedance rate with one-sided Clopper-Pearson
    bounds at its confidence level.
    metric/threshold: the short form's metric name and threshold (threshold also filled in for
    an explicit condition of the shape ``Q op NUMBER``).
    """

    id: str
    family: str
    expr: Expr
    level: str
    action: str
    klass: str
    hard: bool
    metric: str | None = None
    threshold: float | None = None
    budget: float | None = None
    slices: tuple[str, ...] = ()
    temperature: float = 1.0
    form: str = "assert"  # "assert" (explicit) or "metric" (short form, desugared)
    description: str | None = None
    line: int | None = _pos()
    column: int | None = _pos()

    @property
    def text(self) -> str:
        """The condition in normal form (what `kcverify lint` prints)."""
        return to_text(self.expr)


@dataclass(frozen=True)
class Contract:
    """A parsed, type-checked contract."""

    name: str
    version: str
    model: ModelRef
    kernels: Mapping[str, KernelSpec]
    slices: Mapping[str, Slice]
    clauses: tuple[Clause, ...]
    escalation: Mapping[str, str]
    path: Path
    sha256: str
    temperature: float = 1.0
    description: str | None = None

    def resolve(self, relative: str) -> Path:
        """A path written in the contract, resolved against the contract's directory."""
        p = Path(relative)
        return p if p.is_absolute() else (self.path.parent / p)

    def clause(self, clause_id: str) -> Clause:
        for c in self.clauses:
            if c.id == clause_id:
                return c
        raise KeyError(clause_id)
