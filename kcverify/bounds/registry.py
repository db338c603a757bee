"""The table of bound rules, keyed by (op type, domain), and the context a rule receives.

    @bound_rule("Softmax", domain=Interval)
    def softmax(ctx: RuleCtx, x: Box) -> Box: ...

A rule receives the node's inputs as ``Box`` (abstract float tensors), ``Concrete`` (exact values
shared by both kernels) or None (omitted optional inputs), and returns one state per output.
The dispatcher (engine.py), not the rule, checks shapes, NaN and lo <= hi and rounds outward.
Ops evaluated exactly when every input is concrete live in ``CONCRETE_OPS`` (shape.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kcverify.bounds.box import Box, Concrete, meet_hi, meet_lo, pad_hi, pad_lo, round_bounds
from kcverify.kernels.spec import KernelSpec
from kcverify.models.ir import Node


class Interval:
    """The differential interval domain (DiffBox per tensor)."""

    name = "interval"


DOMAINS: dict[str, type] = {"interval": Interval}

State = Box | Concrete | None
Rule = Callable[..., Any]
RULES: dict[tuple[str, str], Rule] = {}
CONCRETE_OPS: dict[str, Callable[..., Any]] = {}


def bound_rule(*ops: str, domain: type = Interval) -> Callable[[Rule], Rule]:
    """Register ``fn`` as the rule of ``ops`` in ``domain``."""

    def deco(fn: Rule) -> Rule:
        for op in ops:
            RULES[(op, domain.name)] = fn
        return fn

    return deco


def concrete_op(*ops: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register an exact evaluator ``fn(node, *values) -> tuple[Tensor, ...]`` (values exact)."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        for op in ops:
            CONCRETE_OPS[op] = fn
        return fn

    return deco


def registered(domain: str) -> list[str]:
    return sorted(op for (op, d) in RULES if d == domain)


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
        magnitude bound of the error: v' in [v - e(v), v + e(v)], e(v) = r|v| + eta, applied
        ``steps`` times. Beyond max_finite the result may be inf: bounds become infinite."""
        if prim is None:  # a selection (ReLU, max): the exact value is representable
            return lo, hi, torch.zeros_like(lo)
        r = (1 + self.rel(spec, prim)) ** steps - 1
        eta = spec.compute.eta * steps * (1 + r)
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
