"""A NaN from a rule (inf - inf) never reaches a certificate: it widens to the whole line."""

from __future__ import annotations

import numpy as np

from kcverify.bounds.box import DiffBox


def test_nan_widens_to_infinity() -> None:
    nan = np.array([np.nan, 1.0])
    d = DiffBox(nan, nan, nan, nan, nan, nan)
    for lo in (d.train_lo, d.inf_lo, d.drift_lo):
        assert lo.tolist() == [-np.inf, 1.0]
    for hi in (d.train_hi, d.inf_hi, d.drift_hi):
        assert hi.tolist() == [np.inf, 1.0]
