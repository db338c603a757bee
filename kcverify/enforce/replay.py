"""Replay a logged request under both kernels with kcverify's executor, and check its signature.

A record's replay signature (``replay.train`` / ``replay.inf``) names, per kernel, the program
that served it (kcverify.kernels.realize.Realization's ``seed``, ``order``, ``chunk``,
``rounding``; defaults seed 0, sequential, nearest) and the hashes of tensors at audit points
(``audit``: tensor name -> ``sha256:...`` as computed by kcverify.enforce.traces.tensor_hash on
the batch-of-one tensor). Replaying runs the model on the record's inputs as that program of
the contract's kernel spec, in float64, batch 1, and recomputes every audit hash:

* every hash matches: the served output is reproduced bit for bit (**reproducible**);
* a hash differs: the first differing audit point in graph order localises the divergence;
* no signature: nothing to compare (reported, exit 1 for ``kcverify replay``).

The recorded logits are also compared with the replayed ones (max |difference| per kernel), and
the recorded drift is attributed to its possible sources (kcverify.enforce.attribution).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kcverify.enforce.traces import (
    PROGRAM_KEYS,
    TraceError,
    TraceReader,
    TraceRecord,
    tensor_hash,
)
from kcverify.errors import InputFileError, KcverifyError

DEFAULT_PROGRAM: dict[str, Any] = {"seed": 0, "order": "sequential", "chunk": None,
                                   "rounding": "nearest"}


def program_choices(program: Mapping[str, Any] | None) -> dict[str, Any]:
    """A Realization's keyword arguments from a recorded program (defaults filled in)."""
    out = dict(DEFAULT_PROGRAM)
    for k, v in (program or {}).items():
        if k not in PROGRAM_KEYS:
            raise KcverifyError(f"replay program: unknown key {k!r}; expected one of "
                                f"{', '.join(PROGRAM_KEYS)}")
        out[k] = v
    return out


def program_executor(graph: Any, spec: Any, program: Mapping[str, Any] | None = None,
                     base_dir: Any = None) -> Any:
    """An executor running ``graph`` as one conforming program of ``spec`` in float64. As
    kcverify.kernels.realize.run_kernel, a spec naming a second ONNX graph (``onnx``) runs that
    graph with its casts executed exactly."""
    import torch

    from kcverify.kernels.realize import Realization, explicit_cast_spec
    from kcverify.models.executor import Executor
    from kcverify.models.ir import load_onnx

    if spec.onnx is not None:
        path = spec.onnx if base_dir is None else os.path.join(os.fspath(base_dir), spec.onnx)
        graph = load_onnx(path)
        spec = explicit_cast_spec(spec)
    return Executor(graph, dtype=torch.float64,
                    arithmetic=Realization(spec, **program_choices(program)))


def run_program(graph: Any, spec: Any, feeds: Mapping[str, Any],
                program: Mapping[str, Any] | None = None, base_dir: Any = None,
                keep: bool = False) -> dict[str, Any]:
    """Run the program (``program_executor``) on ``feeds``: the outputs, or with ``keep`` every
    tensor (for audit points)."""
    return program_executor(graph, spec, program, base_dir).run(dict(feeds), keep=keep)


def record_feeds(record: TraceRecord, graph: Any) -> dict[str, np.ndarray]:
    """The model's inputs for one record, as a batch of one (dtypes as the graph declares)."""
    arrays: dict[str, np.ndarray]
    if record.inputs is not None:
        arrays = dict(record.inputs)
    elif record.input_ref is not None:
        arrays = _referenced_inputs(record)
    else:  # pragma: no cover - the reader requires one of them
        raise TraceError("the record has no inputs", record.source, record.line)
    names = [v.name for v in graph.inputs]
    if len(arrays) == 1 and len(names) == 1 and names[0] not in arrays:
        arrays = {names[0]: next(iter(arrays.values()))}
    missing = [n for n in names if n not in arrays]
    if missing:
        raise TraceError(f"the record's inputs ({', '.join(sorted(arrays))}) lack the model "
                         f"input(s) {', '.join(missing)}", record.source, record.line)
    feeds = {}
    for v in graph.inputs:
        a = np.asarray(arrays[v.name])
        rank = None if v.shape is None else len(v.shape)
        if rank is None or a.ndim == rank - 1:
            a = a[None, ...]
        elif a.ndim != rank or a.shape[0] != 1:
            raise TraceError(f"input {v.name!r} has shape {list(a.shape)}; the model expects "
                             f"one example of rank {rank - 1} (or a batch of one)",
                             record.source, record.line)
        if v.dtype is not None:
            a = a.astype(v.dtype)
        feeds[v.name] = a
    return feeds


def _referenced_inputs(record: TraceRecord) -> dict[str, np.ndarray]:
    from kcverify.empirical.slices import load_slice

    ref = record.input_ref or {}
    path = Path(ref["file"])
    if not path.is_absolute():
        path = Path(record.source).parent / path
    data = load_slice(path, name="input_ref")
    idx = int(ref["index"])
    if idx >= data.n:
        raise TraceError(f"input_ref index {idx} is out of range: {path} holds {data.n} "
                         f"examples", record.source, record.line)
    return {k: v[idx] for k, v in data.inputs.items()}


def find_record(spec: str) -> TraceRecord:
    """The record named by ``FILE:LINE``, ``FILE#REQUEST_ID``, or ``FILE`` (its only record)."""
    path, line, rid = spec, None, None
    if "#" in spec:
        path, rid = spec.rsplit("#", 1)
    elif ":" in spec and spec.rsplit(":", 1)[1].isdigit():
        path, tail = spec.rsplit(":", 1)
        line = int(tail)
    if not Path(path).is_file():
        raise InputFileError(f"{path}: no such trace file (give FILE:LINE, FILE#REQUEST_ID or a "
                             f"file holding one record)")
    records = []
    for rec in TraceReader(path, skip_bad=line is not None or rid is not None,
                           warn=lambda _m: None):
        if (line is not None and rec.line == line) or (rid is not None and rec.request_id == rid):
            return rec
        records.append(rec)
        if line is not None and rec.line > line:
            break
    if line is None and rid is None:
        if len(records) == 1:
            return records[0]
        raise KcverifyError(f"{path}: holds {len(records)} records; name one as {path}:LINE or "
                            f"{path}#REQUEST_ID")
    what = f"line {line}" if line is not None else f"request {rid!r}"
    raise KcverifyError(f"{path}: no valid trace record at {what}")


@dataclass
class AuditCheck:
    tensor: str
    recorded: str
    replayed: str | None
    match: bool


@dataclass
class SideReplay:
    """One kernel's replay: the program, audit checks in graph order, and logit agreement."""

    kernel: str
    program: dict[str, Any]
    audit: list[AuditCheck] = field(default_factory=list)
    first_divergence: str | None = None
    logits_max_abs_diff: float | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def signed(self) -> bool:
        return bool(self.audit)

    @property
    def reproducible(self) -> bool:
        return self.signed and all(a.match for a in self.audit) and not self.problems


@dataclass
class ReplayResult:
    record: TraceRecord
    sides: dict[str, SideReplay]
    attribution: Any = None

    @property
    def signed(self) -> bool:
        return any(s.signed for s in self.sides.values())

    @property
    def reproducible(self) -> bool:
        return self.signed and all(s.reproducible for s in self.sides.values() if s.signed)

    @property
    def ok(self) -> bool:
        explained = self.attribution is None or self.attribution.explained
        return self.reproducible and explained

    def to_json(self) -> dict[str, Any]:
        r = self.record
        return {
            "record": {"source": r.source, "line": r.line, "request_id": r.request_id,
                       "kernel": r.kernel_name, "fingerprint": r.fingerprint},
            "signed": self.signed, "reproducible": self.reproducible,
            "kernels": {k: {**asdict(s), "reproducible": s.reproducible}
                        for k, s in self.sides.items()},
            "attribution": None if self.attribution is None else self.attribution.to_json(),
            "ok": self.ok,
        }


def replay_record(record: TraceRecord, model: str | os.PathLike[str], contract: Any,
                  attribute: bool = True, domain: str = "interval") -> ReplayResult:
    """Replay ``record`` under the contract's kernels ``train`` and ``inf`` (module docstring)."""
    from kcverify.models.ir import load_onnx

    if not Path(model).is_file():
        raise InputFileError(f"{model}: no such ONNX model")
    graph = load_onnx(model)
    feeds = record_feeds(record, graph)
    order = {name: i for i, n in enumerate(graph.nodes) for name in n.outputs if name}
    order.update({v.name: -1 for v in graph.inputs})
    out_name = graph.outputs[0].name
    sides: dict[str, SideReplay] = {}
    replayed_logits: dict[str, np.ndarray] = {}
    base_dir = Path(contract.path).parent
    for side in ("train", "inf"):
        if side not in contract.kernels:
            raise KcverifyError(f"{contract.path}: the contract has no kernel {side!r}; replay "
                                f"needs 'train' and 'inf'")
        sig = (record.replay or {}).get(side) or {}
        program = program_choices(sig.get("program"))
        env = run_program(graph, contract.kernels[side], feeds, program, base_dir, keep=True)
        s = SideReplay(side, program)
        for name in sorted(sig.get("audit", {}), key=lambda n: order.get(n, 1 << 30)):
            recorded = sig["audit"][name]
            if name not in env:
                s.problems.append(f"audit point {name!r} is not a tensor of the model")
                s.audit.append(AuditCheck(name, recorded, None, False))
                continue
            got = tensor_hash(env[name])
            s.audit.append(AuditCheck(name, recorded, got, got == recorded))
        s.first_divergence = next((a.tensor for a in s.audit if not a.match), None)
        z = env[out_name].detach().cpu().double().numpy()
        replayed_logits[side] = z
        recorded_z = record.logits_train if side == "train" else record.logits_inf
        if recorded_z is not None:
            if z.size != recorded_z.size:
                s.problems.append(f"the model's output {out_name!r} has {z.size} values, the "
                                  f"record's logits {recorded_z.size}")
            else:
                s.logits_max_abs_diff = float(np.max(np.abs(z.reshape(recorded_z.shape)
                                                            - recorded_z)))
        sides[side] = s
    result = ReplayResult(record, sides)
    if attribute:
        from kcverify.enforce.attribution import attribute_drift

        result.attribution = attribute_drift(record, graph, contract, feeds, domain=domain)
    return result
