"""The ``smt-block`` rule: an L-inf drift bound on a small block, decided by z3 and re-solved.

Light to import (stdlib only): the checker pays for z3, torch and the bound engine only when a
certificate uses the rule. Register it with ``import kcverify.certs.smt_rule`` (kcverify.smt
imports it) or ``kcverify check --rules kcverify.certs.smt_rule``.
"""

from __future__ import annotations

import base64
import math
from fractions import Fraction
from typing import Any

from kcverify.certs.encoding import fx, unfx, unfx_list
from kcverify.certs.rules import Rule, RuleContext, RuleError, register_rule
from kcverify.errors import InternalError

MAX_NEURONS = 512  # the checker re-solves nothing larger
DEFAULT_TIMEOUT_S = 60.0


def spec_from_canonical(name: str, canon: dict[str, Any]) -> Any:
    """A KernelSpec from its canonical mapping (KernelSpec.canonical(); scale values as hex)."""
    from kcverify.kernels.spec import parse_kernel_spec

    raw = dict(canon)
    for role in ("weights", "activations"):
        if role in raw:
            r = dict(raw[role])
            for key in ("value", "amax_floor"):  # hex floats in the canonical form
                if key in r:
                    r[key] = unfx(r[key], f"params.kernels.{name}.{role}.{key}")
            raw[role] = r
    return parse_kernel_spec(name, raw)


@register_rule("smt-block")
class SmtBlock(Rule):
    """max_j |z_inf_j(x) - z_train_j(x)| <= b_i for every x with |x - x_i|_inf <= eps and every
    conforming pair of programs, decided by z3 on the block's exact encoding (docs/smt.md): the
    negation "some output drifts by more than b_i" has no model, each output's maximum drift
    (z3 Optimize, exact rationals) being <= b_i.

    Leaf (no premises). Params: ``graph`` (the block as base64 ONNX bytes) and its
    ``graph_digest``, ``kernels`` {train, inf: canonical specs}, ``inputs`` (per sample, the
    input point as hex floats), ``eps`` (hex), ``tensor`` (the block output), ``claim`` (per
    sample b_i, hex), ``timeout_s``. ``conclude`` re-solves every sample; a bound that does not
    re-solve (edited, or too tight) is outside the rule. When the checker knows the model's
    segmentation, the block must be the whole model (its blocks' digests) or one of its blocks.
    """

    def conclude(self, premises: list[dict[str, Any]], params: dict[str, Any],
                 ctx: RuleContext) -> dict[str, Any]:
        if premises:
            raise RuleError("smt-block is a leaf: it takes no premises")
        for key in ("graph", "graph_digest", "kernels", "inputs", "eps", "tensor", "claim"):
            if key not in params:
                raise RuleError(f"smt-block: params lack {key!r}")
        claim = unfx_list(params["claim"], "smt-block params.claim")
        inputs = params["inputs"]
        if not isinstance(inputs, list) or len(inputs) != len(claim) or not claim:
            raise RuleError("smt-block: params.inputs needs one input point per claimed bound")
        eps = unfx(params["eps"], "smt-block params.eps")
        if not (eps >= 0 and math.isfinite(eps)):
            raise RuleError("smt-block: eps must be a finite number >= 0")
        graph = _graph(params, ctx)
        decide_problem = _component("kcverify.smt.decide", "decide_problem")
        NotEncodable = _component("kcverify.smt.encode", "NotEncodable")  # noqa: N806
        prepare = _component("kcverify.smt.encode", "prepare")

        kernels = params["kernels"]
        if not isinstance(kernels, dict) or set(kernels) != {"train", "inf"}:
            raise RuleError("smt-block: params.kernels needs 'train' and 'inf'")
        _contract_kernels(kernels, ctx)  # a kernel that is not the contract's says so first
        try:
            train = spec_from_canonical("train", kernels["train"])
            inf = spec_from_canonical("inf", kernels["inf"])
        except Exception as e:  # noqa: BLE001 - any malformed spec is a bad application
            raise RuleError(f"smt-block: params.kernels: {e}") from None
        _bind_to_contract(graph, train, inf, params, eps, ctx)
        tensor = str(params["tensor"])
        if [v.name for v in graph.outputs] != [tensor]:
            raise RuleError(f"smt-block: the block's outputs are {[v.name for v in graph.outputs]}, "
                            f"not [{tensor!r}]")
        raw_t = params.get("timeout_s", DEFAULT_TIMEOUT_S)
        timeout = unfx(raw_t, "smt-block params.timeout_s") if isinstance(raw_t, str) else float(raw_t)
        for i, (point, b) in enumerate(zip(inputs, claim)):
            x = unfx_list(point, f"smt-block params.inputs[{i}]")
            try:
                p = prepare(graph, train, inf, [x], eps)
            except NotEncodable as e:
                raise RuleError(f"smt-block: {e}") from None
            if p.neurons() > MAX_NEURONS:
                raise RuleError(f"smt-block: {p.neurons()} neurons; the checker re-solves at most "
                                f"{MAX_NEURONS}")
            v = decide_problem(p, b, timeout_s=timeout, programs=0)
            if v.verdict != "proved":
                raise RuleError(f"smt-block: sample {i}: the bound {b!r} does not re-solve "
                                f"({v.verdict}{': ' + v.note if v.note else ''})")
        out = {"quantity": "linf_drift", "direction": "upper", "tensor": tensor,
               "bounds": [fx(b) for b in claim]}
        if "slice" in params:  # the contract slice the input points come from
            out["slice"] = str(params["slice"])
        return out


def _contract_kernels(kernels: dict[str, Any], ctx: RuleContext) -> None:
    """The leaf's kernels, as canonical mappings, are the contract's (when the checker knows
    them)."""
    if ctx.kernel_specs is None:
        return
    for name in ("train", "inf"):
        want = ctx.kernel_specs.get(name)
        want = want.canonical() if hasattr(want, "canonical") else want
        if want is None or kernels[name] != dict(want):
            raise RuleError(f"smt-block: params.kernels.{name} is not the contract's kernel "
                            f"{name!r}")


def _bind_to_contract(graph: Any, train: Any, inf: Any, params: dict[str, Any], eps: float,
                      ctx: RuleContext) -> None:
    """What the leaf re-solves must be the certified problem, not one the certificate chose:
    its kernels are the contract's (when the checker knows them), and a conclusion carried into a
    clause over a slice is about the whole model on boxes that contain every input of that slice
    (sample by sample, |x_slice - x_i| <= eps), when the checker can read the slice."""
    if ctx.kernel_specs is not None:
        for name, spec in (("train", train), ("inf", inf)):
            want = ctx.kernel_specs.get(name)
            want = want.canonical() if hasattr(want, "canonical") else want
            if want is None or spec.canonical() != dict(want):
                raise RuleError(f"smt-block: params.kernels.{name} is not the contract's kernel "
                                f"{name!r}")
    if "slice" not in params or ctx.input_region is None:
        return
    import numpy as np

    if ctx.expected_chain is not None:
        blocks_of = _component("kcverify.bounds.engine", "blocks_of")
        if [b.digest for b in blocks_of(graph)] != [d for _, d in ctx.expected_chain]:
            raise RuleError("smt-block: a conclusion over a slice needs the block to be the whole "
                            "model")
    region = ctx.input_region(str(params["slice"]))
    names = [v.name for v in graph.inputs]
    if set(region) != set(names) or len(names) != 1:
        raise RuleError(f"smt-block: the block's inputs {names} are not the model inputs "
                        f"{sorted(region)} of slice {params['slice']!r}")
    box = region[names[0]]
    lo = np.asarray(box.train_lo, dtype=np.float64)
    hi = np.asarray(box.train_hi, dtype=np.float64)
    points = params["inputs"]
    if lo.shape[0] != len(points):
        raise RuleError(f"smt-block: {len(points)} input points for the {lo.shape[0]} inputs of "
                        f"slice {params['slice']!r}")
    e = Fraction(eps)
    for i, point in enumerate(points):
        x = unfx_list(point, f"smt-block params.inputs[{i}]")
        lo_i, hi_i = lo[i].reshape(-1).tolist(), hi[i].reshape(-1).tolist()
        # exact rationals: [lo, hi] of the slice inside [x - eps, x + eps]
        if len(x) != len(lo_i) or not all(Fraction(xv) - e <= Fraction(a) and Fraction(b) <= Fraction(xv) + e
                                          for xv, a, b in zip(x, lo_i, hi_i)):
            raise RuleError(f"smt-block: input point {i} +- eps does not contain input {i} of "
                            f"slice {params['slice']!r}")


def _component(module: str, attr: str) -> Any:
    """What re-solving needs (z3 through kcverify.smt, the IR, the block segmentation): one that
    cannot load is a broken installation, an InternalError, never a skipped or refused check."""
    import importlib

    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise InternalError(f"the smt-block check cannot load {module}.{attr}: {e}") from e


def _graph(params: dict[str, Any], ctx: RuleContext) -> Any:
    onnx_load = _component("onnx", "load_from_string")
    from_onnx = _component("kcverify.models.ir", "from_onnx")
    try:
        model = onnx_load(base64.b64decode(str(params["graph"]).encode(), validate=True))
        graph = from_onnx(model, name="smt-block")
    except Exception as e:  # noqa: BLE001 - decode / protobuf errors have many types
        raise RuleError(f"smt-block: params.graph is not a base64 ONNX model ({type(e).__name__})") from None
    if graph.digest() != params["graph_digest"]:
        raise RuleError("smt-block: params.graph does not match params.graph_digest")
    if ctx.expected_chain is not None:
        chain = [d for _, d in ctx.expected_chain]
        blocks_of = _component("kcverify.bounds.engine", "blocks_of")
        own = [b.digest for b in blocks_of(graph)]
        if own != chain and graph.digest() not in chain:
            raise RuleError("smt-block: the block is neither the certified model nor one of its blocks")
    return graph
