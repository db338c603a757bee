"""SMT (z3) for small blocks: exact drift maxima, proofs and replayed counterexamples.

    from kcverify.smt import decide_drift, max_drift, smt_decide_block, NotEncodable

See docs/smt.md for the encoding and its soundness argument.
"""

from __future__ import annotations

from kcverify.smt.decide import MaxDrift, SmtVerdict, decide_drift, max_drift, realized_drift
from kcverify.smt.encode import NotEncodable, encode, prepare
from kcverify.smt.planner import SmtBlockDecision, smt_block_params, smt_decide_block

__all__ = ["MaxDrift", "NotEncodable", "SmtBlockDecision", "SmtVerdict", "decide_drift", "encode",
           "max_drift", "prepare", "realized_drift", "smt_block_params", "smt_decide_block"]
