"""The example certificates in certs/ re-check against the shipped models and contracts.

Regenerate them (after a change to the bound engine or the certificate format) with
``KCVERIFY_REGEN=1 python -m pytest tests/test_example_certs.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kcverify.cli import main

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = [
    ("certs/mlp-fp8.kcert.json", "models/mlp_tiny.onnx", "examples/contracts/mlp-fp8.yaml"),
]


@pytest.mark.parametrize(("cert", "model", "contract"), EXAMPLES)
def test_example_certificate_checks(cert: str, model: str, contract: str) -> None:
    cert_p, model_p, contract_p = (str(ROOT / p) for p in (cert, model, contract))
    if os.environ.get("KCVERIFY_REGEN"):
        assert main(["prove", contract_p, model_p, "--cert", cert_p, "--quiet"]) == 0
    assert main(["check", cert_p, model_p, contract_p]) == 0
