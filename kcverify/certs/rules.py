"""Composition rules: the steps of a certificate's proof tree (semantics §1.3, 4).

A proof tree node (an *application*) is ``{"rule": name, "premises": [nodes], "conclusion": {...},
"params": {...}}``. A rule is registered with ``@register_rule(name)``; it has

* ``conclude(premises, params, ctx) -> conclusion``: the strongest conclusion the rule justifies
  from its premises' conclusions, computed with outward rounding; it raises ``RuleError`` when the
  application is outside the rule's preconditions;
* ``check(application, ctx) -> list[str]``: the problems with one application (empty = valid). The
  default re-runs ``conclude`` and accepts the stored conclusion only if it is implied by the
  recomputed one (equal, or looser in each bound's direction).

Numeric conclusions share one shape: ``{"quantity": q, "direction": "upper"|"lower", "bounds":
[float.hex per input of the slice], ...}``; a "bounds" entry b_i means q(x_i) <= b_i (upper) or
q(x_i) >= b_i (lower) for every conforming pair of programs. ``{"kind": "state", "outputs":
{tensor: block ref}}`` says a tensor lies in that block's out_state; ``{"kind": "block"}`` is a
block certificate. The checker checks every premise before it is used, so a rule may trust them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np

from kcverify.certs.encoding import (
    INF,
    cosh_up,
    down,
    exp_down,
    exp_up,
    fx,
    log_up,
    tanh_up,
    unfx,
    unfx_list,
    up,
)
from kcverify.certs.records import BOX_FIELDS, BlockData, StoredBox, decode_box
from kcverify.errors import CertificateError


class RuleError(CertificateError):
    """A rule applied outside its preconditions, or to premises of the wrong shape."""


RecheckBlock = Callable[[BlockData], list[str]]


@dataclass
class RuleContext:
    """What rules may consult: the certificate's block certificates and the checker's hooks.

    ``recheck_block(record) -> problems`` re-runs a block's bound method (supplied by the bound
    engine's adapter); ``expected_chain`` is the model's segmentation [(block name, digest)] when
    known; ``graph_inputs`` the model's input names when known; ``input_region(slice) ->
    {input name: box}`` the boxes of a contract slice's inputs as the bound engine builds them
    (then a chain over that slice must assume a region containing them); ``store_input(name,
    box)`` maps a raw model-input region to the values the kernels store (each in its compute
    format: the bound engine's input_box), None when inputs enter unchanged. ``kernel_specs``:
    the contract's kernel specs by name (KernelSpec or canonical mapping), for rules whose
    error analysis depends on them (examples/rules/residual_lipschitz.py); None when unknown.
    ``whole_chain``: the whole graph as one block [(name, digest)], the other cut a prover may use
    (the linear domain's, kcverify.bounds.engine.whole_graph); None when unknown.
    """

    blocks: dict[str, BlockData] = field(default_factory=dict)
    recheck_block: RecheckBlock | None = None
    expected_chain: list[tuple[str, str]] | None = None
    graph_inputs: set[str] | None = None
    input_region: Callable[[str], Mapping[str, Any]] | None = None
    store_input: Callable[[str, StoredBox], Any] | None = None
    rechecked: dict[str, list[str]] = field(default_factory=dict)
    kernel_specs: Mapping[str, Any] | None = None
    whole_chain: list[tuple[str, str]] | None = None

    def block(self, ref: str) -> BlockData:
        if ref not in self.blocks:
            raise RuleError(f"block {ref!r} is not in predicate.blocks")
        return self.blocks[ref]

    def box(self, ref: str, tensor: str) -> StoredBox:
        blk = self.block(ref)
        if tensor not in blk.out_state:
            raise RuleError(f"block {ref!r} has no output {tensor!r}")
        return blk.out_state[tensor]


class Rule:
    """Base class: subclasses implement ``conclude``; ``check`` compares conclusions."""

    name: str = ""
    # list-valued conclusion keys and the direction in which a stored value may be looser
    loose_keys: Mapping[str, str] = {}

    def conclude(self, premises: list[dict[str, Any]], params: dict[str, Any],
                 ctx: RuleContext) -> dict[str, Any]:
        raise NotImplementedError

    def check(self, application: dict[str, Any], ctx: RuleContext) -> list[str]:
        premises = [p.get("conclusion", {}) for p in application.get("premises", [])]
        try:
            derived = self.conclude(premises, dict(application.get("params", {})), ctx)
        except CertificateError as e:
            return [str(e)]
        return implies(derived, application.get("conclusion"), self.directions(derived))

    def directions(self, conclusion: dict[str, Any]) -> dict[str, str]:
        out = dict(self.loose_keys)
        if "bounds" in conclusion and "direction" in conclusion:
            out.setdefault("bounds", conclusion["direction"])
        return out


def implies(derived: dict[str, Any], claimed: Any, directions: Mapping[str, str]) -> list[str]:
    """Problems unless ``claimed`` follows from ``derived``: same keys and non-numeric values, and
    each list in ``directions`` looser entrywise (>= for "upper", <= for "lower")."""
    if not isinstance(claimed, dict):
        return ["conclusion must be an object"]
    problems: list[str] = []
    if set(claimed) != set(derived):
        extra = sorted(set(claimed) - set(derived))
        lack = sorted(set(derived) - set(claimed))
        return [f"conclusion keys differ from what the rule concludes (extra {extra}, missing {lack})"]
    for key, want in derived.items():
        got = claimed[key]
        if key in directions:
            try:
                gv = unfx_list(got, f"conclusion.{key}")
            except CertificateError as e:
                problems.append(str(e))
                continue
            wv = unfx_list(want, key)
            if len(gv) != len(wv):
                problems.append(f"conclusion.{key} has {len(gv)} entries, the premises give {len(wv)}")
                continue
            sign = 1 if directions[key] == "upper" else -1
            for i, (g, w) in enumerate(zip(gv, wv)):
                if sign * g < sign * w:
                    word = "below" if sign > 0 else "above"
                    problems.append(f"conclusion.{key}[{i}] = {g!r} is {word} what the premises "
                                    f"allow ({w!r}): tighter than justified")
                    break
        elif got != want:
            problems.append(f"conclusion.{key} = {got!r} differs from the rule's {want!r}")
    return problems


# ---- the registry ---------------------------------------------------------------------------

RULES: dict[str, Rule] = {}


class _FunctionRule(Rule):
    def __init__(self, fn: Callable[[dict[str, Any], RuleContext], list[str]]) -> None:
        self._fn = fn
        self.__doc__ = fn.__doc__

    def check(self, application: dict[str, Any], ctx: RuleContext) -> list[str]:
        return list(self._fn(application, ctx))

    def conclude(self, premises: list[dict[str, Any]], params: dict[str, Any],
                 ctx: RuleContext) -> dict[str, Any]:
        raise RuleError(f"rule {self.name!r} is check-only: give the conclusion explicitly")


def register_rule(name: str, *, replace: bool = False) -> Callable[[Any], Any]:
    """Register a Rule subclass (instantiated once) or a function ``check(application, ctx)``."""

    def deco(obj: Any) -> Any:
        if name in RULES and not replace:
            raise ValueError(f"composition rule {name!r} is already registered")
        if not (obj.__doc__ or "").strip():
            raise ValueError(f"composition rule {name!r} needs a docstring stating the rule")
        derives = getattr(obj, "derives", None)
        if derives is not None:  # a DSL quantity of the one table (kcverify.dsl.quantities)
            from kcverify.dsl.quantities import QUANTITIES

            if derives not in QUANTITIES:
                raise ValueError(f"composition rule {name!r}: derives {derives!r} is not a "
                                 f"quantity of the table; known: {', '.join(QUANTITIES)}")
        rule = obj() if isinstance(obj, type) else _FunctionRule(obj)
        rule.name = name
        RULES[name] = rule
        return obj

    return deco


def get_rule(name: str) -> Rule:
    if name not in RULES:
        raise RuleError(f"unknown composition rule {name!r}; registered: {', '.join(sorted(RULES))}")
    return RULES[name]


def unregister_rule(name: str) -> None:
    RULES.pop(name, None)


_LOADED: dict[str, set[str]] = {}  # rule module (resolved path or dotted name) -> rules it added


def load_rule_modules(specs: list[str]) -> list[str]:
    """Import modules that register rules: dotted module names or paths to .py files. Returns
    the names of the rules they added. Loading a module again while its rules are registered is
    a no-op (prove and check in one process); a module that cannot be imported, or that
    registers a name already taken, is bad input."""
    import importlib
    import importlib.util
    from pathlib import Path

    from kcverify.errors import InputFileError

    before = set(RULES)
    for spec in specs:
        path = Path(spec)
        key = str(path.resolve()) if spec.endswith(".py") else spec
        if key in _LOADED and _LOADED[key] and _LOADED[key] <= set(RULES):
            continue
        start = set(RULES)
        try:
            if spec.endswith(".py"):
                if not path.is_file():
                    raise InputFileError(f"{spec}: no such rule module")
                mod_spec = importlib.util.spec_from_file_location(f"kcverify_rules_{path.stem}", path)
                if mod_spec is None or mod_spec.loader is None:
                    raise InputFileError(f"{spec}: cannot load as a Python module")
                module = importlib.util.module_from_spec(mod_spec)
                mod_spec.loader.exec_module(module)
            else:
                importlib.import_module(spec)
        except ImportError as e:
            raise InputFileError(f"{spec}: cannot import rule module ({e})") from None
        except ValueError as e:
            raise InputFileError(f"{spec}: {e}") from None
        _LOADED[key] = set(RULES) - start
    return sorted(set(RULES) - before)


# ---- helpers --------------------------------------------------------------------------------

def _one(premises: list[dict[str, Any]], rule: str, n: int = 1) -> None:
    if len(premises) != n:
        raise RuleError(f"{rule} takes {n} premise(s), got {len(premises)}")


def _numeric(c: dict[str, Any], rule: str, quantity: str | tuple[str, ...] | None = None,
             direction: str | None = None) -> list[float]:
    if not isinstance(c, dict) or "bounds" not in c or "quantity" not in c:
        raise RuleError(f"{rule}: premise is not a numeric conclusion (quantity, bounds)")
    qs = (quantity,) if isinstance(quantity, str) else quantity
    if qs is not None and c["quantity"] not in qs:
        raise RuleError(f"{rule}: premise quantity is {c['quantity']!r}, expected {' or '.join(qs)}")
    if direction is not None and c.get("direction") != direction:
        raise RuleError(f"{rule}: premise must be an {direction} bound")
    vals = unfx_list(c["bounds"], f"{rule} premise bounds")
    if not vals:
        raise RuleError(f"{rule}: premise has no bounds")
    return vals


def _positive(params: dict[str, Any], key: str, rule: str) -> float:
    if key not in params:
        raise RuleError(f"{rule}: params lack {key!r}")
    v = unfx(params[key], f"{rule} params.{key}")
    if not (v > 0 and math.isfinite(v)):
        raise RuleError(f"{rule}: {key} must be positive and finite, got {v!r}")
    return v


def _x(delta: float, temperature: float, factor: int = 2) -> float:
    """Outward-rounded factor·δ/T (δ >= 0)."""
    if delta < 0:
        raise RuleError(f"a drift bound cannot be negative ({delta!r})")
    if math.isinf(delta):
        return INF
    return up(Fraction(factor) * Fraction(delta) / Fraction(temperature))


def _linf_premise(premises: list[dict[str, Any]], rule: str) -> tuple[list[float], dict[str, Any]]:
    _one(premises, rule)
    return _numeric(premises[0], rule, "linf_drift", "upper"), premises[0]


CARRIED = ("tensor", "slice", "keep", "rows")  # what identifies a numeric conclusion along a chain


def _carry(c: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: c[k] for k in keys if k in c}


# ---- block and chain rules ------------------------------------------------------------------

@register_rule("block")
class BlockRule(Rule):
    """Leaf: a block certificate B: in_state → out_state (predicate.blocks[ref]).

    Valid iff re-running the block's bound method on in_state gives out_state' ⊆ out_state
    (checked by ``ctx.recheck_block``), and the block's digest matches the model's segmentation.
    """

    def conclude(self, premises: list[dict[str, Any]], params: dict[str, Any],
                 ctx: RuleContext) -> dict[str, Any]:
        _one(premises, "block", 0)
        ref = params.get("ref")
        if not isinstance(ref, str):
            raise RuleError("block: params.ref must name a block in predicate.blocks")
        ctx.block(ref)
        return {"kind": "block", "ref": ref}

    def check(self, application: dict[str, Any], ctx: RuleContext) -> list[str]:
        problems = super().check(application, ctx)
        if problems:
            return problems
        ref = application["params"]["ref"]
        if ref not in ctx.rechecked:
            blk = ctx.block(ref)
            if ctx.recheck_block is None:
                ctx.rechecked[ref] = [f"block {blk.name!r} ({ref}) not re-checked: no bound engine "
                                      "available (pass recheck_block)"]
            else:
                try:
                    ctx.rechecked[ref] = [f"block {blk.name!r} ({ref}): {p}"
                                          for p in ctx.recheck_block(blk)]
                except CertificateError as e:
                    ctx.rechecked[ref] = [f"block {blk.name!r} ({ref}): {e}"]
        return list(ctx.rechecked[ref])


@register_rule("sequential")
class Sequential(Rule):
    """Chain B_1; …; B_n of block certificates from the model-input region X (params.inputs):
    the model's segmentation, or a prefix of it (its first n blocks, in order).

    Valid iff for every tensor t that B_{i+1} assumes: t is produced by an earlier B_j and
    in_{i+1}(t) ⊇ out_j(t), or t is a model input and in_{i+1}(t) ⊇ store(X(t)), the values the
    kernels hold after storing the raw inputs in their formats (``ctx.store_input``). Then every tensor t
    listed in the conclusion lies in out_j(t) of its (last) producer B_j. A block that the chain
    needs but lacks shows up as an input nobody produces. params: inputs (X), outputs, and
    optionally slice (the contract slice X comes from; carried into every derived conclusion)
    and rows [i0, i1] (the chain covers only the slice's inputs i0 .. i1 - 1, a chunk: X must
    contain those rows of the slice's inputs; the conclusion carries ``rows``, and only
    concat-rows, tiling the whole slice, turns such conclusions into one over the slice).
    """

    def conclude(self, premises: list[dict[str, Any]], params: dict[str, Any],
                 ctx: RuleContext) -> dict[str, Any]:
        if not premises:
            raise RuleError("sequential: needs at least one block premise")
        raw_inputs = params.get("inputs")
        if not isinstance(raw_inputs, Mapping) or not raw_inputs:
            raise RuleError("sequential: params.inputs must map the model inputs to boxes")
        inputs = {k: decode_box(v, f"sequential params.inputs[{k!r}]") for k, v in raw_inputs.items()}
        rows = _rows_param(params.get("rows"), "sequential") if "rows" in params else None
        if ctx.graph_inputs is not None:
            unknown = sorted(set(inputs) - ctx.graph_inputs)
            if unknown:
                raise RuleError(f"sequential: {unknown} are not inputs of the model")
        if ctx.input_region is not None:
            sl = params.get("slice")
            if not isinstance(sl, str):
                raise RuleError("sequential: params.slice must name the slice whose inputs the "
                                "chain covers")
            for t, want in ctx.input_region(sl).items():
                if rows is not None:
                    if rows[1] > _n_rows(want):
                        raise RuleError(f"sequential: params.rows {list(rows)} exceed the "
                                        f"{_n_rows(want)} inputs of slice {sl!r}")
                    want = _select_rows(want, *rows)
                if t not in inputs:
                    raise RuleError(f"sequential: the chain assumes no region for input {t!r} of "
                                    f"slice {sl!r}")
                if not inputs[t].contains(want):
                    raise RuleError(f"sequential: the assumed region for input {t!r} does not "
                                    f"contain the inputs of slice {sl!r}")
        stored_inputs = {t: (ctx.store_input(t, b) if ctx.store_input is not None else b)
                         for t, b in inputs.items()}
        produced: dict[str, str] = {}
        refs: list[str] = []
        for i, c in enumerate(premises):
            if not isinstance(c, dict) or c.get("kind") != "block":
                raise RuleError(f"sequential: premise {i} is not a block certificate")
            ref = c["ref"]
            if ref in refs:
                raise RuleError(f"sequential: block {ref!r} appears twice")
            refs.append(ref)
            blk = ctx.block(ref)
            for t, box in blk.in_state.items():
                if t in produced:
                    src = ctx.box(produced[t], t)
                    what = f"block {ctx.block(produced[t]).name!r}'s output"
                elif t in inputs:
                    src, what = stored_inputs[t], "the model-input region (as the kernels store it)"
                else:
                    raise RuleError(f"sequential: block {blk.name!r} assumes tensor {t!r}, which no "
                                    "earlier block produces and is no model input (a block missing?)")
                if not box.contains(src):
                    raise RuleError(f"sequential: block {blk.name!r} assumes an in_state for {t!r} "
                                    f"that does not contain {what}")
            for t in blk.out_state:
                produced[t] = ref
        if ctx.expected_chain is not None:
            # the model's blocks in order from the first: all of them, or a prefix (the state of
            # the tensors those blocks produce, which no later block produces again: a
            # compositional rule continues from it, examples/rules/residual_lipschitz.py), or
            # the whole graph as one block (the linear domain's cut: ctx.whole_chain)
            have = [(ctx.block(r).name, ctx.block(r).digest) for r in refs]
            whole = ctx.whole_chain is not None and have == list(ctx.whole_chain)
            if not whole and have != list(ctx.expected_chain)[:len(have)]:
                names = [n for n, _ in ctx.expected_chain]
                raise RuleError(f"sequential: the chain {[n for n, _ in have]} (with digests) is not "
                                f"the model's segmentation {names} (nor a prefix of it), nor the "
                                "whole graph as one block")
        outputs = params.get("outputs")
        if not isinstance(outputs, list) or not all(isinstance(o, str) for o in outputs):
            raise RuleError("sequential: params.outputs must list tensor names")
        missing = [o for o in outputs if o not in produced]
        if missing:
            raise RuleError(f"sequential: no block produces {missing}")
        out: dict[str, Any] = {"kind": "state", "outputs": {o: produced[o] for o in outputs}}
        if "slice" in params:
            if not isinstance(params["slice"], str):
                raise RuleError("sequential: params.slice must name the contract's slice")
            out["slice"] = params["slice"]
        if rows is not None:
            out["rows"] = list(rows)
        return out


def _rows_param(raw: Any, rule: str) -> tuple[int, int]:
    if (not isinstance(raw, list) or len(raw) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in raw)
            or not 0 <= raw[0] < raw[1]):
        raise RuleError(f"{rule}: rows must be [i0, i1] with 0 <= i0 < i1, not {raw!r}")
    return int(raw[0]), int(raw[1])


def _n_rows(box: Any) -> int:
    return int(np.asarray(box.train_lo).shape[0]) if np.asarray(box.train_lo).ndim else 1


def _select_rows(box: Any, i0: int, i1: int) -> StoredBox:
    """Rows i0 .. i1 - 1 (the sample axis, 0) of a box."""
    return StoredBox(*(np.asarray(getattr(box, f))[i0:i1] for f in BOX_FIELDS))


# list-valued per-row keys of a numeric conclusion (one entry per input, or per (input,
# position) with keep 2, inputs first): what concat-rows concatenates
ROW_KEYS = ("bounds", "margins", "ratio_lo", "ratio_hi")


@register_rule("concat-rows")
class ConcatRows(Rule):
    """One conclusion over a slice from its chunks' conclusions: premises are per-input
    conclusions (bounds per input, or per (input, position)) over rows [i0, i1) of the same
    slice (each carries ``rows`` from its chunk's sequential chain), in order, tiling [0, n)
    exactly once: premise k's rows start where premise k-1's end, the first at 0, the last at n.
    params: n (the slice's input count; checked against the slice's data when the checker has
    it). Every other key of the premises agrees; the per-row lists are concatenated in order.
    Sound: each premise bounds the quantity at the inputs of its rows, the rows partition the
    slice, so the concatenation bounds it at every input of the slice, in the slice's order.
    """

    def conclude(self, premises: list[dict[str, Any]], params: dict[str, Any],
                 ctx: RuleContext) -> dict[str, Any]:
        if not premises:
            raise RuleError("concat-rows: needs at least one premise")
        n = params.get("n")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise RuleError(f"concat-rows: params.n must be the slice's input count, not {n!r}")
        first = premises[0]
        if not isinstance(first, dict) or "slice" not in first:
            raise RuleError("concat-rows: premises must be conclusions over a slice")
        sl = first["slice"]
        if ctx.input_region is not None:
            region = ctx.input_region(sl)
            have = {_n_rows(b) for b in region.values()}
            if have != {n}:
                raise RuleError(f"concat-rows: slice {sl!r} has {sorted(have)} inputs, "
                                f"params.n says {n}")
        rest = {k: v for k, v in first.items() if k not in ROW_KEYS and k != "rows"}
        lists: dict[str, list[Any]] = {k: [] for k in ROW_KEYS if k in first}
        at = 0
        for i, c in enumerate(premises):
            if not isinstance(c, dict) or "rows" not in c:
                raise RuleError(f"concat-rows: premise {i} carries no rows (not a chunk's)")
            i0, i1 = _rows_param(c["rows"], "concat-rows")
            if i0 != at:
                raise RuleError(f"concat-rows: premise {i} covers rows [{i0}, {i1}), expected "
                                f"them to start at {at} (chunks tile the slice once, in order)")
            at = i1
            if {k: v for k, v in c.items() if k not in ROW_KEYS and k != "rows"} != rest:
                raise RuleError(f"concat-rows: premise {i} is about another quantity, tensor "
                                "or slice than premise 0")
            if set(lists) != {k for k in ROW_KEYS if k in c}:
                raise RuleError(f"concat-rows: premise {i} has other per-row lists than "
                                "premise 0")
            per = (i1 - i0) * (1 if c.get("keep", 1) == 1 else -1)
            for k in lists:
                if not isinstance(c[k], list) or (per > 0 and len(c[k]) != per):
                    raise RuleError(f"concat-rows: premise {i}'s {k} must list one entry per "
                                    f"row of [{i0}, {i1})")
                lists[k].extend(c[k])
        if at != n:
            raise RuleError(f"concat-rows: the chunks cover rows [0, {at}), the slice has {n}")
        return {**rest, **lists}

    def directions(self, conclusion: dict[str, Any]) -> dict[str, str]:
        out = super().directions(conclusion)
        if "margins" in conclusion:
            out.setdefault("margins", "lower")
        return out


@register_rule("linf-from-state")
class LinfFromState(Rule):
    """δ_e = max over the remaining axes of max(|drift_lo|, |drift_hi|) for tensor t of a state.

    Since z_inf − z_train ∈ [drift_lo, drift_hi] elementwise, ‖z_inf − z_train‖∞ ≤ δ_e on each
    element e (max and abs are exact in floating point). params.keep = 1 (default): one bound per
    input (axis 0); keep = 2: one per (input, position) (axes 0 and 1), flattened row-major; a
    tensor (batch, classes) has one position per input.
    """

    def conclude(self, premises: list[dict[str, Any]], params: dict[str, Any],
                 ctx: RuleContext) -> dict[str, Any]:
        _one(premises, "linf-from-state")
        c = premises[0]
        t = params.get("tensor")
        keep = params.get("keep", 1)
        if not isinstance(c, dict) or c.get("kind") != "state":
            raise RuleError("linf-from-state: premise must be a state")
        if not isinstance(t, str) or t not in c.get("outputs", {}):
            raise RuleError(f"linf-from-state: tensor {t!r} is not in the premise state")
        box = ctx.box(c["outputs"][t], t)
        if keep not in (1, 2):
            raise RuleError(f"linf-from-state: keep must be 1 or 2, not {keep!r}")
        mag = np.maximum(np.abs(box.drift_lo), np.abs(box.drift_hi))
        axes = keep if mag.ndim > keep else 1  # (batch, classes): one position per input
        lead = int(np.prod(mag.shape[:axes])) if mag.ndim else 1
        per = mag.reshape(lead, -1).max(axis=1) if mag.size else np.zeros(lead)
        out = {"quantity": "linf_drift", "direction": "upper", "tensor": t,
               "bounds": [fx(v) for v in per.tolist()], **_carry(c, "slice", "rows")}
        if keep != 1:
            out["keep"] = keep
        return out


# ---- the paper's chain (semantics §1.3) --------------------------------------------------------

@register_rule("logprob-from-linf")
class LogprobFromLinf(Rule):
    """|log q_i − log p_i| ≤ 2δ/T for every token i, with p = softmax(z_train/T), q = softmax(z_inf/T).

    log p_i = z_i/T − LSE(z/T); LSE is 1-Lipschitz in L∞, so each term moves by ≤ δ/T.
    """

    def conclude(self, premises: list[dict[str, Any]], params: dict[str, Any],
                 ctx: RuleContext) -> dict[str, Any]:
        d, c = _linf_premise(premises, "logprob-from-linf")
        temp = _positive(params, "temperature", "logprob-from-linf")
        return {"quantity": "logprob_drift", "direction": "upper", **_carry(c, *CARRIED),
                "temperature": fx(temp), "bounds": [fx(_x(v, temp)) for v in d]}


@register_rule("ratio-from-linf")
class RatioFromLinf(Rule):
    """ρ_i = q_i/p_i ∈ [e^(−2δ/T), e^(2δ/T)], hence |ρ − 1| ≤ e^(2δ/T) − 1 (as 1 − e^(−x) ≤ e^x − 1).

    Conclusion: bounds (|ρ − 1|, upper), ratio_lo (lower), ratio_hi (upper), per input.
    """

    loose_keys = {"ratio_lo": "lower", "ratio_hi": "upper"}

    def conclude(self, premises: list[dict[str, Any]], params: dict[str, Any],
                 ctx: RuleContext) -> dict[str, Any]:
        d, c = _linf_premise(premises, "ratio-from-linf")
        temp = _positive(params, "temperature", "ratio-from-linf")
        xs = [_x(v, temp) for v in d]
        his = [exp_up(x) for x in xs]
        los = [0.0 if math.isinf(x) else exp_down(-x) for x in xs]
        devs = [INF if math.isinf(h) else up(Fraction(h) - 1) for h in his]
        return {"quantity": "ratio_dev", "direction": "upper", **_carry(c, *CARRIED),
                "temperature": fx(temp), "bounds": [fx(v) for v in devs],
                "ratio_lo": [fx(v) for v in los], "ratio_hi": [fx(v) for v in his]}


def _half(delta: float, temperature: float) -> float:
    """Outward-rounded y = δ/(2T) (δ ≥ 0)."""
    if delta < 0:
        raise RuleError(f"a drift bound cannot be negative ({delta!r})")
    return INF if math.isinf(delta) else up(Fraction(delta) / (2 * Fraction(temperature)))


@register_rule("tv-from-linf")
class TvFromLinf(Rule):
    """TV(p, q) ≤ tanh(δ/(2T)) ≤ (e^(2δ/T) − 1)/2, p = softmax(z/T), q = softmax((z + Δ)/T).

    With w_i = e^(Δ_i/T) ∈ [1/b, b], b = e^(δ/T): TV = max_A q(A) − p(A), and for a fixed A,
    q(A) = Σ_A p_i w_i / Σ_j p_j w_j is linear-fractional in w, so it is largest at w = b on A and
    1/b off A: with P = p(A), r = b², q(A) − P = P(1 − P)(r − 1)/(1 + P(r − 1)), whose maximum
    over P ∈ [0, 1] (at P = 1/(1 + b)) is (b − 1)/(b + 1) = tanh(δ/(2T)). Attained by two tokens;
    sharper than, and implies, semantics §1.3's (e^(2δ/T) − 1)/2.
    """

    def conclude(self, premises: list[dict[str, Any]], params: dict[str, Any],
                 ctx: RuleContext) -> dict[str, Any]:
        d, c = _linf_premise(premises, "tv-from-linf")
        temp = _positive(params, "temperature", "tv-from-linf")
        tv = [1.0 if math.isinf(v) else tanh_up(_half(v, temp)) for v in d]
        return {"quantity": "tv", "direction": "upper", **_carry(c, *CARRIED),
                "temperature": fx(temp), "bounds": [fx(v) for v in tv]}


@register_rule("kl-from-linf")
class KlFromLinf(Rule):
    """KL(q‖p) and KL(p‖q) ≤ 2·log cosh(δ/T) (≤ δ²/T², and ≤ 2δ/T of semantics §1.3).

    KL(q‖p) = E_q log(q/p) ≤ log E_q (q/p) = log E_p ρ², ρ = q/p = w/E_p w with w_i = e^(Δ_i/T) ∈
    [a, b] = [e^(−δ/T), e^(δ/T)]; by Kantorovich's inequality E w²/(E w)² ≤ (a + b)²/(4ab) =
    cosh²(δ/T). Likewise KL(p‖q) ≤ log E_p (p/q) = log(E_p w · E_p w⁻¹) ≤ cosh²(δ/T).
    """

    def conclude(self, premises: list[dict[str, Any]], params: dict[str, Any],
                 ctx: RuleContext) -> dict[str, Any]:
        d, c = _linf_premise(premises, "kl-from-linf")
        temp = _positive(params, "temperature", "kl-from-linf")
        out = []
        for v in d:
            y = _x(v, temp, factor=1)
            ch = cosh_up(y)
            out.append(INF if math.isinf(ch) else up(2 * Fraction(log_up(ch))))
        return {"quantity": "kl", "direction": "upper", **_carry(c, *CARRIED),
                "temperature": fx(temp), "bounds": [fx(v) for v in out]}


@register_rule("reward-from-tv")
class RewardFromTv(Rule):
    """|E_q r − E_p r| ≤ (sup r − inf r)·TV(p, q) ≤ 2R·TV for any reward with |r| ≤ R."""

    def conclude(self, premises: list[dict[str, Any]], params: dict[str, Any],
                 ctx: RuleContext) -> dict[str, Any]:
        _one(premises, "reward-from-tv")
        tv = _numeric(premises[0], "reward-from-tv", "tv", "upper")
        r = _positive(params, "reward_bound", "reward-from-tv")
        out = [INF if math.isinf(t) else up(2 * Fraction(r) * Fraction(t)) for t in tv]
        return {"quantity": "reward_drift", "direction": "upper",
                **_carry(premises[0], *CARRIED, "temperature"), "reward_bound": fx(r),
                "bounds": [fx(v) for v in out]}


def margins_from_box(box: StoredBox, keep: int = 1) -> np.ndarray:
    """Per input (keep=1) or per (input, position) (keep=2), a lower bound on the training
    kernel's top-1 margin z_k − max_{j≠k} z_j over the box (last axis = classes, k = argmax of
    train_lo, min over the other axes), rounded down."""
    lo, hi = box.train_lo, box.train_hi
    if lo.ndim < 2 or lo.shape[-1] < 2:
        raise RuleError("top1-from-margin: the logits need a class axis of size >= 2")
    k = np.argmax(lo, axis=-1)[..., None]
    top_lo = np.take_along_axis(lo, k, axis=-1)[..., 0]
    others = hi.copy()
    np.put_along_axis(others, k, -np.inf, axis=-1)
    m = top_lo - others.max(axis=-1)
    m = np.nextafter(m, -np.inf)  # one ulp below a round-to-nearest difference is <= the exact one
    axes = keep if m.ndim >= keep else 1  # (batch, classes): one position per input
    return m.reshape(int(np.prod(m.shape[:axes])), -1).min(axis=1)


@register_rule("top1-from-margin")
class Top1FromMargin(Rule):
    """If the training margin m_i = z_k − max_{j≠k} z_j > 2δ_i then argmax z_inf = argmax z_train = k.

    z_inf,k − z_inf,j ≥ (z_train,k − z_train,j) − 2‖Δz‖∞ > 0. Premises: [linf_drift of the logits,
    the state holding them]; m_i is a lower bound over every conforming training program (from
    train_lo/hi). Conclusion: agreement indicator (lower bound, 1 = certified) per input.
    """

    loose_keys = {"margins": "lower"}

    def conclude(self, premises: list[dict[str, Any]], params: dict[str, Any],
                 ctx: RuleContext) -> dict[str, Any]:
        _one(premises, "top1-from-margin", 2)
        d = _numeric(premises[0], "top1-from-margin", "linf_drift", "upper")
        st = premises[1]
        t = premises[0].get("tensor")
        if not isinstance(st, dict) or st.get("kind") != "state" or t not in st.get("outputs", {}):
            raise RuleError(f"top1-from-margin: second premise must be a state holding {t!r}")
        if _carry(premises[0], "slice", "rows") != _carry(st, "slice", "rows"):
            raise RuleError("top1-from-margin: the drift bounds and the state are over different "
                            "slices or rows")
        keep = premises[0].get("keep", 1)
        m = margins_from_box(ctx.box(st["outputs"][t], t), keep).tolist()
        if len(m) != len(d):
            raise RuleError("top1-from-margin: the drift bounds and the logits differ in batch size")
        agree = [1.0 if mi > 0 and Fraction(mi) > 2 * Fraction(di) else 0.0 for mi, di in zip(m, d)]
        return {"quantity": "top1_agreement", "direction": "lower", **_carry(premises[0], *CARRIED),
                "bounds": [fx(a) for a in agree], "margins": [fx(v) for v in m]}

    def check(self, application: dict[str, Any], ctx: RuleContext) -> list[str]:
        problems = super().check(application, ctx)
        claimed = application.get("conclusion", {}).get("bounds", [])
        prem = application.get("premises", [])
        if problems and isinstance(claimed, list) and prem:
            try:
                derived = self.conclude([p.get("conclusion", {}) for p in prem],
                                        application.get("params", {}), ctx)
                d = _numeric(prem[0]["conclusion"], "top1-from-margin")
            except (CertificateError, KeyError):
                return problems
            for i, (g, w) in enumerate(zip(claimed, derived["bounds"])):
                if unfx(g) > unfx(w):
                    return [f"top1-from-margin applied outside its precondition: input {i} has "
                            f"margin {unfx(derived['margins'][i])!r} <= 2δ = {2 * d[i]!r}"]
        return problems


def _down(x: np.ndarray) -> np.ndarray:
    """One ulp below a round-to-nearest result: ≤ the exact value (also at binade edges)."""
    return np.nextafter(x, -np.inf)


def agreement_from_box(box: StoredBox, keep: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(indicator, inference-margin lower bound) per input (keep 1) or (input, position).

    k = argmax train_lo; the training kernel picks k when tl_k > max_{j≠k} th_j; the inference
    kernel picks k when, for every j ≠ k, z_inf,k − z_inf,j ≥ max(il_k − ih_j,
    (tl_k − th_j) + (dl_k − dh_j)) > 0 (value box, or training box plus drift box), each
    difference rounded down.
    """
    tl, th, il, ih, dl, dh = (box.train_lo, box.train_hi, box.inf_lo, box.inf_hi, box.drift_lo,
                              box.drift_hi)
    if tl.ndim < 2 or tl.shape[-1] < 2:
        raise RuleError("top1-from-state: the logits need a class axis of size >= 2")
    k = np.argmax(tl, axis=-1)[..., None]

    def at_k(a: np.ndarray) -> np.ndarray:
        return np.take_along_axis(a, k, axis=-1)

    others = np.ones(tl.shape, dtype=bool)
    np.put_along_axis(others, k, False, axis=-1)
    with np.errstate(invalid="ignore"):
        train_gap = np.where(others, _down(at_k(tl) - th), np.inf).min(axis=-1)
        via_box = _down(at_k(il) - ih)
        via_drift = _down(_down(at_k(tl) - th) + _down(at_k(dl) - dh))
        inf_gap = np.where(others, np.maximum(np.nan_to_num(via_box, nan=-np.inf),
                                              np.nan_to_num(via_drift, nan=-np.inf)), np.inf)
    inf_gap = inf_gap.min(axis=-1)
    ok = (train_gap > 0) & (inf_gap > 0)
    axes = keep if ok.ndim >= keep else 1
    n = int(np.prod(ok.shape[:axes]))
    return ok.reshape(n, -1).all(axis=1), inf_gap.reshape(n, -1).min(axis=1)


@register_rule("top1-from-state")
class Top1FromState(Rule):
    """Top-1 agreement read off the state of the logits: both kernels' argmax is k = argmax
    train_lo for every conforming pair when tl_k > max_{j≠k} th_j and, for every j ≠ k,
    max(il_k − ih_j, (tl_k − th_j) + (dl_k − dh_j)) > 0 (z_inf = z_train + drift elementwise).
    Sharper than top1-from-margin, which uses one δ for every class. Premise: [state];
    params: tensor, keep (1: per input; 2: per (input, position)).
    """

    loose_keys = {"margins": "lower"}

    def conclude(self, premises: list[dict[str, Any]], params: dict[str, Any],
                 ctx: RuleContext) -> dict[str, Any]:
        _one(premises, "top1-from-state")
        st, t, keep = premises[0], params.get("tensor"), params.get("keep", 1)
        if not isinstance(st, dict) or st.get("kind") != "state" or t not in st.get("outputs", {}):
            raise RuleError(f"top1-from-state: premise must be a state holding {t!r}")
        if keep not in (1, 2):
            raise RuleError(f"top1-from-state: keep must be 1 or 2, not {keep!r}")
        ok, gap = agreement_from_box(ctx.box(st["outputs"][t], t), keep)
        out = {"quantity": "top1_agreement", "direction": "lower", "tensor": t,
               **_carry(st, "slice", "rows"),
               "bounds": [fx(1.0 if a else 0.0) for a in ok.tolist()],
               "margins": [fx(v) for v in gap.tolist()]}
        if keep != 1:
            out["keep"] = keep
        return out


# ---- aggregates and thresholds --------------------------------------------------------------

def _quantile_index(stat: str, n: int, direction: str) -> int:
    q = Fraction(stat[1:]) / 100
    if not 0 <= q <= 1:
        raise RuleError(f"aggregate: quantile {stat!r} outside p0..p100")
    h = q * (n - 1)
    return math.ceil(h) if direction == "upper" else math.floor(h)


@register_rule("aggregate")
class Aggregate(Rule):
    """A statistic s (max, min, mean, pQ) over a finite slice, from per-input bounds b_i.

    Each statistic is monotone in every value, so s(q(x_1..x_n)) ≤ s(b) for upper bounds (≥ for
    lower). pQ is bounded by the order statistic at index ⌈Q(n−1)⌉ (upper; ⌊·⌋ for lower), which
    bounds the linear, nearest-rank and 'higher' quantile definitions alike; the mean is rounded
    outward. In particular every statistic is ≤ max_i b_i.
    """

    def conclude(self, premises: list[dict[str, Any]], params: dict[str, Any],
                 ctx: RuleContext) -> dict[str, Any]:
        _one(premises, "aggregate")
        c = premises[0]
        if isinstance(c, dict) and "rows" in c:
            raise RuleError("aggregate: the premise covers only rows "
                            f"{c['rows']} of its slice (combine the chunks with concat-rows)")
        b = _numeric(c, "aggregate")
        direction = c.get("direction")
        if direction not in ("upper", "lower"):
            raise RuleError("aggregate: premise direction must be upper or lower")
        stat = params.get("stat")
        if stat == "max":
            v = max(b)
        elif stat == "min":
            v = min(b)
        elif stat == "mean":
            if any(math.isinf(x) for x in b):
                v = INF if direction == "upper" else -INF
            else:
                mean = sum(Fraction(x) for x in b) / len(b)
                v = up(mean) if direction == "upper" else down(mean)
        elif isinstance(stat, str) and stat.startswith("p"):
            try:
                v = sorted(b)[_quantile_index(stat, len(b), direction)]
            except (ValueError, ZeroDivisionError):
                raise RuleError(f"aggregate: bad quantile {stat!r}") from None
        else:
            raise RuleError(f"aggregate: unknown statistic {stat!r}; expected max, min, mean, pQ")
        return {**{k: v2 for k, v2 in c.items() if k not in ("bounds", "margins", "ratio_lo",
                                                             "ratio_hi")},
                "stat": stat, "n": len(b), "bounds": [fx(v)]}


_OPS = {"<=": "upper", "<": "upper", ">=": "lower", ">": "lower"}


@register_rule("threshold")
class Threshold(Rule):
    """bound ≤ τ (or <, ≥, >): from per-input bounds b_i, the clause holds when max_i b_i op τ
    (min_i b_i for lower bounds). Applying it when the bound misses τ is outside its precondition.
    """

    loose_keys = {"bound": "upper"}

    def conclude(self, premises: list[dict[str, Any]], params: dict[str, Any],
                 ctx: RuleContext) -> dict[str, Any]:
        _one(premises, "threshold")
        c = premises[0]
        b = _numeric(c, "threshold")
        op = params.get("op", "<=")
        if op not in _OPS:
            raise RuleError(f"threshold: unknown comparison {op!r}; expected <=, <, >=, >")
        if c.get("direction") != _OPS[op]:
            raise RuleError(f"threshold: '{op}' needs an {_OPS[op]} bound, the premise is "
                            f"{c.get('direction')!r}")
        tau = unfx(params.get("threshold"), "threshold params.threshold")
        bound = max(b) if _OPS[op] == "upper" else min(b)
        holds = {"<=": bound <= tau, "<": bound < tau, ">=": bound >= tau, ">": bound > tau}[op]
        if not holds:
            raise RuleError(f"threshold applied outside its precondition: bound {bound!r} {op} "
                            f"{tau!r} is false")
        return {**_carry(c, "quantity", *CARRIED, "temperature", "stat", "reward_bound"),
                "holds": True, "op": op, "threshold": fx(tau), "bound": [fx(bound)]}

    def directions(self, conclusion: dict[str, Any]) -> dict[str, str]:
        return {"bound": _OPS.get(conclusion.get("op", "<="), "upper")}

    def check(self, application: dict[str, Any], ctx: RuleContext) -> list[str]:
        problems = super().check(application, ctx)
        if problems:
            return problems
        c = application["conclusion"]
        b = unfx_list(c["bound"], "threshold conclusion.bound")[0]
        tau = unfx(c["threshold"])
        op = c["op"]
        if not {"<=": b <= tau, "<": b < tau, ">=": b >= tau, ">": b > tau}[op]:
            return [f"threshold conclusion bound {b!r} {op} {tau!r} is false"]
        return []


@register_rule("all")
class Conjunction(Rule):
    """A ∧ B ∧ …: a clause whose condition is a conjunction holds when every conjunct does.

    Premises: threshold applications (conclusions with holds = true); the conclusion lists them
    as ``parts``.
    """

    def conclude(self, premises: list[dict[str, Any]], params: dict[str, Any],
                 ctx: RuleContext) -> dict[str, Any]:
        if not premises:
            raise RuleError("all: needs at least one premise")
        for i, c in enumerate(premises):
            if not isinstance(c, dict) or c.get("holds") is not True:
                raise RuleError(f"all: premise {i} does not conclude that something holds")
        return {"holds": True, "parts": [dict(c) for c in premises]}
