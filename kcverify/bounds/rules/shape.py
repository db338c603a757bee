"""Data movement (exact in both kernels: the same map applied to all six bounds) and the exact
evaluation of ops whose inputs are all concrete (shapes, indices, masks, constant folding).

Concrete float results of arithmetic carry ``rounds + 1``: a realization may round them to its
compute format (RuleCtx.lift widens them accordingly). ONNX semantics follow the reference
evaluator: attributes as keyword arguments, opset differences as data (axes as attribute before
opset 13/18, as input after).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from kcverify.bounds.box import Box, Concrete, mag, pad_hi, pad_lo
from kcverify.bounds.registry import CONCRETE_OPS, Interval, RuleCtx, bound_rule, concrete_op
from kcverify.bounds.rules import cache
from kcverify.errors import BoundError
from kcverify.kernels.formats import Format, get_format
from kcverify.kernels.spec import KernelSpec
from kcverify.models.ir import Node

_ONNX_TO_TORCH = {
    1: torch.float32, 2: torch.uint8, 3: torch.int8, 5: torch.int16, 6: torch.int32,
    7: torch.int64, 9: torch.bool, 10: torch.float16, 11: torch.float64, 16: torch.bfloat16,
}


def _ints(v: torch.Tensor | None) -> list[int]:
    return [] if v is None else [int(x) for x in v.reshape(-1).tolist()]


def _axes(node: Node, opset: int, inputs: list, pos: int, since: int) -> list[int] | None:
    if opset >= since and len(inputs) > pos and inputs[pos] is not None:
        return _ints(inputs[pos])
    a = node.attrs.get("axes")
    return None if a is None else [int(x) for x in a]


# --- movement functions: fn(node, opset, x, *other_inputs) -> tensor or tuple ------------
def _reshape(node, opset, x, shape):
    s = _ints(shape)
    allowzero = int(node.attrs.get("allowzero", 0))
    out = [(x.shape[i] if (d == 0 and not allowzero) else d) for i, d in enumerate(s)]
    return x.reshape(out)


def _transpose(node, opset, x):
    perm = node.attrs.get("perm")
    perm = list(reversed(range(x.dim()))) if perm is None else [int(p) for p in perm]
    return x.permute(perm)


def _unsqueeze(node, opset, x, axes=None):
    ax = _axes(node, opset, [x, axes], 1, 13) or []
    r = x.dim() + len(ax)
    for a in sorted(a % r for a in ax):
        x = x.unsqueeze(a)
    return x


def _squeeze(node, opset, x, axes=None):
    ax = _axes(node, opset, [x, axes], 1, 13)
    if ax is None:
        return x.reshape([d for d in x.shape if d != 1])
    for a in sorted((a % x.dim() for a in ax), reverse=True):
        x = x.squeeze(a)
    return x


def _flatten(node, opset, x):
    axis = int(node.attrs.get("axis", 1)) % (x.dim() + 1) if x.dim() else 0
    lead = int(np.prod(x.shape[:axis])) if axis else 1
    return x.reshape(lead, -1)


def _identity(node, opset, x, *rest):
    return x


def _expand(node, opset, x, shape):
    target = torch.broadcast_shapes(tuple(x.shape), tuple(_ints(shape)))
    return x.expand(target)


def _gather(node, opset, x, idx):
    axis = int(node.attrs.get("axis", 0)) % x.dim()
    i = idx.to(torch.int64)
    i = torch.where(i < 0, i + x.shape[axis], i)
    out = torch.index_select(x, axis, i.reshape(-1).to(x.device))
    return out.reshape((*x.shape[:axis], *i.shape, *x.shape[axis + 1:]))


def _slice(node, opset, x, starts=None, ends=None, axes=None, steps=None):
    if opset < 10:
        st, en = list(node.attrs["starts"]), list(node.attrs["ends"])
        ax = list(node.attrs.get("axes", range(len(st))))
        sp = [1] * len(st)
    else:
        st, en = _ints(starts), _ints(ends)
        ax = _ints(axes) if axes is not None else list(range(len(st)))
        sp = _ints(steps) if steps is not None else [1] * len(st)
    idx: list[slice] = [slice(None)] * x.dim()
    for s, e, a, p in zip(st, en, ax, sp):
        if p <= 0:
            raise BoundError(f"Slice node {node.name!r}: negative steps are not supported")
        dim = x.shape[a % x.dim()]
        s = max(0, min(dim, s + dim if s < 0 else s))
        e = max(0, min(dim, e + dim if e < 0 else e))
        idx[a % x.dim()] = slice(s, e, p)
    return x[tuple(idx)]


def _split(node, opset, x, split=None):
    axis = int(node.attrs.get("axis", 0)) % x.dim()
    sizes = _ints(split) if split is not None else node.attrs.get("split")
    if sizes is None:
        n = int(node.attrs.get("num_outputs", len(node.outputs)))
        size = -(-x.shape[axis] // n)
        sizes = [min(size, x.shape[axis] - i * size) for i in range(n)]
    return tuple(torch.split(x, [int(s) for s in sizes], dim=axis))


def _trilu(node, opset, x, k=None):
    kk = int(k.reshape(()).item()) if k is not None else 0
    return torch.triu(x, kk) if int(node.attrs.get("upper", 1)) else torch.tril(x, kk)


MOVEMENT: dict[str, Callable] = {
    "Reshape": _reshape, "Transpose": _transpose, "Unsqueeze": _unsqueeze, "Squeeze": _squeeze,
    "Flatten": _flatten, "Identity": _identity, "Dropout": _identity, "Expand": _expand,
    "Slice": _slice, "Split": _split, "Trilu": _trilu,
}


def exact(fn: Callable) -> Callable:
    """Mark a rule whose result only moves or selects bounds of its inputs (no float64
    arithmetic): the dispatcher checks it but does not round it outward."""
    fn.exact = True
    return fn


def _movement_rule(op: str) -> Callable:
    fn = MOVEMENT[op]

    def rule(ctx: RuleCtx, x, *rest):
        box = cache.lift(ctx, x)
        others = [r.value if isinstance(r, Concrete) else r for r in rest]
        if any(isinstance(r, Box) for r in others):
            raise BoundError(f"{op} node {ctx.node.name!r}: shape/axes inputs must be constant")
        outs = [fn(ctx.node, ctx.opset, p, *others) for p in box.parts()]
        if isinstance(outs[0], tuple):
            return tuple(Box(*(o[j].contiguous() for o in outs)) for j in range(len(outs[0])))
        return Box(*(o.contiguous() for o in outs))
    rule.__doc__ = f"{op}: exact data movement, the same map on every bound."
    rule.__name__ = op.lower()
    return exact(rule)


for _op in MOVEMENT:
    bound_rule(_op, domain=Interval)(_movement_rule(_op))


_CAST_FORMATS = {1: "fp32", 10: "fp16", 11: "fp64", 16: "bf16"}


def _contains(big: Format, small: Format) -> bool:
    """Whether every value of ``small`` is a value of ``big``."""
    return big.name == "fp64" or (big.mantissa_bits >= small.mantissa_bits
                                  and big.exponent_bits >= small.exponent_bits)


def cast_target(ctx: RuleCtx) -> Format:
    """The float format a Cast node converts to (a cast to a non-float type is refused)."""
    to = int(ctx.attr("to", 1))
    if to not in _CAST_FORMATS:
        raise BoundError(f"Cast node {ctx.node.name!r}: cast of a bounded float tensor to a "
                         f"non-float type ({to}) is not supported")
    return get_format(_CAST_FORMATS[to])


def cast_is_exact(spec: KernelSpec, target: Format) -> bool:
    """Whether the Cast to ``target`` is the identity on ``spec``'s compute-format values."""
    return _contains(target, spec.compute)


def _round_to(fmt: Format, lo: torch.Tensor, hi: torch.Tensor, rounding: str
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Image of [lo, hi] under a rounding into ``fmt`` (nearest-even: monotone, so [Q(lo),
    Q(hi)], beyond the range +-inf as IEEE's overflow; any direction: a neighbour, within one
    spacing 2u|v| + 2 eta), and the bound on |Q(v) - v| (inf where it may overflow)."""
    from kcverify.bounds.casts import rne

    if fmt.name == "fp64":
        return lo, hi, torch.zeros_like(lo)
    m = fmt.max_finite
    if rounding == "nearest":
        q_lo, q_hi = rne(lo, fmt), rne(hi, fmt)
        e = fmt.u * mag(lo, hi) + fmt.eta
    else:
        e = 2 * (fmt.u * mag(lo, hi) + fmt.eta)
        q_lo, q_hi = pad_lo(lo - 2 * fmt.u * lo.abs() - 2 * fmt.eta), pad_hi(hi + 2 * fmt.u * hi.abs()
                                                                             + 2 * fmt.eta)
        # a neighbour of a value within the range is within it; beyond it, inf
        q_lo = torch.where(q_lo < -m, torch.where(lo < -m, -math.inf, -m), q_lo)
        q_hi = torch.where(q_hi > m, torch.where(hi > m, math.inf, m), q_hi)
    over = (torch.isinf(q_lo) & torch.isfinite(lo)) | (torch.isinf(q_hi) & torch.isfinite(hi))
    e = torch.where(over, math.inf, pad_hi(e, 1e-12))
    return q_lo, q_hi, e


def cast_image(spec: KernelSpec, target: Format, lo: torch.Tensor, hi: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One kernel's Cast of its values in [lo, hi] to ``target``: rounded into ``target`` (the
    spec's cast rounding), then stored in the compute format (nearest) unless that holds every
    ``target`` value. Returns the value set and the bound on |result - v| (inf on overflow)."""
    if cast_is_exact(spec, target):
        return lo, hi, torch.zeros_like(lo)
    q_lo, q_hi, e = _round_to(target, lo, hi, spec.rounding)
    if not _contains(spec.compute, target):
        q_lo, q_hi, e2 = _round_to(spec.compute, q_lo, q_hi, "nearest")
        e = e + e2
    return q_lo, q_hi, e


@bound_rule("Cast", domain=Interval)
def cast(ctx: RuleCtx, x) -> Box:
    """Cast of a float tensor to a float type (a cast to an integer type is refused). A program
    executing the graph rounds there (onnxruntime's fp32 Cast(fp16) -> Cast(fp32) does): each
    kernel's value is the round-to-nearest-even image in the target format (any neighbour with
    ``rounding: any``), +-inf beyond its range, then stored in the kernel's compute format; the
    identity where the target holds every compute-format value. Drift: the input's plus both
    casts' errors."""
    target = cast_target(ctx)
    b = ctx.lift(x)
    if cast_is_exact(ctx.train, target) and cast_is_exact(ctx.inf, target):
        return b
    tl, th, et = cast_image(ctx.train, target, b.tl, b.th)
    il, ih, ei = cast_image(ctx.inf, target, b.il, b.ih)
    return Box.make(tl, th, il, ih, b.dl - et - ei, b.dh + et + ei)


@bound_rule("Gather", domain=Interval)
@exact
def gather(ctx: RuleCtx, data, indices) -> Box:
    """Gather with constant indices: exact selection."""
    if not isinstance(indices, Concrete):
        raise BoundError(f"Gather node {ctx.node.name!r}: indices must be exact (token ids), "
                         f"not a bounded tensor")
    box = cache.lift(ctx, data)
    return box.map(lambda t: _gather(ctx.node, ctx.opset, t, indices.value))


@bound_rule("Concat", domain=Interval)
@exact
def concat(ctx: RuleCtx, *xs) -> Box:
    """Concatenation along ``axis``."""
    boxes = [cache.lift(ctx, x) for x in xs if x is not None]
    axis = int(ctx.attr("axis", 0)) % len(boxes[0].shape)
    return Box(*(torch.cat([b.parts()[k] for b in boxes], dim=axis) for k in range(6)))


@bound_rule("Where", domain=Interval)
@exact
def where(ctx: RuleCtx, cond, x, y) -> Box:
    """Where with an exact condition (e.g. a causal mask): selection, no rounding."""
    if not isinstance(cond, Concrete):
        raise BoundError(f"Where node {ctx.node.name!r}: the condition must be exact")
    c = cond.value.to(torch.bool)
    bx, by = cache.lift(ctx, x), cache.lift(ctx, y)
    return Box(*(torch.where(c.to(a.device), a, b) for a, b in zip(bx.parts(), by.parts())))


# --- exact evaluation of all-concrete nodes ----------------------------------------------
def _register_movement_concrete() -> None:
    for op, fn in MOVEMENT.items():
        def ev(node, opset, *vals, fn=fn):
            out = fn(node, opset, *vals)
            return out if isinstance(out, tuple) else (out,)
        CONCRETE_OPS[op] = ev


_register_movement_concrete()


@concrete_op("Shape")
def _c_shape(node, opset, x):
    dims = list(x.shape)
    start = int(node.attrs.get("start", 0))
    end = node.attrs.get("end")
    dims = dims[start:] if end is None else dims[start:int(end)]
    return (torch.tensor(dims, dtype=torch.int64),)


@concrete_op("Size")
def _c_size(node, opset, x):
    return (torch.tensor(x.numel(), dtype=torch.int64),)


@concrete_op("Range")
def _c_range(node, opset, start, limit, delta):
    return (torch.arange(start.item(), limit.item(), delta.item(), dtype=start.dtype),)


@concrete_op("ConstantOfShape")
def _c_cos(node, opset, shape):
    v = node.attrs.get("value")
    val = torch.as_tensor(np.asarray(v)).reshape(-1)[0] if v is not None else torch.tensor(0.0)
    return (torch.full(_ints(shape), val.item(), dtype=val.dtype),)


@concrete_op("Constant")
def _c_constant(node, opset):
    for key in ("value", "value_float", "value_floats", "value_int", "value_ints"):
        if key in node.attrs:
            return (torch.as_tensor(np.array(node.attrs[key])),)
    raise BoundError(f"Constant node {node.name!r}: unsupported attribute {list(node.attrs)}")


@concrete_op("Cast")
def _c_cast(node, opset, x):
    return (x.to(_ONNX_TO_TORCH.get(int(node.attrs.get("to", 1)), torch.float32)),)


@concrete_op("Gather")
def _c_gather(node, opset, x, idx):
    return (_gather(node, opset, x, idx),)


@concrete_op("Concat")
def _c_concat(node, opset, *xs):
    axis = int(node.attrs.get("axis", 0))
    return (torch.cat([x for x in xs if x is not None], dim=axis),)


@concrete_op("Where")
def _c_where(node, opset, c, x, y):
    return (torch.where(c.to(torch.bool), x, y),)


@concrete_op("Not")
def _c_not(node, opset, x):
    return (torch.logical_not(x),)


def _binary(fn: Callable) -> Callable:
    def ev(node, opset, a, b):
        return (fn(a, b),)
    return ev


for _op, _fn in {"Equal": torch.eq, "Less": torch.lt, "Greater": torch.gt,
                 "LessOrEqual": torch.le, "GreaterOrEqual": torch.ge, "And": torch.logical_and,
                 "Or": torch.logical_or}.items():
    CONCRETE_OPS[_op] = _binary(_fn)

# arithmetic on constants: evaluated in float64 (ints exactly); a realization may round it
ARITH_CONCRETE: dict[str, Callable] = {
    "Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Div": None, "Pow": torch.pow,
    "Max": torch.maximum, "Min": torch.minimum,
}


def _c_arith(op: str) -> Callable:
    def ev(node, opset, a, b):
        if a.is_floating_point() or b.is_floating_point():
            a64, b64 = a.to(torch.float64), b.to(torch.float64)
            out = a64 / b64 if op == "Div" else ARITH_CONCRETE[op](a64, b64)
            return (out,)
        if op == "Div":
            return (torch.div(a, b, rounding_mode="trunc"),)
        return (ARITH_CONCRETE[op](a, b),)
    return ev


for _op in ARITH_CONCRETE:
    CONCRETE_OPS[_op] = _c_arith(_op)


def _unary(fn: Callable) -> Callable:
    def ev(node, opset, a):
        return (fn(a.to(torch.float64)) if a.is_floating_point() else fn(a),)
    return ev


for _op, _fn in {"Sqrt": torch.sqrt, "Neg": torch.neg, "Exp": torch.exp, "Reciprocal": torch.reciprocal,
                 "Abs": torch.abs, "Relu": torch.relu, "Tanh": torch.tanh, "Erf": torch.erf}.items():
    CONCRETE_OPS[_op] = _unary(_fn)

# which concrete ops compute new float values (a realization may round their results)
ROUNDING_CONCRETE = set(ARITH_CONCRETE) | {"Sqrt", "Exp", "Reciprocal", "Tanh", "Erf"}


@bound_rule("CastLike", domain=Interval)
def cast_like(ctx: RuleCtx, x, like) -> Box | Concrete:
    """CastLike to a float tensor's type: a constant stays exact (lifted where it meets a rule),
    a bounded float tensor is unchanged (as Cast)."""
    if isinstance(x, Concrete):
        return Concrete(x.value.to(torch.float64) if x.value.is_floating_point() or x.value.dtype != torch.bool
                        else x.value, x.rounds)
    return ctx.lift(x)
