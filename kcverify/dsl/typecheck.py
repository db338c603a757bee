"""Type checking of clause expressions.

Rules: arithmetic on numbers gives a number; vectors add and subtract, scale by numbers; two
distributions subtract to a vector (apply a norm); norms and divergences give numbers; only
numbers are ordered; ``==``/``!=`` also compare booleans; connectives and quantifier bodies are
booleans; an aggregate's body is a number or a boolean (counted 1 when true). Comparing a vector
or a distribution with a number is a type error: apply a norm or a divergence first.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from kcverify.dsl.ast import (
    Aggregate,
    Binder,
    BinOp,
    BoolOp,
    Call,
    Compare,
    Expr,
    Neg,
    Not,
    Num,
    Quantifier,
    Str,
    Var,
)
from kcverify.dsl.functions import AGGREGATES, FUNCTIONS, is_aggregate
from kcverify.errors import ContractError

_ARTICLE = {"number": "a number", "bool": "a condition", "vector": "a vector (logits)",
            "distribution": "a distribution", "input": "an input", "position": "a token position",
            "slice": "a slice", "string": "a string"}


def _nice(t: str) -> str:
    return _ARTICLE.get(t, t)


def suggest(name: str, known: Collection[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


@dataclass
class Checker:
    """Types one expression; records the function kinds it uses and the slices it names."""

    file: str | None
    slices: Collection[str]
    kinds: set[str] = field(default_factory=set)
    used_slices: list[str] = field(default_factory=list)

    def fail(self, node: Expr | Binder, message: str) -> ContractError:
        return ContractError(message, self.file, node.line, node.column)

    def expect(self, e: Expr, env: Mapping[str, str], want: str, what: str) -> str:
        t = self.type_of(e, env)
        if t != want:
            hint = ""
            if want == "number" and t in ("vector", "distribution"):
                hint = "; apply a norm (linf, l2, l1) or a divergence (kl, tv) first"
            raise self.fail(e, f"{what} must be {_nice(want)}, got {_nice(t)}{hint}")
        return t

    def _bind(self, binders: tuple[Binder, ...], env: Mapping[str, str]) -> dict[str, str]:
        inner = dict(env)
        for b in binders:
            if b.slice is not None:
                if b.slice not in self.slices:
                    known = ", ".join(sorted(self.slices)) or "none"
                    raise self.fail(b, f"undefined slice {b.slice!r}{suggest(b.slice, self.slices)}"
                                       f"; defined: {known}")
                if b.slice not in self.used_slices:
                    self.used_slices.append(b.slice)
                inner[b.var] = "input"
            else:
                if "input" not in inner.values():
                    raise self.fail(b, f"token position {b.var!r} needs an input in scope; write "
                                       f"'forall x in SLICE: forall {b.var}: ...'")
                inner[b.var] = "position"
        return inner

    def type_of(self, e: Expr, env: Mapping[str, str]) -> str:  # noqa: C901 - one case per node
        if isinstance(e, Num):
            return "number"
        if isinstance(e, Str):
            return "string"
        if isinstance(e, Var):
            if e.name in env:
                return env[e.name]
            if e.name in self.slices:
                return "slice"
            known = sorted(env)
            listing = (f"; in scope: {', '.join(known)}" if known else
                       f"; bind it first, e.g. 'forall {e.name} in SLICE: ...'")
            raise self.fail(e, f"undefined variable {e.name!r}{suggest(e.name, known)}{listing}")
        if isinstance(e, Neg):
            t = self.type_of(e.operand, env)
            if t not in ("number", "vector"):
                raise self.fail(e, f"cannot negate {_nice(t)}")
            return t
        if isinstance(e, BinOp):
            return self._arith(e, env)
        if isinstance(e, Compare):
            lt, rt = self.type_of(e.left, env), self.type_of(e.right, env)
            for side, t in ((e.left, lt), (e.right, rt)):
                if t in ("vector", "distribution"):
                    other = rt if side is e.left else lt
                    fix = ("tv(P, Q), kl(P, Q) or linf(P - Q)" if t == "distribution"
                           else "linf(...) or l2(...)")
                    raise self.fail(e, f"cannot compare {_nice(t)} with {_nice(other)}; "
                                       f"apply a norm or divergence first, e.g. {fix}")
            if lt == rt == "bool" and e.op in ("==", "!="):
                return "bool"
            if lt != "number" or rt != "number":
                bad = e.left if lt != "number" else e.right
                raise self.fail(bad, f"'{e.op}' compares numbers, got {_nice(lt)} and {_nice(rt)}")
            return "bool"
        if isinstance(e, Not):
            self.expect(e.operand, env, "bool", "the operand of 'not'")
            return "bool"
        if isinstance(e, BoolOp):
            self.expect(e.left, env, "bool", f"the left operand of '{e.op}'")
            self.expect(e.right, env, "bool", f"the right operand of '{e.op}'")
            return "bool"
        if isinstance(e, Quantifier):
            inner = self._bind((e.binder,), env)
            self.expect(e.body, inner, "bool", f"the body of '{e.kind}'")
            return "bool"
        if isinstance(e, Aggregate):
            if not is_aggregate(e.func):
                raise self.fail(e, f"unknown aggregate {e.func!r}{suggest(e.func, AGGREGATES)}; "
                                   f"expected mean, max, min or a percentile p1 .. p99")
            inner = self._bind(e.binders, env)
            t = self.type_of(e.body, inner)
            if t not in ("number", "bool"):
                raise self.fail(e.body, f"the body of {e.func}(...) must be a number or a "
                                        f"condition, got {_nice(t)}")
            return "number"
        if isinstance(e, Call):
            return self._call(e, env)
        raise TypeError(f"not an expression node: {e!r}")  # pragma: no cover

    def _arith(self, e: BinOp, env: Mapping[str, str]) -> str:
        lt, rt = self.type_of(e.left, env), self.type_of(e.right, env)
        pair = (lt, rt)
        if pair == ("number", "number"):
            return "number"
        if e.op in "+-" and pair == ("vector", "vector"):
            return "vector"
        if e.op == "-" and pair == ("distribution", "distribution"):
            return "vector"
        if e.op == "*" and pair in (("number", "vector"), ("vector", "number")):
            return "vector"
        if e.op == "/" and pair == ("vector", "number"):
            return "vector"
        raise self.fail(e, f"cannot apply '{e.op}' to {_nice(lt)} and {_nice(rt)}")

    def _call(self, e: Call, env: Mapping[str, str]) -> str:
        if is_aggregate(e.func) and e.func not in FUNCTIONS:
            raise self.fail(e, f"aggregate {e.func!r} ranges over a slice; write "
                               f"'{e.func}(x in SLICE: ...)'")
        fn = FUNCTIONS.get(e.func)
        if fn is None:
            raise self.fail(e, f"unknown function {e.func!r}{suggest(e.func, FUNCTIONS)}; known: "
                               f"{', '.join(sorted(FUNCTIONS))}")
        self.kinds.add(fn.kind)
        types = tuple(self.type_of(a, env) for a in e.args)
        for params, result in fn.overloads:
            if params == types:
                if "number" in params and fn.name.startswith("topk_"):
                    k = e.args[-1]
                    if not (isinstance(k, Num) and k.value.is_integer() and k.value >= 1):
                        raise self.fail(k, f"k of {fn.name} must be a whole number >= 1")
                for a, t in zip(e.args, types):
                    if t == "slice" and isinstance(a, Var) and a.name not in self.used_slices:
                        self.used_slices.append(a.name)
                return result
        got = ", ".join(_nice(t) for t in types) or "no arguments"
        raise self.fail(e, f"wrong arguments for {fn.name}: got ({got}); expected {fn.usage}")


def check_condition(e: Expr, file: str | None, slices: Collection[str],
                    env: Mapping[str, str] | None = None, what: str = "an assert") -> Checker:
    """Type-check a whole condition (it must be boolean); returns the checker with its findings."""
    c = Checker(file, slices)
    t = c.type_of(e, dict(env or {}))
    if t != "bool":
        raise c.fail(e, f"{what} must be a condition (true or false), got {_nice(t)}; "
                        f"compare it with a threshold, e.g. '... <= 0.05'")
    return c
