"""Every registered bound rule, checked by sampling: inputs in the set (a point, an L-inf box and
an L2 ball around it) and conforming programs of both kernels (adversarial up/down roundings,
random orders and chunkings); every observed train value, inference value and drift must lie in
the certified sets. The fast run draws ~1,500 (input, realization) pairs; ``-m slow`` ~6,000."""

from __future__ import annotations

import numpy as np
import pytest

from kcverify.bounds import Region, certify_drift
from kcverify.bounds.engine import load_rules
from kcverify.bounds.registry import RULES
from tests.soundness._helpers import (
    SPECS,
    TRAIN,
    Stats,
    check_contains,
    realizations,
    run,
    sample_box,
)
from tests.soundness.cases import CASES
from tests.soundness.test_qdq import COVERED_OPS as QDQ_OPS

FAST_SPECS = ["fp8_bf16", "e5m2_any"]


def test_every_registered_rule_has_a_case() -> None:
    load_rules()
    ops = {op for (op, _d) in RULES}
    covered = {c.op for c in CASES} | QDQ_OPS
    assert ops - covered == set(), f"rules without a soundness case: {sorted(ops - covered)}"


def _check_case(case, spec_name: str, n_inputs: int, n_real: int, seed: int,
                domain: str = "best") -> Stats:
    if spec_name in case.skip_specs:
        pytest.skip(f"{case.id}: kernel {spec_name} is not defined for this op")
    stats = Stats()
    g = case.graph()
    spec = SPECS[spec_name]
    rng = np.random.default_rng(seed)
    feeds = case.point(rng, 2)
    reals_t = realizations(TRAIN, n_real, seed)
    reals_i = realizations(spec, n_real, seed + 100)
    for region in (None, Region("input", "linf", 0.05 * case.scale), Region("input", "l2", 0.05 * case.scale)):
        res = certify_drift(g, TRAIN, spec, feeds, region=region, domain=domain)
        if region is None:
            points = [feeds]
        else:
            per = [sample_box(rng, v, region.eps, n_inputs, region.norm) for v in feeds.values()]
            points = [dict(zip(feeds, vals)) for vals in zip(*per)]
        for pt in points:
            for rt, ri in zip(reals_t, reals_i):
                yt, yi = run(g, rt, pt), run(g, ri, pt)
                for name, box in res.outputs.items():
                    check_contains(stats, box, yt[name].numpy(), yi[name].numpy(),
                                   f"{case.id}/{spec_name}/{region}/{ri}")
    return stats


@pytest.mark.parametrize("spec_name", FAST_SPECS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_rule_sound_fast(case, spec_name: str) -> None:
    stats = _check_case(case, spec_name, n_inputs=2, n_real=4, seed=11)
    assert not stats.violations, "\n".join(stats.violations[:5])


LINEAR_CASES = [c for c in CASES if c.op in ("Gemm", "MatMul", "Add", "Sub", "Mul", "Div", "Relu",
                                             "Reshape", "Flatten", "Identity", "Cast", "Dropout")]


@pytest.mark.parametrize("spec_name", FAST_SPECS)
@pytest.mark.parametrize("case", LINEAR_CASES, ids=lambda c: c.id)
def test_linear_rule_sound_fast(case, spec_name: str) -> None:
    stats = _check_case(case, spec_name, n_inputs=2, n_real=3, seed=31, domain="linear")
    assert not stats.violations, "\n".join(stats.violations[:5])


# -m slow: the specs the fast tests leave out, with more samples; the fast specs' repeats with
# more samples are a campaign
SLOW_SPECS = [pytest.param(s, marks=pytest.mark.campaign) if s in FAST_SPECS else s
              for s in sorted(SPECS)]


@pytest.mark.slow
@pytest.mark.parametrize("spec_name", SLOW_SPECS)
@pytest.mark.parametrize("case", LINEAR_CASES, ids=lambda c: c.id)
def test_linear_rule_sound_slow(case, spec_name: str) -> None:
    stats = _check_case(case, spec_name, n_inputs=5, n_real=6, seed=37, domain="linear")
    assert not stats.violations, "\n".join(stats.violations[:5])


@pytest.mark.slow
@pytest.mark.parametrize("spec_name", SLOW_SPECS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_rule_sound_slow(case, spec_name: str) -> None:
    stats = _check_case(case, spec_name, n_inputs=5, n_real=6, seed=23)
    assert not stats.violations, "\n".join(stats.violations[:5])
