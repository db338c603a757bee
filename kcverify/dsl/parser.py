"""Parse clause expressions (kcverify/dsl/grammar/contract.lark) into the frozen AST of kcverify.dsl.ast.

Positions: the parser works on the expression text; ``locate(offset)`` maps an offset in that text
to (line, column) in the contract file, so nodes and errors point into the YAML file.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from lark import Lark, Token, Transformer, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedInput, UnexpectedToken, VisitError
from lark.tree import Meta

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
from kcverify.errors import ContractError

Locate = Callable[[int], tuple[int, int]]


@lru_cache(maxsize=1)
def grammar() -> Lark:
    """The LALR parser of the expression grammar, package data of kcverify.dsl (built once)."""
    return Lark.open_from_package("kcverify.dsl", "grammar/contract.lark", parser="lalr",
                                  propagate_positions=True, maybe_placeholders=True)


def text_locate(text: str) -> Locate:
    """Line and column (1-based) of an offset within ``text`` itself."""

    def locate(offset: int) -> tuple[int, int]:
        before = text[:offset]
        line = before.count("\n") + 1
        return line, offset - (before.rfind("\n") + 1) + 1

    return locate


class _Build(Transformer):
    """Parse tree -> AST; one method per grammar rule (aliases)."""

    def __init__(self, locate: Locate, file: str | None = None) -> None:
        super().__init__()
        self._locate = locate
        self._file = file

    def _at(self, offset: int) -> dict[str, int]:
        line, column = self._locate(offset)
        return {"line": line, "column": column}

    def _tok(self, tok: Token) -> dict[str, int]:
        return self._at(tok.start_pos or 0)

    @v_args(meta=True)
    def number(self, meta: Meta, items: list[Any]) -> Expr:
        tok = items[0]
        value = float(tok)
        if not math.isfinite(value):
            line, col = self._locate(tok.start_pos or 0)
            raise ContractError(f"number {str(tok)!r} is out of range (larger than 1.8e308)",
                                self._file, line, col)
        return Num(value, **self._tok(tok))

    @v_args(meta=True)
    def string(self, meta: Meta, items: list[Any]) -> Expr:
        tok = items[0]
        return Str(str(tok)[1:-1], **self._tok(tok))

    @v_args(meta=True)
    def var(self, meta: Meta, items: list[Any]) -> Expr:
        return Var(str(items[0]), **self._tok(items[0]))

    def args(self, items: list[Any]) -> Any:
        return tuple(items)

    @v_args(meta=True)
    def call(self, meta: Meta, items: list[Any]) -> Expr:
        name, args = items
        return Call(str(name), tuple(args or ()), **self._tok(name))

    def slice_binder(self, items: list[Any]) -> Any:
        var, sl = items
        return Binder(str(var), str(sl), **self._tok(sl))

    def position_binder(self, items: list[Any]) -> Any:
        return Binder(str(items[0]), None, **self._tok(items[0]))

    def binders(self, items: list[Any]) -> Any:
        return tuple(items)

    agg_binders = binders

    @v_args(meta=True)
    def aggregate(self, meta: Meta, items: list[Any]) -> Expr:
        name, binders, body = items
        return Aggregate(str(name), tuple(binders), body, **self._tok(name))

    def _quant(self, kind: str, meta: Meta, items: list[Any]) -> Expr:
        binders, body = items
        for b in reversed(binders[1:]):
            body = Quantifier(kind, b, body, line=b.line, column=b.column)
        return Quantifier(kind, binders[0], body, **self._at(meta.start_pos))

    @v_args(meta=True)
    def forall(self, meta: Meta, items: list[Any]) -> Expr:
        return self._quant("forall", meta, items)

    @v_args(meta=True)
    def exists(self, meta: Meta, items: list[Any]) -> Expr:
        return self._quant("exists", meta, items)

    @v_args(meta=True)
    def implies(self, meta: Meta, items: list[Any]) -> Expr:
        return BoolOp("implies", items[0], items[1], **self._at(meta.start_pos))

    @v_args(meta=True)
    def or_(self, meta: Meta, items: list[Any]) -> Expr:
        return BoolOp("or", items[0], items[1], **self._at(meta.start_pos))

    @v_args(meta=True)
    def and_(self, meta: Meta, items: list[Any]) -> Expr:
        return BoolOp("and", items[0], items[1], **self._at(meta.start_pos))

    @v_args(meta=True)
    def not_(self, meta: Meta, items: list[Any]) -> Expr:
        return Not(items[0], **self._at(meta.start_pos))

    @v_args(meta=True)
    def compare(self, meta: Meta, items: list[Any]) -> Expr:
        # a op1 b op2 c ... == (a op1 b) and (b op2 c) and ...
        result: Expr | None = None
        for i in range(1, len(items), 2):
            op = items[i]
            left, right = items[i - 1], items[i + 1]
            pos = self._at(meta.start_pos) if i == 1 else self._tok(op)
            cmp = Compare(str(op), left, right, **pos)
            result = cmp if result is None else BoolOp("and", result, cmp,
                                                       **self._at(meta.start_pos))
        assert result is not None
        return result

    @v_args(meta=True)
    def arith(self, meta: Meta, items: list[Any]) -> Expr:
        left, op, right = items
        return BinOp(str(op), left, right, **self._tok(op))

    @v_args(meta=True)
    def neg(self, meta: Meta, items: list[Any]) -> Expr:
        return Neg(items[1], **self._tok(items[0]))


# Readable names of the terminals a parse error may expect.
_TERMINALS = {
    "NAME": "a name", "NUMBER": "a number", "STRING": "a string", "COMP_OP": "a comparison",
    "LPAR": "'('", "RPAR": "')'", "COLON": "':'", "COMMA": "','", "PLUS": "'+'", "MINUS": "'-'",
    "STAR": "'*'", "SLASH": "'/'", "IN": "'in'", "AND": "'and'", "OR": "'or'", "NOT": "'not'",
    "IMPLIES": "'implies'", "FORALL": "'forall'", "EXISTS": "'exists'", "$END": "the end",
}

# Known mistakes, recognised by the parser state and token they fail on (the idea of Lark's
# match_examples, matched on the LALR state alone: see _example_states).
_EXAMPLES: dict[str, list[str]] = {
    "missing ':' after the quantifier's variables; write 'forall x in SLICE: CONDITION'": [
        "forall x in all linf(x) <= 1", "forall t abs(t) <= 1", "exists x in all, t f(x) < 1",
        "forall x in all t: a", "mean(x in all f(x)) <= 1", "mean(x in all, t f(x)) <= 1",
    ],
    "a quantifier used as an operand needs parentheses; write 'A and (forall t: B)'": [
        "a and forall t: b", "a or exists t: b", "not forall t: b", "a implies forall t: b",
        "a and exists t: b", "a or forall t: b", "not exists t: b", "a implies exists t: b",
    ],
    "two operands with no operator between them": [
        "a b", "f(x) 0.5", "1 2", "f(x) g(x)", "a 1", "1 a", "(a) b", "f(x) (a)",
    ],
    "'in' must be followed by a slice name; write 'forall x in SLICE: ...'": [
        "forall x in: a", "forall x in 1: a", "mean(x in: a)",
    ],
    "a quantifier binds names, not expressions; write 'forall x in SLICE: ...' or 'forall t: ...'": [
        "forall 1: a", "forall f(x): a", "forall (x): a", "exists 1: a",
    ],
}


@lru_cache(maxsize=1)
def _example_states() -> dict[tuple[int, str], str]:
    """(LALR state, unexpected token type) of every known mistake -> its message.

    Lark's match_examples also compares the depth of the parser stack, so a mistake nested in a
    quantifier would not match its top-level example; this table matches on the state alone.
    """
    table: dict[tuple[int, str], str] = {}
    for label, examples in _EXAMPLES.items():
        for text in examples:
            try:
                grammar().parse(text)
            except UnexpectedToken as ut:
                table.setdefault((ut.state.position, ut.token.type), label)
            except UnexpectedInput:
                pass
    return table


def _context(e: UnexpectedInput, text: str) -> str:
    snippet = e.get_context(text, span=24).splitlines()[0].strip()
    return f' near "{snippet}"' if snippet else ""


def _check_balance(text: str, file: str | None, locate: Locate) -> None:
    """Report the first unmatched parenthesis at its own position."""
    stack: list[int] = []
    quote: str | None = None
    for i, ch in enumerate(text):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch == "(":
            stack.append(i)
        elif ch == ")":
            if not stack:
                line, col = locate(i)
                raise ContractError("unbalanced parentheses: this ')' has no matching '('",
                                    file, line, col)
            stack.pop()
    if stack:
        line, col = locate(stack[-1])
        raise ContractError("unbalanced parentheses: this '(' is never closed", file, line, col)


def _syntax_error(e: UnexpectedInput, text: str, file: str | None, locate: Locate) -> ContractError:
    pos = getattr(e, "pos_in_stream", None)
    if pos is None or pos < 0:
        pos = len(text)
    if isinstance(e, UnexpectedToken) and e.token.type == "$END":
        pos = len(text.rstrip())
    line, col = locate(min(pos, max(len(text) - 1, 0)) if text else 0)
    where = _context(e, text)
    if isinstance(e, UnexpectedCharacters):
        ch = text[pos]
        hint = {"=": "use '==' to compare (or '<=', '>=')", "&": "use 'and'", "|": "use 'or'",
                "!": "use 'not' (or '!=')", "[": "index with a function argument, e.g. "
                "logits_inf(x, t)", "^": "there is no power operator; use exp/log",
                '"': "unterminated string", "'": "unterminated string"}.get(ch)
        msg = f"unexpected character {ch!r}" + (f"; {hint}" if hint else "")
        return ContractError(msg + where, file, line, col)
    label = None
    if isinstance(e, UnexpectedToken):
        label = _example_states().get((e.state.position, e.token.type))
    if label:
        return ContractError(label + where, file, line, col)
    if isinstance(e, UnexpectedToken):
        expected = sorted({_TERMINALS.get(t, t) for t in (e.accepts or e.expected)})
        if e.token.type == "$END":
            got = "the expression ends too early"
        else:
            kind = _TERMINALS.get(e.token.type, e.token.type).removeprefix("a ")
            got = (f"unexpected {kind}" if kind.startswith("'")
                   else f"unexpected {kind} {str(e.token)!r}")
            if e.token.type in ("AND", "OR", "NOT", "IMPLIES", "FORALL", "EXISTS", "IN"):
                got = f"unexpected keyword {str(e.token)!r}"
        return ContractError(f"{got}; expected {', '.join(expected)}{where}", file, line, col)
    return ContractError(f"syntax error{where}", file, line, col)  # pragma: no cover


def parse_expr(text: str, file: str | None = None, locate: Locate | None = None) -> Expr:
    """Parse one expression; ContractError (at the file position of the mistake) if it is not one."""
    locate = locate or text_locate(text)
    if not text.strip():
        line, col = locate(0)
        raise ContractError("empty expression; expected a condition such as "
                            "'forall x in all: linf(logits_inf(x) - logits_train(x)) <= 0.05'",
                            file, line, col)
    _check_balance(text, file, locate)
    try:
        tree = grammar().parse(text)
    except UnexpectedInput as e:
        raise _syntax_error(e, text, file, locate) from None
    try:
        return _Build(locate, file).transform(tree)
    except VisitError as e:  # a ContractError raised while building, else a bug
        raise e.orig_exc from None
