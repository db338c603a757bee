"""Session 6: ``kcverify prove`` certificates of the shipped contracts' other kernels, and of
contracts written here (bf16 compute, fp16 accumulators, int8 weights, OCP MX and NVFP4 block
scales) on the shipped MLPs, against conforming programs written independently
(programs.py / test_s6_util.QDQRunner). What prove certifies is checked where the certificate
states it: the clause's per-input linf bound (its proof's leaf) and the block certificates'
output boxes (train, inf and drift per element); the same certificate re-checked by
``kcverify check`` in a fresh process.

Inputs: the contracts' own slices and slices written here: values at the rounding midpoints of
the first cast (x / s at k + 1/2 of the int8 or e4m3 grid, exact and one fp32 ulp either side),
at saturation, at powers of two (MX's floor(log2 amax) jumps).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from kcverify.api import load_contract
from tests.soundness.adversarial.arith import next_down, next_up, rnd
from tests.soundness.adversarial.attacks import fp8_midpoints, normal, pairs, saturating
from tests.soundness.adversarial.harness import SESSION, TRAIN
from tests.soundness.adversarial.interp import ProgramRunner
from tests.soundness.adversarial.programs import Program
from tests.soundness.adversarial.test_s6_util import (
    QDQRunner,
    clauses,
    containment,
    leaf_bounds,
    output_box,
    prove_cert,
)

ROOT = Path(__file__).resolve().parents[3]
EX = ROOT / "examples"


def shipped_text(name: str) -> str:
    """A shipped contract with its relative paths made absolute (proved from a temp dir)."""
    text = (EX / "contracts" / f"{name}.yaml").read_text()
    text = text.replace("../../models/", f"{ROOT / 'models'}/")
    return text.replace("../", f"{EX}/")


def mlp_contract(name: str, inf: str, data: Path, threshold: float = 100.0) -> str:
    return f"""contract: {name}
version: 1.0.0
kernels:
  train: {{compute: fp32, accumulate: fp32}}
  inf: {inf}
slices:
  pts: {{inputs: {data}}}
clauses:
  - id: N-1
    family: numerical
    assert: "forall x in pts: linf(logits_inf(x) - logits_train(x)) <= {threshold}"
    level: L2
    action: guard
escalation: {{L1: log, L2: guard, L3: fallback}}
"""


def check_fresh(st: dict, model: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kcverify", "check", st["s6:cert"], str(model),
                           st["s6:contract"]], capture_output=True, text=True, timeout=300)


def prove_and_check(where: Path, model: onnx.ModelProto, x: np.ndarray, name: str, inf: str,
                    threshold: float, full_check: bool = True) -> tuple[np.ndarray | None, bool]:
    """``model`` and the input ``x`` through a one-clause contract (``mlp_contract``: clause
    N-1, linf <= threshold, the inference kernel ``inf``), saved and proved in ``where``: the
    clause's per-input leaf bounds (None: not proved) and whether a fresh ``kcverify check``
    accepts the certificate (False when not proved)."""
    if full_check:
        onnx.checker.check_model(model, full_check=True)
    path = where / "m.onnx"
    onnx.save(model, path)
    np.save(where / "x.npy", x)
    st = prove_cert(where, mlp_contract(name, inf, where / "x.npy", threshold=threshold), path)
    per = leaf_bounds(st, "N-1")
    return per, per is not None and check_fresh(st, path).returncode == 0


def attack_cert(st: dict, clause: str, slice_name: str, out: str, runs_t, runs_i, where: str
                ) -> tuple[list[str], float, int]:
    """Every (training run, inference run) pair against the clause's per-input bounds and the
    output box; runs are callables -> output array."""
    per = leaf_bounds(st, clause)
    box = output_box(st, slice_name, out)
    assert per is not None or box is not None, f"{where}: the certificate states no bound"
    found, worst, n = [], 0.0, 0
    ts = [f() for f in runs_t]
    for k, fi in enumerate(runs_i):
        yi = fi()
        for j, yt in enumerate(ts):
            bad, r = containment(box, per, yt, yi, f"{where} train#{j} inf#{k}")
            found += bad
            worst = max(worst, r)
            n += 1
    return found, worst, n


def _record(cls: str, n: int, worst: float, found: list[str]) -> None:
    st = SESSION[cls]
    st.pairs += n
    st.worst_drift = max(st.worst_drift, worst)
    st.violations.extend(found)
    print(f"{cls}: {n} pairs, worst obs/cert {worst:.4g}, violations {len(found)}")


# --- QDQ contracts ------------------------------------------------------------------------
def qdq_inputs(qdq: Path, n: int, seed: int) -> np.ndarray:
    """mlp_tiny inputs whose first quotient x / s_x sits at a rounding midpoint of the QDQ
    graph's input cast (int8: k + 1/2; e4m3: between grid neighbours), exact or one fp32 ulp
    either side; a quarter of the rows normal."""
    m = onnx.load(str(qdq))
    inits = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    qn = next(n for n in m.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "x")
    s = float(inits[qn.input[1]])
    zdt = inits[qn.input[2]].dtype if len(qn.input) > 2 else np.dtype("uint8")
    rng = np.random.default_rng(seed)
    if zdt.name.startswith("float8"):
        x = np.stack([fp8_midpoints((4,), "fp8_e4m3", rng, static=s) for _ in range(n)])
    else:
        k = rng.integers(-100, 100, size=(n, 4)) + 0.5
        x = rnd(k * s, "fp32")
        nudge = rng.integers(-1, 2, size=x.shape)
        x = np.where(nudge > 0, next_up(x, "fp32"), np.where(nudge < 0, next_down(x, "fp32"), x))
    x = np.asarray(x, np.float64)
    x[: n // 4] = normal((n // 4, 4), rng)
    return x.astype(np.float32)


def qdq_runs(model, qdq_model, sp_i, x: np.ndarray, n_prog: int, seed: int):
    tr = ProgramRunner(model)
    runs_t = []
    for p in pairs(TRAIN, TRAIN, n_prog, seed, per_sample="axis0"):
        runs_t.append(lambda p=p[0]: tr(p, {"x": x})["y"])
    runs_i = []
    for k, p in enumerate(pairs(sp_i, sp_i, n_prog, seed + 7, per_sample="axis0")):
        for quotient in ("exact", "fp32"):
            for dq in ("exact", "fp32"):
                if (k + len(quotient) + len(dq)) % 2 and k > 1:
                    continue  # half the (quotient, dq) corners beyond the extremes
                run = QDQRunner(qdq_model, quotient=quotient, dq=dq)
                runs_i.append(lambda p=p[1], run=run: run(p, {"x": x})["y"])
    return runs_t, runs_i


@pytest.mark.parametrize("fmt", ["int8", pytest.param("fp8", marks=pytest.mark.slow)])
def test_qdq_shipped_contract(tmp_path: Path, fmt: str) -> None:
    """examples/contracts/mlp-{fmt}-qdq.yaml as shipped: prove, attack, check fresh."""
    name = f"mlp-{fmt}-qdq"
    model_p = ROOT / "models" / "mlp_tiny.onnx"
    st = prove_cert(tmp_path, shipped_text(name), model_p, name)
    sp_i = load_contract(st["s6:contract"]).kernels["inf"]
    qdq = onnx.load(str(EX / "qdq" / f"mlp_tiny.{fmt}.qdq.onnx"))
    x = np.load(EX / "data" / "mlp_points.npz")["x"]
    runs_t, runs_i = qdq_runs(onnx.load(str(model_p)), qdq, sp_i, x, 4, 0)
    found, worst, n = attack_cert(st, "N-QDQ-1", "points", "y", runs_t, runs_i, name)
    _record(f"s6/contract/{name}", n * len(x), worst, found)
    assert not found, "\n".join(found[:3])
    chk = check_fresh(st, model_p)
    assert chk.returncode == 0, chk.stdout[-500:] + chk.stderr[-500:]


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_qdq_midpoint_slice(tmp_path: Path, fmt: str) -> None:
    """The shipped QDQ kernels on a slice at the input cast's midpoints (+-1 fp32 ulp)."""
    qdq_p = EX / "qdq" / f"mlp_tiny.{fmt}.qdq.onnx"
    x = qdq_inputs(qdq_p, 48, 3 + len(fmt))
    data = tmp_path / "mid.npz"
    np.savez(data, x=x)
    model_p = ROOT / "models" / "mlp_tiny.onnx"
    inf = f"{{onnx: {qdq_p}, compute: fp32, accumulate: fp32}}"
    st = prove_cert(tmp_path, mlp_contract(f"qdq-mid-{fmt}", inf, data), model_p)
    assert clauses(st)["N-1"]["verdict"] == "proved", clauses(st)["N-1"]["verdict"]
    sp_i = load_contract(st["s6:contract"]).kernels["inf"]
    runs_t, runs_i = qdq_runs(onnx.load(str(model_p)), onnx.load(str(qdq_p)), sp_i, x, 4, 1)
    found, worst, n = attack_cert(st, "N-1", "pts", "y", runs_t, runs_i, f"qdq-mid-{fmt}")
    _record(f"s6/contract/qdq-mid-{fmt}", n * len(x), worst, found)
    assert not found, "\n".join(found[:3])


# --- the native kernels on the MLPs -------------------------------------------------------
KERNELS = {
    "bf16_token": "{weights: {format: fp8_e4m3, scale: per_channel}, activations: {format: "
                  "fp8_e4m3, scale: dynamic_per_token}, accumulate: fp32, compute: bf16}",
    "fp16_acc": "{weights: {format: fp8_e4m3, scale: per_channel}, activations: {format: "
                "fp8_e4m3, scale: dynamic_per_tensor}, accumulate: fp16, compute: fp16}",
    "int8_w": "{weights: {format: int8, scale: per_channel}, accumulate: fp32, compute: bf16}",
    "int8_block": "{weights: {format: int8, scale: per_block, block_size: 4}, accumulate: fp32,"
                  " compute: fp32}",
    "mx_e4m3": "{weights: {format: fp8_e4m3, scale: mx}, activations: {format: fp8_e4m3, "
               "scale: mx}, accumulate: fp32, compute: fp32}",
    "mx_fp4": "{weights: {format: fp4_e2m1, scale: mx}, activations: {format: fp4_e2m1, "
              "scale: mx}, accumulate: fp32, compute: fp32}",
    "nvfp4": "{weights: {format: fp4_e2m1, scale: nv}, activations: {format: fp4_e2m1, "
             "scale: nv}, accumulate: fp32, compute: fp32}",
    "e5m2_any": "{weights: {format: fp8_e5m2, scale: per_tensor}, activations: {format: "
                "fp8_e5m2, scale: dynamic_per_tensor}, accumulate: fp32, compute: fp32, "
                "rounding: any}",
    "bf16_both": "{compute: bf16, accumulate: bf16}",
}


def mlp_inputs(kind: str, d: int, n: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "normal":
        return normal((n, d), rng)
    if kind == "midpoint":
        return np.stack([fp8_midpoints((d,), "fp8_e4m3", rng, amax=float(rng.uniform(0.5, 3)))
                         for _ in range(n)])
    if kind == "saturate":
        return saturating((n, d), rng, amax=2.0)
    if kind == "pow2":  # amaxes at and just under powers of two; elements at e2m1 midpoints
        x = rng.choice([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], size=(n, d))
        x *= rng.choice([-1.0, 1.0], size=(n, d)) * 2.0 ** rng.integers(-3, 2, size=(n, 1))
        top = 2.0 ** rng.integers(-2, 3, size=(n, 1))
        x[:, :1] = np.where(rng.random((n, 1)) < 0.5, top, rnd(top * (1 - 2.0**-22), "fp32"))
        return np.clip(x, -np.abs(x[:, :1]), np.abs(x[:, :1])).astype(np.float32)
    raise ValueError(kind)


def native_attack(tmp_path: Path, model_name: str, kern: str, kinds: tuple[str, ...],
                  n_pairs: int, seed: int) -> None:
    model_p = ROOT / "models" / f"{model_name}.onnx"
    model = onnx.load(str(model_p))
    d = 4 if model_name == "mlp_tiny" else 8
    rng = np.random.default_rng(seed)
    x = np.concatenate([mlp_inputs(k, d, 12, rng) for k in kinds]).astype(np.float32)
    data = tmp_path / "pts.npz"
    np.savez(data, x=x)
    st = prove_cert(tmp_path, mlp_contract(f"s6-{kern}", KERNELS[kern], data), model_p)
    c = clauses(st)["N-1"]
    cls = f"s6/contract/{model_name}/{kern}"
    if c["verdict"] != "proved":
        _record(cls, 0, 0.0, [])
        pytest.skip(f"{kern}: not proved ({c['verdict']}, {c.get('method')})")
    sp_i = load_contract(st["s6:contract"]).kernels["inf"]
    run = ProgramRunner(model)
    prs = pairs(TRAIN, sp_i, n_pairs, seed, per_sample="axis0")
    prs += [(prs[0][0], Program(sp_i, per_sample="axis0", quotient="fp32", rescale="two",
                                order="greedy_up", seed=seed + 5, label="q32")),
            (prs[1][0], Program(sp_i, per_sample="axis0", acc="dequant", order="greedy_down",
                                seed=seed + 6, label="dequant"))]
    pt = list({id(a): a for a, _ in prs}.values())
    pi = list({id(b): b for _, b in prs}.values())
    runs_t = [lambda p=p: run(p, {"x": x})["y"] for p in pt]
    runs_i = [lambda p=p: run(p, {"x": x})["y"] for p in pi]
    with np.errstate(all="ignore"):
        found, worst, n = attack_cert(st, "N-1", "pts", "y", runs_t, runs_i, cls)
    _record(cls, n * len(x), worst, found)
    assert not found, "\n".join(found[:3])


@pytest.mark.parametrize("kern", ["bf16_token", "fp16_acc", "int8_w", "mx_e4m3", "nvfp4"])
def test_native_kernels_fast(tmp_path: Path, kern: str) -> None:
    native_attack(tmp_path, "mlp_small", kern, ("midpoint", "pow2"), 3, len(kern))


@pytest.mark.campaign
@pytest.mark.parametrize("kern", sorted(KERNELS))
@pytest.mark.parametrize("model_name", ["mlp_tiny", "mlp_small"])
def test_native_kernels_campaign(tmp_path: Path, model_name: str, kern: str) -> None:
    native_attack(tmp_path, model_name, kern, ("normal", "midpoint", "saturate", "pow2"), 8,
                  len(kern) + len(model_name))

