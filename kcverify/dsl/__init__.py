"""The contract DSL: YAML container, first-order clause expressions, typed contract model.

    contract = load_contract("contract.yaml")     # ContractError (file:line:col) on bad input
    contract.kernels["inf"]                        # KernelSpec (semantics §1.1)
    for clause in contract.clauses:
        clause.klass, clause.text                  # certifiable | empirical | static; normal form
        numerical_query(clause)                    # the certifiable shape the planner needs

Pure Python: this package never imports torch.
"""

from __future__ import annotations

from kcverify.dsl.analysis import NumericalQuery, numerical_queries, numerical_query
from kcverify.dsl.ast import Expr, to_text
from kcverify.dsl.load import load_contract, parse_contract
from kcverify.dsl.metrics import METRICS, Metric
from kcverify.dsl.model import Clause, Contract, ModelRef, Region, Slice
from kcverify.dsl.parser import parse_expr

__all__ = [
    "METRICS", "Clause", "Contract", "Expr", "Metric", "ModelRef", "NumericalQuery", "Region",
    "Slice", "load_contract", "numerical_queries", "numerical_query", "parse_contract",
    "parse_expr", "to_text",
]
