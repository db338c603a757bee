"""Per-block drift, certified and observed, for the report's "certified vs observed" plot.

* certified: for each block record of a bound run (kcverify.bounds DriftResult.blocks), the
  largest |drift| its out_state allows: max over outputs of max(|drift_lo|, |drift_hi|).
* observed: both kernels run concretely (one conforming program each) keeping every tensor; for
  each block, the largest |z_inf - z_train| over its float outputs.

A sound certificate has observed <= certified for every block: the plot shows the gap
(tightness) per block, and ``check_observed_within`` is the soundness check tests use.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from kcverify.report.model import BlockDrift


def certified_block_drift(records: Iterable[Any]) -> dict[str, float]:
    """Block name -> the largest |drift| the block's out_state allows (over all its outputs)."""
    out: dict[str, float] = {}
    for rec in records:
        worst = 0.0
        for box in rec.out_state.values():
            lo, hi = np.asarray(box.drift_lo, np.float64), np.asarray(box.drift_hi, np.float64)
            if lo.size:
                worst = max(worst, float(np.max(np.maximum(np.abs(lo), np.abs(hi)))))
        out[rec.name] = worst
    return out


def observed_block_drift(graph: Any, blocks: Sequence[Any], train_spec: Any, inf_spec: Any,
                         feeds: Mapping[str, Any], device: str = "cpu", **choices: Any) -> dict[str, float]:
    """Block name -> max |z_inf - z_train| over the block's float outputs, one program each."""
    import torch

    from kcverify.kernels.realize import Realization
    from kcverify.models.executor import Executor

    def run(spec: Any, extra: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        ex = Executor(graph, device=device, dtype=torch.float64, arithmetic=Realization(spec, **extra))
        return ex.run(dict(feeds), keep=True)

    zt, zi = run(train_spec, {}), run(inf_spec, choices)
    out: dict[str, float] = {}
    for b in blocks:
        worst = 0.0
        for name in b.outputs:
            a, c = zt.get(name), zi.get(name)
            if a is None or c is None or not a.is_floating_point():
                continue
            worst = max(worst, float((c.double() - a.double()).abs().max()))
        out[b.name] = worst
    return out


def block_drifts(certified: Mapping[str, float], observed: Mapping[str, float],
                 kinds: Mapping[str, str] | None = None) -> list[BlockDrift]:
    """BlockDrift rows in the certified mapping's order (then any observed-only block)."""
    names = list(certified) + [n for n in observed if n not in certified]
    return [BlockDrift(n, certified.get(n), observed.get(n), (kinds or {}).get(n, ""))
            for n in names]


def check_observed_within(rows: Iterable[BlockDrift], slack: float = 0.0) -> list[str]:
    """The blocks whose observed drift exceeds the certified bound (a soundness violation)."""
    return [r.block for r in rows
            if r.certified is not None and r.observed is not None
            and r.observed > r.certified * (1 + slack)]
