"""A researcher's composition rule, loaded with ``--rules examples/rules/l2_from_linf.py`` by
``kcverify prove``, ``kcverify check`` and ``kcverify registry``: it lets the planner certify
L2 logit-drift clauses (``l2(logits_inf(x) - logits_train(x)) <= c``) from the L-inf drift.

``derives`` tells the planner which DSL quantity (kcverify.dsl NumericalQuery.quantity) the rule
bounds; the planner applies it as ``apply("l2-from-linf", [linf_drift, state])``.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

from kcverify.certs import Rule, RuleContext, RuleError, register_rule
from kcverify.certs.encoding import fx, unfx, up


class L2FromLinf(Rule):
    """‖z_inf(x_i) − z_train(x_i)‖₂ ≤ √n · δ_i, n = the number of entries per element.

    Premises: [linf_drift of tensor t, the state holding t] (the state fixes n, so a certificate
    cannot claim a smaller n). With keep = 2 (per position) n is the size of one position's
    vector; a (batch, classes) tensor has one position per input (as in linf-from-state), so n
    is the number of classes. √n and the product are rounded upward.
    """

    derives = "logit_l2"

    def conclude(self, premises: list[dict[str, Any]], params: dict[str, Any],
                 ctx: RuleContext) -> dict[str, Any]:
        if len(premises) != 2:
            raise RuleError("l2-from-linf takes [linf_drift, state]")
        linf, state = premises
        if linf.get("quantity") != "linf_drift" or state.get("kind") != "state":
            raise RuleError("l2-from-linf takes [linf_drift, state]")
        t = linf["tensor"]
        keep = linf.get("keep", 1)
        box = ctx.box(state["outputs"][t], t)
        axes = keep if len(box.shape) > keep else 1  # (batch, classes): one position per input
        n = math.prod(box.shape[axes:])
        root = math.sqrt(n)  # correctly rounded; step up if below the exact root
        if Fraction(root) ** 2 < n:
            root = math.nextafter(root, math.inf)
        bounds = [up(Fraction(root) * Fraction(unfx(d))) for d in linf["bounds"]]
        out = {"quantity": "l2_drift", "direction": "upper", "tensor": t,
               "bounds": [fx(b) for b in bounds]}
        for key in ("slice", "keep"):
            if key in linf:
                out[key] = linf[key]
        return out


register_rule("l2-from-linf")(L2FromLinf)
