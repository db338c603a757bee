"""The bound engine: walk a graph (block by block) with the registered rules of a domain.

    res = certify_drift(graph, train_spec, inf_spec, feeds, region=None, domain="best")
    res.linf      # (batch,) certified max |z_inf - z_train| per input
    res.outputs   # name -> DiffBox
    res.blocks    # [BlockRecord(name, digest, method, in_state, out_state)]

One generic traversal (jax_verify's shape): a node whose inputs are all concrete is evaluated
exactly (CONCRETE_OPS); every other node is dispatched to RULES[(op, "interval")], and the
dispatcher checks the result (shape, NaN, lo <= hi) and rounds it outward; then each relational
domain of the run's product (``Method.domains``: symbolic, zonotope) runs its own rule from its
own state and the box so far, and its result, concretised, is met with that box. Before anything runs, every node
with neither is collected into one BoundError. Blocks come from kcverify.models.blocks.segment;
each block is bounded from the DiffBoxes of its inputs alone (``bound_block``), which is exactly
what the certificate checker re-runs, and memory stays flat in depth.

Methods (``METHODS``; the name is what a block record carries, and what the checker re-runs):
"interval" (differential intervals), "linear" (intervals, symbolic intervals over the region's
input variables (linear.py) and the zonotope; the whole graph as one block), "best" (the same
product on the segmenter's blocks, the zonotope for batches of at most ``ZONO_BEST_ROWS``),
"zonotope" (intervals and the zonotope), "separate" (the baseline: each kernel bounded on its own,
drift = difference of the value sets).
"""

from __future__ import annotations

import contextvars
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kcverify.bounds.box import F64, Box, Concrete, DiffBox, check_box, pad_check, pad_hi, pad_lo
from kcverify.bounds.nan import close as nan_close
from kcverify.bounds.nan import produced as nan_produced
from kcverify.bounds.registry import (
    CONCRETE_OPS,
    INTERVAL,
    RULES,
    SYMBOLIC,
    ZONOTOPE,
    RuleCtx,
    check_attributes,
    registered,
)
from kcverify.errors import BoundError, InputFileError, InternalError, KcverifyError
from kcverify.kernels.spec import KernelSpec
from kcverify.models.ir import Graph

DOMAIN_NAMES = ("interval", "linear", "best", "separate", "zonotope")
_RULE_MODULES = ("activation", "conv", "elementwise", "linear", "normalization", "qdq", "reduce",
                 "shape", "softmax")
_SHAPE_ONLY = frozenset({"Shape", "Size"})
_INT_DTYPES = ("int64", "int32", "int16", "int8", "uint8", "bool")


def load_rules() -> None:
    """Import every rule module once (each registers its rules by decorator)."""
    import importlib

    for m in _RULE_MODULES:
        importlib.import_module(f"kcverify.bounds.rules.{m}")
    ZONOTOPE.sync()  # the rules zonotope.py registers itself, into the one table


@dataclass(frozen=True)
class Region:
    """A set of inputs around each point: a box (L-inf ball) or an L2 ball of radius ``eps``
    in the model's float input space or in the embedding space (output of the embedding Gather).
    The interval domain encloses an L2 ball by its bounding box."""

    space: str = "input"
    norm: str = "linf"
    eps: float = 0.0

    def __post_init__(self) -> None:
        if self.space not in ("input", "embedding"):
            raise BoundError(f"region space must be 'input' or 'embedding', not {self.space!r}")
        if self.norm not in ("linf", "l2"):
            raise BoundError(f"region norm must be 'linf' or 'l2', not {self.norm!r}")
        if not (self.eps >= 0 and math.isfinite(self.eps)):
            raise BoundError(f"region eps must be a finite number >= 0, not {self.eps!r}")


@dataclass(frozen=True)
class Method:
    """What bounds a block: the domains of the product, in the order they run (the interval
    domain first: every node has its rule; then each relational domain, met with the box so
    far), and the blocks cut by default. ``name`` is what a block record carries and the checker
    re-runs (``Method.of``). A relational domain runs where it applies: the symbolic domain on
    a block with one non-point float input (its symbols), the zonotope on at most ``zono_rows``
    batch rows (None: any)."""

    name: str
    domains: tuple[str, ...]
    cut: str = "segments"
    separate: bool = False  # each kernel on its own: drift = difference of the value sets
    zono_rows: int | None = None

    def __str__(self) -> str:
        return self.name

    @staticmethod
    def of(method: Method | str) -> Method:
        """The method named ``method`` (a block record's ``method``, a ``--domain``)."""
        if isinstance(method, Method):
            return method
        if method not in METHODS:
            raise BoundError(f"unknown bound domain {method!r}; expected one of "
                             f"{', '.join(DOMAIN_NAMES)}")
        return METHODS[method]


@dataclass
class BlockRecord:
    """One block's certificate: for inputs in ``in_state``, outputs lie in ``out_state``.
    ``method``: the name of the Method that bounded it (``Method.of``)."""

    name: str
    digest: str
    method: str
    in_state: dict[str, DiffBox]
    out_state: dict[str, DiffBox]

    @property
    def method_value(self) -> Method:
        return Method.of(self.method)


@dataclass
class DriftResult:
    linf: np.ndarray
    outputs: dict[str, DiffBox]
    blocks: list[BlockRecord] = field(default_factory=list)
    seconds: float = 0.0
    domain: str = "interval"
    # per input: activation casts whose input enclosure straddles a rounding midpoint
    # (kcverify.bounds.diagnostics); None when the run did not count them
    unstable_casts: np.ndarray | None = None
    # the memory budget's decisions (bounds/memory.py): "method X needs ~N GB > budget M GB:
    # used Y", one per block bounded with a cheaper method than asked
    notes: list[str] = field(default_factory=list)


def refuse_second_graph(train: KernelSpec, inf: KernelSpec) -> None:
    """A kernel given as a second ONNX graph (``onnx:``, e.g. QDQ) is not the graph the engine
    walks: bounding it as the first graph under the plain spec would certify the wrong kernel.
    The joint graph of both (kcverify.bounds.qdq_graph.bound_problem) is what to bound."""
    for spec in (train, inf):
        if spec.onnx is not None:
            raise BoundError(f"kernel {spec.name!r} is given as a second ONNX graph "
                             f"({spec.onnx}); bound the joint graph of the model and that graph "
                             "(kcverify.bounds.qdq_graph.bound_problem), not the model alone")


def _rule_domain(domain: Method | str) -> str:
    """The domain whose rules every node needs (the product's first): the interval domain."""
    return Method.of(domain).domains[0]


def expanded(graph: Graph, domain: str) -> Graph:
    """The graph with rule-less ops replaced by their ONNX function bodies (decompose.py)."""
    from kcverify.bounds.decompose import expand, memo

    load_rules()
    rd = _rule_domain(domain)
    tag = ("expanded", rd, frozenset(RULES), frozenset(CONCRETE_OPS))  # what has_rule reads
    return memo(graph, tag, lambda: expand(
        graph, lambda n: (n.op_type, rd) in RULES or n.op_type in CONCRETE_OPS
        or n.op_type in _SHAPE_ONLY))


def check_rules(graph: Graph, domain: str, concrete_inputs: set[str]) -> None:
    """Raise one BoundError listing every node that has no rule (and no decomposition into ops
    that have one) and cannot be evaluated exactly. A graph that passed is remembered (per
    graph object, domain and concrete inputs; decompose.memo)."""
    from kcverify.bounds.decompose import memo

    load_rules()
    rd = _rule_domain(domain)
    tag = ("checked", rd, frozenset(concrete_inputs), frozenset(RULES), frozenset(CONCRETE_OPS))

    def check() -> bool:
        g = expanded(graph, domain)
        known = set(g.constant_names()) | set(concrete_inputs)
        missing: dict[str, list[str]] = {}
        for n in g.nodes:
            ins = [i for i in n.inputs if i]
            if n.op_type in _SHAPE_ONLY or (all(i in known for i in ins)
                                            and n.op_type in CONCRETE_OPS):
                known.update(o for o in n.outputs if o)
                continue
            if (n.op_type, rd) not in RULES:
                missing.setdefault(n.op_type, []).append(n.name)
        if missing:
            listing = "; ".join(f"{op} (nodes: {', '.join(repr(x) for x in names[:5])}"
                                f"{', ...' if len(names) > 5 else ''})"
                                for op, names in sorted(missing.items()))
            raise BoundError(f"no bound rule in domain {rd!r} for: {listing}; "
                             f"registered: {', '.join(registered(rd))}")
        return True
    memo(graph, tag, check)


def _is_int(graph: Graph, name: str) -> bool:
    dt = graph.info(name).dtype
    return dt is not None and dt in _INT_DTYPES


# A hook on run_graph (set by a proof by cases sharing prefixes, kcverify.bounds.cases): its
# ``resume(graph, method, st, runs)`` may return (k, st, runs), the states before node k of a
# run whose nodes 0 .. k - 1 compute what this run's would (the traversal then starts at node
# k), and ``before(k, graph, method, st, runs)`` is called before each node run (it may keep a
# copy). None: every run starts at node 0.
RUN_HOOK: contextvars.ContextVar[Any] = contextvars.ContextVar("kcverify_run_hook",
                                                               default=None)


def run_graph(graph: Graph, train: KernelSpec, inf: KernelSpec, state: dict[str, Any],
              domain: Method | str = "interval", device: torch.device | str = "cpu",
              region_tensors: Mapping[str, Callable[[Any], Box]] | None = None,
              keep: set[str] | None = None, runs: tuple[Any, ...] = (),
              axes: Mapping[str, Any] | None = None, batch: int | None = None,
              progress: Callable[[int, int, str], None] | None = None) -> dict[str, Any]:
    """Bound every node of ``graph`` from ``state`` (name -> Box | Concrete); returns the states
    of the graph outputs (and of ``keep``). The product: each node's interval rule, then each
    of ``runs`` (the relational domains' states for this run, ``SymbolicRun`` / ``ZonotopeRun``,
    in order) steps from its own states and the box so far and meets its result with it.
    ``region_tensors``: tensors replaced, once computed, by a region box around them
    (embedding-space regions). ``axes``/``batch``: the sample axis of every tensor and the
    number of samples (dynamic per-sample scales; RuleCtx). ``progress(k, n, op)``: called
    before node k of n (the caller throttles it)."""
    method = Method.of(domain)
    rd = method.domains[0]
    separate = method.separate
    dev = torch.device(device)
    consts = graph.constant_names()
    st: dict[str, Any] = dict(state)
    for name, arr in graph.initializers.items():
        if name not in st:
            st[name] = Concrete(_initializer_tensor(arr).to(dev))
    outs = {v.name for v in graph.outputs} | set(keep or ())
    last_use: dict[str, int] = {}
    for k, n in enumerate(graph.nodes):
        for i in n.inputs:
            if i:
                last_use[i] = k
    hook = RUN_HOOK.get()
    k0 = 0
    if hook is not None:
        got = hook.resume(graph, method.name, st, runs)
        if got is not None:
            k0, st, runs = got
    for k, n in enumerate(graph.nodes):
        if k < k0:
            continue
        if hook is not None:
            hook.before(k, graph, method.name, st, runs)
        if progress is not None:
            progress(k, len(graph.nodes), n.op_type)
        ins = [st.get(i) if i else None for i in n.inputs]
        for i, v in zip(n.inputs, ins):
            if i and v is None:
                raise BoundError(f"node {n.name!r} ({n.op_type}) reads {i!r}, which has no state")
        ctx = RuleCtx(n, train, inf, consts, graph.opset, dev, axes, batch)
        results = _dispatch(graph, n, ins, rd, ctx, separate)
        made = nan_produced(results) if runs else None
        for run in runs:
            if any(isinstance(r, Box) for r in results):
                results = run.step(graph, n, ins, results, ctx)
        # a NaN-possible input reaches the outputs in every domain, and the NaN a rule made
        # survives the meet (bounds/nan.py); a changed output's relational forms bound finite
        # values only: dropped
        results, nan_changed = nan_close(n, ins, results, axes, made)
        for j in nan_changed:
            for run in runs:
                run.drop(n.outputs[j])
        for o, r in zip(n.outputs, results):
            if o:
                if isinstance(r, Box):
                    r = infinite_drift(r)
                if region_tensors and o in region_tensors:
                    r = region_tensors[o](r)
                    for run in runs:
                        run.drop(o)
                st[o] = r
        for i in set(n.inputs):
            if i and last_use.get(i) == k and i not in outs and i not in graph.initializers:
                st.pop(i, None)
                for run in runs:
                    run.drop(i)
    return {o: st[o] for o in outs if o in st}


def infinite_drift(b: Box) -> Box:
    """The drift interval closed under the infinite values the value sets admit (semantics
    §1.1, "Infinities and NaN"; kcverify.boxes.infinite_drift is the same on numpy arrays).
    The drift of a pair is i - t, 0 for the same infinity in both kernels (a masked entry),
    +-inf for an infinity against a finite value or the opposite infinity, NaN (no bound)
    where a value may be NaN: a value set (-inf, inf). A rule bounds the finite pairs; this
    adds what the infinite ones need, in every domain and after their meet (a value set
    [inf, inf] in both kernels gets a drift interval holding 0, not [inf, inf])."""
    vals = torch.stack([b.tl, b.th, b.il, b.ih])
    if vals.numel() == 0 or bool(torch.isfinite(vals).all()):
        return b
    inf = math.inf
    tp, tn, ip, in_ = b.th == inf, b.tl == -inf, b.ih == inf, b.il == -inf
    tf, if_ = (b.th > -inf) & (b.tl < inf), (b.ih > -inf) & (b.il < inf)  # a finite value
    nan = (tp & tn) | (ip & in_)  # (-inf, inf): the value may be NaN
    same = (tp & ip) | (tn & in_)
    up = nan | (ip & (tf | tn)) | (tn & (if_ | ip))
    down = nan | (tp & (if_ | in_)) | (in_ & (tf | tp))
    zero = torch.zeros_like(b.dl)
    dl = torch.where(down, -inf, torch.where(same, torch.minimum(b.dl, zero), b.dl))
    dh = torch.where(up, inf, torch.where(same, torch.maximum(b.dh, zero), b.dh))
    return Box(b.tl, b.th, b.il, b.ih, dl, dh)


# ops whose axes count the output's dimensions (Unsqueeze), or may be an end point (Flatten: r)
_AXES_OF_OUTPUT = frozenset({"Unsqueeze"})


def _initializer_tensor(arr: Any) -> torch.Tensor:
    """An initializer as a torch tensor of its own type (bfloat16 arrays, ml_dtypes', which
    torch does not read, through their exact float32 values)."""
    a = np.array(arr)
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)
    return torch.as_tensor(a)


def _check_axes(n, ins: list, opset: int) -> None:
    """Refuse an ``axis`` / ``axes`` attribute outside [-r, r) of the first input's rank r (an
    invalid model that no runtime executes: the rules would bound ``axis % r``)."""
    x = ins[0] if ins else None
    if x is None or n.op_type in _AXES_OF_OUTPUT:
        return
    r = len(x.value.shape if isinstance(x, Concrete) else x.tl.shape)
    for name in ("axis", "axes"):
        v = n.attrs.get(name)
        vals = [v] if isinstance(v, int) else list(v) if isinstance(v, (list, tuple)) else []
        top = r + 1 if n.op_type == "Flatten" else r
        bad = [a for a in vals if isinstance(a, int) and not -r <= a < top]
        if bad:
            raise BoundError(f"{n.op_type} node {n.name!r} (opset {opset}): attribute {name!r} = "
                             f"{v!r} is outside [-{r}, {top}) for its rank-{r} input")


def _dispatch(graph: Graph, n, ins: list, rd: str, ctx: RuleCtx, separate: bool) -> tuple:
    where = f"{n.op_type} node {n.name!r}"
    present = [x for x in ins if x is not None]
    if n.op_type in _SHAPE_ONLY:
        x = present[0]
        val = x.value if isinstance(x, Concrete) else x.tl
        return tuple(Concrete(v) for v in CONCRETE_OPS[n.op_type](n, graph.opset, val))
    if all(isinstance(x, Concrete) for x in present) and n.op_type in CONCRETE_OPS:
        from kcverify.bounds.rules.shape import ROUNDING_CONCRETE

        try:
            vals = CONCRETE_OPS[n.op_type](n, graph.opset,
                                           *[x.value if x is not None else None for x in ins])
        except (RuntimeError, ValueError, IndexError, TypeError) as e:
            raise BoundError(f"{where}: exact evaluation failed: {e}") from None
        rounds = max((x.rounds for x in present), default=0)
        if n.op_type in ROUNDING_CONCRETE:
            rounds += 1
        return tuple(Concrete(v, rounds if v.is_floating_point() else 0) for v in vals)
    rule = RULES.get((n.op_type, rd))
    if rule is None:
        raise BoundError(f"{where} (opset {graph.opset}): no rule for domain {rd!r}; "
                         f"registered: {', '.join(registered(rd))}")
    check_attributes(n, rd, graph.opset)
    _check_axes(n, ins, graph.opset)

    def had_inf() -> bool:  # asked only when a result holds NaN (inf - inf is then legitimate)
        return any((isinstance(x, Box) and not all(bool(torch.isfinite(p).all()) for p in x.parts()))
                   or (isinstance(x, Concrete) and x.value.is_floating_point()
                       and not bool(torch.isfinite(x.value).all())) for x in present)
    # rules run without autograd bookkeeping (~10% of their time); their results are
    # inference tensors: read them anywhere, modify them in place only inside inference_mode
    with torch.inference_mode():
        try:
            out = rule(ctx, *ins)
        except BoundError:
            raise
        except (RuntimeError, ValueError, IndexError) as e:
            raise BoundError(f"{where}: rule failed: {e}") from None
        outs = out if isinstance(out, tuple) else (out,)
        res = []
        for o in outs:
            if isinstance(o, Box):  # an exact rule (data movement, selection) is not rounded
                o = (check_box(o, None, where, had_inf) if getattr(rule, "exact", False)
                     else pad_check(o, where, had_inf))
                if separate:
                    o = Box.make(o.tl, o.th, o.il, o.ih)
            res.append(o)
    return tuple(res)


class SymbolicRun:
    """The symbolic domain's states of one run (tensor name -> LinState over ``m`` symbols)."""

    domain = SYMBOLIC

    def __init__(self, forms: dict[str, Any], m: int) -> None:
        self.forms, self.m = forms, m

    def drop(self, name: str) -> None:
        self.forms.pop(name, None)

    def step(self, graph: Graph, n, ins: list, results: tuple, ctx: RuleCtx) -> tuple:
        """The node's symbolic rule from the inputs' forms (a box without one: a constant form),
        its result met with the box (linear.tighten: the reduced product)."""
        rule = self.domain.transfer(n.op_type)
        if rule is None or len(results) != 1 or not isinstance(results[0], Box):
            return results
        check_attributes(n, self.domain.name, graph.opset)
        states = []
        for name, x in zip(n.inputs, ins):
            if x is None:
                states.append((None, None, None))
            elif isinstance(x, Box):
                states.append((x, x, self.forms.get(name)))
            elif x.value.is_floating_point():
                states.append((x, ctx.lift(x), None))
            else:
                states.append((x, None, None))
        try:
            st = rule(ctx, states, results[0], self.m)
        except KcverifyError:
            raise
        except Exception as e:  # noqa: BLE001 - a rule that cannot apply returns None: a bug
            from kcverify.bounds.memory import is_out_of_memory

            if is_out_of_memory(e):  # the budget's business (_run_blocks), not a rule bug
                raise
            raise InternalError(f"{n.op_type} node {n.name!r}: the symbolic-interval rule "
                                f"failed: {type(e).__name__}: {e}") from e
        if st is None:
            return results
        self.forms[n.outputs[0]] = st
        return (self.domain.meet(results[0], st),)


class ZonotopeRun:
    """The zonotope's states of one run: a ZonoTrack, whose ``step`` runs the node's rule
    (``ZONOTOPE.transfer``) and meets its boxes with the forms (zonotope.meet)."""

    domain = ZONOTOPE

    def __init__(self, track: Any = None) -> None:
        from kcverify.bounds.zonotope import ZonoTrack

        self.track = track if track is not None else ZonoTrack()

    def drop(self, name: str) -> None:
        self.track.drop(name)

    def step(self, graph: Graph, n, ins: list, results: tuple, ctx: RuleCtx) -> tuple:
        if self.domain.transfer(n.op_type) is not None:
            check_attributes(n, self.domain.name, graph.opset)
        return self.track.step(n, list(n.inputs), ins, results, ctx)


# --- input sets ---------------------------------------------------------------------------
def _stored(spec: KernelSpec, lo: torch.Tensor, hi: torch.Tensor, point: bool
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Value set of an input after the kernel stores it in its compute format (nearest), and the
    bound on |stored - x|."""
    from kcverify.bounds.casts import rne

    if point:
        q = rne(lo, spec.compute)
        return q, q, (q - lo).abs()
    fmt = spec.compute
    q_lo, q_hi = rne(pad_lo(lo), fmt), rne(pad_hi(hi), fmt)
    err = pad_hi(fmt.u * torch.maximum(lo.abs(), hi.abs()) + fmt.eta, 1e-12)
    return q_lo, q_hi, err


def input_box(train: KernelSpec, inf: KernelSpec, lo: torch.Tensor, hi: torch.Tensor) -> Box:
    """The box of a float input in [lo, hi], stored by both kernels in their compute formats:
    drift = fl_inf(x) - fl_train(x), within the two storage errors (or exact for points)."""
    point = bool((lo == hi).all())
    tl, th, et = _stored(train, lo, hi, point)
    il, ih, ei = _stored(inf, lo, hi, point)
    if point:
        d = il - tl
        return Box(tl, th, il, ih, d, d.clone())
    return Box.make(tl, th, il, ih, -(et + ei), et + ei)


def _region_bounds(x: torch.Tensor, region: Region | None) -> tuple[torch.Tensor, torch.Tensor]:
    if region is None or region.eps == 0:
        return x, x
    e = region.eps
    return pad_lo(x - e), pad_hi(x + e)


def _embedding_tensors(graph: Graph) -> list[str]:
    """Outputs of Gather(constant table, non-constant indices): the token embeddings."""
    const = graph.constant_names()
    out = []
    for n in graph.nodes:
        if n.op_type == "Gather" and n.inputs[0] in const and n.inputs[1] not in const:
            out.append(n.outputs[0])
    return out


def _as_feeds(graph: Graph, feeds: Any) -> dict[str, np.ndarray]:
    if isinstance(feeds, Mapping):
        d = {k: np.asarray(v) for k, v in feeds.items()}
    else:
        if len(graph.inputs) != 1:
            raise InputFileError(f"the model has {len(graph.inputs)} inputs "
                                 f"({', '.join(v.name for v in graph.inputs)}); give a mapping")
        d = {graph.inputs[0].name: np.asarray(feeds)}
    for v in graph.inputs:
        if v.name not in d:
            raise InputFileError(f"no input given for the model input {v.name!r}")
        if v.shape is not None:
            got = d[v.name].shape
            want = v.shape
            ok = len(got) == len(want) and all(
                not isinstance(w, int) or k == 0 or w == g for k, (w, g) in enumerate(zip(want, got)))
            if not ok:
                shown = "x".join(str(w) if isinstance(w, int) else str(w or "?") for w in want)
                raise InputFileError(f"input {v.name!r}: got shape {'x'.join(map(str, got))}, "
                                     f"the model expects {shown} (axis 0 is the batch)")
    return d


def _to_diffbox(x: Any, ctx: RuleCtx) -> DiffBox:
    """A state as a DiffBox; a concrete float a realization may have rounded is widened."""
    if isinstance(x, Box):
        return x.to_diffbox()
    if x.value.is_floating_point():
        return ctx.lift(x).to_diffbox()
    return DiffBox.point(x.value.detach().to("cpu").to(F64).numpy())


def _is_point(d: DiffBox) -> bool:
    a = d.arrays()
    return (np.array_equal(a[0], a[1]) and np.array_equal(a[2], a[3]) and np.array_equal(a[0], a[2])
            and not np.any(a[4]) and not np.any(a[5]))


def _from_diffbox(graph: Graph, name: str, d: DiffBox, dev: torch.device) -> Any:
    if _is_int(graph, name) and _is_point(d):
        return Concrete(torch.as_tensor(d.arrays()[0].astype(np.int64), device=dev))
    return d.to_box(dev)


# --- public API ---------------------------------------------------------------------------
def bound_block(block: Any, train_spec: KernelSpec, inf_spec: KernelSpec,
                in_state: Mapping[str, DiffBox], domain: str = "best", device: str = "cpu",
                region_tensors: Mapping[str, Callable[[Any], Box]] | None = None,
                linear_inputs: Mapping[str, Any] | None = None,
                progress: Callable[[int, int, str], None] | None = None) -> dict[str, DiffBox]:
    """Bound one block (kcverify.models.blocks.Block, or anything with .graph and .outputs)
    from the DiffBoxes of its inputs; returns the DiffBoxes of its outputs. Deterministic: the
    checker re-runs it and checks recomputed within stored. ``progress(k, n, op)``: before
    each node of the block's (expanded) graph."""
    refuse_second_graph(train_spec, inf_spec)
    g: Graph = block.graph
    dev = torch.device(device)
    concrete_inputs = {n for n, d in in_state.items() if _is_int(g, n)}
    check_rules(g, domain, concrete_inputs)
    g = expanded(g, domain)
    axes, batch = _axes_of(block, g, in_state)
    st = {name: _from_diffbox(g, name, d, dev) for name, d in in_state.items()}
    method = Method.of(domain)
    runs: list[Any] = []
    if linear_inputs is None and SYMBOLIC.name in method.domains:
        linear_inputs = _linear_inputs(st)
    if linear_inputs:
        m = int(next(iter(linear_inputs.values())).t.A.shape[-1])
        runs.append(SymbolicRun(dict(linear_inputs), m))
    # inputs of the batch: a point slice of k inputs is k rows (its symbols are shared by all)
    rows = batch if batch is not None else max(
        (d.shape[0] for d in in_state.values() if len(d.shape) >= 2 and not _is_point(d)),
        default=1)  # masks are points
    if ZONOTOPE.name in method.domains and (method.zono_rows is None or rows <= method.zono_rows):
        runs.append(ZonotopeRun())
    out = run_graph(g, train_spec, inf_spec, st, method, dev, region_tensors,
                    keep=set(getattr(block, "outputs", ())), runs=tuple(runs), axes=axes,
                    batch=batch, progress=progress)
    if not out:
        return {}
    ctx = RuleCtx(g.nodes[0], train_spec, inf_spec, set(), g.opset, dev)
    return {k: _to_diffbox(v, ctx) for k, v in out.items()}


def _axes_of(block: Any, g: Graph, in_state: Mapping[str, DiffBox]
             ) -> tuple[dict[str, Any], int | None]:
    """The sample axis of every tensor of the (expanded) block graph, from the block inputs'
    axes in the whole model (Block.sample_axes; a graph without them is the model itself: its
    inputs' axis 0), and the number of samples."""
    from kcverify.bounds.decompose import memo
    from kcverify.models.blocks import sample_axes

    given = tuple(getattr(block, "sample_axes", ()) or ())
    inputs = dict(given) if given else None
    axes = memo(g, ("sample-axes", given), lambda: sample_axes(g, inputs))
    sizes = [d.shape[a] for name, d in in_state.items()
             if isinstance(a := axes.get(name), int) and not isinstance(a, bool)
             and a < len(d.shape)]
    return axes, (max(sizes) if sizes else None)


MAX_LINEAR_VARS = 2048
# the block cuts a prover makes (certify_drift's ``cut``); the checker knows both by digest
# (certs/recheck.model_blocks): the segmenter's blocks, and the whole graph as one block
CUTS = ("segments", "whole")
# `best` adds the zonotope for batches up to this size: its symbols are shared by the batch rows,
# so a large batch leaves each row a sliver of the memory budget for the cost of all of it
ZONO_BEST_ROWS = 2
_PRODUCT = (INTERVAL.name, SYMBOLIC.name, ZONOTOPE.name)
METHODS: dict[str, Method] = {m.name: m for m in (
    Method("interval", (INTERVAL.name,)),
    Method("separate", (INTERVAL.name,), separate=True),
    Method("linear", _PRODUCT, cut="whole"),
    Method("best", _PRODUCT, zono_rows=ZONO_BEST_ROWS),
    Method("zonotope", (INTERVAL.name, ZONOTOPE.name)))}
assert set(METHODS) == set(DOMAIN_NAMES)


def _linear_inputs(st: Mapping[str, Any]) -> dict[str, Any] | None:
    """Symbolic variables for the one non-point float input of a block: z in [-1, 1]^m spans its
    training box, x_t = mid_t + hw_t z exactly, x_i = x_t + [dl, dh] (derived from the in_state
    alone, so the checker's re-run derives the same forms)."""
    from kcverify.bounds.linear import Form, LinState

    wide = [(k, b) for k, b in st.items() if isinstance(b, Box) and b.tl.dim() >= 2
            and bool((b.th > b.tl).any())]
    if len(wide) != 1:
        return None
    name, b = wide[0]
    batch = b.tl.shape[0]
    m = b.tl[0].numel()
    if m > MAX_LINEAR_VARS or not all(bool(torch.isfinite(p).all()) for p in b.parts()):
        return None
    mid = 0.5 * b.tl + 0.5 * b.th
    hw = pad_hi(torch.maximum(b.th - mid, mid - b.tl))
    eye = torch.eye(m, dtype=F64, device=b.tl.device)
    A = (hw.reshape(batch, m, 1) * eye).reshape(*b.tl.shape, m)
    zero = torch.zeros_like(b.tl)
    t = Form(A, mid, zero, zero.clone())
    i = Form(A.clone(), mid.clone(), pad_lo(b.dl), pad_hi(b.dh))
    d = Form(torch.zeros_like(A), zero.clone(), pad_lo(b.dl), pad_hi(b.dh))
    return {name: LinState(t, i, d)}


@dataclass
class _WholeGraph:
    name: str
    kind: str
    graph: Graph
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    digest: str


def whole_graph(graph: Graph) -> list[Any]:
    """The whole graph as one block (the linear domain's forms then span every layer)."""
    return [_WholeGraph("model", "other", graph, tuple(v.name for v in graph.inputs),
                        tuple(v.name for v in graph.outputs), graph.digest())]


def blocks_of(graph: Graph) -> list[Any]:
    """The model's blocks (kcverify.models.blocks.segment; a graph without a cut is one block).
    The checker re-derives the same cut, so a segmenter failure is reported, never replaced by
    another cut: bad input stays a KcverifyError, anything else is an InternalError."""
    from kcverify.bounds.decompose import memo
    from kcverify.models.blocks import segment

    try:  # remembered per graph object (decompose.memo): segmenting costs a few ms a call
        return list(memo(graph, ("blocks",), lambda: list(segment(graph))))
    except KcverifyError:
        raise
    except Exception as e:  # noqa: BLE001 - a bug in the segmenter, reported as one
        raise InternalError(f"segmenting graph {graph.name!r} into blocks failed: "
                            f"{type(e).__name__}: {e}") from e


def _per_sample_linf(d: DiffBox, axis: Any, batch: int) -> np.ndarray:
    """max |drift| per sample of the batch: over every axis but the output's sample axis (an
    output with none, or an unknown one, gives every sample the max over the whole tensor)."""
    m = np.maximum(np.abs(d.drift_lo), np.abs(d.drift_hi))
    if isinstance(axis, int) and not isinstance(axis, bool) and m.ndim > axis \
            and m.shape[axis] == batch:
        m = np.moveaxis(m, axis, 0).reshape(batch, -1)
        return m.max(axis=1) if m.size else np.zeros(batch)
    return np.full(batch, m.max() if m.size else 0.0)


def certify_drift(graph: Graph, train_spec: KernelSpec, inf_spec: KernelSpec, feeds: Any,
                  region: Region | None = None, domain: str = "best", device: str = "cpu",
                  progress: Callable[[int, int, str], None] | None = None,
                  blocks: list[Any] | None = None,
                  input_bounds: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None,
                  memory: int | None = None, cut: str = "segments",
                  node_progress: Callable[[str, int, int, str], None] | None = None
                  ) -> DriftResult:
    """Certified drift bounds between two kernels of ``graph`` for each input of the batch (or
    for every input in the region around each, or in the explicit boxes ``input_bounds``:
    name -> (lo, hi), e.g. a VNN-LIB property's input box). See the module docstring.
    ``memory``: the budget in bytes (bounds/memory.py; default a fraction of physical memory):
    a block whose method cannot fit it, or whose run the allocator refuses, is bounded with
    intervals instead, and ``notes`` says so. ``cut``: the blocks bounded, "segments" (the
    segmenter's; ``CUTS``) or "whole" (the whole graph as one block, as the linear domain
    always does: forms span every layer); ``blocks`` overrides both. ``node_progress(block, k,
    n, op)``: before each node of a block (long whole-graph runs report from inside)."""
    t0 = time.perf_counter()
    refuse_second_graph(train_spec, inf_spec)
    load_rules()
    _rule_domain(domain)
    dev = torch.device(device)
    fd = _as_feeds(graph, feeds)
    state: dict[str, DiffBox] = {}
    for v in graph.inputs:
        arr = fd[v.name]
        if arr.dtype.kind in "iub":
            state[v.name] = DiffBox.point(arr.astype(np.float64))
            continue
        x = torch.as_tensor(arr.astype(np.float64), device=dev)
        lo, hi = _region_bounds(x, region if region is not None and region.space == "input" else None)
        if input_bounds is not None and v.name in input_bounds:
            b_lo, b_hi = (torch.as_tensor(np.broadcast_to(np.asarray(b, np.float64), arr.shape).copy(),
                                          device=dev) for b in input_bounds[v.name])
            if bool((b_lo > b_hi).any()):
                raise BoundError(f"input box for {v.name!r}: a lower bound exceeds its upper bound")
            lo, hi = torch.minimum(lo, b_lo), torch.maximum(hi, b_hi)
        state[v.name] = input_box(train_spec, inf_spec, lo, hi).to_diffbox()
    region_tensors: dict[str, Callable[[Any], Box]] = {}
    if region is not None and region.space == "embedding" and region.eps > 0:
        emb = _embedding_tensors(graph)
        if not emb:
            raise BoundError("an embedding-space region needs a Gather of a constant table by "
                             "token ids; this model has none")

        def to_region(x: Any) -> Box:
            c = x.value.to(dev, F64) if isinstance(x, Concrete) else x.tl
            lo, hi = _region_bounds(c, region)
            return input_box(train_spec, inf_spec, lo, hi)
        region_tensors = {e: to_region for e in emb}
    if cut not in CUTS:
        raise BoundError(f"unknown block cut {cut!r}; expected one of {', '.join(CUTS)}")
    if blocks is not None:
        blks = blocks
    elif Method.of(domain).cut == "whole" or cut == "whole":
        blks = whole_graph(graph)  # forms across layers; one record for the whole model
    else:
        blks = blocks_of(graph)
    records: list[BlockRecord] = []
    needed_later: list[set[str]] = []
    acc: set[str] = {v.name for v in graph.outputs}
    for b in reversed(blks):
        needed_later.append(set(acc))
        acc |= set(b.inputs)
    needed_later.reverse()
    method = domain if domain in ("separate", "linear", "best", "zonotope") else "interval"
    batch = next(iter(fd.values())).shape[0] if fd else 1
    from kcverify.bounds import diagnostics
    from kcverify.bounds import memory as mem

    budget = mem.default_budget() if memory is None else int(memory)
    lin_vars = (min(MAX_LINEAR_VARS, max(a[:1].size for a in fd.values()))
                if region is not None or input_bounds is not None else 0)
    plan = mem.plan_blocks(graph, blks, fd, domain, budget, lin_vars)
    with diagnostics.collecting(batch) as diag:
        _run_blocks(blks, needed_later, state, records, method, train_spec, inf_spec, domain,
                    device, region_tensors, progress, plan, node_progress)
    missing = [v.name for v in graph.outputs if v.name not in state]
    if missing:
        made = {o: n for n in graph.nodes for o in n.outputs}
        n = made.get(missing[0])
        by = (f" ({n.op_type} node {n.name!r} output {list(n.outputs).index(missing[0])}: its "
              "rule bounds only its first outputs)") if n is not None else ""
        raise BoundError(f"graph output {missing[0]!r} is not bounded{by}")
    outputs = {v.name: state[v.name] for v in graph.outputs}
    linf = np.zeros(batch)
    from kcverify.models.blocks import sample_axes

    axes = sample_axes(graph)
    for v in graph.outputs:
        if _is_int(graph, v.name):
            continue
        linf = np.maximum(linf, _per_sample_linf(outputs[v.name], axes.get(v.name), batch))
    return DriftResult(linf, outputs, records, time.perf_counter() - t0, domain,
                       diag.get("unstable_casts", np.zeros(batch, dtype=np.int64)), plan.notes)


def _run_blocks(blks: list[Any], needed_later: list[set[str]], state: dict[str, Any],
                records: list[BlockRecord], method: str, train_spec: KernelSpec,
                inf_spec: KernelSpec, domain: str, device: str,
                region_tensors: Mapping[str, Callable[[Any], Box]],
                progress: Callable[[int, int, str], None] | None, plan: Any = None,
                node_progress: Callable[[str, int, int, str], None] | None = None) -> None:
    """Bound the blocks in order, keeping in ``state`` only what later blocks need. ``plan``
    (memory.MemoryPlan): the domain of each block under the memory budget; a block whose run
    the allocator refuses is bounded again with intervals (a note in ``plan.notes``)."""
    import contextlib

    from kcverify.bounds.memory import enforced, is_out_of_memory, show

    for k, b in enumerate(blks):
        if progress is not None:
            progress(k, len(blks), b.name)
        ins = {name: state[name] for name in b.inputs if name in state}
        missing = [name for name in b.inputs if name not in state]
        if missing:
            raise BoundError(f"block {b.name!r} reads {missing}, which no earlier block produced")
        dom, meth = domain, method
        if plan is not None and plan.domains[k] != domain:
            dom, meth = plan.domains[k], plan.domains[k]
        inner = None if node_progress is None else (
            lambda i, n, op, name=b.name: node_progress(name, i, n, op))
        # the budget holds while a relational method runs (memory.enforced: an allocation
        # past it fails, and is caught below), not only in the estimate
        guard = (enforced(plan.budget, device) if plan is not None and dom != "interval"
                 else contextlib.nullcontext())
        try:
            with guard:
                outs = bound_block(b, train_spec, inf_spec, ins, dom, device, region_tensors,
                                   progress=inner)
        except (RuntimeError, MemoryError, BoundError) as e:
            if dom == "interval" or not is_out_of_memory(e):
                raise
            if plan is not None:
                plan.notes.append(f"block {b.name!r}: method {dom} ran out of memory "
                                  f"({str(e)[:120] or type(e).__name__}; budget "
                                  f"{show(plan.budget)}): used interval")
            dom = meth = "interval"
            outs = bound_block(b, train_spec, inf_spec, ins, dom, device, region_tensors)
        records.append(BlockRecord(b.name, b.digest, meth, ins, outs))
        state.update(outs)
        for name in list(state):
            if name not in needed_later[k]:
                state.pop(name)
