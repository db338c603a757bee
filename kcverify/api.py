"""The Python API: what the CLI does, as functions that return results instead of printing.

    import kcverify
    contract = kcverify.load_contract("examples/contracts/mlp-fp8.yaml")
    result = kcverify.prove("examples/contracts/mlp-fp8.yaml", "models/mlp_tiny.onnx")
    result.report.clauses[0].verdict, result.exit_code, result.cert_path
    kcverify.check(result.cert_path, "models/mlp_tiny.onnx", "examples/contracts/mlp-fp8.yaml").ok
    kcverify.bound("models/mlp_tiny.onnx", "examples/contracts/mlp-fp8.yaml",
                   "examples/data/mlp_points.npz").linf

Bad input raises ``kcverify.KcverifyError`` (the CLI's exit 2) with the same one-line message the
CLI prints; a bug raises ``kcverify.errors.InternalError``. Every function imports the heavy parts
(torch, onnx) when called, so ``import kcverify`` stays light.

JSON (``dumps``, every ``--json`` output, the report file): strict RFC 8259 JSON. There is no
NaN or infinity in JSON, so the project writes one convention everywhere: an infinite number is
the string ``"inf"`` (``"-inf"`` below), NaN is ``null``. The certificate stores its floats as
``float.hex`` strings, whose infinity is the same ``"inf"``. The JSON Schemas of the report, the
``bound --json`` output and the certificate predicate ship in ``kcverify/schemas`` (``schema``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from kcverify.certs.checker import CheckReport
    from kcverify.dsl import Contract
    from kcverify.planner import ProveResult

PathLike = str | os.PathLike[str]
SCHEMAS = ("report", "bound", "certificate-predicate")


# ---- strict JSON ----------------------------------------------------------------------------

def json_value(obj: Any) -> Any:
    """``obj`` as plain JSON values: numpy scalars and arrays unwrapped, paths as strings,
    +-infinity as the strings ``"inf"`` / ``"-inf"``, NaN as ``None`` (kcverify's one convention
    for the numbers JSON cannot write)."""
    if hasattr(obj, "tolist") and not isinstance(obj, str | bytes):
        obj = obj.tolist()
    elif isinstance(obj, os.PathLike):
        obj = os.fspath(obj)
    if isinstance(obj, float):
        if math.isnan(obj):
            return None
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return obj
    if isinstance(obj, Mapping):
        return {str(k): json_value(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_value(v) for v in obj]
    return obj


def dumps(obj: Any, indent: int | None = 2) -> str:
    """Strict JSON text of ``obj`` (``json_value`` first; sorted keys; ``allow_nan=False``)."""
    return json.dumps(json_value(obj), indent=indent, sort_keys=True, allow_nan=False)


def schema(name: str) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) ``name``: ``report`` (``prove --report`` / ``--json``),
    ``bound`` (``bound --json``) or ``certificate-predicate`` (the certificate's ``predicate``),
    read from the package data in kcverify/schemas."""
    from importlib import resources

    if name not in SCHEMAS:
        raise ValueError(f"no schema {name!r}; kcverify ships {', '.join(SCHEMAS)}")
    text = resources.files("kcverify").joinpath("schemas", f"{name}.schema.json").read_text(
        encoding="utf-8")
    return json.loads(text)


# ---- devices --------------------------------------------------------------------------------

def check_device(device: str, flag: str = "--device") -> str:
    """``device`` as a torch device string, or a KcverifyError (exit 2) naming ``flag``: not a
    device torch knows, not cpu/cuda, or cuda without a CUDA device (a CPU-only torch build)."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        from kcverify.errors import KcverifyError

        raise KcverifyError(f"{flag} {device}: not a device; expected cpu, cuda or cuda:N"
                            ) from None
    from kcverify.errors import KcverifyError

    if dev.type == "cpu":
        return str(dev)
    if dev.type != "cuda":
        raise KcverifyError(f"{flag} {device}: kcverify computes on cpu or cuda, not {dev.type}")
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        raise KcverifyError(f"{flag} {device}: no CUDA device is available (torch "
                            f"{torch.__version__}, {build}); use {flag} cpu")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise KcverifyError(f"{flag} {device}: there are {torch.cuda.device_count()} CUDA "
                            f"device(s), numbered from 0")
    return str(dev)


# ---- the contract ---------------------------------------------------------------------------

def load_contract(path: PathLike) -> Contract:
    """Read, parse and type-check a contract file (``kcverify lint`` without the printing).

    Returns the typed ``kcverify.dsl.Contract``: ``.kernels`` (name -> KernelSpec), ``.slices``,
    ``.clauses`` (each with ``.klass``, ``.text``), ``.name``, ``.version``. Never opens the model
    or the data files the contract names. Raises ``ContractError`` (``file:line:col``)."""
    from kcverify.dsl import load_contract as _load

    return _load(path)


# ---- prove and check ------------------------------------------------------------------------

def prove(contract: PathLike, model: PathLike, *, domain: str = "best", device: str = "cpu",
          realizations: int = 2, confidence: float = 0.95, cert: PathLike | None = None,
          embed: bool = False, write_certificate: bool = True, rules: Sequence[str] = (),
          workers: int | None = None, ray_address: str | None = None,
          progress: Callable[[str], None] | None = None) -> ProveResult:
    """Decide every clause of ``contract`` on the ONNX ``model`` (``kcverify prove``).

    Returns a ``kcverify.planner.ProveResult``: ``.report`` (``kcverify.report.model.Report``,
    one ClauseResult per clause: ``verdict`` proved / refuted / unknown / passed / failed,
    ``bound``, ``threshold``, evidence), ``.statement`` (the certificate, an in-toto Statement),
    ``.cert_path`` (where it was written: ``cert``, default MODEL.kcert.json; the model itself
    with ``embed``; None with ``write_certificate=False``) and ``.exit_code`` (0: no clause
    refuted or failed, 1 otherwise). ``rules`` are modules or .py files registering extra
    composition rules; ``progress`` receives one line per step. ``workers`` (a local Ray with
    that many workers) or ``ray_address`` (an existing Ray cluster) bound the contract's slices
    in parallel (``kcverify[ray]``, kcverify.distributed); the result is the serial one."""
    from kcverify.certs.rules import load_rule_modules
    from kcverify.distributed import executor_for
    from kcverify.planner import ProveOptions
    from kcverify.planner import prove as _prove

    load_rule_modules(list(rules))
    options = ProveOptions(domain=domain, device=check_device(device, "device"),
                           realizations=realizations, confidence=confidence,
                           cert_path=None if cert is None else Path(cert), embed=embed,
                           write_certificate=write_certificate, progress=progress)
    with executor_for(workers, ray_address, options.device) as options.executor:
        return _prove(contract, model, options)


def check(cert: PathLike | Mapping[str, Any], model: PathLike, contract: PathLike, *,
          rules: Sequence[str] = ()) -> CheckReport:
    """Re-check a certificate against the model and contract files (``kcverify check``).

    ``cert`` is the sidecar JSON, an ONNX file that embeds one, or a statement already loaded.
    Returns ``kcverify.certs.checker.CheckReport``: ``.ok``, ``.problems`` (each a sentence;
    empty iff ok), ``.notes`` (what was not or could not be checked), ``.statement``."""
    from kcverify.certs.checker import check_certificate
    from kcverify.certs.rules import load_rule_modules

    load_rule_modules(list(rules))
    source = dict(cert) if isinstance(cert, Mapping) else cert
    return check_certificate(source, model, contract)


# ---- bound ----------------------------------------------------------------------------------

@dataclass
class BoundResult:
    """Certified drift bounds of ``kcverify bound``: ``linf[i]`` bounds max |z_inf - z_train|
    over the model's float outputs for input i (or for every input in the region around it),
    for every pair of programs conforming to the contract's kernels ``train`` and ``inf``.
    ``linf`` may hold +inf (a vacuous bound); ``to_json`` writes it as ``"inf"``."""

    model: str
    contract: str
    domain: str
    linf: np.ndarray
    seconds: float
    region: dict[str, Any] | None = None
    blocks: list[dict[str, str]] = field(default_factory=list)
    # per input: activation casts whose input enclosure straddles a rounding midpoint
    unstable_casts: np.ndarray | None = None
    # the memory budget's decisions (kcverify.bounds.memory): a method replaced by a cheaper one
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The ``bound --json`` object (schema ``bound``), plain JSON values."""
        rows = []
        for k, v in enumerate(self.linf):
            row: dict[str, Any] = {"index": k, "linf": float(v)}
            if self.unstable_casts is not None:
                row["unstable_casts"] = int(self.unstable_casts[k])
            rows.append(row)
        return json_value({
            "model": self.model, "contract": self.contract, "domain": self.domain,
            "region": self.region, "seconds": self.seconds, "blocks": self.blocks,
            "bounds": rows})


def read_inputs(path: PathLike) -> np.ndarray | dict[str, np.ndarray]:
    """A .npy batch (the model's single input) or a .npz mapping input name -> batch; never
    unpickles. InputFileError when missing or unreadable."""
    import numpy as np

    from kcverify.errors import InputFileError

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


def input_chunks(feeds: Any, domain: str) -> list[Any]:
    """The work items of ``bound``: the intervals take the whole batch at once; the relational
    domains bound one input at a time (the zonotope's symbols are shared by the rows of a batch,
    so each input gets the whole memory budget), and those inputs are independent."""
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


def kernels_of(contract_path: PathLike) -> tuple[Any, Any]:
    """The contract's kernels ``train`` and ``inf`` (KcverifyError naming what it has)."""
    from kcverify.errors import KcverifyError

    contract = load_contract(contract_path)
    missing = [k for k in ("train", "inf") if k not in contract.kernels]
    if missing:
        raise KcverifyError(f"{contract_path}: the contract has no kernel {missing[0]!r} "
                            f"(kernels: {', '.join(contract.kernels) or 'none'}); "
                            f"'kcverify bound' needs 'train' and 'inf'")
    return contract.kernels["train"], contract.kernels["inf"]


def bound(model: PathLike, contract: PathLike, inputs: PathLike | Any, *,
          domain: str = "best", device: str = "cpu", eps: float = 0.0, space: str = "input",
          workers: int | None = None, ray_address: str | None = None,
          progress: Callable[[int, int], None] | None = None, cases: int = 0,
          memory: int | None = None, threshold: float | None = None) -> BoundResult:
    """Certified drift bounds between the contract's kernels on each input (``kcverify bound``).

    ``inputs``: a .npy/.npz path, an array (the model's single input) or a mapping input name ->
    batch. ``domain``: interval, linear or best. ``eps > 0`` bounds every input in the L-inf box
    of that radius around each input (``space`` input or embedding). ``progress(done, total)``
    is called with 0 first, then after each work item (relational domains: one input each). ``workers`` /
    ``ray_address`` run the work items on Ray (kcverify.distributed); the bounds are the
    serial ones, in input order. ``cases > 0``: a proof by cases over each input's unstable
    casts, up to that many cases per input, each case bounded with ``domain`` (interval or
    best; kcverify.bounds.cases; point inputs only); ``unstable_casts`` then counts those left
    in the cases; ``progress(cases bounded, cases so far)`` after each case. ``threshold`` (with
    ``cases``): clause-directed, a case at most ``threshold`` is a leaf and one above it is split
    only on the straddles that drive its output elements above it. ``memory``: the
    bound engine's budget in bytes (kcverify.bounds.memory; default half of physical memory);
    its decisions are in ``notes``."""
    import numpy as np

    from kcverify.bounds import Region
    from kcverify.distributed import SerialExecutor, executor_for
    from kcverify.models.ir import load_onnx

    train, inf = kernels_of(contract)
    graph = load_onnx(model)
    feeds = read_inputs(inputs) if isinstance(inputs, str | os.PathLike) else inputs
    device = check_device(device, "device")
    region = Region(space, "linf", eps) if eps > 0 else None
    if cases > 0:
        return _bound_by_cases(model, contract, graph, train, inf, feeds, cases, device, eps,
                               workers or ray_address, domain, threshold, progress)
    if threshold is not None:
        from kcverify.errors import BoundError

        raise BoundError("a threshold directs a proof by cases: give cases > 0 (--cases N)")
    items = [dict(feeds=part, region=region, domain=domain, device=device, memory=memory)
             for part in input_chunks(feeds, domain)]
    finished = 0

    def done(i: int, res: Any) -> None:
        nonlocal finished
        finished += 1
        if progress is not None:
            progress(finished, len(items))

    if progress is not None:
        progress(0, len(items))
    with executor_for(workers, ray_address, device) as ex:
        results = (ex or SerialExecutor()).map_drift(graph, model, train, inf, items, done)
    return BoundResult(
        model=os.fspath(model), contract=os.fspath(contract), domain=domain,
        linf=np.concatenate([r.linf for r in results]),
        unstable_casts=(np.concatenate([r.unstable_casts for r in results])
                        if all(getattr(r, "unstable_casts", None) is not None for r in results)
                        else None),
        seconds=sum(r.seconds for r in results),
        region=None if region is None else {"space": region.space, "norm": region.norm,
                                             "eps": region.eps},
        blocks=[{"name": b.name, "digest": b.digest, "method": b.method}
                for b in results[0].blocks],
        notes=list(dict.fromkeys(n for r in results for n in getattr(r, "notes", []))))


def _bound_by_cases(model: PathLike, contract: PathLike, graph: Any, train: Any, inf: Any,
                    feeds: Any, cases: int, device: str, eps: float, distributed: Any,
                    domain: str = "interval", threshold: float | None = None,
                    progress: Callable[[int, int], None] | None = None) -> BoundResult:

    from kcverify.bounds.cases import certify_cases
    from kcverify.bounds.engine import _as_feeds
    from kcverify.errors import BoundError

    if eps > 0 or distributed:
        raise BoundError("--cases bounds point inputs in one process: drop --eps / --workers")
    if domain not in ("interval", "best"):
        raise BoundError(f"--cases runs each case in the interval or best domain, not {domain!r}")
    if threshold is not None and not (threshold >= 0 and math.isfinite(threshold)):
        raise BoundError(f"--threshold must be a finite number >= 0, not {threshold}")
    res = certify_cases(graph, train, inf, _as_feeds(graph, feeds), max_leaves=cases,
                        device=device, domain=domain, threshold=threshold, progress=progress)
    return BoundResult(model=os.fspath(model), contract=os.fspath(contract), domain=domain,
                       linf=res.linf, unstable_casts=res.unstable_left, seconds=res.seconds,
                       region=None,
                       blocks=[{"name": "model", "digest": graph.digest(),
                                "method": f"cases<={cases}" + (
                                    "" if threshold is None else f",threshold={threshold:g}")}])


__all__ = ["BoundResult", "bound", "check", "check_device", "dumps", "json_value",
           "load_contract", "prove", "read_inputs", "schema"]
