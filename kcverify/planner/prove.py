"""`kcverify prove`: decide every clause of a contract on a model and write the certificate.

For each clause, by class (semantics §1.2):

* certifiable: its NumericalQuery goes to the bound engine on the clause's slice (one
  certify_drift run per slice, shared by every clause on it); the certified drift goes through
  the paper's chain (semantics §1.3) as composition rules (linf-from-state, ratio/logprob/tv/kl,
  top1-from-margin, aggregate, threshold), so the clause's proof tree is checkable. When the bound
  misses the threshold, concrete conforming programs (seeded realizations of both specs) look for
  a violation: one found and replayed makes the clause *refuted*; otherwise the clause falls back
  to evidence (passed / failed empirically, the formal verdict recorded as unknown).
* empirical: both kernels run on the clause's slices and the metric registry decides, with
  Clopper-Pearson confidence for a soft clause (kcverify.empirical); runtime metrics are measured.
* static: evaluated on the model artifact.

A soft clause (with a budget) that is proved outright also holds within its budget.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kcverify.dsl import Clause, Contract, NumericalQuery, load_contract, numerical_queries
from kcverify.errors import InputFileError, KcverifyError
from kcverify.report.model import BlockDrift, ClauseResult, Report, Verdict

PROGRESS_S = 15.0  # seconds between progress lines from inside one long block run
CERT_VERDICT = {Verdict.PROVED: "proved", Verdict.REFUTED: "refuted", Verdict.UNKNOWN: "unknown",
                Verdict.PASSED: "passed", Verdict.FAILED: "failed"}


@dataclass
class ProveOptions:
    """How to prove: bound domain and device, concrete programs drawn, outputs written."""

    domain: str = "best"
    device: str = "cpu"
    realizations: int = 2  # inference programs drawn per slice (first: nearest, in order)
    confidence: float = 0.95
    runtime_repeats: int = 3
    smt_timeout: float = 30.0  # seconds per input for z3 on small blocks
    region_timeout: float = 60.0  # seconds of input splitting per VNN-LIB slice (regions)
    # > 0: a bound that misses its threshold on a point slice is proved by cases over the
    # inputs' unstable fp8 casts, up to this many cases per input (a case-split leaf)
    cases: int = 0
    cert_path: Path | None = None  # default MODEL.kcert.json
    embed: bool = False
    write_certificate: bool = True
    force: bool = False  # replace a certificate of another contract (else refuse, exit 2)
    progress: Callable[[str], None] | None = None
    # maps the slices' bound runs as independent work items (kcverify.distributed: Ray);
    # None: one at a time, here, when a clause first needs them
    executor: Any = None
    # inputs per chunk of a slice, each chunk bounded and chained on its own (sequential with
    # rows), the chunks' per-input conclusions joined by concat-rows. None: 1 when the domain
    # is relational (linear, zonotope), else the whole slice (best: the intervals on a slice of
    # more than ZONO_BEST_ROWS inputs, the zonotope beside them on smaller ones: per-input
    # zonotope runs cost minutes each on transformers and are worth it only where they prove
    # more; ask for them with chunk_rows=1); 0: the whole slice
    chunk_rows: int | None = None
    # the bound engine's memory budget in bytes (bounds/memory.py; None: a fraction of physical
    # memory): a block whose method cannot fit is bounded with intervals, with a note
    memory: int | None = None
    # the blocks a slice is bounded in (docs/bounds.md, "Block boundaries"): "segments" (the
    # segmenter's blocks: boxes between them), "whole" (the whole graph as one block, one input
    # per chunk (at most ZONO_BEST_ROWS): best's zonotope keeps its correlations across layers,
    # seconds to minutes per input), "auto": segments, and where a clause's bound misses its
    # threshold on a point slice of at most ``whole_inputs`` inputs, the whole graph per input
    # (stopping at the first input whose bound alone misses a max / min clause). The linear
    # domain always bounds the whole graph.
    blocks: str = "auto"
    whole_inputs: int = 16


@dataclass
class ProveResult:
    report: Report
    statement: dict[str, Any]
    cert_path: Path | None

    @property
    def exit_code(self) -> int:
        """0 when no clause is violated and every hard clause holds; else 1."""
        bad = any(Verdict(c.verdict).violated for c in self.report.clauses)
        return 1 if bad else 0


class Session:
    """One prove run: the contract, the model, the bound results per slice, and the empirical
    run (kcverify.empirical.EmpiricalRun: slices, both kernels' outputs, runtime) they share."""

    def __init__(self, contract: Contract, model_path: Path, options: ProveOptions) -> None:
        from kcverify.empirical.run import EmpiricalRun
        from kcverify.models.ir import load_onnx

        self.contract = contract
        self.model_path = model_path
        self.options = options
        self.graph = load_onnx(model_path)
        self.train = _kernel(contract, "train")
        self.inf = _kernel(contract, "inf")
        from kcverify.bounds.qdq_graph import bound_problem

        # what the bound engine walks: the model and the kernels, or - for an inference kernel
        # given as a QDQ graph - the joint graph of both (docs/qdq.md)
        self.bound_graph, self.bound_train, self.bound_inf = bound_problem(
            self.graph, self.train, self.inf, Path(contract.path).parent)
        floats = [v.name for v in self.graph.outputs if (v.dtype or "float32").startswith("float")]
        if not floats:
            raise KcverifyError(f"{model_path}: the model has no float output to bound")
        self.output = floats[0]
        self.empirical = EmpiricalRun(contract, self.graph, device=options.device,
                                      output=self.output, confidence=options.confidence)
        self._drift: dict[tuple[str, int, int, str], Any] = {}  # (slice, i0, i1, cut)
        self.notes: list[str] = []  # the memory budget's (bounds/memory.py)
        self._blocks: dict[str, list[BlockDrift]] = {}
        # per (slice, its chunks, cut): per chunk (rows, block refs, sequential node)
        self.block_refs: dict[tuple[str, tuple[tuple[int, int], ...], str],
                              list[tuple[tuple[int, int], list[str], dict[str, Any]]]] = {}
        self.chunk_refs: dict[tuple[str, tuple[int, int], str], list[str]] = {}
        if options.blocks not in ("auto", "segments", "whole"):
            raise KcverifyError(f"blocks must be auto, segments or whole, not {options.blocks!r}")
        self._ticks: dict[str, float] = {}

    def say(self, msg: str) -> None:
        if self.options.progress is not None:
            self.options.progress(msg)

    def slice(self, name: str) -> Any:
        if name not in self.contract.slices:
            raise KcverifyError(f"{self.contract.path}: clause uses undefined slice {name!r}")
        data = self.empirical.slice(name)
        if data.n == 0:
            raise InputFileError(f"slice {name!r} ({data.source}): no inputs (after 'where')")
        return data

    def feeds(self, name: str) -> dict[str, np.ndarray]:
        self.slice(name)
        return self.empirical.feeds(name)

    def cuts(self, name: str) -> list[str]:
        """The block cuts to try on slice ``name``, in order (ProveOptions.blocks): "segments"
        (the segmenter's blocks) and / or "whole" (the whole graph as one block). The linear
        domain always cuts the whole graph; auto adds the whole graph after the segments on a
        point slice of at most ``whole_inputs`` inputs under a relational domain."""
        o = self.options
        if o.domain == "linear":
            return ["whole"]
        if o.blocks == "whole":
            return ["whole"]
        if o.blocks == "segments" or o.domain not in ("best", "zonotope"):
            return ["segments"]
        sl = self.contract.slices[name]
        points = (sl.region is None or sl.region.eps == 0) and not _region_slice(self, name)
        return ["segments", "whole"] if points and self.slice(name).n <= o.whole_inputs \
            else ["segments"]

    def chunks(self, name: str, cut: str | None = None) -> list[tuple[int, int]]:
        """The chunks [(i0, i1)] slice ``name`` is bounded in with ``cut`` (default: the first
        of ``cuts``; ProveOptions.chunk_rows). The whole graph under best / zonotope: chunks of
        one input (chunk_rows when 1 .. ZONO_BEST_ROWS), so that the zonotope runs on each."""
        from kcverify.bounds.engine import ZONO_BEST_ROWS

        n = self.slice(name).n
        cut = cut or self.cuts(name)[0]
        size = self.options.chunk_rows
        if size is not None and size < 0:
            raise KcverifyError(f"chunk_rows must be >= 0, not {size}")
        domain = self.options.domain
        if cut == "whole" and domain in ("best", "zonotope"):
            size = size if size is not None and 1 <= size <= ZONO_BEST_ROWS else 1
        if size is None:
            size = 1 if domain in ("linear", "zonotope") else 0
        if size == 0 or size >= n:
            return [(0, n)]
        return [(i, min(n, i + size)) for i in range(0, n, size)]

    def drift_chunk(self, name: str, rows: tuple[int, int], cut: str | None = None) -> Any:
        """The bound engine's result on rows [i0, i1) of slice ``name`` with ``cut`` (default:
        the first of ``cuts``; one run per chunk and cut)."""
        from kcverify.bounds import certify_drift

        cut = cut or self.cuts(name)[0]
        key = (name, *rows, cut)
        if key not in self._drift:
            t0 = time.perf_counter()
            what = f"slice {name!r}" + ("" if self.chunks(name, cut) == [rows] else
                                        f" inputs [{rows[0]}, {rows[1]})")
            if cut == "whole" and self.options.domain != "linear":
                what += " (whole graph)"

            def progress(k: int, n: int, block: str) -> None:
                self.say(f"bounding {what}: block {k + 1}/{n} ({block})")

            def nodes(block: str, k: int, n: int, op: str) -> None:
                # a long block (the whole graph: minutes) says where it is every PROGRESS_S
                now = time.perf_counter()
                if now - self._ticks.get(what, t0) >= PROGRESS_S:
                    self._ticks[what] = now
                    self.say(f"bounding {what}: block {block!r} node {k + 1}/{n} ({op}), "
                             f"{now - t0:.0f}s")

            self._drift[key] = certify_drift(self.bound_graph, self.bound_train, self.bound_inf,
                                             **self.drift_item(name, rows, cut),
                                             progress=progress, node_progress=nodes)
            self.note(self._drift[key])
            un = self._drift[key].unstable_casts
            extra = ("" if un is None or not np.any(un) else
                     f"; {int(np.sum(un))} unstable casts (max {int(np.max(un))} per input)")
            per = self._drift[key].linf
            each = "" if len(per) < 2 else f" (per input {', '.join(f'{v:.4g}' for v in per)})"
            self.say(f"bounded {what} in {time.perf_counter() - t0:.1f}s: "
                     f"certified max drift {float(np.max(per)):.4g}{each}{extra}")
        return self._drift[key]

    def drift(self, name: str, cut: str | None = None) -> Any:
        """The bound engine's result on slice ``name`` with ``cut``: its chunks' runs, joined
        along the inputs (linf, outputs, unstable casts; blocks: every chunk's records)."""
        from kcverify.bounds.engine import DriftResult
        from kcverify.boxes import FIELDS, DiffBox

        cut = cut or self.cuts(name)[0]
        parts = [self.drift_chunk(name, r, cut) for r in self.chunks(name, cut)]
        if len(parts) == 1:
            return parts[0]
        outs = {k: DiffBox(*(np.concatenate([np.asarray(getattr(p.outputs[k], f)) for p in parts])
                             for f in FIELDS)) for k in parts[0].outputs}
        unstable = (None if any(p.unstable_casts is None for p in parts)
                    else np.concatenate([p.unstable_casts for p in parts]))
        return DriftResult(np.concatenate([p.linf for p in parts]), outs,
                           [r for p in parts for r in p.blocks], sum(p.seconds for p in parts),
                           parts[0].domain, unstable)

    def unstable_casts(self) -> dict[str, list[int]]:
        """Per bounded slice, the unstable casts of each input (kcverify.bounds.diagnostics):
        the honest measure of how close the slice sits to an fp8 rounding boundary. Of the
        whole-graph runs where every input has one (fewer: the forms decide more casts), else
        of the first cut's."""
        out: dict[str, list[int]] = {}
        for name in sorted({k[0] for k in self._drift}):
            cuts = self.cuts(name)
            parts = []
            for cut in reversed(cuts):
                keys = [(name, *r, cut) for r in self.chunks(name, cut)]
                parts = [self._drift[k] for k in keys if k in self._drift]
                if len(parts) == len(keys) or cut == cuts[0]:
                    break
            if parts and all(p.unstable_casts is not None for p in parts):
                counts = [int(v) for p in parts for v in p.unstable_casts]
                if any(counts):
                    out[name] = counts
        return out

    def drift_item(self, name: str, rows: tuple[int, int] | None = None,
                   cut: str = "segments") -> dict[str, Any]:
        """The bound engine's work on slice ``name`` (rows [i0, i1) of it when given) with
        ``cut``: certify_drift's arguments besides the graph and the kernels."""
        from kcverify.bounds import Region

        sl = self.contract.slices[name]
        region = None
        if sl.region is not None:
            region = Region(space=sl.region.space, norm=sl.region.norm, eps=sl.region.eps)
        feeds = self.feeds(name)
        if rows is not None:
            feeds = {k: v[rows[0]:rows[1]] for k, v in feeds.items()}
        return dict(feeds=feeds, region=region, domain=self.options.domain,
                    device=self.options.device, memory=self.options.memory, cut=cut)

    def note(self, res: Any) -> None:
        """Keep (and say) the memory budget's notes of a bound run (DriftResult.notes)."""
        for n in getattr(res, "notes", None) or []:
            if n not in self.notes:
                self.notes.append(n)
                self.say(f"memory: {n}")

    def prefetch_drifts(self, executor: Any) -> None:
        """Bound every chunk of every slice a certifiable clause queries (the runs drift_chunk()
        makes when a clause first needs them) as independent work items: ``executor.map_drift``
        returns them in order (kcverify.distributed)."""
        names = list(dict.fromkeys(q.slice for c in self.contract.clauses
                                   if c.klass == "certifiable"
                                   for q in numerical_queries(c) or []
                                   if q.slice in self.contract.slices))
        cut = {n: self.cuts(n)[0] for n in names}
        keys = [(n, r) for n in names for r in self.chunks(n)
                if (n, *r, cut[n]) not in self._drift]
        self.say(f"bounding {len(keys)} chunk(s) of {len(names)} slice(s) on "
                 f"{executor.workers} worker(s)")

        def done(i: int, res: Any) -> None:
            n, r = keys[i]
            self.note(res)
            self.say(f"bounded slice {n!r} inputs [{r[0]}, {r[1]}): certified max drift "
                     f"{float(np.max(res.linf)):.4g}")

        if self.bound_graph is not self.graph:
            # workers reload the model file, not the joint graph of a QDQ kernel: bound here
            self.say("a QDQ kernel's joint graph is bounded here, not on the workers")
            return
        results = executor.map_drift(self.graph, self.model_path, self.train, self.inf,
                                     [self.drift_item(n, r, cut[n]) for n, r in keys], done)
        self._drift.update({(n, *r, cut[n]): res
                            for (n, r), res in zip(keys, results, strict=True)})

    def block_drifts(self, name: str) -> list[BlockDrift]:
        """Certified against observed drift per block on slice ``name`` (the report's plot)."""
        from kcverify.bounds import blocks_of
        from kcverify.empirical.blocks import (
            block_drifts,
            certified_block_drift,
            observed_block_drift,
        )

        if name not in self._blocks:
            certified: dict[str, float] = {}
            for rows in self.chunks(name):  # the largest over the chunks, per block
                for k, v in certified_block_drift(self.drift_chunk(name, rows).blocks).items():
                    certified[k] = max(v, certified.get(k, v))
            blocks = blocks_of(self.bound_graph)
            observed = {} if self.inf.onnx is not None else observed_block_drift(
                self.graph, blocks, self.train, self.inf, self.feeds(name),
                device=self.options.device)  # a QDQ kernel's blocks: certified only
            self._blocks[name] = block_drifts(certified, observed,
                                              {b.name: b.kind for b in blocks})
        return self._blocks[name]


def _kernel(contract: Contract, name: str) -> Any:
    if name not in contract.kernels:
        raise KcverifyError(f"{contract.path}: kernels needs a {name!r} spec "
                            f"(it has {', '.join(sorted(contract.kernels)) or 'none'})")
    return contract.kernels[name]


# --- deciding one clause -----------------------------------------------------------------------
@dataclass
class _Decision:
    result: ClauseResult
    cert: dict[str, Any]  # keyword arguments of CertificateBuilder.add_clause


def _input_box(x: np.ndarray, sl: Any) -> Any:
    """The model-input region a chain starts from: the points, or the box that encloses an
    input-space region around them (both kernels read the same input: no drift). Embedding-space
    regions enter inside the first block."""
    from kcverify.bounds.box import DiffBox

    region = getattr(sl, "region", None)
    if region is None or region.space != "input" or x.dtype.kind != "f":
        return DiffBox.point(x)
    lo = np.nextafter(x - region.eps, -np.inf)
    hi = np.nextafter(x + region.eps, np.inf)
    zero = np.zeros_like(x)
    return DiffBox(lo, hi, lo.copy(), hi.copy(), zero, zero.copy())


@dataclass
class PlanContext:
    """What a rule's ``plan(ctx) -> (premises, params) | None`` sees when it builds its own
    premises (docs/rules.md): the certificate ``builder``, the ``query``, the slice's chain
    (``chain``: the state of the logits; ``refs``: its block certificates, in order), ``linf``
    (the L-inf drift of the logits, with ``keep``) and ``output`` (the logits' tensor).
    ``prefix(k)`` and ``certify(k, in_state)`` build further nodes. ``rows``: the chunk of the
    slice's inputs [i0, i1) the chain covers (None: the whole slice); a plan over a chunk must
    conclude over those rows (carry ``rows``) for concat-rows to join it with the others."""

    session: Session
    builder: Any
    query: NumericalQuery
    refs: list[str]
    chain: dict[str, Any]
    linf: dict[str, Any]
    keep: int
    rows: tuple[int, int] | None = None
    cut: str = "segments"  # the chain's blocks: the segmenter's, or the whole graph as one

    @property
    def output(self) -> str:
        return str(self.session.output)

    @property
    def records(self) -> list[Any]:
        """The bound engine's block records on the query's slice (BlockRecord), in chain order."""
        s, sl = self.session, self.query.slice
        if self.rows is None:
            return list(s.drift(sl, self.cut).blocks)
        return list(s.drift_chunk(sl, self.rows, self.cut).blocks)

    @property
    def blocks(self) -> list[Any]:
        """The blocks of the chain (the model's segmentation; the whole graph for the linear
        domain and the whole cut), as certify_drift bounds them."""
        from kcverify.bounds.engine import blocks_of, whole_graph

        g = self.session.bound_graph
        whole = self.cut == "whole" or self.session.options.domain == "linear"
        return list(whole_graph(g) if whole else blocks_of(g))

    def prefix(self, k: int) -> dict[str, Any]:
        """A sequential node over the first ``k`` blocks of the chain, from the slice's inputs:
        the state of every tensor they produce (outputs: the k-th block's outputs)."""
        sl = self.query.slice
        outs = sorted(self.records[k - 1].out_state)
        return _chain(self.session, self.builder, sl, self.rows, self.refs[:k], outs)

    def certify(self, k: int, in_state: dict[str, Any]) -> dict[str, Any]:
        """A block leaf: block ``k`` of the chain bounded by the engine from ``in_state`` (a
        DiffBox per input tensor), with the session's domain; the checker re-runs it."""
        from kcverify.bounds import bound_block
        from kcverify.bounds.engine import BlockRecord

        s = self.session
        # the method the chain's record of this block was bounded with (the memory budget may
        # have replaced the session's domain by intervals there)
        recs = self.records
        block = self.blocks[k]
        domain = recs[k].method if k < len(recs) else s.options.domain
        out = bound_block(block, s.bound_train, s.bound_inf, in_state, domain=domain,
                          device=s.options.device)
        method = domain if domain in ("separate", "linear", "best", "zonotope") else "interval"
        rec = BlockRecord(block.name, block.digest, method, dict(in_state), out)
        n = sum(1 for r in self.builder.blocks if r.startswith(f"{self.query.slice}/plan"))
        ref = self.builder.add_block(rec, ref=f"{self.query.slice}/plan{n}:{block.name}")
        return self.builder.block(ref)


def _plans(s: Session, b: Any, q: NumericalQuery, chunks: list[tuple[int, int]], keep: int,
           cut: str = "segments") -> list[PlanContext]:
    """One PlanContext per chunk of the query's slice bounded with ``cut``: its blocks stored
    in the certificate (once per session and chunk), its chain (sequential, with rows unless
    the chunk is the whole slice) and the L-inf drift of the logits over it."""
    key = (q.slice, tuple(chunks), cut)
    n = s.slice(q.slice).n
    if key not in s.block_refs:
        built = []
        for rows in chunks:
            whole = rows == (0, n)
            if (q.slice, rows, cut) not in s.chunk_refs:
                res = s.drift_chunk(q.slice, rows, cut)
                tag = q.slice if whole else f"{q.slice}/r{rows[0]}-{rows[1]}"
                if cut == "whole" and s.options.domain != "linear":
                    tag += "/whole"
                s.chunk_refs[(q.slice, rows, cut)] = [
                    b.add_block(r, ref=f"{tag}/{i}:{r.name}") for i, r in enumerate(res.blocks)]
            refs = s.chunk_refs[(q.slice, rows, cut)]
            chain = _chain(s, b, q.slice, None if whole else rows, refs, [s.output])
            built.append((rows, refs, chain))
        s.block_refs[key] = built
    out = []
    for rows, refs, chain in s.block_refs[key]:
        linf = b.apply("linf-from-state", [chain], tensor=s.output, keep=keep)
        out.append(PlanContext(s, b, q, refs, chain, linf, keep,
                               None if rows == (0, n) else rows, cut))
    return out


def _chain(s: Session, b: Any, sl: str, rows: tuple[int, int] | None, refs: list[str],
           outputs: list[str]) -> dict[str, Any]:
    """A sequential node over blocks ``refs`` from the inputs of slice ``sl`` (of its rows
    [i0, i1) only, params.rows, when ``rows`` is given: a chunk's chain)."""
    from kcverify.certs.records import encode_state

    feeds = s.feeds(sl)
    if rows is not None:
        feeds = {k: v[rows[0]:rows[1]] for k, v in feeds.items()}
    inputs = {k: _input_box(np.asarray(v, dtype=np.float64), s.contract.slices[sl])
              for k, v in feeds.items()}
    if rows is None:
        return b.sequential(refs, inputs=inputs, outputs=outputs, slice=sl)
    return b.apply("sequential", [b.block(r) for r in refs], inputs=encode_state(inputs),
                   outputs=list(outputs), slice=sl, rows=list(rows))


def derivations(quantity: str) -> list[tuple[str, str]]:
    """(rule, premises) of every rule that derives ``quantity``: the quantity table's built-ins
    (kcverify.dsl.quantities), then every registered rule declaring ``derives = quantity``
    (docs/rules.md), which takes ``premises`` (a class attribute; default ``linf+state``)."""
    from kcverify.certs.rules import RULES
    from kcverify.dsl.quantities import get_quantity

    out = [(d.rule, d.premises) for d in get_quantity(quantity).derivations]
    for name, rule in sorted(RULES.items()):
        if getattr(rule, "derives", None) == quantity and name not in (r for r, _ in out):
            out.append((name, getattr(rule, "premises", "linf+state")))
    return out


def _derive(b: Any, rule: str, premises: str, q: NumericalQuery, chain: dict[str, Any],
            linf: dict[str, Any], tensor: str, keep: int, plan: Any) -> dict[str, Any]:
    """Apply ``rule`` to the premises it takes (RuleError when outside its preconditions)."""
    from kcverify.certs.rules import RULES, RuleError
    from kcverify.dsl.quantities import PREMISES, get_quantity

    rule_obj = RULES[rule]
    if hasattr(rule_obj, "plan"):  # a rule that builds its own premises (docs/rules.md)
        planned = rule_obj.plan(plan)
        if planned is None:
            raise RuleError(f"{rule}: does not apply to this query")
        nodes, params = planned
        return b.apply(rule, nodes, **params)
    if premises not in PREMISES:
        raise RuleError(f"{rule}: premises {premises!r} is not one of {', '.join(PREMISES)}")
    if premises == "state":
        return b.apply(rule, [chain], tensor=tensor, keep=keep)
    params: dict[str, Any] = {}
    if get_quantity(q.quantity).temperature:
        params["temperature"] = float(q.temperature)
    return b.apply(rule, [linf] if premises == "linf" else [linf, chain], **params)


def _try_prove(s: Session, b: Any, clause: Clause, q: NumericalQuery
               ) -> tuple[dict[str, Any] | None, float | None, str]:
    """(proof, bound, note): a proof tree when the certified bound meets the threshold; else the
    bound reached (None when no rule derives the quantity) and why it is not a proof.

    Every rule that derives the query's quantity is tried (the built-ins of the quantity table
    and each registered rule declaring it in ``derives``); the tightest bound is kept."""
    from kcverify.certs.encoding import unfx
    from kcverify.certs.rules import RuleError
    from kcverify.dsl.quantities import get_quantity, proof_statistic, query_text
    from kcverify.regions.plan import is_vnnlib_slice, prove_region_query

    if is_vnnlib_slice(s.contract.slices[q.slice]):  # a VNN-LIB box: input splitting
        return prove_region_query(s, b, q)
    entry = get_quantity(q.quantity)
    rules = derivations(q.quantity)
    if not rules:
        return None, None, f"'{query_text(q)}': no rule derives {q.quantity} (load one with --rules)"
    region = s.contract.slices[q.slice].region
    if region is not None and region.space != "input" and region.eps > 0:
        # sound bounds, but the checker cannot re-check a region entering inside a block yet:
        # no certificate claim, decided on evidence instead
        return None, None, f"{region.space}-space regions are not certified yet"
    keep = 2 if q.per_position else 1
    if getattr(b.ctx, "kernel_specs", "absent") is None:  # rules may read the specs (checker too)
        b.ctx.kernel_specs = dict(s.contract.kernels)
    stat = proof_statistic(q, keep)
    pick = min if entry.upper else max
    cuts = s.cuts(q.slice)
    tried, skipped, per_input = _derive_all(s, b, q, rules, keep, stat, cuts[0])
    if not tried:
        return None, None, f"'{query_text(q)}': no rule applies ({'; '.join(skipped)})"
    bound, rule, agg = pick(tried, key=lambda t: t[0])
    how = ", ".join(f"{r} {v:.6g}" for v, r, _ in tried) + f"; kept {rule}" if len(tried) > 1 \
        else rule
    s.say(f"{clause.id}: '{query_text(q)}': certified bound {bound:.6g} ({how})")
    try:
        return b.apply("threshold", [agg], threshold=float(q.threshold), op=q.op), bound, ""
    except RuleError:
        pass
    note = f"'{query_text(q)}': certified bound {bound:.6g} ({rule}) misses it"
    for cut in cuts[1:]:  # auto: the whole graph as one block, one input per run
        stopped = _bound_whole(s, b, q, rules, keep, stat, per_input)
        if stopped is not None:
            s.say(f"{clause.id}: {stopped}")
            note += f"; {stopped}"
            continue
        tried, skipped, _ = _derive_all(s, b, q, rules, keep, stat, cut)
        if not tried:
            continue
        got, rule, agg = pick(tried, key=lambda t: t[0])
        s.say(f"{clause.id}: '{query_text(q)}': certified bound {got:.6g} with the whole graph "
              f"as one block per input ({rule})")
        try:
            return b.apply("threshold", [agg], threshold=float(q.threshold), op=q.op), got, ""
        except RuleError:
            note += f"; the whole graph per input: {got:.6g}"
            bound = pick(bound, got)
    smt = _try_smt(s, b, q)
    if smt is not None:
        return smt, unfx(smt["conclusion"]["bound"][0]), ""
    by_cases = _try_cases(s, b, q, stat)
    if by_cases is not None:
        proof, got = by_cases
        if proof is not None:
            return proof, got, ""
        return None, min(bound, got) if entry.upper else bound, note + f"; by cases {got:.6g}"
    return None, bound, note


def _derive_all(s: Session, b: Any, q: NumericalQuery, rules: list[tuple[str, str]], keep: int,
                stat: str, cut: str
                ) -> tuple[list[tuple[float, str, dict[str, Any]]], list[str],
                           dict[str, list[float]]]:
    """Every rule deriving the query's quantity on its slice's chunks bounded with ``cut``,
    aggregated: ([(bound, rule, aggregate node)], [why a rule was skipped], per rule the
    per-input bounds of its node over the slice, where it lists them)."""
    from kcverify.certs.encoding import unfx
    from kcverify.certs.rules import RuleError
    from kcverify.dsl.quantities import get_quantity

    entry = get_quantity(q.quantity)
    plans = _plans(s, b, q, s.chunks(q.slice, cut), keep, cut)
    tried: list[tuple[float, str, dict[str, Any]]] = []
    skipped: list[str] = []
    per_input: dict[str, list[float]] = {}
    for rule, premises in rules:
        try:
            nodes = [p.linf if rule == "linf-from-state" else _derive(
                b, rule, premises, q, p.chain, p.linf, s.output, keep, p) for p in plans]
            if len(nodes) > 1 and any("rows" not in n["conclusion"] for n in nodes):
                # a rule that does not carry its chunk's rows (a researcher's rule written for
                # whole slices): apply it to one chain over the whole slice instead
                (whole,) = _plans(s, b, q, [(0, s.slice(q.slice).n)], keep, cut)
                nodes = [whole.linf if rule == "linf-from-state" else _derive(
                    b, rule, premises, q, whole.chain, whole.linf, s.output, keep, whole)]
            node = nodes[0] if len(nodes) == 1 else b.apply(
                "concat-rows", nodes, n=s.slice(q.slice).n)
            got = node["conclusion"].get("quantity")
            if got != entry.conclusion or node["conclusion"].get("direction") != entry.direction:
                raise RuleError(f"{rule} derives {q.quantity} but concludes {got!r} "
                                f"({node['conclusion'].get('direction')}); the quantity table "
                                f"expects {entry.conclusion!r} ({entry.direction})")
            agg = b.apply("aggregate", [node], stat=stat)
        except RuleError as e:
            skipped.append(f"{rule}: {e}")
            continue
        if isinstance(node["conclusion"].get("bounds"), list):
            per_input[rule] = [unfx(v) for v in node["conclusion"]["bounds"]]
        tried.append((unfx(agg["conclusion"]["bounds"][0]) + 0.0, rule, agg))  # -0 reads 0
    return tried, skipped, per_input


def _bound_whole(s: Session, b: Any, q: NumericalQuery, rules: list[tuple[str, str]], keep: int,
                 stat: str, before: dict[str, list[float]]) -> str | None:
    """Bound the query's slice with the whole graph as one block, chunk by chunk (one input
    each under best); None when every chunk is bounded. Stops early (and says why) at a chunk
    after which no rule can prove the query: for a max (min) statistic, one whose own bound
    misses the threshold; for the others, one that improves on no input's bound ``before``
    (the segments' per-input bounds, per rule). Stopping only saves time: what is proved
    rests on the runs made."""
    from kcverify.certs.encoding import unfx
    from kcverify.certs.rules import RuleError

    chunks = s.chunks(q.slice, "whole")
    n = s.slice(q.slice).n
    s.say(f"{q.slice!r}: bounding the whole graph as one block ({len(chunks)} run(s), "
          f"{chunks[0][1] - chunks[0][0]} input(s) each)")
    for k, rows in enumerate(chunks):
        s.drift_chunk(q.slice, rows, "whole")
        if k == len(chunks) - 1:
            return None
        (p,) = _plans(s, b, q, [rows], keep, "whole")
        hopeful = []
        for rule, premises in rules:
            try:
                node = p.linf if rule == "linf-from-state" else _derive(
                    b, rule, premises, q, p.chain, p.linf, s.output, keep, p)
            except RuleError:
                continue
            c = node["conclusion"]
            if "rows" not in c or not isinstance(c.get("bounds"), list):
                hopeful.append(True)  # no per-chunk reading: cannot tell, go on
                continue
            vals = [unfx(v) for v in c["bounds"]]
            hopeful.append(_may_prove(q, stat, c.get("direction"), vals, before.get(rule),
                                      rows, n))
        if hopeful and not any(hopeful):
            return (f"the whole graph: inputs [{rows[0]}, {rows[1]}) alone leave it unproved "
                    f"(bound {float(np.max(s.drift_chunk(q.slice, rows, 'whole').linf)):.4g} "
                    f"on the logits); stopped after {k + 1} of {len(chunks)} run(s)")
    return None


def _may_prove(q: NumericalQuery, stat: str, direction: Any, vals: list[float],
               before: list[float] | None, rows: tuple[int, int], n: int) -> bool:
    """Whether a query may still be proved after one chunk's per-input bounds ``vals``."""
    thr = float(q.threshold)
    if stat == "max" and direction == "upper" and vals and q.op in ("<=", "<"):
        v = max(vals)
        return v <= thr if q.op == "<=" else v < thr
    if stat == "min" and direction == "lower" and vals and q.op in (">=", ">"):
        v = min(vals)
        return v >= thr if q.op == ">=" else v > thr
    # per input, or per input and position (a per-token quantity: k entries per input)
    k = len(before) // n if before else 0
    if not k or len(before) != k * n or len(vals) != k * (rows[1] - rows[0]):
        return True
    old = before[k * rows[0]:k * rows[1]]
    if direction == "upper":
        return any(v < o for v, o in zip(vals, old, strict=True))
    return any(v > o for v, o in zip(vals, old, strict=True))


def _try_smt(s: Session, b: Any, q: NumericalQuery) -> dict[str, Any] | None:
    """For a small ReLU model and an L-inf logit-drift clause the interval bound misses: decide
    it exactly with z3 (kcverify.smt); a proof is an smt-block leaf the checker re-solves."""
    import math

    from kcverify.certs.rules import RuleError

    if q.quantity != "logit_linf" or q.aggregate != "max" or q.per_position or not q.upper:
        return None
    if not all((v.dtype or "").startswith("float") for v in s.graph.inputs):
        return None  # token models: SMT encodes float-input ReLU networks only
    sl = s.contract.slices[q.slice]
    eps = 0.0
    if sl.region is not None:
        if sl.region.space != "input" or sl.region.norm != "linf":
            return None
        eps = float(sl.region.eps)
    try:
        from kcverify.smt import smt_decide_block
    except ImportError:  # pragma: no cover - z3 is a dependency
        return None
    if eps > 0:
        # the checker holds the leaf to boxes that contain the slice's region as it reads it
        # (x -+ eps rounded outward, within 2 ulps of the exact edges): widen eps by 4 ulps
        import numpy as np

        top = max(float(np.abs(np.asarray(v, dtype=np.float64)).max(initial=0.0))
                  for v in s.feeds(q.slice).values()) + eps
        eps = math.nextafter(eps + 4 * math.ulp(top), math.inf)
    tau = float(q.threshold) if q.op == "<=" else math.nextafter(float(q.threshold), -math.inf)
    s.say(f"interval bound misses {q.op} {q.threshold:g} on {q.slice!r}; trying SMT (z3)")
    try:
        d = smt_decide_block(s.graph, s.train, s.inf, s.feeds(q.slice), tau, eps=eps,
                             timeout_s=s.options.smt_timeout)
    except KcverifyError as e:
        s.say(f"SMT: skipped ({e})")
        return None
    s.say(f"SMT: {d.verdict}{' (' + d.note + ')' if d.note else ''}")
    if d.verdict != "proved" or d.node is None:
        return None
    try:
        leaf = b.apply("smt-block", [], **{**d.node["params"], "slice": q.slice})
        agg = b.apply("aggregate", [leaf], stat="max")
        return b.apply("threshold", [agg], threshold=float(q.threshold), op=q.op)
    except RuleError:
        return None


def _try_cases(s: Session, b: Any, q: NumericalQuery, stat: str
               ) -> tuple[dict[str, Any] | None, float] | None:
    """With ``options.cases``: the slice's per-input L-inf drift by cases over its unstable
    casts (kcverify.bounds.cases), as a case-split leaf the checker re-runs, then the quantity's
    linf-based derivations, aggregated and thresholded. (proof or None, the bound reached) or
    None where cases do not apply (regions, per-position quantities, no unstable cast)."""
    import base64

    from kcverify.certs.cases_rule import encode_inputs
    from kcverify.certs.encoding import fx, unfx
    from kcverify.certs.rules import RuleError
    from kcverify.dsl.quantities import get_quantity

    if s.options.cases <= 0 or q.per_position or s.options.domain not in ("interval", "best"):
        return None
    sl = s.contract.slices[q.slice]
    if sl.region is not None and sl.region.eps > 0:
        return None
    if not any(s.unstable_casts().get(q.slice, [])):
        return None
    from kcverify.bounds.cases import certify_cases
    from kcverify.certs.cases_rule import CaseSplit  # noqa: F401 - registers the rule

    feeds = s.feeds(q.slice)
    s.say(f"{q.slice!r}: the bound misses {q.op} {q.threshold:g}; proving by cases over its "
          f"unstable casts (<= {s.options.cases} per input, domain {s.options.domain})")
    # the L-inf drift itself, bounded for every input: split only while a case misses the
    # threshold, on the straddles its bad outputs depend on (cases.certify_cases)
    directed = (float(q.threshold) if q.quantity == "logit_linf" and q.op in ("<=", "<")
                and stat == "max" else None)
    res = certify_cases(s.bound_graph, s.bound_train, s.bound_inf, feeds,
                        max_leaves=s.options.cases, domain=s.options.domain,
                        device=s.options.device, threshold=directed,
                        progress=lambda k, n: s.say(f"cases: run {k}, {n} open or done"))
    s.say(f"cases: bounds {', '.join(f'{v:.4g}' for v in res.linf)} in {res.runs} runs, "
          f"{res.seconds:.0f} s")
    graph = s.bound_graph
    leaf = b.apply("case-split", [], **{
        "graph": base64.b64encode(graph.to_onnx().SerializeToString()).decode(),
        "graph_digest": graph.digest(),
        "kernels": {"train": s.bound_train.canonical(), "inf": s.bound_inf.canonical()},
        "method": s.options.domain, "tensor": s.output, "inputs": encode_inputs(feeds),
        "leaves": [[[d.to_json() for d in p] for p in paths] for paths in res.leaves],
        "claims": [[fx(float(v)) for v in per] for per in res.leaf_linf],
        # per-element trees (certify_cases(per_element=True)): the elements each leaf proves
        **({"masks": res.masks} if res.masks is not None else {}),
        "slice": q.slice})
    entry = get_quantity(q.quantity)
    best: tuple[float, dict[str, Any]] | None = None
    for rule, premises in derivations(q.quantity):
        try:
            if rule == "linf-from-state":
                node = leaf
            elif premises == "linf":
                params: dict[str, Any] = {}
                if entry.temperature:
                    params["temperature"] = float(q.temperature)
                node = b.apply(rule, [leaf], **params)
            else:
                continue
            agg = b.apply("aggregate", [node], stat=stat)
        except RuleError:
            continue
        v = unfx(agg["conclusion"]["bounds"][0]) + 0.0
        if best is None or (v < best[0] if entry.upper else v > best[0]):
            best = (v, agg)
    if best is None:
        return None
    try:
        return b.apply("threshold", [best[1]], threshold=float(q.threshold), op=q.op), best[0]
    except RuleError:
        return None, best[0]


def _region_slice(s: Session, name: str) -> bool:
    from kcverify.regions.plan import is_vnnlib_slice

    return is_vnnlib_slice(s.contract.slices.get(name))


def _certifiable(s: Session, b: Any, clause: Clause) -> _Decision:
    """Prove every query of the clause; else search conforming programs for a replayed
    violation (refuted); else fall back to evidence (the formal verdict stays unknown)."""
    queries = numerical_queries(clause) or []
    if not queries:
        if clause.metric is not None:
            return _empirical(s, clause, note="formal: no certified rule for this condition")
        r = ClauseResult(id=clause.id, family=clause.family, verdict=Verdict.UNKNOWN,
                         method="none", level=clause.level, action=clause.action,
                         threshold=clause.threshold,
                         note="no certified rule or metric for this condition")
        return _Decision(r, dict(verdict="unknown", method="none"))
    attempts = [_try_prove(s, b, clause, q) for q in queries]
    slices = list(dict.fromkeys(q.slice for q in queries))
    blocks = [row for name in slices if not _region_slice(s, name)  # (points only: no box)
              for row in s.block_drifts(name)] if slices else []
    bounds = [bd for _, bd, _ in attempts if bd is not None]
    bound = (max(bounds) if queries[0].upper else min(bounds)) if len(bounds) == len(queries) else None
    common = dict(id=clause.id, family=clause.family, level=clause.level, action=clause.action,
                  threshold=float(queries[0].threshold), direction=queries[0].op,
                  slice=",".join(slices), budget=clause.budget, blocks=blocks)
    if all(p is not None for p, _, _ in attempts):
        proofs = [p for p, _, _ in attempts]
        proof = proofs[0] if len(proofs) == 1 else b.apply("all", proofs)
        method = "smt-z3" if _uses(proof, "smt-block") else f"bound-{s.options.domain}" + (
            " (whole graph)" if s.options.domain != "linear" and _whole_blocks(proof) else "")
        r = ClauseResult(**common, verdict=Verdict.PROVED, method=method,
                         value=bound, bound=bound,
                         sample_size=sum(s.slice(n).n for n in slices))
        return _Decision(r, dict(verdict="proved", bound=bound, method=r.method, proof=proof,
                                 threshold=float(queries[0].threshold)))
    note = "; ".join(n for _, _, n in attempts if n)
    if clause.budget is not None and clause.metric is not None:
        # a soft clause allows violations up to its budget: a violating program does not refute
        # it; the exceedance rate decides, with confidence
        return _empirical(s, clause, note=f"formal: {note}", certified=bound)
    s.say(f"{clause.id}: {note}; searching conforming programs for a violation")
    found = s.empirical.check_numerical(clause, queries)
    if Verdict(found.verdict) is Verdict.REFUTED:
        r = ClauseResult(**common, verdict=Verdict.REFUTED, method=found.method, value=found.value,
                         bound=bound, sample_size=found.sample_size,
                         violations=found.violations, note=found.note,
                         evidence=found.evidence)
        return _Decision(r, dict(verdict="refuted", method=found.method, op=queries[0].op,
                                 threshold=float(queries[0].threshold),
                                 evidence={**found.evidence, "certified_bound": bound}))
    r = ClauseResult(**common, verdict=found.verdict, method=f"empirical-fallback ({found.method})",
                     value=found.value, bound=bound, sample_size=found.sample_size,
                     violations=found.violations, note=f"formal: {note}; {found.note}",
                     slices=found.slices)
    evidence = {"programs_searched": found.method, "n": found.sample_size,
                "formal_verdict": "unknown", "certified_bound": bound}
    if found.value is not None and Verdict(found.verdict) is Verdict.PASSED:
        evidence["observed"] = found.value
    return _Decision(r, dict(verdict=CERT_VERDICT[Verdict(found.verdict)], method=r.method,
                             op=queries[0].op, threshold=float(queries[0].threshold),
                             evidence=evidence))


def _empirical(s: Session, clause: Clause, note: str = "",
               certified: float | None = None) -> _Decision:
    """A clause with a metric, decided on its slices by kcverify.empirical (with confidence).
    ``certified``: the certified bound on its quantity, when the planner tried to prove it."""
    if clause.metric is None:
        r = ClauseResult(id=clause.id, family=clause.family, verdict=Verdict.UNKNOWN, method="none",
                         level=clause.level, action=clause.action,
                         note="an explicit empirical condition needs a metric (short form)")
        return _Decision(r, dict(verdict="unknown", method="none"))
    for name in clause.slices:
        s.slice(name)
    s.say(f"{clause.id}: measuring {clause.metric} on {', '.join(clause.slices) or 'all'}")
    r = s.empirical.decide(clause)
    # kcverify.empirical reports the violation rate's upper confidence bound as ``bound``; the
    # report keeps ``bound`` for certified bounds on the quantity (report.model.ClauseResult)
    r.rate_upper, r.bound = r.bound, certified
    if note:
        r.note = f"{note}; {r.note}" if r.note else note
    evidence = {"value": r.value, "n": r.sample_size, "violations": r.violations,
                "confidence": r.confidence, "budget": r.budget, "rate_upper": r.rate_upper,
                "slices": {sr.slice: {"n": sr.n, "violations": sr.violations, "rate": sr.rate,
                                      "upper": sr.upper} for sr in r.slices}}
    if clause.budget is None and r.value is not None and Verdict(r.verdict) is Verdict.PASSED:
        evidence["observed"] = r.value
    return _Decision(r, dict(verdict=CERT_VERDICT[Verdict(r.verdict)], threshold=clause.threshold,
                             op=r.direction, method=r.method, evidence=evidence))


def _static(s: Session, clause: Clause) -> _Decision:
    from kcverify.planner.static import evaluate_static, model_facts

    holds = bool(evaluate_static(clause.expr, model_facts(s.model_path)))
    v = Verdict.PASSED if holds else Verdict.FAILED
    r = ClauseResult(id=clause.id, family=clause.family, verdict=v, method="static",
                     level=clause.level, action=clause.action, note=clause.text)
    return _Decision(r, dict(verdict=CERT_VERDICT[v], method="static",
                             evidence={"condition": clause.text, "holds": holds}))


# --- the whole contract ------------------------------------------------------------------------
def prove(contract_path: str | os.PathLike[str], model_path: str | os.PathLike[str],
          options: ProveOptions | None = None) -> ProveResult:
    """Decide every clause; build (and by default attach) the certificate."""
    from kcverify.certs import CertificateBuilder, write_certificate
    from kcverify.empirical.escalation import escalate
    from kcverify.models.ir import file_sha256

    options = options or ProveOptions()
    contract = load_contract(contract_path)
    model = Path(model_path)
    if not model.exists():
        raise InputFileError(f"{model}: no such ONNX file")
    if contract.model.sha256 not in ("auto", None):
        have = file_sha256(model)
        if have != contract.model.sha256:
            raise KcverifyError(f"{model}: sha256 {have} does not match the contract's "
                                f"model.sha256 {contract.model.sha256}")
    if options.write_certificate:
        _refuse_overwrite(contract, model, options)
    s = Session(contract, model, options)
    if options.executor is not None:
        s.prefetch_drifts(options.executor)
    digest_kind = "onnx-canonical-v1" if options.embed else "file-sha256"
    b = CertificateBuilder(model, contract.path, contract.kernels,
                           {"name": contract.name, "version": contract.version},
                           slices=contract.slices, model_digest=digest_kind)
    results: list[ClauseResult] = []
    for k, clause in enumerate(contract.clauses):
        s.say(f"[{k + 1}/{len(contract.clauses)}] {clause.id} ({clause.klass}): {clause.text}")
        if clause.klass == "certifiable":
            d = _certifiable(s, b, clause)
        elif clause.klass == "static":
            d = _static(s, clause)
        else:
            d = _empirical(s, clause)
        d.result.klass = clause.klass
        results.append(d.result)
        cert = dict(d.cert)
        cert.setdefault("decided_by", d.result.decided_by)
        verdict = cert.pop("verdict")
        b.add_clause(clause.id, clause.family, verdict, klass=clause.klass, hard=clause.hard,
                     **{"threshold": clause.threshold, **cert})
    blocks = next((r.blocks for r in results if r.blocks), [])
    report = Report(contract=contract.name, model=str(model), clauses=results, blocks=blocks,
                    escalation=dict(contract.escalation),
                    meta={"contract_path": str(contract.path), "domain": options.domain,
                          "device": options.device, "realizations": options.realizations,
                          **({"memory_notes": list(s.notes)} if s.notes else {}),
                          **({"unstable_casts": s.unstable_casts()} if s.unstable_casts() else {})})
    escalate(report, contract.escalation)
    _prune_blocks(b)
    statement = b.build()
    cert_path: Path | None = None
    if options.write_certificate:
        if options.embed:
            from kcverify.certs.attach import embed

            embed(model, statement)
            cert_path = model
        else:
            cert_path = _cert_path(model, options)
            write_certificate(cert_path, statement)
    return ProveResult(report, statement, cert_path)


def _cert_path(model: Path, options: ProveOptions) -> Path:
    from kcverify.certs.attach import sidecar_path

    return Path(options.cert_path) if options.cert_path is not None else sidecar_path(model)


def _refuse_overwrite(contract: Contract, model: Path, options: ProveOptions) -> None:
    """Before any work: refuse to replace a certificate of *another* contract (the sidecar, the
    --cert file, or the one embedded in the model) unless ``options.force``. A certificate of
    the same contract (a re-run) is replaced; so is anything with --force."""
    import json
    import re

    if options.force:
        return
    if options.embed:
        from kcverify.certs.attach import embedded_certificate

        try:
            stmt = embedded_certificate(model)
        except KcverifyError as e:
            raise InputFileError(f"{model}: cannot read the certificate embedded in it ({e}); "
                                 "pass --force to replace it") from None
        where = f"{model} (embedded)"
    else:
        path = _cert_path(model, options)
        if not path.exists():
            return
        where = str(path)
        try:
            stmt = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise InputFileError(f"{path}: exists and is not a kcverify certificate ({e}); "
                                 "pass --force to overwrite it or --cert PATH to write elsewhere"
                                 ) from None
    if stmt is None:
        return
    try:
        other = stmt["predicate"]["contract"]["name"]
    except (KeyError, TypeError):
        raise InputFileError(f"{where}: exists and is not a kcverify certificate; pass --force to "
                             "overwrite it or --cert PATH to write elsewhere") from None
    if other == contract.name:
        return
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", contract.name) or "contract"
    keep = model.with_name(f"{model.name}.{safe}.kcert.json")
    raise InputFileError(f"{where} holds the certificate of contract {other!r}; proving "
                         f"{contract.name!r} would replace it. Pass --cert {keep} to keep both, "
                         "or --force to replace it")


def _uses(node: Any, rule: str) -> bool:
    """Whether a proof tree applies ``rule`` anywhere."""
    if not isinstance(node, dict):
        return False
    return node.get("rule") == rule or any(_uses(p, rule) for p in node.get("premises", []))


def _whole_blocks(node: Any) -> bool:
    """Whether a proof tree rests on a block of the whole-graph cut (refs tagged /whole/)."""
    if not isinstance(node, dict):
        return False
    if node.get("rule") == "block" and "/whole/" in str(node.get("params", {}).get("ref")):
        return True
    return any(_whole_blocks(p) for p in node.get("premises", []))


def _prune_blocks(b: Any) -> None:
    """Drop block certificates no proof uses (slices bounded for a clause that was then decided
    on evidence): the certificate carries only what its proofs rest on."""
    used: set[str] = set()
    stack = [c.get("proof") for c in b.clauses]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        if node.get("rule") == "block":
            used.add(node.get("params", {}).get("ref"))
        stack.extend(node.get("premises", []))
    for ref in [r for r in b.blocks if r not in used]:
        del b.blocks[ref]
        b.ctx.blocks.pop(ref, None)


def stderr_progress(msg: str) -> None:
    print(f"[kcverify] {msg}", file=sys.stderr, flush=True)
