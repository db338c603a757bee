"""numerical_query recognises exactly the documented certifiable shapes; classes per semantics §1.2."""

from __future__ import annotations

from pathlib import Path

import pytest

from kcverify.dsl import load_contract, numerical_queries, numerical_query, parse_contract
from kcverify.dsl.analysis import NumericalQuery

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

HEAD = """contract: t
kernels: {train: {}, inf: {compute: bf16}}
slices: {all: {inputs: a.npz}, s: {inputs: b.npz}}
temperature: 0.5
clauses:
"""


def clause(body: str):  # noqa: ANN201
    c = parse_contract(HEAD + f"  - {{id: C, family: numerical, assert: {body!r}}}\n")
    return c.clauses[0]


Q = NumericalQuery
POSITIVE = [
    ("forall x in all: linf(logits_inf(x) - logits_train(x)) <= 0.05",
     Q("all", "logit_linf", "max", "<=", 0.05, 0.5, False, None)),
    ("forall x in s: linf(logits_train(x) - logits_inf(x)) < 1",
     Q("s", "logit_linf", "max", "<", 1.0, 0.5, False, None)),
    ("forall x in all: forall t: l2(logits_inf(x, t) - logits_train(x, t)) <= 2",
     Q("all", "logit_l2", "max", "<=", 2.0, 0.5, True, None)),
    ("forall y in all, u: abs(logprob_inf(y, u) - logprob_train(y, u)) <= 0.1",
     Q("all", "logprob_abs", "max", "<=", 0.1, 0.5, True, None)),
    ("forall x in all: forall t: abs(log(ratio(x, t))) <= 0.1",
     Q("all", "logprob_abs", "max", "<=", 0.1, 0.5, True, None)),
    ("forall x in all: forall t: abs(ratio(x, t) - 1) <= 0.2",
     Q("all", "ratio_dev", "max", "<=", 0.2, 0.5, True, None)),
    ("forall x in all: forall t: 0.2 >= abs(1 - ratio(x, t))",
     Q("all", "ratio_dev", "max", "<=", 0.2, 0.5, True, None)),
    ("forall x in all: tv(x) <= 2 * 0.01", Q("all", "tv", "max", "<=", 0.02, 0.5, False, None)),
    ("forall x in all, t: tv(probs_inf(x, t), probs_train(x, t)) <= 0.1",
     Q("all", "tv", "max", "<=", 0.1, 0.5, True, None)),
    ("forall x in all, t: kl(probs_train(x, t), probs_inf(x, t)) <= 0.1",
     Q("all", "kl", "max", "<=", 0.1, 0.5, True, None)),
    ("mean(x in all, t: kl(x, t)) <= 0.001", Q("all", "kl", "mean", "<=", 0.001, 0.5, True, None)),
    ("p99(x in s: kl(x)) <= 0.01", Q("s", "kl", "p99", "<=", 0.01, 0.5, False, None)),
    ("p50(x in all, t: l2(logits_inf(x, t) - logits_train(x, t))) <= 3",
     Q("all", "logit_l2", "p50", "<=", 3.0, 0.5, True, None)),
    ("p95(x in all: linf(logits_inf(x) - logits_train(x))) <= 3",
     Q("all", "logit_linf", "p95", "<=", 3.0, 0.5, False, None)),
    ("max(x in all: linf(logits_inf(x) - logits_train(x))) <= 3",
     Q("all", "logit_linf", "max", "<=", 3.0, 0.5, False, None)),
    ("mean(x in all, t: top1_agree(x, t)) >= 0.99",
     Q("all", "top1_agree", "mean", ">=", 0.99, 0.5, True, 1)),
    ("0.9 < mean(x in all: topk_agree(x, 5))",
     Q("all", "topk_agree", "mean", ">", 0.9, 0.5, False, 5)),
    ("forall x in all: forall t: top1_agree(x, t)",
     Q("all", "top1_agree", "min", ">=", 1.0, 0.5, True, 1)),
    ("min(x in s: top1_agree(x)) >= 1", Q("s", "top1_agree", "min", ">=", 1.0, 0.5, False, 1)),
    ("max(x in all, t: top1_agree(x, t)) > 0", Q("all", "top1_agree", "max", ">", 0.0, 0.5, True, 1)),
    ("min(x in all: linf(logits_inf(x) - logits_train(x))) <= 3",
     Q("all", "logit_linf", "min", "<=", 3.0, 0.5, False, None)),
]

NEGATIVE = [
    "forall x in all: linf(logits_inf(x) - logits_inf(x)) <= 0.05",  # not a drift
    "forall x in all: linf(logits_inf(x) + logits_train(x)) <= 0.05",
    "forall x in all: linf(logits_inf(x) - logits_train(x)) >= 0.05",  # a lower bound
    "exists x in all: linf(logits_inf(x) - logits_train(x)) <= 0.05",
    "forall x in all: forall t: abs(ratio(x, t) - 2) <= 0.2",
    "forall x in all, t: kl(probs_inf(x, t), probs_train(x, t)) <= 0.1",  # reverse KL
    "p90(x in all: kl(x)) <= 0.01",  # percentile the planner does not know
    "mean(x in all, t: top1_agree(x, t)) <= 0.99",  # agreement bounded from above
    "mean(x in all, t: ratio(x, t) * log(ratio(x, t))) <= 0.01",
    "forall x in all: forall t: 0.8 <= ratio(x, t) <= 1.25",
    "forall x in all: margin(x) > 0 implies top1_agree(x)",
    "forall x in all: forall t: abs(logprob_inf(x, t) - logprob_train(x, t)) <= kl(x)",
]


@pytest.mark.parametrize(("text", "query"), POSITIVE, ids=[t for t, _ in POSITIVE])
def test_recognised(text: str, query: NumericalQuery) -> None:
    c = clause(text)
    assert c.klass == "certifiable"
    assert numerical_query(c) == query
    assert numerical_queries(c) == [query]


@pytest.mark.parametrize("text", NEGATIVE)
def test_not_recognised(text: str) -> None:
    c = clause(text)
    assert c.klass == "certifiable"
    assert numerical_query(c) is None


def test_conjunctions_split() -> None:
    c = clause("forall x in all, t: abs(ratio(x, t) - 1) <= 0.2 and kl(x, t) <= 0.1")
    assert numerical_query(c) is None
    assert [q.quantity for q in numerical_queries(c)] == ["ratio_dev", "kl"]
    c = clause("forall x in all, t: abs(ratio(x, t) - 1) <= 0.2 and kl(x, t) >= 0.1")
    assert numerical_queries(c) is None


def test_short_form_over_two_slices() -> None:
    c = parse_contract(HEAD + "  - {id: S, metric: mean_kl, slices: [all, s], threshold: 1e-3}\n")
    (cl,) = c.clauses
    assert cl.family == "statistical" and cl.form == "metric" and cl.metric == "mean_kl"
    assert cl.text == "mean(x in all, t: kl(x, t)) <= 0.001 and mean(x in s, t: kl(x, t)) <= 0.001"
    assert cl.slices == ("all", "s")
    assert [q.slice for q in numerical_queries(cl)] == ["all", "s"]


@pytest.mark.parametrize(("text", "klass"), [
    ("forall x in all: kl(x) <= 1", "certifiable"),
    ("p95(x in all: latency_ms(x)) <= 40", "empirical"),
    ("ece_gap(all) <= 0.01", "empirical"),
    ("forall x in all: kl(x) <= 1 and peak_memory_mb(x) <= 10", "empirical"),
    ("opset() >= 17", "static"),
    ('has_metadata("a")', "static"),
])
def test_classes(text: str, klass: str) -> None:
    c = clause(text)
    assert c.klass == klass
    if klass != "certifiable":
        assert numerical_query(c) is None


def test_fp8_demo_contract_shapes() -> None:
    """./dev demo relies on these shapes of the shipped FP8 contract."""
    c = load_contract(ROOT / "examples" / "contracts" / "fp8-deploy.yaml")
    quantities = {q.quantity for cl in c.clauses for q in (numerical_queries(cl) or [])}
    assert {"logit_linf", "top1_agree", "logprob_abs", "kl"} <= quantities
    classes = {cl.id: cl.klass for cl in c.clauses}
    assert "empirical" in classes.values()
    assert any(not cl.hard and cl.budget for cl in c.clauses)
    assert set(c.slices) == {"all", "safety", "sample"}
    assert "static" in classes.values()
    inf = c.kernels["inf"]
    assert inf.weights.format.name == "fp8_e4m3" and inf.weights.scale == "per_channel"
    assert inf.activations.scale == "dynamic_per_tensor"
    assert inf.compute.name == inf.accumulate.name == "fp32"
    assert inf.weights.format.u == 2.0**-4 and inf.weights.format.max_finite == 448.0
    assert c.model.onnx and c.resolve(c.model.onnx).resolve() == (ROOT / "models" /
                                                                  "tiny_decoder.onnx")


def test_contract_fields() -> None:
    c = load_contract(ROOT / "examples" / "contracts" / "minimal.yaml")
    assert c.name == "minimal-train-infer" and c.version == "1.2.0"
    assert len(c.sha256) == 64
    assert c.slices["near_eval"].region is not None
    assert c.slices["near_eval"].region.eps == 0.01
    assert str(c.slices["long_ctx"].where) == "len >= 512"
    n1 = c.clause("N-1")
    assert (n1.level, n1.action, n1.hard, n1.threshold) == ("L2", "guard", True, 0.05)
    assert (n1.line, n1.column) == (17, 5)
    s1 = c.clause("S-1")
    assert (s1.hard, s1.budget, s1.threshold) == (False, 0.01, 0.99)
    assert c.escalation["L3"] == "fallback"
