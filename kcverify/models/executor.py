"""The torch executor: runs a graph IR on any device, batched, in one float dtype, with every
place where a kernel may err routed through an :class:`~kcverify.models.arith.Arithmetic`.

    ex = Executor(graph, device="cpu", dtype=torch.float32, arithmetic=None)   # None: Exact
    ex.check_supported()                # UnsupportedOpError listing every op without an impl
    outs = ex.run({"input_ids": ids})   # name -> tensor; keep=True returns every tensor

Float tensors are held in ``dtype`` (narrower formats appear only as exactly rounded values);
integer and boolean tensors keep their own type. The constant part of the graph (what
``graph.constant_names()`` lists: weights and what is computed from them alone) is folded once per
executor with the exact arithmetic: it is part of the weights, computed before any kernel runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kcverify.errors import KcverifyError, UnsupportedOpError
from kcverify.models.arith import Arithmetic, Exact
from kcverify.models.ir import Graph, Node
from kcverify.models.ops import OpContext, OpImpl, lookup, registered
from kcverify.models.ops._util import from_numpy

Feed = np.ndarray | torch.Tensor | int | float


class ExecutionError(KcverifyError):
    """A graph that cannot run on the given inputs (missing feed, wrong shape, failing node)."""


@dataclass
class _Step:
    node: Node
    impl: OpImpl
    ctx: OpContext
    attrs: dict[str, Any]


def unsupported_ops(graph: Graph) -> list[tuple[str, str, str]]:
    """(op_type, domain, node name) of every node with no implementation at the graph's opset,
    or with an attribute its implementation does not know."""
    missing = []
    for n in graph.nodes:
        impl = lookup(n.op_type, n.domain, _opset(graph, n.domain))
        if impl is None:
            missing.append((n.op_type, n.domain, n.name))
            continue
        unknown = sorted(a for a in n.attrs if a not in impl.attrs)
        if unknown:
            missing.append((f"{n.op_type} with attribute {', '.join(unknown)}", n.domain, n.name))
    return missing


def _opset(graph: Graph, domain: str) -> int:
    if domain in ("", "ai.onnx"):
        return graph.opset
    return graph.opsets.get(domain, 1)


def _attr_kwargs(node: Node) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in node.attrs.items()}


class Executor:
    """Evaluate ``graph`` with ``arithmetic`` (default: Exact) in ``dtype`` on ``device``."""

    def __init__(self, graph: Graph, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, arithmetic: Arithmetic | None = None) -> None:
        if not dtype.is_floating_point:
            raise ValueError(f"executor dtype must be a float dtype, not {dtype}")
        self.graph = graph
        self.device = torch.device(device)
        self.dtype = dtype
        self.arithmetic: Arithmetic = arithmetic if arithmetic is not None else Exact()
        self.exact = type(self.arithmetic) is Exact
        self.constant_names = graph.constant_names()
        self._steps: list[_Step] | None = None
        self._constants: dict[str, torch.Tensor] | None = None
        self._schedule: list[tuple[_Step, list[str]]] = []

    # --- support -------------------------------------------------------------------------
    def check_supported(self) -> None:
        """Raise UnsupportedOpError naming every unsupported op and node; nothing has run."""
        missing = unsupported_ops(self.graph)
        if missing:
            raise UnsupportedOpError(missing, registered(), what="executor")

    # --- preparation ---------------------------------------------------------------------
    def _prepare(self) -> list[_Step]:
        if self._steps is not None:
            return self._steps
        self.check_supported()
        g = self.graph
        steps: list[_Step] = []
        for n in g.nodes:
            impl = lookup(n.op_type, n.domain, _opset(g, n.domain))
            assert impl is not None  # check_supported passed
            roles = tuple("weights" if i and i in self.constant_names else "activations"
                          for i in n.inputs)
            dtypes = tuple(g.info(i).dtype if i else None for i in n.inputs)
            ctx = OpContext(n, _opset(g, n.domain), self.arithmetic, self.dtype, self.device,
                            roles, self.exact, dtypes)
            steps.append(_Step(n, impl, ctx, _attr_kwargs(n)))
        constants = self._fold_constants(steps)
        outputs = {v.name for v in g.outputs}
        last_use: dict[str, int] = {}
        for idx, s in enumerate(steps):
            for i in s.node.inputs:
                if i and i not in self.constant_names:
                    last_use[i] = idx
        # what runs per call (the constant part is folded), and what each step frees
        frees: dict[int, list[str]] = {}
        for name, idx in last_use.items():
            if name not in outputs:
                frees.setdefault(idx, []).append(name)
        self._schedule = [(s, frees.get(idx, [])) for idx, s in enumerate(steps)
                          if not all((not o) or o in constants for o in s.node.outputs)]
        self._constants = constants
        self._steps = steps
        return steps

    def _fold_constants(self, steps: list[_Step]) -> dict[str, torch.Tensor]:
        """Evaluate the constant part once, with exact arithmetic."""
        exact = Exact()
        env: dict[str, torch.Tensor] = {
            k: from_numpy(v, self.dtype, self.device) for k, v in self.graph.initializers.items()}
        for s in steps:
            outs = [o for o in s.node.outputs if o]
            if outs and all(o in self.constant_names for o in outs):
                ctx = OpContext(s.node, s.ctx.opset, exact, self.dtype, self.device, s.ctx.roles,
                                True, s.ctx.input_dtypes)
                self._eval(s, ctx, env)
        return env

    @property
    def constants(self) -> dict[str, torch.Tensor]:
        """Every constant tensor (initializers and folded constant subgraphs), in ``dtype``."""
        self._prepare()
        assert self._constants is not None
        return self._constants

    # --- running -------------------------------------------------------------------------
    def _feed(self, feeds: Mapping[str, Feed]) -> dict[str, torch.Tensor]:
        env: dict[str, torch.Tensor] = {}
        for vi in self.graph.inputs:
            if vi.name not in feeds:
                names = ", ".join(v.name for v in self.graph.inputs)
                raise ExecutionError(f"{self.graph.name}: missing input {vi.name!r} (inputs: {names})")
            raw = feeds[vi.name]
            t = raw if isinstance(raw, torch.Tensor) else (
                from_numpy(np.asarray(raw), self.dtype, self.device))
            t = t.to(self.device)
            declared = vi.dtype
            if declared is not None and (declared.startswith("float") or declared == "bfloat16"):
                t = self.arithmetic.graph_input(vi.name, t.to(self.dtype))
            elif declared is not None:
                t = t.to(getattr(torch, "bool" if declared == "bool" else declared))
            elif t.is_floating_point():
                t = t.to(self.dtype)
            if vi.shape is not None:
                # a static batch of 1 (as VNN-COMP networks declare) admits any batch
                if len(vi.shape) != t.dim() or any(
                        isinstance(d, int) and d != s and not (k == 0 and d == 1)
                        for k, (d, s) in enumerate(zip(vi.shape, t.shape))):
                    raise ExecutionError(
                        f"{self.graph.name}: input {vi.name!r} has shape {tuple(t.shape)}, "
                        f"expected {tuple(vi.shape)}")
            env[vi.name] = t
        return env

    def _eval(self, step: _Step, ctx: OpContext, env: dict[str, torch.Tensor]) -> None:
        n = step.node
        try:
            args = [env[i] if i else None for i in n.inputs]
            out = step.impl.fn(ctx, *args, **step.attrs)
        except KcverifyError:
            raise
        except Exception as e:  # noqa: BLE001 - any torch failure becomes one located line
            raise ExecutionError(f"node {n.name!r} ({n.op_type}): {type(e).__name__}: {e}") from e
        outs = out if isinstance(out, tuple | list) else (out,)
        for name, value in zip(n.outputs, outs):
            if name:
                env[name] = value

    def run(self, feeds: Mapping[str, Feed], keep: bool = False, grad: bool = False
            ) -> dict[str, torch.Tensor]:
        """Evaluate the graph. ``feeds`` maps each graph input to an array or tensor (extra names
        are ignored). Returns the graph outputs, or with ``keep`` every tensor (inputs,
        constants and intermediates). ``grad`` records torch's autograd graph (an arithmetic
        that attaches leaves to its results can then take gradients; kcverify.bounds.falsify)."""
        self._prepare()
        assert self._constants is not None
        env = dict(self._constants)
        env.update(self._feed(feeds))
        outputs = [v.name for v in self.graph.outputs]
        with torch.set_grad_enabled(grad):
            for s, frees in self._schedule:
                self._eval(s, s.ctx, env)
                if not keep:
                    for name in frees:
                        env.pop(name, None)
        if keep:
            return env
        return {o: env[o] for o in outputs}

    def __call__(self, feeds: Mapping[str, Feed], keep: bool = False) -> dict[str, torch.Tensor]:
        return self.run(feeds, keep)
