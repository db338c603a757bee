"""The proof by cases under the ``best`` domain (what ``bound --cases`` runs on the token models):
the zonotope's branch options (binary symbols, casts on branches, the normalised cast) inside a
leaf whose decisions force some casts. Leaf by leaf as test_cases.leaf_attack checks it (each
program's own casts select exactly one leaf; the pair inside that leaf's sets; the leaf's bound
at most the certified max), with the leaves bounded by ``best``.

Inputs: test_cases' midpoint chain with the second cast's input one fp32 ulp above / below the
midpoint 272 (a forced element that is *not* a tie: every program rounds it alike, but the
enclosure straddles) and exactly on it; test_branches' nets (straddled first casts, the next
cast's input at an e4m3 midpoint +- one fp32 ulp relative to its pinned amax); test_amax_ratio's
quotients at midpoints relative to the amax.
"""

from __future__ import annotations

import pytest

from tests.soundness.adversarial.harness import spec
from tests.soundness.adversarial.programs import Program
from tests.soundness.adversarial.test_amax_ratio import SP as RATIO_SP
from tests.soundness.adversarial.test_amax_ratio import ratio_case, ratio_programs
from tests.soundness.adversarial.test_branches import (
    _train_programs,
    branch_case,
)
from tests.soundness.adversarial.test_cases import (
    _chain_model_for,
    _programs,
    leaf_attack,
)
from tests.soundness.adversarial.test_stable_casts import E4M3_PC, _acts, _chain

pytest.importorskip("kcverify.bounds.cases")


@pytest.mark.parametrize("kind", ["up", "down", "tie"])
def test_best_leaves_on_the_midpoint_chain(kind: str) -> None:
    sp = spec(weights=E4M3_PC, activations=_acts("dynamic_per_tensor"), accumulate="fp32",
              compute="fp32")
    x, w1 = _chain_model_for(kind)
    found, _ = leaf_attack(f"cases-best/chain-{kind}", _chain(w1, sp), sp, {"x": x},
                           _programs(sp), max_leaves=16, domain="best")
    assert not found, "\n".join(found[:3])


def _pairs(progs: list[Program]) -> list[tuple[Program, Program]]:
    pt = _train_programs()
    return [(pt[j % len(pt)], p) for j, p in enumerate(progs)]


@pytest.mark.parametrize(("kind", "mode"), [("mul", "tie"), ("add", "sub")])
def test_best_leaves_on_branch_nets(kind: str, mode: str) -> None:
    model, feeds, sp, progs = branch_case(kind, "dynamic_per_tensor", mode, 0)
    found, _ = leaf_attack(f"cases-best/branches-{kind}-{mode}", model, sp, feeds,
                           _pairs(progs[:8]), max_leaves=16, domain="best")
    assert not found, "\n".join(found[:3])


def test_best_leaves_on_amax_ratio() -> None:
    model, feeds = ratio_case("straddle", 0, False)
    found, _ = leaf_attack("cases-best/amax-ratio", model, RATIO_SP, feeds,
                           ratio_programs(RATIO_SP, 0), max_leaves=16, domain="best")
    assert not found, "\n".join(found[:3])


@pytest.mark.campaign
def test_best_leaves_campaign() -> None:
    found = []
    for seed in range(1, 6):
        for kind in ("mul", "sq", "relu", "add"):
            for mode in ("tie", "sub", "nopin"):
                for acts in ("dynamic_per_tensor", "dynamic_per_token"):
                    model, feeds, sp, progs = branch_case(kind, acts, mode, seed)
                    found += leaf_attack(f"cases-best/campaign/{kind}-{mode}", model, sp, feeds,
                                         _pairs(progs), max_leaves=32, domain="best")[0]
        for kind in ("certain", "close", "straddle"):
            model, feeds = ratio_case(kind, seed, seed % 2 == 1)
            found += leaf_attack("cases-best/campaign/amax-ratio", model, RATIO_SP, feeds,
                                 ratio_programs(RATIO_SP, seed), max_leaves=32,
                                 domain="best")[0]
    assert not found, "\n".join(found[:5])

