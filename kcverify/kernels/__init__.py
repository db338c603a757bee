"""Number formats, kernel specs, exact casts and concrete realizations (semantics §1.1).

    formats   Format, get_format, gamma                 (pure Python: the DSL imports these)
    spec      KernelSpec, CastSpec, Accumulation, parse_kernel_spec   (pure Python)
    scales    ScaleKind, KINDS, kind_of, Unsupported    scale kinds as objects (light import)
    cast      cast_to, cast_grid, round_to_format       exact casts on float64 torch tensors
    scale     weight_scale, activation_scale, quantize_weight, quantize_activation
    realize   Realization, random_realization, run_kernel
    qdq       make_qdq_model, ort_session

Importing this package stays light (no torch): the torch-based names load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "cast_to": "cast", "cast_grid": "cast", "round_to_format": "cast",
    "weight_scale": "scale", "activation_scale": "scale", "quantize_weight": "scale",
    "quantize_activation": "scale",
    "Realization": "realize", "random_realization": "realize", "run_kernel": "realize",
    "make_qdq_model": "qdq",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kcverify.kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kcverify.kernels.{module}"), name)
