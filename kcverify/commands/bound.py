"""`kcverify bound MODEL CONTRACT --inputs FILE [--domain D] [--device cpu|cuda] [--json]`:
certified drift bounds between the contract's kernels ``train`` and ``inf``, one per input."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import numpy as np

from kcverify.errors import InputFileError, KcverifyError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bound", help="certified drift bounds between the contract's two kernels",
                       description="Bound max |z_inf - z_train| over the model's output for each "
                                   "input, for every pair of programs conforming to the "
                                   "contract's kernels 'train' and 'inf'.")
    p.add_argument("model", help="the ONNX model")
    p.add_argument("contract", help="the contract YAML file (its kernels 'train' and 'inf')")
    p.add_argument("--inputs", required=True,
                   help=".npy (a batch for the model's single input) or .npz keyed by input name")
    p.add_argument("--domain", default="best", choices=["interval", "linear", "best"],
                   help="abstract domain (default: best)")
    p.add_argument("--device", default="cpu", help="torch device for the bound computation")
    p.add_argument("--eps", type=float, default=0.0,
                   help="bound over a box (L-inf ball) of this radius around each input")
    p.add_argument("--space", default="input", choices=["input", "embedding"],
                   help="where the --eps box lives (token models: embedding)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def read_inputs(path: str) -> np.ndarray | dict[str, np.ndarray]:
    """A .npy batch or a .npz mapping input name -> batch (never pickles)."""
    if not os.path.exists(path):
        raise InputFileError(f"{path}: no such inputs file")
    try:
        data = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise InputFileError(f"{path}: not a readable .npy/.npz file ({e})") from None
    if isinstance(data, np.ndarray):
        return data
    with data:
        return {k: np.asarray(data[k]) for k in data.files}


def _chunks(feeds: Any, domain: str) -> list[Any]:
    """The zonotope's symbols are shared by the rows of a batch, so the relational domains bound
    one input at a time (each gets the whole memory budget); the intervals take the batch."""
    if domain == "interval":
        return [feeds]
    arrays = feeds if isinstance(feeds, dict) else {"": feeds}
    n = {a.shape[0] if a.ndim else 1 for a in arrays.values()}
    if len(n) != 1 or next(iter(n)) <= 1:
        return [feeds]
    rows = next(iter(n))
    if isinstance(feeds, dict):
        return [{k: v[i:i + 1] for k, v in feeds.items()} for i in range(rows)]
    return [feeds[i:i + 1] for i in range(rows)]


def load_kernels(contract_path: str) -> tuple[Any, Any]:
    """The contract's kernels 'train' and 'inf'."""
    from kcverify.dsl import load_contract

    contract = load_contract(contract_path)
    missing = [k for k in ("train", "inf") if k not in contract.kernels]
    if missing:
        raise KcverifyError(f"{contract_path}: the contract has no kernel {missing[0]!r} "
                            f"(kernels: {', '.join(contract.kernels) or 'none'}); "
                            f"'kcverify bound' needs 'train' and 'inf'")
    return contract.kernels["train"], contract.kernels["inf"]


def run(args: argparse.Namespace) -> int:
    from kcverify.bounds import Region, certify_drift
    from kcverify.models.ir import load_onnx

    train, inf = load_kernels(args.contract)
    graph = load_onnx(args.model)
    feeds = read_inputs(args.inputs)
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise KcverifyError(f"--device {args.device}: no CUDA device is available")
    region = Region(args.space, "linf", args.eps) if args.eps > 0 else None
    chunks = _chunks(feeds, args.domain)
    results = []
    for j, part in enumerate(chunks):
        if len(chunks) > 1:
            sys.stderr.write(f"kcverify bound: input {j + 1}/{len(chunks)}\n")
        results.append(certify_drift(graph, train, inf, part, region=region, domain=args.domain,
                                     device=args.device))
    res = results[0]
    linf = np.concatenate([r.linf for r in results])
    seconds = sum(r.seconds for r in results)
    bounds = [{"index": k, "linf": float(v)} for k, v in enumerate(linf)]
    if args.json:
        out = {"model": args.model, "contract": args.contract, "domain": args.domain,
               "region": None if region is None else {"space": region.space, "norm": region.norm,
                                                      "eps": region.eps},
               "seconds": seconds, "bounds": bounds,
               "blocks": [{"name": b.name, "digest": b.digest, "method": b.method}
                          for b in res.blocks]}
        print(json.dumps(out, indent=2, sort_keys=True, allow_nan=True))
        return 0
    w = sys.stdout.write
    w(f"{args.model}: certified drift bounds (kernels train -> inf, domain {args.domain}, "
      f"{len(res.blocks)} blocks, {seconds:.2f} s)\n")
    for b in bounds:
        w(f"  input {b['index']:>4}  linf <= {b['linf']:.6g}\n")
    return 0
