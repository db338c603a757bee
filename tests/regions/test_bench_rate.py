"""bench/acasxu.py rate: the throughput figure (parts per CPU second) and its split by phase."""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path

import pytest

import kcverify.regions.chain as chain_mod
import kcverify.regions.property as property_mod
from tests.regions.helpers import ROOT


def _bench():  # noqa: ANN202 - the bench script as a module
    spec = importlib.util.spec_from_file_location("bench_acasxu", ROOT / "bench" / "acasxu.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_rate_accounts_phases_and_restores(acas: Path, capsys: pytest.CaptureFixture) -> None:
    """One short split of 1_1: parts bounded, every phase charged some CPU, the phases within
    the total, and the domain's functions restored afterwards (a wrapper left behind would time
    every later caller)."""
    before = {(m, a): getattr(m, a) for m in (chain_mod, property_mod)
              for a in ("optimise_slopes", "backward_value", "backward_drift") if hasattr(m, a)}
    bench = _bench()
    assert bench.rate(argparse.Namespace(nets="1_1", eps=0.05, budget=0.3)) == 0
    line = next(s for s in capsys.readouterr().out.splitlines() if s.startswith("1_1"))
    f = line.split()
    parts, cpu, rate = int(f[3]), float(f[5]), float(f[6])
    assert parts > 1 and cpu > 0 and abs(rate - parts / cpu) < 0.1 * rate + 0.1
    spent = [float(v) for v in re.findall(r"([\d.]+) \(\s*\d+%\)", line)]  # phases, rest
    assert len(spent) == len(bench.PHASES) + 1
    assert all(v > 0 for v in spent[:3]) and sum(spent[:-1]) <= cpu + 0.05
    assert all(getattr(m, a) is f0 for (m, a), f0 in before.items())
