"""Session 6: the shipped token-model contracts' kernels (rl-stability: bf16 training and fp8
per-token bf16 inference with exp at 4 ulps; minimal: fp8 per-tensor activations, bf16 compute;
w8-decoder: weight-only fp8) proved by ``kcverify prove`` on the tiny decoder at one short
input, against conforming programs written independently (programs.py): the logits' output box
(train, inf, drift per element) and the per-input linf bound of the certificate; the
logprob / ratio / KL clauses' slice bounds against the same programs' values. Minutes per
certification under load: campaigns.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from kcverify.api import load_contract
from tests.soundness.adversarial.harness import SESSION
from tests.soundness.adversarial.interp import ProgramRunner
from tests.soundness.adversarial.programs import Program
from tests.soundness.adversarial.test_s6_util import (
    clauses,
    containment,
    leaf_bounds,
    output_box,
    prove_cert,
)

ROOT = Path(__file__).resolve().parents[3]
DEC = ROOT / "models" / "tiny_decoder.onnx"

KERNELS = {
    "rl-stability": ("{compute: bf16, accumulate: fp32}",
                     "{weights: {format: fp8_e4m3, scale: per_channel}, activations: {format: "
                     "fp8_e4m3, scale: dynamic_per_token}, accumulate: fp32, compute: bf16, "
                     "ulps: {exp: 4}}"),
    "minimal": ("{compute: fp32, accumulate: fp32}",
                "{weights: {format: fp8_e4m3, scale: per_channel}, activations: {format: "
                "fp8_e4m3, scale: dynamic_per_tensor}, accumulate: fp32, compute: bf16}"),
    "w8-decoder": ("{compute: fp32, accumulate: fp32}",
                   "{weights: {format: fp8_e4m3, scale: per_channel}, accumulate: fp32, "
                   "compute: fp32}"),
}


def contract(name: str, data: Path) -> str:
    train, inf = KERNELS[name]
    return f"""contract: s6-{name}
version: 1.0.0
temperature: 1.0
kernels:
  train: {train}
  inf: {inf}
slices:
  one: {{inputs: {data}}}
clauses:
  - id: N-LINF
    family: numerical
    assert: "forall x in one: linf(logits_inf(x) - logits_train(x)) <= 1000.0"
    level: L2
    action: guard
  - id: N-LP
    family: numerical
    assert: "forall x in one: forall t: abs(logprob_inf(x, t) - logprob_train(x, t)) <= 1000.0"
    level: L2
    action: guard
  - id: N-RATIO
    family: numerical
    assert: "forall x in one: forall t: abs(ratio(x, t) - 1) <= 1000.0"
    level: L2
    action: guard
escalation: {{L1: log, L2: guard, L3: fallback}}
"""


def _logprobs(z: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """log softmax(z[t])[ids[t + 1]] in float64, per position t < T - 1."""
    z = z[0, :-1].astype(np.float64)
    m = z.max(-1, keepdims=True)
    ls = z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))
    return ls[np.arange(z.shape[0]), ids[0, 1:]]


def programs(sp, seed: int) -> list[Program]:
    rows = [("desc", "greedy_up", "up", "up", "fp32", "two", "two_pass", "two_pass"),
            ("posneg", "greedy_down", "down", "down", "exact", "one", "recip", "two_pass_acc"),
            ("random", "random", "random", "random", "mixed", "two", "fused", "fused"),
            ("greedy_up", "greedy_down", "nearest", "nearest", "exact", "exact", "recip",
             "two_pass")]
    return [Program(sp, order=o, row_order=ro, rounding=r, cast_rounding=c, quotient=q,
                    rescale=rs, sm_form=sm, ln_form=ln, seed=seed + k,
                    label=f"{sp.name}/{o}/{ro}/{r}/{q}/{sm}/{ln}")
            for k, (o, ro, r, c, q, rs, sm, ln) in enumerate(rows)]


@pytest.mark.campaign
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_token_contract(tmp_path: Path, name: str) -> None:
    ids = np.load(ROOT / "examples" / "data" / "probe.npz")["input_ids"][:1]
    data = tmp_path / "one.npz"
    np.savez(data, input_ids=ids)
    st = prove_cert(tmp_path, contract(name, data), DEC)
    cl = clauses(st)
    c = load_contract(st["s6:contract"])
    run = ProgramRunner(onnx.load(str(DEC)))
    feeds = {"input_ids": ids}
    with np.errstate(all="ignore"):
        zt = [run(p, feeds)["logits"] for p in programs(c.kernels["train"], 0)]
        zi = [run(p, feeds)["logits"] for p in programs(c.kernels["inf"], 100)]
    cls = f"s6/token-contract/{name}"
    verdicts = {k: (v["verdict"], v.get("bound")) for k, v in cl.items()}
    print(cls, verdicts)
    found, worst, n = [], 0.0, 0
    per = leaf_bounds(st, "N-LINF")
    box = output_box(st, "one", "logits")
    for j, a in enumerate(zt):
        for k, b in enumerate(zi):
            n += 1
            if cl["N-LINF"]["verdict"] == "proved":
                bad, r = containment(box, per, a, b, f"{cls} train#{j} inf#{k}")
                found += bad
                worst = max(worst, r)
            dlp = _logprobs(b, ids) - _logprobs(a, ids)  # log q - log p
            for cid, obs in (("N-LP", np.abs(dlp).max()),
                             ("N-RATIO", np.abs(np.expm1(dlp)).max())):
                if cl[cid]["verdict"] == "proved":
                    bound = float.fromhex(cl[cid]["bound"])
                    if obs > bound:
                        found.append(f"{cls} {cid} train#{j} inf#{k}: {obs!r} > {bound!r}")
    s = SESSION[cls]
    s.pairs += n
    s.worst_drift = max(s.worst_drift, worst)
    s.violations.extend(found)
    print(cls, n, "pairs, worst linf obs/cert", worst, "violations", len(found))
    assert not found, "\n".join(found[:3])
