"""Block certificates as stored in a certificate: (in_state -> out_state) over named tensors.

A state maps tensor names to boxes of the differential domain (kcverify.bounds.DiffBox): float64
arrays (batch, ...) ``train_lo/hi`` and ``inf_lo/hi`` (the value sets of each kernel) and
``drift_lo/hi`` (z_inf - z_train). A block certificate claims: for every conforming pair of programs
and every input in in_state, the block's outputs lie in out_state. Here boxes are plain numpy
(``StoredBox``), so reading and checking a certificate needs no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kcverify.certs.encoding import decode_array, encode_array
from kcverify.errors import CertificateError

BOX_FIELDS = ("train_lo", "train_hi", "inf_lo", "inf_hi", "drift_lo", "drift_hi")


@dataclass
class StoredBox:
    """A DiffBox read back from a certificate: six float64 arrays of one shape."""

    train_lo: np.ndarray
    train_hi: np.ndarray
    inf_lo: np.ndarray
    inf_hi: np.ndarray
    drift_lo: np.ndarray
    drift_hi: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.drift_lo.shape)

    def contains(self, other: Any) -> bool:
        """other ⊆ self on all three pairs (train, inf, drift); shapes must agree."""
        for lo_name, hi_name in (("train_lo", "train_hi"), ("inf_lo", "inf_hi"),
                                 ("drift_lo", "drift_hi")):
            lo, hi = getattr(self, lo_name), getattr(self, hi_name)
            olo, ohi = _np(getattr(other, lo_name)), _np(getattr(other, hi_name))
            if lo.shape != olo.shape or hi.shape != ohi.shape:
                return False
            if not (bool(np.all(lo <= olo)) and bool(np.all(hi >= ohi))):
                return False
        return True

    def linf_drift(self) -> np.ndarray:
        """Per sample (axis 0): max over the other axes of max(|drift_lo|, |drift_hi|). Exact."""
        mag = np.maximum(np.abs(self.drift_lo), np.abs(self.drift_hi))
        if mag.ndim == 0:
            return mag.reshape(1)
        return mag.reshape(mag.shape[0], -1).max(axis=1) if mag.size else np.zeros(mag.shape[0])


def _np(a: Any) -> np.ndarray:
    if hasattr(a, "detach"):
        a = a.detach().cpu().double().numpy()
    return np.asarray(a, dtype=np.float64)


def encode_box(box: Any) -> dict[str, Any]:
    """Encode any object with the six DiffBox arrays (numpy or torch)."""
    try:
        return {f: encode_array(_np(getattr(box, f))) for f in BOX_FIELDS}
    except AttributeError as e:
        raise CertificateError(f"cannot encode a state box: {e}") from None


def decode_box(obj: Any, where: str) -> StoredBox:
    if not isinstance(obj, Mapping):
        raise CertificateError(f"{where}: expected a box with {', '.join(BOX_FIELDS)}")
    missing = [f for f in BOX_FIELDS if f not in obj]
    if missing:
        raise CertificateError(f"{where}: box lacks {', '.join(missing)}")
    arrays = {f: decode_array(obj[f], f"{where}.{f}") for f in BOX_FIELDS}
    shapes = {a.shape for a in arrays.values()}
    if len(shapes) != 1:
        raise CertificateError(f"{where}: the box's arrays differ in shape")
    box = StoredBox(**arrays)
    for lo, hi in (("train_lo", "train_hi"), ("inf_lo", "inf_hi"), ("drift_lo", "drift_hi")):
        if not bool(np.all(arrays[lo] <= arrays[hi])):
            raise CertificateError(f"{where}: {lo} > {hi} somewhere")
    return box


def encode_state(state: Mapping[str, Any]) -> dict[str, Any]:
    return {str(name): encode_box(box) for name, box in state.items()}


def decode_state(obj: Any, where: str) -> dict[str, StoredBox]:
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
    in_state: dict[str, StoredBox]
    out_state: dict[str, StoredBox]
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
