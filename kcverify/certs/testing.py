"""A small fake bound engine and example certificate, for tests of certificates and the registry.

The fake model is two affine blocks, x --b0--> h --b1--> logits (y = x @ W). Its "bound method"
``fake-affine`` pushes a differential box through y = x @ W by center/radius interval arithmetic
and adds ``eps`` of kernel error to the inference side; ``FakeEngine.recheck`` re-runs it (through
the same adapter the real engine uses, kcverify.certs.recheck.recheck_with). Not sound for any
real kernel: it only gives certificates whose pieces can be re-checked and tampered with.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kcverify.boxes import DiffBox
from kcverify.certs.recheck import recheck_with
from kcverify.certs.records import BlockData
from kcverify.certs.rules import RuleError
from kcverify.certs.statement import CertificateBuilder

CONTRACT_TEXT = """\
contract: fake-contract
version: 1.0.0
model: {onnx: model.onnx}
kernels:
  train: {compute: fp32, accumulate: fp32}
  inf: {compute: bf16, accumulate: fp32}
slices:
  all: {inputs: data.npz}
clauses:
  - {id: N-1, family: numerical, assert: "forall x in all: linf(logits_inf(x) - logits_train(x)) <= 0.5", level: L2, action: guard}
  - {id: N-LP, family: numerical, assert: "forall x in all: forall t: abs(logprob_inf(x, t) - logprob_train(x, t)) <= 1.0", level: L2, action: guard}
  - {id: N-RLHF-1, family: numerical, assert: "forall x in all: forall t: abs(ratio(x, t) - 1) <= 0.2", level: L3, action: fallback}
  - {id: N-TV, family: numerical, assert: "forall x in all: tv(x) <= 0.05", level: L2, action: guard}
  - {id: N-KL, family: numerical, assert: "forall x in all: kl(x) <= 0.01", level: L2, action: guard}
  - {id: S-TOP1, family: numerical, assert: "mean(x in all: top1_agree(x)) >= 0.5", level: L2, action: guard}
  - {id: S-1, family: statistical, metric: top1_overlap, slices: [all], threshold: 0.99, budget: 0.01, level: L2, action: guard}
"""

SLICES = {"all": "data.npz"}  # the contract's slices and their data files (relative to it)
TRAIN = {"compute": "fp32", "accumulate": "fp32"}
INF = {"compute": "bf16", "accumulate": "fp32"}


FakeBox = DiffBox  # the fake engine's states are ordinary boxes


@dataclass
class FakeBlock:
    name: str
    inp: str
    out: str
    w: np.ndarray
    eps: float

    @property
    def digest(self) -> str:
        h = hashlib.sha256(f"{self.name}:{self.inp}->{self.out}:{self.eps!r}".encode())
        h.update(np.ascontiguousarray(self.w, "<f8").tobytes())
        return h.hexdigest()


def _affine(lo: np.ndarray, hi: np.ndarray, w: np.ndarray, pad: float) -> tuple[np.ndarray, np.ndarray]:
    c, r = (lo + hi) / 2, (hi - lo) / 2
    oc, orad = c @ w, r @ np.abs(w)
    return np.nextafter(oc - orad - pad, -np.inf), np.nextafter(oc + orad + pad, np.inf)


def fake_bound(block: FakeBlock, box: Any) -> FakeBox:
    tl, th = _affine(box.train_lo, box.train_hi, block.w, 1e-12)
    il, ih = _affine(box.inf_lo, box.inf_hi, block.w, block.eps)
    dl, dh = _affine(box.drift_lo, box.drift_hi, block.w, block.eps)
    return FakeBox(tl, th, il, ih, dl, dh)


@dataclass
class FakeRecord:
    name: str
    digest: str
    method: str
    in_state: dict[str, Any]
    out_state: dict[str, Any]


class FakeEngine:
    """Two affine blocks; ``certify(x)`` returns block records, ``recheck`` re-runs one."""

    def __init__(self, seed: int = 0, eps: float = 1e-3, n_in: int = 4, n_hidden: int = 6,
                 n_out: int = 5) -> None:
        rng = np.random.default_rng(seed)
        self.blocks = [FakeBlock("b0", "x", "h", rng.normal(size=(n_in, n_hidden)) / 2, eps),
                       FakeBlock("b1", "h", "logits", rng.normal(size=(n_hidden, n_out)), eps)]
        self.n_in = n_in

    @property
    def chain(self) -> list[tuple[str, str]]:
        return [(b.name, b.digest) for b in self.blocks]

    def certify(self, x: np.ndarray) -> list[FakeRecord]:
        state: dict[str, Any] = {"x": FakeBox.point(x)}
        records = []
        for b in self.blocks:
            out = fake_bound(b, state[b.inp])
            records.append(FakeRecord(b.name, b.digest, "fake-affine", {b.inp: state[b.inp]},
                                      {b.out: out}))
            state[b.out] = out
        return records

    def bound_block(self, block: FakeBlock, train: Any, inf: Any, in_state: dict[str, Any],
                    domain: str) -> dict[str, Any]:
        if domain != "fake-affine":
            from kcverify.errors import BoundError

            raise BoundError(f"unknown domain {domain!r}")
        return {block.out: fake_bound(block, in_state[block.inp])}

    def recheck(self, record: BlockData) -> list[str]:
        hook = recheck_with(self.bound_block, {b.digest: b for b in self.blocks}, None, None, FakeBox)
        return hook(record)


def write_model(path: Path, engine: FakeEngine) -> Path:
    """An ONNX file of the fake model (x @ W0 @ W1), so digests and embedding are real."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    b0, b1 = engine.blocks
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W0"], ["h"], name="b0"),
         helper.make_node("MatMul", ["h", "W1"], ["logits"], name="b1")],
        "fake", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", engine.n_in])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", b1.w.shape[1]])],
        [numpy_helper.from_array(b0.w.astype(np.float32), "W0"),
         numpy_helper.from_array(b1.w.astype(np.float32), "W1")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def kernel_specs() -> dict[str, Any]:
    from kcverify.kernels.spec import parse_kernel_spec

    return {"train": parse_kernel_spec("train", TRAIN), "inf": parse_kernel_spec("inf", INF)}


def example_certificate(tmp: Path, engine: FakeEngine | None = None, seed: int = 1,
                        batch: int = 3) -> tuple[Path, Path, dict[str, Any], dict[str, Any]]:
    """Write model.onnx, contract.yaml and the slice data data.npz under ``tmp``; return (model,
    contract, specs, statement) with proved clauses through the built-in rules and one soft
    empirical clause; the contract (CONTRACT_TEXT) states exactly these clauses, so the
    DSL-based checks apply too."""
    engine = engine or FakeEngine()
    tmp.mkdir(parents=True, exist_ok=True)
    model = write_model(tmp / "model.onnx", engine)
    contract = tmp / "contract.yaml"
    contract.write_text(CONTRACT_TEXT)
    specs = kernel_specs()
    x = np.random.default_rng(seed).uniform(-1, 1, size=(batch, engine.n_in))
    np.savez(tmp / "data.npz", x=x)  # the slice 'all' (float64: the chain's points exactly)
    b = CertificateBuilder(model, contract, specs, {"name": "fake-contract", "version": "1.0.0"},
                           slices=SLICES, store_input=None)
    refs = [b.add_block(r) for r in engine.certify(x)]
    chain = b.sequential(refs, {"x": FakeBox.point(x)}, ["logits"], slice="all")
    linf = b.apply("linf-from-state", [chain], tensor="logits")

    def prove(cid: str, node: dict[str, Any], tau: float, op: str = "<=") -> None:
        try:
            proof = b.apply("threshold", [node], threshold=tau, op=op)
        except RuleError:
            b.add_clause(cid, "numerical", "unknown", threshold=tau, op=op, method="fake-affine")
            return
        b.add_clause(cid, "numerical", "proved", threshold=tau, method="fake-affine", proof=proof)

    prove("N-1", linf, 0.5)
    prove("N-LP", b.apply("aggregate", [b.apply("logprob-from-linf", [linf], temperature=1.0)],
                          stat="max"), 1.0)
    prove("N-RLHF-1", b.apply("ratio-from-linf", [linf], temperature=1.0), 0.2)
    prove("N-TV", b.apply("tv-from-linf", [linf], temperature=1.0), 0.05)
    prove("N-KL", b.apply("kl-from-linf", [linf], temperature=1.0), 0.01)
    top1 = b.apply("aggregate", [b.apply("top1-from-margin", [linf, chain])], stat="mean")
    prove("S-TOP1", top1, 0.5, ">=")
    b.add_clause("S-1", "statistical", "passed", klass="empirical", threshold=0.99, op=">=", hard=False,
                 method="sampling", evidence={"observed": 1.0, "n": 200, "confidence": 0.99})
    return model, contract, specs, b.build()

