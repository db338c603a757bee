"""Segment a model along its residual stream into standalone blocks (semantics §2, 6).

A *cut* is a tensor of the stream that is, at that point of the graph's topological order, the
only live stream tensor: every path from the stream input to the outputs passes through it. The
stream is what depends on the primary input's *values* (``Shape``/``Size`` read only a shape, so
masks and position ids built from ``Shape(input_ids)`` are side tensors, not stream). Between
consecutive cuts lie segments; segments are grouped into blocks:

* transformers (a segment holds a Softmax or a fused Attention): a layer starts at each attention segment and runs
  to the next one (the last layer has the period of the previous ones); what precedes the first
  layer is the embedding, what follows the last is the head;
* other networks: one block per layer, each ending at an activation (Relu, Tanh, ...);
* no cut at all: one block holding the whole graph.

Side tensors (masks, position ids, extra model inputs) are computed in the first block that
needs them and become extra inputs of later blocks; constant subgraphs are copied into every
block that reads them, so each block's weights are its own initializers and constants. Running
the blocks in order, feeding each block's inputs by name from the model inputs and earlier
blocks' outputs, reproduces the model exactly (same ops on the same values).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from kcverify.models.ir import Graph, Node

SHAPE_ONLY = frozenset({"Shape", "Size"})
ACTIVATIONS = frozenset({"Relu", "LeakyRelu", "PRelu", "Sigmoid", "Tanh", "Gelu", "Softplus",
                         "HardSigmoid", "Clip"})
LINEAR = frozenset({"MatMul", "Gemm", "Conv"})
ATTENTION = frozenset({"Softmax", "Attention"})  # a segment holding one is an attention sublayer


@dataclass(frozen=True)
class Block:
    """A standalone subgraph of a model. ``kind``: embedding | layer | head | other."""

    name: str
    kind: str
    graph: Graph
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    digest: str
    stream_in: str | None = None  # the cut tensor the block starts from (None: model inputs)
    stream_out: str | None = None  # the cut tensor it ends at (None: no single tensor)
    # the sample axis of each block input in the whole model (sample_axes): a block alone
    # cannot tell which axis of an intermediate tensor is the sample
    sample_axes: tuple[tuple[str, int | str | None], ...] = ()

    @property
    def num_nodes(self) -> int:
        return len(self.graph.nodes)

    @property
    def num_params(self) -> int:
        """Number of scalars in the block's initializers and Constant nodes."""
        n = sum(int(np.asarray(a).size) for a in self.graph.initializers.values())
        for node in self.graph.nodes:
            if node.op_type == "Constant" and isinstance(node.attrs.get("value"), np.ndarray):
                n += int(node.attrs["value"].size)
        return n


def _value_reach(graph: Graph, start: str, const: set[str]) -> set[str]:
    """Tensors whose values depend on ``start`` (not through a shape-only read)."""
    reach = {start}
    for n in graph.nodes:
        if n.op_type in SHAPE_ONLY:
            continue
        if any(i in reach for i in n.inputs if i):
            reach.update(o for o in n.outputs if o and o not in const)
    return reach


def _primary_input(graph: Graph, const: set[str]) -> tuple[str, set[str]]:
    best: tuple[int, str, set[str]] | None = None
    for v in graph.inputs:
        r = _value_reach(graph, v.name, const)
        if best is None or len(r) > best[0]:
            best = (len(r), v.name, r)
    assert best is not None
    return best[1], best[2]


def _cuts(graph: Graph, stream: set[str], primary: list[Node]) -> list[tuple[int, str]]:
    """(position k, tensor t): after the k-th stream node, t is the only live stream tensor."""
    pos = {o: k for k, n in enumerate(primary) for o in n.outputs if o in stream}
    last: dict[str, int] = {}
    for k, n in enumerate(primary):
        for i in n.inputs:
            if i in stream:
                last[i] = k
    end = len(primary)
    for v in graph.outputs:
        if v.name in stream:
            last[v.name] = end
    born: dict[int, list[str]] = {}
    for t, k in pos.items():
        born.setdefault(k, []).append(t)
    dies: dict[int, list[str]] = {}
    for t, k in last.items():
        dies.setdefault(k, []).append(t)
    live: set[str] = {t for t in stream if t not in pos and t in last}  # the stream input
    cuts: list[tuple[int, str]] = []
    for k in range(end):
        live.update(t for t in born.get(k, []) if last.get(t, -1) > k)
        live.difference_update(dies.get(k, []))
        if len(live) == 1:
            (t,) = tuple(live)
            if pos.get(t) == k:
                cuts.append((k, t))
    return cuts


def _is_residual(seg: list[Node], stream: set[str]) -> bool:
    return any(n.op_type in ("Add", "Sum") and sum(i in stream for i in n.inputs) >= 2
               for n in seg)


def _group(segs: list[list[Node]], stream: set[str]) -> list[tuple[str, str, int, int]]:
    """(name, kind, first segment, last segment) of each block."""
    m = len(segs)
    attn = [j for j, s in enumerate(segs) if any(n.op_type in ATTENTION for n in s)]
    out: list[tuple[str, str, int, int]] = []
    if attn:
        starts = attn
        ends = [s - 1 for s in starts[1:]]
        if len(starts) >= 2:
            period = starts[-1] - starts[-2]
            ends.append(min(starts[-1] + period - 1, m - 1))
        else:
            e = max((j for j in range(starts[-1], m) if _is_residual(segs[j], stream)),
                    default=starts[-1])
            while e + 1 < m and not any(n.op_type in LINEAR for n in segs[e + 1]):
                e += 1
            ends.append(e)
        if starts[0] > 0:
            out.append(("embedding", "embedding", 0, starts[0] - 1))
        for i, (a, b) in enumerate(zip(starts, ends)):
            out.append((f"layer{i}", "layer", a, b))
        if ends[-1] < m - 1:
            out.append(("head", "head", ends[-1] + 1, m - 1))
        return out
    first = 0
    layer = 0
    for j, s in enumerate(segs):
        if s and s[-1].op_type in ACTIVATIONS and j < m - 1:
            out.append((f"layer{layer}", "layer", first, j))
            layer += 1
            first = j + 1
    if first <= m - 1:
        out.append(("head" if layer else "model", "head" if layer else "other", first, m - 1))
    return out


def segment(graph: Graph) -> list[Block]:
    """The model's blocks, in order (see the module docstring), each with the sample axes of its
    inputs in the whole model."""
    axes = sample_axes(graph)
    return [replace(b, sample_axes=tuple((i, axes.get(i, UNKNOWN)) for i in b.inputs))
            for b in _segment(graph)]


def _segment(graph: Graph) -> list[Block]:
    const = graph.constant_names()
    producers = graph.producers()
    dynamic = [n for n in graph.nodes if not all((not o) or o in const for o in n.outputs)]
    if not graph.inputs or not dynamic:
        return [_make(graph, "model", "other", [n.name for n in graph.nodes], [], producers, const,
                      None, None)]
    _, stream = _primary_input(graph, const)
    primary = [n for n in dynamic if any(i in stream for i in n.inputs if i)]
    cuts = _cuts(graph, stream, primary)
    bounds = [k for k, _ in cuts]
    segs: list[list[Node]] = []
    prev = -1
    for k in [*bounds, len(primary) - 1]:
        if k > prev:
            segs.append(primary[prev + 1:k + 1])
            prev = k
    if len(segs) <= 1:
        return [_make(graph, "model", "other", [n.name for n in graph.nodes], [], producers, const,
                      None, None)]
    groups = _group(segs, stream)
    # the cut tensor that ends each segment (the last segment may end at the model's outputs)
    seg_end = {j: t for j, (_, t) in enumerate(cuts)}
    block_of: dict[str, int] = {}
    for b, (_, _, a, z) in enumerate(groups):
        for s in segs[a:z + 1]:
            for n in s:
                block_of[n.name] = b
    # side nodes: into the first block that reads them (reverse order sees consumers first)
    consumers = graph.consumers()
    outputs = {v.name for v in graph.outputs}
    last = len(groups) - 1
    for n in reversed(dynamic):
        if n.name in block_of:
            continue
        users = [block_of[c.name] for o in n.outputs for c in consumers.get(o, [])
                 if c.name in block_of]
        if any(o in outputs for o in n.outputs):
            users.append(last)
        if users:
            block_of[n.name] = min(users)
    by_name = {n.name: n for n in graph.nodes}
    members: list[list[str]] = [[] for _ in groups]
    for n in graph.nodes:
        if n.name in block_of:
            members[block_of[n.name]].append(n.name)
    # outputs of each block: what later blocks read, and the model's outputs
    needed_later: list[set[str]] = [set() for _ in groups]
    for n in graph.nodes:
        b = block_of.get(n.name)
        if b is None:
            continue
        for i in n.inputs:
            p = producers.get(i)
            if i and p is not None and i not in const and block_of.get(p.name, b) < b:
                needed_later[block_of[p.name]].add(i)
    blocks = []
    for b, (name, kind, first, last_seg) in enumerate(groups):
        produced = [o for nm in members[b] for o in by_name[nm].outputs if o]
        outs = [o for o in produced if o in needed_later[b] or o in outputs]
        s_in = seg_end.get(first - 1) if first > 0 else None
        s_out = seg_end.get(last_seg)
        blocks.append(_make(graph, name, kind, members[b], outs, producers, const, s_in, s_out))
    return blocks


def _make(graph: Graph, name: str, kind: str, node_names: list[str], outputs: list[str],
          producers: dict[str, Node], const: set[str], stream_in: str | None,
          stream_out: str | None) -> Block:
    """A block from its nodes, with the constant subgraphs they read copied in."""
    keep = set(node_names)
    todo = list(node_names)
    by_name = {n.name: n for n in graph.nodes}
    while todo:
        n = by_name[todo.pop()]
        for i in n.inputs:
            p = producers.get(i)
            if i and i in const and p is not None and p.name not in keep:
                keep.add(p.name)
                todo.append(p.name)
    if not outputs:
        outputs = [v.name for v in graph.outputs]
    sub = graph.subgraph(keep, outputs, name=f"{graph.name}/{name}")
    return Block(name, kind, sub, tuple(v.name for v in sub.inputs), tuple(outputs), sub.digest(),
                 stream_in, stream_out)


def run_blocks(blocks: list[Block], feeds: dict, executor_factory=None) -> dict:  # type: ignore[type-arg]
    """Run ``blocks`` in order from the model ``feeds``; returns every block output by name.
    ``executor_factory(graph)`` builds each block's executor (default: Exact, fp32, CPU)."""
    from kcverify.models.executor import Executor

    make = executor_factory or (lambda g: Executor(g))
    env = dict(feeds)
    for block in blocks:
        outs = make(block.graph).run({k: env[k] for k in block.inputs})
        env.update(outs)
    return env


# --- the sample axis of every tensor (semantics §1.1: "the sample axis comes from the model's
# inputs and is tracked through the graph") ------------------------------------------------
UNKNOWN = "unknown"
SampleAxis = int | str | None  # an axis; None: no sample axis (the same for every sample); UNKNOWN

_SAME = frozenset({
    "Relu", "LeakyRelu", "PRelu", "Sigmoid", "Tanh", "Gelu", "Softplus", "HardSigmoid", "Clip",
    "Exp", "Log", "Sqrt", "Reciprocal", "Neg", "Abs", "Erf", "Cast", "CastLike", "Identity",
    "Dropout", "Not", "Sign", "Floor", "Ceil", "Round", "IsNaN", "IsInf", "Trilu", "Elu", "Selu",
    "Mish", "HardSwish", "Sin", "Cos", "QuantizeLinear", "DequantizeLinear", "Split", "Slice"})
_BROADCAST = frozenset({
    "Add", "Sub", "Mul", "Div", "Pow", "Where", "Max", "Min", "Sum", "Mean", "Equal", "Less",
    "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor", "Mod", "Expand", "BitShift"})
_NORM_LAST = frozenset({"Softmax", "LogSoftmax", "LayerNormalization", "RMSNormalization"})
_REDUCE = frozenset({"ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd",
                     "ReduceL1", "ReduceL2", "ReduceSumSquare", "ReduceLogSumExp"})


def _dims(graph: Graph, name: str) -> tuple | None:
    shape = graph.info(name).shape
    return None if shape is None else tuple(shape)


def _rank(graph: Graph, name: str) -> int | None:
    d = _dims(graph, name)
    return None if d is None else len(d)


def _merge(axes: list[SampleAxis]) -> SampleAxis:
    """The output's axis from its inputs' (already moved to the output's rank)."""
    known = [a for a in axes if a is not None]
    if not known:
        return None
    if any(a == UNKNOWN for a in known) or len(set(known)) > 1:
        return UNKNOWN
    return known[0]


def _prefix(dims: tuple, k: int) -> tuple | None:
    """The product of dims[:k] as (int factor, sorted symbols), None if a dim is unknown."""
    f, syms = 1, []
    for d in dims[:k]:
        if isinstance(d, int):
            f *= d
        elif isinstance(d, str) and d:
            syms.append(d)
        else:
            return None
    return f, tuple(sorted(syms))


def _reshaped(src: tuple | None, dst: tuple | None, a: int) -> SampleAxis:
    """The sample axis after a reshape from ``src`` to ``dst``: the axis j with the same size and
    the same product of the axes before it (then the sample's elements are the same)."""
    if src is None or dst is None:
        return UNKNOWN
    pre = _prefix(src, a)
    if pre is None:
        return UNKNOWN
    hits = [j for j in range(len(dst)) if dst[j] == src[a] and _prefix(dst, j) == pre]
    return hits[0] if len(hits) == 1 else UNKNOWN


def _attr_ints(node: Node, key: str) -> list[int] | None:
    v = node.attrs.get(key)
    return None if v is None else [int(x) for x in np.asarray(v).reshape(-1)]


def _const_ints(graph: Graph, name: str | None) -> list[int] | None:
    if not name or name not in graph.initializers:
        for n in graph.nodes:
            if name and n.op_type == "Constant" and n.outputs and n.outputs[0] == name:
                v = n.attrs.get("value")
                return None if v is None else [int(x) for x in np.asarray(v).reshape(-1)]
        return None
    return [int(x) for x in np.asarray(graph.initializers[name]).reshape(-1)]


def _node_axis(graph: Graph, n: Node, axes: dict[str, SampleAxis], out: str) -> SampleAxis:
    ins = [i for i in n.inputs if i]
    if all(axes.get(i) is None for i in ins):
        return None
    r_out = _rank(graph, out)
    op = n.op_type
    x0 = n.inputs[0] if n.inputs else ""
    a0 = axes.get(x0)
    r0 = _rank(graph, x0) if x0 else None
    if op in ("Shape", "Size"):
        return None
    if op in _NORM_LAST:
        if isinstance(a0, int):
            if r0 is None:
                return UNKNOWN
            coerced = op in ("Softmax", "LogSoftmax") and opset_of(graph) < 13
            ax = int(n.attrs.get("axis", 1 if coerced else -1)) % r0
            normalised = range(ax, r0) if (coerced or op not in ("Softmax", "LogSoftmax")) else (ax,)
            if a0 in normalised:
                return UNKNOWN  # the op mixes samples
        return _merge([a0] + [None if axes.get(i) is None else UNKNOWN for i in ins[1:]])
    if op in _SAME:
        return _merge([a0] + [None if axes.get(i) is None else UNKNOWN for i in ins[1:]])
    if op in _BROADCAST:
        if r_out is None:
            return UNKNOWN
        moved: list[SampleAxis] = []
        for i in ins:
            a = axes.get(i)
            r = _rank(graph, i)
            if isinstance(a, int):
                moved.append(UNKNOWN if r is None else a + (r_out - r))
            else:
                moved.append(a)
        return _merge(moved)
    if op == "Transpose":
        if not isinstance(a0, int) or r0 is None:
            return a0
        perm = _attr_ints(n, "perm") or list(reversed(range(r0)))
        return perm.index(a0)
    if op in ("Reshape", "Flatten", "Squeeze", "Unsqueeze"):
        if not isinstance(a0, int):
            return a0
        return _reshaped(_dims(graph, x0), _dims(graph, out), a0)
    if op in ("MatMul", "Gemm"):
        if r_out is None:
            return UNKNOWN
        moved = []
        for k, i in enumerate(n.inputs[:2]):
            a = axes.get(i)
            r = _rank(graph, i)
            if not isinstance(a, int):
                moved.append(a)
                continue
            if r is None:
                moved.append(UNKNOWN)
                continue
            if op == "Gemm":
                t = int(n.attrs.get("transA" if k == 0 else "transB", 0))
                free = (1 if t else 0) if k == 0 else (0 if t else 1)
                moved.append((0 if k == 0 else 1) if a == free else UNKNOWN)
                continue
            if r == 1:
                moved.append(UNKNOWN)
            elif k == 0:
                moved.append(r_out - 2 if a == r - 2 else UNKNOWN if a == r - 1 else a + r_out - r)
            else:
                moved.append(r_out - 1 if a == r - 1 else UNKNOWN if a == r - 2 else a + r_out - r)
        if op == "Gemm" and len(n.inputs) > 2 and n.inputs[2]:
            c = axes.get(n.inputs[2])
            rc = _rank(graph, n.inputs[2])
            moved.append(c + 2 - rc if isinstance(c, int) and rc is not None else c)
        return _merge(moved)
    if op == "Gather":
        g = int(n.attrs.get("axis", 0))
        ri = _rank(graph, n.inputs[1])
        ai = axes.get(n.inputs[1])
        if r0 is None or ri is None:
            return UNKNOWN
        g %= r0
        moved = []
        if isinstance(a0, int):
            moved.append(UNKNOWN if a0 == g else a0 if a0 < g else a0 - 1 + ri)
        else:
            moved.append(a0)
        moved.append(ai + g if isinstance(ai, int) else ai)
        return _merge(moved)
    if op == "Concat":
        c = int(n.attrs.get("axis", 0))
        rank = r_out
        alist = [axes.get(i) for i in ins]
        m = _merge(alist)
        if isinstance(m, int) and rank is not None and m == c % rank:
            return UNKNOWN
        return m
    if op in _REDUCE:
        if not isinstance(a0, int) or r0 is None:
            return a0
        red = _attr_ints(n, "axes")
        if red is None and len(n.inputs) > 1:
            red = _const_ints(graph, n.inputs[1])
        if red is None:
            return UNKNOWN if int(n.attrs.get("noop_with_empty_axes", 0)) == 0 else a0
        red = sorted(x % r0 for x in red)
        if a0 in red:
            return UNKNOWN
        if int(n.attrs.get("keepdims", 1)):
            return a0
        return a0 - sum(1 for x in red if x < a0)
    if op == "Conv":
        return 0 if a0 == 0 and _merge([axes.get(i) for i in ins[1:]]) is None else UNKNOWN
    return UNKNOWN


def opset_of(graph: Graph) -> int:
    return int(getattr(graph, "opset", 17) or 17)


def sample_axes(graph: Graph, inputs: dict[str, SampleAxis] | None = None) -> dict[str, SampleAxis]:
    """The sample axis of every tensor of ``graph``: axis 0 of each float or integer graph input
    (the batch axis, kcverify.bounds' convention), unless ``inputs`` says otherwise, tracked
    through the ops with the graph's shapes; None for tensors that are the same for every
    sample (constants, shapes), UNKNOWN where an op merges or mixes the sample axis (e.g. a
    reshape that folds it into the heads)."""
    const = graph.constant_names()
    axes: dict[str, SampleAxis] = {c: None for c in const}
    for v in graph.inputs:
        if inputs is not None and v.name in inputs:
            axes[v.name] = inputs[v.name]
        else:
            r = _rank(graph, v.name)
            axes[v.name] = 0 if r is None or r > 0 else None
    for n in graph.nodes:
        for o in n.outputs:
            if not o or o in const:
                continue
            try:
                axes[o] = _node_axis(graph, n, axes, o)
            except (ValueError, TypeError, IndexError):
                axes[o] = UNKNOWN
    return axes
