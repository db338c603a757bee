"""The issue's contract keys, exactly as written, through ``kcverify lint``; what they mean
lands in the canonical spec (the certificate's digest); malformed ones are one located error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kcverify.cli import main
from kcverify.dsl import load_contract

HEAD = """contract: families
version: 1.0.0
model: {onnx: model.onnx, sha256: auto}
kernels:
"""
TAIL = """slices:
  pts: {inputs: pts.npz}
clauses:
  - id: N-1
    family: numerical
    assert: "forall x in pts: linf(logits_inf(x) - logits_train(x)) <= 0.5"
    level: L2
    action: guard
"""
KERNELS = {
    "sequential": """  train: {compute: fp32, accumulate: {format: fp32, order: sequential}}
  inf: {compute: fp32, accumulate: {format: fp32, order: pairwise}}
""",
    "any": """  train: {compute: fp32, accumulate: {format: fp32, order: any}}
  inf: {compute: bf16, accumulate: fp32}
""",
    "tile_k": """  train: {compute: fp32, accumulate: {format: fp32, order: {tile_k: 128}}}
  inf: {compute: fp32, accumulate: {format: fp32, tile_k: 64}}
""",
    "sm90": """  train: {compute: bf16, accumulate: fp32}
  inf:
    weights: {format: fp8_e4m3, scale: per_block, block_size: [128, 128]}
    activations: {format: fp8_e4m3, scale: dynamic_per_block, block_size: 128}
    accumulate: {mma: sm90_fp8, promote: 128}
    split_k: [1, 2, 4]
    compute: bf16
""",
    "sm90_inside": """  train: {compute: fp32, accumulate: fp32}
  inf:
    weights: {format: fp8_e4m3, scale: per_channel}
    activations: {format: fp8_e4m3, scale: dynamic_per_token}
    accumulate: {mma: sm90_fp8, split_k: [1, 2, 4]}
""",
    "mx_nv": """  train: {compute: fp32, accumulate: fp32}
  inf:
    weights: {format: fp4_e2m1, scale: mx, block_size: 32}
    activations: {format: fp6, scale: mx, saturate: true, ftz: true}
    accumulate: {format: fp32, order: any, split_k: [1, 2]}
""",
    "nvfp4": """  train: {compute: fp32, accumulate: fp32}
  inf:
    weights: {format: fp4_e2m1, scale: nv}
    activations: {format: fp4_e2m1, scale: nv, block_size: 16}
""",
    "fp6_e3m2": """  train: {compute: fp32, accumulate: fp32}
  inf:
    weights: {format: fp6_e3m2, scale: mx}
    activations: {format: fp8_e5m2, scale: dynamic_per_tensor, saturate: false}
""",
}


def _write(tmp_path: Path, kernels: str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(HEAD + kernels + TAIL)
    return p


@pytest.mark.parametrize("name", list(KERNELS))
def test_lint_accepts_the_family_keys(tmp_path: Path, name: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    p = _write(tmp_path, KERNELS[name])
    assert main(["lint", str(p), "--json"]) == 0, capsys.readouterr().err
    out = json.loads(capsys.readouterr().out)
    assert out


def test_families_reach_the_digest(tmp_path: Path) -> None:
    c = load_contract(_write(tmp_path, KERNELS["sm90"]))
    inf = c.kernels["inf"].canonical()
    assert inf["accumulation"] == {"order": "any", "mma": "sm90_fp8", "promote": 128,
                                   "split_k": [1, 2, 4]}
    assert inf["weights"]["block_size"] == [128, 128]
    c = load_contract(_write(tmp_path, KERNELS["any"]))
    # the shorthand and {order: any} are the same family, and today's digest (no new key)
    assert c.kernels["train"].canonical() == {**c.kernels["train"].canonical()}
    assert "accumulation" not in c.kernels["train"].canonical()
    assert "accumulation" not in c.kernels["inf"].canonical()
    c = load_contract(_write(tmp_path, KERNELS["tile_k"]))
    assert c.kernels["train"].accumulation.tile_k == 128
    assert c.kernels["inf"].accumulation.order == "tile_k"


@pytest.mark.parametrize("kernels,message", [
    ("  train: {accumulate: {format: fp32, order: random}}\n  inf: {}\n", "unknown order"),
    ("  train: {accumulate: {mma: sm90_fp8, promote: 100}}\n  inf: {}\n", "multiple of 32"),
    ("  train: {accumulate: {mma: sm90_fp8}}\n  inf: {}\n", "need an fp8 format"),
    ("  train: {accumulate: {format: fp32, promote: 128}}\n  inf: {}\n", "mma accumulator"),
    ("  train: {accumulate: fp32, split_k: [0]}\n  inf: {}\n", "split_k must be"),
    ("  train: {weights: {format: fp4_e2m1, scale: mx, saturate: false}}\n  inf: {}\n",
     "always saturate"),
    ("  train: {weights: {format: fp8_e4m3, scale: nv}}\n  inf: {}\n", "NVFP4"),
    ("  train: {weights: {format: fp4_e2m1, scale: per_block, block_size: [1, 2, 3]}}\n"
     "  inf: {}\n", "block_size must be"),
])
def test_bad_family_keys_are_one_located_error(tmp_path: Path, kernels: str, message: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    p = _write(tmp_path, kernels)
    assert main(["lint", str(p)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and message in err and err.startswith(str(p)), err


@pytest.mark.parametrize("name", list(KERNELS))
def test_normal_form_reads_back_to_the_same_kernels(tmp_path: Path, name: str) -> None:
    import yaml

    from kcverify.dsl.printer import contract_to_data

    c = load_contract(_write(tmp_path, KERNELS[name]))
    data = contract_to_data(c)
    data["model"] = {"onnx": "model.onnx", "sha256": "auto"}
    again = tmp_path / "again.yaml"
    again.write_text(yaml.safe_dump(data, sort_keys=False))
    c2 = load_contract(again)
    for k in ("train", "inf"):
        assert c2.kernels[k].canonical() == c.kernels[k].canonical()
