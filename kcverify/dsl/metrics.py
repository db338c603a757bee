"""Known metrics of the short clause form (pure data).

A short clause ``{metric: M, slices: [S, ...], threshold: c}`` means, for every listed slice S,
``QUANTITY(S) DIRECTION c``, where QUANTITY is the metric's explicit form below with ``{slice}``
replaced by S. The empirical package registers an implementation under each name.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    """name, default clause family, direction of a passing value, explicit form of the quantity."""

    name: str
    family: str
    direction: str  # "<=": smaller is better; ">=": larger is better
    quantity: str  # an expression with a {slice} placeholder
    doc: str


def _m(name: str, family: str, direction: str, quantity: str, doc: str) -> Metric:
    return Metric(name, family, direction, quantity, doc)


METRICS: dict[str, Metric] = {m.name: m for m in (
    _m("p50_logit_l2", "statistical", "<=",
       "p50(x in {slice}, t: l2(logits_inf(x, t) - logits_train(x, t)))",
       "median over tokens of the L2 logit drift"),
    _m("p95_logit_l2", "statistical", "<=",
       "p95(x in {slice}, t: l2(logits_inf(x, t) - logits_train(x, t)))",
       "95th percentile over tokens of the L2 logit drift"),
    _m("p99_logit_l2", "statistical", "<=",
       "p99(x in {slice}, t: l2(logits_inf(x, t) - logits_train(x, t)))",
       "99th percentile over tokens of the L2 logit drift"),
    _m("mean_kl", "statistical", "<=", "mean(x in {slice}, t: kl(x, t))",
       "mean over tokens of KL(p || q)"),
    _m("p99_kl", "statistical", "<=", "p99(x in {slice}, t: kl(x, t))",
       "99th percentile over tokens of KL(p || q)"),
    _m("top1_overlap", "statistical", ">=", "mean(x in {slice}, t: top1_agree(x, t))",
       "fraction of tokens where both kernels pick the same top-1 token"),
    _m("top5_overlap", "statistical", ">=", "mean(x in {slice}, t: topk_overlap(x, t, 5))",
       "mean over tokens of the top-5 set overlap"),
    _m("top10_overlap", "statistical", ">=", "mean(x in {slice}, t: topk_overlap(x, t, 10))",
       "mean over tokens of the top-10 set overlap"),
    _m("mean_abs_log_ratio", "statistical", "<=",
       "mean(x in {slice}, t: abs(logprob_inf(x, t) - logprob_train(x, t)))",
       "mean over positions of |log q - log p|; measured weighted by p (E_p|log rho|), "
       "certified through the per-token bound, which covers both readings"),
    _m("mean_w_log_w", "statistical", "<=",
       "mean(x in {slice}, t: ratio(x, t) * log(ratio(x, t)))",
       "mean over tokens of w log w, w = q/p (importance-weight entropy)"),
    _m("ece_gap", "statistical", "<=", "ece_gap({slice})",
       "calibration gap |ECE(q) - ECE(p)|; needs labels"),
    _m("p95_latency_ms", "runtime", "<=", "p95(x in {slice}: latency_ms(x))",
       "95th percentile of inference latency per input, ms"),
    _m("p99_latency_ms", "runtime", "<=", "p99(x in {slice}: latency_ms(x))",
       "99th percentile of inference latency per input, ms"),
    _m("peak_memory_mb", "runtime", "<=", "max(x in {slice}: peak_memory_mb(x))",
       "peak memory of inference over the slice, MiB"),
)}
