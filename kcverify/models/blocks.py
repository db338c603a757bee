"""Segment a model along its residual stream into standalone blocks (DESIGN 2, 6).

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

from dataclasses import dataclass

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
    """The model's blocks, in order (see the module docstring)."""
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
