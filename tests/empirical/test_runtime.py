"""Runtime measurement: warm-up is untimed, one latency per call, peak memory sees allocations."""

from __future__ import annotations

import mmap
import time

import numpy as np
import pytest

from kcverify.empirical.metrics import MetricInputs, compute_metric
from kcverify.empirical.runtime import measure_runtime


def test_latency_counts_and_order_of_magnitude() -> None:
    calls: list[int] = []

    def fn(a: int = 0) -> None:
        calls.append(a)
        time.sleep(0.002)

    s = measure_runtime(fn, warmup=2, repeats=5)
    assert len(calls) == 7 and s.n == 5 and s.warmup == 2
    assert np.all(s.latencies_ms >= 2.0) and np.all(s.latencies_ms < 200.0)
    calls.clear()
    s = measure_runtime(fn, args=[1, 2, 3], warmup=1, repeats=2)
    assert calls == [1, 2, 3] * 3 and s.n == 6


def test_peak_memory_sees_a_large_allocation() -> None:
    def alloc() -> None:
        # 64 MiB of fresh anonymous pages, touched: a numpy array may instead reuse pages the
        # allocator kept resident after earlier tests freed large buffers (then RSS cannot grow)
        m = mmap.mmap(-1, 64 * 2**20)
        m.write(b"\1" * (64 * 2**20))
        m.close()

    s = measure_runtime(alloc, warmup=0, repeats=1)
    assert s.peak_memory_mb >= s.baseline_memory_mb
    if s.memory_method.startswith("peak RSS (VmHWM"):
        assert s.peak_memory_mb - s.baseline_memory_mb >= 50


def test_runtime_sample_feeds_metrics() -> None:
    s = measure_runtime(lambda: sum(range(1000)), warmup=1, repeats=30)
    x = MetricInputs(latencies_ms=s.latencies_ms, peak_memory_mb=s.peak_memory_mb)
    assert compute_metric("p95_latency_ms", x) == pytest.approx(s.percentile(0.95))
    assert compute_metric("peak_memory_mb", x) == s.peak_memory_mb


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        measure_runtime(lambda: None, repeats=0)


@pytest.mark.gpu
def test_cuda_events_and_peak_memory() -> None:
    import torch

    def fn() -> None:
        a = torch.ones(2**24, device="cuda")  # 64 MiB
        (a * 2).sum()

    s = measure_runtime(fn, warmup=1, repeats=5, device="cuda")
    assert s.n == 5 and np.all(s.latencies_ms > 0)
    assert s.memory_method == "torch.cuda.max_memory_allocated"
    assert s.peak_memory_mb - s.baseline_memory_mb >= 64
