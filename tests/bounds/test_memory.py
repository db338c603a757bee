"""The bound engine's memory budget (kcverify/bounds/memory.py): sizes, estimates, the cheaper
method with a note when a method cannot fit, an allocator failure caught into the same
fallback, and a point slice of k inputs counted as k rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kcverify.bounds import certify_drift, memory
from kcverify.bounds.engine import blocks_of, expanded
from kcverify.cli import main
from kcverify.kernels.spec import parse_kernel_spec
from kcverify.models.ir import load_onnx

ROOT = Path(__file__).resolve().parents[2]
TRAIN = parse_kernel_spec("train", {"compute": "fp32", "accumulate": "fp32"})
W8 = parse_kernel_spec("inf", {"weights": {"format": "fp8_e4m3", "scale": "per_channel"},
                               "accumulate": "fp32", "compute": "fp32"})


def test_parse_size() -> None:
    assert memory.parse_size("4G") == 4 * 2**30
    assert memory.parse_size("512MiB") == 512 * 2**20
    assert memory.parse_size("1.5gb") == int(1.5 * 2**30)
    assert memory.parse_size("1000") == 1000
    assert 0 < memory.parse_size("50%") <= memory.physical_memory()
    assert memory.default_budget() == int(memory.physical_memory() * memory.DEFAULT_FRACTION)
    for bad in ("4X", "", "-1G", "G", "0"):
        with pytest.raises(memory.MemoryBudgetError):
            memory.parse_size(bad)


def test_bad_memory_flag_is_one_error_line(capsys) -> None:  # type: ignore[no-untyped-def]
    code = main(["bound", str(ROOT / "models/mlp_tiny.onnx"),
                 str(ROOT / "examples/contracts/mlp-fp8.yaml"),
                 "--inputs", str(ROOT / "examples/data/mlp_points.npz"), "--memory", "lots"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "memory budget 'lots'" in err[0]


def _decoder_one():
    g = load_onnx(ROOT / "models/tiny_decoder.onnx")
    ids = np.load(ROOT / "examples/data/probe.npz")
    feeds = {g.inputs[0].name: ids[ids.files[0]][:1]}
    return g, feeds


def _mlp_one():
    g = load_onnx(ROOT / "models/mlp_tiny.onnx")
    pts = np.load(ROOT / "examples/data/mlp_points.npz")
    return g, {g.inputs[0].name: pts[pts.files[0]][:1]}


def test_estimates_grow_with_rows_and_rank_the_methods() -> None:
    g, feeds = _decoder_one()
    x = next(iter(feeds.values()))
    b = expanded(blocks_of(g)[1].graph, "best")
    one = memory.tensor_sizes(g, feeds)
    four = memory.tensor_sizes(g, {k: np.repeat(v, 4, 0) for k, v in feeds.items()})
    assert x.shape[0] == 1 and max(four.values()) >= 4 * max(v for k, v in one.items()
                                                          if k not in g.initializers) > 0
    iv, zo = (memory.estimate(b, one, m) for m in ("interval", "zonotope"))
    assert memory.BASE_BYTES < iv < zo
    assert memory.estimate(b, four, "zonotope") > zo


def test_a_method_that_cannot_fit_is_replaced_with_a_note() -> None:
    """best on one input adds the zonotope; a budget below its estimate (above the intervals')
    bounds those blocks with intervals: the same bounds as the interval domain, records that
    say so (the checker re-runs that method) and a note per block."""
    g, feeds = _mlp_one()
    sizes = memory.tensor_sizes(g, feeds)
    blocks = blocks_of(g)
    iv = max(memory.estimate(expanded(b.graph, "best"), sizes, "interval") for b in blocks)
    res = certify_drift(g, TRAIN, W8, feeds, domain="best", memory=iv + 1)
    ref = certify_drift(g, TRAIN, W8, feeds, domain="interval")
    replaced = [r for r in res.blocks if r.method == "interval"]
    assert replaced and len(res.notes) == len(replaced)
    assert all("needs ~" in n and "> budget" in n and n.endswith("used interval")
               for n in res.notes)
    np.testing.assert_array_equal(res.linf, ref.linf)
    roomy = certify_drift(g, TRAIN, W8, feeds, domain="best", memory=64 * 2**30)
    assert not roomy.notes and all(r.method == "best" for r in roomy.blocks)


def test_an_allocator_failure_falls_back_to_intervals(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from kcverify.bounds import zonotope

    g, feeds = _mlp_one()

    def refuse(self, *a, **k):  # type: ignore[no-untyped-def]
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: "
                           "can't allocate memory: you tried to allocate 8589934592 bytes.")
    monkeypatch.setattr(zonotope.ZonoTrack, "step", refuse)
    res = certify_drift(g, TRAIN, W8, feeds, domain="best", memory=64 * 2**30)
    assert res.notes and all("ran out of memory" in n for n in res.notes)
    assert len(res.notes) == sum(r.method == "interval" for r in res.blocks)

    def bug(self, *a, **k):  # type: ignore[no-untyped-def]
        raise RuntimeError("shape mismatch")
    monkeypatch.setattr(zonotope.ZonoTrack, "step", bug)
    with pytest.raises(RuntimeError, match="shape mismatch"):  # a bug is not a memory problem
        certify_drift(g, TRAIN, W8, feeds, domain="best", memory=64 * 2**30)


def test_a_point_slice_of_k_inputs_is_k_rows(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """best adds the zonotope on at most ZONO_BEST_ROWS inputs: a slice of three points has
    three rows (it used to count as one, and the zonotope ran on every input at once)."""
    from kcverify.bounds import zonotope

    g, feeds = _decoder_one()
    made = []
    real = zonotope.ZonoTrack.__init__

    def count(self, *a, **k):  # type: ignore[no-untyped-def]
        made.append(1)
        real(self, *a, **k)
    monkeypatch.setattr(zonotope.ZonoTrack, "__init__", count)
    monkeypatch.setattr(zonotope.ZonoTrack, "step", lambda self, n, names, ins, res, ctx: res)
    three = {k: np.repeat(v, 3, 0) for k, v in feeds.items()}
    certify_drift(g, TRAIN, W8, three, domain="best", memory=64 * 2**30)
    assert not made
    certify_drift(g, TRAIN, W8, feeds, domain="best", memory=64 * 2**30)
    assert made


def _wide_mlp():
    """x (1, 512) -> MatMul 4096 -> Relu -> MatMul 10: the zonotope's forms after the Relu
    hold thousands of symbols over 4096 elements (hundreds of MB): past 256 MB of room."""
    from onnx import helper

    from tests.soundness.adversarial.harness import chain_model, graph_of

    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((512, 4096)) / 16).astype(np.float32)
    w2 = (rng.standard_normal((4096, 10)) / 64).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["y"])]
    g = graph_of(chain_model(nodes, [("x", [1, 512]), ("w1", w1), ("w2", w2)], ["y"]))
    return g, {"x": rng.standard_normal((1, 512)).astype(np.float32)}


def test_the_budget_holds_where_the_estimate_misses(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The estimates are not upper bounds (the zonotope writes position-local symbols densely
    inside some rules: MiniLM's 12.1 GB against 2.3 GB estimated). While a method the plan let
    through runs, the address space is held to the budget (memory.enforced), so its allocations
    past it fail and the block falls back to intervals with a note - not the OOM killer. Here
    the estimate lets everything through and the budget leaves no room beyond the slack."""
    import resource

    g, feeds = _wide_mlp()
    bf16 = parse_kernel_spec("inf", {"compute": "bf16", "accumulate": "fp32"})
    before = resource.getrlimit(resource.RLIMIT_AS)
    monkeypatch.setattr(memory, "estimate", lambda *a, **k: 0)
    res = certify_drift(g, TRAIN, bf16, feeds, domain="best", cut="whole", memory=1)
    assert resource.getrlimit(resource.RLIMIT_AS) == before  # restored
    assert [r.method for r in res.blocks] == ["interval"]
    assert len(res.notes) == 1 and "ran out of memory" in res.notes[0], res.notes
    ref = certify_drift(g, TRAIN, bf16, feeds, domain="interval")
    np.testing.assert_array_equal(res.linf, ref.linf)
    g, feeds = _mlp_one()  # a roomy budget: the method runs
    roomy = certify_drift(g, TRAIN, bf16, feeds, domain="best", cut="whole", memory=64 * 2**30)
    assert not roomy.notes and [r.method for r in roomy.blocks] == ["best"]


def test_enforced_never_loosens_a_limit_already_set() -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    size, rss = memory.process_memory()
    assert size > rss > 0
    with memory.enforced(2**30) as limit:
        assert limit is not None and size < limit <= size + 2**30 + memory.GUARD_SLACK
        assert resource.getrlimit(resource.RLIMIT_AS)[0] == limit
        with memory.enforced(64 * 2**30) as inner:  # looser than the one set: kept
            assert inner is None and resource.getrlimit(resource.RLIMIT_AS)[0] == limit
    assert resource.getrlimit(resource.RLIMIT_AS) == (soft, hard)
    with memory.enforced(2**30, device="cuda") as limit:
        assert limit is None


ENCODER_CONTRACT = """contract: encoder-layer
version: 1.0.0
model: {onnx: enc.onnx}
kernels:
  train: {compute: fp32, accumulate: fp32}
  inf:
    weights: {format: fp8_e4m3, scale: per_channel}
    accumulate: fp32
    compute: fp32
slices:
  eight: {inputs: x8.npz}
  two: {inputs: x2.npz}
clauses:
  - id: N-8
    family: numerical
    assert: "forall x in eight: linf(logits_inf(x) - logits_train(x)) <= 0.5"
    level: L2
    action: guard
  - id: N-2
    family: numerical
    assert: "forall x in two: linf(logits_inf(x) - logits_train(x)) <= 0.1"
    level: L2
    action: guard
escalation: {L1: log, L2: guard, L3: fallback}
"""


@pytest.mark.slow
def test_the_newcomer_encoder_layer_under_a_real_limit(tmp_path: Path) -> None:
    """Issue 14's newcomer: nn.TransformerEncoderLayer(d_model=32, nhead=4) + Linear(32, 10),
    torch's legacy export, fp8 weights, 8 inputs of seq 8, `prove --memory 4G` in a process the
    kernel holds to 4 GiB of address space (prlimit --as). It used to reach 24 GB (the zonotope
    on all 8 rows) and die with an allocator traceback. Now: the 8-input clause is proved by
    the segments (intervals beside the symbolic forms), the 2-input one (0.1, which they miss)
    through the whole graph per input (auto), and the process exits 0 with no traceback."""
    import shutil
    import subprocess
    import sys

    import torch

    if shutil.which("prlimit") is None:
        pytest.skip("prlimit (util-linux) is not installed")
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.TransformerEncoderLayer(d_model=32, nhead=4, dropout=0.0,
                                                          batch_first=True)
            self.head = torch.nn.Linear(32, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.layer(x))

    torch.onnx.export(Net().eval(), (torch.randn(1, 8, 32),), str(tmp_path / "enc.onnx"),
                      dynamo=False, opset_version=17, input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}})
    x = np.random.default_rng(0).standard_normal((8, 8, 32)).astype(np.float32)
    np.savez(tmp_path / "x8.npz", x=x)
    np.savez(tmp_path / "x2.npz", x=x[:2])
    (tmp_path / "enc.yaml").write_text(ENCODER_CONTRACT)
    report = tmp_path / "r.json"
    run = subprocess.run(
        ["prlimit", f"--as={4 * 2**30}", sys.executable, "-m", "kcverify", "prove",
         str(tmp_path / "enc.yaml"), str(tmp_path / "enc.onnx"), "--memory", "4G", "--no-cert",
         "--report", str(report), "--realizations", "1"],
        capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr[-3000:]
    import json

    by_id = {c["id"]: c for c in json.loads(report.read_text())["clauses"]}
    assert by_id["N-8"]["verdict"] == "proved" and by_id["N-8"]["method"] == "bound-best"
    assert by_id["N-2"]["verdict"] == "proved", by_id["N-2"]
    assert by_id["N-2"]["method"] == "bound-best (whole graph)"
