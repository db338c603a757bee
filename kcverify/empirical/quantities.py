"""Concrete values of the DSL's certifiable quantities, for evidence and counterexamples.

``query_values(query, logits_train, logits_inf, tokens)`` evaluates the quantity of a
kcverify.dsl NumericalQuery on both kernels' concrete logits, one value per element of the
aggregate: [n, m] with m the positions when ``query.per_position``, else m = 1 (the worst position
of each input, as the DSL defines a quantity with the position omitted: a divergence is the max
over positions, an agreement must hold at every position). Semantics follow
kcverify.dsl.functions (p = softmax(z_train / T), q = softmax(z_inf / T)):

    logit_linf   max_i |z_inf,i - z_train,i|     logit_l2   ||z_inf - z_train||_2
    logprob_abs  |log q - log p| of the observed next token x[t+1]  (positions 0 .. seq-2)
    ratio_dev    |q / p - 1| of the observed next token
    tv           (1/2) ||p - q||_1               kl         KL(p || q)
    top1_agree   1 if argmax agree else 0        topk_agree 1 if the top-k sets agree else 0

``evaluate_query`` then aggregates (max / mean / p50 / p95 / p99) and compares with the threshold;
for max, the element that attains it is the counterexample's location.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kcverify.empirical.metrics import MetricError, MetricInputs

AGREEMENT = ("top1_agree", "topk_agree")
_QUANTILE = {"p50": 0.50, "p95": 0.95, "p99": 0.99}


def _observed(logp: np.ndarray, tokens: np.ndarray | None) -> np.ndarray:
    """log-probability of the observed next token: logp[:, t, tokens[:, t+1]] for t < seq-1."""
    if tokens is None:
        raise MetricError("this quantity needs the observed tokens (the slice's input ids)")
    tok = np.asarray(tokens).reshape(tokens.shape[0], -1)
    n, m, _ = logp.shape
    if tok.shape[1] != m:
        raise MetricError(f"observed tokens have {tok.shape[1]} positions, the logits {m}")
    nxt = tok[:, 1:]
    return np.take_along_axis(logp[:, :-1, :], nxt[..., None], axis=-1)[..., 0]


def element_values(quantity: str, x: MetricInputs, tokens: np.ndarray | None = None,
                   k: int | None = None) -> np.ndarray:
    """The quantity at every (input, position): [n, m] (m = seq - 1 for next-token quantities)."""
    zt, zi = x.flat_logits()
    if quantity == "logit_linf":
        return np.max(np.abs(zi - zt), axis=-1)
    if quantity == "logit_l2":
        return np.sqrt(np.sum((zi - zt) ** 2, axis=-1))
    lp, lq = x.log_probs()
    if quantity == "logprob_abs":
        return np.abs(_observed(lq, tokens) - _observed(lp, tokens))
    if quantity == "ratio_dev":
        return np.abs(np.exp(_observed(lq, tokens) - _observed(lp, tokens)) - 1.0)
    if quantity == "tv":
        return 0.5 * np.sum(np.abs(np.exp(lp) - np.exp(lq)), axis=-1)
    if quantity == "kl":
        return np.maximum(np.sum(np.exp(lp) * (lp - lq), axis=-1), 0.0)
    if quantity in AGREEMENT:
        kk = 1 if quantity == "top1_agree" else int(k or 1)
        kk = min(kk, zt.shape[-1])
        a = np.sort(np.argsort(-zt, axis=-1, kind="stable")[..., :kk], axis=-1)
        b = np.sort(np.argsort(-zi, axis=-1, kind="stable")[..., :kk], axis=-1)
        return np.all(a == b, axis=-1).astype(np.float64)
    raise MetricError(f"unknown quantity {quantity!r}")


def query_values(query: Any, x: MetricInputs, tokens: np.ndarray | None = None) -> np.ndarray:
    """Values per aggregated element, [n, m] (see the module docstring)."""
    v = element_values(query.quantity, x, tokens, getattr(query, "k", None))
    if getattr(query, "per_position", False):
        return v
    if query.quantity == "logit_l2":  # l2 over the whole output of the input
        zt, zi = x.flat_logits()
        return np.sqrt(np.sum((zi - zt) ** 2, axis=(1, 2)))[:, None]
    worst = np.min if query.quantity in AGREEMENT else np.max
    return worst(v, axis=1, keepdims=True)


def aggregate(values: np.ndarray, how: str) -> float:
    """max / min / mean / p50 / p95 / p99 of all values."""
    flat = np.asarray(values, dtype=np.float64).ravel()
    if flat.size == 0:
        return float("nan")
    if how == "max":
        return float(np.max(flat))
    if how == "min":
        return float(np.min(flat))
    if how == "mean":
        return float(np.mean(flat))
    if how in _QUANTILE:
        return float(np.quantile(flat, _QUANTILE[how]))
    raise MetricError(f"unknown aggregate {how!r}")


def compare(value: float, op: str, threshold: float) -> bool:
    """value op threshold (NaN never holds)."""
    return bool({"<=": value <= threshold, "<": value < threshold, ">=": value >= threshold,
                 ">": value > threshold}[op])


@dataclass(frozen=True)
class QueryOutcome:
    """A numerical query on concrete outputs: the aggregate, whether it holds, and where.

    margin: how far inside (> 0) or outside (< 0) the threshold the value lies, in the quantity's
    units (threshold - value for an upper bound, value - threshold for a lower one).
    where: (input, position) of the worst element for a max / min aggregate, else None.
    """

    value: float
    holds: bool
    margin: float
    n: int
    where: tuple[int, int] | None
    values: np.ndarray


def evaluate_query(query: Any, x: MetricInputs, tokens: np.ndarray | None = None) -> QueryOutcome:
    """Aggregate the quantity over the slice and compare with the query's threshold."""
    v = query_values(query, x, tokens)
    how = query.aggregate
    if query.quantity in AGREEMENT and how == "max":
        how = "min"  # forall: every element agrees <=> the minimum is 1
    upper = query.op in ("<=", "<")
    nan = np.isnan(v)
    if nan.any():  # a NaN output (an overflow, inf - inf) is no bounded drift: the worst value
        v = np.where(nan, np.inf if upper else -np.inf, v)
    value = aggregate(v, how)
    margin = (query.threshold - value) if upper else (value - query.threshold)
    where = None
    if how in ("max", "min") and v.size:
        flat = int(np.argmax(v) if how == "max" else np.argmin(v))
        i, t = np.unravel_index(flat, v.shape)
        where = (int(i), int(t))
    return QueryOutcome(value, compare(value, query.op, query.threshold), float(margin),
                        int(v.shape[0]), where, v)
