"""Shared test configuration: the ``gpu`` marker skips without a CUDA device; under
pytest-xdist (``-n 2``, as ``./dev test`` runs) each worker uses one torch thread, and the
soundness suites' totals (tests/soundness and tests/soundness/adversarial print them at the end)
are gathered from the workers and printed once by the controller."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover - torch is a dependency
        has_cuda = False
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def root() -> Path:
    return ROOT


# ---- pytest-xdist: one torch thread per worker, the soundness totals gathered -----------------
_GATHERED: dict[str, Any] = {}


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)  # -n workers share the cores; two threads each oversubscribe


def pytest_sessionfinish(session: pytest.Session) -> None:
    out = getattr(session.config, "workeroutput", None)
    if out is None:  # not an xdist worker
        return
    import sys

    totals: dict[str, Any] = {}
    helpers = sys.modules.get("tests.soundness._helpers")
    if helpers is not None:
        totals["total"] = dict(helpers.TOTAL)
    harness = sys.modules.get("tests.soundness.adversarial.harness")
    if harness is not None:
        totals["classes"] = {n: {"pairs": st.pairs, "violations": st.violations,
                                 "worst_drift": st.worst_drift,
                                 "worst_excursion": st.worst_excursion, "errors": st.errors}
                             for n, st in harness.SESSION.classes.items()}
    out["kcverify_totals"] = json.dumps(totals)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    raw = getattr(node, "workeroutput", {}).get("kcverify_totals")
    if not raw:
        return
    got = json.loads(raw)
    if "total" in got:
        tot = _GATHERED.setdefault("total", {"pairs": 0, "worst_ratio": 0.0})
        tot["pairs"] += got["total"]["pairs"]
        tot["worst_ratio"] = max(tot["worst_ratio"], got["total"]["worst_ratio"])
    for name, st in got.get("classes", {}).items():
        me = _GATHERED.setdefault("classes", {}).setdefault(
            name, {"pairs": 0, "violations": [], "worst_drift": 0.0, "worst_excursion": 0.0,
                   "errors": []})
        me["pairs"] += st["pairs"]
        me["violations"] += st["violations"]
        me["errors"] += st["errors"]
        me["worst_drift"] = max(me["worst_drift"], st["worst_drift"])
        me["worst_excursion"] = max(me["worst_excursion"], st["worst_excursion"])


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The controller's copy of the workers' totals (serial runs print them from the suites'
    own conftests)."""
    if _GATHERED.get("classes"):
        from tests.soundness.adversarial.harness import ClassStats

        terminalreporter.section("adversarial soundness: per attack class (all workers)")
        for name, st in sorted(_GATHERED["classes"].items()):
            terminalreporter.write_line(ClassStats(**st).line(name))
    tot = _GATHERED.get("total")
    if tot and tot["pairs"]:
        terminalreporter.write_line(
            f"soundness: {int(tot['pairs'])} (input, realization) pairs checked (all workers); "
            f"worst observed/certified drift ratio {tot['worst_ratio']:.4f}")
