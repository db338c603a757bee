"""One differential box (kcverify.boxes.DiffBox) for the engine, the planner, certificates, the
checker and the fake test engine: NaN handling, containment, linf and JSON defined once."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest

from kcverify.boxes import DiffBox
from kcverify.errors import CertificateError


def box(lo: float, hi: float, n: int = 2) -> DiffBox:
    a = np.full((1, n), lo)
    b = np.full((1, n), hi)
    return DiffBox(a, b, a, b, a, b)


def test_every_box_type_is_this_one() -> None:
    from kcverify.certs.records import StoredBox
    from kcverify.certs.testing import FakeBox

    assert StoredBox is DiffBox and FakeBox is DiffBox
    bounds = pytest.importorskip("kcverify.bounds")
    assert issubclass(bounds.DiffBox, DiffBox)  # plus the conversion to the torch Box
    p = bounds.DiffBox.point(np.ones((1, 3)))
    assert type(p) is bounds.DiffBox and DiffBox.of(p) is p


def test_nan_widens_at_construction_and_is_never_contained() -> None:
    nan = np.array([[math.nan, 1.0]])
    d = DiffBox(nan, nan, nan, nan, nan, nan)
    assert d.train_lo.tolist() == [[-math.inf, 1.0]] and d.drift_hi.tolist() == [[math.inf, 1.0]]
    assert d.contains(box(0.5, 1.0)) is False  # 1.0 is the only value at index 1
    assert box(-2, 2).contains(box(-1, 1)) and not box(-1, 1).contains(box(-2, 2))

    @dataclass
    class Raw:  # a duck-typed box that did not go through the constructor
        train_lo: np.ndarray
        train_hi: np.ndarray
        inf_lo: np.ndarray
        inf_hi: np.ndarray
        drift_lo: np.ndarray
        drift_hi: np.ndarray

    z = np.zeros((1, 2))
    raw = Raw(z, z, z, z, np.array([[0.0, math.nan]]), z)
    assert not box(-math.inf, math.inf).contains(raw)  # NaN is not in even the whole line
    assert box(-1, 1).contains(Raw(z, z, z, z, z, z))
    assert not box(-1, 1, n=3).contains(box(0, 0))  # shapes must agree


def test_contains_reads_torch_tensors() -> None:
    torch = pytest.importorskip("torch")
    t = torch.zeros((1, 2), dtype=torch.float32)

    @dataclass
    class T:
        train_lo: object = t
        train_hi: object = t
        inf_lo: object = t
        inf_hi: object = t
        drift_lo: object = t
        drift_hi: object = t

    assert box(-1, 1).contains(T()) and not box(0.5, 1).contains(T())


def test_linf() -> None:
    d = DiffBox(*[np.zeros((2, 3))] * 4, np.array([[-0.5, 0, 0], [0, 0, -0.25]]),
                np.array([[0.25, 0, 0], [0, 0.125, 0]]))
    assert d.linf().tolist() == [0.5, 0.25] and d.linf_drift().tolist() == [0.5, 0.25]
    assert DiffBox.point(np.float64(3.0)).linf().tolist() == [0.0]


def test_json_is_exact_and_validated() -> None:
    rng = np.random.default_rng(0)
    lo = rng.normal(size=(2, 3))
    d = DiffBox(lo, lo + 1, lo - 2.0**-60, lo + math.inf, lo * 0 - 1e-300, lo * 0 + 5e-324)
    enc = d.to_json()
    back = DiffBox.from_json(enc)
    assert all(np.array_equal(a, b) for a, b in zip(back.arrays(), d.arrays()))
    assert back.contains(d) and d.contains(back)
    enc2 = dict(enc, train_hi=enc["train_lo"], train_lo=enc["train_hi"])
    with pytest.raises(CertificateError, match="train_lo > train_hi"):
        DiffBox.from_json(enc2, "x")
    with pytest.raises(CertificateError, match="x: box lacks drift_hi"):
        DiffBox.from_json({k: v for k, v in enc.items() if k != "drift_hi"}, "x")
