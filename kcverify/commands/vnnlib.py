"""`kcverify vnnlib MODEL PROPERTY [--contract C --kernel train|inf] [--timeout S] [--out RESULT]`:
decide a VNN-LIB property (VNN-COMP's run_instance convention) for every conforming program.

Prints ``unsat`` (the property holds), ``sat`` and a witness ``((X_0 v) ... (Y_0 v))``,
``unknown`` or ``timeout``, and writes the same to RESULT. Exit 0 for unsat, 1 for any other
answer (not shown to hold), 2 for bad input (a malformed property: ``file:line:col: error:``).
"""

from __future__ import annotations

import argparse
import sys

from kcverify.errors import KcverifyError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("vnnlib", help="decide a VNN-LIB property for every conforming program",
                       description="Decide a VNN-LIB property on an ONNX model for every program "
                                   "conforming to a kernel spec (default: fp32 compute and "
                                   "accumulation in any order). Answers unsat, sat (with a "
                                   "witness checked under a conforming program), unknown or "
                                   "timeout, as VNN-COMP's run_instance does.")
    p.add_argument("model", help="the ONNX model (one input, one output)")
    p.add_argument("property", help="the VNN-LIB file (.vnnlib or .vnnlib.gz)")
    p.add_argument("--contract", help="take the kernel spec from this contract")
    p.add_argument("--kernel", choices=["train", "inf"], default="inf",
                   help="which of the contract's kernels (default: inf)")
    p.add_argument("--timeout", type=float, default=116.0,
                   help="seconds before answering timeout (default: 116, VNN-COMP's)")
    p.add_argument("--out", help="also write the result here (VNN-COMP's RESULT file)")
    p.add_argument("--device", default="cpu", help="torch device for the bounds")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kcverify.api import check_device
    from kcverify.dsl.vnnlib import load_vnnlib
    from kcverify.fileio import atomic_write_text
    from kcverify.regions.verify import verify_vnnlib

    check_device(args.device)
    if not args.timeout > 0:
        raise KcverifyError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    prop = load_vnnlib(args.property)
    spec = None
    if args.contract:
        from kcverify.dsl import load_contract

        contract = load_contract(args.contract)
        if args.kernel not in contract.kernels:
            raise KcverifyError(f"{args.contract}: the contract has no kernel {args.kernel!r} "
                                f"(kernels: {', '.join(contract.kernels) or 'none'})")
        spec = contract.kernels[args.kernel]
    res = verify_vnnlib(args.model, prop, spec, timeout=args.timeout, device=args.device)
    text = res.text()
    if args.out:
        atomic_write_text(args.out, text)
    sys.stdout.write(text)
    kernel = f"{args.contract}: {args.kernel}" if args.contract else "fp32, any order"
    how = f"; witness from {res.witness.program}" if res.witness is not None else ""
    if res.witness is not None and res.witness.ort_violates is not None:
        how += f" (onnxruntime {'also violates' if res.witness.ort_violates else 'does not'})"
    sys.stderr.write(f"kcverify vnnlib: {res.answer} in {res.seconds:.1f}s (kernel {kernel}; "
                     f"{res.method}, {res.parts} parts{how})\n")
    for note in res.notes:
        sys.stderr.write(f"  {note}\n")
    return 0 if res.answer == "unsat" else 1
