"""One table of bound rules, keyed by (op type, domain name); the domains; what a rule receives.

    @rule("Softmax", domain=INTERVAL, attrs=("axis",))
    def softmax(ctx: RuleCtx, x: Box) -> Box: ...

A domain (``Domain``) is an abstraction of the set of (training, inference) value pairs a tensor
may hold: it is built from a box (``from_box``), concretised to one (``to_box``), met with a box
(``meet``), and it has one transfer function per op (``transfer(op)``: the rule registered for
(op, domain) in ``RULES``). Three domains exist: ``INTERVAL`` (differential intervals, a ``Box``
per tensor: every node has its rule), ``SYMBOLIC`` (differential symbolic intervals over the
block input, kcverify/bounds/linear.py) and ``ZONOTOPE`` (the differential zonotope,
kcverify/bounds/zonotope.py). The engine runs a tuple of them as one product (engine.run_graph):
the interval rule first, then each relational rule from its own state and the box so far, its
result concretised and met with that box.

Rule signatures, per domain (the dispatcher, not the rule, checks shapes, NaN and lo <= hi):

* interval: ``fn(ctx, *ins) -> state | tuple``, ``ins`` a ``Box`` (abstract float tensor), a
  ``Concrete`` (exact values shared by both kernels) or None (an omitted optional input);
* symbolic: ``fn(ctx, ins, out, m) -> LinState | None``, ``ins`` (orig, Box | None,
  LinState | None) per input, ``out`` the box so far, ``m`` the number of symbols;
* zonotope: ``fn(zt, ctx, states, boxes, results) -> ZState | tuple | None`` (ZonoTrack.step).

A relational rule returns None where it does not apply: the node keeps its box. Every rule
declares the node attributes it handles (``attrs``); the dispatcher refuses a node that carries
any other attribute, or a value the rule does not handle, with a BoundError naming the node, the
op and the attribute (``check_attributes``). Ops evaluated exactly when every input is concrete
live in ``CONCRETE_OPS`` (shape.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from kcverify.bounds.box import Box, Concrete, meet_hi, meet_lo, pad_hi, pad_lo, round_bounds
from kcverify.errors import BoundError
from kcverify.kernels.spec import KernelSpec
from kcverify.models.ir import Node

State = Box | Concrete | None
Rule = Callable[..., Any]
# the one table: (op type, domain name) -> rule
RULES: dict[tuple[str, str], Rule] = {}
CONCRETE_OPS: dict[str, Callable[..., Any]] = {}

# The attributes a rule handles: attribute name -> the values it handles (None: any value), or
# EXECUTOR: those the executor's own op function takes (rules/shape.handled_attributes), for
# rules that apply that function (movement, selection, Conv's geometry)
EXECUTOR = "executor"
AttrSpec = Mapping[str, Collection[Any] | None] | str
ATTRS: dict[tuple[str, str], AttrSpec] = {}


@runtime_checkable
class Domain(Protocol):
    """An abstract domain of the engine's product (module docstring)."""

    name: str

    def from_box(self, box: Box, *args: Any) -> Any:
        """The domain's state for every pair in ``box``."""

    def to_box(self, state: Any) -> Box:
        """The state concretised to a box (outward)."""

    def meet(self, box: Box, state: Any) -> Box:
        """``box`` intersected with the state's concretisation (never empty: both enclose the
        same set; where rounding makes them disjoint, the box is kept)."""

    def transfer(self, op: str) -> Rule | None:
        """The rule of ``op`` in this domain (None: the domain has none; the box stands)."""


class _TableDomain:
    """A domain whose transfer functions are the table's rules for (op, ``name``)."""

    name = ""

    def transfer(self, op: str) -> Rule | None:
        return RULES.get((op, self.name))

    def register(self, op: str, fn: Rule) -> None:
        RULES[(op, self.name)] = fn

    def __repr__(self) -> str:
        return f"<domain {self.name}>"


class IntervalDomain(_TableDomain):
    """The differential interval domain: a Box per tensor (train, inference and drift
    intervals). Its rules are the base of every product: each node has one."""

    name = "interval"

    def from_box(self, box: Box, *args: Any) -> Box:
        return box

    def to_box(self, state: Box) -> Box:
        return state

    def meet(self, box: Box, state: Box) -> Box:
        parts = []
        for lo, hi, slo, shi in ((box.tl, box.th, state.tl, state.th),
                                 (box.il, box.ih, state.il, state.ih),
                                 (box.dl, box.dh, state.dl, state.dh)):
            nlo, nhi = torch.maximum(lo, slo), torch.minimum(hi, shi)
            ok = nlo <= nhi
            parts += [torch.where(ok, nlo, lo), torch.where(ok, nhi, hi)]
        return Box(*parts)


class SymbolicDomain(_TableDomain):
    """Differential symbolic intervals over the block input's m symbols (linear.py): a LinState
    (affine forms of train, inference and drift, each with an interval term) per tensor."""

    name = "symbolic"

    def from_box(self, box: Box, *args: Any) -> Any:
        from kcverify.bounds.linear import from_box

        return from_box(box, int(args[0]))

    def to_box(self, state: Any) -> Box:
        return Box(*state.t.bounds(), *state.i.bounds(), *state.d.bounds())

    def meet(self, box: Box, state: Any) -> Box:
        from kcverify.bounds.linear import tighten

        return tighten(box, state)


class ZonotopeDomain(_TableDomain):
    """The differential zonotope (zonotope.py): a ZState (forms of train and inference over
    shared symbols) per tensor. zonotope.py registers its rules in the one table with ``rule``
    (through its ``zrule`` / ``_register``) when it is imported; a rule registered here is also
    written to ``ZRULES``, which ZonoTrack.step reads."""

    name = "zonotope"

    def from_box(self, box: Box, *args: Any) -> Any:
        from kcverify.bounds.zonotope import ZonoTrack

        track = args[0] if args else ZonoTrack()
        return track.from_box(box)

    def to_box(self, state: Any) -> Box:
        return Box(*state.t.bounds(), *state.i.bounds(), *state.drift_bounds())

    def meet(self, box: Box, state: Any) -> Box:
        from kcverify.bounds.zonotope import meet

        return meet(box, state)

    def register(self, op: str, fn: Rule) -> None:
        from kcverify.bounds.zonotope import ZRULES

        RULES[(op, self.name)] = fn
        ZRULES[op] = fn

    def sync(self) -> None:
        """Load zonotope.py, which registers its rules (once, on import)."""
        import kcverify.bounds.zonotope  # noqa: F401


# What each rule of zonotope.py reads of its node (zonotope._register declares them):
# movement and Gather apply the executor's op function
_GELU = {"approximate": ("none", "tanh")}
ZONOTOPE_ATTRS: dict[str, AttrSpec] = {
    "Cast": {"to": None, "saturate": None}, "Gather": EXECUTOR, "Concat": {"axis": None},
    "Gelu": _GELU, "Gemm": {"transA": None, "transB": None, "alpha": None, "beta": None},
    "LayerNormalization": {"axis": None, "epsilon": None, "stash_type": None},
    "Softmax": {"axis": None},
    **{op: EXECUTOR for op in ("Reshape", "Transpose", "Unsqueeze", "Squeeze", "Flatten",
                               "Identity", "Dropout", "Expand", "Slice", "Split", "Trilu")}}

INTERVAL = IntervalDomain()
SYMBOLIC = SymbolicDomain()
ZONOTOPE = ZonotopeDomain()
Interval = INTERVAL  # the name rule files use (``domain=Interval``)
DOMAINS: dict[str, Domain] = {d.name: d for d in (INTERVAL, SYMBOLIC, ZONOTOPE)}


def domain_of(domain: Domain | str) -> Any:
    """The registered domain object of ``domain`` (an object or its name)."""
    name = domain if isinstance(domain, str) else domain.name
    if name not in DOMAINS:
        raise ValueError(f"unknown domain {name!r}; expected one of {', '.join(DOMAINS)}")
    return DOMAINS[name]


def _attr_spec(attrs: AttrSpec | Collection[str]) -> AttrSpec:
    if isinstance(attrs, str):
        if attrs != EXECUTOR:
            raise ValueError(f"attrs must be a mapping, names or {EXECUTOR!r}, not {attrs!r}")
        return attrs
    if isinstance(attrs, Mapping):
        return {k: (None if v is None else tuple(v)) for k, v in attrs.items()}
    return {k: None for k in attrs}


def rule(*ops: str, domain: Domain | str = INTERVAL,
         attrs: AttrSpec | Collection[str] = ()) -> Callable[[Rule], Rule]:
    """Register ``fn`` as the rule of each of ``ops`` in ``domain`` (the one table, ``RULES``),
    handling the node attributes ``attrs`` (names, or name -> the values handled, or
    ``EXECUTOR``); a node with any other attribute is refused (``check_attributes``)."""
    d = domain_of(domain)
    spec = _attr_spec(attrs)

    def deco(fn: Rule) -> Rule:
        for op in ops:
            d.register(op, fn)
            ATTRS[(op, d.name)] = spec
        return fn

    return deco


def bound_rule(*ops: str, domain: Domain | str = INTERVAL,
               attrs: AttrSpec | Collection[str] = ()) -> Callable[[Rule], Rule]:
    """``rule`` (the name interval rules were registered with)."""
    return rule(*ops, domain=domain, attrs=attrs)


def linear_rule(*ops: str, attrs: AttrSpec | Collection[str] = ()) -> Callable[[Rule], Rule]:
    """``rule(..., domain=SYMBOLIC)``."""
    return rule(*ops, domain=SYMBOLIC, attrs=attrs)


def zrule(*ops: str, attrs: AttrSpec | Collection[str] = ()) -> Callable[[Rule], Rule]:
    """``rule(..., domain=ZONOTOPE)``."""
    return rule(*ops, domain=ZONOTOPE, attrs=attrs)


class RulesOf(Mapping[str, Rule]):
    """The table's rules of one domain, by op (a read-only view)."""

    def __init__(self, domain: str) -> None:
        self.domain = domain

    def __getitem__(self, op: str) -> Rule:
        return RULES[(op, self.domain)]

    def __iter__(self) -> Iterator[str]:
        return iter([op for (op, d) in RULES if d == self.domain])

    def __len__(self) -> int:
        return sum(1 for (_op, d) in RULES if d == self.domain)


def concrete_op(*ops: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register an exact evaluator ``fn(node, *values) -> tuple[Tensor, ...]`` (values exact)."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        for op in ops:
            CONCRETE_OPS[op] = fn
        return fn

    return deco


def registered(domain: str) -> list[str]:
    return sorted(op for (op, d) in RULES if d == domain)


def handled(op: str, domain: str, opset: int, node_domain: str = "") -> dict[str, Any]:
    """The attributes the rule of (``op``, ``domain``) handles: name -> values (None: any)."""
    spec = ATTRS.get((op, domain), {})
    if spec == EXECUTOR:
        from kcverify.bounds.rules.shape import handled_attributes

        return dict.fromkeys(handled_attributes(op, opset, node_domain))
    return dict(spec)


def check_attributes(node: Node, domain: str, opset: int) -> None:
    """Refuse a node carrying an attribute (or an attribute value) that its rule in ``domain``
    does not declare: one BoundError naming the node, the op and the attribute."""
    if not node.attrs:
        return
    ok = handled(node.op_type, domain, opset, node.domain or "")
    for name, value in node.attrs.items():
        if name not in ok:
            shown = ", ".join(sorted(ok)) or "none"
            raise BoundError(f"{node.op_type} node {node.name!r} (opset {opset}): attribute "
                             f"{name!r} is not handled by its {domain} bound rule (handled: "
                             f"{shown})")
        values = ok[name]
        if values is not None and _plain(value) not in values:
            raise BoundError(f"{node.op_type} node {node.name!r} (opset {opset}): attribute "
                             f"{name!r} = {_plain(value)!r} is not handled by its {domain} bound "
                             f"rule (handled values: {', '.join(repr(v) for v in values)})")
        # a bounded op's float attribute (a scale, a slope, an epsilon) is a finite number and
        # an epsilon is not negative: a NaN alpha makes every program's output NaN, a negative
        # epsilon may take a square root of a negative number; neither is bounded
        floats = [value] if isinstance(value, float) else (
            [v for v in value if isinstance(v, float)] if isinstance(value, (list, tuple)) else [])
        if not all(math.isfinite(v) for v in floats) or (name == "epsilon" and floats
                                                           and min(floats) < 0):
            raise BoundError(f"{node.op_type} node {node.name!r} (opset {opset}): attribute "
                             f"{name!r} = {_plain(value)!r}; expected a finite number"
                             f"{' >= 0' if name == 'epsilon' else ''}")


def _plain(v: Any) -> Any:
    return v.decode() if isinstance(v, bytes) else v


@dataclass
class RuleCtx:
    """What a rule may use: the node, both kernel specs, the graph's constant names."""

    node: Node
    train: KernelSpec
    inf: KernelSpec
    constants: set[str]
    opset: int = 17
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # the sample axis of every tensor (kcverify.models.blocks.sample_axes) and the number of
    # samples; without them a dynamic per-sample scale ranges over the whole operand's amax
    sample_axes: Mapping[str, Any] | None = None
    batch: int | None = None

    @property
    def kernels(self) -> tuple[KernelSpec, KernelSpec]:
        return (self.train, self.inf)

    def sample_axis(self, index: int) -> Any:
        """The sample axis of the node's input ``index`` (an axis, None: the same for every
        sample, or "unknown")."""
        name = self.node.inputs[index] if index < len(self.node.inputs) else ""
        if self.sample_axes is None or not name:
            return "unknown"
        return self.sample_axes.get(name, "unknown")

    def attr(self, name: str, default: Any = None) -> Any:
        return self.node.attrs.get(name, default)

    # --- rounding model of semantics §1.1 ---------------------------------------------------
    def rel(self, spec: KernelSpec, prim: str) -> float:
        """Relative error of one primitive of ``spec``: ulps * u_compute."""
        return spec.ulp(prim) * spec.compute.u

    def round(self, spec: KernelSpec, prim: str | None, lo: torch.Tensor, hi: torch.Tensor,
              steps: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Value set after ``steps`` roundings of ``prim`` into the compute format, and the
        magnitude bound of the error: v' in [v - e(v), v + e(v)], e(v) = r|v| + eta (plus the
        primitive's absolute error, KernelSpec.abs_err: sigmoid, tanh), applied ``steps`` times. Beyond max_finite the result may be inf: bounds become infinite."""
        if prim is None:  # a selection (ReLU, max): the exact value is representable
            return lo, hi, torch.zeros_like(lo)
        r = (1 + self.rel(spec, prim)) ** steps - 1
        eta = (spec.compute.eta + spec.abs_err(prim)) * steps * (1 + r)
        return round_bounds(lo, hi, r, eta, spec.compute.max_finite)

    def lift(self, x: State) -> Box:
        """A Concrete float value as a box: exact in both kernels up to the rounding steps a
        realization may have applied while computing it (``rounds``); exactly representable
        data (rounds == 0) may still be stored in the compute format, so each kernel's value is
        the hull of c and its compute-format neighbours (relative u)."""
        if isinstance(x, Box):
            return x
        if x is None:
            raise ValueError("missing input")
        c = x.value.to(self.device, torch.float64)
        parts = []
        for spec in self.kernels:
            if spec.compute.name == "fp64" or (x.rounds == 0 and spec.compute.u <= 2.0**-24
                                               and _is_f32(x.value)):
                lo, hi = c, c
            else:
                lo, hi, _ = self.round(spec, "add", c, c, steps=max(x.rounds, 1))
            parts += [lo, hi]
        finite = torch.isfinite(c)
        dl, dh = parts[2] - parts[1], parts[3] - parts[0]
        dl = torch.where(finite, dl, torch.zeros_like(c))
        dh = torch.where(finite, dh, torch.zeros_like(c))
        return Box(parts[0], parts[1], parts[2], parts[3], pad_lo(dl), pad_hi(dh))

    def elementwise(self, x: Box, f: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                    df: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None,
                    prim: str | None, steps: int = 1) -> Box:
        """Unary op: each kernel's value f([lo, hi]) then rounded; drift by the mean-value
        theorem f(x_i) - f(x_t) in f'(hull) * [dl, dh], plus both rounding errors, intersected
        with the difference of the value sets."""
        from kcverify.bounds.box import imul

        ft_lo, ft_hi = f(x.tl, x.th)
        fi_lo, fi_hi = f(x.il, x.ih)
        tl, th, et = self.round(self.train, prim, ft_lo, ft_hi, steps)
        il, ih, ei = self.round(self.inf, prim, fi_lo, fi_hi, steps)
        if df is not None:
            h_lo, h_hi = x.hull()
            g_lo, g_hi = df(h_lo, h_hi)
            dl, dh = imul(g_lo, g_hi, x.dl, x.dh)
            dl = meet_lo(dl, fi_lo - ft_hi) - et - ei
            dh = meet_hi(dh, fi_hi - ft_lo) + et + ei
            return Box.make(tl, th, il, ih, dl, dh)
        return Box.make(tl, th, il, ih)


def _is_f32(t: torch.Tensor) -> bool:
    return t.dtype in (torch.float32, torch.float16, torch.bfloat16)
