"""The quantity table: every certifiable quantity of the DSL, in one place.

A clause's certifiable shape (kcverify.dsl.analysis) names a *quantity* (``logit_linf``, ``tv``,
``top1_agree`` ...). This table says, for each one, everything the tools need to agree on:

* ``forms``: how the DSL writes it (analysis.py recognises exactly these forms);
* ``conclusion``: the ``quantity`` key of the rule conclusions that bound it (``linf_drift``,
  ``tv``, ``top1_agreement``); the checker matches a proof to a clause through it;
* ``direction``: ``upper`` (a drift: the clause bounds it from above, ``<=`` / ``<``) or ``lower``
  (an agreement indicator, a condition in the DSL: bounded from below, ``>=`` / ``>``);
* ``derivations``: the built-in composition rules that derive it, and which premises they take
  (the planner applies each, and every registered rule with ``derives = NAME``);
* ``temperature``: whether it depends on the clause temperature T (its rules take
  ``params.temperature``, the checker compares it); ``next_token``: whether it is defined at
  positions 0 .. seq-2 only (the observed next token), which limits the statistics that bound it;
* ``words``: what it is, for documentation.

The planner (kcverify.planner.prove), the checker (kcverify.certs.checker), the rule registry
(kcverify.certs.rules: ``derives`` must name a quantity of this table) and ``kcverify lint`` all
read it, and phrase a query with the one function ``query_text``. Adding a quantity here (with a
form the analysis knows and a rule that derives it) is all it takes for every tool to handle it.

Pure Python: no torch, no numpy (the DSL and the checker import it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# A form's kind -> the DSL text it stands for (FUNC, K as in the Form; x an input, t a position)
FORM_KINDS = {
    "norm": "FUNC(logits_inf(x[, t]) - logits_train(x[, t]))  (either order)",
    "abs_diff": "abs(FUNC_inf(x, t) - FUNC_train(x, t))  (either order)",
    "abs_log": "abs(log(FUNC(x, t)))",
    "abs_minus_one": "abs(FUNC(x, t) - 1)  (either order)",
    "call": "FUNC(x[, t])",
    "call_k": "FUNC(x[, t], k)",
    "pair": "FUNC(probs_train(x[, t]), probs_inf(x[, t]))  (either order when symmetric)",
}
PREMISES = ("state", "linf", "linf+state")
AGGREGATES = ("max", "min", "mean", "p50", "p95", "p99")


@dataclass(frozen=True)
class Form:
    """One way the DSL writes a quantity (``FORM_KINDS``). ``per_position``: True when the form
    needs the position t, None when t is optional; ``k``: the fixed k of an agreement form."""

    kind: str
    func: str
    symmetric: bool = True
    per_position: bool | None = None
    k: int | None = None

    def text(self, x: str = "x", t: str | None = None, k: int | None = None) -> str:
        """The form written out, e.g. ``linf(logits_inf(x, t) - logits_train(x, t))``."""
        args = x if t is None else f"{x}, {t}"
        f = self.func
        if self.kind == "norm":
            return f"{f}(logits_inf({args}) - logits_train({args}))"
        if self.kind == "abs_diff":
            return f"abs({f}_inf({args}) - {f}_train({args}))"
        if self.kind == "abs_log":
            return f"abs(log({f}({args})))"
        if self.kind == "abs_minus_one":
            return f"abs({f}({args}) - 1)"
        if self.kind == "call":
            return f"{f}({args})"
        if self.kind == "call_k":
            return f"{f}({args}, {k if k is not None else 5})"
        if self.kind == "pair":
            return f"{f}(probs_train({args}), probs_inf({args}))"
        raise ValueError(f"unknown form kind {self.kind!r}; known: {', '.join(FORM_KINDS)}")


@dataclass(frozen=True)
class Derivation:
    """A built-in rule that derives a quantity, and its premises: ``state`` (the chain's state of
    the logits; params tensor, keep), ``linf`` (the L-inf drift of the logits) or ``linf+state``."""

    rule: str
    premises: str = "linf"


@dataclass(frozen=True)
class Quantity:
    """One certifiable quantity (see the module docstring)."""

    name: str
    conclusion: str
    direction: str
    forms: tuple[Form, ...]
    derivations: tuple[Derivation, ...] = ()
    temperature: bool = False
    next_token: bool = False
    words: str = ""

    @property
    def upper(self) -> bool:
        return self.direction == "upper"

    @property
    def extreme(self) -> str:
        """The statistic every other one is bounded by: max for a drift, min for an agreement."""
        return "max" if self.upper else "min"


QUANTITIES: dict[str, Quantity] = {q.name: q for q in (
    Quantity("logit_linf", "linf_drift", "upper", (Form("norm", "linf"),),
             (Derivation("linf-from-state", "state"),),
             words="L-inf norm of the logit drift z_inf - z_train"),
    Quantity("logit_l2", "l2_drift", "upper", (Form("norm", "l2"),),
             words="L2 norm of the logit drift (no built-in rule: examples/rules/l2_from_linf.py)"),
    Quantity("logprob_abs", "logprob_drift", "upper",
             (Form("abs_diff", "logprob", per_position=True),
              Form("abs_log", "ratio", per_position=True)),
             (Derivation("logprob-from-linf"),), temperature=True, next_token=True,
             words="|log q - log p| of the observed next token"),
    Quantity("ratio_dev", "ratio_dev", "upper",
             (Form("abs_minus_one", "ratio", per_position=True),),
             (Derivation("ratio-from-linf"),), temperature=True, next_token=True,
             words="|q/p - 1| of the observed next token (importance ratio)"),
    Quantity("tv", "tv", "upper", (Form("call", "tv"), Form("pair", "tv")),
             (Derivation("tv-from-linf"),), temperature=True,
             words="total variation (1/2)||p - q||_1"),
    Quantity("kl", "kl", "upper", (Form("call", "kl"), Form("pair", "kl", symmetric=False)),
             (Derivation("kl-from-linf"),), temperature=True, words="KL(p || q)"),
    Quantity("top1_agree", "top1_agreement", "lower", (Form("call", "top1_agree", k=1),),
             (Derivation("top1-from-state", "state"), Derivation("top1-from-margin", "linf+state")),
             words="both kernels pick the same top-1 token (1) or not (0)"),
    Quantity("topk_agree", "topk_agreement", "lower", (Form("call_k", "topk_agree"),),
             words="same set of top-k tokens (no built-in rule)"),
)}


def get_quantity(name: str) -> Quantity:
    """The table's entry; KeyError names the known quantities."""
    if name not in QUANTITIES:
        raise KeyError(f"unknown quantity {name!r}; known: {', '.join(QUANTITIES)}")
    return QUANTITIES[name]


def quantity_of_conclusion(conclusion: str) -> list[str]:
    """The DSL quantities whose rules conclude ``conclusion`` (e.g. linf_drift -> [logit_linf])."""
    return [q.name for q in QUANTITIES.values() if q.conclusion == conclusion]


# --- words -------------------------------------------------------------------------------------

def _get(q: Any, key: str, default: Any = None) -> Any:
    return q.get(key, default) if isinstance(q, dict) else getattr(q, key, default)


def query_subject(q: Any) -> str:
    """What a query is about: ``min of top1_agree over safety (per token)``; ``q`` is a
    NumericalQuery (or its dict form, as ``kcverify lint --json`` prints it)."""
    name = _get(q, "quantity")
    entry = QUANTITIES.get(name)
    k = _get(q, "k")
    what = f"{name}[k={k}]" if name == "topk_agree" and k is not None else name
    temp = float(_get(q, "temperature", 1.0) or 1.0)
    at = f" at T={temp:g}" if entry is not None and entry.temperature and temp != 1.0 else ""
    where = "per token" if _get(q, "per_position") else "per input"
    return f"{_get(q, 'aggregate')} of {what}{at} over {_get(q, 'slice')} ({where})"


def query_text(q: Any) -> str:
    """The whole query in words, the same in lint, the planner and the checker:
    ``max of logit_linf over all (per input) <= 1``."""
    return f"{query_subject(q)} {_get(q, 'op')} {float(_get(q, 'threshold')):g}"


# --- statistics --------------------------------------------------------------------------------

def proof_statistic(q: Any, keep: int) -> str:
    """The statistic the planner applies to per-element bounds to bound the query's aggregate.

    Every statistic is monotone, so the query's own aggregate of the bounds bounds the
    aggregate of the quantity, except for a next-token quantity bounded per (input, position)
    (keep 2): its bounds cover every position, the quantity only positions 0 .. seq-2, so only
    the extreme (max) of the bounds is sure to bound its mean or quantiles.
    """
    entry = get_quantity(_get(q, "quantity"))
    if entry.next_token and keep == 2:
        return entry.extreme
    return str(_get(q, "aggregate"))


def statistic_problem(q: Any, stat: str | None, keep: int) -> str | None:
    """None when a proof's statistic ``stat`` over per-element bounds (``keep`` 1: per input,
    2: per (input, position)) soundly bounds the query's aggregate; else why not.

    Sound: the query's own aggregate, or the extreme (max of upper bounds, min of lower ones),
    which bounds every statistic (None: a threshold applied without an aggregate takes the
    extreme). Per-input bounds also bound a per-position statistic (every input has the same
    number of positions, each within its input's bound); per-pair bounds bound a per-input
    statistic only through the extreme; a next-token quantity with per-pair bounds only through
    the extreme (proof_statistic).
    """
    entry = get_quantity(_get(q, "quantity"))
    agg = str(_get(q, "aggregate"))
    if stat is None or stat == entry.extreme:
        return None
    if stat != agg:
        return f"its statistic {stat!r} does not bound the clause's {agg!r}"
    if keep == 2 and not _get(q, "per_position"):
        return (f"its {stat} is over (input, position) pairs, the clause's over inputs")
    if keep == 2 and entry.next_token:
        return (f"its {stat} is over every position; {entry.name} is defined at the next-token "
                "positions only, whose statistic only the extreme bounds")
    return None
