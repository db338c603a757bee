"""The differential box: one tensor's abstract state, in numpy (no torch import).

``DiffBox(train_lo, train_hi, inf_lo, inf_hi, drift_lo, drift_hi)`` holds six float64 arrays of
one shape (batch first). It claims: for every input in the set and every pair of conforming
programs, the training value lies in [train_lo, train_hi], the inference value in
[inf_lo, inf_hi], and the drift (inference − training) in [drift_lo, drift_hi], elementwise.

This one class is what the bound engine returns (kcverify.bounds.DiffBox adds the conversion
to its torch Box), what the planner passes to certificates, what a certificate stores and what
the checker reads back (kcverify.certs.records).

NaN, defined once:

* **Construction.** A NaN bound carries no information (an inf − inf inside a bound rule): a
  lower end becomes −inf and an upper end +inf, so a box is always a sound, if vacuous,
  enclosure and never holds NaN.
* **Infinities.** The drift of a pair (t, i) is i - t; 0 when both are the same infinity (a
  masked entry: -inf in every program); +-inf for an infinity against a finite value or the
  opposite infinity; NaN where either value is NaN. Construction closes the drift interval
  under what the value intervals admit (``infinite_drift``; semantics §1.1): where both may be
  the same infinity it holds 0, where one may be infinite and the other finite (or the other
  infinity) the matching end is infinite, and where a value interval is (-inf, inf) (it may be
  NaN) the drift is (-inf, inf). A box never claims the drift [inf, inf], which no pair has.
* **Containment.** ``a.contains(b)`` holds iff the shapes agree and, on each of the three pairs,
  a.lo <= b.lo and b.hi <= a.hi everywhere. A comparison with NaN is false, so a NaN in ``b``
  (a duck-typed box that was not built through this class) is never contained, and a box with
  NaN contains nothing.

JSON encoding (``to_json`` / ``from_json``): each array through kcverify.certs.encoding's exact
encoding (base64 of the little-endian float64 bytes, shape, sha256); decoding validates every
array, the common shape and lo <= hi.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

import numpy as np

FIELDS = ("train_lo", "train_hi", "inf_lo", "inf_hi", "drift_lo", "drift_hi")
PAIRS = (("train_lo", "train_hi"), ("inf_lo", "inf_hi"), ("drift_lo", "drift_hi"))


def as_float64(a: Any) -> np.ndarray:
    """An array (numpy, torch, nested lists) as a float64 numpy array."""
    if hasattr(a, "detach"):  # a torch tensor; no torch import needed
        a = a.detach().cpu().double().numpy()
    return np.asarray(a, dtype=np.float64)


def infinite_drift(train_lo: np.ndarray, train_hi: np.ndarray, inf_lo: np.ndarray,
                   inf_hi: np.ndarray, drift_lo: np.ndarray, drift_hi: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray]:
    """The drift interval closed under the infinite values the two value intervals admit (the
    module doc's "Infinities"; kcverify.bounds.engine.infinite_drift does the same on the
    engine's torch boxes after every node)."""
    vals = (train_lo, train_hi, inf_lo, inf_hi)
    if all(bool(np.all(np.isfinite(v))) for v in vals):
        return drift_lo, drift_hi
    inf = np.inf
    tp, tn, ip, in_ = train_hi == inf, train_lo == -inf, inf_hi == inf, inf_lo == -inf
    tf = (train_hi > -inf) & (train_lo < inf)  # the interval holds a finite value
    if_ = (inf_hi > -inf) & (inf_lo < inf)
    nan = (tp & tn) | (ip & in_)  # (-inf, inf): the value may be NaN
    same = (tp & ip) | (tn & in_)
    up = nan | (ip & (tf | tn)) | (tn & (if_ | ip))
    down = nan | (tp & (if_ | in_)) | (in_ & (tf | tp))
    lo = np.where(down, -inf, np.where(same, np.minimum(drift_lo, 0.0), drift_lo))
    hi = np.where(up, inf, np.where(same, np.maximum(drift_hi, 0.0), drift_hi))
    return lo, hi


@dataclass
class DiffBox:
    """Six float64 arrays of one tensor's shape: the train, inference and drift intervals."""

    train_lo: np.ndarray
    train_hi: np.ndarray
    inf_lo: np.ndarray
    inf_hi: np.ndarray
    drift_lo: np.ndarray
    drift_hi: np.ndarray

    def __post_init__(self) -> None:
        """Fresh float64 arrays; NaN widens to the whole line, the drift is closed under the
        infinite values (see the module doc)."""
        for lo, hi in PAIRS:
            a, b = as_float64(getattr(self, lo)), as_float64(getattr(self, hi))
            setattr(self, lo, np.where(np.isnan(a), -np.inf, a))
            setattr(self, hi, np.where(np.isnan(b), np.inf, b))
        self.drift_lo, self.drift_hi = infinite_drift(*self.arrays())

    @classmethod
    def of(cls, box: Any) -> Self:
        """Any object with the six arrays (numpy or torch) as this class; itself if it is one."""
        if isinstance(box, cls):
            return box
        try:
            return cls(*(getattr(box, f) for f in FIELDS))
        except AttributeError as e:
            raise TypeError(f"not a differential box ({e})") from None

    @classmethod
    def point(cls, x: Any) -> Self:
        """The same exact value in both kernels, zero drift."""
        x = as_float64(x)
        z = np.zeros_like(x)
        return cls(x, x, x, x, z, z)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.train_lo.shape)

    def arrays(self) -> tuple[np.ndarray, ...]:
        """The six arrays in FIELDS order."""
        return tuple(getattr(self, f) for f in FIELDS)

    def contains(self, other: Any) -> bool:
        """other ⊆ self on all three pairs; shapes must agree; NaN is never contained."""
        for lo_name, hi_name in PAIRS:
            lo, hi = getattr(self, lo_name), getattr(self, hi_name)
            olo, ohi = as_float64(getattr(other, lo_name)), as_float64(getattr(other, hi_name))
            if lo.shape != olo.shape or hi.shape != ohi.shape:
                return False
            if not (bool(np.all(lo <= olo)) and bool(np.all(ohi <= hi))):
                return False
        return True

    def linf(self) -> np.ndarray:
        """Per sample (axis 0): max over the other axes of max(|drift_lo|, |drift_hi|) — the
        certified max |inf − train|. Exact (abs and max do not round)."""
        mag = np.maximum(np.abs(self.drift_lo), np.abs(self.drift_hi))
        if mag.ndim == 0:
            return mag.reshape(1)
        return mag.reshape(mag.shape[0], -1).max(axis=1) if mag.size else np.zeros(mag.shape[0])

    linf_drift = linf

    def to_json(self) -> dict[str, Any]:
        """{field: encoded array} with kcverify.certs.encoding's exact array encoding."""
        from kcverify.certs.encoding import encode_array

        return {f: encode_array(getattr(self, f)) for f in FIELDS}

    @classmethod
    def from_json(cls, obj: Any, where: str = "box") -> Self:
        """Inverse of to_json; CertificateError names what is wrong (a missing or malformed
        array, arrays of different shapes, lo > hi)."""
        from kcverify.certs.encoding import decode_array
        from kcverify.errors import CertificateError

        if not isinstance(obj, Mapping):
            raise CertificateError(f"{where}: expected a box with {', '.join(FIELDS)}")
        missing = [f for f in FIELDS if f not in obj]
        if missing:
            raise CertificateError(f"{where}: box lacks {', '.join(missing)}")
        arrays = {f: decode_array(obj[f], f"{where}.{f}") for f in FIELDS}
        if len({a.shape for a in arrays.values()}) != 1:
            raise CertificateError(f"{where}: the box's arrays differ in shape")
        for lo, hi in PAIRS:
            if not bool(np.all(arrays[lo] <= arrays[hi])):
                raise CertificateError(f"{where}: {lo} > {hi} somewhere")
        return cls(**arrays)

    # the names the bound engine used for its JSON form
    to_plain = to_json

    @classmethod
    def from_plain(cls, obj: Any) -> Self:
        return cls.from_json(obj)
