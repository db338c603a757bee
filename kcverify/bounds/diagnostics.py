"""Diagnostics a bound run collects beside its bounds: how close a deployment sits to its formats.

``unstable casts``: a cast of an activation to an fp8 (or other) format is *stable* when the
enclosure of its input lies strictly between two rounding midpoints, so every conforming program
casts it to the same value; it is *unstable* when the enclosure straddles a midpoint (programs
that conform may round it either way). Their number per input is the honest measure of how close
the inputs sit to an fp8 rounding boundary: each unstable cast is a discrete choice the
certificate must cover.

A run opens a collector (``collecting()``); rules report per-sample counts with ``note``; the
engine reads them back. Outside a collector ``note`` does nothing, so rules stay usable alone.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import numpy as np

_CURRENT: contextvars.ContextVar[dict[str, np.ndarray] | None] = contextvars.ContextVar(
    "kcverify_bound_diagnostics", default=None)


@contextlib.contextmanager
def collecting(batch: int) -> Iterator[dict[str, np.ndarray]]:
    """Collect per-sample counters for a run over ``batch`` inputs."""
    store: dict[str, np.ndarray] = {"batch": np.zeros(batch, dtype=np.int64)}
    token = _CURRENT.set(store)
    try:
        yield store
    finally:
        _CURRENT.reset(token)


def note(name: str, per_sample: np.ndarray | int) -> None:
    """Add counts: an array (batch,) per sample, or one total that every sample may hold (an
    operand whose sample axis is unknown: the count is an upper bound for each input)."""
    store = _CURRENT.get()
    if store is None:
        return
    batch = store["batch"].shape[0]
    counts = np.broadcast_to(np.asarray(per_sample, dtype=np.int64), (batch,))
    store[name] = store.get(name, np.zeros(batch, dtype=np.int64)) + counts
