"""Data movement (exact in both kernels: the same map applied to all six bounds) and the exact
evaluation of ops whose inputs are all concrete (shapes, indices, masks, constant folding).

ONNX semantics are written once, in the executor (kcverify/models/ops): every rule here applies
the executor's own op function (``executor_op``), to each bound of a box for movement and
selection (a monotone map: the image of [lo, hi] is [f(lo), f(hi)] element by element, exactly,
as jax_verify binds a primitive on lower and upper), or to the exact values of concrete inputs.
Attributes come from the node, their defaults from the op's ONNX schema (onnx.defs); a rule
handles exactly the attributes its executor function takes (``handled_attributes``), and a node
with any other attribute is refused with a BoundError naming the node and the attribute.

Concrete float results of arithmetic carry ``rounds + 1``: a realization may round them to its
compute format (RuleCtx.lift widens them accordingly). Concrete arithmetic runs in float64 (ints
exactly); results of exact ops (movement, selection, comparisons, casts) that are fp32 values are
returned as float32, so ``lift`` keeps them exact.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from kcverify.bounds.box import Box, Concrete, mag, pad_hi, pad_lo
from kcverify.bounds.registry import CONCRETE_OPS, EXECUTOR, Interval, RuleCtx, bound_rule
from kcverify.bounds.rules import cache
from kcverify.errors import BoundError
from kcverify.kernels.formats import Format, get_format
from kcverify.kernels.spec import KernelSpec
from kcverify.models.ir import Node


# --- the executor's op functions, with the schema's attribute defaults -----------------------
def schema_defaults(op: str, opset: int, domain: str = "") -> dict[str, Any]:
    """The ONNX schema's default value of every attribute of ``op`` at ``opset`` that has one
    (onnx.defs; an op the schema does not know has none). Read once per (op, opset, domain)."""
    return _schema_defaults(op, int(opset), domain or "")


@functools.cache
def _schema_defaults(op: str, opset: int, domain: str) -> dict[str, Any]:
    import onnx.defs

    from kcverify.models.ir import _attr_value

    try:
        schema = onnx.defs.get_schema(op, opset, domain)
    except onnx.defs.SchemaError:
        return {}
    return {name: _attr_value(a.default_value) for name, a in schema.attributes.items()
            if a.default_value.name}


def _impl(node: Node, opset: int) -> Any:
    from kcverify.models.ops import lookup

    impl = lookup(node.op_type, node.domain or "", opset)
    if impl is None:
        raise BoundError(f"{node.op_type} node {node.name!r} (opset {opset}): the executor has no "
                         f"implementation to evaluate it with")
    return impl


def handled_attributes(op: str, opset: int, domain: str = "") -> frozenset[str]:
    """The attributes the rule of ``op`` handles: those its executor function takes."""
    from kcverify.models.ops import lookup

    impl = lookup(op, domain, opset)
    return frozenset() if impl is None else impl.attrs


def attributes(node: Node, opset: int) -> dict[str, Any]:
    """The node's attributes as keyword arguments of its executor function: the schema's
    defaults overlaid by the node's own; an attribute the function does not handle is a
    BoundError naming the node and the attribute."""
    impl = _impl(node, opset)
    unknown = sorted(a for a in node.attrs if a not in impl.attrs)
    if unknown:
        raise BoundError(f"{node.op_type} node {node.name!r} (opset {opset}): attribute "
                         f"{', '.join(repr(a) for a in unknown)} is not handled by its bound rule "
                         f"(handled: {', '.join(sorted(impl.attrs)) or 'none'})")
    kw = {k: v for k, v in schema_defaults(node.op_type, opset, node.domain).items()
          if k in impl.attrs}
    kw.update({k: list(v) if isinstance(v, tuple) else v for k, v in node.attrs.items()})
    return kw


def executor_op(node: Node, opset: int, *inputs: Any, dtype: torch.dtype = torch.float64
                ) -> tuple[torch.Tensor, ...]:
    """The executor's op function for ``node`` applied to ``inputs`` (tensors or None), with the
    exact arithmetic and float tensors held in ``dtype``; one tensor per node output."""
    from kcverify.models.arith import Exact
    from kcverify.models.ops import OpContext

    impl = _impl(node, opset)
    kw = attributes(node, opset)
    dev = next((x.device for x in inputs if isinstance(x, torch.Tensor)), torch.device("cpu"))
    octx = OpContext(node, opset, Exact(), dtype, dev,
                     tuple("activations" for _ in node.inputs), True,
                     tuple(_np_dtype(x) for x in inputs))
    out = impl.fn(octx, *inputs, **kw)
    outs = tuple(out) if isinstance(out, tuple | list) else (out,)
    return outs[:max(1, len(node.outputs))]


def _np_dtype(x: Any) -> str | None:
    if not isinstance(x, torch.Tensor):
        return None
    return {torch.float64: "float64", torch.float32: "float32", torch.float16: "float16",
            torch.bfloat16: "bfloat16"}.get(x.dtype, str(x.dtype).removeprefix("torch."))


def _apply(op_node: Node, opset: int, x: torch.Tensor, *rest: Any) -> Any:
    """``fn(node, opset, x, *other_inputs)``: one tensor, or a tuple for several outputs."""
    outs = executor_op(op_node, opset, x, *rest, dtype=x.dtype if x.is_floating_point()
                       else torch.float64)
    return outs[0] if len(outs) == 1 else outs


# Movement: a selection or rearrangement of the elements of input 0 (the other inputs are
# shapes, axes, indices), applied with the same map to every bound and to every generator row
# of a zonotope form (zonotope.py reads this table).
MOVEMENT_OPS = ("Reshape", "Transpose", "Unsqueeze", "Squeeze", "Flatten", "Identity", "Dropout",
                "Expand", "Slice", "Split", "Trilu")
MOVEMENT: dict[str, Callable] = {op: _apply for op in MOVEMENT_OPS}


def _gather(node: Node, opset: int, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return _apply(node, opset, x, idx)


def exact(fn: Callable) -> Callable:
    """Mark a rule whose result only moves or selects bounds of its inputs (no float64
    arithmetic): the dispatcher checks it but does not round it outward."""
    fn.exact = True
    return fn


def _bounds_map(ctx: RuleCtx, ins: tuple, box_at: tuple[int, ...]) -> tuple[Box, ...]:
    """The executor's op applied to bound k of every input at ``box_at`` (k = 0..5) with the
    other inputs as exact values: the image of a monotone selection, exactly."""
    boxes = {j: cache.lift(ctx, ins[j]) for j in box_at if j < len(ins) and ins[j] is not None}
    for j, x in enumerate(ins):
        if j not in boxes and isinstance(x, Box):
            raise BoundError(f"{ctx.node.op_type} node {ctx.node.name!r}: input {j} must be "
                             f"exact (a shape, axes, indices or a condition), not a bounded tensor")
    parts = []
    for k in range(6):
        args = [boxes[j].parts()[k] if j in boxes else (x.value if isinstance(x, Concrete) else x)
                for j, x in enumerate(ins)]
        parts.append(executor_op(ctx.node, ctx.opset, *args))
    n_out = 1 if ctx.node.op_type == "Dropout" else len(parts[0])
    return tuple(Box(*(parts[k][j].contiguous() for k in range(6))) for j in range(n_out))


def _movement_rule(op: str, box_at: tuple[int, ...] | None = None) -> Callable:
    def rule(ctx: RuleCtx, *ins):
        at = box_at if box_at is not None else tuple(range(len(ins)))
        outs = _bounds_map(ctx, ins, at)
        if op == "Dropout" and len([o for o in ctx.node.outputs if o]) > 1:
            return outs[0], Concrete(torch.ones(outs[0].shape, dtype=torch.bool))
        return outs if len(outs) > 1 else outs[0]
    rule.__doc__ = (f"{op}: the executor's {op} applied to every bound (exact movement or "
                    f"selection).")
    rule.__name__ = op.lower()
    return exact(rule)


# input positions holding bounded data (the others must be exact): None = every input
_BOX_INPUTS: dict[str, tuple[int, ...] | None] = {op: (0,) for op in MOVEMENT_OPS}
_BOX_INPUTS.update({"Gather": (0,), "Concat": None, "Where": (1, 2)})
for _op, _at in _BOX_INPUTS.items():
    bound_rule(_op, domain=Interval, attrs=EXECUTOR)(_movement_rule(_op, _at))


_CAST_FORMATS = {1: "fp32", 10: "fp16", 11: "fp64", 16: "bf16"}
_TORCH_FORMATS = {torch.float32: "fp32", torch.float16: "fp16", torch.float64: "fp64",
                  torch.bfloat16: "bf16"}


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


@bound_rule("Cast", domain=Interval, attrs=("to", "saturate"))
def cast(ctx: RuleCtx, x) -> Box:
    """Cast of a float tensor to a float type (a cast to an integer type is refused). A program
    executing the graph rounds there (onnxruntime's fp32 Cast(fp16) -> Cast(fp32) does): each
    kernel's value is the round-to-nearest-even image in the target format (any neighbour with
    ``rounding: any``), +-inf beyond its range, then stored in the kernel's compute format; the
    identity where the target holds every compute-format value. Drift: the input's plus both
    casts' errors."""
    return _cast_box(ctx, ctx.lift(x), cast_target(ctx))


def _cast_box(ctx: RuleCtx, b: Box, target: Format) -> Box:
    """Both kernels' casts of ``b`` to ``target`` (the Cast rule's semantics)."""
    if cast_is_exact(ctx.train, target) and cast_is_exact(ctx.inf, target):
        return b
    tl, th, et = cast_image(ctx.train, target, b.tl, b.th)
    il, ih, ei = cast_image(ctx.inf, target, b.il, b.ih)
    return Box.make(tl, th, il, ih, b.dl - et - ei, b.dh + et + ei)



# --- exact evaluation of all-concrete nodes ----------------------------------------------
# Ops evaluated exactly, by the executor's function, when every input is concrete; those in
# ROUNDING_CONCRETE compute new float values (a realization may round them).
ROUNDING_CONCRETE = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum", "Mod",
                               "Sqrt", "Exp", "Log", "Reciprocal", "Tanh", "Erf", "Sigmoid",
                               "Sin", "Cos", "Range"})
EXACT_CONCRETE = frozenset({*MOVEMENT_OPS, "Shape", "Size", "Constant", "ConstantOfShape", "Cast",
                            "Gather", "GatherElements", "GatherND", "Concat", "Tile",
                            "Where", "Not", "And", "Or", "Xor", "Equal", "Less", "Greater",
                            "LessOrEqual", "GreaterOrEqual", "IsNaN", "IsInf", "Neg", "Abs",
                            "Relu", "Sign", "Floor", "Ceil", "Round", "Clip"})


def _concrete(node: Node, opset: int, *vals: Any) -> tuple[torch.Tensor, ...]:
    """Exact evaluation: floats in float64; an exact op's fp32 values back as float32."""
    f32 = all(v is None or not v.is_floating_point() or v.dtype in (torch.float32, torch.float16,
                                                                       torch.bfloat16)
              for v in vals)
    args = [v.to(torch.float64) if v is not None and v.is_floating_point() else v for v in vals]
    outs = executor_op(node, opset, *args)
    if node.op_type in ROUNDING_CONCRETE:
        return outs
    return tuple(_narrow(o) if f32 or node.op_type in ("Constant", "ConstantOfShape", "Cast")
                 else o for o in outs)


def _narrow(v: torch.Tensor) -> torch.Tensor:
    """A float64 tensor of fp32 values as float32 (lift then keeps it exact), else itself."""
    if v.dtype != torch.float64:
        return v
    v32 = v.to(torch.float32)
    same = (v32.to(torch.float64) == v) | (torch.isnan(v) & torch.isnan(v32))
    return v32 if bool(same.all()) else v


for _op in ROUNDING_CONCRETE | EXACT_CONCRETE:
    CONCRETE_OPS[_op] = _concrete


@bound_rule("CastLike", domain=Interval, attrs=("saturate",))
def cast_like(ctx: RuleCtx, x, like) -> Box | Concrete:
    """CastLike(x, like) is Cast(x, to = like's element type): every program rounds there. The
    engine's expansion rewrites a CastLike whose ``like`` has a declared type into that Cast
    (decompose.expand); this rule sees the rest, whose type is known only from a constant
    ``like``. A computed ``like`` of undeclared type is refused (its type decides the rounding)."""
    fmt = _TORCH_FORMATS.get(like.value.dtype) if isinstance(like, Concrete) else None
    if fmt is None:
        raise BoundError(f"CastLike node {ctx.node.name!r}: the element type of input 'like' is "
                         "not declared in the graph (nor a float constant's); expected a float "
                         "type to cast to")
    if isinstance(x, Concrete) and x.rounds == 0:  # exact: every program rounds it alike
        v = x.value if x.value.is_floating_point() else x.value.to(torch.float64)
        return Concrete(v.to(like.value.dtype).to(torch.float64))
    return _cast_box(ctx, ctx.lift(x), get_format(fmt))
