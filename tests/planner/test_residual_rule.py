"""The compositional residual rule (examples/rules/residual_lipschitz.py, docs/rules.md) through
`prove --rules` and `check --rules` on a real ONNX residual MLP (torch exporter): it beats the
chain's bound on an input region, the certificate holds no drifted certificate of the residual
block, a tampered Lipschitz constant is rejected by check, and the bound holds on sampled
conforming programs. Plus hand-computed cases of its analysis."""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kcverify.certs.rules import RULES, RuleError, unregister_rule
from kcverify.cli import main

ROOT = Path(__file__).resolve().parents[2]
RULE_FILE = ROOT / "examples" / "rules" / "residual_lipschitz.py"
EPS = 0.05

CONTRACT = f"""\
contract: res-fp8
version: 1.0.0
model: {{onnx: res.onnx, sha256: auto}}
kernels:
  train: {{compute: fp32, accumulate: fp32}}
  inf:
    weights: {{format: fp8_e4m3, scale: per_channel}}
    activations: {{format: fp8_e4m3, scale: dynamic_per_tensor}}
    accumulate: fp32
    compute: fp32
slices:
  box: {{inputs: pts.npz, region: {{space: input, norm: linf, eps: {EPS}}}}}
clauses:
  - {{id: N-1, family: numerical, level: L2, action: guard,
     assert: "forall x in box: linf(logits_inf(x) - logits_train(x)) <= 2"}}
"""


def build_model(path: Path, cancel: float = 0.9) -> None:
    """h = relu(W0 x + b0) (block 1), then the residual block y = h + W2 relu(W1 h + b1) + b2
    with W2 = -cancel * pinv(W1): on the box the branch is affine and y ~ (1 - cancel) h."""
    import torch
    from torch import nn

    class ResMLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            g = torch.Generator().manual_seed(0)
            self.inp, self.up, self.down = nn.Linear(4, 8), nn.Linear(8, 16), nn.Linear(16, 8)
            with torch.no_grad():
                self.inp.weight.copy_(torch.randn(8, 4, generator=g) * 0.5)
                self.inp.bias.copy_(torch.rand(8, generator=g) + 0.5)
                w1 = torch.randn(16, 8, generator=g) * 0.5
                self.up.weight.copy_(w1)
                self.up.bias.fill_(4.0)
                self.down.weight.copy_(-cancel * torch.linalg.pinv(w1))
                self.down.bias.zero_()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.inp(x))
            return h + self.down(torch.relu(self.up(h)))

    torch.onnx.export(ResMLP().eval(), (torch.zeros(1, 4),), str(path), input_names=["x"],
                      output_names=["logits"], dynamic_axes={"x": {0: "n"}, "logits": {0: "n"}},
                      opset_version=17, dynamo=False)


@pytest.fixture(scope="module")
def res_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("res")
    with pytest.warns(DeprecationWarning):  # the TorchScript exporter: small, fast, exact
        build_model(d / "res.onnx")
    np.savez(d / "pts.npz", x=np.random.default_rng(0).uniform(-1, 1, (8, 4)).astype(np.float32))
    return d / "res.onnx"


@pytest.fixture
def work(res_model: Path, tmp_path: Path) -> tuple[Path, Path]:
    for f in ("res.onnx", "pts.npz"):
        (tmp_path / f).write_bytes((res_model.parent / f).read_bytes())
    (tmp_path / "c.yaml").write_text(CONTRACT)
    return tmp_path / "res.onnx", tmp_path / "c.yaml"


@pytest.fixture
def rule() -> Iterator[Any]:
    yield RULE_FILE
    unregister_rule("residual-lipschitz")


def _node(stmt: dict[str, Any]) -> dict[str, Any]:
    return stmt["predicate"]["clauses"][0]["proof"]["premises"][0]["premises"][0]


def test_prove_uses_the_rule_and_check_verifies_it(
        work: tuple[Path, Path], rule: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, contract = work
    cert = model.with_name("res.kcert.json")
    assert main(["prove", str(contract), str(model), "--cert", str(cert), "--domain", "interval",
                 "--rules", str(rule)]) == 0
    err = capsys.readouterr().err
    chain, res = map(float, re.search(r"linf-from-state ([0-9.e-]+), residual-lipschitz "
                                      r"([0-9.e-]+); kept residual-lipschitz", err).groups())
    assert res < 0.8 * chain  # the chain re-runs the block on the drifted box; the rule does not
    stmt = json.loads(cert.read_text())
    node = _node(stmt)
    assert node["rule"] == "residual-lipschitz"
    assert [p["rule"] for p in node["premises"]] == ["sequential", "block"]
    assert 0.1 <= float.fromhex(node["params"]["lipschitz"]) < 0.1001  # |I - 0.9 I| = 0.1
    # the residual block is certified once, with no input drift; no drifted certificate of it
    assert sorted(stmt["predicate"]["blocks"]) == ["box/0:layer0", "box/plan0:head"]
    assert main(["check", str(cert), str(model), str(contract), "--rules", str(rule)]) == 0
    capsys.readouterr()

    # a smaller constant is outside the rule; a larger one does not justify the stored bounds
    for factor, why in ((0.5, "is below the constant"), (2.0, "tighter than justified")):
        bad = json.loads(cert.read_text())
        p = _node(bad)["params"]
        p["lipschitz"] = (float.fromhex(p["lipschitz"]) * factor).hex()
        path = model.with_name("bad.kcert.json")
        path.write_text(json.dumps(bad))
        assert main(["check", str(path), str(model), str(contract), "--rules", str(rule)]) == 1
        out = capsys.readouterr().out
        assert "(residual-lipschitz)" in out and why in out, out
    unregister_rule("residual-lipschitz")
    assert main(["check", str(cert), str(model), str(contract)]) == 1  # the rule is needed
    assert "unknown rule 'residual-lipschitz'" in capsys.readouterr().out


def test_bound_holds_on_sampled_conforming_programs(work: tuple[Path, Path], rule: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from kcverify.dsl import load_contract
    from kcverify.kernels.realize import random_realization, run_kernel
    from kcverify.models.ir import load_onnx

    model, contract = work
    cert = model.with_name("res.kcert.json")
    assert main(["prove", str(contract), str(model), "--cert", str(cert), "--domain", "interval",
                 "--rules", str(rule), "--quiet"]) == 0
    capsys.readouterr()
    bounds = np.array([float.fromhex(b) for b in _node(json.loads(cert.read_text()))
                       ["conclusion"]["bounds"]])
    c = load_contract(contract)
    g = load_onnx(model)
    pts = np.load(model.with_name("pts.npz"))["x"].astype(np.float64)
    rng = np.random.default_rng(1)
    m = 24
    offs = rng.uniform(-EPS, EPS, (len(pts), m, 4))
    offs[:, :4] = np.sign(rng.uniform(-1, 1, (len(pts), 4, 4))) * EPS  # corners
    x = (pts[:, None, :] + offs).reshape(-1, 4).astype(np.float32)
    worst = np.zeros(len(pts))
    for k in range(4):
        choices = [{a: getattr(random_realization(c.kernels[s], 7 * k + j), a)
                    for a in ("seed", "order", "chunk", "rounding")}
                   for j, s in enumerate(("train", "inf"))]
        zt = run_kernel(g, c.kernels["train"], {"x": x}, **choices[0])["logits"].numpy()
        zi = run_kernel(g, c.kernels["inf"], {"x": x}, **choices[1])["logits"].numpy()
        drift = np.abs(zi - zt).max(axis=1).reshape(len(pts), m).max(axis=1)
        worst = np.maximum(worst, drift)
    assert np.all(worst <= bounds), (worst, bounds)
    assert np.all(worst > 0)


def _rule_module() -> Any:
    spec = importlib.util.spec_from_file_location("residual_lipschitz_for_test", RULE_FILE)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def _scalar_block(w1: float, b1: float, w2: float) -> Any:
    """y = x + w2 * relu(w1 * x + b1), one feature, as a kcverify graph."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from kcverify.models.ir import from_onnx

    f = np.float32
    nodes = [helper.make_node("Gemm", ["x", "W1", "B1"], ["p"], name="up"),
             helper.make_node("Relu", ["p"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "W2"], ["g"], name="down"),
             helper.make_node("Add", ["x", "g"], ["y"], name="res")]
    inits = [numpy_helper.from_array(np.array([[w1]], f), "W1"),
             numpy_helper.from_array(np.array([b1], f), "B1"),
             numpy_helper.from_array(np.array([[w2]], f), "W2")]
    graph = helper.make_graph(nodes, "res", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                            ["N", 1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1])],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return from_onnx(model)


def test_analysis_hand_computed() -> None:
    """L = |1 + w2 w1| where the ReLU is active on the box, hull(1, 1 + w2 w1) where it may
    switch; the training error of fp32 is a few ulps of the values."""
    from kcverify.kernels.spec import parse_kernel_spec

    mod = _rule_module()
    fp32 = parse_kernel_spec("train", {"compute": "fp32", "accumulate": "fp32"})
    g = _scalar_block(2.0, 10.0, -0.75)  # active for x in [-1, 1]: y = x - 1.5 x - 7.5
    lo, hi = np.array([[-1.0], [0.25]]), np.array([[1.0], [0.5]])
    lips, eta = mod.analyse(g, "x", "y", lo, hi, fp32)
    assert np.all(lips >= 0.5) and np.all(lips <= 0.5 * (1 + 1e-12))
    # by hand, u = 2^-24, x in [-1, 1]: Gemm 2u (sum) + 2u (stored) + 12u (bias), carried by
    # |w2| = 0.75 to 12u, MatMul 9u (sum) + 9u (stored), residual Add 8u: 38u
    assert np.all(eta > 0) and eta[0, 0] <= 41 * 2**-24
    lips, _ = mod.analyse(g, "x", "y", np.array([[-8.0]]), np.array([[-6.0]]), fp32)
    assert lips[0] == pytest.approx(1.0)  # the ReLU is off: y = x
    lips, _ = mod.analyse(g, "x", "y", np.array([[-6.0]]), np.array([[1.0]]), fp32)
    assert lips[0] == pytest.approx(1.0)  # it may switch: J in [1 - 1.5, 1], |J| <= 1
    bf16 = parse_kernel_spec("train", {"compute": "bf16", "accumulate": "fp32"})
    with pytest.raises(RuleError, match="weights must be exact"):
        mod.analyse(g, "x", "y", lo, hi, bf16)
    assert "residual-lipschitz" in RULES  # loading the module registered it
    unregister_rule("residual-lipschitz")


def test_lipschitz_and_error_bounds_hold_on_samples() -> None:
    """|F(a) - F(b)| <= L |a - b| in exact arithmetic (float64 here, far below the bounds), and
    every fp32 evaluation order stays within eta of F."""
    from kcverify.kernels.spec import parse_kernel_spec

    mod = _rule_module()
    unregister_rule("residual-lipschitz")
    fp32 = parse_kernel_spec("train", {"compute": "fp32", "accumulate": "fp32"})
    w1, b1, w2 = 2.0, 0.5, -0.75
    g = _scalar_block(w1, b1, w2)
    lo, hi = np.array([[-1.0]]), np.array([[1.0]])
    (lips,), (eta,) = mod.analyse(g, "x", "y", lo, hi, fp32)
    rng = np.random.default_rng(0)
    a, b = rng.uniform(-1, 1, 10_000), rng.uniform(-1, 1, 10_000)

    def f(v: np.ndarray) -> np.ndarray:
        return v + w2 * np.maximum(w1 * v + b1, 0.0)
    assert np.all(np.abs(f(a) - f(b)) <= lips * np.abs(a - b) + 1e-15)
    v32 = a.astype(np.float32)
    p = np.maximum(np.float32(w1) * v32 + np.float32(b1), np.float32(0))
    y32 = v32 + np.float32(w2) * p
    assert np.all(np.abs(y32.astype(np.float64) - f(v32.astype(np.float64))) <= eta[0])
