"""The shipped token models under the shipped FP8 deployment contract
(examples/contracts/fp8-deploy.yaml: e4m3 per-channel weights, e4m3 dynamic per-tensor
activations, two-pass LayerNorm moments), domain ``best``, at the contract's own eval inputs
(examples/data/eval.npz): where session 4's new enclosures (casts on branches, the normalised
cast, x @ W with fresh symbols after the product) carry the bound. Programs: the crossed
extremes of attacks.pairs and cast-splitting programs (quotient exact / fp32 / per element,
rescale in one or two roundings, greedy orders) against training programs in several orders.
Each certification is minutes under load (the decoder's 137 s wall on eval input 0, session 5):
campaigns only. Measured (session 5, 2-core sandbox, load 4, the zonotope just before dc10a6f):
tiny_decoder, inputs 0 and 3, 8 pairs each, inside; the best bound there was vacuous (89,868
against the programs' 0.242 on input 0; docs/bounds.md has the figure after dc10a6f), so these
runs check containment, not sharpness.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kcverify.api import load_contract
from tests.soundness.adversarial.attacks import pairs
from tests.soundness.adversarial.harness import SESSION, TRAIN, Ledger, attack, ratio_text
from tests.soundness.adversarial.programs import Program
from tests.soundness.adversarial.subjects import shipped

ROOT = Path(__file__).resolve().parents[3]


def deploy_spec():
    return load_contract(ROOT / "examples" / "contracts" / "fp8-deploy.yaml").kernels["inf"]


def deploy_pairs(sp, seed: int = 0) -> list[tuple[Program, Program]]:
    rows = [("mixed", "one", "greedy_up"), ("fp32", "two", "greedy_down"),
            ("exact", "exact", "posneg"), ("mixed", "two", "random")]
    pt = [Program(TRAIN, order=o, row_order=ro, seed=seed + k, label=f"train/{o}/{ro}")
          for k, (o, ro) in enumerate((("seq", "seq"), ("greedy_down", "greedy_up"),
                                       ("greedy_up", "greedy_down"), ("random", "random")))]
    own = [(pt[k], Program(sp, quotient=q, rescale=r, order=o, row_order=o, seed=seed + 10 + k,
                           label=f"inf/q-{q}/rescale-{r}/{o}"))
           for k, (q, r, o) in enumerate(rows)]
    return pairs(TRAIN, sp, 4, seed) + own


@pytest.mark.campaign
@pytest.mark.parametrize("index", [0, 3])
@pytest.mark.parametrize("name", ["tiny_decoder", "tiny_encoder"])
def test_fp8_deploy_eval_inputs(name: str, index: int) -> None:
    sp = deploy_spec()
    ids = np.load(ROOT / "examples" / "data" / "eval.npz")["input_ids"][index:index + 1]
    led = Ledger()
    cls = f"fp8-deploy/{name}"
    found = attack(led, cls, shipped(name), TRAIN, sp, {"input_ids": ids}, deploy_pairs(sp),
                   domain="best")
    SESSION.merge(led)
    print(cls, index, ratio_text(led[cls]))
    assert not found, "\n".join(found[:3])
