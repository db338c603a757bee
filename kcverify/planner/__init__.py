"""The planner: compiles a contract's clauses into bound queries, SMT, or empirical checks,
maps the results back to verdicts, and assembles the certificate and the report."""

from __future__ import annotations

from kcverify.planner.prove import ProveOptions, ProveResult, prove

__all__ = ["ProveOptions", "ProveResult", "prove"]
