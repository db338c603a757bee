"""Certificates: the in-toto statement, composition rules, the checker, and attachment.

Importing this package stays light (numpy, stdlib): torch and the bound engine are imported only
when a block is re-checked, onnx only to read or write an embedded certificate.
"""

from __future__ import annotations

from kcverify.certs.rules import RULES, Rule, RuleContext, RuleError, get_rule, register_rule
from kcverify.certs.statement import (
    CertificateBuilder,
    kernel_spec_digest,
    read_certificate,
    validate_statement,
    write_certificate,
)

__all__ = ["RULES", "CertificateBuilder", "Rule", "RuleContext", "RuleError", "get_rule",
           "kernel_spec_digest", "read_certificate", "register_rule", "validate_statement",
           "write_certificate"]

import kcverify.certs.cases_rule  # noqa: E402,F401  (registers "case-split"; torch when used)
import kcverify.certs.smt_rule  # noqa: E402,F401  (registers "smt-block"; z3 loads only when used)
import kcverify.certs.split_rule  # noqa: E402,F401  (registers "split-cover"; torch when used)
