"""Exact JSON encodings for what a checker re-verifies: floats as ``float.hex`` strings, float64
arrays as base64 of their little-endian bytes with a sha256, and outward-rounded arithmetic.

Outward rounding: ``up(q)`` is the least float >= the exact rational q and ``down(q)`` the
greatest float <= q; ``exp_up``/``log_up``/... widen libm's (faithful, not correctly rounded)
results by two ulps so that the returned float bounds the exact value in the stated direction.
"""

from __future__ import annotations

import base64
import hashlib
import math
from fractions import Fraction
from typing import Any

import numpy as np

from kcverify.errors import CertificateError

INF = math.inf


# ---- floats -------------------------------------------------------------------------------

def fx(value: float) -> str:
    """Encode a float exactly (``float.hex``); NaN is refused."""
    v = float(value)
    if math.isnan(v):
        raise CertificateError("refusing to encode NaN in a certificate")
    return v.hex()


def unfx(value: Any, where: str = "value") -> float:
    """Decode a ``float.hex`` string (plain JSON numbers are accepted as exact binary floats)."""
    if isinstance(value, bool):
        raise CertificateError(f"{where}: expected a float (hex string), got a boolean")
    if isinstance(value, int | float):
        v = float(value)
    elif isinstance(value, str):
        try:
            v = float.fromhex(value)
        except ValueError:
            raise CertificateError(f"{where}: {value!r} is not a float.hex string") from None
    else:
        raise CertificateError(f"{where}: expected a float (hex string), got {type(value).__name__}")
    if math.isnan(v):
        raise CertificateError(f"{where}: NaN is not a bound")
    return v


def fx_list(values: Any) -> list[str]:
    return [fx(v) for v in np.asarray(values, dtype=np.float64).reshape(-1).tolist()]


def unfx_list(values: Any, where: str = "values") -> list[float]:
    if not isinstance(values, list):
        raise CertificateError(f"{where}: expected a list of floats")
    return [unfx(v, f"{where}[{i}]") for i, v in enumerate(values)]


# ---- outward rounding -----------------------------------------------------------------------

def up(q: Fraction | int | float) -> float:
    """Least float >= q (q exact; an infinite float is returned as it is)."""
    if isinstance(q, float):
        return q
    q = Fraction(q)
    try:
        f = float(q)
    except OverflowError:
        return INF if q > 0 else -math.nextafter(INF, 0.0)
    if Fraction(f) < q:
        f = math.nextafter(f, INF)
    return f


def down(q: Fraction | int | float) -> float:
    """Greatest float <= q (q exact)."""
    if isinstance(q, float):
        return q
    return -up(-Fraction(q))


def _widen_up(f: float, n: int = 2) -> float:
    for _ in range(n):
        f = math.nextafter(f, INF)
    return f


def _widen_down(f: float, n: int = 2) -> float:
    for _ in range(n):
        f = math.nextafter(f, -INF)
    return f


def exp_up(x: float) -> float:
    """A float >= e^x."""
    try:
        return _widen_up(math.exp(x))
    except OverflowError:
        return INF


def exp_down(x: float) -> float:
    """A float in [0, e^x]."""
    try:
        return max(0.0, _widen_down(math.exp(x)))
    except OverflowError:
        return math.nextafter(INF, 0.0)


def log_up(x: float) -> float:
    """A float >= log x (x > 0)."""
    if math.isinf(x):
        return INF
    return _widen_up(math.log(x))


def cosh_up(x: float) -> float:
    try:
        return _widen_up(math.cosh(x))
    except OverflowError:
        return INF


def tanh_up(x: float) -> float:
    """A float >= tanh x, never above 1."""
    return min(1.0, _widen_up(math.tanh(x)))


# ---- arrays ---------------------------------------------------------------------------------

def encode_array(a: Any) -> dict[str, Any]:
    """{"dtype": "float64", "shape", "b64": little-endian bytes, "sha256" of those bytes}."""
    if hasattr(a, "detach"):  # a torch tensor; no torch import needed
        a = a.detach().cpu().double().numpy()
    arr = np.ascontiguousarray(np.asarray(a, dtype="<f8"))
    raw = arr.tobytes()
    return {"dtype": "float64", "shape": list(arr.shape),
            "b64": base64.b64encode(raw).decode("ascii"),
            "sha256": hashlib.sha256(raw).hexdigest()}


def decode_array(obj: Any, where: str = "array") -> np.ndarray:
    """Inverse of encode_array, validating dtype, shape, size and digest."""
    if not isinstance(obj, dict):
        raise CertificateError(f"{where}: expected an encoded array object")
    for key in ("dtype", "shape", "b64", "sha256"):
        if key not in obj:
            raise CertificateError(f"{where}: encoded array lacks {key!r}")
    if obj["dtype"] != "float64":
        raise CertificateError(f"{where}: dtype must be 'float64', not {obj['dtype']!r}")
    shape = obj["shape"]
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool)
                                              and d >= 0 for d in shape):
        raise CertificateError(f"{where}: shape must be a list of non-negative integers")
    try:
        raw = base64.b64decode(obj["b64"], validate=True)
    except (ValueError, TypeError):
        raise CertificateError(f"{where}: b64 is not valid base64") from None
    if hashlib.sha256(raw).hexdigest() != obj["sha256"]:
        raise CertificateError(f"{where}: sha256 of the array bytes does not match")
    n = math.prod(shape)
    if len(raw) != 8 * n:
        raise CertificateError(f"{where}: {len(raw)} bytes do not hold shape {shape} of float64")
    arr = np.frombuffer(raw, dtype="<f8").reshape(shape).astype(np.float64)
    if np.isnan(arr).any():
        raise CertificateError(f"{where}: array holds NaN")
    return arr
