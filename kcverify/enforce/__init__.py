"""Enforcement over logged traces: a contract re-evaluated on what production served.

    traces       the JSONL trace format (trace.schema.json), its validation, a reader that
                 follows a growing file; malformed lines are located errors or counted skips
    clauses      each clause decided on trace records with the empirical metrics, the DSL's
                 quantities, the static checks, and the implicit observability clause O-TRACE
    monitor      per time window: clause values and deviations, the health score H, the action
    promote      the four-stage pipeline ci / shadow / canary / full and its decision record
    replay       a logged request re-run under both kernels; its replay signature checked
    attribution  which known source (quantisation, operators, batch shape, routing) could
                 explain a request's drift, under its certified bound
    plot         the monitor's HTML page: H over time, threshold, action bands (E5)
    synthetic    deterministic traces with an injected kernel fault (E5 in miniature)

docs/enforcement.md describes the format and the semantics. Importing this package does not
import torch; replaying, attributing and generating traces do.
"""

from __future__ import annotations

from kcverify.enforce.monitor import WindowResult, health, monitor
from kcverify.enforce.promote import STAGES, Promotion, PromotionOptions, decide
from kcverify.enforce.traces import TraceError, TraceReader, TraceRecord, read_traces

__all__ = [
    "STAGES", "Promotion", "PromotionOptions", "TraceError", "TraceReader", "TraceRecord",
    "WindowResult", "decide", "health", "monitor", "read_traces",
]
