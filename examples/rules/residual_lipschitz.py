"""A researcher's compositional rule (paper section 9.3), loaded with
``--rules examples/rules/residual_lipschitz.py`` by ``kcverify prove``, ``check`` and ``registry``.

``residual-lipschitz`` bounds the output drift of the model's last block, a residual block
y = x + g(x) (g: Gemm / MatMul / bias Add / Relu), from its *input* drift and a certified
Lipschitz constant, instead of re-running the block on the drifted input: the block itself is
certified once with no input drift (its own kernel error), and the input drift is carried through
the block's exact Jacobian I + W_m Θ ... W_1, where the skip path and the branch can cancel. The
bound engine re-running the block on a drifted input box adds |W_m| ... |W_1| δ to the skip
path's δ instead, so on input regions (boxes around the slice's points) this rule wins. It
derives ``logit_linf``: the planner tries it beside ``linf-from-state`` and keeps the tighter
(docs/rules.md has the numbers).
"""

from __future__ import annotations

import base64
import math
from fractions import Fraction
from typing import Any

import numpy as np

from kcverify.certs import Rule, RuleContext, RuleError, register_rule
from kcverify.certs.encoding import INF, fx, unfx, up

OPS = ("Gemm", "MatMul", "Add", "Relu", "Identity")
_U64 = 2.0**-53


class ResidualLipschitz(Rule):
    """‖y_inf − y_train‖∞ ≤ ε_i + L·δ_i + 2η_i for the last block B, y = B(x), per input i.

    Premises: [S, C]. S: a state holding x, B's input (the chain of the blocks before B):
    x_train ∈ T, x_inf ∈ I, ‖x_inf − x_train‖∞ ≤ δ_i (its drift box). C: a block certificate of B
    whose in_state for x has train and inf boxes that both contain T ∪ I (call the train box H,
    a box, so convex) and a drift box containing 0: re-checked by the checker like any block
    certificate, so its digest is a block of the model. Params: ``graph`` (B's ONNX, base64,
    whose digest must be C's), ``input`` x, ``output`` y, ``lipschitz`` L (hex).

    Soundness. Fix conforming programs P (training) and Q (inference) and a slice input; on B
    they are functions of B's input, and y_inf − y_train = Q(x_inf) − P(x_train)
    = [Q(x_inf) − P(x_inf)] + [P(x_inf) − P(x_train)].
    (1) x_inf ∈ H and the pair (u, u) with u = x_inf has drift 0 in C's drift box, so C gives
        |Q(x_inf) − P(x_inf)|_j ≤ ε_ij, the largest |drift| of C's out_state at input i.
    (2) P = F + e with F the exact real function of B: F(a) − F(b) for a, b ∈ H is
        (I + W_m Θ_{m−1} W_{m−1} ... Θ_1 W_1)(a − b): affine maps are exact, and a ReLU on the
        segment [b, a] ⊂ H gives relu(p) − relu(q) = θ (p − q) with θ ∈ [0, 1], θ = 1 where the
        pre-activation box over H is >= 0 and θ = 0 where it is <= 0 (boxes computed from H with
        outward rounding). The interval product J ⊇ every such matrix, so
        ‖F(a) − F(b)‖∞ ≤ L_i ‖a − b‖∞ with L_i = max_j Σ_l max(|J_lo|, |J_hi|)_jl.
    (3) |e(u)|_j ≤ η_ij for u ∈ H: the training spec's error model (kcverify.kernels.spec):
        products exact, sums in the accumulator in any order (γ_n(u_acc)·Σ|a w| plus n·η_acc for
        underflow), each stored result rounded to the compute format (ulps·u_c·|v| + η_c; doubled
        for rounding: any); ReLU is exact and 1-Lipschitz, so input errors pass through |W|.
        The weights must be exact in the compute format (fp32 or fp64 compute, no casts).
    Hence |y_inf − y_train|_j ≤ ε_ij + L_i δ_i + 2η_ij, and the rule concludes per input
    max_j (ε_ij + 2η_ij) + L δ_i with the claimed L ≥ max_i L_i (a smaller L is outside the
    rule), rounded upward in exact rational arithmetic.
    """

    derives = "logit_linf"

    # ---- the planner's side: build [S, C] and the params (docs/rules.md, PlanContext) ----
    def plan(self, ctx: Any) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
        from kcverify.bounds import DiffBox

        blocks = ctx.blocks
        k = len(blocks) - 1
        last = blocks[-1]
        if ctx.keep != 1 or k < 1 or list(last.outputs) != [ctx.output] or len(last.inputs) != 1:
            return None
        x = last.inputs[0]
        train = ctx.builder.ctx.kernel_specs["train"]
        state = ctx.prefix(k)
        if x not in state["conclusion"]["outputs"]:
            return None
        box = ctx.builder.ctx.box(state["conclusion"]["outputs"][x], x)
        lo = np.minimum(box.train_lo, box.inf_lo)
        hi = np.maximum(box.train_hi, box.inf_hi)
        try:
            lips, _ = analyse(last.graph, x, ctx.output, lo, hi, train)
        except RuleError:
            return None  # an op or a spec this rule does not model
        zero = np.zeros_like(lo)
        block = ctx.certify(k, {x: DiffBox(lo, hi, lo.copy(), hi.copy(), zero, zero.copy())})
        params = {"graph": base64.b64encode(last.graph.to_onnx().SerializeToString()).decode(),
                  "input": x, "output": ctx.output, "lipschitz": fx(float(np.max(lips)))}
        return [state, block], params

    # ---- the rule ----
    def conclude(self, premises: list[dict[str, Any]], params: dict[str, Any],
                 ctx: RuleContext) -> dict[str, Any]:
        if len(premises) != 2:
            raise RuleError("residual-lipschitz takes [state, block]")
        state, blk_node = premises
        if state.get("kind") != "state" or blk_node.get("kind") != "block":
            raise RuleError("residual-lipschitz takes [state, block]")
        for key in ("graph", "input", "output", "lipschitz"):
            if key not in params:
                raise RuleError(f"residual-lipschitz: params lack {key!r}")
        x, y = str(params["input"]), str(params["output"])
        if x not in state.get("outputs", {}):
            raise RuleError(f"residual-lipschitz: the state does not hold the block input {x!r}")
        sx = ctx.box(state["outputs"][x], x)
        blk = ctx.block(blk_node["ref"])
        graph = _graph(params["graph"])
        if graph.digest() != blk.digest:
            raise RuleError("residual-lipschitz: params.graph is not the certified block "
                            "(digests differ)")
        if set(blk.in_state) != {x} or y not in blk.out_state:
            raise RuleError(f"residual-lipschitz: the block certificate must map {x!r} alone to "
                            f"{y!r}")
        cin, cout = blk.in_state[x], blk.out_state[y]
        if cin.train_lo.shape != sx.train_lo.shape or cout.drift_lo.shape[0] != sx.train_lo.shape[0]:
            raise RuleError("residual-lipschitz: the block certificate and the state differ in shape")
        low, high = np.minimum(sx.train_lo, sx.inf_lo), np.maximum(sx.train_hi, sx.inf_hi)
        for lo_, hi_, what in ((cin.train_lo, cin.train_hi, "train"), (cin.inf_lo, cin.inf_hi, "inf")):
            if not (np.all(lo_ <= low) and np.all(high <= hi_)):
                raise RuleError(f"residual-lipschitz: the block certificate's {what} box for {x!r} "
                                "does not contain both kernels' values of the state")
        if not (np.all(cin.drift_lo <= 0) and np.all(cin.drift_hi >= 0)):
            raise RuleError("residual-lipschitz: the block certificate's drift box excludes 0")
        specs = getattr(ctx, "kernel_specs", None)
        if not specs or "train" not in specs:
            raise RuleError("residual-lipschitz: needs the contract's kernel specs (ctx.kernel_specs)")
        lips, eta = analyse(graph, x, y, cin.train_lo, cin.train_hi, specs["train"])
        claimed = unfx(params["lipschitz"], "residual-lipschitz params.lipschitz")
        need = float(np.max(lips))
        if not claimed >= need:
            raise RuleError(f"residual-lipschitz: lipschitz {claimed!r} is below the constant "
                            f"{need!r} certified for the block's exact function on its box")
        n = sx.train_lo.shape[0]
        eps = np.maximum(np.abs(cout.drift_lo), np.abs(cout.drift_hi)).reshape(n, -1)
        delta = np.maximum(np.abs(sx.drift_lo), np.abs(sx.drift_hi)).reshape(n, -1).max(axis=1)
        bounds = []
        for i in range(n):
            own = [Fraction(float(e)) + 2 * Fraction(float(h)) if math.isfinite(e + h) else None
                   for e, h in zip(eps[i], eta[i].reshape(-1))]
            if any(v is None for v in own) or not math.isfinite(claimed * delta[i]):
                bounds.append(INF)
                continue
            bounds.append(up(max(own) + Fraction(claimed) * Fraction(float(delta[i]))))
        out: dict[str, Any] = {"quantity": "linf_drift", "direction": "upper", "tensor": y,
                               "bounds": [fx(b) for b in bounds]}
        if "slice" in state:
            out["slice"] = state["slice"]
        return out


def _graph(raw: Any) -> Any:
    import onnx

    from kcverify.models.ir import from_onnx

    try:
        model = onnx.load_from_string(base64.b64decode(str(raw).encode(), validate=True))
        return from_onnx(model, name="residual-lipschitz")
    except Exception as e:  # noqa: BLE001 - decode / protobuf errors have many types
        raise RuleError(f"residual-lipschitz: params.graph is not a base64 ONNX model "
                        f"({type(e).__name__})") from None


# ---- the analysis: exact value boxes, Jacobian intervals, training errors, outward rounded ----

def _up(a: np.ndarray) -> np.ndarray:
    return np.nextafter(a, np.inf)


def _down(a: np.ndarray) -> np.ndarray:
    return np.nextafter(a, -np.inf)


def _dot_up(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """An upper bound on a @ b for nonnegative a, b (float64 sums: relative error <= γ_m)."""
    m = a.shape[-1]
    return _up(np.matmul(a, b) * (1 + (m + 2) * 2 * _U64))


def _imatmul(w: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """{w @ v : lo <= v <= hi} enclosed, w exact (k_out, k_in), v (..., k_in, c), outward."""
    wp, wn = np.maximum(w, 0.0), np.minimum(w, 0.0)
    lo_o = np.matmul(wp, lo) + np.matmul(wn, hi)
    hi_o = np.matmul(wp, hi) + np.matmul(wn, lo)
    pad = _dot_up(np.abs(w), np.maximum(np.abs(lo), np.abs(hi))) * ((w.shape[-1] + 2) * 2 * _U64)
    return _down(lo_o - pad), _up(hi_o + pad)


def _spec(spec: Any) -> Any:
    if hasattr(spec, "compute"):
        return spec
    from kcverify.certs.smt_rule import spec_from_canonical

    return spec_from_canonical("train", dict(spec))


def analyse(graph: Any, x: str, y: str, lo: np.ndarray, hi: np.ndarray, train: Any
            ) -> tuple[np.ndarray, np.ndarray]:
    """(L_i, η_i): per input i of the box [lo, hi] of x (n, d), a Lipschitz constant in L-inf of
    the block's exact function from x to y, and per entry of y a bound on the training program's
    error (the class docstring's (2) and (3)). RuleError for what the analysis does not model."""
    spec = _spec(train)
    if spec.weights is not None or spec.activations is not None or spec.onnx is not None:
        raise RuleError("residual-lipschitz: the training spec casts or names a graph; only "
                        "plain arithmetic is modelled")
    if spec.compute.name not in ("fp32", "fp64"):
        raise RuleError(f"residual-lipschitz: training compute {spec.compute.name}: the float32 "
                        "weights must be exact in it (fp32 or fp64)")
    if lo.ndim != 2:
        raise RuleError("residual-lipschitz: the block input must be (batch, features)")
    inputs = [v.name for v in graph.inputs if v.name not in graph.initializers]
    if inputs != [x] or [v.name for v in graph.outputs] != [y]:
        raise RuleError(f"residual-lipschitz: the block must map {x!r} alone to {y!r}")
    twice = 2.0 if spec.rounding == "any" else 1.0
    u_c, eta_c = spec.compute.u, spec.compute.eta
    u_add = twice * spec.ulp("add") * u_c
    consts = {k: np.asarray(v, dtype=np.float64) for k, v in graph.initializers.items()}
    n, d = lo.shape
    eye = np.broadcast_to(np.eye(d), (n, d, d))
    # tensor -> (exact value lo, hi), (Jacobian lo, hi), training error bound
    st: dict[str, Any] = {x: ((lo, hi), (eye, eye), np.zeros_like(lo))}

    def rounded(v: tuple[np.ndarray, np.ndarray], e: np.ndarray, rel: float) -> np.ndarray:
        mag = _up(np.maximum(np.abs(v[0]), np.abs(v[1])) + e)
        return _up(e + _up(mag * rel) + eta_c)

    for node in graph.nodes:
        op, ins = node.op_type, list(node.inputs)
        if op == "Constant":
            consts[node.outputs[0]] = np.asarray(node.attrs["value"], dtype=np.float64)
            continue
        if op not in OPS:
            raise RuleError(f"residual-lipschitz: op {op} is not modelled ({', '.join(OPS)})")
        if op in ("Relu", "Identity"):
            (vlo, vhi), (jlo, jhi), e = st[ins[0]]
            if op == "Relu":
                on, off = vlo >= 0, vhi <= 0
                jlo = np.where(on[..., None], jlo, np.where(off[..., None], 0.0, np.minimum(jlo, 0)))
                jhi = np.where(on[..., None], jhi, np.where(off[..., None], 0.0, np.maximum(jhi, 0)))
                vlo, vhi = np.maximum(vlo, 0.0), np.maximum(vhi, 0.0)
            st[node.outputs[0]] = ((vlo, vhi), (jlo, jhi), e)
            continue
        if op == "Add":
            a, b = ins
            if a in consts and b in consts:
                raise RuleError("residual-lipschitz: a constant Add belongs to the weights")
            if a in consts or b in consts:
                t, c = (b, consts[a]) if a in consts else (a, consts[b])
                (vlo, vhi), jac, e = st[t]
                v = (_down(vlo + c), _up(vhi + c))
                st[node.outputs[0]] = (v, jac, rounded(v, e, u_add))
                continue
            (alo, ahi), (ajl, ajh), ea = st[a]
            (blo, bhi), (bjl, bjh), eb = st[b]
            v = (_down(alo + blo), _up(ahi + bhi))
            st[node.outputs[0]] = (v, (_down(ajl + bjl), _up(ajh + bjh)),
                                   rounded(v, _up(ea + eb), u_add))
            continue
        # Gemm / MatMul: a tensor times constant weights (and Gemm's constant bias)
        a, w_name = ins[0], ins[1]
        if a not in st or w_name not in consts:
            raise RuleError(f"residual-lipschitz: {op} {node.name!r} needs a tensor times "
                            "constant weights")
        w = consts[w_name]
        if op == "Gemm":
            if node.attrs.get("transA", 0) or float(node.attrs.get("alpha", 1.0)) != 1.0 \
                    or float(node.attrs.get("beta", 1.0)) != 1.0:
                raise RuleError(f"residual-lipschitz: Gemm {node.name!r}: transA, alpha, beta "
                                "are not modelled")
            w = w.T if node.attrs.get("transB", 0) else w
        if w.ndim != 2:
            raise RuleError(f"residual-lipschitz: {op} {node.name!r}: 2-d weights only")
        wt = np.ascontiguousarray(w.T)  # (out, in)
        (vlo, vhi), (jlo, jhi), e = st[a]
        olo, ohi = _imatmul(wt, vlo[..., None], vhi[..., None])
        v = (olo[..., 0], ohi[..., 0])
        jac = _imatmul(wt, jlo, jhi)
        m = wt.shape[1]
        acc = spec.accumulate
        g = m * acc.u / (1 - m * acc.u) if m * acc.u < 1 else math.inf
        mag_in = _up(np.maximum(np.abs(vlo), np.abs(vhi)) + e)
        err = _up(_dot_up(np.abs(wt), e[..., None])[..., 0]
                  + _up(_dot_up(np.abs(wt), mag_in[..., None])[..., 0] * (twice * g))
                  + m * acc.eta)
        err = rounded(v, err, twice * u_c)  # the result stored in the compute format
        if op == "Gemm" and len(ins) > 2 and ins[2]:
            if ins[2] not in consts:
                raise RuleError(f"residual-lipschitz: Gemm {node.name!r}: the bias must be constant")
            c = consts[ins[2]]
            v = (_down(v[0] + c), _up(v[1] + c))
            err = rounded(v, err, u_add)
        st[node.outputs[0]] = (v, jac, err)
    if y not in st:
        raise RuleError(f"residual-lipschitz: the block does not compute {y!r}")
    _, (jlo, jhi), eta = st[y]
    lips = _dot_up(np.maximum(np.abs(jlo), np.abs(jhi)), np.ones((d, 1)))[..., 0].max(axis=1)
    if np.any(np.isnan(lips)) or np.any(np.isnan(eta)):
        raise RuleError("residual-lipschitz: the analysis produced NaN (an overflow)")
    return lips, eta


register_rule("residual-lipschitz")(ResidualLipschitz)
