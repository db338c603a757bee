"""`prove --blocks auto|segments|whole` (issue 14, "best matches the whole-model bound"): best
bounds a point input with the whole graph as one block where the segmenter's blocks (boxes
between them) miss a clause's threshold; the block record names the method and the cut (its
digest: the whole graph's), the checker re-runs exactly that, and a record whose method or cut
is altered is refused.

The model: mlp_small (three blocks) with a bf16 inference kernel, one point, where the segmented
bound (0.1951) is 4% above the whole-graph one (0.1872): a threshold between the two is proved
by no bound over the segments, only through the whole graph."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from kcverify.bounds import certify_drift
from kcverify.bounds.engine import blocks_of, whole_graph
from kcverify.cli import main
from kcverify.kernels.spec import parse_kernel_spec
from kcverify.models.ir import load_onnx

ROOT = Path(__file__).resolve().parents[2]
TRAIN = parse_kernel_spec("train", {"compute": "fp32", "accumulate": "fp32"})
BF16 = parse_kernel_spec("inf", {"compute": "bf16", "accumulate": "fp32"})
X = np.random.default_rng(0).standard_normal((1, 8)).astype(np.float32)

CONTRACT = """contract: cut
version: 1.0.0
model: {{onnx: mlp_small.onnx}}
kernels:
  train: {{compute: fp32, accumulate: fp32}}
  inf: {{compute: bf16, accumulate: fp32}}
slices:
  point: {{inputs: x.npz}}
clauses:
  - id: N-CUT
    family: numerical
    assert: "forall x in point: linf(logits_inf(x) - logits_train(x)) <= {tau}"
    level: L2
    action: guard
escalation: {{L1: log, L2: guard, L3: fallback}}
"""


@pytest.fixture(scope="module")
def bounds() -> tuple[float, float]:
    g = load_onnx(ROOT / "models" / "mlp_small.onnx")
    feeds = {g.inputs[0].name: X}
    seg = float(certify_drift(g, TRAIN, BF16, feeds, domain="best").linf[0])
    whole = float(certify_drift(g, TRAIN, BF16, feeds, domain="best", cut="whole").linf[0])
    assert len(blocks_of(g)) == 3 and whole < 0.97 * seg, (whole, seg)
    return seg, whole


def _workspace(tmp_path: Path, tau: float) -> tuple[Path, Path]:
    shutil.copy(ROOT / "models" / "mlp_small.onnx", tmp_path / "mlp_small.onnx")
    np.savez(tmp_path / "x.npz", x=X)
    c = tmp_path / "cut.yaml"
    c.write_text(CONTRACT.format(tau=repr(tau)))
    return tmp_path / "mlp_small.onnx", c


def _clause(report: Path) -> dict:
    return json.loads(report.read_text())["clauses"][0]


def test_auto_proves_with_the_whole_graph_where_segments_miss(tmp_path: Path, bounds) -> None:  # type: ignore[no-untyped-def]
    seg, whole = bounds
    model, contract = _workspace(tmp_path, 0.5 * (seg + whole))
    cert, report = tmp_path / "c.kcert.json", tmp_path / "r.json"
    args = [str(contract), str(model), "--cert", str(cert), "--report", str(report), "--quiet"]
    assert main(["prove", *args, "--blocks", "segments", "--no-cert"]) in (0, 1)
    c = _clause(report)
    # the segments' bound misses; z3 on this small network may still decide the clause after
    # it (within its timeout: machine-dependent), but no bound over the segments proves it
    assert c["blocks"][-1]["certified"] == pytest.approx(seg, rel=1e-6)
    assert c["verdict"] != "proved" or c["method"] == "smt-z3", c
    assert main(["prove", *args]) == 0  # auto
    c = _clause(report)
    assert c["verdict"] == "proved" and c["method"] == "bound-best (whole graph)", c
    assert c["bound"] == pytest.approx(whole, rel=1e-6)
    stmt = json.loads(cert.read_text())
    (rec,) = stmt["predicate"]["blocks"].values()
    g = load_onnx(model)
    assert rec["method"] == "best" and rec["digest"] == whole_graph(g)[0].digest
    assert main(["check", str(cert), str(model), str(contract)]) == 0


def test_a_record_whose_method_or_cut_is_altered_is_refused(tmp_path: Path, bounds) -> None:  # type: ignore[no-untyped-def]
    seg, whole = bounds
    model, contract = _workspace(tmp_path, 0.5 * (seg + whole))
    cert = tmp_path / "c.kcert.json"
    assert main(["prove", str(contract), str(model), "--cert", str(cert), "--quiet",
                 "--blocks", "whole"]) == 0
    original = cert.read_text()
    assert main(["check", str(cert), str(model), str(contract)]) == 0
    g = load_onnx(model)
    first = blocks_of(g)[0]

    def altered(change) -> int:  # type: ignore[no-untyped-def]
        st = json.loads(original)
        (rec,) = st["predicate"]["blocks"].values()
        change(rec)
        cert.write_text(json.dumps(st))
        return main(["check", str(cert), str(model), str(contract)])

    # re-run with intervals (another method) the stored whole-graph bound does not hold
    assert altered(lambda r: r.update(method="interval")) == 1
    assert altered(lambda r: r.update(method="segments")) == 1  # no such method
    # the cut: the digest of a segment (its re-run reads other tensors), another name
    assert altered(lambda r: r.update(digest=first.digest)) == 1
    assert altered(lambda r: r.update(name=first.name)) == 1
    cert.write_text(original)
    assert main(["check", str(cert), str(model), str(contract)]) == 0


def test_whole_runs_one_input_per_chunk_and_says_where_it_is(tmp_path: Path, bounds,
                                                             capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """--blocks whole bounds a slice of two points in two whole-graph runs (the zonotope on
    each), with progress lines from inside the block."""
    import importlib

    monkeypatch.setattr(importlib.import_module("kcverify.planner.prove"), "PROGRESS_S", 0.0)
    seg, whole = bounds
    model, contract = _workspace(tmp_path, 4 * seg)
    np.savez(tmp_path / "x.npz", x=np.concatenate([X, X[:, ::-1]]))
    report = tmp_path / "r.json"
    assert main(["prove", str(contract), str(model), "--no-cert", "--report", str(report),
                 "--blocks", "whole", "--realizations", "1"]) == 0
    err = capsys.readouterr().err
    assert "inputs [0, 1) (whole graph)" in err and "inputs [1, 2) (whole graph)" in err
    assert "block 'model' node " in err
    assert _clause(report)["bound"] >= whole * (1 - 1e-9)


def test_auto_stops_at_the_first_input_that_misses_alone(tmp_path: Path, bounds, capsys) -> None:  # type: ignore[no-untyped-def]
    """A max clause no input can meet: auto bounds the whole graph for the first input only
    (its bound alone misses the threshold) and says so; the clause is decided on evidence."""
    seg, whole = bounds
    model, contract = _workspace(tmp_path, 0.5 * whole)
    np.savez(tmp_path / "x.npz", x=np.concatenate([X, X[:, ::-1]]))
    report = tmp_path / "r.json"
    assert main(["prove", str(contract), str(model), "--no-cert", "--report", str(report),
                 "--realizations", "1"]) in (0, 1)
    err = capsys.readouterr().err
    assert "inputs [0, 1) (whole graph)" in err and "inputs [1, 2) (whole graph)" not in err
    c = _clause(report)
    assert c["verdict"] != "proved" and "stopped after 1 of 2 run(s)" in c["note"], c


def test_the_stop_reads_per_input_and_per_token_bounds() -> None:
    """auto's stop for a mean clause: a chunk that improves no input's (or token's) segmented
    bound stops it; an improvement, or bounds it cannot line up, go on."""
    import importlib
    from types import SimpleNamespace

    may = importlib.import_module("kcverify.planner.prove")._may_prove
    q = SimpleNamespace(threshold=0.6, op=">=")
    seg = [0.0] * 6  # 2 inputs x 3 tokens, top-1 agreement lower bounds
    assert not may(q, "mean", "lower", [0.0, 0.0, 0.0], seg, (0, 1), 2)
    assert may(q, "mean", "lower", [0.0, 1.0, 0.0], seg, (0, 1), 2)
    assert may(q, "mean", "lower", [0.0, 0.0], seg, (1, 2), 2)  # cannot line up: go on
    assert not may(q, "mean", "upper", [3.0], [2.0, 5.0], (0, 1), 2)
    assert may(q, "mean", "upper", [3.0], [2.0, 5.0], (1, 2), 2)
    m = SimpleNamespace(threshold=1.0, op="<=")
    assert not may(m, "max", "upper", [0.5, 1.5], None, (0, 1), 4)
    assert may(m, "max", "upper", [0.5, 1.0], None, (0, 1), 4)
