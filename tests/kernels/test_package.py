"""The kernels package stays importable without torch (the DSL imports its specs)."""

from __future__ import annotations

import subprocess
import sys

import kcverify.kernels as kernels


def test_spec_import_does_not_load_torch() -> None:
    code = ("import sys, kcverify.kernels, kcverify.kernels.spec, kcverify.kernels.formats; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_lazy_exports() -> None:
    from kcverify.kernels.realize import Realization

    assert kernels.Realization is Realization
    try:
        kernels.no_such_thing  # noqa: B018
    except AttributeError as e:
        assert "no_such_thing" in str(e)
    else:  # pragma: no cover
        raise AssertionError("expected AttributeError")
