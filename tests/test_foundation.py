"""The foundation: format constants (semantics §1.1) against ml_dtypes, the IR round trip."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kcverify.cli import main
from kcverify.errors import KernelSpecError
from kcverify.kernels.formats import FORMATS, gamma, get_format
from kcverify.kernels.spec import parse_kernel_spec


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2", "bf16", "fp16", "fp32"])
def test_format_constants_match_ml_dtypes(name: str) -> None:
    f = FORMATS[name]
    info = ml_dtypes.finfo(np.dtype(getattr(ml_dtypes, f.ml_dtype, None) or f.ml_dtype))
    assert f.max_finite == float(info.max)
    assert f.min_normal == float(info.smallest_normal)
    assert f.eta == float(info.smallest_subnormal) / 2
    assert f.u == float(info.eps) / 2  # eps = 2u for round to nearest


def test_gamma() -> None:
    assert gamma(4, 2.0**-24) == pytest.approx(4 * 2.0**-24, rel=1e-6)
    assert gamma(2**24, 2.0**-24) == float("inf")


def test_unknown_format_lists_known() -> None:
    with pytest.raises(KernelSpecError, match="expected one of fp8_e4m3"):
        get_format("fp9")


def test_kernel_spec_canonical_is_order_free() -> None:
    a = parse_kernel_spec("k", {"compute": "bf16", "weights": {"format": "int8", "scale": "per_channel"}})
    b = parse_kernel_spec("k", {"weights": {"scale": "per_channel", "format": "int8"}, "compute": "bf16"})
    assert a.canonical() == b.canonical()


def test_cli_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert "kcverify" in capsys.readouterr().out


def test_static_scale_is_the_float32_every_kernel_stores() -> None:
    """One scale for realizations, QDQ graphs and the bound engine: fl32 of what is written."""
    spec = parse_kernel_spec("k", {"activations": {"format": "fp8_e4m3", "scale": "static",
                                                   "value": 0.1}})
    assert spec.activations.value == float(np.float32(0.1)) != 0.1
    with pytest.raises(KernelSpecError, match="positive float32"):
        parse_kernel_spec("k", {"activations": {"format": "fp8_e4m3", "scale": "static",
                                                "value": 1e39}})
