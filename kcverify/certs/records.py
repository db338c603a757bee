"""Block certificates as stored in a certificate: (in_state -> out_state) over named tensors.

A state maps tensor names to differential boxes (kcverify.boxes.DiffBox: float64 arrays
(batch, ...) ``train_lo/hi`` and ``inf_lo/hi`` (the value sets of each kernel) and ``drift_lo/hi``
(z_inf - z_train)). A block certificate claims: for every conforming pair of programs and every
input in in_state, the block's outputs lie in out_state. The box class is numpy-only, so reading
and checking a certificate needs no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kcverify.boxes import FIELDS as BOX_FIELDS
from kcverify.boxes import DiffBox
from kcverify.errors import CertificateError

StoredBox = DiffBox  # the name the checker's modules use for a box read from a certificate

__all__ = ["BOX_FIELDS", "BlockData", "StoredBox", "decode_block", "decode_box", "decode_state",
           "encode_block", "encode_box", "encode_state"]


def encode_box(box: Any) -> dict[str, Any]:
    """Encode any object with the six DiffBox arrays (numpy or torch)."""
    try:
        return DiffBox.of(box).to_json()
    except TypeError as e:
        raise CertificateError(f"cannot encode a state box: {e}") from None


def decode_box(obj: Any, where: str) -> DiffBox:
    return DiffBox.from_json(obj, where)


def encode_state(state: Mapping[str, Any]) -> dict[str, Any]:
    return {str(name): encode_box(box) for name, box in state.items()}


def decode_state(obj: Any, where: str) -> dict[str, DiffBox]:
    if not isinstance(obj, Mapping):
        raise CertificateError(f"{where}: expected a mapping from tensor names to boxes")
    return {str(k): decode_box(v, f"{where}[{k!r}]") for k, v in obj.items()}


@dataclass
class BlockData:
    """One block certificate: ``ref`` is its key in predicate.blocks."""

    ref: str
    name: str
    digest: str
    method: str
    in_state: dict[str, DiffBox]
    out_state: dict[str, DiffBox]
    extra: dict[str, Any] = field(default_factory=dict)


def encode_block(record: Any) -> dict[str, Any]:
    """A bound-engine BlockRecord(name, digest, method, in_state, out_state) (or a mapping) as JSON."""
    get = (lambda k: record[k]) if isinstance(record, Mapping) else (lambda k: getattr(record, k))
    try:
        name, digest, method = str(get("name")), str(get("digest")), str(get("method"))
        in_state, out_state = get("in_state"), get("out_state")
    except (KeyError, AttributeError) as e:
        raise CertificateError(f"block record lacks {e}") from None
    out: dict[str, Any] = {"name": name, "digest": digest, "method": method,
                           "in_state": encode_state(in_state), "out_state": encode_state(out_state)}
    domain = record.get("domain") if isinstance(record, Mapping) else getattr(record, "domain", None)
    if domain is not None:
        out["domain"] = str(domain)
    return out


def decode_block(ref: str, obj: Any) -> BlockData:
    where = f"predicate.blocks[{ref!r}]"
    if not isinstance(obj, Mapping):
        raise CertificateError(f"{where}: expected an object")
    for key in ("name", "digest", "method", "in_state", "out_state"):
        if key not in obj:
            raise CertificateError(f"{where}: lacks {key!r}")
    for key in ("name", "digest", "method"):
        if not isinstance(obj[key], str):
            raise CertificateError(f"{where}.{key}: expected a string")
    extra = {k: v for k, v in obj.items()
             if k not in ("name", "digest", "method", "in_state", "out_state")}
    return BlockData(ref, obj["name"], obj["digest"], obj["method"],
                     decode_state(obj["in_state"], f"{where}.in_state"),
                     decode_state(obj["out_state"], f"{where}.out_state"), extra)
