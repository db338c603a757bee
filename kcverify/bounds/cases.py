"""Proof by cases over the discrete decisions of fp8 casts (issue 12, lever 2).

A cast of an activation to a float format (fp8) is *stable* at an input when the enclosure of
its quotient x / s lies strictly between two rounding midpoints: every conforming program then
casts it to the same value. It is *unstable* when the enclosure straddles one midpoint: the
format values q_lo < q_hi adjacent, and each conforming program picks one of the two. A single
unstable cast widens everything downstream by a full fp8 spacing in the interval domain, which
makes more casts downstream unstable, and so on (an avalanche: ~50 straddles in one attention
layer leave every later cast unstable).

A *case split* on an unstable cast element e of site t (a MatMul operand: node, side, kernel)
partitions the programs by the value they cast e to: {P : cast_P(e) = q_lo} and
{P : cast_P(e) = q_hi}. Their union is every conforming program, because the enclosure
[q_lo, q_hi] (computed in the same case, so under the same earlier decisions) holds no third
value. In each case the cast of e is one known value v, so the bound of that case forces it
(value v s, s the scale's interval) and everything downstream stays narrow. The drift of the
whole family is then the hull of the cases' drifts.

Cases are leaves of a binary tree: a split node names (site, element, the two values) and has one
child per value; a leaf is bounded by running the interval domain with every decision on its
path forced. ``run_forced`` checks, at every forced element, that the element's unforced
enclosure lies in the split's two values: a decision that does not cover what the analysis
admits there is refused (``CaseError``), so a tree whose leaves are all re-bounded covers every
conforming program by construction. The checker re-runs every leaf the same way
(kcverify.certs.cases_rule).

Sites are keyed by node name, operand side and kernel name; an element by its flat index in the
operand with the sample axis removed (one input's part of the tensor).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

Site = tuple[str, str, str]  # (node name, "left" | "right", kernel name)


class CaseError(Exception):
    """A forced decision that does not cover the enclosure (or names no visited site)."""


@dataclass(frozen=True)
class Decision:
    """Force element ``index`` of ``site``'s cast to ``value``; ``other`` is the split's second
    value (the enclosure there must lie in {value, other})."""

    site: Site
    index: int
    value: float
    other: float

    def to_json(self) -> list[Any]:
        return [list(self.site), self.index, float(self.value).hex(), float(self.other).hex()]

    @staticmethod
    def from_json(raw: Any) -> Decision:
        if (not isinstance(raw, list) or len(raw) != 4 or not isinstance(raw[0], list)
                or len(raw[0]) != 3 or not all(isinstance(s, str) for s in raw[0])
                or not isinstance(raw[1], int) or isinstance(raw[1], bool) or raw[1] < 0
                or not isinstance(raw[2], str) or not isinstance(raw[3], str)):
            raise CaseError(f"a decision must be [[node, side, kernel], index, value, other], "
                            f"not {raw!r}")
        try:
            v, o = float.fromhex(raw[2]), float.fromhex(raw[3])
        except ValueError:
            raise CaseError(f"a decision's values must be hex floats, not {raw[2:]!r}") from None
        if not (v == v and o == o) or v == o:
            raise CaseError(f"a decision's two values must be distinct numbers, not {raw[2:]!r}")
        return Decision((raw[0][0], raw[0][1], raw[0][2]), raw[1], v, o)


@dataclass
class Unstable:
    """The unstable, splittable elements one run saw at one site, per batch row."""

    site: Site
    rows: list[list[tuple[int, float, float]]]  # per row: (index, q_lo, q_hi)


@dataclass
class _Run:
    decisions: list[dict[Site, dict[int, Decision]]]  # per batch row
    seen: dict[Site, Unstable] = field(default_factory=dict)
    used: list[set[tuple[Site, int]]] = field(default_factory=list)
    # the zonotope's base binary symbols (straddles it kept as symbols): id -> (site, element),
    # and the run's ZonoTrack (its forms at the end); a diagnostic for choosing splits only
    bases: dict[int, tuple[Site, int]] = field(default_factory=dict)
    track: Any = None


def note_bases(track: Any, site: Site, ids: list[int], elements: list[int]) -> None:
    """The zonotope made binary symbols ``ids`` for straddled casts of ``elements`` (flat
    indices in the operand, a batch of 1) at ``site`` (zonotope.ZonoTrack.binary_symbols)."""
    run = _ACTIVE.get()
    if run is None or len(run.decisions) != 1:
        return
    run.track = track
    for i, e in zip(ids, elements):
        run.bases[int(i)] = (site, int(e))


_ACTIVE: contextvars.ContextVar[_Run | None] = contextvars.ContextVar("kcverify_cases",
                                                                      default=None)


def active() -> bool:
    return _ACTIVE.get() is not None


@contextlib.contextmanager
def forcing(decisions: list[list[Decision]]) -> Iterator[_Run]:
    """Within the block, the interval MatMul rule forces, for batch row b, every decision of
    ``decisions[b]`` and records the unstable elements it sees. On exit, every decision must
    have been applied (a decision naming a site or element the run never cast is refused)."""
    rows: list[dict[Site, dict[int, Decision]]] = []
    for row in decisions:
        per: dict[Site, dict[int, Decision]] = {}
        for d in row:
            if d.index in per.setdefault(d.site, {}):
                raise CaseError(f"element {d.index} of {d.site} is decided twice on one path")
            per[d.site][d.index] = d
        rows.append(per)
    run = _Run(rows, used=[set() for _ in rows])
    token = _ACTIVE.set(run)
    try:
        yield run
    finally:
        _ACTIVE.reset(token)
    for b, per in enumerate(rows):
        for site, ds in per.items():
            for i in ds:
                if (site, i) not in run.used[b]:
                    raise CaseError(f"a decision names element {i} of {site}, which the analysis "
                                    "never cast there")


def _rows_view(t: torch.Tensor, sample_axis: Any, batch: int) -> torch.Tensor:
    """(batch, rest) view of an operand-shaped tensor (the sample axis first)."""
    if batch == 1 and not (isinstance(sample_axis, int) and not isinstance(sample_axis, bool)):
        return t.reshape(1, -1)
    if not (isinstance(sample_axis, int) and not isinstance(sample_axis, bool)):
        raise CaseError("a case split needs the operand's sample axis (it is unknown here)")
    a = sample_axis % t.dim()
    if t.shape[a] != batch:
        raise CaseError(f"operand axis {a} has {t.shape[a]} rows, the run {batch}")
    return t.movedim(a, 0).reshape(batch, -1)


def force_q(site: Site, q_lo: torch.Tensor, q_hi: torch.Tensor, next_up: Any,
            sample_axis: Any, batch: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Apply the active run's decisions at ``site`` to the cast enclosure [q_lo, q_hi] (format
    values, operand-shaped). Returns (q_lo, q_hi, forced mask). ``next_up(q)``: the next format
    value above q (adjacency of a splittable pair). Records the unstable elements left."""
    run = _ACTIVE.get()
    shape = torch.broadcast_shapes(q_lo.shape, q_hi.shape)
    q_lo, q_hi = q_lo.expand(shape).clone(), q_hi.expand(shape).clone()
    forced = torch.zeros(shape, dtype=torch.bool, device=q_lo.device)
    if run is None:
        return q_lo, q_hi, forced
    nb = len(run.decisions)
    if batch is not None and batch != nb:
        raise CaseError(f"the run has {nb} cases, the analysis {batch} samples")
    lo_r, hi_r, f_r = (_rows_view(t, sample_axis, nb) for t in (q_lo, q_hi, forced))
    lo_r, hi_r, f_r = lo_r.clone(), hi_r.clone(), f_r.clone()
    adj = (lo_r != hi_r) & (hi_r == next_up(lo_r))
    unstable: list[list[tuple[int, float, float]]] = []
    for b in range(nb):
        ds = run.decisions[b].get(site, {})
        for i, d in ds.items():
            if i >= lo_r.shape[1]:
                raise CaseError(f"element {i} of {site} is beyond its {lo_r.shape[1]} elements")
            a, c = float(lo_r[b, i]), float(hi_r[b, i])
            # the enclosure [a, c] must hold no format value besides the split's two: its ends
            # one value or adjacent (a split naming the ends of a wider enclosure leaves the
            # programs that cast the element in between in no leaf: finding F1 of session 9)
            if not ({a, c} <= {d.value, d.other}) or not (a == c or bool(adj[b, i])):
                raise CaseError(f"the case split at element {i} of {site} covers "
                                f"{{{d.value!r}, {d.other!r}}}, the analysis admits [{a!r}, {c!r}]")
            lo_r[b, i] = hi_r[b, i] = d.value
            f_r[b, i] = True
            run.used[b].add((site, i))
        idx = torch.nonzero(adj[b] & ~f_r[b]).reshape(-1).tolist()
        unstable.append([(i, float(lo_r[b, i]), float(hi_r[b, i])) for i in idx])
    if site not in run.seen:
        run.seen[site] = Unstable(site, unstable)

    def back(r: torch.Tensor) -> torch.Tensor:
        if r.shape[0] == 1 and not (isinstance(sample_axis, int) and not isinstance(sample_axis, bool)):
            return r.reshape(shape)
        a = sample_axis % len(shape)
        moved = [shape[a]] + [s for k, s in enumerate(shape) if k != a]
        return r.reshape(moved).movedim(0, a)
    return back(lo_r), back(hi_r), back(f_r)


def next_up(q: torch.Tensor, fmt: Any) -> torch.Tensor:
    """The next value of the float format ``fmt`` above q (q a value of the format)."""
    emin = int(round(math.log2(fmt.min_normal)))
    a = q.abs()
    m, E = torch.frexp(a)
    e = E.to(torch.float64) - 1
    up = torch.exp2(torch.clamp(e, min=emin) - fmt.mantissa_bits)
    up = torch.where(a == 0, torch.full_like(up, 2.0 ** (emin - fmt.mantissa_bits)), up)
    eb = torch.where(m == 0.5, e - 1, e)
    down = torch.exp2(torch.clamp(eb, min=emin) - fmt.mantissa_bits)
    return torch.where(q >= 0, q + up, q + down)


SPLITTABLE_SCALES = ("none", "static", "dynamic_per_tensor", "dynamic_per_token")


def cast_enclosure(lo: torch.Tensor, hi: torch.Tensor, cs: Any, side: str, sample_axis: Any,
                   batch: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                               torch.Tensor] | None:
    """(q_lo, q_hi, s_lo, s_hi): the format values a round-to-nearest cast of x in [lo, hi]
    takes, and the scale's interval, as the MatMul rule's grid path computes them; None for
    casts a case split does not handle (integer formats, per-block scales). ``ftz``: the cast
    flushes subnormal results to 0 after rounding; flush(rne(t)) is still nondecreasing in t,
    so the rounded ends flushed enclose it."""
    from kcverify.bounds.box import imul, pad_hi, pad_lo
    from kcverify.bounds.casts import SCALE_SLACK, activation_scale_bounds, rne
    from kcverify.kernels.cast import flush_subnormals

    if cs.format.kind != "float" or cs.scale not in SPLITTABLE_SCALES:
        return None
    s_lo, s_hi = activation_scale_bounds(lo, hi, cs, side, sample_axis, batch)
    t_lo, t_hi = imul(lo, hi, 1.0 / s_hi, 1.0 / s_lo)
    t_lo, t_hi = pad_lo(t_lo, SCALE_SLACK), pad_hi(t_hi, SCALE_SLACK)
    if cs.scale.startswith("dynamic"):
        lim = cs.format.max_finite * (1 + 2 * SCALE_SLACK)
        t_lo, t_hi = t_lo.clamp(-lim, lim), t_hi.clamp(-lim, lim)
    q_lo, q_hi = rne(t_lo, cs.format), rne(t_hi, cs.format)
    if cs.ftz:
        q_lo, q_hi = flush_subnormals(q_lo, cs.format), flush_subnormals(q_hi, cs.format)
    return q_lo, q_hi, s_lo, s_hi


def forced_values(site: Site, lo: torch.Tensor, hi: torch.Tensor, cs: Any, side: str,
                  sample_axis: Any, batch: int | None, c_lo: torch.Tensor, c_hi: torch.Tensor,
                  deq_u: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The dequantised cast values [c_lo, c_hi] of an activation operand with the active run's
    decisions at ``site`` applied: a forced element holds v s for its value v and s in the
    scale's interval, dequantised with relative rounding ``deq_u``; and the forced mask (None:
    nothing forced)."""
    from kcverify.bounds.box import pad_hi, pad_lo

    enc = cast_enclosure(lo, hi, cs, side, sample_axis, batch)
    if enc is None:
        return c_lo, c_hi, None
    q_lo, q_hi, s_lo, s_hi = enc
    q_lo, q_hi, forced = force_q(site, q_lo, q_hi, lambda q: next_up(q, cs.format),
                                 sample_axis, batch)
    if not bool(forced.any()):
        return c_lo, c_hi, None
    a, b = q_lo * s_lo, q_lo * s_hi
    v_lo, v_hi = torch.minimum(a, b), torch.maximum(a, b)
    r = (deq_u + 2.0**-52) * q_lo.abs() * s_hi
    v_lo, v_hi = pad_lo(v_lo - r), pad_hi(v_hi + r)
    return torch.where(forced, v_lo, c_lo), torch.where(forced, v_hi, c_hi), forced


class PrefixCache:
    """Prefix sharing for the cases of one input (engine.RUN_HOOK): the engine states before
    chosen nodes of one case's run, reused by later cases whose decisions upstream of that node
    are the same.

    Why a resumed run is the unshared run: a decision is read only at its own site's node (the
    MatMul rule's cast of that operand, ``force_q``), so the states before node k of a run are
    a function of the input, the graph, the kernels, the method and the decisions at sites of
    nodes before k, and nothing else (the traversal is deterministic: the same rules on the same
    states). A snapshot at node k is a deep copy of everything the traversal carries past k: the
    engine's box map, the relational runs (the zonotope's forms, symbol counter, monomials),
    this module's per-run records (sites seen, decisions used, base symbols) and the
    diagnostics' counters; a resumed run starts from a deep copy of it (the snapshot itself
    stays as taken), so the two runs' values are equal bit for bit (tested:
    tests/bounds/test_cases_shared.py).

    Nodes: a snapshot is taken before each node of ``nodes`` (names; the caller adds the nodes of
    the sites it splits on), once per (node, upstream decisions). ``prune(open_paths)`` drops
    the snapshots no open case can resume from. ``max_bytes``: a snapshot that would take the
    cache past it is not kept (memory; a case without one runs from node 0)."""

    def __init__(self, max_bytes: int = 4 << 30) -> None:
        self.nodes: set[str] = set()
        self.snaps: dict[tuple[Any, ...], tuple[int, Any]] = {}  # key -> (bytes, state)
        self.max_bytes = max_bytes
        self.resumed_at: int = 0  # the node the last run resumed at (0: from the start)
        self.taken = 0
        self._index: dict[tuple[Any, ...], dict[str, int]] = {}

    @staticmethod
    def _sig(graph: Any) -> tuple[Any, ...]:
        """The graph a snapshot belongs to, by its nodes (an expanded graph is rebuilt when the
        engine's memo drops it, and a freed object's id can be reused by another graph)."""
        return (len(graph.nodes), tuple((n.name, n.op_type, tuple(n.inputs), tuple(n.outputs))
                                        for n in graph.nodes), tuple(graph.initializers))

    def _idx(self, graph: Any) -> dict[str, int]:
        sig = self._sig(graph)
        got = self._index.get(sig)
        if got is None:
            got = self._index[sig] = {n.name: k for k, n in enumerate(graph.nodes)}
        return got

    @staticmethod
    def _upstream(path: list[Decision], idx: dict[str, int], k: int) -> frozenset[Any]:
        return frozenset((d.site, d.index, d.value, d.other) for d in path
                         if idx.get(d.site[0], k) < k)

    def _key(self, graph: Any, method: str, k: int, path: list[Decision]) -> tuple[Any, ...]:
        return (self._sig(graph), method, k, self._upstream(path, self._idx(graph), k))

    def bytes(self) -> int:
        return sum(b for b, _ in self.snaps.values())

    def resume(self, graph: Any, method: str, st: dict[str, Any], runs: tuple[Any, ...]
               ) -> tuple[int, dict[str, Any], tuple[Any, ...]] | None:
        import copy

        from kcverify.bounds import diagnostics

        self.resumed_at = 0
        run = _ACTIVE.get()
        if run is None or len(run.decisions) != 1:
            return None
        path = [d for ds in run.decisions[0].values() for d in ds.values()]
        best = None
        sig = self._sig(graph)
        for key in self.snaps:
            if key[0] == sig and key[1] == method and (best is None or key[2] > best[2]) \
                    and key == self._key(graph, method, key[2], path):
                best = key
        if best is None:
            return None
        memo = _constants_memo(st)
        s2, runs2, seen, used, bases, track, diag = copy.deepcopy(self.snaps[best][1], memo)
        if len(runs2) != len(runs) or any(type(a) is not type(b) for a, b in zip(runs2, runs)):
            return None
        run.seen, run.used, run.bases, run.track = seen, used, bases, track
        store = diagnostics._CURRENT.get()
        if store is not None:
            store.clear()
            store.update(diag)
        self.resumed_at = best[2]
        return best[2], s2, runs2

    def before(self, k: int, graph: Any, method: str, st: dict[str, Any],
               runs: tuple[Any, ...]) -> None:
        import copy

        from kcverify.bounds import diagnostics

        if graph.nodes[k].name not in self.nodes:
            return
        run = _ACTIVE.get()
        if run is None or len(run.decisions) != 1:
            return
        path = [d for ds in run.decisions[0].values() for d in ds.values()]
        key = self._key(graph, method, k, path)
        if key in self.snaps:
            return
        store = diagnostics._CURRENT.get()
        memo = _constants_memo(st)
        shared = {id(v) for v in memo.values()}
        snap = copy.deepcopy((st, tuple(runs), run.seen, run.used, run.bases, run.track,
                              dict(store) if store is not None else {}), memo)
        size = _tensor_bytes(snap, shared)
        if self.bytes() + size > self.max_bytes:
            return
        self.snaps[key] = (size, snap)
        self.taken += 1

    def prune(self, open_paths: list[list[Decision]]) -> None:
        """Drop the snapshots that no case of ``open_paths`` (nor a case below one: its further
        decisions are downstream of its last) can resume from."""
        keep = set()
        for key in self.snaps:
            sig, method, k, up = key
            idx = self._index.get(sig, {})
            if any(self._upstream(p, idx, k) == up for p in open_paths):
                keep.add(key)
        self.snaps = {k: v for k, v in self.snaps.items() if k in keep}


def _constants_memo(st: dict[str, Any]) -> dict[int, Any]:
    """A deepcopy memo that keeps the graph's constants (Concrete values: never written) shared
    instead of copied."""
    from kcverify.bounds.box import Concrete

    memo: dict[int, Any] = {}
    for v in st.values():
        if isinstance(v, Concrete):
            memo[id(v)] = v
            memo[id(v.value)] = v.value
    return memo


def _tensor_bytes(obj: Any, skip: set[int]) -> int:
    """The bytes of the distinct tensor storages reachable through dicts, lists, tuples, sets
    and objects' __dict__ / dataclass fields (an estimate of a snapshot's size)."""
    seen: set[int] = set()
    total = 0
    stack = [obj]
    visited: set[int] = set()
    while stack:
        o = stack.pop()
        if id(o) in visited or id(o) in skip:
            continue
        visited.add(id(o))
        if isinstance(o, torch.Tensor):
            st = o.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
        elif hasattr(o, "__dict__"):
            stack.extend(vars(o).values())
        elif hasattr(o, "__slots__"):
            stack.extend(getattr(o, a) for a in o.__slots__ if hasattr(o, a))
    return total


def distinct_kernels(train: Any, inf: Any) -> None:
    """A site names its kernel by ``spec.name``: two kernels of one name would share every
    decision, and pairs of programs that cast an element apart would lie in no leaf (finding F2
    of session 9). Contracts name them ``train`` and ``inf``; an API caller may not."""
    if getattr(train, "name", None) == getattr(inf, "name", None):
        raise CaseError(f"the two kernels share the name {getattr(inf, 'name', None)!r}: a proof "
                        "by cases keys its decisions by kernel name; rename one (dataclasses.replace"
                        "(spec, name=...))")


def site_order(graph: Any) -> dict[str, int]:
    """Each node's position in the graph order the analysis runs in (sites are casts at nodes)."""
    return {n.name: k for k, n in enumerate(graph.nodes)}


def check_tree(paths: list[list[Decision]], order: dict[str, int]) -> None:
    """The leaves' decision paths form a complete binary case tree, or CaseError.

    Every path lists its decisions in graph order of their sites (non-decreasing); the paths
    share the root's decision, and split there into exactly two non-empty groups, one per value
    of that element (value / other swapped), each again a complete tree over the remaining
    decisions; a leaf is one path that ends there. Why this covers every conforming program,
    with each leaf re-run under its whole path (``forcing`` checks each decided element's
    unforced enclosure against its two values): the root's element is at the earliest site of
    every path, so its enclosure is computed with nothing upstream forced, and every program
    casts it to one of the two values; each child then holds exactly the programs of its value,
    and the same holds below it, site by site in graph order (a decision affects only what is
    downstream of its site)."""
    if not paths:
        raise CaseError("a case tree needs at least one leaf")
    for p in paths:
        pos = []
        for d in p:
            if d.site[0] not in order:
                raise CaseError(f"a decision names node {d.site[0]!r}, which the model lacks")
            pos.append(order[d.site[0]])
        if pos != sorted(pos):
            raise CaseError("a path's decisions must follow the graph order of their sites")

    def walk(group: list[list[Decision]], depth: int) -> None:
        ends = [p for p in group if len(p) == depth]
        if ends:
            if len(group) != 1:
                raise CaseError(f"a leaf at depth {depth} has {len(group) - 1} other paths "
                                "beside it (a duplicate leaf, or a leaf that is also split)")
            return
        d0 = group[0][depth]
        a, b = [], []
        for p in group:
            d = p[depth]
            if (d.site, d.index) != (d0.site, d0.index):
                raise CaseError(f"the paths under one node split on different elements at depth "
                                f"{depth}: {d0.site}[{d0.index}] and {d.site}[{d.index}]")
            if (d.value, d.other) == (d0.value, d0.other):
                a.append(p)
            elif (d.value, d.other) == (d0.other, d0.value):
                b.append(p)
            else:
                raise CaseError(f"element {d0.index} of {d0.site} is split on {{{d0.value!r}, "
                                f"{d0.other!r}}} and on {{{d.value!r}, {d.other!r}}}")
        if not a or not b:
            v = d0.other if not b else d0.value
            raise CaseError(f"the case tree lacks the branch {v!r} of element {d0.index} of "
                            f"{d0.site}")
        walk(a, depth + 1)
        walk(b, depth + 1)
    walk(paths, 0)


def bound_leaf(graph: Any, train: Any, inf: Any, feeds: dict[str, Any], path: list[Decision],
               domain: str = "interval", device: str = "cpu") -> tuple[float, int]:
    """One leaf: the drift bound of one input (``feeds`` a batch of 1) with every decision of
    ``path`` forced, and the unstable casts left; CaseError when a decision does not cover the
    enclosure it is applied to, or names an element the run never cast."""
    from kcverify.bounds.engine import certify_drift, whole_graph

    distinct_kernels(train, inf)
    with forcing([path]):
        res = certify_drift(graph, train, inf, feeds, domain=domain, device=device,
                            blocks=whole_graph(graph))
    left = int(res.unstable_casts[0]) if res.unstable_casts is not None else 0
    return float(res.linf[0]), left


def drivers(run: _Run, outputs: list[str], bad: dict[str, torch.Tensor]
            ) -> dict[tuple[Site, int], float]:
    """The straddled elements behind the output elements ``bad`` (per output, a mask of its
    shape): per base binary symbol the zonotope kept at the end of ``run`` (note_bases), the sum
    over the drift forms' binary rows whose support holds it of |coefficient| at the bad
    elements, keyed by (site, element). A heuristic for where to split (the split itself is
    checked where it is applied, whatever chose it); empty when the run kept no base symbol or
    the outputs have no forms."""
    zt = run.track
    if zt is None or not run.bases:
        return {}
    binset = set(zt._bin)
    score: dict[int, float] = {}
    for name in outputs:
        z = zt.forms.get(name)
        if z is None or name not in bad or not bool(bad[name].any()):
            continue
        m = bad[name].reshape(-1).to(z.i.c.device)
        rows: dict[int, torch.Tensor] = {}
        for sign, f in ((1.0, z.i.dense()), (-1.0, z.t.dense())):
            G = f.G.reshape(f.G.shape[0], -1)
            for r, i in enumerate(f.ids.tolist()):
                if i in binset:
                    g = sign * G[r, m]
                    rows[i] = rows[i] + g if i in rows else g
        for i, g in rows.items():
            w = float(g.abs().sum())
            if w > 0:
                for j in zt.mono.support.get(i, (i,)):
                    score[j] = score.get(j, 0.0) + w
    return {run.bases[j]: w for j, w in score.items() if j in run.bases}


def driver_groups(run: _Run, outputs: list[str], groups: list[dict[str, torch.Tensor]]
                  ) -> list[dict[tuple[Site, int], float]]:
    """``drivers`` for several groups of bad output elements at once (each group a dict output
    -> mask, as ``bad``): the drift forms' binary rows are read once, and each group's weights
    are those rows' |coefficient| summed over the group's elements."""
    zt = run.track
    if zt is None or not run.bases or not groups:
        return [{} for _ in groups]
    binset = set(zt._bin)
    sizes = {n: int(zt.forms[n].i.c.numel()) for n in outputs if zt.forms.get(n) is not None}
    names = [n for n in outputs if n in sizes]
    if not names:
        return [{} for _ in groups]
    offs, tot = {}, 0
    for n in names:
        offs[n], tot = tot, tot + sizes[n]
    rows: dict[int, torch.Tensor] = {}
    for n in names:
        z = zt.forms[n]
        for sign, f in ((1.0, z.i.dense()), (-1.0, z.t.dense())):
            G = f.G.reshape(f.G.shape[0], -1)
            for r, i in enumerate(f.ids.tolist()):
                if i in binset:
                    row = rows.setdefault(i, torch.zeros(tot, dtype=G.dtype, device=G.device))
                    row[offs[n]:offs[n] + sizes[n]] += sign * G[r]
    if not rows:
        return [{} for _ in groups]
    ids = list(rows)
    R = torch.stack([rows[i] for i in ids]).abs()
    M = torch.zeros((len(groups), tot), dtype=R.dtype, device=R.device)
    for k, grp in enumerate(groups):
        for n, m in grp.items():
            if n in offs:
                M[k, offs[n]:offs[n] + sizes[n]] = m.reshape(-1).to(R.device, R.dtype)
    W = (R @ M.T).tolist()  # (rows, groups)
    out: list[dict[tuple[Site, int], float]] = []
    for k in range(len(groups)):
        score: dict[int, float] = {}
        for r, i in enumerate(ids):
            w = W[r][k]
            if w > 0:
                for j in zt.mono.support.get(i, (i,)):
                    score[j] = score.get(j, 0.0) + w
        out.append({run.bases[j]: w for j, w in score.items() if j in run.bases})
    return out


# per-element trees: a group follows the whole goal's split where it is a driver of its own
JOINT_FIRST = True
DRIVER_SHARE = 0.1  # a driver's weight against the heaviest open driver's, to be split on


def _choose(path: list[Decision], seen: dict[Site, list[tuple[int, float, float]]],
            weights: dict[tuple[Site, int], float], order: dict[str, int], per_split: int
            ) -> tuple[Site, list[tuple[int, float, float]]] | None:
    """The site and elements to split a case on: among the unstable elements the case's run saw
    (``seen``: per site, unforced elements whose enclosure holds two adjacent values) at sites no
    earlier in graph order than the path's last decision (check_tree's order), those with a
    weight in the bad outputs' forms (``weights``, drivers), at the earliest such site, the
    ``per_split`` heaviest; without weights, the first such site's first elements. A driver
    counts when its weight is at least ``DRIVER_SHARE`` of the heaviest open one: a tie whose
    row barely reaches the bad outputs (a flip at another position, seen there through a
    normalisation) does not close the later sites (the path's graph order) for the ties that
    matter. Flips at later sites are mostly consequences of earlier ones (an earlier tie's
    nonlinear remainder makes later casts straddle): the earliest site goes first."""
    last = max((order[d.site[0]] for d in path), default=-1)
    open_sites = sorted((s for s, els in seen.items() if els and order.get(s[0], -1) >= last),
                        key=lambda s: order[s[0]])
    top = max((weights.get((s, e[0]), 0.0) for s in open_sites for e in seen[s]), default=0.0)
    for site in open_sites:
        heavy = [e for e in seen[site]
                 if weights.get((site, e[0]), 0.0) > 0
                 and weights.get((site, e[0]), 0.0) >= DRIVER_SHARE * top]
        if heavy:
            heavy.sort(key=lambda e: -weights[(site, e[0])])
            return site, heavy[:per_split]
    if open_sites and not weights:
        return open_sites[0], seen[open_sites[0]][:per_split]
    return None


@dataclass
class CaseResult:
    """Per input: the certified bound (max over the leaves), the leaves' decision paths, and
    the unstable casts left in the leaves (summed); ``runs``: analyses made."""

    linf: Any  # np.ndarray (batch,)
    leaves: list[list[list[Decision]]]
    unstable_left: Any  # np.ndarray (batch,)
    seconds: float
    runs: int
    leaf_linf: list[list[float]] = field(default_factory=list)  # per input, per leaf
    # per-element trees (per_element): per input, per leaf, the output elements it is credited
    # with (output -> encode_mask); None: every leaf is credited with every element
    masks: list[list[dict[str, str]]] | None = None
    resumed: int = 0  # runs resumed from a shared prefix (PrefixCache)
    snapshot_bytes: int = 0  # the prefix cache's peak size


def encode_mask(m: Any) -> str:
    """A boolean mask as hex of its bits, packed in C order (numpy.packbits)."""
    import numpy as np

    return np.packbits(np.asarray(m, dtype=bool).reshape(-1)).tobytes().hex()


def decode_mask(raw: Any, size: int) -> Any:
    """encode_mask's inverse for a mask of ``size`` elements, or CaseError (wrong length,
    padding bits set, not hex)."""
    import numpy as np

    if not isinstance(raw, str) or len(raw) != 2 * ((size + 7) // 8):
        raise CaseError(f"a mask of {size} elements is {2 * ((size + 7) // 8)} hex digits")
    try:
        bits = np.unpackbits(np.frombuffer(bytes.fromhex(raw), dtype=np.uint8))
    except ValueError:
        raise CaseError("a mask must be hex digits") from None
    if bits[size:].any():
        raise CaseError("a mask sets bits beyond its elements")
    return bits[:size].astype(bool)


def output_elements(graph: Any) -> list[str]:
    """The outputs whose elements a per-element case tree covers: the graph's float outputs
    (those certify_drift's linf reads), in graph order."""
    from kcverify.bounds.engine import _is_int

    return [v.name for v in graph.outputs if not _is_int(graph, v.name)]


def decode_masks(raw: dict[str, str], sizes: dict[str, int]) -> dict[str, Any]:
    """One node's masks {output: encode_mask hex} decoded against the outputs' element counts
    (absent: no element); CaseError for an output that is not in ``sizes``."""
    extra = set(raw) - set(sizes)
    if extra:
        raise CaseError(f"a mask names {sorted(extra)}, not a float output of the model")
    import numpy as np

    return {nm: decode_mask(raw[nm], n) if nm in raw else np.zeros(n, dtype=bool)
            for nm, n in sizes.items()}


def check_cover(nodes: list[tuple[list[Decision], dict[str, Any]]], sizes: dict[str, int],
                order: dict[str, int]) -> None:
    """Per-element case trees (certify_cases(per_element=True)): each node is a decision path
    and the output elements it is credited with (output -> bool mask, decode_masks). For every
    element of every output in ``sizes``, the paths credited with it must form a complete case
    tree in graph order (check_tree); an element no path is credited with is refused. Elements
    with the same set of credited paths are checked once."""
    import numpy as np

    if not nodes:
        raise CaseError("a case tree needs at least one leaf")
    cols = []
    for name, n in sizes.items():
        col = np.zeros((len(nodes), n), dtype=bool)
        for k, (_, masks) in enumerate(nodes):
            if name in masks:
                m = np.asarray(masks[name], dtype=bool).reshape(-1)
                if m.size != n:
                    raise CaseError(f"a mask of {name!r} has {m.size} elements, not {n}")
                col[k] = m
        cols.append(col)
    cover = np.concatenate(cols, axis=1) if cols else np.zeros((len(nodes), 0), dtype=bool)
    for col in np.unique(cover, axis=1).T if cover.shape[1] else []:
        ks = np.nonzero(col)[0].tolist()
        if not ks:
            raise CaseError("an output element is credited to no case")
        check_tree([nodes[k][0] for k in ks], order)


def node_drifts(res: Any, outs: list[str]) -> dict[str, Any]:
    """Per output, the per-element bound max(|drift_lo|, |drift_hi|) of a run of one input (a
    batch of 1: every element of the output is that input's; NaN stays NaN, a bound never
    met)."""
    import numpy as np

    out = {}
    for nm in outs:
        db = res.outputs[nm]
        lo, hi = np.asarray(db.drift_lo, np.float64), np.asarray(db.drift_hi, np.float64)
        d = np.maximum(np.abs(lo), np.abs(hi))
        out[nm] = np.where(np.isnan(lo) | np.isnan(hi), np.nan, d)
    return out


def bound_node(graph: Any, train: Any, inf: Any, feeds: dict[str, Any], path: list[Decision],
               domain: str = "interval", device: str = "cpu") -> dict[str, Any]:
    """One node of per-element case trees: the per-element drift bounds (node_drifts) of one
    input (``feeds`` a batch of 1) with every decision of ``path`` forced; CaseError as
    bound_leaf."""
    from kcverify.bounds.engine import certify_drift, whole_graph

    distinct_kernels(train, inf)
    with forcing([path]):
        res = certify_drift(graph, train, inf, feeds, domain=domain, device=device,
                            blocks=whole_graph(graph))
    return node_drifts(res, output_elements(graph))


def _position_groups(bad: dict[str, Any]) -> list[dict[str, torch.Tensor]]:
    """The bad elements grouped by output and index along axis 1 (the position of a (batch,
    seq, vocab) logit tensor; a tensor of rank < 3 is one group), one group per key that has a
    bad element. A heuristic: each group chooses its own splits."""
    import numpy as np

    out: list[dict[str, torch.Tensor]] = []
    for name, m in bad.items():
        m = np.asarray(m, dtype=bool)
        if m.ndim < 3:
            if m.any():
                out.append({name: torch.as_tensor(m)})
            continue
        for p in range(m.shape[1]):
            if m[:, p].any():
                g = np.zeros_like(m)
                g[:, p] = m[:, p]
                out.append({name: torch.as_tensor(g)})
    return out


def _certify_per_element(graph: Any, train: Any, inf: Any, feeds: dict[str, Any],
                         max_leaves: int, per_split: int, domain: str, device: str,
                         progress: Any, threshold: float, runner: Any = None,
                         share: bool = True) -> CaseResult:
    """certify_cases(per_element=True): per-element case trees sharing their runs (module doc
    of certify_cases). ``runner(fd, path) -> (DriftResult, _Run)`` bounds one case (default: a
    whole-graph run with the path forced)."""
    import time

    import numpy as np

    from kcverify.bounds.engine import RUN_HOOK, certify_drift, whole_graph

    t0 = time.perf_counter()
    blks = whole_graph(graph)
    order = site_order(graph)
    outs = output_elements(graph)
    names = list(feeds)
    batch = int(np.asarray(feeds[names[0]]).shape[0])

    def default_runner(fd: dict[str, Any], path: list[Decision]) -> tuple[Any, _Run]:
        with forcing([path]) as run:
            res = certify_drift(graph, train, inf, fd, domain=domain, device=device, blocks=blks)
        return res, run

    run_case = runner or default_runner
    linf, all_paths, all_masks, all_claims, left_sum = [], [], [], [], []
    runs = resumed = 0
    peak = 0
    for i in range(batch):
        fd = {k: np.asarray(v)[i:i + 1] for k, v in feeds.items()}
        stack: list[tuple[list[Decision], dict[str, Any] | None]] = [([], None)]
        credited: list[tuple[list[Decision], dict[str, Any], float]] = []
        lost, done_runs, left = False, 0, 0
        cache = PrefixCache() if share else None  # one input's states: a cache per input
        while stack:
            # the open case whose goal holds the most elements first (a case left for one
            # position's deep chain waits until the wider cases are done), the latest first
            # among equals (depth first: the fewest snapshots alive)
            pick = max(range(len(stack)), key=lambda k: (
                -1 if stack[k][1] is None else
                sum(int(np.asarray(m).sum()) for m in stack[k][1].values()), k))
            path, goal = stack.pop(pick)
            if cache is not None:
                cache.prune([path] + [p for p, _ in stack])
                token = RUN_HOOK.set(cache)
                try:
                    res, run = run_case(fd, path)
                finally:
                    RUN_HOOK.reset(token)
                resumed += cache.resumed_at > 0
                peak = max(peak, cache.bytes())
            else:
                res, run = run_case(fd, path)
            runs += 1
            done_runs += 1
            if progress is not None:
                progress(runs, done_runs + len(stack))
            left += int(res.unstable_casts[0]) if res.unstable_casts is not None else 0
            d = node_drifts(res, outs)
            if goal is None:
                goal = {nm: np.ones(d[nm].shape, dtype=bool) for nm in outs}
            good = {nm: goal[nm] & (d[nm] <= threshold) for nm in outs}
            bad = {nm: goal[nm] & ~(d[nm] <= threshold) for nm in outs}
            credit = {nm: good[nm].copy() for nm in outs}
            splits: dict[tuple[Site, tuple[tuple[int, float, float], ...]],
                         dict[str, Any]] = {}
            if any(m.any() for m in bad.values()):
                groups = _position_groups(bad) if not lost else []
                seen = {s: u.rows[0] for s, u in run.seen.items()}
                weights = driver_groups(run, outs, groups) if groups else []
                # joint first: the split the whole goal would take (its groups' weights summed);
                # a group follows it where those elements are drivers of its own (at least
                # DRIVER_SHARE of its heaviest), and picks its own split only where they are not
                # (groups that need the same ties share one tree; independent ones get a sum)
                union: dict[tuple[Site, int], float] = {}
                for w in weights:
                    for key_, v in w.items():
                        union[key_] = union.get(key_, 0.0) + v
                joint = (_choose(path, seen, union, order, per_split)
                         if JOINT_FIRST and len(groups) > 1 else None)
                for grp, w in zip(groups, weights):
                    ch = None
                    if joint is not None and w:
                        top = max(w.values())
                        if all(w.get((joint[0], e[0]), 0.0) >= DRIVER_SHARE * top
                               for e in joint[1][:per_split]):
                            ch = joint
                    if ch is None:
                        ch = _choose(path, seen, w, order, per_split)
                    if ch is None:
                        for nm, m in grp.items():
                            credit[nm] |= m.numpy()
                        lost = True
                        continue
                    key = (ch[0], tuple(ch[1][:per_split]))
                    acc = splits.setdefault(key, {nm: np.zeros_like(goal[nm]) for nm in outs})
                    for nm, m in grp.items():
                        acc[nm] |= m.numpy()
                # the budget: the runs made, the open ones and the children of these splits
                kids = sum(2 ** len(els) for _, els in splits)
                if lost or done_runs + len(stack) + kids > max_leaves:
                    for acc in splits.values():
                        for nm in outs:
                            credit[nm] |= acc[nm]
                    splits = {}
                    lost = True
            if any(m.any() for m in credit.values()):
                claim = max(float(d[nm][credit[nm]].max()) for nm in outs if credit[nm].any())
                credited.append((path, credit, claim))
            for (site, els), acc in reversed(list(splits.items())):
                if cache is not None:
                    cache.nodes.add(site[0])
                kids_p = [path]
                for idx, a, c in els:
                    kids_p = [p + [Decision(site, idx, v, o)] for p in kids_p
                              for v, o in ((a, c), (c, a))]
                for p in reversed(kids_p):
                    stack.append((p, acc))
        all_paths.append([p for p, _, _ in credited])
        all_masks.append([{nm: encode_mask(m[nm]) for nm in outs if m[nm].any()}
                          for _, m, _ in credited])
        all_claims.append([c for _, _, c in credited])
        linf.append(max(all_claims[-1]))
        left_sum.append(left)
    return CaseResult(np.array(linf), all_paths, np.array(left_sum), time.perf_counter() - t0,
                      runs, all_claims, all_masks, resumed, peak)


def certify_cases(graph: Any, train: Any, inf: Any, feeds: dict[str, Any], max_leaves: int = 64,
                  per_split: int = 3, domain: str = "interval", device: str = "cpu",
                  progress: Any = None, threshold: float | None = None,
                  per_element: bool = False, runner: Any = None, share: bool = True
                  ) -> CaseResult:
    """Drift bound of each input (a point) by cases over its unstable casts (module doc).

    Per input, a frontier of cases (decision paths) starts at the empty path; each round bounds
    every open case (the interval domain in one batched run per round, a relational domain one
    case at a time, the whole graph as one block), then splits each case on up to ``per_split``
    unstable elements of one site (2^k children), while the input's leaves stay <=
    ``max_leaves``. A case left unsplit is a leaf. The bound of an input is the max over its
    leaves: every conforming pair of programs lies in exactly one leaf.

    Without ``threshold``: every case is split at the first site (graph order) where unstable
    elements remain. With ``threshold`` (clause-directed): a case whose bound is <= threshold is a
    leaf; one above it is split only on the elements that drive its bad output elements (those
    whose drift bound exceeds the threshold): the straddles the zonotope kept as base binary
    symbols that the bad elements' drift forms depend on (``drivers``), at the earliest such
    site no earlier than the path's last decision, the heaviest first (``_choose``); the other
    straddles stay binary symbols. Once a case of an input ends above the threshold with no
    split left (or the budget spent), the input's other open cases are bounded but not split
    further (its bound misses the threshold whatever they give)."""
    import time

    import numpy as np

    from kcverify.bounds.engine import RUN_HOOK, certify_drift, whole_graph

    distinct_kernels(train, inf)
    if per_element:
        if threshold is None:
            raise CaseError("per-element case trees need the clause's threshold")
        return _certify_per_element(graph, train, inf, feeds, max_leaves, per_split, domain,
                                    device, progress, threshold, runner,
                                    share and domain != "interval")
    t0 = time.perf_counter()
    names = list(feeds)
    batch = int(np.asarray(feeds[names[0]]).shape[0])
    blks = whole_graph(graph)
    order = site_order(graph)
    outs = [v.name for v in graph.outputs]
    paths: list[list[list[Decision]]] = [[[]] for _ in range(batch)]
    final: list[list[bool]] = [[False] for _ in range(batch)]
    linf: list[list[float]] = [[float("inf")] for _ in range(batch)]
    left: list[list[int]] = [[0] for _ in range(batch)]
    lost = [False] * batch  # threshold mode: a leaf of the input ended above it
    runs = resumed = peak = 0
    caches = ({i: PrefixCache() for i in range(batch)} if share and domain != "interval"
              else {})
    while True:
        todo = [(i, j) for i in range(batch) for j in range(len(paths[i])) if not final[i][j]]
        if not todo:
            break
        # the interval domain bounds open cases in batched runs of the slice's own batch size
        # (a model may fix its batch in constants: a Concat with a (1, T, 1) initializer, a
        # Reshape to a static [1, n]; the slice's batch is one it was given); a relational
        # domain (best, zonotope) one case at a time (its forms are per input)
        size = batch if domain == "interval" else 1
        groups = [todo[k:k + size] for k in range(0, len(todo), size)]
        choice: list[Any] = []
        for grp in groups:
            rows = np.array([i for i, _ in grp])
            fd = {k: np.asarray(v)[rows] for k, v in feeds.items()}
            # prefix sharing (PrefixCache) for a relational domain's one-case runs, a cache per
            # input, pruned to what the input's open cases can resume from
            cache = caches.get(grp[0][0]) if len(grp) == 1 else None
            if cache is not None:
                i0 = grp[0][0]
                cache.prune([p for j, p in enumerate(paths[i0]) if not final[i0][j]])
            token = RUN_HOOK.set(cache) if cache is not None else None
            try:
                with forcing([paths[i][j] for i, j in grp]) as run:
                    res = certify_drift(graph, train, inf, fd, domain=domain, device=device,
                                        blocks=blks)
            finally:
                if token is not None:
                    RUN_HOOK.reset(token)
            if cache is not None:
                resumed += cache.resumed_at > 0
                peak = max(peak, cache.bytes())
            for b, (i, j) in enumerate(grp):
                linf[i][j] = float(res.linf[b])
                left[i][j] = int(res.unstable_casts[b]) if res.unstable_casts is not None else 0
                if threshold is None:
                    choice.append(next(((s, u.rows[b]) for s, u in run.seen.items()
                                        if u.rows[b]), None))
                    continue
                if linf[i][j] <= threshold:
                    choice.append(None)
                    continue
                seen = {s: u.rows[b] for s, u in run.seen.items()}
                weights: dict[tuple[Site, int], float] = {}
                if len(grp) == 1:
                    bad = {}
                    for nm in outs:
                        db = res.outputs.get(nm)
                        if db is not None:
                            d = np.maximum(np.abs(db.drift_lo[b]), np.abs(db.drift_hi[b]))
                            bad[nm] = torch.as_tensor(d > threshold)
                    weights = drivers(run, outs, bad)
                choice.append(_choose(paths[i][j], seen, weights, order, per_split))
            runs += 1
            if progress is not None:
                progress(runs, sum(len(p) for p in paths))
        grown: dict[int, list[tuple[int, list[list[Decision]]]]] = {}
        for b, (i, j) in enumerate(todo):
            first = choice[b]
            room = max_leaves - len(paths[i]) - sum(len(k) - 1 for _, k in grown.get(i, []))
            if first is None or room < 1 or lost[i]:
                final[i][j] = True
                if threshold is not None and linf[i][j] > threshold:
                    lost[i] = True
                continue
            site, els = first
            if i in caches:
                caches[i].nodes.add(site[0])
            kids = [paths[i][j]]
            for idx, a, c in els[:per_split]:
                if len(kids) > room:
                    break
                room -= len(kids)
                kids = [p + [Decision(site, idx, v, o)] for p in kids for v, o in ((a, c), (c, a))]
            if len(kids) == 1:
                final[i][j] = True
                if threshold is not None and linf[i][j] > threshold:
                    lost[i] = True
                continue
            grown.setdefault(i, []).append((j, kids))
        for i, splits in grown.items():
            if lost[i]:  # an input already lost: its open cases stay leaves
                continue
            for j, kids in sorted(splits, key=lambda t: -t[0]):
                paths[i][j:j + 1] = kids
                final[i][j:j + 1] = [False] * len(kids)
                linf[i][j:j + 1] = [float("inf")] * len(kids)
                left[i][j:j + 1] = [0] * len(kids)
        for i in range(batch):  # a lost input's unsplit cases were bounded: leaves
            if lost[i]:
                final[i] = [True] * len(paths[i])
    return CaseResult(np.array([max(v) for v in linf]), paths,
                      np.array([sum(v) for v in left]), time.perf_counter() - t0, runs,
                      [list(v) for v in linf], None, resumed, peak)
