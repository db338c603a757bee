"""Input splitting (branch and bound) for clauses over boxes.

    out = branch_and_bound(lo, hi, objective, budget_s=60)
    out.verdict          # "proved" | "refuted" | "unknown"
    out.bound            # the best certified value over the whole box (max over the leaves)
    out.proved_fraction  # fraction of the box volume whose parts are proved
    out.leaves           # the partition's parts (lo, hi, value, proved), in preorder of
    out.tree             # the bisection tree (split dimension per node, -1 for a leaf)

An *objective* bounds a batch of boxes at once (one tensor program, the batch axis of the
bound domain; ``Objective.evaluate(lo, hi, prior) -> PartEval``): per part whether the clause
holds on it, the certified value (e.g. the L-inf drift bound), the input dimension to split
next, and what its children inherit (``inherit``: the certified pre-activation boxes of every
ReLU, valid on any subset of the part; a child's run meets its own boxes with them).
The driver keeps a stack of open parts; each round it bounds up to ``batch`` of them together,
keeps the proved ones as leaves and bisects the others on their chosen dimension. It stops when
every part is proved (verdict proved: the leaves partition the box and each is proved), when the
objective's falsifier confirms a counterexample (refuted), or when the budget (seconds, parts)
ends (unknown, with the best bound: an open part inherits its parent's certified value, which
holds on it because it is a subset).

The split dimension is the objective's estimate of where splitting helps most: for the chain
domain, the input with the largest |coefficient| x width in the form of the worst output (the
gradient-times-width heuristic of ReluDiff / NeuroDiff); without one, the widest dimension
relative to the original box. Children share their cut point (lo..mid, mid..hi), so the leaves
cover the box exactly.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

INF = math.inf


@dataclass
class PartEval:
    """What an objective says about a batch of parts (arrays of length batch)."""

    proved: np.ndarray  # bool
    value: np.ndarray  # float: the certified value on the part (inf: none)
    split_dim: np.ndarray  # int
    counterexample: Any = None  # a confirmed counterexample, when the objective found one
    inherit: np.ndarray | None = None  # per part, what its children may start from (prior)


class Objective(Protocol):
    def evaluate(self, lo: np.ndarray, hi: np.ndarray, prior: Any = None) -> PartEval: ...


@dataclass
class Leaf:
    lo: np.ndarray
    hi: np.ndarray
    value: float
    proved: bool


@dataclass
class SplitOutcome:
    verdict: str
    bound: float
    proved_fraction: float
    leaves: list[Leaf]
    parts_bounded: int
    rounds: int
    seconds: float
    counterexample: Any = None
    stopped: str = ""  # why the search ended without a proof
    notes: list[str] = field(default_factory=list)
    tree: list[int] = field(default_factory=list)  # preorder: split dimension, or -1 (leaf)

    def proved_leaves(self) -> list[Leaf]:
        return [lf for lf in self.leaves if lf.proved]


def bisect(lo: np.ndarray, hi: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cut points of parts (k, n) on dimensions d (k,): lo + (hi - lo) / 2 in float64, kept
    in [lo, hi]; the children are [lo, mid] and [mid, hi] on d. The certificate checker
    replays exactly this to rebuild a partition from its tree."""
    idx = np.arange(len(d))
    a, b = lo[idx, d], hi[idx, d]
    return np.clip(a + 0.5 * (b - a), a, b), idx


@dataclass
class TreeNodes:
    """The nodes of a bisection tree in preorder: boxes, parent (-1 at the root), depth, and
    whether each is a leaf."""

    lo: np.ndarray
    hi: np.ndarray
    parent: np.ndarray
    depth: np.ndarray
    leaf: np.ndarray


def tree_nodes(lo: np.ndarray, hi: np.ndarray, tree: list[int]) -> TreeNodes:
    """Every node of a bisection tree over [lo, hi] (``bisect``), preorder; ValueError when the
    tree is malformed (a dimension out of range, missing or extra nodes)."""
    lo = np.asarray(lo, dtype=np.float64)
    hi = np.asarray(hi, dtype=np.float64)
    n_lo, n_hi, parent, depth, leaf = [], [], [], [], []
    stack = [(lo, hi, -1, 0)]
    pos = 0
    while stack:
        if pos >= len(tree):
            raise ValueError("the tree ends before every part is a leaf")
        a, b, par, dep = stack.pop()
        d = tree[pos]
        if not isinstance(d, int) or isinstance(d, bool) or d < -1 or d >= len(lo):
            raise ValueError(f"tree entry {pos}: {d!r} is neither -1 nor a dimension")
        me = pos
        pos += 1
        n_lo.append(a)
        n_hi.append(b)
        parent.append(par)
        depth.append(dep)
        leaf.append(d == -1)
        if d == -1:
            continue
        mid, _ = bisect(a[None], b[None], np.array([d]))
        left_hi, right_lo = b.copy(), a.copy()
        left_hi[d] = right_lo[d] = mid[0]
        stack.append((right_lo, b, me, dep + 1))
        stack.append((a, left_hi, me, dep + 1))
    if pos != len(tree):
        raise ValueError(f"the tree has {len(tree) - pos} entries after its last leaf")
    k = len(lo)
    return TreeNodes(np.array(n_lo).reshape(-1, k), np.array(n_hi).reshape(-1, k),
                     np.array(parent), np.array(depth), np.array(leaf, dtype=bool))


def replay(lo: np.ndarray, hi: np.ndarray, tree: list[int], objective: Objective,
           batch: int = 512) -> np.ndarray:
    """Each leaf's value (preorder) as the split computed it: every node bounded from its box
    and what its parent passed down (``PartEval.inherit``), level by level. What a certificate
    checker re-runs."""
    nodes = tree_nodes(lo, hi, tree)
    values = np.full(len(nodes.lo), INF)
    inherit: dict[int, np.ndarray] = {}
    for dep in range(int(nodes.depth.max()) + 1 if len(nodes.depth) else 0):
        ids = np.flatnonzero(nodes.depth == dep)
        for k in range(0, len(ids), batch):
            chunk = ids[k:k + batch]
            par = nodes.parent[chunk]
            prior = None
            if dep > 0 and all(int(q) in inherit for q in par):
                prior = np.stack([inherit[int(q)] for q in par])
            ev = objective.evaluate(nodes.lo[chunk], nodes.hi[chunk], prior=prior)
            values[chunk] = ev.value
            if ev.inherit is not None:
                for i, node in enumerate(chunk):
                    if not nodes.leaf[node]:
                        inherit[int(node)] = np.asarray(ev.inherit[i])
        for q in {int(q) for q in nodes.parent[ids] if q >= 0}:
            inherit.pop(q, None)  # a level's parents are no longer needed
    return values[nodes.leaf]


def leaves_of(lo: np.ndarray, hi: np.ndarray, tree: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The leaf boxes (preorder) of a bisection tree over [lo, hi] (see ``bisect``); ValueError
    when the tree is malformed (a dimension out of range, missing or extra nodes)."""
    lo = np.asarray(lo, dtype=np.float64)
    hi = np.asarray(hi, dtype=np.float64)
    out_lo, out_hi = [], []
    stack = [(lo, hi)]
    pos = 0
    while stack:
        if pos >= len(tree):
            raise ValueError("the tree ends before every part is a leaf")
        a, b = stack.pop()
        d = tree[pos]
        pos += 1
        if not isinstance(d, int) or isinstance(d, bool) or d < -1 or d >= len(lo):
            raise ValueError(f"tree entry {pos - 1}: {d!r} is neither -1 nor a dimension")
        if d == -1:
            out_lo.append(a)
            out_hi.append(b)
            continue
        mid, _ = bisect(a[None], b[None], np.array([d]))
        left_hi, right_lo = b.copy(), a.copy()
        left_hi[d] = right_lo[d] = mid[0]
        stack.append((right_lo, b))
        stack.append((a, left_hi))
    if pos != len(tree):
        raise ValueError(f"the tree has {len(tree) - pos} entries after its last leaf")
    return np.array(out_lo).reshape(-1, len(lo)), np.array(out_hi).reshape(-1, len(lo))


def _volume(lo: np.ndarray, hi: np.ndarray, live: np.ndarray) -> np.ndarray:
    """Volumes (over the box's non-degenerate dimensions) of parts (k, n)."""
    w = (hi - lo)[:, live]
    return np.prod(w, axis=1) if w.shape[1] else np.ones(len(lo))


def widest(lo: np.ndarray, hi: np.ndarray, width0: np.ndarray) -> np.ndarray:
    """The dimension with the largest width relative to the original box (a fallback)."""
    rel = np.where(width0 > 0, (hi - lo) / np.where(width0 > 0, width0, 1.0), -1.0)
    return np.argmax(rel, axis=1)


def branch_and_bound(lo: np.ndarray, hi: np.ndarray, objective: Objective,
                     budget_s: float = 60.0, max_parts: int = 1_000_000, batch: int = 1024,
                     min_width: float = 0.0,
                     progress: Callable[[str], None] | None = None) -> SplitOutcome:
    """Split the box [lo, hi] (n,) until ``objective`` proves every part (see module doc)."""
    t0 = time.perf_counter()
    lo = np.asarray(lo, dtype=np.float64).reshape(-1)
    hi = np.asarray(hi, dtype=np.float64).reshape(-1)
    if lo.shape != hi.shape or np.any(lo > hi) or not (np.all(np.isfinite(lo))
                                                      and np.all(np.isfinite(hi))):
        raise ValueError("branch_and_bound needs a finite, non-empty box")
    width0 = hi - lo
    live = width0 > 0
    vol0 = float(_volume(lo[None], hi[None], live)[0])
    # the stack of open parts with the certified value of their parent (inf at the root)
    st_lo, st_hi, st_val = [lo[None]], [hi[None]], [np.array([INF])]
    st_id = [np.array([0])]
    st_pay: list[np.ndarray] | None = None  # inherited boxes per open part (once known)
    split_of: dict[int, tuple[int, int, int]] = {}  # node -> (dimension, left, right)
    leaf_of: dict[int, Leaf] = {}
    next_id = 1
    leaves: list[Leaf] = []
    proved_vol = 0.0
    bounded = rounds = 0
    stopped = ""
    cex = None

    def pending() -> int:
        return sum(len(a) for a in st_lo)

    while pending():
        if time.perf_counter() - t0 > budget_s:
            stopped = "time budget"
            break
        if bounded >= max_parts:
            stopped = "part budget"
            break
        P_lo, P_hi, P_val, P_id = (np.concatenate(st_lo), np.concatenate(st_hi),
                                   np.concatenate(st_val), np.concatenate(st_id))
        take = min(batch, len(P_lo))
        b_lo, b_hi, b_id = P_lo[-take:], P_hi[-take:], P_id[-take:]  # last in, first out
        st_lo, st_hi, st_val, st_id = [P_lo[:-take]], [P_hi[:-take]], [P_val[:-take]], \
            [P_id[:-take]]
        prior = None
        if st_pay is not None:
            P_pay = np.concatenate(st_pay)
            prior, st_pay = P_pay[-take:], [P_pay[:-take]]
        ev = objective.evaluate(b_lo, b_hi, prior=prior)
        bounded += take
        rounds += 1
        if ev.counterexample is not None:
            cex = ev.counterexample
            stopped = "counterexample"
            st_lo.append(b_lo)
            st_hi.append(b_hi)
            st_val.append(np.full(take, INF))
            st_id.append(b_id)
            if st_pay is not None and prior is not None:
                st_pay.append(prior)
            break
        own = np.asarray(ev.value, dtype=np.float64)
        val = np.minimum(own, P_val[-take:])
        ok = np.asarray(ev.proved, dtype=bool)
        for k in np.flatnonzero(ok):  # a proved part's value is its own (what a re-check gives)
            leaf = Leaf(b_lo[k].copy(), b_hi[k].copy(), float(own[k]), True)
            leaves.append(leaf)
            leaf_of[int(b_id[k])] = leaf
        proved_vol += float(_volume(b_lo[ok], b_hi[ok], live).sum()) if ok.any() else 0.0
        o_lo, o_hi, o_val, o_id = b_lo[~ok], b_hi[~ok], val[~ok], b_id[~ok]
        o_pay = None if ev.inherit is None else np.asarray(ev.inherit)[~ok]
        if len(o_lo) == 0:
            continue
        d = np.asarray(ev.split_dim, dtype=np.int64)[~ok]
        w = o_hi[np.arange(len(d)), d] - o_lo[np.arange(len(d)), d]
        thin = w <= max(min_width, 0.0)
        if thin.any():  # the chosen dimension cannot be cut: the widest one instead
            d[thin] = widest(o_lo[thin], o_hi[thin], width0)
            w = o_hi[np.arange(len(d)), d] - o_lo[np.arange(len(d)), d]
        stuck = ~(w > 0) | (w <= min_width)
        if stuck.any():  # nothing left to cut (a point): these parts stay open
            for k in np.flatnonzero(stuck):
                leaf = Leaf(o_lo[k].copy(), o_hi[k].copy(), float(o_val[k]), False)
                leaves.append(leaf)
                leaf_of[int(o_id[k])] = leaf
            keep = ~stuck
            o_lo, o_hi, o_val, o_id, d = o_lo[keep], o_hi[keep], o_val[keep], o_id[keep], d[keep]
            o_pay = None if o_pay is None else o_pay[keep]
            if not len(d):
                continue
        mid, idx = bisect(o_lo, o_hi, d)
        left_hi = o_hi.copy()
        left_hi[idx, d] = mid
        right_lo = o_lo.copy()
        right_lo[idx, d] = mid
        left_id = np.arange(next_id, next_id + len(d))
        right_id = left_id + len(d)
        next_id += 2 * len(d)
        for k in range(len(d)):
            split_of[int(o_id[k])] = (int(d[k]), int(left_id[k]), int(right_id[k]))
        st_lo.append(np.concatenate([o_lo, right_lo]))
        st_hi.append(np.concatenate([left_hi, o_hi]))
        st_val.append(np.concatenate([o_val, o_val]))
        st_id.append(np.concatenate([left_id, right_id]))
        if o_pay is not None:
            if st_pay is None:  # the first payload: everything before it inherits nothing
                st_pay = [np.full((sum(len(a) for a in st_lo) - 2 * len(d), *o_pay.shape[1:]),
                                  np.nan)]
                st_pay[0][..., 0::2, :] = -INF
                st_pay[0][..., 1::2, :] = INF
            st_pay.append(np.concatenate([o_pay, o_pay]))
        if progress is not None and rounds % 20 == 0:
            progress(f"split: {bounded} parts bounded, {pending()} open, "
                     f"{proved_vol / vol0 if vol0 else 0:.1%} of the volume proved")
    P_lo, P_hi, P_val, P_id = (np.concatenate(st_lo), np.concatenate(st_hi),
                               np.concatenate(st_val), np.concatenate(st_id))
    for k in range(len(P_lo)):
        leaf = Leaf(P_lo[k].copy(), P_hi[k].copy(), float(P_val[k]), False)
        leaves.append(leaf)
        leaf_of[int(P_id[k])] = leaf
    tree: list[int] = []
    ordered: list[Leaf] = []
    todo = [0]
    while todo:  # preorder: the certificate's partition record
        node = todo.pop()
        if node in split_of:
            dim, left, right = split_of[node]
            tree.append(dim)
            todo += [right, left]
        else:
            tree.append(-1)
            ordered.append(leaf_of[node])
    leaves = ordered
    all_proved = cex is None and all(lf.proved for lf in leaves)
    verdict = "refuted" if cex is not None else ("proved" if all_proved else "unknown")
    bound = max((lf.value for lf in leaves), default=INF)
    if vol0 > 0:
        frac = proved_vol / vol0
    else:  # a degenerate box: count parts
        frac = 1.0 if all_proved else 0.0
    if not all_proved and not stopped:
        stopped = "parts that cannot be split further"
    return SplitOutcome(verdict, bound, min(frac, 1.0), leaves, bounded, rounds,
                        time.perf_counter() - t0, cex, stopped, tree=tree)
