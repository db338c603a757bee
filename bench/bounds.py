"""Benchmark of the bound engine: ratios measured in one run (semantics §5, 6; issue 4).

    python bench/bounds.py [--models tiny_decoder,tiny_encoder] [--device cpu]
                           [--contracts examples/contracts/w8-decoder.yaml,...] [--programs 3]
                           [--domains interval,best] [--batch 1] [--seq 16] [--eps 0]
                           [--cut segments|whole] [--budget 24] [--widths]

It prints the machine, then for each kernel pair (contract: default weight-only fp8 and the
fp8-deploy demo with fp8 activations), model and domain:
  ort s         one fp32 forward pass in onnxruntime (median of 7, same threads)
  cert s        certification wall-clock seconds; cpu s: this process's CPU seconds for it
                (on a shared machine the wall clock measures the load; the CPU time less so)
  time/ort      certification time / that forward pass (the goal: 20x, at most 1,000x); cpu/ort
                the same with the CPU seconds
  time/fwd      certification time / one fp32 forward pass of the executor (Exact arithmetic)
  bound         the certified bound on max |z_inf - z_train| (per input; median over the batch)
  falsifier     the falsifier's largest realized drift (a lower bound on the true supremum)
  cert/falsif   certified bound / the falsifier's largest realized drift (point inputs; >= 1
                always, 1 is perfect)
  sep/diff      separate-kernel baseline bound / differential bound (point inputs, and an
                input/embedding box of radius --eps)
  unstable      unstable casts per input: fp8 roundings conforming programs may take either way
With --widths, after each relational domain's line: per LayerNormalization output (a transformer's
checkpoints, twice per layer) the widest training value set and drift enclosure the zonotope kept
there, and its symbol rows (dense + local kinds): where a bound is lost (docs/bounds.md, MiniLM).
  rss GB        the process's peak resident set so far (a running maximum: the first domain
                that needs more memory than everything before it shows its own peak)
With --cases N, a second line per domain ("+cases"): the bound by cases (at most N leaves per
input), its cert/falsif, the leaves, the unstable casts left in them, and the CPU seconds per
analysis run (one case of one input for a relational domain).
Figures are medians over the batch; 'inf' means the domain gave no finite bound. Domains:
interval (per block), linear (the whole graph as one block: intervals, symbolic intervals and
the zonotope, so forms span every layer), best (per block: all three; what certificates store).
--cut whole bounds the whole graph as one block with every domain (``certify_drift(...,
cut="whole")``: what `prove --blocks whole|auto` runs per input; docs/bounds.md "Speed").
The kernels come from each contract (default: weight-only fp8 and the fp8-deploy demo).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kcverify.bounds import Region, certify_drift  # noqa: E402
from kcverify.bounds.falsify import falsify  # noqa: E402
from kcverify.models.executor import Executor  # noqa: E402
from kcverify.models.ir import load_onnx  # noqa: E402

MODEL_FILES = {
    "tiny_decoder": ROOT / "models" / "tiny_decoder.onnx",
    "tiny_encoder": ROOT / "models" / "tiny_encoder.onnx",
    "minilm": ROOT / "models" / "minilm" / "minilm.onnx",
    "mlp_small": ROOT / "models" / "mlp_small.onnx",
}


def feeds_for(graph, batch: int, seq: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    out = {}
    for v in graph.inputs:
        if (v.dtype or "").startswith("int"):
            out[v.name] = (np.ones((batch, seq), np.int64) if "mask" in v.name
                           else rng.integers(0, 256, size=(batch, seq)))
        else:
            out[v.name] = rng.normal(size=(batch, *[int(d) for d in v.shape[1:]])).astype(np.float32)
    return out


def forward_seconds(graph, feeds, device: str) -> float:
    ex = Executor(graph, device=device, dtype=torch.float32)
    ex.run(feeds)
    ts = []
    for _ in range(7):
        t = time.perf_counter()
        ex.run(feeds)
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def ort_seconds(path: Path, feeds: dict[str, np.ndarray], threads: int) -> float:
    """One fp32 forward pass in onnxruntime (median of 7 after a warm-up)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    f = {k: v for k, v in feeds.items() if k in names}
    sess.run(None, f)
    ts = []
    for _ in range(7):
        t = time.perf_counter()
        sess.run(None, f)
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def machine() -> str:
    """The machine the figures were taken on: CPU, cores, memory, load, library versions."""
    import platform

    import onnxruntime as ort

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")),
                       cpu)
    except OSError:
        pass
    from kcverify.bounds.memory import physical_memory

    return (f"machine: {cpu}, {os.cpu_count()} cores, {physical_memory() / 2**30:.0f} GiB, "
            f"load average {os.getloadavg()[0]:.1f}; {platform.system()} {platform.release()}, "
            f"python {platform.python_version()}, torch {torch.__version__}, "
            f"onnxruntime {ort.__version__}")


@contextlib.contextmanager
def width_trace(out: list[str] | None):
    """Collect, into ``out``, one line per LayerNormalization output the zonotope bounds: the
    widest training value set (max th - tl), drift enclosure (max dh - dl) and |drift| bound,
    and the rows its training form keeps (dense, local kinds) (zonotope.STEP_TRACE)."""
    from kcverify.bounds import zonotope

    if out is None:
        yield
        return

    def trace(node, name, b, z) -> None:
        if node.op_type != "LayerNormalization":
            return
        tw = float((b.th - b.tl).max())
        dw = float((b.dh - b.dl).max())
        dm = float(torch.maximum(b.dh.abs(), b.dl.abs()).max())
        out.append(f"  widths {name[-48:]:<48} value {tw:<10.3g} drift {dw:<10.3g} "
                   f"|drift| <= {dm:<10.3g} rows {z.t.kd} + {z.t.kl}")

    old = zonotope.STEP_TRACE
    zonotope.STEP_TRACE = trace
    try:
        yield
    finally:
        zonotope.STEP_TRACE = old


def peak_rss_gb() -> float:
    """The process's peak resident set so far, GB (ru_maxrss: KiB on Linux)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def med(x: np.ndarray) -> float:
    return float(np.median(x))


def ratio(a: np.ndarray, b: np.ndarray) -> float:
    """Median of a / b; inf where b is finite and a is not; nan where neither is finite."""
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(np.isfinite(a) | np.isfinite(b), a / b, np.nan)
    return float(np.median(r))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny_decoder,tiny_encoder")
    ap.add_argument("--domains", default="interval,best",
                    help="bound domains, comma-separated (interval, linear, best)")
    ap.add_argument("--contracts", default=",".join(
        str(ROOT / "examples" / "contracts" / c) for c in ("w8-decoder.yaml", "fp8-deploy.yaml")))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--eps", type=float, default=0.0,
                    help="also bound a box of this radius around each input (0: points only)")
    ap.add_argument("--programs", type=int, default=3, help="program pairs the falsifier runs")
    ap.add_argument("--cases", type=int, default=0,
                    help="also bound each point input by cases (kcverify/bounds/cases.py) with "
                         "at most this many leaves per input, in each domain (0: no)")
    ap.add_argument("--cut", default="segments", choices=("segments", "whole"),
                    help="the blocks bounded: the segmenter's, or the whole graph as one block")
    ap.add_argument("--budget", type=int, default=None,
                    help="the zonotope's symbol budget: at most 2**N generator entries per form "
                         "(zonotope.ELEMENT_BUDGET; default its own, 2**24)")
    ap.add_argument("--widths", action="store_true",
                    help="print the widths the zonotope keeps at each LayerNormalization output")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: with more, small tensors mostly measure BLAS/OpenMP "
                         "start-up, for the forward pass and the bounds alike)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    if args.budget is not None:
        from kcverify.bounds import zonotope

        zonotope.ELEMENT_BUDGET = 2**args.budget
    from kcverify.commands.bound import load_kernels

    print(machine())
    for contract in [c for c in args.contracts.split(",") if c]:
        train, inf = load_kernels(contract)
        print(f"contract {contract}: kernels train {train.canonical()} -> inf {inf.canonical()}")
        bench_contract(args, train, inf)


def unstable_text(res) -> str:
    """Unstable casts per input (median over the batch): fp8 roundings the programs may take
    either way (kcverify.bounds.diagnostics; issue 12's diagnostic)."""
    u = getattr(res, "unstable_casts", None)
    return "-" if u is None else f"{int(np.median(u))}"


def bench_contract(args, train, inf) -> None:
    from kcverify.bounds import zonotope

    print(f"device {args.device}, torch threads {torch.get_num_threads()}, batch {args.batch}, "
          f"seq {args.seq}, region eps {args.eps}, cut {args.cut}, "
          f"symbol budget 2^{int(math.log2(zonotope.ELEMENT_BUDGET))}, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'model':<14}{'domain':<10}{'ort s':>9}{'fwd s':>9}{'cert s':>9}{'cpu s':>9}"
          f"{'time/ort':>10}{'cpu/ort':>10}"
          f"{'time/fwd':>10}{'bound':>11}{'falsifier':>11}{'cert/fals':>10}{'sep/diff':>10}"
          f"{'unstable':>9}{'rss GB':>8}{'box bound':>11}{'box sep/diff':>13}")
    for name in [m for m in args.models.split(",") if m]:
        path = MODEL_FILES.get(name, Path(name))
        if not path.exists():
            print(f"{name:<14}(not available: {path})")
            continue
        graph = load_onnx(path)
        rng = np.random.default_rng(0)
        feeds = feeds_for(graph, args.batch, args.seq, rng)
        fwd = forward_seconds(graph, feeds, args.device)
        ort_fwd = ort_seconds(path, feeds, args.threads)
        fals = falsify(graph, train, inf, feeds,
                       programs=1 if name == "minilm" else args.programs).best
        sep = certify_drift(graph, train, inf, feeds, domain="separate", device=args.device).linf
        token = any((v.dtype or "").startswith("int") for v in graph.inputs)
        region = Region("embedding" if token else "input", "linf", args.eps)
        box_sep = (certify_drift(graph, train, inf, feeds, region=region, domain="separate",
                                 device=args.device).linf if args.eps > 0 else None)
        for domain in [d for d in args.domains.split(",") if d]:
            dts, cpus = [], []
            widths: list[str] = []
            for _ in range(2 if domain == "interval" else 1):  # a second, warm interval run
                widths.clear()
                t, c = time.perf_counter(), time.process_time()
                with width_trace(widths if args.widths else None):
                    res = certify_drift(graph, train, inf, feeds, domain=domain,
                                        device=args.device, cut=args.cut)
                dts.append(time.perf_counter() - t)
                cpus.append(time.process_time() - c)
            dt, cpu = min(dts), min(cpus)
            if args.eps > 0:
                box = certify_drift(graph, train, inf, feeds, region=region, domain=domain,
                                    device=args.device, cut=args.cut).linf
                box_txt = f"{med(box):>11.4g}{ratio(box_sep, box):>13.4g}"
            else:
                box_txt = ""
            with np.errstate(divide="ignore", invalid="ignore"):
                print(f"{name:<14}{domain:<10}{ort_fwd:>9.5f}{fwd:>9.4f}{dt:>9.3f}{cpu:>9.3f}"
                      f"{dt / ort_fwd:>10.0f}{cpu / ort_fwd:>10.0f}{dt / fwd:>10.1f}"
                      f"{med(res.linf):>11.4g}{med(fals):>11.4g}{ratio(res.linf, fals):>10.4g}"
                      f"{ratio(sep, res.linf):>10.4g}{unstable_text(res):>9}{peak_rss_gb():>8.2f}"
                      f"{box_txt}")
            for line in widths:
                print(line)
            sys.stdout.flush()
            if args.cases > 0 and domain in ("interval", "best"):
                bench_cases(args, graph, train, inf, feeds, name, domain, fals)


def bench_cases(args, graph, train, inf, feeds, name: str, domain: str, fals) -> None:
    """One line: the bound by cases per input (median), against the falsifier."""
    from kcverify.bounds.cases import certify_cases

    c = time.process_time()
    res = certify_cases(graph, train, inf, feeds, max_leaves=args.cases, domain=domain,
                        device=args.device)
    cpu = time.process_time() - c
    leaves = int(np.median([len(p) for p in res.leaves]))
    with np.errstate(divide="ignore", invalid="ignore"):
        print(f"{name:<14}{domain + '+cases':<16}bound {med(res.linf):.4g}  falsifier "
              f"{med(fals):.4g}  cert/fals {ratio(res.linf, fals):.4g}  leaves {leaves}  "
              f"unstable left {int(np.median(res.unstable_left))}  runs {res.runs}  "
              f"cpu s/run {cpu / max(res.runs, 1):.1f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
