"""The model registry: admission gate (checker + hard clauses), SQLite store, content-addressed
blobs, decision log. See kcverify.registry.store."""

from __future__ import annotations

from kcverify.registry.store import ENV, Decision, Registry, VerifyResult, default_root

__all__ = ["ENV", "Decision", "Registry", "VerifyResult", "default_root"]
