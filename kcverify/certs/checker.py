"""The independent checker: re-verifies a certificate without the original run (semantics §4).

It checks, and reports every failure as one line:
1. the subject digests: the model (its bytes, or its canonical form for embedded certificates),
   each external-data file the model names, the contract's bytes, each slice's data file (every
   slice of the contract must be digested; a file that cannot be read is a problem), and each
   kernel spec's canonical JSON (from the contract);
2. every node of every proof tree: the rule is registered and its application is valid
   (kcverify.certs.rules), including every block certificate, re-run through ``recheck_block``;
3. the chain: sequential nodes leave no tensor unproduced and, when the model's segmentation is
   known, cover exactly its blocks with matching digests;
4. every clause's verdict follows from its proof tree (proved), or carries its evidence
   (refuted: a counterexample; passed/failed: measurements consistent with the threshold);
5. when the contract can be loaded, the certificate lists exactly its clauses, with their
   hardness.

Imports stay light: numpy and the stdlib; onnx only for embedded certificates and the model's
interface; torch and the bound engine only inside the default ``recheck_block``.

Nothing in the trusted path falls back silently: a component of kcverify that fails to import
is an InternalError (a broken installation, exit 3), and a file or model that cannot be read
is a problem, never a note.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kcverify.certs.attach import external_data_files, load_certificate, model_digest
from kcverify.certs.encoding import unfx
from kcverify.certs.records import BlockData, decode_block
from kcverify.certs.rules import RULES, RuleContext
from kcverify.certs.statement import (
    DIGEST_FILE,
    PATH_KEY,
    data_slices,
    kernel_spec_digest,
    sha256_file,
    subjects_of,
)
from kcverify.errors import CertificateError, InputFileError, InternalError, KcverifyError

RecheckBlock = Callable[[BlockData], list[str]]
_CMP = {"<=": lambda b, t: b <= t, "<": lambda b, t: b < t,
        ">=": lambda b, t: b >= t, ">": lambda b, t: b > t}


@dataclass
class CheckReport:
    """ok is True iff ``problems`` is empty; notes say what was not (or could not be) checked."""

    ok: bool
    problems: list[str]
    notes: list[str] = field(default_factory=list)
    statement: dict[str, Any] | None = None


def _component(module: str, what: str, attr: str | None = None) -> Any:
    """Import a kcverify component the checker needs (a module, or ``attr`` of it); failing is
    a broken installation (a bug), never a reason to skip a check."""
    import importlib

    name = f"{module}.{attr}" if attr else module
    try:
        mod = importlib.import_module(module)
        return getattr(mod, attr) if attr else mod
    except (ImportError, AttributeError) as e:
        raise InternalError(f"the checker cannot load {name} ({what}): {e}") from e


def slice_input_region(contract: Any, model_path: str | os.PathLike[str],
                       notes: list[str] | None = None) -> Callable[[str], Mapping[str, Any]]:
    """input_region from the contract's own slice data (kcverify.empirical.slices): each model
    input's raw values as a point, or the box [x − eps, x + eps] (rounded outward) of an
    input-space region (which also encloses an L2 ball). An embedding-space region lies inside
    the graph, so the raw inputs stay points. A data file that cannot be read raises
    CertificateError (the chain over that slice does not check)."""
    import numpy as np

    from kcverify.boxes import DiffBox

    load_slice = _component("kcverify.empirical.slices", "reading slice data", "load_slice")
    load_onnx = _component("kcverify.models.ir", "reading the model's inputs", "load_onnx")
    cache: dict[str, dict[str, Any]] = {}

    def region(name: str) -> Mapping[str, Any]:
        if name in cache:
            return cache[name]
        sl = getattr(contract, "slices", {}).get(name)
        if sl is None:
            raise CertificateError(f"the chain names slice {name!r}, which the contract lacks")
        try:
            data = load_slice(sl, base_dir=Path(contract.path).parent)
            feeds = data.feeds([v.name for v in load_onnx(model_path).inputs])
        except KcverifyError as e:
            raise CertificateError(f"slice {name!r}: its inputs cannot be compared with the "
                                   f"chain's region ({e})") from None
        reg = getattr(sl, "region", None)
        if reg is not None and reg.space != "input" and reg.eps > 0:
            # the region enters inside the first block, which the block re-check does not model
            raise CertificateError(f"slice {name!r}: proofs over an {reg.space}-space region "
                                   "cannot be re-checked yet")
        out: dict[str, Any] = {}
        for k, v in feeds.items():
            x = np.asarray(v, dtype=np.float64)
            lo, hi = x, x
            if reg is not None and reg.space == "input" and reg.eps > 0 and v.dtype.kind == "f":
                lo = np.nextafter(x - reg.eps, -np.inf)
                hi = np.nextafter(x + reg.eps, np.inf)
            z = np.zeros_like(x)
            out[k] = DiffBox(lo, hi, lo, hi, z, z)
        cache[name] = out
        return out

    return region


def _load_contract(contract_path: str | os.PathLike[str]) -> Any:
    return _component("kcverify.dsl", "reading the contract", "load_contract")(contract_path)


def _segmentation(model_path: str | os.PathLike[str], kernel_specs: Mapping[str, Any] | None = None,
                  base_dir: Path | None = None
                  ) -> tuple[list[tuple[str, str]], set[str], list[tuple[str, str]]]:
    """The model's block chain [(name, digest)], its input names and the whole graph as one
    block [(name, digest)] (the other cut a prover may use: the linear domain's); KcverifyError
    when the IR cannot load the model (the caller reports it as a problem)."""
    load_onnx = _component("kcverify.models.ir", "reading the model", "load_onnx")
    segment = _component("kcverify.models.blocks", "segmenting the model into blocks", "segment")
    whole_graph = _component("kcverify.bounds.engine", "cutting the whole graph as one block",
                             "whole_graph")
    graph = load_onnx(model_path)
    inputs = {v.name for v in graph.inputs if v.name not in graph.initializers}
    if kernel_specs is not None and "train" in kernel_specs and "inf" in kernel_specs:
        # an inference kernel given as a QDQ graph: the prover bounded the joint graph
        bound_problem = _component("kcverify.bounds.qdq_graph", "joining a QDQ kernel's graph",
                                   "bound_problem")
        graph = bound_problem(graph, kernel_specs["train"], kernel_specs["inf"], base_dir)[0]
    whole = [(b.name, b.digest) for b in whole_graph(graph)]
    return [(b.name, b.digest) for b in segment(graph)], inputs, whole


def _contract_dir(contract: Any) -> Path | None:
    """The folder a contract's relative paths (a kernel's ``onnx:`` graph) are resolved in."""
    path = getattr(contract, "path", None)
    return None if path is None else Path(path).parent


def _why(e: Exception) -> str:
    return str(e) if isinstance(e, KcverifyError) else f"{type(e).__name__}: {e}"


def _file_problem(path: Path, digest: str, what: str) -> str | None:
    """None when the file at ``path`` has sha256 ``digest``; else what is wrong with it."""
    try:
        have = sha256_file(path)
    except InputFileError as e:
        return f"{what}: {e}"
    if have != digest:
        return (f"{what}: digest mismatch: the certificate is for {digest[:16]}…, {path} is "
                f"{have[:16]}…")
    return None


def _data_problems(stmt: Mapping[str, Any], model_path: str | os.PathLike[str],
                   contract: Any) -> list[str]:
    """The model's external-data files and the contract's slice data files are exactly the
    certificate's model-data and slice subjects, and each file has its digest."""
    problems = []
    stated = {s["annotations"][PATH_KEY]: s["digest"]["sha256"]
              for s in subjects_of(stmt, "model-data")}
    try:
        names = external_data_files(model_path)
    except KcverifyError as e:
        names = None
        problems.append(f"the model's external-data files cannot be listed ({e})")
    if names is not None:
        for loc in sorted(set(stated) | set(names)):
            what = f"model data {loc!r}"
            if loc not in names:
                problems.append(f"{what}: in the certificate, not named by the model")
            elif loc not in stated:
                problems.append(f"{what}: the model's weights in this file are not digested in "
                                "the certificate")
            else:
                problems += filter(None, [_file_problem(Path(model_path).parent / loc,
                                                        stated[loc], what)])
    slices = data_slices(getattr(contract, "slices", None) or {})
    in_cert = {s["name"].removeprefix("slice:"): s for s in subjects_of(stmt, "slice")}
    for name in sorted(set(slices) | set(in_cert)):
        what = f"slice {name!r}"
        if name not in slices:
            problems.append(f"{what}: in the certificate, not a slice with a data file in the "
                            "contract")
            continue
        if name not in in_cert:
            problems.append(f"{what}: its data file is not digested in the certificate")
            continue
        written = slices[name]
        if in_cert[name]["annotations"][PATH_KEY] != written:
            problems.append(f"{what}: the certificate digests "
                            f"{in_cert[name]['annotations'][PATH_KEY]!r}, the contract names "
                            f"{written!r}")
            continue
        p = Path(written)
        path = p if p.is_absolute() else Path(contract.path).parent / p
        problems += filter(None, [_file_problem(path, in_cert[name]["digest"]["sha256"], what)])
    return problems


def check_certificate(cert_or_path: str | os.PathLike[str] | dict[str, Any],
                      model_path: str | os.PathLike[str], contract_path: str | os.PathLike[str],
                      *, recheck_block: RecheckBlock | None = None,
                      kernel_specs: Mapping[str, Any] | None = None,
                      contract: Any = None,
                      expected_chain: list[tuple[str, str]] | None = None,
                      graph_inputs: set[str] | None = None,
                      input_region: Callable[[str], Mapping[str, Any]] | None = None,
                      store_input: Any = "default") -> CheckReport:
    """Re-check a certificate against the model and contract files.

    ``contract`` defaults to what kcverify.dsl.load_contract reads from ``contract_path`` (always
    read: its clauses and slices are checked whether or not ``kernel_specs`` is given);
    ``kernel_specs`` (name -> KernelSpec or canonical mapping) to the contract's;
    ``expected_chain`` and ``graph_inputs`` to the model's segmentation and inputs;
    ``recheck_block`` to the bound engine's adapter (kcverify.certs.recheck);
    ``input_region(slice) -> {input: box}`` to the boxes of the slice's data file (every chain
    must assume a region containing them); ``store_input`` (default: the bound engine's
    input_box) maps raw inputs to stored values. A missing model or contract file (the command's
    own arguments) raises InputFileError; a slice data or external-data file that is missing,
    unreadable or changed is a problem of the report. A component that cannot be imported
    raises InternalError.
    """
    for p, what in ((model_path, "model"), (contract_path, "contract")):
        if not Path(p).is_file():
            raise InputFileError(f"{p}: no such {what} file")
    problems: list[str] = []
    notes: list[str] = []
    try:
        stmt = load_certificate(cert_or_path, model_path)
    except CertificateError as e:
        return CheckReport(False, [str(e)])
    pred = stmt["predicate"]

    # 1. digests
    if contract is None:
        contract = _load_contract(contract_path)
    if kernel_specs is None:
        if hasattr(contract, "kernels"):
            kernel_specs = dict(contract.kernels)
        else:
            problems.append("kernel specs not re-derived: the contract gives none and no "
                            "kernel_specs were given")
    for s in stmt["subject"]:
        role, method = s["annotations"]["kcverify.role"], s["annotations"].get("kcverify.digest")
        want = s["digest"]["sha256"]
        if role == "model":
            try:
                have = model_digest(model_path, method or DIGEST_FILE)
            except CertificateError as e:
                problems.append(str(e))
                continue
            if have != want:
                problems.append(f"model digest mismatch ({method}): the certificate is for "
                                f"{want[:16]}…, {model_path} is {have[:16]}…")
        elif role == "contract":
            have = sha256_file(contract_path)
            if have != want:
                problems.append(f"contract digest mismatch: the certificate is for {want[:16]}…, "
                                f"{contract_path} is {have[:16]}…")
    if kernel_specs is not None:
        stated = {s["name"]: s["digest"]["sha256"] for s in stmt["subject"]
                  if s["annotations"]["kcverify.role"] == "kernel"}
        actual = {f"kernel:{k}": kernel_spec_digest(v) for k, v in kernel_specs.items()}
        for name in sorted(set(stated) | set(actual)):
            if name not in actual:
                problems.append(f"{name}: the certificate names a kernel spec the contract lacks")
            elif name not in stated:
                problems.append(f"{name}: the contract's kernel spec is not in the certificate")
            elif stated[name] != actual[name]:
                problems.append(f"{name}: kernel spec digest mismatch (the spec differs from the "
                                "certified one)")
    problems += _data_problems(stmt, model_path, contract)

    # 5. the contract's clauses
    problems += _compare_contract(contract, pred, _model_outputs(model_path, problems))

    # 2-4. proof trees
    whole_chain: list[tuple[str, str]] | None = None
    if expected_chain is None or graph_inputs is None:
        try:
            chain, inputs, whole_chain = _segmentation(model_path, kernel_specs,
                                                       _contract_dir(contract))
        except InternalError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure to read the model is a problem
            chain, inputs = None, None
            problems.append(f"the model's blocks cannot be re-derived ({_why(e)})")
        expected_chain = expected_chain if expected_chain is not None else chain
        graph_inputs = graph_inputs if graph_inputs is not None else inputs
    if recheck_block is None and kernel_specs is not None:
        default_recheck = _component("kcverify.certs.recheck", "re-running block certificates",
                                     "default_recheck")
        try:
            recheck_block, why = default_recheck(model_path, kernel_specs,
                                                 _contract_dir(contract))
        except KcverifyError as e:  # the model cannot be read: every block check will fail
            recheck_block, why = None, str(e)
        if why:
            notes.append(f"blocks not re-run: {why}")
    if input_region is None and hasattr(contract, "slices"):
        input_region = slice_input_region(contract, model_path, notes)
    if store_input == "default":
        default_store_input = _component("kcverify.certs.recheck", "storing model inputs",
                                         "default_store_input")
        store_input = (default_store_input(model_path, kernel_specs)
                       if kernel_specs is not None else None)
        if store_input is None:
            problems.append("how the kernels store the model inputs was not re-derived (the "
                            "bound engine's input_box is not available for this model and "
                            "contract)")
    ctx = RuleContext(blocks={}, recheck_block=recheck_block, expected_chain=expected_chain,
                      whole_chain=whole_chain,
                      store_input=store_input, kernel_specs=kernel_specs,
                      graph_inputs=graph_inputs, input_region=input_region)
    for ref, raw in pred["blocks"].items():
        ctx.blocks[ref] = decode_block(ref, raw)
    used: set[str] = set()
    for clause in pred["clauses"]:
        problems += _check_clause(clause, ctx, used)
    unused = sorted(set(ctx.blocks) - used)
    if unused:
        notes.append(f"block certificates not used by any proof: {unused}")
    if input_region is None:
        notes.append("chains' input regions not compared with the slices' data (no contract)")
    for c in pred["clauses"]:
        if c["verdict"] == "refuted":
            notes.append(f"clause {c['id']}: counterexample not replayed (stored evidence)")
    return CheckReport(not problems, problems, notes, stmt)


def _compare_contract(contract: Any, pred: Mapping[str, Any],
                      outputs: set[str] | None = None) -> list[str]:
    """The certificate's clauses are the contract's (ids, hardness), and each proved clause's
    proof establishes the clause's numerical queries (kcverify.dsl.numerical_queries)."""
    problems = []
    for key in ("name", "version"):
        have = getattr(contract, key, None)
        if have is not None and str(have) != pred["contract"][key]:
            problems.append(f"contract {key}: the certificate says {pred['contract'][key]!r}, the "
                            f"contract says {have!r}")
    clauses = getattr(contract, "clauses", None)
    if clauses is None:
        return problems
    in_cert = {c["id"]: c for c in pred["clauses"]}
    ids = [getattr(c, "id", None) for c in clauses]
    for cl, cid in zip(clauses, ids):
        if cid not in in_cert:
            problems.append(f"clause {cid}: in the contract, missing from the certificate")
            continue
        hard = getattr(cl, "hard", None)
        if hard is not None and bool(hard) != in_cert[cid]["hard"]:
            problems.append(f"clause {cid}: the certificate marks it hard={in_cert[cid]['hard']}, "
                            f"the contract hard={bool(hard)}")
        c = in_cert[cid]
        if c["verdict"] == "proved" and c.get("proof") is not None:
            problems += [f"clause {cid}: {p}" for p in _proves_queries(cl, c["proof"], outputs)]
    for cid in in_cert:
        if cid not in ids:
            problems.append(f"clause {cid}: in the certificate, not in the contract")
    return problems


# Which conclusion bounds which DSL quantity, its direction, temperature and the statistics that
# bound an aggregate: kcverify.dsl.quantities (the one table the planner and lint read too).


def _model_outputs(model_path: str | os.PathLike[str], problems: list[str]) -> set[str] | None:
    """The tensor the DSL's logits_train / logits_inf name: the model's first float output (None,
    with a problem added, when the model cannot be read)."""
    load_onnx = _component("kcverify.models.ir", "reading the model's outputs", "load_onnx")
    try:
        outs = load_onnx(model_path).outputs
    except InternalError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure to read the model is a problem
        problems.append(f"the model's outputs cannot be read ({_why(e)})")
        return None
    floats = [v.name for v in outs if (v.dtype or "float32").startswith("float")]
    return set(floats[:1])


def _proves_queries(clause: Any, proof: Mapping[str, Any], outputs: set[str] | None) -> list[str]:
    """Problems unless every numerical query of the contract clause is established by a part of
    the proof: same quantity, slice, temperature, a statistic that bounds the query's aggregate,
    and a proved bound that meets the contract's own comparison and threshold."""
    numerical_queries = _component("kcverify.dsl", "matching proofs to clauses",
                                   "numerical_queries")
    queries = numerical_queries(clause)
    if not queries:
        return []
    table = _component("kcverify.dsl.quantities", "the quantity table")
    root = proof.get("conclusion", {})
    parts = root.get("parts", [root]) if isinstance(root, Mapping) else []
    problems = []
    for q in queries:
        entry = table.QUANTITIES.get(q.quantity)
        why = []
        for part in parts:
            w = _part_mismatch(q, entry, part, outputs, table)
            if not w:
                break
            why.append(w)
        else:
            problems.append(f"the proof does not establish '{table.query_text(q)}' "
                            f"({'; '.join(why) or 'no parts'})")
    return problems


def _part_mismatch(q: Any, entry: Any, part: Mapping[str, Any], outputs: set[str] | None,
                   table: Any) -> str | None:
    if entry is None:
        return f"quantity {q.quantity!r} is not in the quantity table"
    if part.get("quantity") != entry.conclusion:
        return f"it bounds {part.get('quantity')!r}, not {entry.conclusion!r}"
    if part.get("slice") != q.slice:
        return f"it is over slice {part.get('slice')!r}, not {q.slice!r}"
    if outputs is not None and part.get("tensor") not in outputs:
        return (f"its tensor {part.get('tensor')!r} is not the model's logits (its first float "
                f"output, {', '.join(sorted(outputs))})")
    if entry.temperature and (part.get("temperature") is None
                              or unfx(part["temperature"]) != float(q.temperature)):
        return f"it is at temperature {part.get('temperature')!r}, not {q.temperature!r}"
    if q.k is not None and not any(f.k is not None for f in entry.forms) and part.get("k") != q.k:
        return f"it is for k = {part.get('k')!r}, not {q.k!r}"
    direction = "upper" if q.op in ("<=", "<") else "lower"
    if direction != entry.direction or _OPS_DIR.get(part.get("op")) != direction:
        return f"it compares with {part.get('op')!r}, the clause with {q.op!r}"
    # the statistic of per-element bounds must bound the clause's aggregate (per input, keep 1,
    # or per (input, position), keep 2): kcverify.dsl.quantities.statistic_problem
    keep = part.get("keep", 1)
    why = table.statistic_problem(q, part.get("stat"), 1 if keep == 1 else 2)
    if why is not None:
        return why
    bound = unfx(part["bound"][0]) if isinstance(part.get("bound"), list) else None
    if bound is None or not _CMP[q.op](bound, float(q.threshold)):
        return f"its bound {bound!r} {q.op} {q.threshold!r} does not hold"
    return None


_OPS_DIR = {"<=": "upper", "<": "upper", ">=": "lower", ">": "lower"}
# a clause's verdict -> what decided it (kcverify.report.model.decided_by_default)
_DECIDED_BY = {"proved": "proof", "refuted": "counterexample", "unknown": "undecided"}


def _check_tree(node: dict[str, Any], ctx: RuleContext, path: str, used: set[str]) -> list[str]:
    problems = []
    for i, p in enumerate(node["premises"]):
        problems += _check_tree(p, ctx, f"{path}.premises[{i}]", used)
    name = node["rule"]
    if name == "block" and isinstance(node["params"].get("ref"), str):
        used.add(node["params"]["ref"])
    rule = RULES.get(name)
    if rule is None:
        return [*problems, f"{path}: unknown rule {name!r}; registered: {', '.join(sorted(RULES))}"]
    try:
        found = rule.check(node, ctx)
    except CertificateError as e:
        found = [str(e)]
    except (KeyError, TypeError, ValueError, IndexError) as e:
        found = [f"malformed application ({type(e).__name__}: {e})"]
    return problems + [f"{path} ({name}): {p}" for p in found]


def _check_clause(c: dict[str, Any], ctx: RuleContext, used: set[str]) -> list[str]:
    where = f"clause {c['id']}"
    problems: list[str] = []
    proof = c.get("proof")
    if proof is not None:
        problems += _check_tree(proof, ctx, f"{where}: proof", used)
    verdict = c["verdict"]
    thr = None if c.get("threshold") is None else unfx(c["threshold"])
    bound = None if c.get("bound") is None else unfx(c["bound"])
    op = c.get("op") or "<="
    root = proof.get("conclusion", {}) if proof else {}
    if "decided_by" in c:  # what the planner says decided the verdict must match the verdict
        want = _DECIDED_BY.get(verdict, "evidence")
        if verdict in ("passed", "failed") and c.get("method") == "static":
            want = "static"
        if c["decided_by"] != want:
            problems.append(f"{where}: decided_by {c['decided_by']!r} does not match its verdict "
                            f"{verdict!r} (expected {want!r})")
    if verdict == "proved":
        if proof is None:
            return [*problems, f"{where}: verdict 'proved' without a proof tree"]
        if root.get("holds") is not True:
            return [*problems, f"{where}: the proof's conclusion does not state that the clause holds"]
        if "parts" in root:  # a conjunction: each part is a checked threshold application
            return problems
        if thr is None or root.get("threshold") is None or unfx(root["threshold"]) != thr:
            problems.append(f"{where}: the proof's threshold {root.get('threshold')!r} is not the "
                            f"clause's {c.get('threshold')!r}")
        if root.get("op") != op:
            problems.append(f"{where}: the proof compares with {root.get('op')!r}, the clause with {op!r}")
        if c.get("quantity") is not None and root.get("quantity") != c["quantity"]:
            problems.append(f"{where}: the proof bounds {root.get('quantity')!r}, the clause is about "
                            f"{c['quantity']!r}")
        if bound is None:
            problems.append(f"{where}: a proved clause needs its certified bound")
        else:
            proof_bound = unfx(root["bound"][0]) if isinstance(root.get("bound"), list) else None
            upper = op in ("<=", "<")
            if proof_bound is None or (bound < proof_bound if upper else bound > proof_bound):
                problems.append(f"{where}: bound {bound!r} is tighter than the proof gives "
                                f"({proof_bound!r})")
            if thr is not None and not _CMP[op](bound, thr):
                problems.append(f"{where}: bound {bound!r} {op} threshold {thr!r} is false")
    elif verdict == "refuted":
        if not c["evidence"].get("counterexample"):
            problems.append(f"{where}: verdict 'refuted' without a counterexample in its evidence")
        if root.get("holds") is True:
            problems.append(f"{where}: refuted, yet its proof tree concludes that it holds")
        if bound is not None and thr is not None and _CMP[op](bound, thr):
            problems.append(f"{where}: refuted, yet the observed value {bound!r} {op} {thr!r}")
    elif verdict in ("passed", "failed"):
        ev = c["evidence"]
        if not ev:
            problems.append(f"{where}: verdict {verdict!r} without evidence")
        observed = ev.get("observed", c.get("bound"))
        if observed is not None and thr is not None:
            holds = _CMP[op](unfx(observed, f"{where}: evidence.observed"), thr)
            if holds != (verdict == "passed"):
                problems.append(f"{where}: verdict {verdict!r} contradicts the observed value "
                                f"{unfx(observed)!r} {op} {thr!r}")
    elif verdict == "unknown" and root.get("holds") is True:
        problems.append(f"{where}: 'unknown', yet its proof tree concludes that it holds")
    return problems

