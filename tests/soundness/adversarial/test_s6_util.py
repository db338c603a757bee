"""Session 6: a certificate written by ``kcverify prove`` against the programs it speaks about.

``prove_cert(dir, contract_text, model)`` writes the contract into ``dir`` and proves it there
(the certificate in ``dir``, never next to a shipped model); ``leaf_bounds(statement, clause)``
reads a clause's per-input bounds from its proof tree's leaf, ``output_box(statement, slice,
tensor)`` the block certificate's box of the model's output over the slice; ``containment``
checks one (training program, inference program) pair of outputs against both, per element.

``QDQRunner`` runs a QDQ graph (an inference kernel given as an ONNX graph, docs/qdq.md) as one
program: its QuantizeLinear / DequantizeLinear nodes as ONNX specifies, written here from the
operator text (x / s exact or rounded to float32 first, round half to even, saturate; (q - z) s
exact or rounded to float32), the rest by the Program (any order, its roundings).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx.reference.op_run import OpRun

from kcverify.boxes import DiffBox
from tests.soundness.adversarial.arith import rnd
from tests.soundness.adversarial.interp import ProgramRunner, _op_classes
from tests.soundness.adversarial.programs import Program

ROOT = Path(__file__).resolve().parents[3]


def prove_cert(where: Path, contract_text: str, model: Path, name: str = "c") -> dict[str, Any]:
    """Prove ``contract_text`` (written to where/name.yaml) on ``model``; the statement as JSON
    (read back from the file prove wrote)."""
    import kcverify

    where.mkdir(parents=True, exist_ok=True)
    cpath = where / f"{name}.yaml"
    cpath.write_text(contract_text)
    cert = where / f"{name}.kcert.json"
    res = kcverify.prove(str(cpath), str(model), cert=str(cert))
    st = json.loads(cert.read_text())
    st["s6:exit_code"] = res.exit_code
    st["s6:cert"] = str(cert)
    st["s6:contract"] = str(cpath)
    return st


def clauses(st: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["id"]: c for c in st["predicate"]["clauses"]}


def leaf_bounds(st: dict[str, Any], clause: str) -> np.ndarray | None:
    """The per-input bounds of a proved clause: the deepest conclusion with a ``bounds`` list of
    more than one entry or, failing that, the slice-level one (float.hex strings)."""
    c = clauses(st)[clause]
    if c["verdict"] != "proved" or not c.get("proof"):
        return None
    best = None
    stack = [c["proof"]]
    while stack:
        node = stack.pop()
        b = node.get("conclusion", {}).get("bounds")
        if b is not None and (best is None or len(b) > len(best)):
            best = b
        stack.extend(node.get("premises", []))
    return None if best is None else np.array([float.fromhex(v) for v in best])


def output_box(st: dict[str, Any], slice_name: str, tensor: str) -> DiffBox | None:
    """The block certificates' boxes of ``tensor`` over the slice, concatenated along axis 0 in
    the order the certificate lists them (None: no block names it)."""
    parts = []
    for key, b in st["predicate"].get("blocks", {}).items():
        if key.split("/")[0] == slice_name and tensor in b["out_state"]:
            parts.append(DiffBox.from_json(b["out_state"][tensor], key))
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    arrs = [np.concatenate([p.arrays()[k] for p in parts], axis=0) for k in range(6)]
    return DiffBox(*arrs)


def containment(box: DiffBox | None, per_input: np.ndarray | None, t: np.ndarray, i: np.ndarray,
                where: str) -> tuple[list[str], float]:
    """Violations of the output box (train, inf, drift per element) and of the clause's
    per-input linf bounds; and the worst observed / certified linf ratio."""
    t = np.asarray(t, np.float64)
    i = np.asarray(i, np.float64)
    d = i - t
    bad: list[str] = []
    if box is not None:
        tl, th, il, ih, dl, dh = box.arrays()
        for nm, v, lo, hi in (("train", t, tl, th), ("inf", i, il, ih), ("drift", d, dl, dh)):
            out = ~((lo <= v) & (v <= hi))
            if np.any(out):
                k = tuple(np.argwhere(out)[0])
                bad.append(f"{where}: {nm} {v[k]!r} outside [{lo[k]!r}, {hi[k]!r}] at "
                           f"{list(map(int, k))} ({int(out.sum())} elements)")
    ratio = 0.0
    if per_input is not None:
        obs = np.abs(d).reshape(d.shape[0], -1).max(axis=1)
        over = obs > per_input
        if np.any(over):
            k = int(np.argmax(over))
            bad.append(f"{where}: input {k} linf drift {obs[k]!r} > certified {per_input[k]!r}")
        ok = np.isfinite(per_input) & (per_input > 0)
        if np.any(ok):
            ratio = float(np.max(obs[ok] / per_input[ok]))
    return bad, ratio


# --- QDQ graphs as programs ----------------------------------------------------------------
_FP8 = {"float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}
_INT = {np.dtype("int8"): (-128, 127), np.dtype("uint8"): (0, 255),
        np.dtype("int16"): (-32768, 32767), np.dtype("int32"): (-2**31, 2**31 - 1)}


def _qtype(z: Any) -> tuple[str, Any]:
    """("fp8_e4m3" / ..., None) or ("int", (lo, hi)) from a zero point's dtype."""
    dt = np.asarray(z).dtype
    if dt.name in _FP8:
        return _FP8[dt.name], None
    return "int", _INT[dt]


def _bshape(s: np.ndarray, x: np.ndarray, axis: int) -> np.ndarray:
    s = np.asarray(s, np.float64)
    if s.ndim == 0 or s.size == 1:
        return s.reshape(())
    shape = [1] * x.ndim
    shape[axis % x.ndim] = s.size
    return s.reshape(shape)


class QDQRunner(ProgramRunner):
    """ProgramRunner with QuantizeLinear / DequantizeLinear written from the ONNX text;
    ``quotient`` ("exact" / "fp32") and ``dq`` ("exact" / "fp32") are the two roundings a
    runtime may add (docs/qdq.md). A Q node outputs the quantized values as float64, tagged
    with their type in ``self.qtypes`` by output name; DQ reads them back."""

    def __init__(self, model: onnx.ModelProto, quotient: str = "exact", dq: str = "exact"
                 ) -> None:
        super().__init__(model)
        self.quotient, self.dq = quotient, dq

    def session(self, prog: Program):
        from onnx.reference import ReferenceEvaluator

        quotient, dq = self.quotient, self.dq

        def q_run(op, x, s, z=None, axis=1, saturate=1, **_kw):
            x = np.asarray(x, np.float64)
            s = _bshape(s, x, axis)
            kind, rng = _qtype(z if z is not None else np.uint8(0))
            with np.errstate(all="ignore"):
                t = x / s
                if quotient == "fp32":
                    t = rnd(t, "fp32")
            if kind == "int":
                zz = _bshape(np.asarray(z, np.float64), x, axis)
                q = np.clip(np.rint(t) + zz, rng[0], rng[1])
            else:
                q = rnd(t, kind, sat=bool(saturate))
            return (q,)

        def dq_run(op, q, s, z=None, axis=1, **_kw):
            qf = np.asarray(q).astype(np.float64)
            s = _bshape(s, qf, axis)
            zz = 0.0 if z is None else _bshape(np.asarray(z).astype(np.float64), qf, axis)
            y = (qf - zz) * s  # <= 32 + 24 bits: exact for int8 / fp8 operands
            if dq == "fp32":
                y = rnd(y, "fp32")
            return (y,)

        extra = [type("QuantizeLinear", (OpRun,), {"op_domain": "", "_run": q_run}),
                 type("DequantizeLinear", (OpRun,), {"op_domain": "", "_run": dq_run})]
        return ReferenceEvaluator(self.model, new_ops=_op_classes(prog, self.const) + extra)
