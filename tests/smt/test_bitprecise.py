"""Bit-precise mode: z3's floating-point theory agrees with running the sequential programs on
every input of the box, and the error model's maximum is above it (by the ratio reported)."""

from __future__ import annotations

import numpy as np
import pytest

from kcverify.kernels.spec import parse_kernel_spec
from kcverify.smt.bitprecise import bitprecise_max, enumerated_max, fp_box_model
from kcverify.smt.decide import max_drift


def _specs(fmt8: str, comp: str):
    train = parse_kernel_spec("train", {"compute": comp, "accumulate": comp})
    inf = parse_kernel_spec("inf", {"compute": comp, "accumulate": comp,
                                    "weights": {"format": fmt8}, "activations": {"format": fmt8}})
    return train, inf


def _check(fmt8: str, comp: str, sizes=(2, 2, 1), eps=2.0**-7) -> None:
    train, inf = _specs(fmt8, comp)
    g = fp_box_model(sizes, 0, comp)
    x0 = np.array([[0.5, -0.25]], np.float32)
    enum, x_enum = enumerated_max(g, train, inf, x0, eps)
    model = max_drift(g, train, inf, x0, eps=eps, timeout_s=120)
    assert model.exact and float(model.value) >= enum
    b = bitprecise_max(g, train, inf, x0, eps, upper=float(model.value) * 1.001, lower=enum,
                       timeout_s=240)
    # one unsat answer: no input of the box drifts more than the enumerated maximum
    assert b.queries == 1 and b.lower == enum and b.upper == enum


def test_bitprecise_bf16_e5m2_matches_enumeration() -> None:
    _check("fp8_e5m2", "bf16")


@pytest.mark.slow
@pytest.mark.parametrize("fmt8,comp", [("fp8_e4m3", "fp16"), ("fp8_e5m2", "fp16"), ("fp8_e4m3", "bf16")])
def test_bitprecise_other_formats_match_enumeration(fmt8: str, comp: str) -> None:
    _check(fmt8, comp)


@pytest.mark.slow
def test_bitprecise_finds_the_maximum_from_below() -> None:
    """Without a starting point the bisection climbs to the enumerated maximum (a witness)."""
    train, inf = _specs("fp8_e5m2", "fp16")
    g = fp_box_model((2, 1, 1), 1, "fp16")
    x0 = np.array([[0.5, -0.25]], np.float32)
    eps = 2.0**-8
    enum, _ = enumerated_max(g, train, inf, x0, eps)
    b = bitprecise_max(g, train, inf, x0, eps, upper=1.0, timeout_s=240, rel_tol=0.05)
    assert b.lower <= enum <= b.upper and b.x is not None
