"""VNN-LIB 1.0 properties: the SMT-LIB subset every verifier of the field reads (VNN-COMP).

    prop = load_vnnlib("prop_1.vnnlib")
    prop.cases        # (Case(lo, hi, x_atoms, unsafe), ...): input boxes, each with its unsafe DNF
    prop.box()        # the hull of the input boxes (a slice's region)
    prop.violated(x, y)  # exact check of one (input, output) pair against the unsafe set

What a file means. ``X_0 .. X_{n-1}`` are the row-major flattening of the model's single input,
``Y_0 .. Y_{m-1}`` of its single output, all real-valued. The conjunction of the ``assert``s
describes the *unsafe* set U of pairs (X, Y): the property holds (``unsat``) when no input X and
output Y = f(X) lie in U; a pair in U is a counterexample (``sat``).

Accepted subset: ``(declare-const NAME Real)`` with NAME = X_i or Y_i (indices contiguous from 0);
``(assert F)`` with F built from ``and``, ``or`` and comparisons ``<= >= < > =`` between linear
terms (numbers, variables, ``+``, ``-``, ``*`` by a constant, ``/`` by a constant); comments
``;`` to the end of a line; the commands ``set-logic``, ``set-info``, ``check-sat``, ``get-model``
and ``exit`` are accepted and ignored. Numbers are read exactly (decimal or scientific notation,
a leading minus allowed, as VNN-COMP files write them).

Normal form. The conjunction of the asserts is put in disjunctive normal form; in each disjunct,
the atoms over X must bound one variable each (together an input box, non-empty, every variable
bounded from both sides), the atoms over Y are linear inequalities ``sum c_j Y_j <= d`` (or
``<``), and no atom mixes X and Y. Disjuncts with the same box are grouped into one ``Case``
whose ``unsafe`` lists their Y-conjunctions (an empty conjunction is always true). Bounds are kept
exactly (``Fraction``); ``Case.lo/hi`` are their float64 enclosures, rounded outward.

Malformed files raise ``VnnlibError`` with ``file:line:col`` (unbalanced parentheses at the
parenthesis, undeclared variables at their use, an empty box at the bound that empties it).
Pure Python: no torch, no numpy.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

from kcverify.errors import InputFileError, LocatedError

MAX_DISJUNCTS = 1 << 16
IGNORED_COMMANDS = ("set-logic", "set-info", "check-sat", "get-model", "exit")
_VAR = re.compile(r"^([XY])_(\d+)$")
_NUM = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")
_COMPARISONS = ("<=", ">=", "<", ">", "=")


class VnnlibError(LocatedError):
    """A VNN-LIB file outside the accepted subset, or malformed (``file:line:col: error: ...``)."""


# --- s-expressions ------------------------------------------------------------------------
@dataclass(frozen=True)
class Sym:
    """A token (symbol or number) with its position."""

    text: str
    line: int
    col: int


@dataclass(frozen=True)
class SList:
    """A parenthesised list with the position of its '('."""

    items: tuple[Any, ...]
    line: int
    col: int


def _tokens(text: str, file: str) -> list[tuple[str, int, int]]:
    out: list[tuple[str, int, int]] = []
    line, col, i, n = 1, 1, 0, len(text)
    while i < n:
        ch = text[i]
        if ch == "\n":
            line, col, i = line + 1, 1, i + 1
        elif ch in " \t\r\f\v":
            col, i = col + 1, i + 1
        elif ch == ";":
            while i < n and text[i] != "\n":
                i += 1
        elif ch in "()":
            out.append((ch, line, col))
            col, i = col + 1, i + 1
        elif ch == "|" or ch == '"':
            raise VnnlibError(f"quoted symbols and strings ({ch}...) are not part of the VNN-LIB "
                              "subset", file, line, col)
        else:
            j = i
            while j < n and text[j] not in " \t\r\n\f\v();":
                j += 1
            out.append((text[i:j], line, col))
            col, i = col + (j - i), j
    return out


def parse_sexprs(text: str, file: str = "<vnnlib>") -> list[SList]:
    """The top-level lists of ``text``; unbalanced parentheses are located errors."""
    stack: list[tuple[list[Any], int, int]] = []
    top: list[SList] = []
    for tok, line, col in _tokens(text, file):
        if tok == "(":
            stack.append(([], line, col))
        elif tok == ")":
            if not stack:
                raise VnnlibError("unbalanced parentheses: ')' without a matching '('",
                                  file, line, col)
            items, l0, c0 = stack.pop()
            node = SList(tuple(items), l0, c0)
            if stack:
                stack[-1][0].append(node)
            else:
                top.append(node)
        elif not stack:
            raise VnnlibError(f"expected '(' to start a command, got {tok!r}", file, line, col)
        else:
            stack[-1][0].append(Sym(tok, line, col))
    if stack:
        _, line, col = stack[-1]
        raise VnnlibError("unbalanced parentheses: this '(' is never closed", file, line, col)
    return top


# --- the property -------------------------------------------------------------------------
@dataclass(frozen=True)
class Atom:
    """``sum_j coeffs[j] * var_j  op  rhs`` with op '<=' or '<', exact; var 'X' or 'Y'."""

    var: str
    coeffs: tuple[tuple[int, Fraction], ...]
    op: str
    rhs: Fraction
    line: int = 0
    col: int = 0

    def holds(self, values: Sequence[float]) -> bool:
        """Exact evaluation at float values (each converted exactly)."""
        s = sum((c * Fraction(values[j]) for j, c in self.coeffs), Fraction(0))
        return s <= self.rhs if self.op == "<=" else s < self.rhs

    def render(self) -> str:
        terms = " ".join(f"{'+' if c >= 0 else '-'} {abs(float(c)):g}*{self.var}_{j}"
                         for j, c in self.coeffs)
        return f"{terms.lstrip('+ ')} {self.op} {float(self.rhs):g}"


@dataclass(frozen=True)
class Case:
    """One input box with the output conditions that are unsafe on it (a DNF over Y)."""

    lo: tuple[float, ...]  # float64 enclosure of the exact bounds, rounded outward
    hi: tuple[float, ...]
    x_atoms: tuple[Atom, ...]  # the exact box (strictness included)
    unsafe: tuple[tuple[Atom, ...], ...]

    def contains(self, x: Sequence[float]) -> bool:
        """x lies in the exact box (every X atom holds)."""
        return len(x) == len(self.lo) and all(a.holds(x) for a in self.x_atoms)

    def unsafe_at(self, y: Sequence[float]) -> tuple[Atom, ...] | None:
        """The first unsafe conjunction that holds at y (exactly), or None."""
        for conj in self.unsafe:
            if all(a.holds(y) for a in conj):
                return conj
        return None


@dataclass(frozen=True)
class VnnProperty:
    path: str
    n_inputs: int
    n_outputs: int
    cases: tuple[Case, ...]
    digest: str = field(default="", compare=False)

    def box(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """The hull of the cases' input boxes (float64, outward)."""
        lo = tuple(min(c.lo[i] for c in self.cases) for i in range(self.n_inputs))
        hi = tuple(max(c.hi[i] for c in self.cases) for i in range(self.n_inputs))
        return lo, hi

    def violated(self, x: Sequence[float], y: Sequence[float]) -> tuple[Atom, ...] | None:
        """An unsafe conjunction that (x, y) satisfies exactly, or None (the pair is safe)."""
        for c in self.cases:
            if c.contains(x):
                hit = c.unsafe_at(y)
                if hit is not None:
                    return hit
        return None


# --- reading ------------------------------------------------------------------------------
class _Reader:
    def __init__(self, file: str) -> None:
        self.file = file
        self.vars: dict[str, tuple[str, int]] = {}
        self.decl_at: dict[str, tuple[int, int]] = {}

    def fail(self, msg: str, at: Sym | SList) -> VnnlibError:
        return VnnlibError(msg, self.file, at.line, at.col)

    def head(self, lst: SList) -> str:
        if not lst.items or not isinstance(lst.items[0], Sym):
            raise self.fail("expected an operator or command name after '('", lst)
        return lst.items[0].text

    def command(self, lst: SList, asserts: list[Any]) -> None:
        name = self.head(lst)
        if name == "declare-const":
            self.declare(lst)
        elif name == "declare-fun":
            if len(lst.items) == 4 and isinstance(lst.items[2], SList) and not lst.items[2].items:
                self.declare(SList((lst.items[0], lst.items[1], lst.items[3]), lst.line, lst.col))
            else:
                raise self.fail("declare-fun must declare a constant: (declare-fun X_0 () Real)",
                                lst)
        elif name == "assert":
            if len(lst.items) != 2:
                raise self.fail(f"assert takes one formula, got {len(lst.items) - 1}", lst)
            asserts.append(self.formula(lst.items[1]))
        elif name in IGNORED_COMMANDS:
            return
        else:
            raise self.fail(f"unknown command {name!r}; the VNN-LIB subset has declare-const and "
                            "assert", lst.items[0])

    def declare(self, lst: SList) -> None:
        if len(lst.items) != 3 or not all(isinstance(t, Sym) for t in lst.items[1:]):
            raise self.fail("expected (declare-const NAME Real)", lst)
        name, sort = lst.items[1], lst.items[2]
        m = _VAR.match(name.text)
        if m is None:
            raise self.fail(f"variable {name.text!r}: VNN-LIB variables are X_i (inputs) and Y_i "
                            "(outputs)", name)
        if sort.text != "Real":
            raise self.fail(f"variable {name.text!r} has sort {sort.text!r}; expected Real", sort)
        if name.text in self.vars:
            line, col = self.decl_at[name.text]
            raise self.fail(f"variable {name.text!r} is declared twice (first at line {line})",
                            name)
        self.vars[name.text] = (m.group(1), int(m.group(2)))
        self.decl_at[name.text] = (name.line, name.col)

    # formulas: ("and" | "or", [children], at) or Atom
    def formula(self, t: Any) -> Any:
        if isinstance(t, Sym):
            if t.text == "true":
                return ("and", [], t)
            if t.text == "false":
                return ("or", [], t)
            raise self.fail(f"expected a formula (and / or / a comparison), got {t.text!r}", t)
        op = self.head(t)
        args = t.items[1:]
        if op in ("and", "or"):
            return (op, [self.formula(a) for a in args], t)
        if op in _COMPARISONS:
            if len(args) < 2:
                raise self.fail(f"{op} needs at least two terms", t)
            atoms = []
            for a, b in zip(args, args[1:]):  # chains: (<= a b c) = a <= b and b <= c
                atoms += self.compare(op, self.term(a), self.term(b), t)
            return atoms[0] if len(atoms) == 1 else ("and", atoms, t)
        if op == "not":
            raise self.fail("'not' is outside the VNN-LIB subset; write the negated comparison",
                            t.items[0])
        raise self.fail(f"unknown operator {op!r} in a formula; expected and, or, <=, >=, <, >, =",
                        t.items[0])

    def compare(self, op: str, a: dict[Any, Fraction], b: dict[Any, Fraction],
                at: SList) -> list[Any]:
        """a op b as atoms sum c v op' d (op' in <=, <)."""
        if op == "=":
            return self.compare("<=", a, b, at) + self.compare(">=", a, b, at)
        if op in (">=", ">"):
            a, b = b, a
            op = "<=" if op == ">=" else "<"
        diff = dict(a)
        for k, v in b.items():
            diff[k] = diff.get(k, Fraction(0)) - v
        rhs = -diff.pop(None, Fraction(0))
        diff = {k: v for k, v in diff.items() if v != 0}
        kinds = {self.vars[k][0] for k in diff}
        if len(kinds) > 1:
            raise self.fail("a comparison mixes input (X) and output (Y) variables; the VNN-LIB "
                            "subset keeps them apart", at)
        if not kinds:  # a constant comparison: true or false
            ok = Fraction(0) <= rhs if op == "<=" else Fraction(0) < rhs
            return [("and", [], at) if ok else ("or", [], at)]
        kind = kinds.pop()
        coeffs = tuple(sorted((self.vars[k][1], v) for k, v in diff.items()))
        return [Atom(kind, coeffs, op, rhs, at.line, at.col)]

    def term(self, t: Any) -> dict[Any, Fraction]:
        """A linear term as {variable name or None (constant): coefficient}."""
        if isinstance(t, Sym):
            if _NUM.match(t.text):
                return {None: _exact(t.text)}
            if t.text not in self.vars:
                if _VAR.match(t.text):
                    raise self.fail(f"undeclared variable {t.text!r} (declare it with "
                                    f"(declare-const {t.text} Real) before its first use)", t)
                raise self.fail(f"unknown symbol {t.text!r}; expected a number or a declared "
                                "X_i / Y_i", t)
            return {t.text: Fraction(1)}
        op = self.head(t)
        args = [self.term(a) for a in t.items[1:]]
        if op == "+" and args:
            return _sum(args)
        if op == "-" and len(args) == 1:
            return {k: -v for k, v in args[0].items()}
        if op == "-" and len(args) >= 2:
            return _sum([args[0]] + [{k: -v for k, v in a.items()} for a in args[1:]])
        if op == "*" and args:
            out = args[0]
            for a in args[1:]:
                if set(out) == {None}:
                    out, a = a, out
                if set(a) != {None}:
                    raise self.fail("a product of two variables is not linear", t)
                out = {k: v * a[None] for k, v in out.items()}
            return out
        if op == "/" and len(args) == 2:
            if set(args[1]) != {None} or args[1][None] == 0:
                raise self.fail("division only by a non-zero constant", t)
            return {k: v / args[1][None] for k, v in args[0].items()}
        raise self.fail(f"unknown term operator {op!r}; expected +, -, *, / (linear terms)",
                        t.items[0] if t.items else t)


def _exact(text: str) -> Fraction:
    return Fraction(text)


def _sum(terms: list[dict[Any, Fraction]]) -> dict[Any, Fraction]:
    out: dict[Any, Fraction] = {}
    for t in terms:
        for k, v in t.items():
            out[k] = out.get(k, Fraction(0)) + v
    return out


def _dnf(f: Any, file: str) -> list[list[Atom]]:
    if isinstance(f, Atom):
        return [[f]]
    op, kids, at = f
    if op == "or":
        out: list[list[Atom]] = []
        for k in kids:
            out += _dnf(k, file)
            if len(out) > MAX_DISJUNCTS:
                break
    else:
        out = [[]]
        for k in kids:
            sub = _dnf(k, file)
            out = [a + b for a in out for b in sub]
            if len(out) > MAX_DISJUNCTS:
                break
    if len(out) > MAX_DISJUNCTS:
        raise VnnlibError(f"the property's disjunctive normal form has more than {MAX_DISJUNCTS} "
                          "disjuncts", file, at.line, at.col)
    return out


def _down(q: Fraction) -> float:
    f = float(q)
    return f if Fraction(f) <= q else math.nextafter(f, -math.inf)


def _up(q: Fraction) -> float:
    f = float(q)
    return f if Fraction(f) >= q else math.nextafter(f, math.inf)


def _box(conj: list[Atom], n: int, file: str, anchor: tuple[int, int]) -> tuple[
        tuple[Fraction | None, ...], tuple[Fraction | None, ...]]:
    lo: list[Fraction | None] = [None] * n
    hi: list[Fraction | None] = [None] * n
    for a in conj:
        if len(a.coeffs) != 1:
            raise VnnlibError("an input constraint must bound one variable (the input set is a "
                              f"box); got {a.render()}", file, a.line, a.col)
        (j, c), = a.coeffs
        bound = a.rhs / c
        if c > 0:
            hi[j] = bound if hi[j] is None else min(hi[j], bound)
        else:
            lo[j] = bound if lo[j] is None else max(lo[j], bound)
        if lo[j] is not None and hi[j] is not None and (
                lo[j] > hi[j] or (lo[j] == hi[j] and _strict_at(conj, j, lo[j]))):
            raise VnnlibError(f"empty input box: X_{j} >= {float(lo[j]):g} and X_{j} <= "
                              f"{float(hi[j]):g} leave no value", file, a.line, a.col)
    for j in range(n):
        if lo[j] is None or hi[j] is None:
            side = "lower" if lo[j] is None else "upper"
            raise VnnlibError(f"X_{j} has no {side} bound: the input set must be a bounded box",
                              file, *anchor)
    return tuple(lo), tuple(hi)


def _strict_at(conj: list[Atom], j: int, v: Fraction) -> bool:
    return any(a.op == "<" and len(a.coeffs) == 1 and a.coeffs[0][0] == j
               and a.rhs / a.coeffs[0][1] == v for a in conj)


def parse_vnnlib(text: str, file: str = "<vnnlib>") -> VnnProperty:
    """Read a VNN-LIB property from ``text`` (positions name ``file``)."""
    import hashlib

    r = _Reader(file)
    asserts: list[Any] = []
    for cmd in parse_sexprs(text, file):
        r.command(cmd, asserts)
    counts = {}
    for kind in ("X", "Y"):
        idx = sorted(i for k, i in r.vars.values() if k == kind)
        if not idx:
            raise VnnlibError(f"no {kind}_i variables are declared (a property needs inputs X_0.. "
                              "and outputs Y_0..)", file, 1, 1)
        if idx != list(range(len(idx))):
            missing = min(set(range(len(idx) + 1)) - set(idx))
            name = f"{kind}_{max(idx)}"
            raise VnnlibError(f"{kind} variables must be numbered 0..n-1: {name} is declared but "
                              f"{kind}_{missing} is not", file, *r.decl_at[name])
        counts[kind] = len(idx)
    if not asserts:
        raise VnnlibError("no assert: the file states no unsafe set", file, 1, 1)
    f = ("and", asserts, SList((), 1, 1))
    cases: dict[tuple[Any, Any], tuple[list[Atom], list[tuple[Atom, ...]]]] = {}
    for conj in _dnf(f, file):
        xs = [a for a in conj if a.var == "X"]
        ys = tuple(a for a in conj if a.var == "Y")
        anchor = (conj[0].line, conj[0].col) if conj else (1, 1)
        key = _box(xs, counts["X"], file, anchor)
        if key not in cases:
            cases[key] = (xs, [])
        cases[key][1].append(ys)
    if not cases:
        raise VnnlibError("the asserts contradict each other: the unsafe set is empty", file, 1, 1)
    out = []
    for (lo, hi), (xs, ys) in cases.items():
        out.append(Case(tuple(_down(v) for v in lo), tuple(_up(v) for v in hi), tuple(xs),
                        tuple(dict.fromkeys(ys))))
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    return VnnProperty(file, counts["X"], counts["Y"], tuple(out), digest)


def load_vnnlib(path: str | os.PathLike[str]) -> VnnProperty:
    """Read a VNN-LIB file (``.vnnlib``, or gzip-compressed ``.vnnlib.gz``)."""
    p = Path(path)
    if not p.is_file():
        raise InputFileError(f"{p}: no such VNN-LIB file")
    try:
        if p.suffix == ".gz":
            import gzip

            text = gzip.decompress(p.read_bytes()).decode("utf-8")
        else:
            text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError, EOFError) as e:
        raise InputFileError(f"{p}: unreadable VNN-LIB file ({type(e).__name__}: {e})") from None
    return parse_vnnlib(text, str(p))
