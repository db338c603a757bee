"""The VNN-LIB reader (kcverify.dsl.vnnlib): the ACAS Xu properties, the accepted subset, exact
semantics, and one located error per malformed file."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import pytest

from kcverify.dsl.vnnlib import VnnlibError, load_vnnlib, parse_vnnlib
from kcverify.errors import InputFileError

ROOT = Path(__file__).resolve().parents[2]
ACAS = next((p for p in (ROOT / ".." / "shared" / "data" / "acasxu",
                         Path("/work/shared/data/acasxu")) if p.is_dir()), None)
HEAD = "".join(f"(declare-const X_{i} Real)\n" for i in range(2)) + \
    "".join(f"(declare-const Y_{i} Real)\n" for i in range(2))


@pytest.mark.skipif(ACAS is None, reason="ACAS Xu data not available")
def test_acasxu_properties() -> None:
    assert ACAS is not None
    shapes = {}
    for k in range(1, 11):
        p = load_vnnlib(ACAS / f"prop_{k}.vnnlib")
        assert (p.n_inputs, p.n_outputs) == (5, 5)
        shapes[k] = (len(p.cases), [len(c.unsafe) for c in p.cases])
    assert shapes[1] == (1, [1]) and shapes[2] == (1, [1]) and shapes[6] == (2, [4, 4])
    assert shapes[7] == (1, [2]) and shapes[8] == (1, [3])
    p1 = load_vnnlib(ACAS / "prop_1.vnnlib").cases[0]
    # bounds enclose the decimal bounds, rounded outward
    assert Fraction(p1.hi[0]) >= Fraction("0.679857769") > Fraction(p1.hi[0]) - Fraction(2**-52)
    assert Fraction(p1.lo[3]) <= Fraction("0.45")
    (atom,), = p1.unsafe
    assert atom.coeffs == ((0, Fraction(-1)),) and atom.rhs == -Fraction("3.991125645861615")
    p4 = load_vnnlib(ACAS / "prop_4.vnnlib").cases[0]
    assert p4.lo[2] == p4.hi[2] == 0.0  # a degenerate dimension is a point, not an empty box


def test_dnf_grouping_and_exact_checks() -> None:
    text = HEAD + """
; two boxes, each with two unsafe output conditions
(assert (or (and (>= X_0 0) (<= X_0 1) (>= X_1 -1) (<= X_1 1))
            (and (>= X_0 2) (<= X_0 3) (>= X_1 -1) (< X_1 1))))
(assert (or (<= (- Y_0 Y_1) 0.125) (and (> Y_1 (* 2 Y_0)) (>= Y_0 -5))))
"""
    p = parse_vnnlib(text, "t.vnnlib")
    assert len(p.cases) == 2 and all(len(c.unsafe) == 2 for c in p.cases)
    assert p.box() == ((0.0, -1.0), (3.0, 1.0))
    c0, c1 = p.cases
    assert c0.contains([1.0, 1.0]) and not c1.contains([2.5, 1.0])  # strict bound excluded
    assert p.violated([0.5, 0.0], [0.125, 0.0]) is not None  # 0.125 - 0 <= 0.125
    assert p.violated([0.5, 0.0], [0.1250001, 0.0]) is None
    assert p.violated([0.5, 0.0], [1.0, 0.5]) is None  # 0.5 > 0.125 and 0.5 > 2 is false
    assert p.violated([0.5, 0.0], [-1.0, -1.5]) is not None  # -1.5 > -2 and -1 >= -5
    # exact decimals: the float 0.1 is above the decimal 0.1
    tenth = parse_vnnlib(HEAD + "(assert (<= X_0 1)) (assert (>= X_0 0)) (assert (<= X_1 1))"
                         "(assert (>= X_1 0)) (assert (<= Y_0 0.1))")
    assert tenth.violated([0.0, 0.0], [0.1, 0.0]) is None
    assert tenth.violated([0.0, 0.0], [0.09999999999999999, 0.0]) is not None
    assert p.violated([1.5, 0.0], [0.0, -1.0]) is None  # no case contains X_0 = 1.5
    strict = [a for conj in c0.unsafe for a in conj if a.op == "<"]
    assert strict and strict[0].coeffs == ((0, Fraction(2)), (1, Fraction(-1)))


def test_ignored_commands_and_numbers() -> None:
    text = "(set-logic QF_LRA)\n" + HEAD + """
(assert (<= X_0 1e-1)) (assert (>= X_0 -.5)) (assert (<= X_1 (/ 1 3))) (assert (>= X_1 (- 1)))
(assert (<= Y_0 Y_1))
(check-sat)
"""
    c = parse_vnnlib(text).cases[0]
    assert c.lo[0] == -0.5 and c.hi[0] == 0.1 and c.lo[1] == -1.0
    assert Fraction(c.hi[1]) >= Fraction(1, 3)


BAD = {
    "unbalanced_close": (HEAD + "(assert (<= X_0 1)))\n", 5, 20,
                         "unbalanced parentheses: ')' without a matching '('"),
    "unclosed": (HEAD + "(assert (<= X_0 1)\n(assert (>= X_0 0))\n", 5, 1,
                 "unbalanced parentheses: this '(' is never closed"),
    "undeclared": (HEAD + "(assert (<= X_0 1))\n(assert (>= X_7 0))\n", 6, 13,
                   "undeclared variable 'X_7' (declare it with (declare-const X_7 Real) before "
                   "its first use)"),
    "empty_box": (HEAD + "(assert (<= X_0 1))\n(assert (>= X_0 2))\n(assert (<= X_1 1))\n"
                  "(assert (>= X_1 0))\n(assert (<= Y_0 0))\n", 6, 9,
                  "empty input box: X_0 >= 2 and X_0 <= 1 leave no value"),
    "unbounded": (HEAD + "(assert (<= X_0 1))\n(assert (>= X_0 0))\n(assert (<= X_1 1))\n"
                  "(assert (<= Y_0 0))\n", 5, 9,
                  "X_1 has no lower bound: the input set must be a bounded box"),
    "mixed": (HEAD + "(assert (<= X_0 Y_0))\n", 5, 9,
              "a comparison mixes input (X) and output (Y) variables; the VNN-LIB subset keeps "
              "them apart"),
    "nonlinear": (HEAD + "(assert (<= (* Y_0 Y_1) 1))\n", 5, 13, "a product of two variables is "
                  "not linear"),
    "command": (HEAD + "(push 1)\n", 5, 2, "unknown command 'push'; the VNN-LIB subset has "
                "declare-const and assert"),
    "sort": ("(declare-const X_0 Int)\n", 1, 20, "variable 'X_0' has sort 'Int'; expected Real"),
    "gap": ("(declare-const X_0 Real)\n(declare-const X_2 Real)\n(declare-const Y_0 Real)\n"
            "(assert (<= Y_0 0))\n", 2, 16,
            "X variables must be numbered 0..n-1: X_2 is declared but X_1 is not"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_malformed_is_one_located_error(name: str) -> None:
    text, line, col, msg = BAD[name]
    with pytest.raises(VnnlibError) as e:
        parse_vnnlib(text, "bad.vnnlib")
    assert e.value.render() == f"bad.vnnlib:{line}:{col}: error: {msg}"


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(InputFileError, match="no such VNN-LIB file"):
        load_vnnlib(tmp_path / "none.vnnlib")


def test_reader_is_pure_python() -> None:
    import subprocess
    import sys

    code = ("import sys, kcverify.dsl.vnnlib; "
            "sys.exit(1 if 'torch' in sys.modules or 'numpy' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
