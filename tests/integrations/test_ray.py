"""Distributed certification on a local Ray (loopback, num_cpus=2): `prove --workers 2` and
`bound --workers 2` give the serial run's verdicts, bounds and certificate, byte for byte."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kcverify
from kcverify.cli import main

ROOT = Path(__file__).resolve().parents[2]
MLP = ROOT / "models" / "mlp_tiny.onnx"

# two slices (points; a box around one point): two independent bound runs
TWO_SLICES = f"""\
contract: mlp-two-slices
version: 1.0.0
model: {{onnx: {MLP}, sha256: auto}}
kernels:
  train: {{compute: fp32, accumulate: fp32}}
  inf:
    weights: {{format: fp8_e4m3, scale: per_channel}}
    activations: {{format: fp8_e4m3, scale: dynamic_per_tensor}}
    accumulate: fp32
    compute: fp32
slices:
  points: {{inputs: {ROOT / "examples/data/mlp_points.npz"}}}
  box: {{inputs: {ROOT / "examples/data/mlp_box.npz"}, region: {{space: input, norm: linf, eps: 0.01}}}}
clauses:
  - {{id: N-1, family: numerical, level: L2, action: guard,
     assert: "forall x in points: linf(logits_inf(x) - logits_train(x)) <= 0.25"}}
  - {{id: N-2, family: numerical, level: L2, action: guard,
     assert: "forall x in box: linf(logits_inf(x) - logits_train(x)) <= 0.5"}}
  - {{id: N-3, family: numerical, level: L3, action: fallback,
     assert: "forall x in points: top1_agree(x)"}}
escalation: {{L1: log, L2: guard, L3: fallback}}
"""


@pytest.fixture(scope="module")
def ray_local() -> Any:
    """One local Ray for the module: 2 CPUs, loopback only; the executors use it as it is."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before ray is imported
    ray = pytest.importorskip("ray")
    import logging

    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 logging_level=logging.ERROR)
    yield ray
    ray.shutdown()


@pytest.fixture
def work(tmp_path: Path) -> dict[str, Path]:
    shutil.copy(MLP, tmp_path / MLP.name)
    (tmp_path / "two.yaml").write_text(TWO_SLICES)
    return {"model": tmp_path / MLP.name, "contract": tmp_path / "two.yaml", "dir": tmp_path}


def _clauses(result: Any) -> list[tuple[str, str, Any]]:
    return [(c.id, str(c.verdict), c.bound) for c in result.report.clauses]


def test_local_ray_is_on_loopback(ray_local: Any) -> None:
    assert ray_local.nodes()[0]["NodeManagerAddress"] == "127.0.0.1"
    assert ray_local.cluster_resources()["CPU"] == 2


def test_prove_workers_gives_the_serial_certificate(ray_local: Any, work: dict[str, Path]) -> None:
    serial = kcverify.prove(work["contract"], work["model"], cert=work["dir"] / "serial.json")
    fanned = kcverify.prove(work["contract"], work["model"], cert=work["dir"] / "ray.json",
                            workers=2)
    assert _clauses(serial) == _clauses(fanned)
    assert [v for _, v, _ in _clauses(fanned)] == ["proved"] * 3
    assert (work["dir"] / "serial.json").read_bytes() == (work["dir"] / "ray.json").read_bytes()
    assert kcverify.check(work["dir"] / "ray.json", work["model"], work["contract"]).ok


def test_prove_cli_workers_same_verdicts_and_bounds(ray_local: Any, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The README's MLP example: `kcverify prove ... --workers 2` against the serial run."""
    shutil.copy(MLP, tmp_path / MLP.name)
    contract = str(ROOT / "examples" / "contracts" / "mlp-fp8.yaml")
    model = str(tmp_path / MLP.name)
    reports = []
    for extra in ([], ["--workers", "2"]):
        assert main(["prove", contract, model, "--json", "--quiet", *extra]) == 0
        body = json.loads(capsys.readouterr().out)
        reports.append([(c["id"], c["verdict"], c["bound"]) for c in body["clauses"]])
    assert reports[0] == reports[1]
    assert [v for _, v, _ in reports[0]] == ["proved", "proved", "passed"]


def test_bound_workers_same_bounds_in_input_order(ray_local: Any, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """--domain linear bounds one input per task; the bounds come back in input order."""
    x = np.load(ROOT / "examples" / "data" / "mlp_points.npz")["x"][:6]
    np.save(tmp_path / "six.npy", x)
    outs = []
    for extra in ([], ["--workers", "2"]):
        assert main(["bound", str(MLP), str(ROOT / "examples" / "contracts" / "mlp-fp8.yaml"),
                     "--inputs", str(tmp_path / "six.npy"), "--domain", "linear", "--json",
                     *extra]) == 0
        body = json.loads(capsys.readouterr().out)
        body.pop("seconds")
        outs.append(body)
    assert outs[0] == outs[1]
    assert [b["index"] for b in outs[1]["bounds"]] == list(range(6))
    assert len({b["linf"] for b in outs[1]["bounds"]}) > 1  # distinct inputs, distinct bounds


def test_worker_errors_are_bad_input(ray_local: Any, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A bad input found inside a task is reported as the serial run reports it (exit 2, one
    line); --workers 0 and a CUDA device on a cluster without GPUs are bad input too."""
    np.save(tmp_path / "bad.npy", np.zeros((3, 5), dtype=np.float32))  # the MLP takes 4 features
    contract = str(ROOT / "examples" / "contracts" / "mlp-fp8.yaml")
    cmd = ["bound", str(MLP), contract, "--inputs", str(tmp_path / "bad.npy"), "--domain", "linear"]
    assert main(cmd) == 2
    serial = capsys.readouterr().err.strip().splitlines()
    assert main([*cmd, "--workers", "2"]) == 2
    fanned = capsys.readouterr().err.strip().splitlines()
    assert len(fanned) == 1 and fanned[-1] == serial[-1] and fanned[0].startswith("error: ")
    assert main([*cmd[:-2], "--workers", "0"]) == 2
    assert "--workers 0" in capsys.readouterr().err
    from kcverify.distributed import RayExecutor

    ex = RayExecutor(device="cuda")
    with pytest.raises(kcverify.KcverifyError, match="no GPU"):
        ex.map_drift(None, MLP, None, None, [{}])
