"""Runtime measurements of the inference kernel: latency per call and peak memory.

``measure_runtime(fn, args, warmup, repeats, device)`` calls ``fn`` ``warmup`` times untimed,
then ``repeats`` times timed (each call on each element of ``args`` in turn when given, so one
sample per input and repetition).

* CPU: wall-clock latency by ``time.perf_counter``; peak memory = the process's peak resident set
  (VmHWM in /proc/self/status, reset first through /proc/self/clear_refs where Linux allows; else
  ``resource.getrusage`` ru_maxrss, the peak since the process started).
* CUDA: latency by ``torch.cuda.Event`` pairs (synchronised), peak memory =
  ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``.

Memory is reported in MiB (2^20 bytes).
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MIB = float(2**20)


@dataclass(frozen=True)
class RuntimeSample:
    """Timed calls of one kernel: latencies_ms [r] (one per call), peak memory, and how."""

    latencies_ms: np.ndarray
    peak_memory_mb: float
    baseline_memory_mb: float
    device: str
    warmup: int
    repeats: int
    memory_method: str
    backend: str = "callable"  # what ran: onnxruntime | executor | realization | callable

    @property
    def n(self) -> int:
        return int(self.latencies_ms.shape[0])

    def percentile(self, q: float) -> float:
        """The q-quantile (q in (0, 1)) of the latencies, ms."""
        return float(np.quantile(self.latencies_ms, q))


def _read_hwm_kib() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _rss_kib() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_hwm() -> bool:
    """Reset the peak-RSS watermark (Linux >= 4.0: write 5 to /proc/self/clear_refs)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _maxrss_mib() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / 1024.0 if sys.platform != "darwin" else r / MIB  # KiB on Linux, bytes on macOS


def _cpu_memory_start() -> tuple[float, str]:
    rss = _rss_kib()
    baseline = rss / 1024.0 if rss is not None else _maxrss_mib()
    if _reset_hwm() and _read_hwm_kib() is not None:
        return baseline, "peak RSS (VmHWM, reset before timing)"
    return baseline, "peak RSS since process start (getrusage ru_maxrss)"


def _cpu_memory_peak(method: str) -> float:
    hwm = _read_hwm_kib() if method.startswith("peak RSS (VmHWM") else None
    return hwm / 1024.0 if hwm is not None else _maxrss_mib()


def measure_runtime(fn: Callable[..., Any], args: Sequence[Any] | None = None, *, warmup: int = 3,
                    repeats: int = 20, device: str = "cpu") -> RuntimeSample:
    """Time ``fn`` (``fn(a)`` for each ``a`` in ``args``, else ``fn()``) after ``warmup`` calls."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats}, {warmup}")
    calls: list[tuple[Any, ...]] = [(a,) for a in args] if args is not None else [()]
    if not calls:
        raise ValueError("measure_runtime: no inputs to time")
    cuda = str(device).startswith("cuda")
    for _ in range(warmup):
        for c in calls:
            fn(*c)
    lat: list[float] = []
    if cuda:
        import torch

        torch.cuda.synchronize(device)
        baseline = torch.cuda.memory_allocated(device) / MIB
        torch.cuda.reset_peak_memory_stats(device)
        for _ in range(repeats):
            for c in calls:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn(*c)
                end.record()
                end.synchronize()
                lat.append(float(start.elapsed_time(end)))
        peak, method = torch.cuda.max_memory_allocated(device) / MIB, "torch.cuda.max_memory_allocated"
    else:
        baseline, method = _cpu_memory_start()
        for _ in range(repeats):
            for c in calls:
                t0 = time.perf_counter()
                fn(*c)
                lat.append((time.perf_counter() - t0) * 1e3)
        peak = _cpu_memory_peak(method)
    return RuntimeSample(np.asarray(lat, dtype=np.float64), float(peak), float(baseline),
                         str(device), warmup, repeats, method)
