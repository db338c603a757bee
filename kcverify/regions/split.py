"""Input splitting (branch and bound) for clauses over boxes.

    out = branch_and_bound(lo, hi, objective, budget_s=60)
    out.verdict          # "proved" | "refuted" | "unknown"
    out.bound            # the best certified value over the whole box (max over the leaves)
    out.proved_fraction  # fraction of the box volume whose parts are proved
    out.leaves           # the partition's parts (lo, hi, value, proved), in preorder of
    out.tree             # the bisection tree (split dimension per node, -1 for a leaf,
                         # -2 - d for a cut on d of a node that was not bounded)

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

**Quartering far parts** (``quad``): a part whose certified value is above ``quad`` (the drift
objective: 3 eps) needs more than one cut (a cut shrinks a stalled part's bound 2-9x), so its
chosen cut's halves are cut again on the same dimension and the four quarters are bounded at
once; the two halves between are *not bounded* (the tree records them as ``-2 - d``) and the
quarters inherit what the part passed down (its boxes hold on every subset). That saves the
halves' full bounds and their cut choice: on ACAS Xu 3_3 and 2_6 at eps 0.1, 20.9 CPU s to a
proof of both against 27.7 (docs/regions.md). A part above ``quad * deeper`` (30 eps) gets one
more level (eighths, ``MAX_EXTRA``): 3_3, 2_6, 3_5 and 2_2 at eps 0.05 are all proved in 12-14
CPU s each, none in 15 with quarters alone (bounds 0.056-0.22) nor without (0.10-0.27). The cover argument is unchanged: the tree records
cuts, and a node that is not bounded only passes its parent's boxes on.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

INF = math.inf
MAX_EXTRA = 2  # a far part is cut in at most 2^(1 + MAX_EXTRA) at once


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
    bounded: np.ndarray  # False: an inner node recorded as -2 - d (only passes its prior on)


def _tree_dim(d: Any, pos: int, n: int) -> int:
    """The split dimension of tree entry ``d`` at ``pos`` (-1 for a leaf; ``-2 - k``, a cut on
    k of a node that was not bounded, gives k); ValueError for anything else."""
    if isinstance(d, int) and not isinstance(d, bool):
        if -1 <= d < n:
            return d
        if -2 - n < d <= -2:
            return -2 - d
    raise ValueError(f"tree entry {pos}: {d!r} is neither -1, a dimension nor -2 - dimension")


def tree_nodes(lo: np.ndarray, hi: np.ndarray, tree: list[int]) -> TreeNodes:
    """Every node of a bisection tree over [lo, hi] (``bisect``), preorder; ValueError when the
    tree is malformed (a dimension out of range, missing or extra nodes)."""
    lo = np.asarray(lo, dtype=np.float64)
    hi = np.asarray(hi, dtype=np.float64)
    n_lo, n_hi, parent, depth, leaf, bounded = [], [], [], [], [], []
    stack = [(lo, hi, -1, 0)]
    pos = 0
    while stack:
        if pos >= len(tree):
            raise ValueError("the tree ends before every part is a leaf")
        a, b, par, dep = stack.pop()
        d = tree[pos]
        d = _tree_dim(d, pos, len(lo))
        me = pos
        pos += 1
        n_lo.append(a)
        n_hi.append(b)
        parent.append(par)
        depth.append(dep)
        leaf.append(d == -1)
        bounded.append(tree[me] >= -1)
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
                     np.array(parent), np.array(depth), np.array(leaf, dtype=bool),
                     np.array(bounded, dtype=bool))


def replay(lo: np.ndarray, hi: np.ndarray, tree: list[int], objective: Objective,
           batch: int = 512) -> np.ndarray:
    """Each leaf's value (preorder) as the split computed it: every bounded node bounded from
    its box and what its parent passed down (``PartEval.inherit``), level by level; a node that
    was not bounded (``-2 - d``) passes its parent's on. What a certificate checker re-runs."""
    nodes = tree_nodes(lo, hi, tree)
    values = np.full(len(nodes.lo), INF)
    inherit: dict[int, np.ndarray] = {}
    for dep in range(int(nodes.depth.max()) + 1 if len(nodes.depth) else 0):
        level = ids = np.flatnonzero(nodes.depth == dep)
        for node in ids[~nodes.bounded[ids]]:
            q = int(nodes.parent[node])
            if q in inherit:
                inherit[int(node)] = inherit[q]
        ids = ids[nodes.bounded[ids]]
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
        for q in {int(q) for q in nodes.parent[level] if q >= 0}:
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
        d = _tree_dim(tree[pos], pos, len(lo))
        pos += 1
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


def _cut_dims(lo: np.ndarray, hi: np.ndarray, hint: np.ndarray, strong: int,
              min_width: float, width0: np.ndarray) -> list[np.ndarray]:
    """Per part, the dimensions whose bisection is tried: every cuttable one (width above
    ``min_width``) when there are at most ``strong`` of them, else the objective's hint (the
    widest cuttable dimension where the hint cannot be cut); empty for a part that is a point."""
    w = hi - lo
    cut = (w > 0) & (w > min_width)
    out = []
    for k in range(len(lo)):
        dims = np.flatnonzero(cut[k])
        if len(dims) > strong:
            h = int(hint[k])
            if not cut[k, h]:
                rel = np.where(cut[k] & (width0 > 0), w[k] / np.where(width0 > 0, width0, 1.0), -1)
                h = int(np.argmax(rel))
            dims = np.array([h])
        out.append(dims)
    return out


def cut_options(objective: Any, chain: bool) -> dict[str, Any]:
    """branch_and_bound's cut options for an objective: with the chain domain, strong branching
    whose candidates are bounded by the forward-only domain (``objective.chooser()``); with the
    bound engine's domains (models that are not chains) the objective's own choice, one cut.
    ``quad``: the objective's ``quad_above`` (parts above it are quartered), else never."""
    quad = float(getattr(objective, "quad_above", INF))
    deeper = float(getattr(objective, "deeper", INF))
    if chain:
        return {"strong": 8, "chooser": objective.chooser(), "quad": quad, "deeper": deeper}
    return {"strong": 0, "chooser": None, "quad": quad, "deeper": deeper}


def _deepen(lo: np.ndarray, hi: np.ndarray, par: np.ndarray, dim: np.ndarray,
            extra: np.ndarray) -> tuple:
    """The halves (pairs, one per parent), each bisected ``extra`` more times on the same
    dimension (``bisect``): 2^extra parts in order along it; and per row the index of the half
    it came from."""
    out_lo, out_hi, keep = [], [], []
    for i in range(len(lo)):
        d = int(dim[i])
        parts = [(lo[i], hi[i])]
        for _ in range(int(extra[i])):
            finer = []
            for a, b in parts:
                mid, _ = bisect(a[None], b[None], np.array([d]))
                left_hi, right_lo = b.copy(), a.copy()
                left_hi[d] = right_lo[d] = mid[0]
                finer += [(a, left_hi), (right_lo, b)]
            parts = finer
        out_lo += [a for a, _ in parts]
        out_hi += [b for _, b in parts]
        keep += [i] * len(parts)
    keep_a = np.array(keep)
    return np.array(out_lo), np.array(out_hi), par[keep_a], dim[keep_a], keep_a


def _subtree(d: int, parts: list[int], next_id: int, split_of: dict, unbounded: set
             ) -> tuple[int, int]:
    """A complete bisection tree on d over ``parts`` (node ids in order along d): its root (the
    part itself when there is one) and the next free id; its inner nodes are not bounded."""
    if len(parts) == 1:
        return parts[0], next_id
    node, h = next_id, len(parts) // 2
    left, nxt = _subtree(d, parts[:h], next_id + 1, split_of, unbounded)
    right, nxt = _subtree(d, parts[h:], nxt, split_of, unbounded)
    split_of[node] = (d, left, right)
    unbounded.add(node)
    return node, nxt


def _best_cuts(value: np.ndarray, c_par: np.ndarray, n_par: int) -> np.ndarray:
    """Per parent, the candidate cut (index of its pair of halves) whose worse half has the
    smallest value, ties broken by the better half; -1 for a parent without candidates."""
    own = np.asarray(value, dtype=np.float64)
    own = np.where(np.isnan(own), INF, own)
    worse = np.maximum(own[0::2], own[1::2])
    better = np.minimum(own[0::2], own[1::2])
    out = np.full(n_par, -1)
    par = c_par[0::2]
    for k in range(n_par):
        cand = np.flatnonzero(par == k)
        if len(cand):
            out[k] = cand[np.lexsort((better[cand], worse[cand]))[0]]
    return out


def branch_and_bound(lo: np.ndarray, hi: np.ndarray, objective: Objective,
                     budget_s: float = 60.0, max_parts: int = 1_000_000, batch: int = 1024,
                     min_width: float = 0.0, strong: int = 8, chooser: Objective | None = None,
                     progress: Callable[[str], None] | None = None, quad: float = INF,
                     deeper: float = INF, clock: Callable[[], float] = time.perf_counter
                     ) -> SplitOutcome:
    """Split the box [lo, hi] (n,) until ``objective`` proves every part (see module doc).

    Every open part on the stack has been bounded. A round takes open parts, bounds the two
    halves of each along every candidate dimension (``strong`` branching: all cuttable
    dimensions when there are at most ``strong``; else the objective's choice), keeps per part
    the cut whose worse half has the smaller value, records its proved halves as leaves and
    pushes the others. About ``batch`` halves are bounded per call. A part whose value is above
    ``quad`` is quartered on its chosen dimension (module doc), the halves between not bounded;
    one above ``quad * deeper`` is cut in eighths. ``clock``: what ``budget_s`` is measured on
    (wall-clock seconds; ``time.process_time`` for CPU seconds, steadier on a shared machine)."""
    t0 = clock()
    lo = np.asarray(lo, dtype=np.float64).reshape(-1)
    hi = np.asarray(hi, dtype=np.float64).reshape(-1)
    if lo.shape != hi.shape or np.any(lo > hi) or not (np.all(np.isfinite(lo))
                                                      and np.all(np.isfinite(hi))):
        raise ValueError("branch_and_bound needs a finite, non-empty box")
    width0 = hi - lo
    live = width0 > 0
    vol0 = float(_volume(lo[None], hi[None], live)[0])
    split_of: dict[int, tuple[int, int, int]] = {}  # node -> (dimension, left, right)
    unbounded: set[int] = set()  # inner nodes whose children were bounded without them
    leaf_of: dict[int, Leaf] = {}
    proved_vol = 0.0
    bounded = rounds = 0
    stopped = ""
    cex = None
    next_id = 1
    # the open parts (bounded, not proved): box, id, value (own met with the parent's),
    # the objective's split hint and what the part's children inherit
    op_lo: list[np.ndarray] = []
    op_hi: list[np.ndarray] = []
    op_id: list[int] = []
    op_val: list[float] = []
    op_hint: list[int] = []
    op_pay: list[Any] = []

    def take_eval(ev: PartEval, b_lo: np.ndarray, b_hi: np.ndarray, ids: np.ndarray,
                  parent_val: np.ndarray, rows: np.ndarray) -> None:
        """Record the bounded parts ``rows`` of ``ev``: proved ones as leaves, the others open."""
        nonlocal proved_vol
        own = np.asarray(ev.value, dtype=np.float64)
        ok = np.asarray(ev.proved, dtype=bool)
        for r, pid, pv in zip(rows, ids, parent_val):
            if ok[r]:  # a proved part's value is its own (what a re-check gives)
                leaf_of[int(pid)] = Leaf(b_lo[r].copy(), b_hi[r].copy(), float(own[r]), True)
                proved_vol += float(_volume(b_lo[r][None], b_hi[r][None], live)[0])
                continue
            op_lo.append(b_lo[r].copy())
            op_hi.append(b_hi[r].copy())
            op_id.append(int(pid))
            op_val.append(float(min(own[r], pv)))
            op_hint.append(int(np.asarray(ev.split_dim)[r]))
            op_pay.append(None if ev.inherit is None else np.asarray(ev.inherit[r]))

    ev = objective.evaluate(lo[None], hi[None], prior=None)
    bounded, rounds = 1, 1
    if ev.counterexample is not None:
        cex, stopped = ev.counterexample, "counterexample"
        op_lo, op_hi, op_id, op_val, op_hint, op_pay = [lo], [hi], [0], [INF], [0], [None]
    else:
        take_eval(ev, lo[None], hi[None], np.array([0]), np.array([INF]), np.array([0]))
    while op_id and cex is None:
        if clock() - t0 > budget_s:
            stopped = "time budget"
            break
        if bounded >= max_parts:
            stopped = "part budget"
            break
        # last in, first out: parents whose candidate halves fill about one batch
        P_lo, P_hi = np.array(op_lo[-batch:]), np.array(op_hi[-batch:])
        dims_all = _cut_dims(P_lo, P_hi, np.array(op_hint[-batch:]), strong, min_width, width0)
        n_par, n_child = 0, 0
        for k in range(len(dims_all) - 1, -1, -1):
            if n_par and n_child + 2 * len(dims_all[k]) > batch:
                break
            n_par += 1
            n_child += 2 * len(dims_all[k])
        sel = slice(len(op_id) - n_par, len(op_id))
        par_lo, par_hi = P_lo[len(P_lo) - n_par:], P_hi[len(P_hi) - n_par:]
        par_dims = dims_all[len(dims_all) - n_par:]
        par_id, par_val, par_pay = op_id[sel], op_val[sel], op_pay[sel]
        del op_lo[sel], op_hi[sel], op_id[sel], op_val[sel], op_hint[sel], op_pay[sel]
        c_lo, c_hi, c_par, c_dim, c_pay = [], [], [], [], []
        for k in range(n_par):
            dims = par_dims[k]
            if not len(dims):  # nothing left to cut (a point): this part stays open
                leaf_of[par_id[k]] = Leaf(par_lo[k].copy(), par_hi[k].copy(), par_val[k], False)
                continue
            mids, _ = bisect(np.repeat(par_lo[k][None], len(dims), 0),
                             np.repeat(par_hi[k][None], len(dims), 0), dims)
            for d, m in zip(dims, mids):
                left_hi, right_lo = par_hi[k].copy(), par_lo[k].copy()
                left_hi[d] = right_lo[d] = m
                c_lo += [par_lo[k], right_lo]
                c_hi += [left_hi, par_hi[k]]
                c_par += [k, k]
                c_dim += [int(d), int(d)]
                c_pay += [par_pay[k], par_pay[k]]
        if not c_lo:
            continue
        C_lo, C_hi = np.array(c_lo), np.array(c_hi)
        prior = None if any(p is None for p in c_pay) else np.stack(c_pay)
        rounds += 1
        c_par_a, c_dim_a = np.array(c_par), np.array(c_dim)
        if chooser is not None and len(C_lo) > 2 * n_par:  # cheap bounds pick the cut
            pick = _best_cuts(chooser.evaluate(C_lo, C_hi, prior=prior).value, c_par_a, n_par)
            rows = np.sort(np.concatenate([2 * pick, 2 * pick + 1]))
            C_lo, C_hi, c_par_a, c_dim_a = C_lo[rows], C_hi[rows], c_par_a[rows], c_dim_a[rows]
            prior = None if prior is None else prior[rows]
        # per half: the extra cuts of its parent's (only where one cut per parent was chosen)
        pv = np.array(par_val)[c_par_a]
        extra = sum((pv > quad * deeper ** i).astype(int) for i in range(MAX_EXTRA))
        extra *= bool(len(c_par_a) and np.bincount(c_par_a).max() == 2)
        quads = extra > 0
        if quads.any():
            C_lo, C_hi, c_par_a, c_dim_a, keep = _deepen(C_lo, C_hi, c_par_a, c_dim_a, extra)
            prior = None if prior is None else prior[keep]
        ev = objective.evaluate(C_lo, C_hi, prior=prior)
        bounded += len(C_lo)
        if ev.counterexample is not None:
            cex, stopped = ev.counterexample, "counterexample"
            for k in range(n_par):  # the parents stay open
                op_lo.append(par_lo[k])
                op_hi.append(par_hi[k])
                op_id.append(par_id[k])
                op_val.append(par_val[k])
                op_hint.append(0)
                op_pay.append(None)
            break
        if quads.any():  # one cut per parent was chosen before: its halves or quarters
            for k in np.unique(c_par_a):
                rows = np.flatnonzero(c_par_a == k)
                d = int(c_dim_a[rows[0]])
                ids = list(range(next_id, next_id + len(rows)))
                next_id += len(rows)
                h = len(ids) // 2
                left, next_id = _subtree(d, ids[:h], next_id, split_of, unbounded)
                right, next_id = _subtree(d, ids[h:], next_id, split_of, unbounded)
                split_of[par_id[k]] = (d, left, right)
                take_eval(ev, C_lo, C_hi, np.array(ids), np.full(len(rows), par_val[k]), rows)
        for k, best in enumerate([] if quads.any() else _best_cuts(ev.value, c_par_a, n_par)):
            if best < 0:
                continue
            d = int(c_dim_a[2 * best])
            left, right = next_id, next_id + 1
            next_id += 2
            split_of[par_id[k]] = (d, left, right)
            take_eval(ev, C_lo, C_hi, np.array([left, right]),
                      np.array([par_val[k], par_val[k]]), np.array([2 * best, 2 * best + 1]))
        if progress is not None and rounds % 20 == 0:
            progress(f"split: {bounded} parts bounded, {len(op_id)} open, "
                     f"{proved_vol / vol0 if vol0 else 0:.1%} of the volume proved")
    for k in range(len(op_id)):
        leaf_of[op_id[k]] = Leaf(op_lo[k], op_hi[k], op_val[k], False)
    tree: list[int] = []
    leaves: list[Leaf] = []
    todo = [0]
    while todo:  # preorder: the certificate's partition record
        node = todo.pop()
        if node in split_of:
            dim, left, right = split_of[node]
            tree.append(-2 - dim if node in unbounded else dim)
            todo += [right, left]
        else:
            tree.append(-1)
            leaves.append(leaf_of[node])
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
                        clock() - t0, cex, stopped, tree=tree)
