"""The engine's memory budget: each method's peak is estimated before it allocates, and a method
that cannot fit is replaced by a cheaper one, with a note, never a crash.

    budget = parse_size("4G")                        # or default_budget(): a fraction of RAM
    plan = plan_blocks(graph, blocks, feeds, "best", budget)
    plan.domains   # per block: the domain it is bounded with ("interval" where the asked one
                   # cannot fit)
    plan.notes     # "block 'layer0': method best needs ~9.1 GB > budget 4.0 GB: used interval"

What is estimated (bytes, float64 = 8 bytes per entry; shapes from one fp32 forward pass of one
sample, tensors with a sample axis scaled by the rows: a point slice of k inputs is k rows):

* interval: six bounds per live tensor (``INTERVAL_PARTS``), plus the largest op's temporaries;
* linear (symbolic intervals, only for a block with one non-point input of at most
  ``engine.MAX_LINEAR_VARS`` elements): three forms (train, inference, drift) of numel x m
  entries per tensor;
* zonotope: a form keeps k <= cap(numel) = max(64, min(K_MAX, ELEMENT_BUDGET / numel)) symbols
  (zonotope.py), two forms (train, inference) per live tensor; an op's result is computed over
  all its inputs' symbols before it is reduced to its cap, so its temporaries hold
  ``ZONO_TEMPORARIES`` x (symbols in) x numel(out) entries: a linear layer that widens 32
  features to 2048 from a form with 16384 symbols allocates 16384 x 2048 x rows x seq x 8
  bytes at once (the encoder layer's 8 GiB request).

A method's estimate is the largest, over its nodes, of the live forms plus that node's
temporaries, plus ``BASE_BYTES``. The estimates are coarse (measured on
nn.TransformerEncoderLayer(32, 4) + Linear(32, 10), seq 8, 2-core CPU: one input, 2.9 GB
estimated, 1.5 GB peak RSS; eight inputs, 16.8 GB estimated where the unplanned run asked the
allocator for 8 GiB at once and reached 24 GB) and not an upper bound (MiniLM seq 16 under
``linear``: 12.1 GB peak against 2.3 GB estimated: some zonotope rules write position-local
symbols densely, one row per kind and position, beyond what the cap counts). They decide
between methods; the certificate records the method actually run per block (its ``method``),
and the checker re-runs that method. What makes the budget hold is ``enforced``: while a
relational method runs, the process's address space may grow by at most the budget's room
(RLIMIT_AS), so an allocation past it fails in the allocator, and the engine catches that
failure (torch's RuntimeError, MemoryError: ``is_out_of_memory``) into the same fallback: the
block is bounded again with intervals and the note says so.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kcverify.errors import KcverifyError

DEFAULT_FRACTION = 0.5  # of physical memory, the default budget
BASE_BYTES = 512 * 2**20  # the interpreter, torch, the graph and its weights
INTERVAL_PARTS = 6 * 3  # six bounds per tensor, and the rules' temporaries
LINEAR_TEMPORARIES = 3
ZONO_TEMPORARIES = 2
SYMBOLS_PER_MIX = 4
GB = 2.0**30


class MemoryBudgetError(KcverifyError):
    """A memory size that cannot be read (``--memory``)."""


def physical_memory() -> int:
    """The machine's physical memory in bytes (os.sysconf), or 0 when unknown."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def default_budget() -> int:
    """DEFAULT_FRACTION of physical memory (8 GiB when the machine does not say)."""
    phys = physical_memory()
    return int(phys * DEFAULT_FRACTION) if phys > 0 else 8 * 2**30


_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20,
          "mib": 2**20, "g": 2**30, "gb": 2**30, "gib": 2**30, "t": 2**40, "tb": 2**40,
          "tib": 2**40}


def parse_size(text: str | int | float) -> int:
    """A memory size: bytes, or a number with a binary unit (``4G``, ``512MiB``, ``1.5GB``), or
    a percentage of physical memory (``50%``)."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        if not (text > 0 and math.isfinite(text)):
            raise MemoryBudgetError(f"memory budget must be a positive size, not {text!r}")
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z%]*)\s*", str(text))
    unit = m.group(2).lower() if m else ""
    if m is None or (unit not in _UNITS and unit != "%"):
        raise MemoryBudgetError(f"memory budget {text!r}: expected a size such as 4G, 512M, "
                                f"2.5GiB or 50% (of physical memory)")
    value = float(m.group(1))
    size = value / 100 * physical_memory() if unit == "%" else value * _UNITS[unit]
    if not size >= 1:
        raise MemoryBudgetError(f"memory budget {text!r} is not a positive size")
    return int(size)


def show(n: float) -> str:
    return f"{n / GB:.1f} GB" if n >= 0.1 * GB else f"{n / 2**20:.0f} MB"


def is_out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is an allocator failure (torch's CPU / CUDA allocators, Python's)."""
    if isinstance(e, MemoryError):
        return True
    oom = getattr(__import__("torch"), "OutOfMemoryError", None)
    if oom is not None and isinstance(e, oom):
        return True
    msg = str(e)
    return isinstance(e, RuntimeError | KcverifyError) and (
        "can't allocate memory" in msg or "out of memory" in msg.lower()
        or "Cannot allocate memory" in msg or "Unable to allocate" in msg)


# --- the budget enforced -------------------------------------------------------------------
GUARD_SLACK = 256 * 2**20  # address space for thread stacks and malloc arenas made meanwhile


def process_memory() -> tuple[int, int]:
    """(mapped address space, resident set) of this process in bytes (/proc/self/statm); (0, 0)
    where the system does not say."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            size, resident = (int(v) for v in f.read().split()[:2])
        page = int(os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, AttributeError):
        return 0, 0
    return size * page, resident * page


def _start_threads() -> None:
    """Start torch's worker threads (OpenMP, BLAS) before the address space is limited: a
    thread that cannot be created under the limit ends the process (libgomp aborts), where an
    allocation that fails only raises."""
    import torch

    a = torch.ones(1 << 17, dtype=torch.float64)
    float((a * 2).sum())
    m = torch.ones(256, 256, dtype=torch.float64)
    float((m @ m).sum())


@contextlib.contextmanager
def enforced(budget: int, device: str = "cpu") -> Iterator[int | None]:
    """While a method the estimate let through runs, hold the process to the budget: its
    address space (RLIMIT_AS, soft limit) may grow by at most the budget's room above what is
    resident now (plus ``GUARD_SLACK``), so an allocation beyond fails in the allocator -
    torch's "can't allocate memory" RuntimeError, MemoryError - which the engine catches into
    a cheaper method with a note (``is_out_of_memory``), instead of the kernel's OOM killer
    ending the process without a word. The estimates decide between methods and are not upper
    bounds (the zonotope writes position-local symbols densely inside some rules, beyond what
    the cap counts); this is what makes the budget hold. Yields the limit set (None: not
    enforced: not Linux, a CUDA device - its driver maps address space freely -, or a limit
    already tighter). The previous limit is restored on exit."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        yield None
        return
    size, rss = process_memory()
    if not size or not str(device).startswith("cpu"):
        yield None
        return
    _start_threads()
    size, rss = process_memory()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = size + max(0, budget - rss) + GUARD_SLACK
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    if soft != resource.RLIM_INFINITY and soft <= limit:
        yield None  # a tighter limit is already set (prlimit, ulimit -v): it holds
        return
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield limit
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


# --- shapes ---------------------------------------------------------------------------------
def tensor_sizes(graph: Any, feeds: Mapping[str, np.ndarray]) -> dict[str, int]:
    """numel of every float tensor of ``graph`` for the batch in ``feeds``: one fp32 forward
    pass of the first sample, tensors with a sample axis scaled by the batch size."""
    import torch

    from kcverify.models.blocks import sample_axes
    from kcverify.models.executor import Executor

    one = {k: np.asarray(v)[:1] for k, v in feeds.items()}
    rows = max((np.asarray(v).shape[0] for v in feeds.values() if np.asarray(v).ndim), default=1)
    env = Executor(graph, dtype=torch.float32).run(one, keep=True)
    axes = sample_axes(graph)
    consts = set(graph.constant_names())
    out = {}
    for name, t in env.items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            continue
        ax = axes.get(name, "unknown")
        known = isinstance(ax, int) and not isinstance(ax, bool)
        # a tensor whose sample axis a reshape merged away grows with the batch too
        scaled = name not in consts and (ax == "unknown" or (known and t.dim() > ax
                                                              and t.shape[ax] == 1))
        out[name] = int(t.numel()) * (rows if scaled else 1)
    return out


# --- estimates ------------------------------------------------------------------------------
def _zono_cap(numel: int) -> int:
    from kcverify.bounds.zonotope import ELEMENT_BUDGET, K_MAX

    return max(64, min(K_MAX, ELEMENT_BUDGET // max(1, numel)))


MIXING = frozenset({"MatMul", "Gemm", "Conv", "LayerNormalization", "Softmax"})


def estimate(block_graph: Any, sizes: Mapping[str, int], method: str, linear_vars: int = 0
             ) -> int:
    """Peak bytes of bounding ``block_graph`` with ``method`` ("interval", "linear": symbolic
    intervals over ``linear_vars`` variables, "zonotope"), from the tensors' sizes. The
    zonotope's symbols: one per element of the block's inputs, and before each op that mixes
    elements (``MIXING``) at most ``SYMBOLS_PER_MIX`` per element of its inputs (fresh symbols
    for both kernels' noise, the casts' errors and straddled roundings); a form holds at most
    its cap and at most the symbols made so far."""
    consts = set(block_graph.constant_names())
    nodes = list(block_graph.nodes)
    last: dict[str, int] = {}
    for k, n in enumerate(nodes):
        for i in n.inputs:
            if i:
                last[i] = k
    outs = {v.name for v in block_graph.outputs}
    made = [sum(sizes.get(v.name, 0) for v in block_graph.inputs)]  # symbols so far

    def symbols(name: str) -> int:
        return min(_zono_cap(sizes.get(name, 0)), made[0])

    def entries(name: str) -> int:
        numel = sizes.get(name, 0)
        if method == "zonotope":
            return 2 * numel * symbols(name)
        if method == "linear":
            return 3 * numel * max(1, linear_vars)
        return INTERVAL_PARTS * numel

    live: dict[str, int] = {v.name: entries(v.name) for v in block_graph.inputs}
    peak = 0
    for k, n in enumerate(nodes):
        ins = [i for i in n.inputs if i and i not in consts and i in sizes]
        out_numel = sum(sizes.get(o, 0) for o in n.outputs if o)
        if method == "zonotope":
            if n.op_type in MIXING:
                made[0] += SYMBOLS_PER_MIX * sum(sizes[i] for i in ins)
            temp = ZONO_TEMPORARIES * sum(symbols(i) for i in ins) * out_numel
        elif method == "linear":
            temp = LINEAR_TEMPORARIES * 3 * out_numel * max(1, linear_vars)
        else:
            temp = INTERVAL_PARTS * out_numel
        peak = max(peak, sum(live.values()) + temp)
        for o in n.outputs:
            if o and o in sizes:
                live[o] = entries(o)
        for i in set(n.inputs):
            if i and last.get(i) == k and i not in outs:
                live.pop(i, None)
    return BASE_BYTES + 8 * peak


def _element_budget() -> int:
    from kcverify.bounds.zonotope import ELEMENT_BUDGET

    return ELEMENT_BUDGET


def methods_of(domain: str, block_graph: Any, in_rows: int) -> list[str]:
    """The methods a block bounded with ``domain`` runs beside the intervals (engine.bound_block:
    best adds the zonotope on at most ZONO_BEST_ROWS rows)."""
    from kcverify.bounds.engine import ZONO_BEST_ROWS

    if domain in ("linear", "zonotope"):
        return ["interval", "linear", "zonotope"] if domain == "linear" else ["interval", "zonotope"]
    if domain == "best":
        return ["interval", "linear"] + (["zonotope"] if in_rows <= ZONO_BEST_ROWS else [])
    return ["interval"]


@dataclass
class MemoryPlan:
    """Per block: the domain it is bounded with, the estimated peak of that choice, and notes
    (one per replaced method)."""

    domains: list[str]
    peaks: list[int]
    budget: int
    notes: list[str] = field(default_factory=list)


def plan_blocks(graph: Any, blocks: Sequence[Any], feeds: Mapping[str, np.ndarray], domain: str,
                budget: int, linear_vars: int = 0) -> MemoryPlan:
    """For each block, ``domain`` when its estimate fits ``budget``, else "interval" (with a
    note "method X needs ~N GB > budget M GB: used interval")."""
    from kcverify.bounds.engine import expanded

    rows = max((np.asarray(v).shape[0] for v in feeds.values() if np.asarray(v).ndim), default=1)
    need_shapes = domain in ("best", "linear", "zonotope")
    domains, peaks, notes = [], [], []
    sizes: dict[str, int] = {}
    if need_shapes:
        try:
            sizes = tensor_sizes(graph, feeds)
        except Exception as e:  # noqa: BLE001 - a resource estimate, not a bound: say so, go on
            notes.append(f"memory plan: tensor shapes unknown ({type(e).__name__}: {e}); "
                         f"methods run unplanned")
    for b in blocks:
        if not need_shapes:
            domains.append(domain)
            peaks.append(0)
            continue
        g = expanded(b.graph, domain)
        runs = methods_of(domain, g, rows)
        est = {m: estimate(g, sizes, m, linear_vars) for m in runs}
        need = sum(est.values()) - (len(est) - 1) * BASE_BYTES
        if need <= budget:
            domains.append(domain)
            peaks.append(need)
            continue
        biggest = max((m for m in runs if m != "interval"), key=lambda m: est[m])
        domains.append("interval")
        peaks.append(est["interval"])
        notes.append(f"block {b.name!r}: method {domain} ({biggest}) needs ~{show(need)} > "
                     f"budget {show(budget)}: used interval")
    return MemoryPlan(domains, peaks, budget, notes)
