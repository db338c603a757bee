"""The campaign (campaign.py): >= 10^6 (input, conforming program pair) checks, no violation.
Tens of minutes on a 2-core CPU; behind ``-m campaign`` (CI runs ``-m "not campaign"``).
``python bench/adversarial.py`` runs the same and prints the per-class table."""

from __future__ import annotations

import pytest

from tests.soundness.adversarial.campaign import by_family, led_total, run_campaign
from tests.soundness.adversarial.harness import SESSION


@pytest.mark.campaign
def test_campaign_no_violation() -> None:
    led = run_campaign(scale=1.0, seed=0)
    SESSION.merge(by_family(led, 4))
    total = led_total(led, "campaign/")
    bad = [v for st in led.classes.values() for v in st.violations]
    assert total >= 1_000_000, f"only {total} pairs"
    assert not bad, f"{len(bad)} violations; first: {bad[0]}"


@pytest.mark.campaign
def test_campaign_smoke() -> None:
    """The campaign's machinery at a small scale (every part runs, pairs are counted)."""
    led = run_campaign(scale=0.004, seed=1, parts=("mlp", "rules"))
    assert led_total(led, "campaign/mlp/") >= 2 * 7 * 3 * 16
    assert led_total(led, "campaign/rule/") > 0
    bad = [v for st in led.classes.values() for v in st.violations]
    assert not bad, bad[0]
    errors = [e for st in led.classes.values() for e in st.errors]
    assert not any("InternalError" in e for e in errors), errors[:2]


@pytest.mark.campaign
def test_fp8_models_campaign() -> None:
    """Whole models with fp8 activations (campaign.fp8_models: fp8-deploy, rounding any, sm90
    tensor cores, per-token bf16) at a quarter scale: no violation, no internal error."""
    led = run_campaign(scale=0.25, seed=2, parts=("fp8",))
    SESSION.merge(by_family(led, 4))
    assert led_total(led, "campaign/fp8/") > 0
    bad = [v for st in led.classes.values() for v in st.violations]
    assert not bad, f"{len(bad)} violations; first: {bad[0]}"
    errors = [e for st in led.classes.values() for e in st.errors]
    assert not any("InternalError" in e for e in errors), errors[:2]
