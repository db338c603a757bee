"""What rules derive from a constant alone (its lift into a box, a weight's casts), cached.

A model's weights, biases and gains are the same in every block call and every run, and so is
everything a rule computes from them with the kernel specs: ``lift`` (the hull of each kernel's
stored value), a MatMul's cast operands and cast drift. ``cached(ctx, x, tag, build)`` keys the
result by ``tag``, the two specs (by identity; the entry holds them), the device, the rounding
count, shape, dtype and a CRC of the values, and confirms a hit by comparing the values exactly,
so a different graph or different weights never read a stale entry. Cached tensors are shared:
rules never modify their inputs in place. The cache holds at most ``CACHE_BYTES`` of tensors
(least recently used first out).
"""

from __future__ import annotations

import dataclasses
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from kcverify.bounds.box import Box, Concrete
from kcverify.bounds.registry import RuleCtx

T = TypeVar("T")
CACHE_BYTES = 256 * 2**20
_CRC_DTYPES = (torch.float32, torch.float64, torch.float16)


@dataclass
class _Entry:
    train: Any
    inf: Any
    value: torch.Tensor
    result: Any
    nbytes: int


_CACHE: OrderedDict[tuple, _Entry] = OrderedDict()
_held = [0]


def _key(ctx: RuleCtx, x: Concrete, tag: tuple) -> tuple | None:
    v = x.value
    if v.device.type != "cpu" or v.dtype not in _CRC_DTYPES:
        return None
    crc = zlib.crc32(v.detach().contiguous().numpy())
    return (tag, id(ctx.train), id(ctx.inf), str(ctx.device), x.rounds, tuple(v.shape), v.dtype,
            crc)


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if dataclasses.is_dataclass(obj):
        return sum(_nbytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    if isinstance(obj, (tuple, list)):
        return sum(_nbytes(o) for o in obj)
    return 0


def cached(ctx: RuleCtx, x: Concrete, tag: tuple, build: Callable[[], T]) -> T:
    """``build()``, or the result an earlier call with the same constant, tag and specs built."""
    key = _key(ctx, x, tag)
    if key is None:
        return build()
    hit = _CACHE.get(key)
    if (hit is not None and hit.train is ctx.train and hit.inf is ctx.inf
            and torch.equal(hit.value, x.value)):
        _CACHE.move_to_end(key)
        return hit.result
    result = build()
    size = _nbytes(result) + _nbytes(x.value)
    if size <= CACHE_BYTES:
        old = _CACHE.pop(key, None)
        if old is not None:
            _held[0] -= old.nbytes
        _CACHE[key] = _Entry(ctx.train, ctx.inf, x.value.clone(), result, size)
        _held[0] += size
        while _held[0] > CACHE_BYTES:
            _, e = _CACHE.popitem(last=False)
            _held[0] -= e.nbytes
    return result


def lift(ctx: RuleCtx, x: Any) -> Box:
    """``ctx.lift(x)``, cached for a constant."""
    if isinstance(x, Concrete):
        return cached(ctx, x, ("lift",), lambda: ctx.lift(x))
    return ctx.lift(x)


def clear() -> None:
    """Empty the cache (tests; memory)."""
    _CACHE.clear()
    _held[0] = 0


def size() -> tuple[int, int]:
    """(entries, bytes held)."""
    return len(_CACHE), _held[0]
