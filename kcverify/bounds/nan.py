"""NaN closure of a node's results (semantics §1.1, "Infinities and NaN").

A value set (-inf, inf) in a kernel means the value may be NaN there (the engine's convention:
``engine.infinite_drift`` gives such an element the drift (-inf, inf)). IEEE arithmetic carries a
NaN operand into its result, but a rule that bounds the finite values only (Sigmoid, Tanh, Erf
and HardSigmoid map any finite input into their range; Mul by a constant 0 reads 0 * x as 0)
returned a finite value set for a NaN-possible input: the NaN was lost and the drift came out
finite (finding F5 of session 9: fp16 overflow, inf - inf, Sigmoid: certified 1.001 for a NaN).

``close`` runs after every node, for every domain (after the relational runs' meet): where an
input of the node may be NaN in a kernel, the outputs it reaches may be NaN in that kernel, and
their value sets there become (-inf, inf). What "reaches" means:

* elementwise ops (``ELEMENTWISE``, their inputs broadcast to the output's shape): the output
  elements at the NaN-possible input elements' broadcast positions;
* every other op: the whole sample (the slice of the output along its sample axis) whose input
  sample holds a NaN-possible element, or the whole output where the sample axes are unknown.

This encloses IEEE propagation (a NaN reaches at most those elements) and is the identity where
no input may be NaN, so it costs nothing in the usual case. Ops that legitimately drop a NaN
(a Where whose constant condition never selects it, a Slice that skips it) are closed
conservatively: a sound over-approximation, only where a value may already be NaN.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kcverify.bounds.box import Box

ELEMENTWISE = frozenset({
    "Abs", "Acos", "Acosh", "Add", "Asin", "Asinh", "Atan", "Atanh", "Cast", "CastLike", "Ceil",
    "Celu", "Clip", "Cos", "Cosh", "Div", "Elu", "Erf", "Exp", "Floor", "Gelu", "HardSigmoid",
    "HardSwish", "Identity", "LeakyRelu", "Log", "Max", "Mean", "Min", "Mish", "Mul", "Neg",
    "Pow", "PRelu", "Reciprocal", "Relu", "Round", "Selu", "Sigmoid", "Sign", "Sin", "Sinh",
    "Softplus", "Softsign", "Sqrt", "Sub", "Sum", "Tan", "Tanh", "ThresholdedRelu", "Where",
})


def _nan_masks(b: Box) -> tuple[torch.Tensor, torch.Tensor]:
    inf = float("inf")
    return (b.tl == -inf) & (b.th == inf), (b.il == -inf) & (b.ih == inf)


def _int_axis(axes: Mapping[str, Any] | None, name: str) -> int | None:
    a = axes.get(name) if axes is not None and name else None
    return a if isinstance(a, int) and not isinstance(a, bool) else None


def _per_sample(mask: torch.Tensor, a: int | None, shape: tuple[int, ...],
                b: int | None) -> torch.Tensor:
    """The output mask (``shape``) of an input mask on a non-elementwise op: the whole sample."""
    out = torch.zeros(shape, dtype=torch.bool, device=mask.device)
    if a is None or b is None or mask.dim() == 0 or len(shape) == 0:
        return out | bool(mask.any())
    a, b = a % mask.dim(), b % len(shape)
    if mask.shape[a] != shape[b]:
        return out | bool(mask.any())
    flag = mask.movedim(a, 0).reshape(mask.shape[a], -1).any(1)
    view = [1] * len(shape)
    view[b] = shape[b]
    return out | flag.reshape(view)


def produced(results: list[Any]) -> list[Any]:
    """The NaN-possible masks (train, inf) of a node's interval results, before a relational
    run's meet: the meet intersects with forms that bound finite values only, so it would read
    (-inf, inf) as no information and drop the NaN (0 * inf made by the Mul rule, 0 / 0 by
    Div); ``close`` restores them."""
    out: list[Any] = []
    for r in results:
        if isinstance(r, Box):
            mt, mi = _nan_masks(r)
            out.append((mt, mi) if bool(mt.any()) or bool(mi.any()) else None)
        else:
            out.append(None)
    return out


def close(node: Any, ins: list[Any], results: list[Any], axes: Mapping[str, Any] | None,
          made: list[Any] | None = None) -> tuple[list[Any], list[int]]:
    """``results`` with the NaN-possible elements the inputs reach set to (-inf, inf) in their
    kernel (module doc), and those the node's own rule made (``made``, from ``produced``); and
    the indices of the outputs that changed (their relational forms, which bound finite values,
    must be dropped)."""
    boxed = [(name, _nan_masks(v)) for name, v in zip(node.inputs, ins) if isinstance(v, Box)]
    made = made or [None] * len(results)
    if not any(bool(m.any()) for _, ms in boxed for m in ms) and all(m is None for m in made):
        return results, []
    out, changed = list(results), []
    inf = float("inf")
    for k, (o, r) in enumerate(zip(node.outputs, results)):
        if not isinstance(r, Box):
            continue
        shape = r.shape
        reach = []
        for kern in (0, 1):
            m_out = torch.zeros(shape, dtype=torch.bool, device=r.tl.device)
            for name, ms in boxed:
                m = ms[kern]
                if not bool(m.any()):
                    continue
                if node.op_type in ELEMENTWISE:
                    try:
                        m_out = m_out | torch.broadcast_to(m, shape)
                        continue
                    except RuntimeError:  # not broadcastable to the output: the whole sample
                        pass
                m_out = m_out | _per_sample(m, _int_axis(axes, name), shape, _int_axis(axes, o))
            if k < len(made) and made[k] is not None:
                m_out = m_out | made[k][kern].expand(shape)
            reach.append(m_out)
        lo_t, hi_t, lo_i, hi_i = r.tl, r.th, r.il, r.ih
        new_t = reach[0] & ~((lo_t == -inf) & (hi_t == inf))
        new_i = reach[1] & ~((lo_i == -inf) & (hi_i == inf))
        if not (bool(new_t.any()) or bool(new_i.any())):
            continue
        ninf = torch.full_like(lo_t, -inf)
        pinf = torch.full_like(lo_t, inf)
        out[k] = Box(torch.where(reach[0], ninf, lo_t), torch.where(reach[0], pinf, hi_t),
                     torch.where(reach[1], ninf, lo_i), torch.where(reach[1], pinf, hi_i),
                     r.dl, r.dh)
        changed.append(k)
    return out, changed
