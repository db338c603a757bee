"""kcverify: formal verification of training-inference kernel contracts.

A kernel contract states how far the inference kernel of a model may drift from its training
kernel at identical weights. kcverify decides each clause formally where it can (sound bound
propagation of the drift, SMT for small blocks), falls back to measured evidence elsewhere, and
writes a certificate that an independent checker re-verifies. See DESIGN section 1 for what a
certificate means.
"""

from __future__ import annotations

__version__ = "0.1.0"

from kcverify.errors import KcverifyError  # noqa: E402

__all__ = ["KcverifyError", "__version__"]
