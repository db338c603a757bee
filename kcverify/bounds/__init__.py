"""Sound differential bounds on the drift between two kernels of one model (semantics §1.1, 5, 6).

    from kcverify.bounds import certify_drift, bound_block, Region, DiffBox
"""

from __future__ import annotations

from kcverify.bounds.box import Box, Concrete, DiffBox
from kcverify.bounds.engine import (
    BlockRecord,
    DriftResult,
    Region,
    blocks_of,
    bound_block,
    certify_drift,
    check_rules,
)
from kcverify.bounds.registry import Interval, bound_rule

__all__ = [
    "BlockRecord", "Box", "Concrete", "DiffBox", "DriftResult", "Interval", "Region",
    "blocks_of", "bound_block", "bound_rule", "certify_drift", "check_rules",
]
