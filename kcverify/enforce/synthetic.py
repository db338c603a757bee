"""Synthetic, deterministic traces with an injected kernel fault (the paper's E5, in miniature).

The requests are drawn (seeded, uniformly) from the distinct examples of the contract's slices
(``slice_name``: of that slice only); each record names every slice its example belongs to. Before ``fault_at`` minutes,
build ``build`` serves them: its logits are those of a conforming program of the contract's
inference kernel (kcverify.kernels.realize, run once per distinct input, batch 1), and the
training kernel's logits are a conforming program of the training kernel. From ``fault_at`` on,
build ``fault_build`` serves them with the drift multiplied by ``factor``:

    z_inf' = z_train + factor * (z_inf - z_train)

Replay signatures hash each kernel's tensors at audit points (the model's outputs and a few
intermediate tensors). The faulty build's intermediates are those of the conforming program and
only its output differs, so replaying a faulty request localises the divergence at the output.
Latencies are log-normal (median ``latency_ms``, log-sd ``latency_sigma``) whatever the build.
Arrival times are evenly spaced at ``rate`` requests per minute with seeded jitter.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

from kcverify.enforce.replay import DEFAULT_PROGRAM, program_executor
from kcverify.enforce.traces import format_time, parse_time, tensor_hash
from kcverify.errors import KcverifyError
from kcverify.fileio import atomic_write_text


@dataclass(frozen=True)
class FaultPlan:
    minutes: float = 40.0
    fault_at: float | None = 20.0
    factor: float = 50.0
    rate: float = 30.0  # requests per minute
    seed: int = 0
    start: str = "2025-06-01T12:00:00Z"
    build: str = "2025.06-r1"
    fault_build: str = "2025.06-r2"
    latency_ms: float = 2.0
    latency_sigma: float = 0.15
    audit_points: int = 2  # intermediate tensors hashed besides the outputs


def _audit_names(graph: Any, count: int) -> list[str]:
    outs = [v.name for v in graph.outputs]
    inner = [o for n in graph.nodes for o in n.outputs if o and o not in outs]
    if count <= 0 or not inner:
        return outs
    step = max(1, len(inner) // count)
    return inner[step - 1::step][:count] + outs


def _fingerprint(contract: Any, build: str) -> dict[str, str]:
    inf = contract.kernels["inf"]
    casts = [f"{role}={c.format.name}/{c.scale}" for role, c in
             (("weights", inf.weights), ("activations", inf.activations)) if c is not None]
    return {"build": build, "attention": "none", "quantisation": ",".join(casts) or "none",
            "hardware": "cpu-x86_64"}


def _example_json(name: str, a: np.ndarray) -> Any:
    return a.tolist() if a.dtype.kind in "iu" else np.asarray(a, dtype=np.float64).tolist()


def synthetic_traces(contract_path: str | os.PathLike[str], out: str | os.PathLike[str],
                     plan: FaultPlan | None = None, slice_name: str | None = None) -> dict[str, Any]:
    """Write the traces to ``out`` (JSONL, atomically); returns a summary (records, fault time)."""
    from kcverify.dsl import load_contract
    from kcverify.empirical.slices import load_slice
    from kcverify.models.ir import load_onnx

    plan = plan or FaultPlan()
    contract = load_contract(contract_path)
    if contract.model.onnx is None:
        raise KcverifyError(f"{contract_path}: the contract names no model (model.onnx)")
    graph = load_onnx(contract.resolve(contract.model.onnx))
    names = [n for n, sl in contract.slices.items() if sl.inputs]
    if slice_name is not None and slice_name not in names:
        raise KcverifyError(f"{contract_path}: no slice {slice_name!r} with inputs; slices: "
                            f"{', '.join(names)}")
    if not names:
        raise KcverifyError(f"{contract_path}: no slice with inputs to draw requests from")
    # every distinct example of the slices, with the slices it belongs to
    examples: list[dict[str, np.ndarray]] = []
    member: list[list[str]] = []
    where: dict[tuple[str, int], int] = {}
    inputs = [v.name for v in graph.inputs]
    for name in names:
        data = load_slice(contract.slices[name], base_dir=contract.path.parent)
        feeds = data.feeds(inputs)
        src = os.fspath(Path(data.source).resolve())
        for j in range(data.n):
            key = (src, int(data.fields["index"][j]))
            if key not in where:
                where[key] = len(examples)
                examples.append({k: v[j:j + 1] for k, v in feeds.items()})  # batch 1
                member.append([])
            member[where[key]].append(name)
    pool = [i for i in range(len(examples)) if slice_name is None or slice_name in member[i]]
    audit = _audit_names(graph, plan.audit_points)
    out_name = graph.outputs[0].name
    base_dir = contract.path.parent
    rng = np.random.default_rng(plan.seed)
    n_req = int(round(plan.minutes * plan.rate))
    picks = [pool[int(k)] for k in rng.integers(0, len(pool), size=n_req)]
    cache: dict[int, dict[str, Any]] = {}
    executors = {side: program_executor(graph, contract.kernels[side], DEFAULT_PROGRAM, base_dir)
                 for side in ("train", "inf")}
    for i in sorted(set(picks)):
        sides = {}
        for side in ("train", "inf"):  # batch 1, as replay runs it
            env = executors[side].run(examples[i], keep=True)
            z = env[out_name].detach().cpu().double().numpy()
            sides[side] = (z, {a: tensor_hash(env[a]) for a in audit})
        cache[i] = sides
    t0 = parse_time(plan.start)
    spacing = 60.0 / plan.rate
    jitter = rng.uniform(0.0, 0.8 * spacing, size=n_req)
    latency = np.exp(np.log(plan.latency_ms) + plan.latency_sigma * rng.standard_normal(n_req))
    fault_s = None if plan.fault_at is None else plan.fault_at * 60.0
    lines = []
    for r in range(n_req):
        i = int(picks[r])
        offset = r * spacing + jitter[r]
        faulty = fault_s is not None and offset >= fault_s
        (zt, h_train), (zi, h_inf) = cache[i]["train"], cache[i]["inf"]
        h_inf = dict(h_inf)
        if faulty:
            zi = zt + plan.factor * (zi - zt)
            h_inf[out_name] = tensor_hash(zi)
        shape = zt.shape[1:] if zt.ndim >= 2 else zt.shape
        zt1, zi1 = zt.reshape(shape), zi.reshape(shape)
        rec: dict[str, Any] = {
            "request_id": f"req-{r:06d}",
            "time": format_time(t0 + timedelta(seconds=offset)),
            "slices": member[i],
            "kernel": {"name": "inf", "fingerprint": _fingerprint(
                contract, plan.fault_build if faulty else plan.build)},
        }
        ex = {k: v[0] for k, v in examples[i].items()}
        if list(ex) == ["input_ids"]:
            rec["input_ids"] = _example_json("input_ids", ex["input_ids"])
        else:
            rec["inputs"] = {k: _example_json(k, v) for k, v in ex.items()}
        rec["logits_train"] = zt1.tolist()
        rec["logits_inf"] = zi1.tolist()
        rec["latency_ms"] = round(float(latency[r]), 4)
        rec["replay"] = {"train": {"program": dict(DEFAULT_PROGRAM), "audit": h_train},
                         "inf": {"program": dict(DEFAULT_PROGRAM), "audit": h_inf}}
        rec["slice_index"] = i  # an extra field: kept by the reader, ignored by the checks
        lines.append(json.dumps(rec, separators=(",", ":")))
    atomic_write_text(Path(out), "\n".join(lines) + "\n")
    return {"records": n_req, "path": os.fspath(out), "slices": names if slice_name is None
            else [slice_name],
            "start": format_time(t0),
            "fault_at": None if fault_s is None else format_time(t0 + timedelta(seconds=fault_s)),
            "builds": [plan.build] + ([plan.fault_build] if fault_s is not None else [])}


def split_at(path: str | os.PathLike[str], when: str, before: str | os.PathLike[str],
             after: str | os.PathLike[str]) -> tuple[int, int]:
    """Split a trace file at an RFC 3339 time: records before ``when`` / at or after it."""
    t = parse_time(when)
    a, b = [], []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        (a if parse_time(json.loads(line)["time"]) < t else b).append(line)
    atomic_write_text(Path(before), "\n".join(a) + ("\n" if a else ""))
    atomic_write_text(Path(after), "\n".join(b) + ("\n" if b else ""))
    return len(a), len(b)
