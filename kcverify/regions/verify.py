"""Decide a VNN-LIB property for every program conforming to one kernel spec.

    res = verify_vnnlib("net.onnx", load_vnnlib("prop.vnnlib"), spec=None, timeout=116)
    res.answer    # "unsat" (the property holds) | "sat" (witness) | "unknown" | "timeout"
    res.text()    # what VNN-COMP's run_instance expects in the result file

Semantics. ``unsat``: no input in the property's boxes has an output in its unsafe set, for
*every* program conforming to the kernel spec (any summation order, the spec's formats and
casts); without a spec the kernel is fp32 compute and accumulation in any order, so the answer
is already sound for real floating-point programs, not only for the real-valued network. ``sat``:
a float32 input inside the box and the outputs of a named conforming program (round to nearest or
directed, sequential / pairwise / reverse / chunked / random order) that satisfy the unsafe
condition exactly; onnxruntime's outputs at the same input are reported too.

Method. Per case of the property (an input box with its unsafe DNF): a projected-gradient search
first, then input splitting (kcverify.regions.split) with the chain domain (an affine-ReLU model)
or the bound engine's intervals (any other model), the centres of open parts searched each round.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kcverify.dsl.vnnlib import Case, VnnProperty
from kcverify.errors import KcverifyError
from kcverify.regions.chain import ChainBounds, NotAChain, chain_method, extract_chain, one_thread
from kcverify.regions.falsify import (
    ChainNet,
    Witness,
    confirm,
    descend,
    inside_f32,
    pgd_candidates,
)
from kcverify.regions.property import AtomTable, EngineObjective, PropertyObjective
from kcverify.regions.split import branch_and_bound, cut_options

ANSWERS = ("unsat", "sat", "unknown", "timeout")
# the chain domain's slope-optimisation steps (ChainBounds): none here. Measured on the 186 ACAS
# Xu instances at 10 s each, 2 steps decided 147 against 154 (docs/regions.md): property parts
# are many and small, where CROWN's slopes are nearly as tight and cost less
ALPHA_ITERS = 0


@dataclass
class VnnResult:
    answer: str
    witness: Witness | None = None
    seconds: float = 0.0
    parts: int = 0
    method: str = ""
    proved_fraction: float = 0.0
    notes: list[str] = field(default_factory=list)

    def text(self) -> str:
        """The result as VNN-COMP writes it: the answer, then the witness for sat."""
        if self.answer == "sat" and self.witness is not None:
            return f"sat\n{self.witness.vnncomp()}\n"
        return f"{self.answer}\n"


def default_spec() -> Any:
    """fp32 compute and accumulation in any order: every fp32 program with exact products."""
    from kcverify.kernels.spec import parse_kernel_spec

    return parse_kernel_spec("fp32", {"compute": "fp32", "accumulate": "fp32"})


def _shapes(graph: Any, prop: VnnProperty) -> tuple[str, tuple[int, ...], str]:
    floats = [v for v in graph.inputs if (v.dtype or "float32").startswith("float")]
    if len(graph.inputs) != 1 or len(floats) != 1:
        raise KcverifyError(f"VNN-LIB needs a model with one float input; this one has "
                            f"{', '.join(v.name for v in graph.inputs) or 'none'}")
    if len(graph.outputs) != 1:
        raise KcverifyError("VNN-LIB needs a model with one output; this one has "
                            f"{', '.join(v.name for v in graph.outputs)}")
    inp = graph.inputs[0]
    shape = tuple(inp.shape or ())
    if not shape or not all(isinstance(d, int) and d > 0 for d in shape[1:]):
        raise KcverifyError(f"input {inp.name!r} needs a static shape (batch, ...), got {shape}")
    feat = tuple(int(d) for d in shape[1:])
    n = int(np.prod(feat)) if feat else 1
    if n != prop.n_inputs:
        raise KcverifyError(f"{prop.path}: the property declares {prop.n_inputs} inputs X_i, "
                            f"the model's input {inp.name!r} has {n} elements ({shape})")
    out = graph.outputs[0]
    oshape = tuple(out.shape or ())
    if oshape and all(isinstance(d, int) and d > 0 for d in oshape[1:]):
        m = int(np.prod(oshape[1:])) if len(oshape) > 1 else 1
        if m != prop.n_outputs:
            raise KcverifyError(f"{prop.path}: the property declares {prop.n_outputs} outputs "
                                f"Y_i, the model's output {out.name!r} has {m} elements")
    return inp.name, feat, out.name


def _ort(model_path: str | None) -> Any:
    if model_path is None:
        return None
    try:
        import onnxruntime as ort
    except ImportError:  # pragma: no cover - a test dependency
        return None
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(model_path, opts, providers=["CPUExecutionProvider"])


def verify_vnnlib(model: str | os.PathLike[str] | Any, prop: VnnProperty, spec: Any = None,
                  timeout: float = 116.0, device: str = "cpu", batch: int = 256,
                  progress: Callable[[str], None] | None = None,
                  clock: Callable[[], float] = time.perf_counter) -> VnnResult:
    """Decide ``prop`` on ``model`` (a path or a Graph) for every program conforming to
    ``spec`` (default: fp32 any order) within ``timeout`` seconds (module doc) of ``clock``
    (wall-clock, as VNN-COMP's run_instance; ``time.process_time``: CPU seconds)."""
    with one_thread():
        return _verify(model, prop, spec, timeout, device, batch, progress, clock)


def _verify(model: str | os.PathLike[str] | Any, prop: VnnProperty, spec: Any, timeout: float,
            device: str, batch: int, progress: Callable[[str], None] | None,
            clock: Callable[[], float] = time.perf_counter) -> VnnResult:
    from kcverify.models.ir import Graph, load_onnx

    t0 = clock()
    path = None if isinstance(model, Graph) else os.fspath(model)
    graph = model if isinstance(model, Graph) else load_onnx(path)
    spec = spec or default_spec()
    name, feat, out = _shapes(graph, prop)
    session = _ort(path)
    cb = None
    notes: list[str] = []
    try:
        cb = ChainBounds(extract_chain(graph), spec, None, device=device, alpha_iters=ALPHA_ITERS)
        method = chain_method(ALPHA_ITERS)
    except NotAChain as e:
        method = "engine:interval"
        notes.append(f"not the chain domain ({e}): the bound engine's intervals on each part")
    net = ChainNet(cb.chain, cb.kernels[0].mats) if cb is not None else None

    def left() -> float:
        return timeout - (clock() - t0)

    def found(w: Witness) -> VnnResult:
        return VnnResult("sat", w, clock() - t0, parts, method, 0.0, notes)

    parts = 0
    fraction = []
    for ci, case in enumerate(prop.cases):
        run = _CaseRun(graph, spec, case, prop.n_outputs, name, feat, out, session, net)
        w = run.search()
        if w is not None:
            return found(w)
        if left() <= 0:
            notes.append(f"case {ci}: the time ran out in the counterexample search, before any "
                         "splitting; 0.00% of the box volume proved in 0 parts; best bound inf")
            return VnnResult("timeout", None, clock() - t0, parts, method,
                             float(np.mean(fraction)) if fraction else 0.0, notes)
        lo, hi = np.asarray(case.lo), np.asarray(case.hi)
        if cb is not None:
            obj: Any = PropertyObjective(cb, case, hi - lo, 0, run.falsify)
        else:
            obj = EngineObjective(graph, spec, spec, name, feat, hi - lo, case=case,
                                  domain="interval", device=device)
        res = branch_and_bound(lo, hi, obj, budget_s=max(left(), 0.0), batch=batch,
                               progress=progress, clock=clock,
                               **cut_options(obj, cb is not None))
        parts += res.parts_bounded
        fraction.append(res.proved_fraction)
        if res.verdict == "refuted":
            return found(res.counterexample)
        if res.verdict != "proved":
            ans = "timeout" if left() <= 0 else "unknown"
            notes.append(f"case {ci}: {res.stopped}; {res.proved_fraction:.2%} of the box volume "
                         f"proved in {res.parts_bounded} parts; best bound {res.bound:.6g} (the "
                         "largest certified margin d - min c.Y of an unsafe disjunct on an open "
                         "part: the case is proved where it is below 0)")
            return VnnResult(ans, None, clock() - t0, parts, method,
                             float(np.mean(fraction)), notes)
    return VnnResult("unsat", None, clock() - t0, parts, method, 1.0, notes)


class _CaseRun:
    """The search for a counterexample in one case: PGD before splitting, open parts' centres
    during it; every candidate confirmed under conforming programs."""

    def __init__(self, graph: Any, spec: Any, case: Case, n_out: int, name: str,
                 feat: tuple[int, ...], out: str, session: Any, net: ChainNet | None) -> None:
        self.graph, self.spec, self.case = graph, spec, case
        self.name, self.feat, self.out, self.session, self.net = name, feat, out, session, net
        self.table = AtomTable(case, n_out)
        self.groups = [np.flatnonzero(self.table.group == k)
                       for k in range(self.table.n_disjuncts)]
        self.d = np.array([float(a.rhs) for a in self.table.atoms])

    def attempt(self, points: np.ndarray, limit: int = 4) -> Witness | None:
        tried = 0
        for p in points:
            x = inside_f32(p, self.case)
            if x is None:
                continue
            w = confirm(self.graph, self.spec, self.case, x, self.name, self.feat, self.out,
                        self.session)
            tried += 1
            if w is not None or tried >= limit:
                return w
        return None

    def violation(self, pts: np.ndarray) -> np.ndarray:
        from kcverify.regions.falsify import _violation

        assert self.net is not None
        with torch.no_grad():
            y = self.net(torch.as_tensor(np.asarray(pts, dtype=np.float64)))
            return _violation(y, torch.as_tensor(self.table.C), torch.as_tensor(self.d),
                              self.groups).numpy()

    def search(self) -> Witness | None:
        if self.net is not None:
            cands = pgd_candidates(self.net, self.case, self.table.C, self.d, self.groups)
            v = self.violation(cands)
            return self.attempt(cands[v <= _tol(v)][:4])
        if self.session is not None:
            return _sample_ort(self.session, self.case, self.name, self.feat, self.attempt)
        return None

    def falsify(self, olo: np.ndarray, ohi: np.ndarray) -> Witness | None:
        if self.net is None:
            return None
        mid = 0.5 * olo + 0.5 * ohi
        v = self.violation(mid)
        order = np.argsort(v)[:32]  # descend in the open parts whose centres look worst
        pts = descend(self.net, mid[order], olo[order], ohi[order],
                      torch.as_tensor(self.table.C), torch.as_tensor(self.d), self.groups, 30)
        v = self.violation(pts)
        return self.attempt(pts[v <= _tol(v)][:4], limit=2)


def _tol(v: np.ndarray) -> float:
    """Candidates worth confirming: violating, or within a hair of it on the search network."""
    return 1e-6 * (1 + float(np.max(np.abs(v[np.isfinite(v)]), initial=0.0)))


def _sample_ort(session: Any, case: Case, name: str, feat: tuple[int, ...],
                attempt: Callable[..., Any]) -> Witness | None:
    """Random points of the box through onnxruntime (models outside the chain domain)."""
    rng = np.random.default_rng(0)
    lo, hi = np.asarray(case.lo), np.asarray(case.hi)
    pts = np.concatenate([[0.5 * (lo + hi), lo, hi], rng.uniform(lo, hi, (253, len(lo)))])
    bad = []
    for p in pts:
        y = session.run(None, {name: p.astype(np.float32).reshape(1, *feat)})[0].reshape(-1)
        if case.unsafe_at(y.astype(np.float64).tolist()) is not None:
            bad.append(p)
    return attempt(np.array(bad)) if bad else None


def is_vnnlib_path(path: str) -> bool:
    """Whether a slice's file is a VNN-LIB property (``.vnnlib`` or ``.vnnlib.gz``)."""
    p = str(path).lower()
    return p.endswith(".vnnlib") or p.endswith(".vnnlib.gz")


__all__ = ["ANSWERS", "VnnResult", "default_spec", "is_vnnlib_path", "verify_vnnlib"]

