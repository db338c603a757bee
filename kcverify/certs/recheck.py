"""The bound engine's adapter for the checker: re-run a block's bound method on its stored
in_state and require the recomputed out_state ⊆ the stored one.

Imports torch, the executor and kcverify.bounds lazily: only re-checking a block needs them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from kcverify.certs.records import BOX_FIELDS, BlockData, StoredBox
from kcverify.errors import InternalError, KcverifyError

RecheckBlock = Callable[[BlockData], list[str]]


def to_diffbox(box: StoredBox, diffbox_cls: Any) -> Any:
    """A StoredBox as the bound engine's DiffBox (``from_numpy`` if it has one, else keywords)."""
    arrays = {f: getattr(box, f) for f in BOX_FIELDS}
    if hasattr(diffbox_cls, "from_numpy"):
        return diffbox_cls.from_numpy(**arrays)
    try:
        return diffbox_cls(**arrays)
    except TypeError:
        import torch

        return diffbox_cls(**{f: torch.from_numpy(np.ascontiguousarray(a)) for f, a in arrays.items()})


def excess(stored: StoredBox, got: Any) -> float:
    """How far ``got`` sticks out of ``stored`` (0 when contained; inf on a shape mismatch)."""
    worst = 0.0
    for f in BOX_FIELDS:
        a = getattr(stored, f)
        b = getattr(got, f)
        b = b.detach().cpu().double().numpy() if hasattr(b, "detach") else np.asarray(b, np.float64)
        if a.shape != b.shape:
            return float("inf")
        d = (a - b) if f.endswith("_lo") else (b - a)
        worst = max(worst, float(np.max(d, initial=0.0)))
    return worst


def feasible(box: StoredBox) -> bool:
    """Whether every element of a stored box holds some (train, inf) pair whose difference lies
    in its drift interval: drift_lo <= inf_hi - train_lo and drift_hi >= inf_lo - train_hi
    (differences rounded outward, so a box the prover made, which holds the true values, always
    passes). A box that fails describes no execution at all; sound rules may then meet
    enclosures into nothing, so the checker refuses it before re-running from it."""
    with np.errstate(invalid="ignore", over="ignore"):
        hi = np.nextafter(box.inf_hi - box.train_lo, np.inf)
        lo = np.nextafter(box.inf_lo - box.train_hi, -np.inf)
        bad = (box.drift_lo > hi) | (box.drift_hi < lo) | (box.train_lo > box.train_hi) \
            | (box.inf_lo > box.inf_hi) | (box.drift_lo > box.drift_hi)
    return not bool(np.any(bad))  # (inf - inf is NaN: no evidence of emptiness there)


def recheck_with(bound_block: Callable[..., Mapping[str, Any]], blocks_by_digest: Mapping[str, Any],
                 train_spec: Any, inf_spec: Any, diffbox_cls: Any) -> RecheckBlock:
    """A recheck hook from explicit parts: ``bound_block(block, train, inf, in_state, domain)``."""

    def recheck(record: BlockData) -> list[str]:
        block = blocks_by_digest.get(record.digest)
        if block is None:
            return [f"digest {record.digest[:12]}… is not a block of this model"]
        empty = [t for t, b in record.in_state.items() if not feasible(b)]
        if empty:  # no (train, inf) pair of the box has a drift in it: nothing to re-run from
            return [f"in_state of {t!r} is empty: its drift interval misses inf - train at some "
                    f"element" for t in empty]
        in_state = {t: to_diffbox(b, diffbox_cls) for t, b in record.in_state.items()}
        domain = record.extra.get("domain", record.method)
        try:
            out = bound_block(block, train_spec, inf_spec, in_state, domain)
        except KcverifyError as e:
            return [f"re-running {domain!r} failed: {e}"]
        problems = []
        for t, stored in record.out_state.items():
            if t not in out:
                problems.append(f"re-running {domain!r} gives no bound for {t!r}")
                continue
            if not stored.contains(out[t]):
                problems.append(f"re-running {domain!r}: the recomputed out_state of {t!r} is not "
                                f"inside the stored one (sticks out by {excess(stored, out[t])!r})")
        return problems

    return recheck


def model_blocks(graph: Any) -> dict[str, Any]:
    """Every block a prover may have cut from ``graph``, by digest, exactly as it cut it: the
    segmenter's blocks (interval, best, zonotope: kcverify.models.blocks.segment, with their
    inputs' sample axes) and the whole graph as one block (the linear domain:
    kcverify.bounds.engine.whole_graph). A digest names one subgraph, so the record's digest
    says which cut was bounded; its ``domain`` (or method) says how."""
    from kcverify.bounds.engine import whole_graph
    from kcverify.models.blocks import segment

    out = {b.digest: b for b in whole_graph(graph)}
    out.update({b.digest: b for b in segment(graph)})
    return out


def default_recheck(model_path: str | os.PathLike[str], kernel_specs: Mapping[str, Any],
                    base_dir: str | os.PathLike[str] | None = None
                    ) -> tuple[RecheckBlock | None, str | None]:
    """The real bound engine's hook for this model, or (None, why not). The engine ships with
    kcverify: failing to import it is an internal error, never a skipped check. An inference
    kernel given as a QDQ graph (``onnx:``, relative to ``base_dir``) re-runs the joint graph's
    blocks (kcverify.bounds.qdq_graph)."""
    try:
        from kcverify.bounds import DiffBox, bound_block
        from kcverify.bounds.qdq_graph import bound_problem
        from kcverify.models.ir import load_onnx
    except ImportError as e:
        raise InternalError(f"the bound engine cannot be imported: {e}") from e
    if "train" not in kernel_specs or "inf" not in kernel_specs:
        return None, "the contract does not name kernels 'train' and 'inf'"
    graph, train, inf = bound_problem(load_onnx(model_path), kernel_specs["train"],
                                      kernel_specs["inf"], base_dir)
    return recheck_with(bound_block, model_blocks(graph), train, inf, DiffBox), None


def default_store_input(model_path: str | os.PathLike[str], kernel_specs: Mapping[str, Any]
                        ) -> Callable[[str, StoredBox], Any] | None:
    """The bound engine's own storage of raw model inputs (kcverify.bounds.engine.input_box):
    float inputs in [lo, hi] are rounded into each kernel's compute format; integer inputs (token
    ids) enter unchanged. None when the engine is not available."""
    try:
        import torch

        from kcverify.bounds.engine import input_box
        from kcverify.models.ir import load_onnx
    except ImportError as e:
        raise InternalError(f"the bound engine cannot be imported: {e}") from e
    if "train" not in kernel_specs or "inf" not in kernel_specs:
        return None
    try:
        dtypes = {v.name: v.dtype for v in load_onnx(model_path).inputs}
    except KcverifyError:  # an unreadable model: the checker reports it as a problem
        return None
    train, inf = kernel_specs["train"], kernel_specs["inf"]

    def store(name: str, box: StoredBox) -> Any:
        dt = dtypes.get(name)
        if dt is not None and np.dtype(dt).kind in "iub":
            return box
        lo = torch.as_tensor(np.ascontiguousarray(box.train_lo), dtype=torch.float64)
        hi = torch.as_tensor(np.ascontiguousarray(box.train_hi), dtype=torch.float64)
        return input_box(train, inf, lo, hi).to_diffbox()

    return store
