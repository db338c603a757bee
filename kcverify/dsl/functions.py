"""The functions and aggregates an expression may use, with their types (pure data).

Types: ``number`` (a real), ``bool``, ``vector`` (a real tensor, e.g. logits over the vocabulary),
``distribution`` (next-token probabilities), ``input`` (a variable bound to a slice), ``position``
(a token position of that input), ``slice`` (a slice named as an argument), ``string``.

Semantics (p = training kernel, q = inference kernel, z = logits, T = the clause temperature):
``logprob_k(x, t) = log softmax(z_k(x)[t] / T)[x[t+1]]`` (the observed next token),
``ratio(x, t) = exp(logprob_inf(x, t) - logprob_train(x, t))``, ``kl = KL(p || q)``,
``tv = (1/2) * ||p - q||_1``, ``margin`` = top-1 minus top-2 training logit. With the position
omitted, a divergence is the maximum over positions, an agreement holds at every position, and an
overlap or a margin is the minimum over positions (the worst position in every case).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Kinds decide a clause's class (semantics §1.2): 'model' needs both kernels' outputs (certifiable
# when quantified over slices), 'runtime' and 'label' are measured (empirical), 'static' inspects
# the artifacts, 'pure' is plain arithmetic.
KINDS = ("model", "pure", "runtime", "label", "static")


@dataclass(frozen=True)
class Function:
    """A function: its kind, accepted argument types (overloads) and result type."""

    name: str
    kind: str
    overloads: tuple[tuple[tuple[str, ...], str], ...]
    usage: str
    doc: str


_X = ("input",)
_XT = ("input", "position")


def _fn(name: str, kind: str, overloads: list[tuple[tuple[str, ...], str]], usage: str,
        doc: str) -> Function:
    return Function(name, kind, tuple(overloads), usage, doc)


FUNCTIONS: dict[str, Function] = {f.name: f for f in (
    _fn("logits_train", "model", [(_X, "vector"), (_XT, "vector")], "logits_train(x[, t])",
        "training-kernel logits of input x (all positions, or position t)"),
    _fn("logits_inf", "model", [(_X, "vector"), (_XT, "vector")], "logits_inf(x[, t])",
        "inference-kernel logits of input x (all positions, or position t)"),
    _fn("probs_train", "model", [(_X, "distribution"), (_XT, "distribution")],
        "probs_train(x[, t])", "training-kernel next-token distribution softmax(z/T)"),
    _fn("probs_inf", "model", [(_X, "distribution"), (_XT, "distribution")],
        "probs_inf(x[, t])", "inference-kernel next-token distribution softmax(z/T)"),
    _fn("logprob_train", "model", [(_XT, "number")], "logprob_train(x, t)",
        "training-kernel log-probability of the observed next token"),
    _fn("logprob_inf", "model", [(_XT, "number")], "logprob_inf(x, t)",
        "inference-kernel log-probability of the observed next token"),
    _fn("ratio", "model", [(_XT, "number")], "ratio(x, t)",
        "importance ratio q/p of the observed next token"),
    _fn("kl", "model", [(_X, "number"), (_XT, "number"),
                        (("distribution", "distribution"), "number")],
        "kl(x[, t]) or kl(P, Q)", "KL(p || q) of the next-token distributions"),
    _fn("tv", "model", [(_X, "number"), (_XT, "number"),
                        (("distribution", "distribution"), "number")],
        "tv(x[, t]) or tv(P, Q)", "total variation distance of the next-token distributions"),
    _fn("margin", "model", [(_X, "number"), (_XT, "number")], "margin(x[, t])",
        "training-kernel margin: top-1 minus top-2 logit"),
    _fn("top1_agree", "model", [(_X, "bool"), (_XT, "bool")], "top1_agree(x[, t])",
        "both kernels pick the same top-1 token"),
    _fn("topk_agree", "model", [(("input", "number"), "bool"),
                                (("input", "position", "number"), "bool")],
        "topk_agree(x[, t], k)", "both kernels have the same set of top-k tokens"),
    _fn("topk_overlap", "model", [(("input", "number"), "number"),
                                  (("input", "position", "number"), "number")],
        "topk_overlap(x[, t], k)", "|top-k(p) ∩ top-k(q)| / k"),
    _fn("linf", "pure", [(("vector",), "number"), (("distribution",), "number")], "linf(v)",
        "max-norm of a vector (over every position and token)"),
    _fn("l2", "pure", [(("vector",), "number"), (("distribution",), "number")], "l2(v)",
        "Euclidean norm of a vector"),
    _fn("l1", "pure", [(("vector",), "number"), (("distribution",), "number")], "l1(v)",
        "sum of absolute values of a vector"),
    _fn("abs", "pure", [(("number",), "number")], "abs(a)", "absolute value of a number"),
    _fn("log", "pure", [(("number",), "number")], "log(a)", "natural logarithm"),
    _fn("exp", "pure", [(("number",), "number")], "exp(a)", "exponential"),
    _fn("max", "pure", [(("number", "number"), "number")], "max(a, b)", "larger of two numbers"),
    _fn("min", "pure", [(("number", "number"), "number")], "min(a, b)", "smaller of two numbers"),
    _fn("len", "pure", [(_X, "number")], "len(x)", "number of tokens of input x"),
    _fn("latency_ms", "runtime", [(_X, "number")], "latency_ms(x)",
        "measured wall time of one inference-kernel forward pass on x, in milliseconds"),
    _fn("peak_memory_mb", "runtime", [(_X, "number")], "peak_memory_mb(x)",
        "measured peak memory of one inference-kernel forward pass on x, in MiB"),
    _fn("ece_gap", "label", [(("slice",), "number")], "ece_gap(S)",
        "|ECE(q) - ECE(p)| on slice S: expected calibration error gap; needs labels"),
    _fn("has_metadata", "static", [(("string",), "bool")], 'has_metadata("key")',
        "the ONNX model carries this metadata_props key"),
    _fn("opset", "static", [((), "number")], "opset()", "the model's default-domain opset"),
)}

# mean, max, min and percentiles p1..p99 over the tuples a binder list ranges over.
AGGREGATES = ("mean", "max", "min")
_PERCENTILE = re.compile(r"^p([1-9][0-9]?)$")


def aggregate_percentile(name: str) -> float | None:
    """The percentile (0-100) of an aggregate name pNN, else None."""
    m = _PERCENTILE.match(name)
    return float(m.group(1)) if m else None


def is_aggregate(name: str) -> bool:
    return name in AGGREGATES or aggregate_percentile(name) is not None
