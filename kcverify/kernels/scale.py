"""Scales of the casts of semantics §1.1 and the exact quantization of weights and activations.

A scale is s = fl32(max(amax, floor) / max_finite) (qmax for int formats) over its group, the
float32 quotient of the float32 amax clamped to the spec's floor (CastSpec.floor, default 1e-12),
stored as a float32 number the way kernels store it (see kcverify.kernels.cast for why float32
scales keep the cast exact): always a normal float32 number, so an all-zero or subnormal group
never divides by zero; a static scale is fl32(value); no scale is s = 1.

Groups, for a MatMul operand with reduction axis r (A's last axis, B's axis -2):

weights      per_tensor   the whole tensor
             per_channel  one scale per output feature: all axes but ``out_axis`` (B (K, N): -1;
                          a constant left operand A (M, K): -2; a Conv weight (O, I, ...): 0)
             per_block    block_size consecutive entries along r, separately for every index of
                          the other axes (group-wise quantization: per output feature and block)
activations  dynamic_per_tensor  per sample: all axes but the operand's sample axis (axis 0 of
                                 the model's inputs, tracked through the graph:
                                 kcverify.models.blocks.sample_axes); an operand with no
                                 sample axis, or an unknown one, is one group (exact when the
                                 batch holds one sample)
             dynamic_per_token   one scale per row of A / column of B: amax along r
             dynamic_per_block   block_size consecutive entries along r, per every other index

             mx, nv              OCP MX / NVFP4 block scales along r (kcverify.kernels.scales)

Every dynamic group lies inside one sample (one index of the sample axis), so a sample's scales
never depend on the rest of the batch. Scales come back broadcastable to the tensor: size 1 along the
axes a scale is shared by; per-block scales are expanded to the full length of r.
"""

from __future__ import annotations

import torch

from kcverify.errors import KernelSpecError
from kcverify.kernels import scales as _scales
from kcverify.kernels.cast import cast_grid, flush_subnormals
from kcverify.kernels.scales import kind_of
from kcverify.kernels.spec import CastSpec

_F64 = torch.float64


def scale_from_amax(amax: torch.Tensor, cast: CastSpec) -> torch.Tensor:
    """s = fl32(max(amax, floor) / max_finite): one float32 division of the float32 amax, as a
    kernel computes it. float64 result."""
    return _scales.scale_from_amax(amax, cast)


def weight_scale(w: torch.Tensor, cast: CastSpec, out_axis: int = -1,
                 reduce_axis: int | None = None) -> torch.Tensor:
    """The weight scales of ``cast`` for w (see module doc), broadcastable to w, float64: the
    scale kind's realization (kcverify.kernels.scales)."""
    kind = kind_of(cast)
    if "weights" not in kind.roles:
        raise KernelSpecError(f"unknown weights scaling {cast.scale!r}")
    if reduce_axis is None and kind.blocked and kind.name != "per_block":
        reduce_axis = -2 if out_axis % max(w.dim(), 1) == max(w.dim(), 1) - 1 else -1
    return kind.realize(w, cast, out_axis=out_axis, reduce_axis=reduce_axis, role="weights")


def activation_scale(x: torch.Tensor, cast: CastSpec, reduce_axis: int = -1,
                     sample_axis: int | str | None = 0) -> torch.Tensor:
    """The activation scales of ``cast`` for x (see module doc), broadcastable to x, float64.
    ``sample_axis``: x's sample axis (None: none; "unknown": one group for all of x)."""
    kind = kind_of(cast)
    if "activations" not in kind.roles:
        raise KernelSpecError(f"unknown activations scaling {cast.scale!r}")
    return kind.realize(x, cast, reduce_axis=reduce_axis, sample_axis=sample_axis,
                        role="activations")


def cast_values(t: torch.Tensor, cast: CastSpec, s: torch.Tensor, rounding: str = "nearest",
                generator: torch.Generator | None = None) -> torch.Tensor:
    """cast(t / s) as the spec says: its saturation, flush-to-zero, and Q = 0 where s = 0 (an
    NVFP4 block scale that underflows)."""
    q = cast_grid(t, cast.format, s, rounding, saturate=cast.saturate, generator=generator)
    if cast.ftz:
        q = flush_subnormals(q, cast.format)
    zero = s == 0
    if bool(zero.any()):
        q = torch.where(zero, torch.zeros_like(q), q)
    return q


def quantize_weight(w: torch.Tensor, cast: CastSpec, out_axis: int = -1,
                    reduce_axis: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q(W), scales): Q(W) = s * cast(W / s) with round-to-nearest-even, exact, float64."""
    s = weight_scale(w, cast, out_axis, reduce_axis)
    return cast_values(w, cast, s) * s, s


def quantize_activation(x: torch.Tensor, cast: CastSpec, reduce_axis: int = -1,
                        rounding: str = "nearest",
                        generator: torch.Generator | None = None,
                        sample_axis: int | str | None = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q(x), scales) for an activation, exact, float64; ``rounding`` as in cast_to."""
    s = activation_scale(x, cast, reduce_axis, sample_axis)
    return cast_values(x, cast, s, rounding, generator) * s, s
