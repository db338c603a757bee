"""The certificate as JSON: round trip, exact floats and arrays, atomic writes, validation."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kcverify.certs.encoding import decode_array, down, encode_array, fx, unfx, up
from kcverify.certs.statement import (
    PREDICATE_TYPE,
    STATEMENT_TYPE,
    kernel_spec_digest,
    read_certificate,
    validate_statement,
    write_certificate,
)
from kcverify.errors import CertificateError


def test_round_trip_is_exact(example: Any, tmp_path: Path) -> None:
    _, _, _, stmt = example
    path = write_certificate(tmp_path / "out" / "c.kcert.json", stmt)
    assert read_certificate(path) == stmt
    text = path.read_text()
    assert json.dumps(json.loads(text), sort_keys=True, indent=1) + "\n" == text  # sort_keys
    assert [p.name for p in path.parent.iterdir()] == ["c.kcert.json"]  # no temp file left


def test_statement_shape(example: Any) -> None:
    model, contract, specs, stmt = example
    assert stmt["_type"] == STATEMENT_TYPE and stmt["predicateType"] == PREDICATE_TYPE
    names = {s["name"]: s["digest"]["sha256"] for s in stmt["subject"]}
    assert set(names) == {"model.onnx", "contract.yaml", "kernel:train", "kernel:inf", "slice:all"}
    canon = json.dumps(specs["inf"].canonical(), sort_keys=True).encode()
    import hashlib

    assert names["kernel:inf"] == hashlib.sha256(canon).hexdigest() == kernel_spec_digest(specs["inf"])
    assert names["contract.yaml"] == hashlib.sha256(contract.read_bytes()).hexdigest()
    data = contract.parent / "data.npz"
    assert names["slice:all"] == hashlib.sha256(data.read_bytes()).hexdigest()
    (sl,) = [s for s in stmt["subject"] if s["name"] == "slice:all"]
    assert sl["annotations"] == {"kcverify.role": "slice", "kcverify.digest": "file-sha256",
                                 "kcverify.path": "data.npz"}
    pred = stmt["predicate"]
    assert pred["format"] == "kcverify-certificate" and pred["format_version"] == 2
    assert {"torch", "onnx", "numpy", "z3-solver"} <= set(pred["libraries"])
    assert pred["contract"] == {"name": "fake-contract", "version": "1.0.0"}


def test_float_and_array_encodings_are_exact() -> None:
    for v in (0.1, -0.0, 1e-310, math.inf, 2.0**-1074, 1 / 3):
        assert unfx(fx(v)) == v and math.copysign(1, unfx(fx(v))) == math.copysign(1, v)
    with pytest.raises(CertificateError, match="NaN"):
        fx(math.nan)
    a = np.random.default_rng(0).normal(size=(3, 4, 2))
    enc = encode_array(a)
    assert enc["dtype"] == "float64" and enc["shape"] == [3, 4, 2]
    assert np.array_equal(decode_array(enc), a)
    bad = dict(enc, b64=enc["b64"][:-4] + "AAA=")
    with pytest.raises(CertificateError, match="sha256"):
        decode_array(bad)
    with pytest.raises(CertificateError, match="shape"):
        decode_array(dict(enc, shape=[3, 4]))


def test_outward_rounding() -> None:
    from fractions import Fraction

    third = Fraction(1, 3)
    assert Fraction(up(third)) >= third and Fraction(down(third)) <= third
    assert math.nextafter(down(third), math.inf) == up(third)
    assert up(Fraction(1, 2)) == 0.5 == down(Fraction(1, 2))


def _mutations() -> list[tuple[str, Any, str]]:
    def drop(path: list[Any]) -> Any:
        def f(s: dict[str, Any]) -> None:
            obj = s
            for k in path[:-1]:
                obj = obj[k]
            del obj[path[-1]]
        return f

    def setv(path: list[Any], v: Any) -> Any:
        def f(s: dict[str, Any]) -> None:
            obj = s
            for k in path[:-1]:
                obj = obj[k]
            obj[path[-1]] = v
        return f

    return [
        ("type", setv(["_type"], "x"), "_type"),
        ("predtype", setv(["predicateType"], "x"), "predicateType"),
        ("no subject", drop(["subject"]), "missing 'subject'"),
        ("digest", setv(["subject", 0, "digest", "sha256"], "abc"), r"subject\[0\].digest.sha256"),
        ("format_version", setv(["predicate", "format_version"], 1),
         "format_version 1 is not supported .* did not bind the slice data"),
        ("role", setv(["subject", 0, "annotations", "kcverify.role"], "weights"),
         "kcverify.role must be one of"),
        ("slice path", drop(["subject", 2, "annotations", "kcverify.path"]),
         r"a slice subject needs its path \(kcverify.path\)"),
        ("verdict", setv(["predicate", "clauses", 0, "verdict"], "maybe"), "verdict: 'maybe'"),
        ("bound", setv(["predicate", "clauses", 0, "bound"], "zero"), "not a float.hex"),
        ("hard", drop(["predicate", "clauses", 0, "hard"]), "missing 'hard'"),
        ("node", drop(["predicate", "clauses", 0, "proof", "premises"]), "missing 'premises'"),
        ("array", setv(["predicate", "blocks", "0:b0", "in_state", "x", "drift_lo", "dtype"],
                       "float32"), "dtype must be 'float64'"),
        ("box", drop(["predicate", "blocks", "0:b0", "out_state", "h", "inf_hi"]), "lacks inf_hi"),
    ]


@pytest.mark.parametrize(("label", "mutate", "message"), _mutations(), ids=[m[0] for m in _mutations()])
def test_malformed_certificates_are_named(example: Any, label: str, mutate: Any, message: str) -> None:
    stmt = copy.deepcopy(example[3])
    mutate(stmt)
    with pytest.raises(CertificateError, match=message):
        validate_statement(stmt)


def test_read_rejects_non_json(tmp_path: Path) -> None:
    p = tmp_path / "c.json"
    p.write_text("{not json")
    with pytest.raises(CertificateError, match="not JSON"):
        read_certificate(p)
