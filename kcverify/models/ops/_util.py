"""Helpers shared by the op families: ONNX element types, numpy arrays and int lists as tensors.

Every floating tensor is held in the executor's float dtype; a cast to a narrower float format
(fp16, bf16, fp8) rounds the value exactly to that format and keeps it in the executor's dtype.
Integer and boolean tensors keep their own torch dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import ml_dtypes
import numpy as np
import torch
from onnx import TensorProto

# ONNX element type -> the torch dtype an *integer/bool* tensor is held in.
INT_TYPES: dict[int, torch.dtype] = {
    TensorProto.UINT8: torch.uint8, TensorProto.INT8: torch.int8,
    TensorProto.UINT16: torch.uint16, TensorProto.INT16: torch.int16,
    TensorProto.INT32: torch.int32, TensorProto.INT64: torch.int64,
    TensorProto.UINT32: torch.uint32, TensorProto.UINT64: torch.uint64,
    TensorProto.BOOL: torch.bool,
    TensorProto.INT4: torch.int8, TensorProto.UINT4: torch.uint8,  # held widened
}
# ONNX float element type -> the torch dtype whose rounding it has (None: the executor's float).
FLOAT_TYPES: dict[int, torch.dtype | None] = {
    TensorProto.FLOAT: None, TensorProto.DOUBLE: None,
    TensorProto.FLOAT16: torch.float16, TensorProto.BFLOAT16: torch.bfloat16,
    TensorProto.FLOAT8E4M3FN: torch.float8_e4m3fn, TensorProto.FLOAT8E5M2: torch.float8_e5m2,
}
# numpy / ml_dtypes names of the float formats narrower than the executor's -> their torch dtype
NARROW_FLOATS: dict[str, torch.dtype] = {
    "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
}
_ML_FLOATS = {np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn),
              np.dtype(ml_dtypes.float8_e5m2)}

_ML_INTS = {np.dtype(ml_dtypes.int4): np.int8, np.dtype(ml_dtypes.uint4): np.uint8}


def round_to(value: torch.Tensor, fmt: torch.dtype | None, saturate: bool = False) -> torch.Tensor:
    """``value`` rounded to nearest-even in ``fmt``, returned in ``value``'s dtype.

    fp8 (ONNX semantics): with ``saturate`` every value (inf too) is clamped to +-max first;
    without it a magnitude past max + ulp/2 (ties to even) becomes NaN (e4m3fn) or inf (e5m2).
    A float64 value is rounded once, exactly (torch's own cast goes through float32 and would
    round twice).
    """
    if fmt is None:
        return value
    cast = _single_rounding if value.dtype == torch.float64 and fmt in _NARROW else _torch_cast
    if fmt in _FP8_OVERFLOW:
        top = torch.finfo(fmt).max
        if saturate:
            return cast(value.clamp(-top, top), fmt)
        out = cast(value.clamp(-top, top), fmt)
        limit, tie_up = _FP8_OVERFLOW[fmt]
        mag = value.abs()
        over = (mag >= limit) if tie_up else (mag > limit)
        if fmt == torch.float8_e4m3fn:
            special = torch.full_like(out, float("nan"))
        else:
            special = torch.copysign(torch.full_like(out, float("inf")), value)
        return torch.where(over, special, out)
    return cast(value, fmt)


_NARROW = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2",
           torch.bfloat16: "bf16", torch.float16: "fp16"}


def _torch_cast(value: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    return value.to(fmt).to(value.dtype)


def _single_rounding(value: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    from kcverify.kernels.cast import round_to_format

    return round_to_format(value, _NARROW[fmt])


# fp8 format -> (max + ulp/2, whether that tie rounds up past max: max's last mantissa bit is 1)
_FP8_OVERFLOW: dict[torch.dtype, tuple[float, bool]] = {
    torch.float8_e4m3fn: (448.0 + 16.0, False),
    torch.float8_e5m2: (57344.0 + 4096.0, True),
}


def from_numpy(arr: np.ndarray, float_dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A numpy array (ml_dtypes floats too) as a tensor: floats in ``float_dtype`` (exact for
    every narrower format), integers and booleans in their own dtype."""
    a = np.asarray(arr)
    if a.dtype in _ML_INTS:
        a = a.astype(_ML_INTS[a.dtype])
    if a.dtype in _ML_FLOATS or a.dtype.kind == "f":
        return torch.from_numpy(np.array(a, dtype=np.float64, copy=True)).to(device, float_dtype)
    if a.dtype == np.bool_:
        return torch.from_numpy(np.array(a, copy=True)).to(device)
    if a.dtype.kind in "iu":
        return torch.from_numpy(np.array(a, copy=True)).to(device)
    raise TypeError(f"unsupported array dtype {a.dtype}")


def ints(t: torch.Tensor | None) -> list[int]:
    """A (shape-like) integer tensor as a Python list of ints; ``None`` gives []."""
    if t is None:
        return []
    return [int(v) for v in t.reshape(-1).tolist()]


def int_tensor(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64, device=device)


def norm_axis(axis: int, rank: int, inclusive: bool = False) -> int:
    """``axis`` in [-rank, rank) (``inclusive``: [-rank, rank], Flatten's range) as a
    non-negative axis; outside it a ValueError (every runtime refuses such a model: the axis is
    never reinterpreted as axis % rank)."""
    hi = rank + 1 if inclusive else rank
    if not -rank <= axis < hi:
        raise ValueError(f"axis {axis} outside [{-rank}, {hi}) for a rank-{rank} input")
    return axis + rank if axis < 0 else axis
