"""The strict interfaces: every --json output parses with a strict JSON parser (an infinite bound
is the string "inf"), reports and certificates validate against the shipped JSON Schemas, a CUDA
device that is not there is bad input (exit 2, one line), and the Python API does what the CLI
does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kcverify
from kcverify.api import SCHEMAS, dumps, schema
from kcverify.cli import main

jsonschema = pytest.importorskip("jsonschema")

ROOT = Path(__file__).resolve().parents[1]
MLP = ROOT / "models" / "mlp_tiny.onnx"
MLP_CONTRACT = ROOT / "examples" / "contracts" / "mlp-fp8.yaml"


def strict_loads(text: str) -> Any:
    """json.loads that refuses NaN, Infinity and -Infinity (JSON has none of them)."""

    def refuse(constant: str) -> None:
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


def validate(obj: Any, name: str) -> None:
    jsonschema.Draft202012Validator(schema(name)).validate(obj)


@pytest.fixture
def mlp(tmp_path: Path) -> Path:
    """A scratch copy of the MLP (prove writes its certificate next to the model)."""
    shutil.copy(MLP, tmp_path / MLP.name)
    return tmp_path / MLP.name


def test_schemas_are_valid_json_schemas() -> None:
    for name in SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(schema(name))
    with pytest.raises(ValueError, match="no schema 'nope'"):
        schema("nope")


def test_bound_json_infinite_bound_is_strict(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """fp8 activations in the interval domain give a vacuous bound on the decoder: +inf, written
    "inf" (Python's json would write the non-standard Infinity)."""
    ids = np.load(ROOT / "examples" / "data" / "sample.npz")["input_ids"][:1]
    np.save(tmp_path / "one.npy", ids)
    code = main(["bound", str(ROOT / "models" / "tiny_decoder.onnx"),
                 str(ROOT / "examples" / "contracts" / "fp8-deploy.yaml"),
                 "--inputs", str(tmp_path / "one.npy"), "--domain", "interval", "--json"])
    assert code == 0
    out = strict_loads(capsys.readouterr().out)
    assert [b["linf"] for b in out["bounds"]] == ["inf"]
    # how close the input sits to fp8 rounding boundaries: counted, and some straddle here
    assert all(isinstance(b["unstable_casts"], int) for b in out["bounds"])
    assert out["bounds"][0]["unstable_casts"] > 0
    validate(out, "bound")


def test_bound_api_matches_cli(capsys: pytest.CaptureFixture[str]) -> None:
    points = ROOT / "examples" / "data" / "mlp_points.npz"
    res = kcverify.bound(MLP, MLP_CONTRACT, points, domain="interval")
    assert res.linf.shape == (64,) and np.all(np.isfinite(res.linf)) and np.all(res.linf > 0)
    assert main(["bound", str(MLP), str(MLP_CONTRACT), "--inputs", str(points),
                 "--domain", "interval", "--json"]) == 0
    out = strict_loads(capsys.readouterr().out)
    validate(out, "bound")
    assert [b["linf"] for b in out["bounds"]] == res.linf.tolist()


def test_prove_json_report_and_certificate_validate(mlp: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    report = mlp.parent / "report.json"
    code = main(["prove", str(MLP_CONTRACT), str(mlp), "--json", "--quiet",
                 "--report", str(report)])
    assert code == 0
    printed = strict_loads(capsys.readouterr().out)
    written = strict_loads(report.read_text())
    assert printed == written
    validate(written, "report")
    cert = strict_loads((mlp.parent / (mlp.name + ".kcert.json")).read_text())
    validate(cert["predicate"], "certificate-predicate")
    # the schemas can fail: a verdict outside the five, a proved clause without its proof
    bad = json.loads(json.dumps(written))
    bad["clauses"][0]["verdict"] = "maybe"
    with pytest.raises(jsonschema.ValidationError):
        validate(bad, "report")
    bad = json.loads(json.dumps(cert["predicate"]))
    bad["clauses"][0]["proof"] = None
    with pytest.raises(jsonschema.ValidationError):
        validate(bad, "certificate-predicate")


def test_example_certificates_validate() -> None:
    for path in sorted((ROOT / "certs").glob("*.kcert.json")):
        validate(strict_loads(path.read_text())["predicate"], "certificate-predicate")


def test_lint_and_inspect_json_are_strict(capsys: pytest.CaptureFixture[str]) -> None:
    for contract in sorted((ROOT / "examples" / "contracts").glob("*.yaml")):
        assert main(["lint", str(contract), "--json"]) == 0
        strict_loads(capsys.readouterr().out)
    assert main(["inspect", str(MLP), "--json"]) == 0
    strict_loads(capsys.readouterr().out)


def test_dumps_writes_one_convention() -> None:
    text = dumps({"a": float("inf"), "b": -np.inf, "c": np.float64("nan"), "d": np.arange(2),
                  "e": (1.5,)})
    assert strict_loads(text) == {"a": "inf", "b": "-inf", "c": None, "d": [0, 1], "e": [1.5]}


def test_prove_cuda_without_cuda_is_bad_input(mlp: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    for cmd in (["prove", str(MLP_CONTRACT), str(mlp), "--no-cert", "--quiet"],
                ["bound", str(mlp), str(MLP_CONTRACT), "--inputs",
                 str(ROOT / "examples" / "data" / "mlp_points.npz")]):
        assert main([*cmd, "--device", "cuda"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [err[0]] and err[0].startswith("error: --device cuda: no CUDA device")
    assert main(["prove", str(MLP_CONTRACT), str(mlp), "--device", "cuda:x", "--quiet"]) == 2
    assert capsys.readouterr().err.startswith("error: --device cuda:x: not a device")
    assert not (mlp.parent / (mlp.name + ".kcert.json")).exists()
    with pytest.raises(kcverify.KcverifyError, match="no CUDA device"):
        kcverify.prove(MLP_CONTRACT, mlp, device="cuda")


def test_api_prove_check_load_contract(mlp: Path) -> None:
    contract = kcverify.load_contract(MLP_CONTRACT)
    assert contract.name == "mlp-fp8" and set(contract.kernels) == {"train", "inf"}
    result = kcverify.prove(MLP_CONTRACT, mlp)
    assert result.exit_code == 0
    assert [str(c.verdict) for c in result.report.clauses] == ["proved", "proved", "passed"]
    assert result.cert_path == mlp.parent / (mlp.name + ".kcert.json")
    report = kcverify.check(result.cert_path, mlp, MLP_CONTRACT)
    assert report.ok, report.problems
    assert kcverify.check(result.statement, mlp, MLP_CONTRACT).ok
    # a changed model byte: the certificate no longer checks
    data = bytearray(mlp.read_bytes())
    data[-1] ^= 1
    mlp.write_bytes(bytes(data))
    assert not kcverify.check(result.cert_path, mlp, MLP_CONTRACT).ok


def test_api_is_documented() -> None:
    for name in ("prove", "check", "bound", "load_contract"):
        fn = getattr(kcverify, name)
        assert fn.__doc__ and len(fn.__doc__.split()) > 15, name
    assert "prove" in dir(kcverify)
    with pytest.raises(AttributeError):
        _ = kcverify.nope  # type: ignore[attr-defined]
