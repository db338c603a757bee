"""Recognise the certifiable clause shapes the planner knows (semantics §1.2, 1.3).

``numerical_query(clause)`` returns a NumericalQuery for a clause whose condition has one of these
shapes (S a slice, x its input variable, t a token position, c a number; ``a - b`` may be written
``b - a`` where the quantity is symmetric; ``c >= Q`` is read as ``Q <= c``), else None:

    forall x in S: [forall t:] Q op c              aggregate "max" (a drift: every element <= c)
    forall x in S: [forall t:] A                   aggregate "min", ">= 1" (an agreement A holds
                                                   at every element)
    max | min | mean | p50 | p95 | p99 (x in S[, t]: Q) op c     that aggregate

with op ``<=`` or ``<`` for a drift and ``>=`` or ``>`` for an agreement, and the quantity Q one
of the quantity table's (kcverify.dsl.quantities.QUANTITIES), written in one of its forms:

    logit_linf    linf(logits_inf(x[, t]) - logits_train(x[, t]))
    logit_l2      l2(logits_inf(x[, t]) - logits_train(x[, t]))
    logprob_abs   abs(logprob_inf(x, t) - logprob_train(x, t))   or  abs(log(ratio(x, t)))
    ratio_dev     abs(ratio(x, t) - 1)
    tv            tv(x[, t])   or  tv(probs_train(x[, t]), probs_inf(x[, t]))  (either order)
    kl            kl(x[, t])   or  kl(probs_train(x[, t]), probs_inf(x[, t]))  (KL(p || q) only)
    top1_agree    top1_agree(x[, t])                 (k = 1)
    topk_agree    topk_agree(x[, t], k)              (k as written)

An agreement (direction "lower" in the table) is a condition: under an aggregate it is a
fraction of elements; as the whole body of a forall it must hold everywhere, which is the
query ``min(...) >= 1``.

``per_position`` is true when the quantity is evaluated per token position t (the aggregate then
ranges over (input, position) pairs). ``numerical_queries`` also splits conjunctions (the short
form over several slices, or ``forall x in S: forall t: A and B``) into one query per conjunct.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kcverify.dsl.ast import (
    Aggregate,
    BinOp,
    BoolOp,
    Call,
    Compare,
    Expr,
    Num,
    Quantifier,
    Var,
    number_value,
)
from kcverify.dsl.model import Clause
from kcverify.dsl.quantities import AGGREGATES as AGGREGATES
from kcverify.dsl.quantities import QUANTITIES as TABLE
from kcverify.dsl.quantities import Form

QUANTITIES = tuple(TABLE)  # the quantity names, in the table's order
_FLIP = {"<=": ">=", "<": ">", ">=": "<=", ">": "<"}


@dataclass(frozen=True)
class NumericalQuery:
    """One certifiable question: is aggregate_{x in slice[, t]} quantity  op  threshold?"""

    slice: str
    quantity: str
    aggregate: str
    op: str
    threshold: float
    temperature: float = 1.0
    per_position: bool = False
    k: int | None = None

    @property
    def upper(self) -> bool:
        """True when the quantity must stay below the threshold (a drift), False for agreement."""
        return self.op in ("<=", "<")


def _vars(args: tuple[Expr, ...], x: str, t: str | None) -> bool | None:
    """Whether args are (x) or (x, t): None if neither; else True iff t is used."""
    names = [a.name if isinstance(a, Var) else None for a in args]
    if names == [x]:
        return False
    if t is not None and names == [x, t]:
        return True
    return None


def _diff(e: Expr, a: str, b: str, x: str, t: str | None,
          symmetric: bool = True) -> bool | None:
    """e == a(args) - b(args) (or b - a if symmetric) with args (x[, t]); returns per_position."""
    if not (isinstance(e, BinOp) and e.op == "-"):
        return None
    left, right = e.left, e.right
    if not (isinstance(left, Call) and isinstance(right, Call)):
        return None
    pair = (left.func, right.func)
    if pair != (a, b) and not (symmetric and pair == (b, a)):
        return None
    pl, pr = _vars(left.args, x, t), _vars(right.args, x, t)
    return pl if pl is not None and pl == pr else None


def _match(form: Form, body: Call, x: str, t: str | None) -> tuple[bool, int | None] | None:
    """(per_position, k) when ``body`` is written in ``form`` (kcverify.dsl.quantities), else
    None."""
    f, args = body.func, body.args
    pp: bool | None = None
    k = form.k
    if form.kind == "norm" and f == form.func and len(args) == 1:
        pp = _diff(args[0], "logits_inf", "logits_train", x, t)
    elif form.kind in ("abs_diff", "abs_log", "abs_minus_one") and f == "abs" and len(args) == 1:
        a = args[0]
        if form.kind == "abs_diff":
            pp = _diff(a, f"{form.func}_inf", f"{form.func}_train", x, t)
        elif form.kind == "abs_log":
            if isinstance(a, Call) and a.func == "log" and len(a.args) == 1:
                r = a.args[0]
                if isinstance(r, Call) and r.func == form.func:
                    pp = _vars(r.args, x, t)
        elif isinstance(a, BinOp) and a.op == "-":
            for r, one in ((a.left, a.right), (a.right, a.left)):
                if (isinstance(r, Call) and r.func == form.func and isinstance(one, Num)
                        and one.value == 1):
                    pp = _vars(r.args, x, t)
                    break
    elif form.kind == "call" and f == form.func:
        pp = _vars(args, x, t)
    elif form.kind == "call_k" and f == form.func and args and isinstance(args[-1], Num):
        pp = _vars(args[:-1], x, t)
        k = int(args[-1].value)
    elif form.kind == "pair" and f == form.func and len(args) == 2:
        pp = _diff(BinOp("-", args[0], args[1]), "probs_train", "probs_inf", x, t,
                   symmetric=form.symmetric)
    if pp is None or (form.per_position and not pp):
        return None
    return pp, k


def _quantity(body: Expr, x: str, t: str | None) -> tuple[str, bool, int | None] | None:
    """(quantity, per_position, k) of a body written in one of the table's forms, else None."""
    if not isinstance(body, Call):
        return None
    for q in TABLE.values():
        for form in q.forms:
            m = _match(form, body, x, t)
            if m is not None:
                return q.name, m[0], m[1]
    return None


def _agreement(name: str) -> bool:
    return not TABLE[name].upper


def _compare(e: Expr) -> tuple[Expr, str, float] | None:
    """(quantity side, op, c) of Q op c or c op Q."""
    if not isinstance(e, Compare) or e.op in ("==", "!="):
        return None
    c = number_value(e.right)
    if c is not None:
        return e.left, e.op, c
    c = number_value(e.left)
    if c is not None:
        return e.right, _FLIP[e.op], c
    return None


def _query(e: Expr, temperature: float) -> NumericalQuery | None:
    # forall x in S: [forall t:] body
    if isinstance(e, Quantifier):
        if e.kind != "forall" or e.binder.slice is None:
            return None
        x, sl, body, t = e.binder.var, e.binder.slice, e.body, None
        if isinstance(body, Quantifier) and body.kind == "forall" and body.binder.slice is None:
            t, body = body.binder.var, body.body
        q = _quantity(body, x, t)
        if q is not None and _agreement(q[0]):  # holds at every element: its minimum is 1
            return NumericalQuery(sl, q[0], "min", ">=", 1.0, temperature, q[1], q[2])
        cmp = _compare(body)
        if cmp is None:
            return None
        side, op, c = cmp
        q = _quantity(side, x, t)
        if q is None or _agreement(q[0]) or op not in ("<=", "<"):
            return None
        return NumericalQuery(sl, q[0], "max", op, c, temperature, q[1], q[2])
    cmp = _compare(e)
    if cmp is None or not isinstance(cmp[0], Aggregate):
        return None
    agg, op, c = cmp
    assert isinstance(agg, Aggregate)
    if agg.func not in AGGREGATES or not 1 <= len(agg.binders) <= 2:
        return None
    b0 = agg.binders[0]
    t = None
    if len(agg.binders) == 2:
        if agg.binders[1].slice is not None:
            return None
        t = agg.binders[1].var
    q = _quantity(agg.body, b0.var, t)
    if q is None:
        return None
    if _agreement(q[0]) != (op in (">=", ">")):
        return None
    return NumericalQuery(b0.slice or "", q[0], agg.func, op, c, temperature, q[1], q[2])


def numerical_query(clause: Clause) -> NumericalQuery | None:
    """The certifiable shape of a clause's condition (see the module docstring), else None."""
    if clause.klass != "certifiable":
        return None
    return _query(clause.expr, clause.temperature)


def numerical_queries(clause: Clause) -> list[NumericalQuery] | None:
    """One query per conjunct; None if any conjunct is not recognised.

    Conjunctions split at the top level and under ``forall`` (forall distributes over and):
    ``forall x in S: forall t: A and B`` gives the queries of ``forall x in S: forall t: A`` and
    ``forall x in S: forall t: B``.
    """
    if clause.klass != "certifiable":
        return None

    def split(e: Expr) -> list[Expr]:
        if isinstance(e, BoolOp) and e.op == "and":
            return split(e.left) + split(e.right)
        if isinstance(e, Quantifier) and e.kind == "forall":
            return [replace(e, body=b) for b in split(e.body)]
        return [e]

    out = [_query(p, clause.temperature) for p in split(clause.expr)]
    return None if any(q is None for q in out) else out  # type: ignore[return-value]
