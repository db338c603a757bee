"""The ``case-split`` rule: an L-inf drift bound at point inputs, proved by cases over unstable
fp8 casts (kcverify.bounds.cases) and re-checked leaf by leaf.

Light to import (stdlib and numpy): the checker pays for torch and the bound engine only when a
certificate uses the rule. Register it with ``import kcverify.certs.cases_rule`` (the planner
imports it) or ``kcverify check --rules kcverify.certs.cases_rule``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kcverify.certs.encoding import fx, unfx_list
from kcverify.certs.rules import Rule, RuleContext, RuleError, register_rule
from kcverify.certs.smt_rule import _component, _contract_kernels, _graph, spec_from_canonical

METHODS = ("interval", "best")
MAX_LEAVES = 4096  # the checker re-runs at most this many leaves per input


def encode_inputs(feeds: dict[str, Any]) -> list[dict[str, Any]]:
    """Per sample, {input name: {dtype, shape, data (hex floats)}} of a batch of point inputs."""
    names = list(feeds)
    n = int(np.asarray(feeds[names[0]]).shape[0])
    out = []
    for i in range(n):
        row = {}
        for k in names:
            a = np.asarray(feeds[k])[i]
            row[k] = {"dtype": str(a.dtype), "shape": list(a.shape),
                      "data": [fx(float(v)) for v in a.reshape(-1).tolist()]}
        out.append(row)
    return out


def decode_input(raw: Any, where: str) -> dict[str, np.ndarray]:
    """One sample's feeds (a batch of 1) from encode_inputs' form, or RuleError."""
    if not isinstance(raw, dict) or not raw:
        raise RuleError(f"{where}: an input is {{name: {{dtype, shape, data}}}}")
    out = {}
    for k, v in raw.items():
        if not isinstance(v, dict) or not {"dtype", "shape", "data"} <= set(v):
            raise RuleError(f"{where}.{k}: needs dtype, shape and data")
        try:
            dt = np.dtype(str(v["dtype"]))
            shape = [int(d) for d in v["shape"]]
        except (TypeError, ValueError):
            raise RuleError(f"{where}.{k}: dtype {v['dtype']!r} / shape {v['shape']!r} "
                            "unreadable") from None
        data = unfx_list(v["data"], f"{where}.{k}.data")
        if len(data) != int(np.prod(shape, dtype=np.int64)):
            raise RuleError(f"{where}.{k}: {len(data)} values for shape {shape}")
        arr = np.asarray(data, dtype=np.float64).astype(dt)
        if not np.array_equal(arr.astype(np.float64), np.asarray(data, dtype=np.float64)):
            raise RuleError(f"{where}.{k}: the values are not {dt} values")
        out[k] = arr.reshape([1, *shape])
    return out


@register_rule("case-split")
class CaseSplit(Rule):
    """max_j |z_inf_j(x_i) - z_train_j(x_i)| <= b_i for each input point x_i of a slice and every
    pair of programs conforming to the two kernel specs, because the programs split into the
    cases of a complete binary tree over the unstable casts (each case: the programs that cast
    the decided elements to the decided values) and each case's re-computed bound is <= its
    claim; b_i is the largest claim of input i.

    Leaf (no premises). Params: ``graph`` (the model as base64 ONNX) and ``graph_digest``;
    ``kernels`` {train, inf: canonical specs}; ``method`` (the bound domain of every leaf:
    interval or best, the whole graph as one block); ``tensor`` (the output); ``inputs`` (per
    input, the feeds: encode_inputs); ``leaves`` (per input, the decision paths,
    kcverify.bounds.cases.Decision.to_json) and ``claims`` (per input, one hex bound per leaf);
    ``slice``.

    Checks: the graph is the certified model (its blocks are the model's segmentation); the
    kernels are the contract's; when the checker knows the slice's inputs, they are these points,
    in order; per input, the paths form a complete case tree (cases.check_tree); every leaf is
    re-bounded with its path forced (a decision whose two values do not hold the element's
    unforced enclosure, or that names an element the run never casts, fails the check) and must
    come out <= its claim. Conclusion: ``{quantity: linf_drift, direction: upper, tensor, slice,
    bounds}``, one bound per input, as linf-from-state concludes it.
    """

    def conclude(self, premises: list[dict[str, Any]], params: dict[str, Any],
                 ctx: RuleContext) -> dict[str, Any]:
        if premises:
            raise RuleError("case-split is a leaf: it takes no premises")
        for key in ("graph", "graph_digest", "kernels", "method", "tensor", "inputs", "leaves",
                    "claims", "slice"):
            if key not in params:
                raise RuleError(f"case-split: params lack {key!r}")
        method = params["method"]
        if method not in METHODS:
            raise RuleError(f"case-split: unknown method {method!r}; expected one of "
                            f"{', '.join(METHODS)}")
        inputs, leaves, claims = params["inputs"], params["leaves"], params["claims"]
        if not (isinstance(inputs, list) and isinstance(leaves, list) and isinstance(claims, list)
                and len(inputs) == len(leaves) == len(claims) and inputs):
            raise RuleError("case-split: params.inputs, leaves and claims need one entry per "
                            "input")
        graph = _graph_of(params, ctx)
        kernels = params["kernels"]
        if not isinstance(kernels, dict) or set(kernels) != {"train", "inf"}:
            raise RuleError("case-split: params.kernels needs 'train' and 'inf'")
        _contract_kernels(kernels, ctx)
        try:
            train = spec_from_canonical("train", kernels["train"])
            inf = spec_from_canonical("inf", kernels["inf"])
        except Exception as e:  # noqa: BLE001 - any malformed spec is a bad application
            raise RuleError(f"case-split: params.kernels: {e}") from None
        tensor = str(params["tensor"])
        if tensor not in [v.name for v in graph.outputs]:
            raise RuleError(f"case-split: {tensor!r} is not an output of the model")
        feeds = [decode_input(x, f"case-split params.inputs[{i}]") for i, x in enumerate(inputs)]
        _bind_slice(graph, feeds, str(params["slice"]), ctx)
        decision = _component("kcverify.bounds.cases", "Decision")
        check_tree = _component("kcverify.bounds.cases", "check_tree")
        site_order = _component("kcverify.bounds.cases", "site_order")
        bound_leaf = _component("kcverify.bounds.cases", "bound_leaf")
        case_error = _component("kcverify.bounds.cases", "CaseError")
        order = site_order(graph)
        masks_all = params.get("masks")
        if masks_all is not None and not (isinstance(masks_all, list)
                                          and len(masks_all) == len(inputs)):
            raise RuleError("case-split: params.masks needs one entry per input")
        bounds = []
        for i, (x, paths_raw, claim_raw) in enumerate(zip(feeds, leaves, claims)):
            where = f"case-split input {i}"
            claim = unfx_list(claim_raw, f"case-split params.claims[{i}]")
            if not isinstance(paths_raw, list) or len(paths_raw) != len(claim) or not claim:
                raise RuleError(f"{where}: one claim per leaf, at least one leaf")
            if len(paths_raw) > MAX_LEAVES:
                raise RuleError(f"{where}: {len(paths_raw)} leaves; the checker re-runs at most "
                                f"{MAX_LEAVES}")
            try:
                paths = [[decision.from_json(d) for d in p] if isinstance(p, list) else
                         _not_a_path(p) for p in paths_raw]
                if masks_all is None:
                    check_tree(paths, order)
                else:
                    raw_masks = _masks_of(masks_all[i], len(paths), where)
            except case_error as e:
                raise RuleError(f"{where}: {e}") from None
            if masks_all is None:
                for k, (path, b) in enumerate(zip(paths, claim)):
                    try:
                        got, _ = bound_leaf(graph, train, inf, x, path, domain=method)
                    except case_error as e:
                        raise RuleError(f"{where}, leaf {k}: {e}") from None
                    if not got <= b:
                        raise RuleError(f"{where}, leaf {k}: the leaf re-bounds to {got!r}, "
                                        f"above its claim {b!r}")
            else:
                _check_elements(graph, train, inf, x, paths, raw_masks, claim, method, order,
                                where)
            bounds.append(max(claim))
        return {"quantity": "linf_drift", "direction": "upper", "tensor": tensor,
                "bounds": [fx(b) for b in bounds], "slice": str(params["slice"])}


def _masks_of(raw: Any, n: int, where: str) -> list[dict[str, str]]:
    """One input's masks as given: per node, {output: hex mask} (cases.encode_mask); RuleError
    when malformed (decoded once the outputs' sizes are known)."""
    if not isinstance(raw, list) or len(raw) != n:
        raise RuleError(f"{where}: one mask per leaf")
    out = []
    for k, m in enumerate(raw):
        if not isinstance(m, dict) or not all(isinstance(nm, str) and isinstance(v, str)
                                              for nm, v in m.items()):
            raise RuleError(f"{where}, leaf {k}: a mask is {{output: hex}}")
        out.append(dict(m))
    return out


def _check_elements(graph: Any, train: Any, inf: Any, x: dict[str, np.ndarray],
                    paths: list[Any], raw_masks: list[dict[str, str]], claim: list[float],
                    method: str, order: dict[str, int], where: str) -> None:
    """Per-element case trees (cases.certify_cases(per_element=True)): every node re-run with
    its path forced (cases.bound_node), the masks decoded against the outputs' sizes of those
    runs, every element's credited paths a complete tree (cases.check_cover), and each node's
    per-element bounds at its credited elements <= its claim."""
    case_error = _component("kcverify.bounds.cases", "CaseError")
    bound_node = _component("kcverify.bounds.cases", "bound_node")
    decode_masks = _component("kcverify.bounds.cases", "decode_masks")
    check_cover = _component("kcverify.bounds.cases", "check_cover")
    drifts = []
    for k, path in enumerate(paths):
        try:
            drifts.append(bound_node(graph, train, inf, x, path, domain=method))
        except case_error as e:
            raise RuleError(f"{where}, leaf {k}: {e}") from None
    sizes = {nm: int(np.asarray(d).size) for nm, d in drifts[0].items()}
    try:
        masks = [decode_masks(m, sizes) for m in raw_masks]
        check_cover(list(zip(paths, masks)), sizes, order)
    except case_error as e:
        raise RuleError(f"{where}: {e}") from None
    for k, (d, m, b) in enumerate(zip(drifts, masks, claim)):
        vals = [np.asarray(d[nm]).reshape(-1)[m[nm]] for nm in sizes]
        got = max((float(v.max()) if v.size and not np.isnan(v).any() else
                   (float("nan") if v.size else float("-inf"))) for v in vals)
        if not got <= b:
            raise RuleError(f"{where}, leaf {k}: the leaf re-bounds to {got!r} at its credited "
                            f"elements, above its claim {b!r}")


def _not_a_path(p: Any) -> Any:
    case_error = _component("kcverify.bounds.cases", "CaseError")
    raise case_error(f"a leaf is a list of decisions, not {p!r}")


def _graph_of(params: dict[str, Any], ctx: RuleContext) -> Any:
    """The embedded model (smt_rule._graph's checks), which must be the whole certified model."""
    try:
        graph = _graph(params, ctx)
    except RuleError as e:
        raise RuleError(str(e).replace("smt-block", "case-split")) from None
    if ctx.expected_chain is not None:
        blocks_of = _component("kcverify.bounds.engine", "blocks_of")
        if [b.digest for b in blocks_of(graph)] != [d for _, d in ctx.expected_chain]:
            raise RuleError("case-split: the embedded graph is not the whole certified model")
    return graph


def _bind_slice(graph: Any, feeds: list[dict[str, np.ndarray]], sl: str, ctx: RuleContext) -> None:
    """When the checker reads the slice: its inputs are exactly these points, in order."""
    if ctx.input_region is None:
        return
    region = ctx.input_region(sl)
    names = sorted(v.name for v in graph.inputs)
    if sorted(region) != names:
        raise RuleError(f"case-split: the model's inputs {names} are not slice {sl!r}'s "
                        f"{sorted(region)}")
    for name in names:
        box = region[name]
        lo = np.asarray(box.train_lo, dtype=np.float64)
        hi = np.asarray(box.train_hi, dtype=np.float64)
        if lo.shape[0] != len(feeds):
            raise RuleError(f"case-split: {len(feeds)} inputs for the {lo.shape[0]} of slice "
                            f"{sl!r}")
        for i, x in enumerate(feeds):
            v = np.asarray(x[name], dtype=np.float64)[0]
            if v.shape != lo[i].shape or not (np.array_equal(lo[i], v) and np.array_equal(hi[i], v)):
                raise RuleError(f"case-split: input {i} ({name}) is not input {i} of slice "
                                f"{sl!r}")
