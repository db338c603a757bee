"""What ``kcverify inspect`` reports about a model: interface, op census, unsupported ops, the
blocks (digests and sizes), and optionally the executor's agreement with onnxruntime on random
inputs (integer inputs read by an embedding Gather get token ids below its table size)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from kcverify.errors import ModelImportError
from kcverify.models.blocks import segment
from kcverify.models.executor import Executor, unsupported_ops
from kcverify.models.ir import Graph, file_sha256, load_onnx

RTOL = 1e-5  # max |executor - onnxruntime| <= RTOL * max |onnxruntime| in fp32


def vocab_sizes(graph: Graph) -> dict[str, int]:
    """Integer graph inputs used as Gather indices into a constant table: input -> table size."""
    const = graph.constant_names()
    names = {v.name for v in graph.inputs}
    out: dict[str, int] = {}
    for n in graph.nodes:
        if n.op_type != "Gather" or len(n.inputs) < 2 or n.inputs[1] not in names:
            continue
        table = n.inputs[0]
        if table in const and table in graph.initializers:
            axis = int(n.attrs.get("axis", 0))
            size = int(graph.initializers[table].shape[axis])
            out[n.inputs[1]] = min(out.get(n.inputs[1], size), size)
    return out


def random_feeds(graph: Graph, batch: int = 2, seq: int = 16, seed: int = 0) -> dict[str, np.ndarray]:
    """Random inputs: floats N(0, 1), token ids uniform below the vocabulary, other integer
    inputs (masks) all ones. Symbolic dims: the first is ``batch``, the others ``seq``."""
    rng = np.random.default_rng(seed)
    vocab = vocab_sizes(graph)
    feeds: dict[str, np.ndarray] = {}
    for v in graph.inputs:
        shape = []
        for k, d in enumerate(v.shape or (batch, seq)):
            shape.append(d if isinstance(d, int) else (batch if k == 0 else seq))
        dtype = np.dtype(v.dtype or "float32")
        if dtype.kind == "f":
            feeds[v.name] = rng.standard_normal(shape).astype(dtype)
        elif v.name in vocab:
            feeds[v.name] = rng.integers(0, vocab[v.name], size=shape).astype(dtype)
        elif dtype == np.bool_:
            feeds[v.name] = np.ones(shape, dtype=bool)
        else:
            feeds[v.name] = np.ones(shape, dtype=dtype)
    return feeds


def against_ort(path: str, graph: Graph, feeds: dict[str, np.ndarray]) -> dict[str, Any]:
    """Run the executor (Exact, fp32) and onnxruntime on ``feeds``; per output max |diff|."""
    import onnxruntime as ort

    ours = Executor(graph).run(feeds)
    try:
        sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - onnxruntime raises its own exception types
        raise ModelImportError(f"{path}: onnxruntime cannot load the model ({e})") from None
    names = [o.name for o in sess.get_outputs()]
    theirs = dict(zip(names, sess.run(names, feeds)))
    per: dict[str, Any] = {}
    ok = True
    for name, ref in theirs.items():
        mine = ours[name].detach().cpu().numpy()
        ref = np.asarray(ref)
        diff = float(np.max(np.abs(mine.astype(np.float64) - ref))) if ref.size else 0.0
        scale = float(np.max(np.abs(ref))) if ref.size else 0.0
        good = bool(diff <= RTOL * scale) if ref.dtype.kind == "f" else bool(diff == 0)
        ok &= good
        per[name] = {"max_abs_diff": diff, "max_abs_output": scale, "ok": good}
    return {"ok": ok, "rtol": RTOL, "outputs": per,
            "feeds": {k: list(v.shape) for k, v in feeds.items()}}


def inspect_model(path: str | os.PathLike[str], check_ort: bool = False, batch: int = 2,
                  seq: int = 16, seed: int = 0) -> dict[str, Any]:
    """The inspection report of an ONNX file, as JSON-able data."""
    p = os.fspath(path)
    graph = load_onnx(p)
    missing = unsupported_ops(graph)
    blocks = segment(graph)
    params = sum(int(np.asarray(a).size) for a in graph.initializers.values())
    report: dict[str, Any] = {
        "model": p,
        "sha256": file_sha256(p),
        "digest": graph.digest(),
        "opset": graph.opset,
        "nodes": len(graph.nodes),
        "params": params,
        "inputs": [{"name": v.name, "dtype": v.dtype, "shape": list(v.shape or [])}
                   for v in graph.inputs],
        "outputs": [{"name": v.name, "dtype": v.dtype, "shape": list(v.shape or [])}
                    for v in graph.outputs],
        "ops": graph.op_census(),
        "unsupported": [{"op": op if not d else f"{d}::{op}", "node": node}
                        for op, d, node in missing],
        "blocks": [{"name": b.name, "kind": b.kind, "nodes": b.num_nodes, "params": b.num_params,
                    "inputs": list(b.inputs), "outputs": list(b.outputs), "digest": b.digest}
                   for b in blocks],
    }
    if check_ort:
        if missing:
            report["against_ort"] = {"ok": False, "skipped": "the model has unsupported ops"}
        else:
            report["against_ort"] = against_ort(p, graph, random_feeds(graph, batch, seq, seed))
    return report


def _shape(s: list[Any]) -> str:
    return "[" + ", ".join(str(d) for d in s) + "]"


def render(report: dict[str, Any]) -> str:
    """The report as terminal text."""
    lines = [f"model    {report['model']}",
             f"sha256   {report['sha256']}",
             f"opset    {report['opset']}   nodes {report['nodes']}   params {report['params']:,}"]
    for key in ("inputs", "outputs"):
        for v in report[key]:
            lines.append(f"{key[:-1]:<8} {v['name']}: {v['dtype']} {_shape(v['shape'])}")
    lines.append("ops      " + ", ".join(f"{k} {n}" for k, n in report["ops"].items()))
    if report["unsupported"]:
        lines.append("unsupported " + ", ".join(f"{u['op']} ({u['node']!r})"
                                                 for u in report["unsupported"]))
    else:
        lines.append("unsupported none")
    lines.append("blocks")
    width = max(len(b["name"]) for b in report["blocks"])
    for b in report["blocks"]:
        lines.append(f"  {b['name']:<{width}}  {b['kind']:<9} {b['nodes']:>5} nodes "
                     f"{b['params']:>11,} params  {b['digest'][:16]}  "
                     f"{', '.join(b['inputs'])} -> {', '.join(b['outputs'])}")
    ort_rep = report.get("against_ort")
    if ort_rep is not None:
        if "skipped" in ort_rep:
            lines.append(f"onnxruntime  skipped: {ort_rep['skipped']}")
        for name, r in ort_rep.get("outputs", {}).items():
            verdict = "ok" if r["ok"] else "MISMATCH"
            lines.append(f"onnxruntime  {name}: max|diff| {r['max_abs_diff']:.3g}, "
                         f"max|out| {r['max_abs_output']:.3g} ({verdict}, "
                         f"tolerance {ort_rep['rtol']:g} x max|out|)")
    return "\n".join(lines)
