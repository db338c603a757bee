"""Run an ONNX model as one conforming program: onnx's reference evaluator for data movement and
exact ops, with every op that rounds replaced by the Program's implementation (programs.py).
Independent of kcverify's executor and realizations: onnx.reference does the graph walking.

    run_program(model_proto, program, feeds) -> {output name: float64 array}

Float graph inputs are stored in the compute format. A tensor is *constant* when it is an
initializer, a Constant's output, or computed from constants only; a MatMul / Gemm reads its
constant operands as weights, the others as activations (the spec's roles). Samples run one at a
time (``per_sample="whole"``) unless the program says every tensor keeps the sample on axis 0.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from tests.soundness.adversarial.programs import Program

_UNARY = {"Exp": "exp", "Log": "log", "Tanh": "tanh", "Erf": "erf", "Sigmoid": "sigmoid",
          "Reciprocal": "reciprocal", "Softplus": "softplus"}


def constant_names(model: onnx.ModelProto) -> set[str]:
    g = model.graph
    const = {i.name for i in g.initializer}
    inputs = {i.name for i in g.input} - const
    for n in g.node:
        ins = [i for i in n.input if i]
        if n.op_type == "Constant" or (ins and all(i in const for i in ins)
                                       and not any(i in inputs for i in ins)):
            const.update(o for o in n.output if o)
    return const


def _f64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def _op_classes(prog: Program, const: set[str]) -> list[type]:
    def is_const(op: OpRun, k: int) -> bool:
        names = op.onnx_node.input
        return k < len(names) and names[k] in const

    def binary(fn_name: str):
        def _run(self, a, b, **_kw):
            if not np.issubdtype(np.asarray(a).dtype, np.floating):
                return (_int_binary(fn_name, a, b),)
            return (getattr(prog, fn_name)(_f64(a), _f64(b)),)
        return _run

    def unary(name: str):
        def _run(self, x, **_kw):
            return (prog.unary(name, _f64(x)),)
        return _run

    def sqrt(self, x, **_kw):
        return (prog.sqrt(_f64(x)),)

    def pow_(self, x, y, **_kw):
        y = _f64(y)
        if np.all(y == 2):
            return (prog.mul(_f64(x), _f64(x)),)
        with np.errstate(all="ignore"):
            ex = np.power(_f64(x), y)
        return (prog.prim(ex, "pow"),)

    def mark(op: OpRun) -> None:
        if prog.sites is not None:
            prog.sites.append(("node", op.onnx_node.name))

    def matmul(self, a, b, **_kw):
        mark(self)
        return (prog.matmul(_f64(a), _f64(b), is_const(self, 0), is_const(self, 1)),)

    def gemm(self, a, b, c=None, alpha=1.0, beta=1.0, transA=0, transB=0, **_kw):
        mark(self)
        a, b = _f64(a), _f64(b)
        a = a.T if transA else a
        b = b.T if transB else b
        y = prog.matmul(a, b, is_const(self, 0), is_const(self, 1))
        if alpha != 1.0:
            y = prog.mul(y, prog.store(alpha))
        if c is not None and beta != 0.0:
            cc = _f64(c) if beta == 1.0 else prog.mul(_f64(c), prog.store(beta))
            y = prog.add(y, cc)
        return (y,)

    def conv(self, x, w, b=None, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None,
             pads=None, strides=None, **_kw):
        if int(group) != 1:
            raise NotImplementedError("Conv group != 1")
        mark(self)
        x, w = _f64(x), _f64(w)
        nd = w.ndim - 2
        ks = list(kernel_shape or w.shape[2:])
        st = list(strides or [1] * nd)
        dl = list(dilations or [1] * nd)
        pb, pe = conv_pads(x.shape[2:], ks, st, dl, pads, auto_pad)
        if nd == 1:  # run as H = 1
            x, w = x[:, :, None, :], w[:, :, None, :]
            st, dl, pb, pe = [1, *st], [1, *dl], [0, *pb], [0, *pe]
        y = prog.conv(x, w, None if b is None else _f64(b), (st[0], st[1]),
                      (pb[0], pb[1], pe[0], pe[1]), (dl[0], dl[1]), is_const(self, 0),
                      is_const(self, 1))
        return (y[:, :, 0, :] if nd == 1 else y,)

    def softmax(self, x, axis=-1, **_kw):
        return (prog.softmax(_f64(x), axis),)

    def layernorm(self, x, scale=None, bias=None, axis=-1, epsilon=1e-5, stash_type=1, **_kw):
        g = None if scale is None else _f64(scale)
        b = None if bias is None else _f64(bias)
        y = prog.layernorm(_f64(x), g, b, axis, epsilon)
        return (y,) if len(self.onnx_node.output) == 1 else (y, None, None)

    def reduce(mean: bool):
        def _run(self, x, axes=None, keepdims=1, noop_with_empty_axes=0, **_kw):
            ax = () if axes is None else tuple(int(a) for a in np.asarray(axes).reshape(-1))
            if not ax and noop_with_empty_axes:
                return (_f64(x),)
            return (prog.reduce_sum(_f64(x), ax, bool(keepdims), mean),)
        return _run

    def gelu(self, x, approximate="none", **_kw):
        return (prog.gelu(_f64(x), approximate),)

    def where(self, c, x, y, **_kw):  # a selection: exact (float inputs as float64)
        x, y = np.asarray(x), np.asarray(y)
        if np.issubdtype(x.dtype, np.floating) or np.issubdtype(y.dtype, np.floating):
            x, y = _f64(x), _f64(y)
        return (np.where(c, x, y),)

    table = {
        "Where": where,
        "Add": binary("add"), "Sub": binary("sub"), "Mul": binary("mul"), "Div": binary("div"),
        "Sqrt": sqrt, "Pow": pow_, "MatMul": matmul, "Gemm": gemm, "Softmax": softmax,
        "LayerNormalization": layernorm, "ReduceSum": reduce(False), "ReduceMean": reduce(True),
        "Gelu": gelu, "Conv": conv,
    }
    for op, name in _UNARY.items():
        table[op] = unary(name)
    return [type(op, (OpRun,), {"op_domain": "", "_run": fn}) for op, fn in table.items()]


def conv_pads(spatial, kernel, strides, dilations, pads, auto_pad) -> tuple[list, list]:
    """(begin, end) pads per spatial axis, from the ONNX operator text (Conv, auto_pad): SAME_*
    gives out = ceil(in / stride) and the total (out - 1) stride + (k - 1) d + 1 - in split in
    halves, the odd one at the end (UPPER) or the beginning (LOWER)."""
    nd = len(spatial)
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else str(auto_pad)
    if auto_pad in ("NOTSET", ""):
        p = [int(v) for v in (pads if pads is not None else [0] * 2 * nd)]
        return p[:nd], p[nd:]
    if auto_pad == "VALID":
        return [0] * nd, [0] * nd
    begin, end = [], []
    for size, k, s, d in zip(spatial, kernel, strides, dilations):
        out = -(-int(size) // int(s))
        total = max(0, (out - 1) * s + (k - 1) * d + 1 - int(size))
        small = total // 2
        begin.append(small if auto_pad == "SAME_UPPER" else total - small)
        end.append(total - begin[-1])
    return begin, end


def _int_binary(name: str, a, b) -> np.ndarray:
    a, b = np.asarray(a), np.asarray(b)
    if name == "add":
        return a + b
    if name == "sub":
        return a - b
    if name == "mul":
        return a * b
    return a // b if np.issubdtype(a.dtype, np.integer) else a / b


class ProgramRunner:
    """One model, many programs: ``runner(program, feeds)`` -> outputs (float64)."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.const = constant_names(model)
        self.inputs = [i.name for i in model.graph.input if i.name not in self.const]
        self.outputs = [o.name for o in model.graph.output]
        self._sessions: dict[int, ReferenceEvaluator] = {}

    def session(self, prog: Program) -> ReferenceEvaluator:
        return ReferenceEvaluator(self.model, new_ops=_op_classes(prog, self.const))

    def __call__(self, prog: Program, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        sess = self.session(prog)
        stored = {}
        for k, v in feeds.items():
            v = np.asarray(v)
            stored[k] = prog.store(v) if np.issubdtype(v.dtype, np.floating) else v
        batch = {v.shape[0] for v in stored.values() if v.ndim}
        if prog.per_sample == "axis0" or batch == {1}:  # one sample (or every tensor batched)
            res = sess.run(None, stored)
            return {o: _f64(r) for o, r in zip(self.outputs, res)}
        n = next(iter(stored.values())).shape[0]
        outs: dict[str, list[np.ndarray]] = {o: [] for o in self.outputs}
        for b in range(n):
            one = {k: v[b:b + 1] for k, v in stored.items()}
            res = sess.run(None, one)
            for o, r in zip(self.outputs, res):
                outs[o].append(_f64(r))
        return {o: np.concatenate([np.atleast_1d(a) for a in v], axis=0) for o, v in outs.items()}
