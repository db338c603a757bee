"""`kcverify vnnlib` on ACAS Xu known answers (a fast subset; bench/acasxu.py runs all 186) and
on malformed properties."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import numpy as np
import pytest

from kcverify.cli import main
from kcverify.dsl.vnnlib import load_vnnlib

# (net, property): quick instances, two of each answer
FAST = (("2_3", 4), ("4_5", 3), ("2_1", 2), ("1_7", 3))


def _truth(acas: Path) -> dict[tuple[str, str], str]:
    with open(acas / "ground_truth.csv") as f:
        return {(r["onnx"], r["vnnlib"]): r["expected"] for r in csv.DictReader(f)}


@pytest.mark.parametrize("net,prop", FAST)
def test_known_answers(acas: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                       net: str, prop: int) -> None:
    model, vnn = f"ACASXU_run2a_{net}_batch_2000.onnx", f"prop_{prop}.vnnlib"
    want = _truth(acas)[(model, vnn)]
    out = tmp_path / "result.txt"
    rc = main(["vnnlib", str(acas / model), str(acas / vnn), "--timeout", "40", "--out", str(out)])
    text = out.read_text()
    assert capsys.readouterr().out == text
    assert text.split("\n")[0] == want, (net, prop, text)
    assert rc == (0 if want == "unsat" else 1)
    if want == "sat":
        _check_witness(acas / model, load_vnnlib(acas / vnn), text)


def _check_witness(model: Path, prop, text: str) -> None:  # noqa: ANN001
    """The witness's X is a float32 point of the box and its Y is unsafe; onnxruntime at that X
    lands within fp32 noise of the reported Y."""
    import onnxruntime as ort

    vals = {m[0]: float(m[1]) for m in re.findall(r"\((\w+) ([^\s()]+)\)", text)}
    x = np.array([vals[f"X_{i}"] for i in range(prop.n_inputs)])
    y = np.array([vals[f"Y_{i}"] for i in range(prop.n_outputs)])
    assert np.array_equal(x.astype(np.float32).astype(np.float64), x)
    assert prop.violated(x.tolist(), y.tolist()) is not None
    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    yo = sess.run(None, {"input": x.astype(np.float32).reshape(1, 1, 1, 5)})[0].reshape(-1)
    assert np.allclose(yo, y, rtol=1e-5, atol=1e-6)


BAD = {
    "unbalanced": ("(declare-const X_0 Real)\n(declare-const Y_0 Real)\n(assert (<= X_0 1)))\n",
                   "3:20: error: unbalanced parentheses"),
    "undeclared": ("(declare-const X_0 Real)\n(declare-const Y_0 Real)\n(assert (<= X_1 1))\n",
                   "3:13: error: undeclared variable 'X_1'"),
    "empty": ("(declare-const X_0 Real)\n(declare-const Y_0 Real)\n(assert (<= X_0 0))\n"
              "(assert (>= X_0 1))\n(assert (<= Y_0 0))\n", "4:9: error: empty input box"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_malformed_exit_2(acas: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                          name: str) -> None:
    text, where = BAD[name]
    p = tmp_path / f"{name}.vnnlib"
    p.write_text(text)
    out = tmp_path / "result.txt"
    rc = main(["vnnlib", str(acas / "ACASXU_run2a_1_1_batch_2000.onnx"), str(p),
               "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"{p}:{where}"), err
    assert not out.exists()


def test_size_mismatch_is_bad_input(acas: Path, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "small.vnnlib"
    p.write_text("(declare-const X_0 Real)\n(declare-const Y_0 Real)\n(assert (<= X_0 1))\n"
                 "(assert (>= X_0 0))\n(assert (<= Y_0 0))\n")
    rc = main(["vnnlib", str(acas / "ACASXU_run2a_1_1_batch_2000.onnx"), str(p)])
    assert rc == 2
    assert "declares 1 inputs X_i, the model's input 'input' has 5 elements" in \
        capsys.readouterr().err


def test_timeout_reports_fraction_and_bound(acas: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Out of time on an unsat instance that needs thousands of parts (4_9 on property 1 is
    still open after 10 s; 1_4, used before, is now proved in about 100 parts): the answer is
    timeout (never unsat, never sat), and stderr gives the proved share of the box volume and
    the best certified margin."""
    out = tmp_path / "result.txt"
    rc = main(["vnnlib", str(acas / "ACASXU_run2a_4_9_batch_2000.onnx"),
               str(acas / "prop_1.vnnlib"), "--timeout", "3", "--out", str(out)])
    cap = capsys.readouterr()
    assert rc == 1 and out.read_text() == cap.out and cap.out.strip() in ("timeout", "unknown")
    # (under heavy load the 3 s may run out in the counterexample search, before splitting:
    # then 0 parts and an infinite bound, said the same way)
    m = re.search(r"(\d+\.\d\d)% of the box volume proved in \d+ parts; best bound "
                  r"([0-9.e+-]+|inf)", cap.err)
    assert m, cap.err
    assert float(m.group(1)) < 100.0 and float(m.group(2)) > 0


@pytest.mark.parametrize("net,prop,kernel,want", [("1_7", 3, "inf", "sat"),
                                                  ("2_3", 4, "train", "unsat")])
def test_contract_kernel(acas: Path, capsys: pytest.CaptureFixture[str], net: str, prop: int,
                         kernel: str, want: str) -> None:
    """--contract C --kernel K: the answer holds for the programs of that kernel (fp16 weights
    for NeuroDiff's inf); a sat witness names a program of it."""
    contract = Path(__file__).resolve().parents[2] / "examples" / "contracts" / "acasxu-fp16.yaml"
    rc = main(["vnnlib", str(acas / f"ACASXU_run2a_{net}_batch_2000.onnx"),
               str(acas / f"prop_{prop}.vnnlib"), "--contract", str(contract), "--kernel", kernel,
               "--timeout", "40"])
    cap = capsys.readouterr()
    assert cap.out.split("\n")[0] == want and rc == (0 if want == "unsat" else 1)
    assert f"acasxu-fp16.yaml: {kernel}" in cap.err
    if want == "sat":
        assert f"witness from {kernel} kernel" in cap.err
        p = load_vnnlib(acas / f"prop_{prop}.vnnlib")
        vals = {m[0]: float(m[1]) for m in re.findall(r"\((\w+) ([^\s()]+)\)", cap.out)}
        x = [vals[f"X_{i}"] for i in range(p.n_inputs)]
        y = [vals[f"Y_{i}"] for i in range(p.n_outputs)]
        assert p.violated(x, y) is not None  # the fp16-weight program's outputs, exactly
