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

Every dynamic group lies inside one sample (one index of the sample axis), so a sample's scales
never depend on the rest of the batch. Scales come back broadcastable to the tensor: size 1 along the
axes a scale is shared by; per-block scales are expanded to the full length of r.
"""

from __future__ import annotations

import torch

from kcverify.errors import KernelSpecError
from kcverify.kernels.cast import cast_grid
from kcverify.kernels.spec import CastSpec

_F64 = torch.float64


def _max_step(cast: CastSpec) -> float:
    return float(cast.format.max_finite)


def scale_from_amax(amax: torch.Tensor, cast: CastSpec) -> torch.Tensor:
    """s = fl32(max(amax, floor) / max_finite): one float32 division of the float32 amax, as a
    kernel computes it. float64 result."""
    a = torch.clamp(amax.to(_F64), min=cast.floor).to(torch.float32)
    return (a / torch.tensor(_max_step(cast), dtype=torch.float32, device=a.device)).to(_F64)


def _ones(x: torch.Tensor) -> torch.Tensor:
    return torch.ones([1] * x.dim(), dtype=_F64, device=x.device)


def _amax_except(x: torch.Tensor, keep: tuple[int, ...]) -> torch.Tensor:
    axes = [d for d in range(x.dim()) if d not in keep]
    a = x.to(_F64).abs()
    return a.amax(dim=axes, keepdim=True) if axes else a


def _block_amax(x: torch.Tensor, axis: int, block: int) -> torch.Tensor:
    """amax over blocks of ``block`` entries along ``axis``, expanded back to x's shape."""
    a = x.to(_F64).abs().movedim(axis, -1)
    k = a.shape[-1]
    nb = -(-k // block)
    pad = nb * block - k
    if pad:
        a = torch.nn.functional.pad(a, (0, pad))
    m = a.reshape(*a.shape[:-1], nb, block).amax(dim=-1)
    m = m.repeat_interleave(block, dim=-1)[..., :k]
    return m.movedim(-1, axis)


def _axis(x: torch.Tensor, axis: int, what: str) -> int:
    if not -x.dim() <= axis < max(x.dim(), 1):
        raise KernelSpecError(f"{what}: axis {axis} is out of range for a tensor of rank {x.dim()}")
    return axis % max(x.dim(), 1)


def weight_scale(w: torch.Tensor, cast: CastSpec, out_axis: int = -1,
                 reduce_axis: int | None = None) -> torch.Tensor:
    """The weight scales of ``cast`` for w (see module doc), broadcastable to w, float64."""
    if cast.scale == "none":
        return _ones(w)
    if cast.scale == "static":
        return torch.full([1] * w.dim(), float(torch.tensor(cast.value, dtype=torch.float32)),
                          dtype=_F64, device=w.device)
    if cast.scale == "per_tensor":
        return scale_from_amax(_amax_except(w, ()), cast)
    if w.dim() == 0:
        return scale_from_amax(w.abs().reshape(()), cast)
    out = _axis(w, out_axis, "per-channel weight scale")
    if cast.scale == "per_channel":
        return scale_from_amax(_amax_except(w, (out,)), cast)
    if cast.scale == "per_block":
        if reduce_axis is None:
            if w.dim() != 2:
                raise KernelSpecError(f"per_block weight scale of a rank-{w.dim()} tensor needs its reduction axis")
            reduce_axis = 1 - out
        r = _axis(w, reduce_axis, "per-block weight scale")
        return scale_from_amax(_block_amax(w, r, int(cast.block_size or 32)), cast)
    raise KernelSpecError(f"unknown weights scaling {cast.scale!r}")


def activation_scale(x: torch.Tensor, cast: CastSpec, reduce_axis: int = -1,
                     sample_axis: int | str | None = 0) -> torch.Tensor:
    """The activation scales of ``cast`` for x (see module doc), broadcastable to x, float64.
    ``sample_axis``: x's sample axis (None: none; "unknown": one group for all of x)."""
    if cast.scale == "none":
        return _ones(x)
    if cast.scale == "static":
        return torch.full([1] * x.dim(), float(torch.tensor(cast.value, dtype=torch.float32)),
                          dtype=_F64, device=x.device)
    if x.dim() <= 1 and cast.scale == "dynamic_per_tensor":
        return scale_from_amax(_amax_except(x, ()), cast)
    if cast.scale == "dynamic_per_tensor":
        if isinstance(sample_axis, int) and not isinstance(sample_axis, bool):
            return scale_from_amax(_amax_except(x, (_axis(x, sample_axis, "sample axis"),)), cast)
        return scale_from_amax(_amax_except(x, ()), cast)
    r = _axis(x, reduce_axis, f"{cast.scale} activation scale")
    if cast.scale == "dynamic_per_token":
        return scale_from_amax(x.to(_F64).abs().amax(dim=r, keepdim=True), cast)
    if cast.scale == "dynamic_per_block":
        return scale_from_amax(_block_amax(x, r, int(cast.block_size or 32)), cast)
    raise KernelSpecError(f"unknown activations scaling {cast.scale!r}")


def quantize_weight(w: torch.Tensor, cast: CastSpec, out_axis: int = -1,
                    reduce_axis: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q(W), scales): Q(W) = s * cast(W / s) with round-to-nearest-even, exact, float64."""
    s = weight_scale(w, cast, out_axis, reduce_axis)
    return cast_grid(w, cast.format, s) * s, s


def quantize_activation(x: torch.Tensor, cast: CastSpec, reduce_axis: int = -1,
                        rounding: str = "nearest",
                        generator: torch.Generator | None = None,
                        sample_axis: int | str | None = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q(x), scales) for an activation, exact, float64; ``rounding`` as in cast_to."""
    s = activation_scale(x, cast, reduce_axis, sample_axis)
    return cast_grid(x, cast.format, s, rounding, generator=generator) * s, s
