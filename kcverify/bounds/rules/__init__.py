"""Bound rules, one module per op family; each registers its rules with ``@bound_rule``."""
