"""Region clauses in ``kcverify prove``: a slice ``{vnnlib: FILE}`` is the input box of a VNN-LIB
property, and a drift clause over it is proved by input splitting (kcverify.regions.split) with
a ``split-cover`` certificate (kcverify.certs.split_rule) that records the partition and each
part's claim, re-checked part by part.

``prove_region_query(session, builder, query)`` returns what the planner's ``_try_prove`` does:
(proof, bound, note). When the budget (``ProveOptions.region_timeout``, seconds) ends first, the
clause is not proved: the note gives the fraction of the box volume proved and the best bound.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kcverify.regions.chain import (
    ChainBounds,
    NotAChain,
    alpha_of,
    chain_method,
    extract_chain,
    one_thread,
)
from kcverify.regions.property import DriftObjective, EngineObjective
from kcverify.regions.split import branch_and_bound, cut_options
from kcverify.regions.verify import is_vnnlib_path

DEFAULT_TIMEOUT = 60.0
BATCH = 256
# slope-optimisation steps of the chain domain's intermediate value bounds (alpha-CROWN):
# measured on ACAS Xu (docs/regions.md): with 2 steps a proof needed 0.6-0.85x the parts at
# 1.3-1.6x the CPU per part; since the descent runs in float32 (chain.SLOPE_DTYPE) 4 steps cost
# little more than 2, and on 15 s of CPU they proved 1_3 and left 4_5 95% proved (73% with 2)
ALPHA_ITERS = 4
# what ``region_timeout`` is measured on: wall-clock seconds; bench/acasxu.py --cpu sets
# time.process_time (CPU seconds of this process: the steadier figure on a shared machine)
CLOCK: Callable[[], float] = time.perf_counter


def is_vnnlib_slice(sl: Any) -> bool:
    """Whether a contract slice is a VNN-LIB property's input box."""
    return bool(getattr(sl, "inputs", None)) and is_vnnlib_path(str(sl.inputs))


def region_of(contract: Any, name: str) -> Any:
    """The VNN-LIB property of slice ``name`` (its path relative to the contract)."""
    from kcverify.dsl.vnnlib import load_vnnlib

    p = Path(contract.slices[name].inputs)
    return load_vnnlib(p if p.is_absolute() else Path(contract.path).parent / p)


def _method(graph: Any, train: Any, inf: Any, device: str) -> tuple[str, ChainBounds | None]:
    try:
        return chain_method(ALPHA_ITERS), ChainBounds(extract_chain(graph), train, inf,
                                                      device=device, alpha_iters=ALPHA_ITERS)
    except NotAChain:
        return "engine:interval", None


def tree_bounds(graph: Any, train: Any, inf: Any, method: str, name: str, shape: tuple,
                lo: np.ndarray, hi: np.ndarray, tree: list[int], batch: int = 512,
                device: str = "cpu") -> np.ndarray:
    """Each leaf's L-inf drift bound (preorder) as the split computed it (what a split-cover
    certificate claims, re-computed): the chain domain replays the tree, every node from its box
    and its parent's certified intermediate boxes; the engine's domains bound each leaf alone."""
    from kcverify.regions.split import leaves_of, replay

    if method.startswith("chain"):
        cb = ChainBounds(extract_chain(graph), train, inf, device=device,
                         alpha_iters=alpha_of(method))
        obj = DriftObjective(cb, 0.0, hi - lo, margin=0.0)
        with torch.no_grad():
            return replay(lo, hi, tree, obj, batch)
    p_lo, p_hi = leaves_of(lo, hi, tree)
    out = np.empty(len(p_lo))
    domain = method.split(":", 1)[1]
    eng = EngineObjective(graph, train, inf, name, shape, hi - lo, domain=domain,
                          device=device)
    for k in range(0, len(p_lo), batch):
        box = eng.boxes(p_lo[k:k + batch], p_hi[k:k + batch])
        n = min(batch, len(p_lo) - k)
        mag = np.maximum(np.abs(box.drift_lo), np.abs(box.drift_hi)).reshape(n, -1).max(axis=1)
        out[k:k + batch] = np.where(np.isnan(mag), np.inf, mag)
    return out


def _drift_falsifier(graph: Any, cb: ChainBounds, s: Any, eps: float, strict: bool,
                     name: str, shape: tuple) -> Any:
    """Centres of open parts: the drift of the real-arithmetic networks (both kernels' weights)
    as a search; a candidate beyond 0.999 eps is confirmed with conforming programs."""
    from kcverify.regions.falsify import ChainNet, confirm_drift

    nt = ChainNet(cb.chain, cb.kernels[0].mats)
    ni = ChainNet(cb.chain, cb.kernels[1].mats)

    def falsify(lo: np.ndarray, hi: np.ndarray) -> Any:
        x = torch.as_tensor(0.5 * lo + 0.5 * hi)
        with torch.no_grad():
            d = (ni(x) - nt(x)).abs().amax(-1).numpy()
        for k in np.argsort(-d)[:2]:
            if d[k] < 0.999 * eps:
                break
            w = confirm_drift(graph, s.train, s.inf, (0.5 * lo[k] + 0.5 * hi[k]).astype(
                np.float32), eps, name, shape, s.output, strict)
            if w is not None:
                return w
        return None
    return falsify


def prove_region_query(s: Any, b: Any, q: Any) -> tuple[dict[str, Any] | None, float | None, str]:
    """Prove a drift query over a VNN-LIB slice by splitting (module doc)."""
    from kcverify.certs.rules import RuleError
    from kcverify.kernels.spec import KernelSpec

    if q.quantity != "logit_linf" or q.per_position or q.op not in ("<=", "<"):
        return None, None, ("region (VNN-LIB) slices certify upper bounds on the logits' L-inf "
                            f"drift only, not {q.quantity}")
    prop = region_of(s.contract, q.slice)
    lo, hi = (np.asarray(v, dtype=np.float64) for v in prop.box())
    g = s.graph
    inp = [v for v in g.inputs if (v.dtype or "float32").startswith("float")]
    if len(g.inputs) != 1 or len(inp) != 1:
        return None, None, "region slices need a model with one float input"
    shape = tuple(int(d) for d in (inp[0].shape or ())[1:])
    if int(np.prod(shape)) != len(lo):
        return None, None, (f"the VNN-LIB slice {q.slice!r} has {len(lo)} inputs, the model "
                            f"{int(np.prod(shape))}")
    device = s.options.device
    method, cb = _method(g, s.train, s.inf, device)
    eps = float(q.threshold)
    strict = q.op == "<"
    budget = float(getattr(s.options, "region_timeout", DEFAULT_TIMEOUT))
    if cb is not None:
        obj: Any = DriftObjective(cb, eps, hi - lo, strict,
                                  _drift_falsifier(g, cb, s, eps, strict, inp[0].name, shape))
    else:
        obj = EngineObjective(g, s.train, s.inf, inp[0].name, shape, hi - lo, eps=eps,
                              domain="interval", strict=strict, device=device)
    s.say(f"splitting the box of slice {q.slice!r} ({method}, budget {budget:g}s)")
    with one_thread():
        out = branch_and_bound(lo, hi, obj, budget_s=budget, batch=BATCH, progress=s.say,
                               clock=CLOCK, **cut_options(obj, cb is not None))
    s.say(f"split: {out.verdict}, {out.parts_bounded} parts in {out.seconds:.1f}s, "
          f"{out.proved_fraction:.2%} of the volume proved, bound {out.bound:.6g}")
    if out.verdict == "refuted":
        w = out.counterexample
        return None, None, (f"split: a conforming pair drifts by {w.extra.get('drift'):.6g} at "
                            f"x = {w.x.tolist()} ({w.program})")
    if out.verdict != "proved":
        return None, out.bound, (f"split: {out.proved_fraction:.2%} of the box volume proved in "
                                 f"{out.seconds:.0f}s ({out.parts_bounded} parts, "
                                 f"{out.stopped}); best bound {out.bound:.6g}")

    def canon(spec: KernelSpec) -> dict[str, Any]:
        return spec.canonical()
    params = {"graph": base64.b64encode(Path(s.model_path).read_bytes()).decode(),
              "graph_digest": g.digest(), "kernels": {"train": canon(s.train), "inf": canon(s.inf)},
              "method": method, "input": inp[0].name, "shape": list(shape), "tensor": s.output,
              "region": {"lo": [float(v).hex() for v in lo], "hi": [float(v).hex() for v in hi]},
              "tree": out.tree, "claims": [float(lf.value).hex() for lf in out.leaves],
              "slice": q.slice}
    try:
        with one_thread():
            node = b.apply("split-cover", [], **params)
        agg = b.apply("aggregate", [node], stat="max")
        proof = b.apply("threshold", [agg], threshold=eps, op=q.op)
    except RuleError as e:
        return None, out.bound, f"split: proved, but its certificate does not re-check ({e})"
    from kcverify.certs.encoding import unfx

    return proof, unfx(proof["conclusion"]["bound"][0]), ""


import kcverify.certs.split_rule  # noqa: E402,F401 - registers the split-cover rule
