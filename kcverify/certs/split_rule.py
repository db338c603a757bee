"""The ``split-cover`` rule: an L-inf drift bound over a box, proved part by part by input
splitting (kcverify.regions), re-checked part by part.

Light to import (stdlib and numpy): the checker pays for torch and the bound domains only when a
certificate uses the rule. Register it with ``import kcverify.certs.split_rule`` (kcverify.regions
imports it) or ``kcverify check --rules kcverify.certs.split_rule``.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from kcverify.certs.encoding import fx, unfx_list
from kcverify.certs.rules import Rule, RuleContext, RuleError, register_rule

BATCH = 512  # parts re-bounded together


def methods() -> tuple[str, ...]:
    """The methods a split-cover leaf may name: the chain domain with the prover's slope steps
    (kcverify.regions.plan.ALPHA_ITERS, so the list follows the prover) and the engine's."""
    from kcverify.regions.chain import chain_method
    from kcverify.regions.plan import ALPHA_ITERS

    return ("chain", chain_method(ALPHA_ITERS), "engine:interval", "engine:best")


@register_rule("split-cover")
class SplitCover(Rule):
    """max_j |z_inf_j(x) - z_train_j(x)| <= max_k b_k for every x in the box R = [lo, hi] and
    every pair of programs conforming to the two kernel specs, because the parts P_k cover R and
    each part's re-computed bound is <= its claim b_k.

    Leaf (no premises). Params: ``graph`` (the model as base64 ONNX) and ``graph_digest``;
    ``kernels`` {train, inf: canonical specs}; ``method`` (``chain``: the affine-ReLU chain
    domain with back-substitution, kcverify.regions.chain; ``chain:alpha<N>``: the same with the
    intermediate value bounds' and the objective's lower slopes optimised by N projected-gradient
    steps (N = kcverify.regions.plan.ALPHA_ITERS), which the checker re-runs; ``engine:interval`` /
    ``engine:best``: kcverify.bounds.certify_drift on the part's box); ``input`` and ``shape``
    (the model's float input and its shape without the batch axis); ``tensor`` (the output);
    ``region`` {lo, hi} (hex, flattened input); ``tree`` (the partition: a bisection tree in
    preorder, a split dimension d per inner node and -1 per leaf, each cut at lo + (hi - lo)/2 in
    float64 as kcverify.regions.split.bisect computes it; ``-2 - d``: the same cut on d of an
    inner node the split did not bound, so its children inherit what its parent passed down);
    ``claims`` (hex, one per leaf in
    preorder); ``slice`` (the contract slice whose inputs R must contain).

    Checks: the graph is the certified model (its blocks are the model's segmentation, when the
    checker knows it); the leaves are rebuilt from R and the tree, so they cover R by
    construction (each cut splits a box into two closed halves sharing the cut); every leaf is
    re-bounded by ``method`` and must come out <= its claim (``chain`` replays the tree: each
    node bounded from its box and the pre-activation boxes its parent certified, which hold on
    the node since it is a subset - a node recorded as ``-2 - d`` is not bounded and passes its
    parent's boxes on, which hold on its children for the same reason; the engine's methods
    bound each leaf alone); when the checker
    knows the slice's inputs (ctx.input_region), every one of them lies in R. Conclusion: one
    bound for the region, ``{quantity: linf_drift, direction: upper, tensor, slice, bounds:
    [max claim]}``.
    """

    def conclude(self, premises: list[dict[str, Any]], params: dict[str, Any],
                 ctx: RuleContext) -> dict[str, Any]:
        if premises:
            raise RuleError("split-cover is a leaf: it takes no premises")
        for key in ("graph", "graph_digest", "kernels", "method", "input", "shape", "tensor",
                    "region", "tree", "claims", "slice"):
            if key not in params:
                raise RuleError(f"split-cover: params lack {key!r}")
        method = params["method"]
        if method not in methods():
            raise RuleError(f"split-cover: unknown method {method!r}; expected one of "
                            f"{', '.join(methods())}")
        region = params["region"]
        if not isinstance(region, dict) or set(region) != {"lo", "hi"}:
            raise RuleError("split-cover: params.region needs 'lo' and 'hi'")
        lo = np.array(unfx_list(region["lo"], "split-cover params.region.lo"))
        hi = np.array(unfx_list(region["hi"], "split-cover params.region.hi"))
        if lo.shape != hi.shape or not lo.size or np.any(lo > hi) or not (
                np.all(np.isfinite(lo)) and np.all(np.isfinite(hi))):
            raise RuleError("split-cover: the region must be a finite, non-empty box")
        tree = params["tree"]
        if not isinstance(tree, list):
            raise RuleError("split-cover: params.tree must be a list")
        from kcverify.regions.split import leaves_of

        try:
            p_lo, _ = leaves_of(lo, hi, tree)
        except ValueError as e:
            raise RuleError(f"split-cover: params.tree: {e}") from None
        claims = np.array(unfx_list(params["claims"], "split-cover params.claims"))
        if len(claims) != len(p_lo):
            raise RuleError(f"split-cover: {len(claims)} claims for {len(p_lo)} parts")
        if not np.all(claims >= 0):
            raise RuleError("split-cover: a claim is negative or NaN")
        sl = params["slice"]
        if not isinstance(sl, str):
            raise RuleError("split-cover: params.slice must name the contract's slice")
        if ctx.input_region is not None:
            _covers_slice(ctx, sl, str(params["input"]), lo, hi)
        graph = _graph(params, ctx)
        tensor = str(params["tensor"])
        if [v.name for v in graph.outputs] != [tensor]:
            raise RuleError(f"split-cover: the model's outputs are "
                            f"{[v.name for v in graph.outputs]}, not [{tensor!r}]")
        got = _rebound(graph, params, method, lo, hi, tree)
        bad = np.flatnonzero(~(got <= claims))
        if len(bad):
            k = int(bad[0])
            raise RuleError(f"split-cover: part {k} ({len(bad)} of {len(claims)} parts): the "
                            f"re-computed bound {got[k]!r} exceeds the claim {claims[k]!r}")
        return {"quantity": "linf_drift", "direction": "upper", "tensor": tensor, "slice": sl,
                "bounds": [fx(float(claims.max()))]}


def _covers_slice(ctx: RuleContext, sl: str, name: str, lo: np.ndarray, hi: np.ndarray) -> None:
    assert ctx.input_region is not None
    boxes = ctx.input_region(sl)
    if name not in boxes:
        raise RuleError(f"split-cover: slice {sl!r} has no input {name!r}")
    box = boxes[name]
    a = np.asarray(box.train_lo, dtype=np.float64).reshape(len(box.train_lo), -1)
    b = np.asarray(box.train_hi, dtype=np.float64).reshape(len(box.train_hi), -1)
    if a.shape[1] != lo.size:
        raise RuleError(f"split-cover: slice {sl!r} inputs have {a.shape[1]} elements, the "
                        f"region {lo.size}")
    if not (np.all(a >= lo) and np.all(b <= hi)):
        raise RuleError(f"split-cover: the region does not contain the inputs of slice {sl!r}")


def _graph(params: dict[str, Any], ctx: RuleContext) -> Any:
    import onnx

    from kcverify.models.ir import from_onnx

    try:
        model = onnx.load_from_string(base64.b64decode(str(params["graph"]).encode(),
                                                       validate=True))
        graph = from_onnx(model, name="split-cover")
    except Exception as e:  # noqa: BLE001 - decode / protobuf errors have many types
        raise RuleError(f"split-cover: params.graph is not a base64 ONNX model "
                        f"({type(e).__name__})") from None
    if graph.digest() != params["graph_digest"]:
        raise RuleError("split-cover: params.graph does not match params.graph_digest")
    if ctx.expected_chain is not None:
        from kcverify.bounds.engine import blocks_of

        if [b.digest for b in blocks_of(graph)] != [d for _, d in ctx.expected_chain]:
            raise RuleError("split-cover: the embedded graph is not the certified model")
    return graph


def _rebound(graph: Any, params: dict[str, Any], method: str, lo: np.ndarray,
             hi: np.ndarray, tree: list[int]) -> np.ndarray:
    """Each leaf's L-inf drift bound, re-computed (kcverify.regions.plan.tree_bounds)."""
    from kcverify.certs.smt_rule import spec_from_canonical

    kernels = params["kernels"]
    if not isinstance(kernels, dict) or set(kernels) != {"train", "inf"}:
        raise RuleError("split-cover: params.kernels needs 'train' and 'inf'")
    try:
        train = spec_from_canonical("train", kernels["train"])
        inf = spec_from_canonical("inf", kernels["inf"])
    except Exception as e:  # noqa: BLE001 - any malformed spec is a bad application
        raise RuleError(f"split-cover: params.kernels: {e}") from None
    shape = params["shape"]
    if not isinstance(shape, list) or not all(isinstance(d, int) and d > 0 for d in shape):
        raise RuleError("split-cover: params.shape must list positive dimensions")
    if int(np.prod(shape)) != lo.size:
        raise RuleError("split-cover: params.shape does not match the region's size")
    from kcverify.regions.chain import one_thread
    from kcverify.regions.plan import tree_bounds

    try:
        with one_thread():
            return tree_bounds(graph, train, inf, method, str(params["input"]), tuple(shape),
                               lo, hi, tree, batch=BATCH)
    except RuleError:
        raise
    except Exception as e:  # noqa: BLE001 - a part the method cannot bound has no bound
        raise RuleError(f"split-cover: re-bounding the parts with {method!r} failed: "
                        f"{type(e).__name__}: {e}") from None


