"""The syntax tree of clause expressions, and its printer.

Nodes are frozen dataclasses. Each carries the ``line`` and ``column`` (1-based) where it starts in
the contract file; positions are excluded from equality, so ``parse(to_text(e)) == e`` compares
structure only. Canonical trees: a number literal is never negative (``-1`` is ``Neg(Num(1))``),
a quantifier binds one variable (``forall x in s, t: b`` is ``forall x in s: forall t: b``), a
comparison is binary (``a <= b < c`` is ``a <= b and b < c``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, replace

KEYWORDS = frozenset({"forall", "exists", "in", "and", "or", "not", "implies"})
COMPARISONS = ("<=", "<", ">=", ">", "==", "!=")


def _pos() -> int | None:
    return field(default=None, compare=False, repr=False, kw_only=True)  # type: ignore[return-value]


@dataclass(frozen=True)
class Expr:
    """Base of every expression node."""

    line: int | None = _pos()
    column: int | None = _pos()

    def children(self) -> tuple[Expr, ...]:
        return ()

    def __str__(self) -> str:
        return to_text(self)


@dataclass(frozen=True)
class Num(Expr):
    """A non-negative finite number literal."""

    value: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.value) and self.value >= 0):
            raise ValueError(f"a number literal is finite and >= 0, not {self.value!r}")


@dataclass(frozen=True)
class Str(Expr):
    """A string literal (only static clauses use them, e.g. has_metadata("key"))."""

    value: str


@dataclass(frozen=True)
class Var(Expr):
    """A variable: an input bound to a slice, a token position, or a slice attribute (len)."""

    name: str


@dataclass(frozen=True)
class Neg(Expr):
    operand: Expr

    def children(self) -> tuple[Expr, ...]:
        return (self.operand,)


@dataclass(frozen=True)
class BinOp(Expr):
    """Arithmetic: op is one of + - * /."""

    op: str
    left: Expr
    right: Expr

    def children(self) -> tuple[Expr, ...]:
        return (self.left, self.right)


@dataclass(frozen=True)
class Call(Expr):
    """A function application: a norm, a model function, a runtime or static measurement."""

    func: str
    args: tuple[Expr, ...] = ()

    def children(self) -> tuple[Expr, ...]:
        return self.args


@dataclass(frozen=True)
class Compare(Expr):
    """A comparison: op is one of <= < >= > == !=."""

    op: str
    left: Expr
    right: Expr

    def children(self) -> tuple[Expr, ...]:
        return (self.left, self.right)


@dataclass(frozen=True)
class Not(Expr):
    operand: Expr

    def children(self) -> tuple[Expr, ...]:
        return (self.operand,)


@dataclass(frozen=True)
class BoolOp(Expr):
    """A connective: op is 'and', 'or' or 'implies' (implies is non-associative)."""

    op: str
    left: Expr
    right: Expr

    def children(self) -> tuple[Expr, ...]:
        return (self.left, self.right)


@dataclass(frozen=True)
class Binder:
    """``var in slice`` (an input of a slice) or ``var`` alone (a token position of that input).

    line/column locate the slice name when there is one, else the variable.
    """

    var: str
    slice: str | None = None
    line: int | None = _pos()
    column: int | None = _pos()


@dataclass(frozen=True)
class Quantifier(Expr):
    """``forall``/``exists`` one binder: body."""

    kind: str
    binder: Binder
    body: Expr

    def children(self) -> tuple[Expr, ...]:
        return (self.body,)


@dataclass(frozen=True)
class Aggregate(Expr):
    """``func(x in slice[, t]: body)``: mean, max, min or a percentile pNN of body over the set of
    (input[, position]) tuples; a boolean body counts 1 when true (so mean is a fraction)."""

    func: str
    binders: tuple[Binder, ...]
    body: Expr

    def children(self) -> tuple[Expr, ...]:
        return (self.body,)


def walk(e: Expr) -> Iterator[Expr]:
    """Every node of e, pre-order."""
    yield e
    for c in e.children():
        yield from walk(c)


def strip_positions(e: Expr) -> Expr:
    """A copy of e with every position cleared (positions never affect equality anyway)."""
    changes = {}
    for f in fields(e):
        if f.name in ("line", "column"):
            changes[f.name] = None
            continue
        v = getattr(e, f.name)
        if isinstance(v, Expr):
            changes[f.name] = strip_positions(v)
        elif isinstance(v, tuple):
            changes[f.name] = tuple(strip_positions(a) if isinstance(a, Expr)
                                    else replace(a, line=None, column=None)
                                    if isinstance(a, Binder) else a for a in v)
        elif isinstance(v, Binder):
            changes[f.name] = replace(v, line=None, column=None)
    return replace(e, **changes)


def number(value: float) -> Expr:
    """The canonical tree of a (possibly negative) number."""
    return Neg(Num(-value)) if value < 0 else Num(float(value))


def number_value(e: Expr) -> float | None:
    """The value of a constant: numbers combined by unary -, + - * / (e.g. ``2 * 0.05 / 0.7``);
    None if e is not constant or does not evaluate to a finite number."""
    if isinstance(e, Num):
        return e.value
    if isinstance(e, Neg):
        v = number_value(e.operand)
        return None if v is None else -v
    if isinstance(e, BinOp):
        a, b = number_value(e.left), number_value(e.right)
        if a is None or b is None or (e.op == "/" and b == 0):
            return None
        v = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else 0.0}[e.op]
        return v if math.isfinite(v) else None
    return None


# ---------------------------------------------------------------- printer

# Binding strength: an operand printed where a stronger context is needed gets parentheses.
_QUANT, _IMPLIES, _OR, _AND, _NOT, _CMP, _SUM, _PROD, _NEG, _ATOM = range(10)


def format_number(v: float) -> str:
    """Shortest text that reads back as exactly v (integers without a decimal point)."""
    if float(v).is_integer() and abs(v) < 1e15:
        return str(int(v))
    return repr(float(v))


def _strength(e: Expr) -> int:
    if isinstance(e, Quantifier):
        return _QUANT
    if isinstance(e, BoolOp):
        return {"implies": _IMPLIES, "or": _OR, "and": _AND}[e.op]
    if isinstance(e, Not):
        return _NOT
    if isinstance(e, Compare):
        return _CMP
    if isinstance(e, BinOp):
        return _SUM if e.op in "+-" else _PROD
    if isinstance(e, Neg):
        return _NEG
    return _ATOM


def _binder(b: Binder) -> str:
    return f"{b.var} in {b.slice}" if b.slice is not None else b.var


def _at(e: Expr, need: int) -> str:
    text = to_text(e)
    return f"({text})" if _strength(e) < need else text


def to_text(e: Expr) -> str:
    """Print e in the concrete syntax, with only the parentheses the grammar needs."""
    if isinstance(e, Num):
        return format_number(e.value)
    if isinstance(e, Str):
        q = "'" if '"' in e.value else '"'
        return f"{q}{e.value}{q}"
    if isinstance(e, Var):
        return e.name
    if isinstance(e, Neg):
        return "-" + _at(e.operand, _NEG)
    if isinstance(e, BinOp):
        s = _SUM if e.op in "+-" else _PROD
        return f"{_at(e.left, s)} {e.op} {_at(e.right, s + 1)}"
    if isinstance(e, Compare):
        return f"{_at(e.left, _SUM)} {e.op} {_at(e.right, _SUM)}"
    if isinstance(e, Not):
        return "not " + _at(e.operand, _NOT)
    if isinstance(e, BoolOp):
        if e.op == "implies":
            return f"{_at(e.left, _OR)} implies {_at(e.right, _OR)}"
        s = _OR if e.op == "or" else _AND
        return f"{_at(e.left, s)} {e.op} {_at(e.right, s + 1)}"
    if isinstance(e, Call):
        return f"{e.func}({', '.join(to_text(a) for a in e.args)})"
    if isinstance(e, Aggregate):
        return f"{e.func}({', '.join(_binder(b) for b in e.binders)}: {to_text(e.body)})"
    if isinstance(e, Quantifier):
        return f"{e.kind} {_binder(e.binder)}: {to_text(e.body)}"
    raise TypeError(f"not an expression node: {e!r}")
