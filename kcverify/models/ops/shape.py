"""Data movement and shape ops: no arithmetic, so nothing here is rounded (except casts to a
narrower float format, which round exactly as the target format does)."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from kcverify.models.ops import OpContext, register_op
from kcverify.models.ops._util import (
    FLOAT_TYPES,
    INT_TYPES,
    NARROW_FLOATS,
    from_numpy,
    int_tensor,
    ints,
    norm_axis,
    round_to,
)


# --- constants -------------------------------------------------------------------------------
@register_op("Constant", since_opset=1)
def constant(ctx: OpContext, *, value: np.ndarray | None = None, value_float: float | None = None,
             value_floats: list[float] | None = None, value_int: int | None = None,
             value_ints: list[int] | None = None) -> torch.Tensor:
    if value is not None:
        return from_numpy(value, ctx.dtype, ctx.device)
    if value_float is not None:
        return torch.tensor(value_float, dtype=ctx.dtype, device=ctx.device)
    if value_floats is not None:
        return torch.tensor(list(value_floats), dtype=ctx.dtype, device=ctx.device)
    if value_int is not None:
        return torch.tensor(value_int, dtype=torch.int64, device=ctx.device)
    if value_ints is not None:
        return int_tensor(value_ints, ctx.device)
    raise ValueError("Constant without a value")


@register_op("ConstantOfShape", since_opset=9)
def constant_of_shape(ctx: OpContext, shape: torch.Tensor, *,
                      value: np.ndarray | None = None) -> torch.Tensor:
    fill = from_numpy(value if value is not None else np.zeros(1, np.float32), ctx.dtype, ctx.device)
    return fill.reshape(()).expand(ints(shape)).clone()


@register_op("Range", since_opset=11)
def range_(ctx: OpContext, start: torch.Tensor, limit: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """start + i * delta for i < max(ceil((limit - start) / delta), 0), in start's type."""
    s, lim, d = start.item(), limit.item(), delta.item()
    n = max(int(math.ceil((lim - s) / d)), 0)
    if start.is_floating_point():
        return s + torch.arange(n, dtype=ctx.dtype, device=ctx.device) * d
    return torch.arange(s, s + n * d, d, dtype=start.dtype, device=ctx.device)[:n]


# --- types -----------------------------------------------------------------------------------
def _cast(ctx: OpContext, x: torch.Tensor, to: int, saturate: int) -> torch.Tensor:
    if to in INT_TYPES:
        target = INT_TYPES[to]
        if x.is_floating_point() and target != torch.bool:
            x = torch.trunc(x)
        return x.to(target)
    if to in FLOAT_TYPES:
        fmt = FLOAT_TYPES[to]
        y = x.to(ctx.dtype)
        return round_to(y, fmt, saturate=bool(saturate))
    raise ValueError(f"Cast to ONNX element type {to} is not supported")


@register_op("Cast", since_opset=6)
def cast(ctx: OpContext, x: torch.Tensor, *, to: int, saturate: int = 1) -> torch.Tensor:
    """Cast to ``to``; float targets narrower than the executor's dtype round exactly to them
    (fp8 saturating unless ``saturate=0``, opset 19) and are held in the executor's dtype."""
    return _cast(ctx, x, to, saturate)


@register_op("CastLike", since_opset=15)
def cast_like(ctx: OpContext, x: torch.Tensor, like: torch.Tensor, *,
              saturate: int = 1) -> torch.Tensor:
    if like.is_floating_point():
        fmt = NARROW_FLOATS.get(ctx.input_dtype(1) or "")
        return round_to(x.to(ctx.dtype), fmt, saturate=bool(saturate))
    return x.to(like.dtype)


@register_op("Identity", since_opset=1)
def identity(ctx: OpContext, x: torch.Tensor) -> torch.Tensor:
    return x


@register_op("Dropout", since_opset=1)
def dropout_v1(ctx: OpContext, x: torch.Tensor, *, is_test: int = 1, ratio: float = 0.5,
               seed: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Inference: the identity, and an all-true mask."""
    return x, torch.ones_like(x, dtype=torch.bool)


@register_op("Dropout", since_opset=12)
def dropout(ctx: OpContext, x: torch.Tensor, ratio: torch.Tensor | None = None,
            training_mode: torch.Tensor | None = None, *,
            seed: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Inference (training_mode must be false): the identity, and an all-true mask."""
    if training_mode is not None and bool(training_mode.item()):
        raise ValueError("Dropout in training mode is not deterministic; export in eval mode")
    return x, torch.ones_like(x, dtype=torch.bool)


# --- shapes ----------------------------------------------------------------------------------
@register_op("Shape", since_opset=1)
def shape(ctx: OpContext, x: torch.Tensor, *, start: int = 0, end: int | None = None) -> torch.Tensor:
    dims = list(x.shape)
    return int_tensor(dims[start:end] if end is not None else dims[start:], ctx.device)


@register_op("Size", since_opset=1)
def size(ctx: OpContext, x: torch.Tensor) -> torch.Tensor:
    return torch.tensor(x.numel(), dtype=torch.int64, device=ctx.device)


@register_op("Reshape", since_opset=5)
def reshape(ctx: OpContext, x: torch.Tensor, shape_: torch.Tensor, *, allowzero: int = 0) -> torch.Tensor:
    """A 0 copies the input's dim (unless allowzero), one -1 is inferred."""
    target = ints(shape_)
    if not allowzero:
        target = [x.shape[i] if d == 0 else d for i, d in enumerate(target)]
    return x.reshape(target)


@register_op("Flatten", since_opset=1)
def flatten(ctx: OpContext, x: torch.Tensor, *, axis: int = 1) -> torch.Tensor:
    a = norm_axis(axis, x.dim(), inclusive=True)
    return x.reshape(math.prod(x.shape[:a]), math.prod(x.shape[a:]))


@register_op("Transpose", since_opset=1)
def transpose(ctx: OpContext, x: torch.Tensor, *, perm: list[int] | None = None) -> torch.Tensor:
    return x.permute(list(perm) if perm is not None else list(reversed(range(x.dim()))))


def _squeeze(x: torch.Tensor, axes: list[int]) -> torch.Tensor:
    if not axes:
        return x.reshape([d for d in x.shape if d != 1])
    drop = {norm_axis(a, x.dim()) for a in axes}
    return x.reshape([d for i, d in enumerate(x.shape) if i not in drop])


def _unsqueeze(x: torch.Tensor, axes: list[int]) -> torch.Tensor:
    rank = x.dim() + len(axes)
    new = sorted(norm_axis(a, rank) for a in axes)
    out = list(x.shape)
    for a in new:
        out.insert(a, 1)
    return x.reshape(out)


@register_op("Squeeze", since_opset=1)
def squeeze_v1(ctx: OpContext, x: torch.Tensor, *, axes: list[int] | None = None) -> torch.Tensor:
    return _squeeze(x, list(axes or []))


@register_op("Squeeze", since_opset=13)
def squeeze(ctx: OpContext, x: torch.Tensor, axes: torch.Tensor | None = None) -> torch.Tensor:
    return _squeeze(x, ints(axes))


@register_op("Unsqueeze", since_opset=1)
def unsqueeze_v1(ctx: OpContext, x: torch.Tensor, *, axes: list[int]) -> torch.Tensor:
    return _unsqueeze(x, list(axes))


@register_op("Unsqueeze", since_opset=13)
def unsqueeze(ctx: OpContext, x: torch.Tensor, axes: torch.Tensor) -> torch.Tensor:
    return _unsqueeze(x, ints(axes))


@register_op("Expand", since_opset=8)
def expand(ctx: OpContext, x: torch.Tensor, shape_: torch.Tensor) -> torch.Tensor:
    """Bidirectional broadcast of x against ``shape``."""
    out = torch.broadcast_shapes(tuple(x.shape), tuple(ints(shape_)))
    return x.expand(out)


@register_op("Tile", since_opset=6)
def tile(ctx: OpContext, x: torch.Tensor, repeats: torch.Tensor) -> torch.Tensor:
    return x.repeat(ints(repeats))


@register_op("Concat", since_opset=4)
def concat(ctx: OpContext, *xs: torch.Tensor, axis: int) -> torch.Tensor:
    parts = [x for x in xs if x is not None]
    if any(p.is_floating_point() for p in parts):
        parts = [p.to(ctx.dtype) for p in parts]
    return torch.cat(parts, dim=norm_axis(axis, parts[0].dim()))


def _split(ctx: OpContext, x: torch.Tensor, axis: int, sizes: list[int]) -> tuple[torch.Tensor, ...]:
    a = norm_axis(axis, x.dim())
    if not sizes:
        n = len(ctx.node.outputs)
        if x.shape[a] % n:
            raise ValueError(f"cannot split {x.shape[a]} into {n} equal parts")
        sizes = [x.shape[a] // n] * n
    return tuple(torch.split(x, sizes, dim=a))


@register_op("Split", since_opset=2)
def split_v2(ctx: OpContext, x: torch.Tensor, *, axis: int = 0,
             split: list[int] | None = None) -> tuple[torch.Tensor, ...]:
    return _split(ctx, x, axis, list(split or []))


@register_op("Split", since_opset=13)
def split_v13(ctx: OpContext, x: torch.Tensor, split: torch.Tensor | None = None, *,
              axis: int = 0) -> tuple[torch.Tensor, ...]:
    return _split(ctx, x, axis, ints(split))


@register_op("Split", since_opset=18)
def split(ctx: OpContext, x: torch.Tensor, split: torch.Tensor | None = None, *, axis: int = 0,
          num_outputs: int | None = None) -> tuple[torch.Tensor, ...]:
    """Sizes from ``split``, else ``num_outputs`` chunks of ceil(n / num_outputs) (last smaller)."""
    sizes = ints(split)
    if not sizes and num_outputs:
        a = norm_axis(axis, x.dim())
        chunk = -(-x.shape[a] // num_outputs)
        sizes = [min(chunk, x.shape[a] - i * chunk) for i in range(num_outputs)]
    return _split(ctx, x, axis, sizes)


def _slice(x: torch.Tensor, starts: list[int], ends: list[int], axes: list[int],
           steps: list[int]) -> torch.Tensor:
    """numpy slicing with ONNX's clamping; negative steps walk backwards."""
    if not axes:
        axes = list(range(len(starts)))
    if not steps:
        steps = [1] * len(starts)
    index: list[slice] = [slice(None)] * x.dim()
    backward: list[tuple[int, int, int, int]] = []
    if len(set(norm_axis(a, x.dim()) for a in axes)) != len(axes):
        raise ValueError(f"Slice axes {axes} repeat an axis")
    for s, e, a, st in zip(starts, ends, axes, steps):
        if st == 0:
            raise ValueError("Slice step 0 (ONNX: steps cannot be 0)")
        a = norm_axis(a, x.dim())
        dim = x.shape[a]
        s = s + dim if s < 0 else s
        e = e + dim if e < 0 else e
        if st > 0:
            index[a] = slice(min(max(s, 0), dim), min(max(e, 0), dim), st)
        else:
            backward.append((a, min(max(s, 0), dim - 1), min(max(e, -1), dim - 1), st))
    out = x[tuple(index)]
    for a, s, e, st in backward:
        idx = (torch.arange(s, e, st, device=x.device) if s > e  # else empty, as ONNX says
               else torch.zeros(0, dtype=torch.int64, device=x.device))
        out = out.index_select(a, idx)
    return out


@register_op("Slice", since_opset=1)
def slice_v1(ctx: OpContext, x: torch.Tensor, *, starts: list[int], ends: list[int],
             axes: list[int] | None = None) -> torch.Tensor:
    return _slice(x, list(starts), list(ends), list(axes or []), [])


@register_op("Slice", since_opset=10)
def slice_(ctx: OpContext, x: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor,
           axes: torch.Tensor | None = None, steps: torch.Tensor | None = None) -> torch.Tensor:
    return _slice(x, ints(starts), ints(ends), ints(axes), ints(steps))


def _wrap(idx: torch.Tensor, dim: int) -> torch.Tensor:
    idx = idx.to(torch.int64)
    return torch.where(idx < 0, idx + dim, idx)


@register_op("Gather", since_opset=1)
def gather(ctx: OpContext, x: torch.Tensor, indices: torch.Tensor, *, axis: int = 0) -> torch.Tensor:
    """out[..., idx..., ...] = x[..., indices[idx...], ...] along ``axis`` (negatives wrap)."""
    a = norm_axis(axis, x.dim())
    idx = _wrap(indices, x.shape[a])
    out = x.index_select(a, idx.reshape(-1))
    return out.reshape(tuple(x.shape[:a]) + tuple(idx.shape) + tuple(x.shape[a + 1:]))


@register_op("GatherElements", since_opset=11)
def gather_elements(ctx: OpContext, x: torch.Tensor, indices: torch.Tensor, *,
                    axis: int = 0) -> torch.Tensor:
    a = norm_axis(axis, x.dim())
    return torch.gather(x, a, _wrap(indices, x.shape[a]))


@register_op("Trilu", since_opset=14)
def trilu(ctx: OpContext, x: torch.Tensor, k: torch.Tensor | None = None, *,
          upper: int = 1) -> torch.Tensor:
    """Keep the upper (j - i >= k) or lower (j - i <= k) triangle of the last two axes."""
    kk = int(k.item()) if k is not None else 0
    rows, cols = x.shape[-2], x.shape[-1]
    i = torch.arange(rows, device=x.device).unsqueeze(1)
    j = torch.arange(cols, device=x.device).unsqueeze(0)
    keep = (j - i >= kk) if upper else (j - i <= kk)
    return torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))


@register_op("Pad", since_opset=2)
def pad_v2(ctx: OpContext, x: torch.Tensor, *, pads: list[int], mode: str = "constant",
           value: float = 0.0) -> torch.Tensor:
    """Pad with the amounts and fill value as attributes (opsets 2-10)."""
    return _pad(x, list(pads), [], mode, value)


@register_op("Pad", since_opset=11)
def pad(ctx: OpContext, x: torch.Tensor, pads: torch.Tensor, value: torch.Tensor | None = None,
        axes: torch.Tensor | None = None, *, mode: str = "constant") -> torch.Tensor:
    """Pad with (begin..., end...) amounts per axis (negative pads crop)."""
    fill = float(value.item()) if value is not None and value.numel() else 0.0
    return _pad(x, ints(pads), ints(axes), mode, fill)


def _pad(x: torch.Tensor, p: list[int], axes: list[int], mode: str, fill: float) -> torch.Tensor:
    ax = [norm_axis(a, x.dim()) for a in axes] or list(range(x.dim()))
    n = len(ax)
    flat: list[int] = []
    for i in reversed(range(x.dim())):
        if i in ax:
            j = ax.index(i)
            flat += [p[j], p[n + j]]
        else:
            flat += [0, 0]
    torch_mode = {"constant": "constant", "reflect": "reflect", "edge": "replicate"}[mode]
    if torch_mode == "constant":
        return F.pad(x, flat, mode="constant", value=fill)
    while len(flat) > 2 and flat[-2:] == [0, 0]:  # torch pads only the trailing axes here
        flat = flat[:-2]
    return F.pad(x, flat, mode=torch_mode)


@register_op("GatherND", since_opset=11)
def gather_nd(ctx: OpContext, x: torch.Tensor, indices: torch.Tensor, *,
              batch_dims: int = 0) -> torch.Tensor:
    """out[i..., j...] = x[i..., indices[i..., :]...] over the ``batch_dims`` leading axes."""
    b = batch_dims
    m = indices.shape[-1]
    batch = tuple(x.shape[:b])
    nb = math.prod(batch)
    picked = tuple(x.shape[b:b + m])
    rest = tuple(x.shape[b + m:])
    idx = indices.to(torch.int64).reshape(nb, -1, m)
    dims = torch.tensor(picked, dtype=torch.int64, device=x.device)
    idx = torch.where(idx < 0, idx + dims, idx)
    strides = [math.prod(picked[k + 1:]) for k in range(m)]
    lin = (idx * torch.tensor(strides, dtype=torch.int64, device=x.device)).sum(-1)
    flat = x.reshape((nb, math.prod(picked)) + rest)
    rows = torch.arange(nb, device=x.device).unsqueeze(1)
    out = flat[rows, lin]
    return out.reshape(tuple(indices.shape[:-1]) + rest)
