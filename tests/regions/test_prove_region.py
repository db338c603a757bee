"""`kcverify prove` with a ``{vnnlib: FILE}`` slice: NeuroDiff's clause proved by input splitting
on an ACAS Xu network, its split-cover certificate re-checked by `kcverify check`, and tampered
certificates (a claim, the partition, the region) rejected."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from kcverify.certs.encoding import unfx_list
from kcverify.cli import main
from kcverify.dsl import load_contract
from kcverify.empirical.slices import load_slice
from kcverify.errors import ContractError
from kcverify.regions.chain import chain_method
from kcverify.regions.plan import ALPHA_ITERS

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = ROOT / "examples" / "contracts" / "acasxu-fp16.yaml"


@pytest.fixture(scope="module")
def proved(acas: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    d = tmp_path_factory.mktemp("acas")
    model = d / "net.onnx"
    shutil.copy(acas / "ACASXU_run2a_1_1_batch_2000.onnx", model)
    model.chmod(0o644)
    report = d / "report.json"
    assert main(["prove", str(CONTRACT), str(model), "--report", str(report)]) == 0
    cert = next(d.glob("net.onnx*.kcert.json"))
    return model, cert, json.loads(report.read_text())


def _split_node(stmt: dict) -> dict:
    node = stmt["predicate"]["clauses"][0]["proof"]
    while node["rule"] != "split-cover":
        node = node["premises"][0]
    return node


def test_proved_and_checks(proved: tuple[Path, Path, dict]) -> None:
    model, cert, report = proved
    (clause,) = report["clauses"]
    assert clause["verdict"] == "proved" and clause["bound"] <= 0.05
    node = _split_node(json.loads(cert.read_text()))
    params = node["params"]
    assert params["method"] == chain_method(ALPHA_ITERS) and params["tree"].count(-1) == len(params["claims"]) > 1
    assert max(unfx_list(params["claims"])) == clause["bound"]
    # parts far above eps were quartered: cuts of nodes the split did not bound (-2 - d),
    # which the checker's replay passes through
    assert any(d <= -2 for d in params["tree"])
    assert main(["check", str(cert), str(model), str(CONTRACT)]) == 0


def _tampered(proved: tuple[Path, Path, dict], tmp_path: Path, edit) -> int:  # noqa: ANN001
    model, cert, _ = proved
    stmt = json.loads(cert.read_text())
    edit(_split_node(stmt)["params"])
    bad = tmp_path / "bad.kcert.json"
    bad.write_text(json.dumps(stmt))
    return main(["check", str(bad), str(model), str(CONTRACT)])


def test_tampered_claim_rejected(proved: tuple[Path, Path, dict], tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    def edit(p: dict) -> None:
        claims = unfx_list(p["claims"])
        k = int(np.argmax(claims))
        p["claims"][k] = float(claims[k] / 4).hex()
    assert _tampered(proved, tmp_path, edit) == 1
    assert "exceeds the claim" in capsys.readouterr().out


def test_partition_must_cover(proved: tuple[Path, Path, dict], tmp_path: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    def drop_leaf(p: dict) -> None:  # the tree no longer describes a partition
        p["tree"] = p["tree"][:-1]
        p["claims"] = p["claims"][:-1]
    assert _tampered(proved, tmp_path, drop_leaf) == 1
    assert "tree ends before every part is a leaf" in capsys.readouterr().out

    def shrink(p: dict) -> None:  # a smaller region than the slice's box
        hi = unfx_list(p["region"]["hi"])
        hi[1] = hi[1] - 0.25
        p["region"]["hi"] = [float(v).hex() for v in hi]
    assert _tampered(proved, tmp_path, shrink) == 1
    assert "does not contain the inputs of slice 'p1'" in capsys.readouterr().out


def test_method_is_the_one_replayed(proved: tuple[Path, Path, dict], tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The checker re-bounds with the recorded method: the optimised slopes' claims do not
    hold for CROWN's 0 / 1 slopes, and a method it does not know is rejected."""
    def crown(p: dict) -> None:
        p["method"] = "chain"
    assert _tampered(proved, tmp_path, crown) == 1
    assert "exceeds the claim" in capsys.readouterr().out

    def unknown(p: dict) -> None:
        p["method"] = "chain:alpha7"
    assert _tampered(proved, tmp_path, unknown) == 1
    assert "unknown method 'chain:alpha7'" in capsys.readouterr().out


def test_vnnlib_slice_data(acas: Path) -> None:
    c = load_contract(CONTRACT)
    data = load_slice(c.slices["p1"], base_dir=CONTRACT.parent)
    assert data.n == 64 and data.flat
    x = data.feeds(["input"], {"input": (1, 1, 1, 5)})["input"]
    assert x.shape == (64, 1, 1, 5)
    lo, hi = x.reshape(64, 5).min(0), x.reshape(64, 5).max(0)
    assert np.allclose(lo, [0.6, -0.5, -0.5, 0.45, -0.5]) and np.allclose(hi[0], 0.679857769)


def test_vnnlib_slice_rejects_other_keys(tmp_path: Path) -> None:
    text = CONTRACT.read_text().replace("p1: {vnnlib: ../data/acasxu/prop_1.vnnlib}",
                                        "p1: {vnnlib: prop_1.vnnlib, where: 'len > 0'}")
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    with pytest.raises(ContractError, match="a vnnlib slice is the property's input box; 'where'"):
        load_contract(bad)
    bad.write_text(CONTRACT.read_text().replace("../data/acasxu/prop_1.vnnlib", "p.npz"))
    with pytest.raises(ContractError, match=r"vnnlib must name a \.vnnlib"):
        load_contract(bad)


def test_budget_end_reports_fraction_and_bound(acas: Path, tmp_path: Path) -> None:
    """Out of splitting time: not proved; the note gives the proved share of the box volume and
    the best certified bound (finite, above eps: the part still open inherits its parent's)."""
    from kcverify.planner.prove import ProveOptions, prove

    model = tmp_path / "net.onnx"
    shutil.copy(acas / "ACASXU_run2a_4_5_batch_2000.onnx", model)
    model.chmod(0o644)
    tight = ROOT / "examples" / "contracts" / "acasxu-fp16-tight.yaml"
    res = prove(tight, model, ProveOptions(region_timeout=0.5, realizations=1,
                                           write_certificate=False))
    (c,) = res.report.clauses
    assert c.verdict != "proved"
    m = re.search(r"split: (\d+\.\d\d)% of the box volume proved in .*; best bound ([0-9.e+-]+)",
                  c.note)
    assert m, c.note
    assert 0.0 <= float(m.group(1)) < 100.0 and 0.01 < float(m.group(2)) < math.inf


@pytest.mark.parametrize("text,where", [
    ("(declare-const X_0 Real)\n(declare-const Y_0 Real)\n(assert (<= X_7 1))\n",
     "3:13: error: undeclared variable 'X_7'"),
    ("(declare-const X_0 Real)\n(declare-const Y_0 Real)\n(assert (<= X_0 1)))\n",
     "3:20: error: unbalanced parentheses"),
    ("(declare-const X_0 Real)\n(declare-const Y_0 Real)\n(assert (<= X_0 0))\n"
     "(assert (>= X_0 1))\n(assert (<= Y_0 0))\n", "4:9: error: empty input box"),
])
def test_malformed_slice_property(acas: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                  text: str, where: str) -> None:
    """A malformed property behind a {vnnlib:} slice: one located error line, exit 2, nothing
    written."""
    (tmp_path / "bad.vnnlib").write_text(text)
    contract = tmp_path / "c.yaml"
    contract.write_text(CONTRACT.read_text().replace("../data/acasxu/prop_1.vnnlib", "bad.vnnlib"))
    model = tmp_path / "net.onnx"
    shutil.copy(acas / "ACASXU_run2a_1_1_batch_2000.onnx", model)
    model.chmod(0o644)
    assert main(["prove", str(contract), str(model), "--quiet"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith(f"{tmp_path / 'bad.vnnlib'}:{where}"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.vnnlib", "c.yaml", "net.onnx"]
