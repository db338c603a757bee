"""The checker accepts an honest certificate and rejects each kind of tampering."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kcverify.certs.checker import CheckReport, check_certificate
from kcverify.certs.encoding import decode_array, encode_array, fx, unfx
from kcverify.certs.statement import CertificateBuilder
from kcverify.certs.testing import FakeBox, FakeEngine, example_certificate
from kcverify.kernels.spec import parse_kernel_spec


def check(example: Any, engine: FakeEngine, stmt: dict[str, Any] | None = None,
          **kw: Any) -> CheckReport:
    model, contract, specs, st = example
    kw.setdefault("kernel_specs", specs)
    kw.setdefault("recheck_block", engine.recheck)
    kw.setdefault("expected_chain", engine.chain)
    kw.setdefault("store_input", None)
    return check_certificate(stmt if stmt is not None else st, model, contract, **kw)


def rejected(report: CheckReport, *fragments: str) -> None:
    assert not report.ok
    text = "\n".join(report.problems)
    for f in fragments:
        assert f in text, text


def clause(stmt: dict[str, Any], cid: str) -> dict[str, Any]:
    return next(c for c in stmt["predicate"]["clauses"] if c["id"] == cid)


def test_honest_certificate_checks(example: Any, engine: FakeEngine) -> None:
    report = check(example, engine)
    assert report.ok, report.problems
    assert report.problems == []


def test_changed_model_byte(example: Any, engine: FakeEngine) -> None:
    model = example[0]
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0x01
    model.write_bytes(bytes(data))
    rejected(check(example, engine), "model digest mismatch")


def test_different_contract(example: Any, engine: FakeEngine) -> None:
    contract = example[1]
    contract.write_text(contract.read_text().replace("<= 0.5", "<= 0.6"))
    rejected(check(example, engine), "contract digest mismatch")


def test_different_kernel_spec(example: Any, engine: FakeEngine) -> None:
    specs = dict(example[2])
    specs["inf"] = parse_kernel_spec("inf", {"compute": "bf16", "accumulate": "bf16"})
    rejected(check(example, engine, kernel_specs=specs), "kernel:inf: kernel spec digest mismatch")
    specs.pop("inf")
    rejected(check(example, engine, kernel_specs=specs), "kernel:inf: the certificate names")


def test_edited_clause_bound(example: Any, engine: FakeEngine) -> None:
    st = example[3]
    c = clause(st, "N-1")
    c["bound"] = fx(unfx(c["bound"]) / 2)
    rejected(check(example, engine, st), "clause N-1: bound", "tighter than the proof gives")


def test_edited_bound_inside_the_proof(example: Any, engine: FakeEngine) -> None:
    st = example[3]
    linf = clause(st, "N-RLHF-1")["proof"]["premises"][0]["premises"][0]
    assert linf["rule"] == "linf-from-state"
    linf["conclusion"]["bounds"] = [fx(unfx(b) / 10) for b in linf["conclusion"]["bounds"]]
    rejected(check(example, engine, st), "(linf-from-state): conclusion.bounds[0]",
             "tighter than justified")


def _scale_drift(st: dict[str, Any], ref: str, tensor: str, factor: float) -> None:
    box = st["predicate"]["blocks"][ref]["out_state"][tensor]
    for f in ("drift_lo", "drift_hi"):
        box[f] = encode_array(decode_array(box[f]) * factor)


def test_edited_block_out_state(example: Any, engine: FakeEngine) -> None:
    st = example[3]
    _scale_drift(st, "1:b1", "logits", 0.5)  # consistently re-encoded, tighter than the method
    rejected(check(example, engine, st), "block 'b1' (1:b1)", "not inside the stored one")


def test_loosened_block_out_state_breaks_the_derived_bounds(example: Any, engine: FakeEngine) -> None:
    st = example[3]
    _scale_drift(st, "1:b1", "logits", 2.0)  # still a valid block certificate ...
    rejected(check(example, engine, st), "(linf-from-state)")  # ... but the bounds above now lie


def test_removed_block_from_the_chain(example: Any, engine: FakeEngine) -> None:
    st = example[3]
    seq = clause(st, "N-1")["proof"]["premises"][0]["premises"][0]
    assert seq["rule"] == "sequential"
    del seq["premises"][0]
    rejected(check(example, engine, st), "assumes tensor 'h', which no earlier block produces")


def test_removed_block_record(example: Any, engine: FakeEngine) -> None:
    st = example[3]
    del st["predicate"]["blocks"]["0:b0"]
    rejected(check(example, engine, st), "block '0:b0' is not in predicate.blocks")


def test_chain_must_match_the_segmentation(example: Any, engine: FakeEngine) -> None:
    other = FakeEngine(seed=5)
    rejected(check(example, engine, expected_chain=other.chain), "is not the model's segmentation")


def test_threshold_outside_its_precondition(example: Any, engine: FakeEngine) -> None:
    st = example[3]
    c = clause(st, "N-1")
    tiny = fx(1e-6)
    c["threshold"] = tiny
    c["proof"]["params"]["threshold"] = tiny
    c["proof"]["conclusion"]["threshold"] = tiny
    rejected(check(example, engine, st), "threshold applied outside its precondition")


def test_top1_outside_its_precondition(tmp_path: Path) -> None:
    engine = FakeEngine(eps=0.5)  # drift so large that no margin exceeds 2δ
    ex = example_certificate(tmp_path, engine)
    model, contract, specs, st = ex
    assert clause(st, "S-TOP1")["verdict"] == "unknown"  # the planner could not prove it
    b = CertificateBuilder(model, contract, specs, {"name": "fake-contract", "version": "1.0.0"},
                           store_input=None)
    x = np.random.default_rng(1).uniform(-1, 1, size=(3, engine.n_in))
    refs = [b.add_block(r) for r in engine.certify(x)]
    chain = b.sequential(refs, {"x": FakeBox.point(x)}, ["logits"], slice="all")
    agree = b.apply("top1-from-margin", [b.apply("linf-from-state", [chain], tensor="logits"), chain])
    assert all(unfx(v) == 0.0 for v in agree["conclusion"]["bounds"])
    agree["conclusion"]["bounds"] = [fx(1.0)] * 3  # claim agreement anyway
    top1 = {"rule": "threshold", "premises": [agree], "params": {"threshold": fx(1.0), "op": ">="},
            "conclusion": {"quantity": "top1_agreement", "tensor": "logits", "slice": "all",
                           "holds": True, "op": ">=", "threshold": fx(1.0), "bound": [fx(1.0)]}}
    b.add_clause("S-TOP1", "numerical", "proved", threshold=1.0, op=">=", proof=top1)
    rejected(check(ex, engine, b.build()), "top1-from-margin applied outside its precondition")


def test_unknown_rule_and_missing_recheck(example: Any, engine: FakeEngine) -> None:
    st = example[3]
    clause(st, "N-TV")["proof"]["rule"] = "wishful-thinking"
    rejected(check(example, engine, st), "unknown rule 'wishful-thinking'")
    rejected(check(example, engine, recheck_block=None, kernel_specs={"train": example[2]["train"]}),
             "not re-checked")


def test_verdicts_must_follow(example: Any, engine: FakeEngine) -> None:
    st = example[3]
    clause(st, "N-KL")["threshold"] = fx(0.5)  # the proof is for 0.01
    clause(st, "S-1")["evidence"]["observed"] = fx(0.5)  # passed, yet 0.5 >= 0.99 is false
    clause(st, "N-1")["verdict"] = "unknown"  # unknown, yet proved
    c = clause(st, "N-TV")
    c["verdict"], c["proof"] = "proved", None
    rejected(check(example, engine, st), "clause N-KL: the proof's threshold",
             "clause S-1: verdict 'passed' contradicts", "clause N-1: 'unknown', yet",
             "clause N-TV: verdict 'proved' without a proof tree")


def test_stored_state_arrays_are_exact(example: Any) -> None:
    st = example[3]
    box = st["predicate"]["blocks"]["0:b0"]["in_state"]["x"]
    x = decode_array(box["train_lo"])
    assert np.array_equal(x, decode_array(box["inf_hi"]))


def test_contract_loaded_by_the_dsl(example: Any, engine: FakeEngine) -> None:
    """The checker reads the contract with kcverify.dsl (always, kernel specs given or not) and
    checks that each proved clause's proof establishes the contract's own condition."""
    kw = {"kernel_specs": None}
    assert check(example, engine, **kw).ok, check(example, engine, **kw).problems
    st = example[3]
    tv, kl = clause(st, "N-TV"), clause(st, "N-KL")
    tv["proof"], kl["proof"] = kl["proof"], tv["proof"]  # valid proofs, of the wrong clauses
    tv["threshold"], kl["threshold"] = kl["threshold"], tv["threshold"]
    tv["bound"], kl["bound"] = kl["bound"], tv["bound"]
    tv["quantity"], kl["quantity"] = kl["quantity"], tv["quantity"]
    for report in (check(example, engine, st), check(example, engine, st, **kw)):
        # self-consistent: only the match with the contract fails ...
        assert all("the proof does not establish" in p for p in report.problems), report.problems
        rejected(report,  # ... it is not what the contract asks
                 "clause N-TV: the proof does not establish 'max of tv over all (per input) <= 0.05'",
                 "it bounds 'kl', not 'tv'")


def test_proof_over_another_slice(example: Any, engine: FakeEngine) -> None:
    st = example[3]
    proof = clause(st, "N-1")["proof"]
    proof["conclusion"]["slice"] = "other"
    proof["premises"][0]["conclusion"]["slice"] = "other"
    seq = proof["premises"][0]["premises"][0]
    seq["params"]["slice"] = seq["conclusion"]["slice"] = "other"
    report = check(example, engine, st, input_region=lambda s: {})
    # N-1 is consistent in itself (shared nodes of other clauses are not) ...
    assert [p for p in report.problems if p.startswith("clause N-1:")] == [
        "clause N-1: the proof does not establish 'max of logit_linf over all (per input) <= 0.5' "
        "(it is over "
        "slice 'other', not 'all')"]  # ... but over another slice than the contract's


def test_input_region_must_cover_the_slice(example: Any, engine: FakeEngine) -> None:
    from kcverify.certs.testing import FakeBox

    st = example[3]
    seq = clause(st, "N-1")["proof"]["premises"][0]["premises"][0]
    x = decode_array(seq["params"]["inputs"]["x"]["train_lo"])
    assert check(example, engine, input_region=lambda s: {"x": FakeBox.point(x)}).ok
    rejected(check(example, engine, input_region=lambda s: {"x": FakeBox.point(x + 0.5)}),
             "does not contain the inputs of slice 'all'")


def test_checker_imports_stay_light() -> None:
    """semantics §2: certs/checker depends on nothing heavier than re-checking needs."""
    import subprocess
    import sys

    code = ("import sys, kcverify.certs.checker, kcverify.registry; "
            "print(sorted(m for m in ('torch', 'onnx', 'kcverify.bounds', 'z3') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_slices_with_data_are_digested_trace_slices_are_not(example: Any, engine: FakeEngine) -> None:
    """Every slice with a data file is a subject; a slice given only by a trace file (read by
    monitor/promote, never by prove) is not, so a growing log does not break the certificate."""
    from kcverify.certs.testing import CONTRACT_TEXT
    from kcverify.dsl import load_contract

    model, contract, specs, _ = example
    head = CONTRACT_TEXT[:CONTRACT_TEXT.index("clauses:")]
    contract.write_text(head.replace("  all: {inputs: data.npz}\n", "  all: {inputs: data.npz}\n"
                                     "  live: {traces: live.jsonl}\n  again: {inputs: data.npz}\n")
                        + "clauses:\n" + CONTRACT_TEXT.split("clauses:\n")[1].splitlines()[0] + "\n")
    x = decode_array(example[3]["predicate"]["blocks"]["0:b0"]["in_state"]["x"]["train_lo"])
    b = CertificateBuilder(model, contract, specs, {"name": "fake-contract", "version": "1.0.0"},
                           slices=load_contract(contract).slices, store_input=None)
    refs = [b.add_block(r) for r in engine.certify(x)]
    chain = b.sequential(refs, {"x": FakeBox.point(x)}, ["logits"], slice="all")
    b.add_clause("N-1", "numerical", "proved", threshold=0.5, method="fake-affine",
                 proof=b.apply("threshold", [b.apply("linf-from-state", [chain], tensor="logits")],
                               threshold=0.5))
    st = b.build()
    assert sorted(s["name"] for s in st["subject"] if s["name"].startswith("slice:")) == [
        "slice:again", "slice:all"]
    assert check(example, engine, st).ok, check(example, engine, st).problems
    st["subject"] = [s for s in st["subject"] if s["name"] != "slice:again"]
    rejected(check(example, engine, st), "slice 'again': its data file is not digested")
