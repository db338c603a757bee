"""The chain domain models fp32 accumulation in any order (and the pinned orders inside it); a
tensor-core accumulator (sm90_fp8: 13-bit truncation per group) is outside it and is refused, so
a region proof falls back to the engine's domains, which bound it (docs/kernels.md)."""

from __future__ import annotations

from kcverify.kernels.spec import parse_kernel_spec
from kcverify.regions.chain import supported


def test_tensor_core_accumulators_are_not_chain_kernels() -> None:
    sm90 = parse_kernel_spec("inf", {"compute": "fp32", "weights": "fp8_e4m3",
                                     "activations": "fp8_e4m3",
                                     "accumulate": {"mma": "sm90_fp8", "promote": 128}})
    assert supported(sm90) is not None
    seq = parse_kernel_spec("inf", {"compute": "fp32",
                                    "accumulate": {"format": "fp32", "order": "sequential"}})
    assert supported(seq) is None
    assert supported(parse_kernel_spec("train", {"compute": "fp32", "accumulate": "fp32"})) is None
