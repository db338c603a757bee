"""Affine-ReLU chains: batched differential symbolic bounds over input boxes (the parts of a split).

A model whose float input flows through one path of ``Sub/Add/Mul/Div`` by constants,
``MatMul``/``Gemm`` with constant weights, ``Relu`` and layout ops (``Flatten``, ``Reshape`` to
(batch, n), ``Identity``) to its output (ACAS Xu, most VNN-COMP MLPs) is an *affine-ReLU chain*.
For such a model ``ChainBounds(chain, train, inf).bound(lo, hi)`` bounds, for every box
[lo_b, hi_b] of a batch and every pair of programs conforming to the two kernel specs
(kcverify.kernels.spec), each kernel's output value and the drift ``z_inf - z_train``.

The domain (Neurify's symbolic linear relaxation, with NeuroDiff's differential forms). Per box
the input x ranges over [lo, hi] (m variables). Every tensor carries, per kernel k, a lower and
an upper affine form in x, L_k(x) <= v_k <= U_k(x), and the drift carries its own pair
Dl(x) <= v_inf - v_train <= Du(x) over the same x, so the shared dependence on x cancels in the
drift instead of being bounded twice. A form is a tensor (batch, n, m + 1): coefficients, then
the constant. Concretizing a form over the box gives the interval bounds.

* Input: each kernel stores x in its compute format: |fl(x) - x| <= u|x| + eta (forms x -+ e).
  Round to nearest is deterministic, so two kernels with the same compute format store the same
  value: drift 0 (else the sum of both errors).
* Affine step y = a W (+ b) for kernel k: W_k is the weight as the kernel uses it (the exact cast
  of the spec's ``weights``, kcverify.bounds.casts.weight_cast; without a cast, the hull of W and
  its compute-format rounding, as the interval rule). U_y = W+ U_a + W- L_a (L alike); the kernel
  error e_k = gamma_n(u_acc) |a| |W| + n eta_acc (any-order accumulation of exact products) plus
  two roundings to the compute format (r|y| + eta each, r = ulps * u) and, for a bias, one more
  rounding; e_k enters the constants. Drift: y_i - y_t = dA W_i + a_t (W_i - W_t) + e_i - e_t, so
  Du = W_i+ Du_a + W_i- Dl_a + dW+ U_t + dW- L_t + e_i + e_t.
* ReLU, each kernel: stable neurons keep (or zero) their forms; an unstable one (l < 0 < u)
  gets the upper relaxation lam (U - l), lam = u/(u - l), and the lower relaxation alpha L with
  alpha = 1 if u > -l else 0 (CROWN's choice).
* ReLU, drift r = relu(z_i) - relu(z_t), z_i = z_t + d. Always min(0, d) <= r <= max(0, d)
  (relu is monotone and 1-Lipschitz), relaxed like a ReLU: max(0, d) <= lam_d (Du - dl) and
  min(0, d) >= mu_d (Dl - du), mu_d = -dl/(du - dl). By stability of the two kernels: both active
  r = d; both inactive r = 0; train active, inf inactive r = -z_t; train inactive, inf active
  r = z_i; train active: r >= d; train inactive: r in [0, relax(z_i)]; inf active: r <= d and
  r <= z_i; inf inactive: r in [-relax(z_t), 0]. Per neuron, of the valid forms the one with the
  tighter concretization is kept, and the concrete drift box is met with the value-set difference.
* Back-substitution (CROWN, ``backward_value`` / ``backward_drift``) re-derives the intermediate
  pre-activation boxes of unstable neurons and the outputs' bounds; with ``alpha_iters`` the
  lower slopes of the intermediate value bounds are optimised per objective row
  (``optimise_slopes``, alpha-CROWN: relu(z) >= a z for every a in [0, 1], so any slope is sound).

Soundness of the verifier's own arithmetic: all forms are float64; every form operation adds a
bound on its rounding error over the box (k u64 |coefficients| |x| + |constant|, k >= the number
of terms summed) to the constant, folded in with ``nextafter`` outward; relaxation slopes are
rounded up where a larger slope keeps the relaxation sound. A possible overflow (a value or an
accumulator beyond its format's max_finite) makes that box's bounds infinite.

``bound`` is one batched tensor program over the boxes (no Python loop over boxes or neurons);
parts of a split are bounded together.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kcverify.kernels.formats import gamma
from kcverify.kernels.spec import KernelSpec
from kcverify.models.ir import Graph

F64 = torch.float64
U64 = 2.0 ** -53
TINY = 2.0 ** -1000
INF = math.inf
_LAYOUT = ("Flatten", "Reshape", "Identity", "Dropout")
ROW_CHUNK = 1 << 30  # see ChainBounds.row_chunk


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run torch single-threaded inside the block (restored after): the domain's tensors are
    small, and on a shared CPU intra-op threads made a split 8x slower (measured on ACAS Xu)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def chain_method(alpha_iters: int) -> str:
    """The name of the chain domain with ``alpha_iters`` slope-optimisation steps, as a
    split-cover certificate records it: ``chain`` (CROWN's slopes) or ``chain:alpha<N>``."""
    return "chain" if not alpha_iters else f"chain:alpha{int(alpha_iters)}"


def alpha_of(method: str) -> int:
    """The slope-optimisation steps of a chain method name (``chain_method``'s inverse);
    ValueError for a name that is not one."""
    if method == "chain":
        return 0
    if method.startswith("chain:alpha") and method[11:].isdigit() and int(method[11:]) > 0:
        return int(method[11:])
    raise ValueError(f"not a chain method: {method!r}")


class NotAChain(Exception):
    """The model is not an affine-ReLU chain (the reason says which node)."""


@dataclass(frozen=True)
class Step:
    """One step: ``affine`` (y = x W + b; W (n_in, n_out), b (n_out,) or None; ``rounded``:
    whether the bias add is a separate rounded op), ``scale`` (y = x * s, elementwise constant,
    ``prim`` 'mul' or 'div' with s the divisor), ``shift`` (y = x + c), or ``relu``."""

    kind: str
    node: str
    W: np.ndarray | None = None
    b: np.ndarray | None = None
    prim: str = ""


@dataclass(frozen=True)
class AffineChain:
    """The model as a chain of steps from its single float input to its single output."""

    input: str
    output: str
    input_shape: tuple[int, ...]  # without the batch axis
    n_in: int
    n_out: int
    steps: tuple[Step, ...]

    def weights(self) -> list[tuple[np.ndarray, np.ndarray | None]]:
        return [(s.W, s.b) for s in self.steps if s.kind == "affine"]


def _const(graph: Graph, name: str) -> np.ndarray | None:
    if name in graph.initializers:
        return np.asarray(graph.initializers[name])
    for n in graph.nodes:
        if n.op_type == "Constant" and name in n.outputs:
            v = n.attrs.get("value")
            return None if v is None else np.asarray(v)
    return None


def extract_chain(graph: Graph) -> AffineChain:
    """The affine-ReLU chain of ``graph``; NotAChain names the first node that does not fit."""
    floats = [v for v in graph.inputs if (v.dtype or "float32").startswith("float")]
    if len(graph.inputs) != 1 or len(floats) != 1 or len(graph.outputs) != 1:
        raise NotAChain("the model needs exactly one float input and one output")
    inp, out = graph.inputs[0], graph.outputs[0].name
    shape = tuple(inp.shape or ())
    if not shape or not all(isinstance(d, int) and d > 0 for d in shape[1:]):
        raise NotAChain(f"input {inp.name!r} needs a static shape (batch, ...), got {shape}")
    feat = tuple(int(d) for d in shape[1:])
    n = int(np.prod(feat)) if feat else 1
    consts = graph.constant_names()
    cur, width, steps = inp.name, n, []
    flat = len(feat) <= 1
    for node in graph.nodes:
        if node.op_type == "Constant" or all((not i) or i in consts for i in node.inputs):
            continue
        live = [i for i in node.inputs if i and i not in consts]
        if live != [cur]:
            raise NotAChain(f"node {node.name!r} ({node.op_type}) does not continue the chain")
        op = node.op_type
        if op in _LAYOUT:
            if op == "Flatten" and int(node.attrs.get("axis", 1)) != 1:
                raise NotAChain(f"Flatten {node.name!r}: only axis 1 keeps the batch axis")
            if op == "Reshape":
                tgt = _const(graph, node.inputs[1])
                if tgt is None or tgt.size != 2 or int(tgt[-1]) not in (-1, width):
                    raise NotAChain(f"Reshape {node.name!r}: only to (batch, {width})")
            flat = flat or op in ("Flatten", "Reshape")
        elif op == "Relu":
            steps.append(Step("relu", node.name))
        elif op in ("MatMul", "Gemm"):
            if not flat:
                raise NotAChain(f"{op} {node.name!r}: the input must be flattened first")
            if node.inputs[0] != cur:
                raise NotAChain(f"{op} {node.name!r}: the constant operand must be on the right")
            W = _const(graph, node.inputs[1])
            if W is None or W.ndim != 2:
                raise NotAChain(f"{op} {node.name!r}: needs a constant 2-D weight")
            b = None
            if op == "Gemm":
                if (int(node.attrs.get("transA", 0)) or float(node.attrs.get("alpha", 1.0)) != 1.0
                        or float(node.attrs.get("beta", 1.0)) != 1.0):
                    raise NotAChain(f"Gemm {node.name!r}: only transA=0, alpha=beta=1")
                if int(node.attrs.get("transB", 0)):
                    W = W.T
                if len(node.inputs) > 2 and node.inputs[2]:
                    b = _const(graph, node.inputs[2])
                    if b is None:
                        raise NotAChain(f"Gemm {node.name!r}: the bias must be constant")
                    b = np.broadcast_to(b.reshape(-1), (W.shape[1],)).copy()
            if W.shape[0] != width:
                raise NotAChain(f"{op} {node.name!r}: weight rows {W.shape[0]} != width {width}")
            steps.append(Step("affine", node.name, np.ascontiguousarray(W), b))
            width = W.shape[1]
        elif op in ("Add", "Sub", "Mul", "Div"):
            other = [i for i in node.inputs if i != cur]
            if len(other) != 1:
                raise NotAChain(f"{op} {node.name!r}: needs one constant operand")
            c = _const(graph, other[0])
            if c is None:
                raise NotAChain(f"{op} {node.name!r}: the other operand is not a constant")
            if op in ("Sub", "Div") and node.inputs[0] != cur:
                raise NotAChain(f"{op} {node.name!r}: the constant must be the second operand")
            try:
                full = np.broadcast_to(c, (1, *feat) if not flat else (1, width)).reshape(-1)
            except ValueError:
                raise NotAChain(f"{op} {node.name!r}: the constant does not broadcast") from None
            if op in ("Add", "Sub"):
                steps.append(Step("shift", node.name, b=(-full if op == "Sub" else full).copy()))
            else:
                steps.append(Step("scale", node.name, b=full.astype(np.float64).copy(),
                                  prim="mul" if op == "Mul" else "div"))
        else:
            raise NotAChain(f"node {node.name!r}: op {op} is not an affine-ReLU chain step")
        cur = node.outputs[0]
    if cur != out:
        raise NotAChain(f"the chain ends at {cur!r}, not at the output {out!r}")
    return AffineChain(inp.name, out, feat, n, width, _fuse(steps))


def _fuse(steps: list[Step]) -> tuple[Step, ...]:
    """A shift right after an affine step is its (separately rounded) bias."""
    out: list[Step] = []
    for s in steps:
        if s.kind == "shift" and out and out[-1].kind == "affine" and out[-1].prim != "biased":
            a = out[-1]
            b = s.b if a.b is None else None
            if b is not None:
                out[-1] = Step("affine", a.node, a.W, b, prim="biased")
                continue
        out.append(s)
    return tuple(out)


# --- forms ---------------------------------------------------------------------------------
# A form is a tensor (batch, m + 1, n): rows 0..m-1 the coefficients of x_1..x_m, row m the
# constant, one column per neuron (so x W is one matmul).
def _up(v: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(v, torch.full_like(v, INF))


def _dn(v: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(v, torch.full_like(v, -INF))


class Box:
    """The batch of input boxes: lo, hi (batch, m) and their magnitudes."""

    def __init__(self, lo: torch.Tensor, hi: torch.Tensor) -> None:
        self.lo, self.hi = lo[:, :, None], hi[:, :, None]
        self.mag = torch.maximum(lo.abs(), hi.abs())[:, :, None]
        self.m = lo.shape[1]

    def upper(self, F: torch.Tensor) -> torch.Tensor:
        """max over the box of the form F (batch, m+1, n), rounded up."""
        A, c = F[:, :-1], F[:, -1]
        v = torch.maximum(A * self.lo, A * self.hi).sum(1) + c
        return _up(v + (self.m + 4) * U64 * self.magnitude(F))

    def lower(self, F: torch.Tensor) -> torch.Tensor:
        A, c = F[:, :-1], F[:, -1]
        v = torch.minimum(A * self.lo, A * self.hi).sum(1) + c
        return _dn(v - (self.m + 4) * U64 * self.magnitude(F))

    def magnitude(self, F: torch.Tensor) -> torch.Tensor:
        """An upper bound of |F(x)| over the box (up to a relative 2^-50)."""
        return (F[:, :-1].abs() * self.mag).sum(1) + F[:, -1].abs() + TINY


def _shift(F: torch.Tensor, add: torch.Tensor, up: bool) -> torch.Tensor:
    """F + add in the constant (add >= 0 widens up, <= 0 down), rounded outward."""
    c = F[:, -1] + add
    return torch.cat([F[:, :-1], (_up(c) if up else _dn(c))[:, None]], 1)


def _matmul(Fp: torch.Tensor, Fn: torch.Tensor, W: torch.Tensor, box: Box, up: bool,
            parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
            ) -> torch.Tensor:
    """Fp Wp + Fn Wn for W = Wp + Wn (Wp >= 0 >= Wn): the upper (up) or lower form of x W, with
    its float64 rounding error over the box added outward."""
    Wp, Wn, Wa = parts if parts is not None else (W.clamp(min=0), W.clamp(max=0), W.abs())
    F = Fp @ Wp + Fn @ Wn
    mag = torch.maximum(box.magnitude(Fp), box.magnitude(Fn))
    err = (W.shape[0] + box.m + 8) * U64 * (mag @ Wa) + TINY
    return _shift(F, err if up else -err, up)


def _scale(F: torch.Tensor, s: torch.Tensor, box: Box, up: bool) -> torch.Tensor:
    """s * F for s >= 0 (batch, n), with its rounding error added outward."""
    G = F * s[:, None]
    err = 4 * U64 * s * box.magnitude(F) + TINY
    return _shift(G, err if up else -err, up)


def _sum(F: torch.Tensor, G: torch.Tensor, box: Box, up: bool) -> torch.Tensor:
    err = 4 * U64 * (box.magnitude(F) + box.magnitude(G)) + TINY
    return _shift(F + G, err if up else -err, up)


def _const_form(v: torch.Tensor, m: int) -> torch.Tensor:
    F = torch.zeros(v.shape[0], m + 1, *v.shape[1:], dtype=F64, device=v.device)
    F[:, -1] = v
    return F


def _sel(mask: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per neuron (batch, n) mask: form a where true, else b."""
    return torch.where(mask[:, None], a, b)


# --- the domain ---------------------------------------------------------------------------
@dataclass
class Bounds:
    """Bounds over each box of a batch: per kernel (0 train, 1 inf) the output's value forms
    and boxes, and the drift's (``None`` when only values were asked for). ``overflow[b]``: a
    program may overflow on box b (its bounds are then infinite)."""

    box: Box
    lo: list[torch.Tensor]
    hi: list[torch.Tensor]
    L: list[torch.Tensor]
    U: list[torch.Tensor]
    dlo: torch.Tensor | None
    dhi: torch.Tensor | None
    Dl: torch.Tensor | None
    Du: torch.Tensor | None
    overflow: torch.Tensor
    trace: list[dict[str, Any]] = field(default_factory=list)  # per step: its input's boxes
    input_err: list[torch.Tensor] = field(default_factory=list)  # storage error per kernel

    def intermediates(self, steps: tuple[Step, ...]) -> torch.Tensor:
        """Every ReLU's pre-activation boxes: (batch, relus, channels, n), channels the value
        box of each kernel (lo, hi), then the drift box when there is one (``bound(prior=)``)."""
        out = []
        for st, tr in zip(steps, self.trace):
            if st.kind != "relu":
                continue
            ch = [v for k in range(len(tr["lo"])) for v in (tr["lo"][k], tr["hi"][k])]
            if tr["dlo"] is not None:
                ch += [tr["dlo"], tr["dhi"]]
            out.append(torch.stack(ch, 1))
        return torch.stack(out, 1)

    def linf(self) -> torch.Tensor:
        """Per box: max over the outputs of |drift| (inf where a program may overflow)."""
        assert self.dlo is not None and self.dhi is not None
        v = torch.maximum(self.dlo.abs(), self.dhi.abs()).amax(-1)
        return torch.where(self.overflow, torch.full_like(v, INF), v)


@dataclass
class _Kernel:
    """One kernel's view of the chain: per step, the weight as that kernel uses it (mid, rad),
    its bias (mid, rad) and constants, and the error constants of its formats."""

    spec: KernelSpec
    mats: list[Any]


def _stored(spec: KernelSpec, v: np.ndarray, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(mid, rad) of a constant as the kernel stores it: exact when representable in the compute
    format, else the hull of v and its compute-format rounding (what the interval rules assume)."""
    from kcverify.bounds.casts import rne

    t = torch.as_tensor(np.asarray(v, dtype=np.float64), device=dev)
    q = rne(t, spec.compute)
    lo, hi = torch.minimum(t, q), torch.maximum(t, q)
    if bool(torch.equal(lo, hi)):
        return t, torch.zeros_like(t)
    mid = 0.5 * lo + 0.5 * hi
    return mid, _up(torch.maximum(hi - mid, mid - lo))


def _weight(spec: KernelSpec, W: np.ndarray, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(mid, rad) of the weight a conforming program of ``spec`` multiplies by."""
    if spec.weights is not None:
        from kcverify.bounds.casts import weight_cast

        q_lo, q_hi = weight_cast(torch.as_tensor(np.array(W), dtype=F64, device=dev), spec.weights,
                                 spec.rounding, -1, -2, spec.accumulate.u)
        if not bool(torch.isfinite(q_lo).all() and torch.isfinite(q_hi).all()):
            raise NotAChain("a weight overflows its cast format")
        mid = 0.5 * q_lo + 0.5 * q_hi
        return mid, _up(torch.maximum(q_hi - mid, mid - q_lo)) if not torch.equal(q_lo, q_hi) \
            else torch.zeros_like(mid)
    return _stored(spec, W, dev)


def supported(spec: KernelSpec) -> str | None:
    """None when the chain domain models ``spec``; else why not (the engine's domains do)."""
    if spec.activations is not None:
        return "activation casts are bounded by the engine's domains, not the chain domain"
    if spec.onnx is not None:
        return "a kernel given as a second ONNX graph"
    acc = getattr(spec, "accumulation", None)
    if acc is not None and acc.mma is not None:
        # the chain's accumulation error is fp32's in any order (which holds the pinned
        # orders); a tensor-core accumulator truncates far beyond it (docs/kernels.md)
        return f"a tensor-core accumulator (mma: {acc.mma}) is bounded by the engine's domains"
    return None


class ChainBounds:
    """The chain domain for one chain and a pair of kernels (or one kernel: ``inf=None``)."""

    def __init__(self, chain: AffineChain, train: KernelSpec, inf: KernelSpec | None = None,
                 device: str = "cpu", alpha_iters: int = 0) -> None:
        for s in (train, inf):
            why = None if s is None else supported(s)
            if why:
                raise NotAChain(why)
        self.chain = chain
        self.dev = torch.device(device)
        self.specs = [train] if inf is None else [train, inf]
        self.crown = True  # intermediate bounds by back-substitution (else forward forms only)
        self.crown_drift = True
        # optimised lower slopes (alpha-CROWN) for the intermediate value bounds: the number of
        # projected-gradient steps per back-substitution (0: CROWN's 0/1 slopes)
        self.alpha_iters = int(alpha_iters)
        # back-substitution rows per tensor program: the rows are independent, and chunks
        # whose temporaries stay in cache ran faster on ACAS Xu (docs/regions.md)
        self.row_chunk = ROW_CHUNK
        self.kernels = [self._prepare(s) for s in self.specs]
        self.dW: list[Any] = []
        self.stacked: dict[int, torch.Tensor] = {}  # [W_t^T; dW^T] per affine step
        if inf is not None:
            for j, st in enumerate(chain.steps):
                if st.kind != "affine":
                    self.dW.append(None)
                    continue
                (Wt, _), _, _ = self.kernels[0].mats[j]
                (Wi, _), _, _ = self.kernels[1].mats[j]
                dW = Wi - Wt
                bb = dW - Wi  # TwoSum (Knuth): the exact rounding error of Wi - Wt
                err = ((Wi - (dW - bb)) + (-Wt - bb)).abs()
                self.dW.append((dW, _parts(dW), err))
                self.stacked[j] = torch.cat([Wt.T, dW.T], 0).contiguous()

    def forward_only(self) -> ChainBounds:
        """The same domain without back-substitution of the intermediate bounds (the forward
        forms alone, about 20x cheaper on ACAS Xu): the split's estimate of which cut helps."""
        cheap = copy.copy(self)
        cheap.crown = False
        return cheap

    def _prepare(self, spec: KernelSpec) -> _Kernel:
        mats: list[Any] = []
        for st in self.chain.steps:
            if st.kind == "affine":
                Wm, Wr = _weight(spec, st.W, self.dev)
                b = None if st.b is None else _stored(spec, st.b, self.dev)
                mats.append(((Wm, Wr), b, _parts(Wm)))
            elif st.kind == "shift":
                mats.append(_stored(spec, st.b, self.dev))
            elif st.kind == "scale":
                cm, cr = _stored(spec, st.b, self.dev)
                if bool(cr.any()) or (st.prim == "div" and bool((cm == 0).any())):
                    raise NotAChain(f"{st.node}: a scale the kernel does not store exactly "
                                    "(or a division by zero)")
                mats.append((cm, cr))
            else:
                mats.append(None)
        return _Kernel(spec, mats)

    # --- kernel error terms --------------------------------------------------------------
    @staticmethod
    def _rounding(spec: KernelSpec, prim: str, mag: torch.Tensor, steps: int = 1
                  ) -> torch.Tensor:
        """Error of ``steps`` roundings of a value of magnitude <= mag into the compute format."""
        rel = spec.ulp(prim) * spec.compute.u
        r = (1 + rel) ** steps - 1
        eta = spec.compute.eta * steps * (1 + r)
        return _up((r * (1 + 1e-12)) * mag + eta)

    def bound(self, lo: torch.Tensor | np.ndarray, hi: torch.Tensor | np.ndarray,
              drift: bool = True, prior: torch.Tensor | np.ndarray | None = None) -> Bounds:
        """Bounds for the boxes [lo_b, hi_b] (batch, n_in) of the raw (real-valued) input.

        ``prior``: pre-activation boxes already certified for supersets of the boxes (a split's
        parent: ``Bounds.intermediates()`` of it), met with this run's at every ReLU, so a part
        inherits what its parent proved about each neuron."""
        lo = torch.as_tensor(lo, dtype=F64, device=self.dev).reshape(len(lo), -1)
        hi = torch.as_tensor(hi, dtype=F64, device=self.dev).reshape(len(hi), -1)
        if lo.shape[1] != self.chain.n_in or hi.shape != lo.shape:
            raise ValueError(f"boxes must be (batch, {self.chain.n_in}), got {tuple(lo.shape)}")
        box = Box(lo, hi)
        B, m = lo.shape
        X = torch.cat([torch.eye(m, dtype=F64, device=self.dev).expand(B, m, m),
                       torch.zeros(B, 1, m, dtype=F64, device=self.dev)], 1)
        K = len(self.kernels)
        L, U, lo_k, hi_k, errs = [], [], [], [], []
        for k in self.kernels:  # each kernel stores the raw input in its compute format
            e = (self._rounding(k.spec, "add", box.mag[:, :, 0], 1)
                 if k.spec.compute.name != "fp64" else torch.zeros_like(lo))
            errs.append(e)
            L.append(_shift(X, -e, False))
            U.append(_shift(X, e, True))
            lo_k.append(_dn(lo - e))
            hi_k.append(_up(hi + e))
        overflow = torch.zeros(B, dtype=torch.bool, device=self.dev)
        want_d = drift and K == 2
        Dl = Du = dlo = dhi = None
        if want_d:
            if self.specs[0].compute == self.specs[1].compute:  # the same stored value
                Dl, Du = torch.zeros_like(X), torch.zeros_like(X)
            else:
                e = _up(errs[0] + errs[1])
                Dl, Du = _const_form(-e, m), _const_form(e, m)
            dlo, dhi = box.lower(Dl), box.upper(Du)
        trace: list[dict[str, Any]] = []
        partial = Bounds(box, lo_k, hi_k, L, U, dlo, dhi, Dl, Du, overflow, trace, errs)
        relaxed = False  # before the first ReLU the forms are exact: nothing to tighten
        if prior is not None:
            prior = torch.as_tensor(prior, dtype=F64, device=self.dev)
        layer = 0
        for j, st in enumerate(self.chain.steps):
            if st.kind == "relu" and prior is not None:
                lo_k, hi_k, dlo, dhi = _meet_prior(prior[:, layer], lo_k, hi_k, dlo, dhi, want_d)
            if st.kind == "relu" and self.crown and relaxed:
                lo_k, hi_k, dlo, dhi = self._tighten(partial, j, lo_k, hi_k, dlo, dhi, want_d)
            relaxed = relaxed or st.kind == "relu"
            trace.append({"lo": list(lo_k), "hi": list(hi_k), "dlo": dlo, "dhi": dhi})
            if st.kind == "relu":
                layer += 1
                if want_d:
                    Dl, Du, dlo, dhi = self._relu_drift(box, L, U, lo_k, hi_k, Dl, Du, dlo, dhi)
                for k in range(K):
                    L[k], U[k], lo_k[k], hi_k[k] = self._relu(box, L[k], U[k], lo_k[k], hi_k[k])
                continue
            new = [self._linear_step(box, st, self.kernels[k].spec, self.kernels[k].mats[j],
                                     L[k], U[k], lo_k[k], hi_k[k]) for k in range(K)]
            if want_d:
                Dl, Du, dlo, dhi = self._drift_step(box, st, j, L[0], U[0], lo_k[0], hi_k[0],
                                                    Dl, Du, dlo, dhi, [nw[4] for nw in new])
            trace[-1]["err"] = [nw[4] for nw in new]
            for k in range(K):
                L[k], U[k], lo_k[k], hi_k[k], _, ov = new[k]
                overflow |= ov
            if want_d:
                dlo = torch.maximum(dlo, _dn(lo_k[1] - hi_k[0]))
                dhi = torch.minimum(dhi, _up(hi_k[1] - lo_k[0]))
                lo_k[1] = torch.maximum(lo_k[1], _dn(lo_k[0] + dlo))
                hi_k[1] = torch.minimum(hi_k[1], _up(hi_k[0] + dhi))
        for t in (*lo_k, *hi_k, *((dlo, dhi) if want_d else ())):
            overflow |= ~torch.isfinite(t).all(-1)
        return Bounds(box, lo_k, hi_k, L, U, dlo, dhi, Dl, Du, overflow, trace, errs)

    def _tighten(self, r: Bounds, j: int, lo: list, hi: list, dlo: Any, dhi: Any,
                 want_d: bool) -> tuple:
        """Pre-activation boxes of step j met with back-substitution over steps < j (CROWN's
        intermediate bounds) for the neurons whose relaxation they decide (unstable in some
        kernel): the training value, then the drift, then the inference value from both. One
        objective row per (box, neuron) pair that needs it: the boxes' other neurons cost
        nothing."""
        lo, hi = list(lo), list(hi)
        unst = torch.zeros_like(lo[0], dtype=torch.bool)
        for k in range(len(lo)):
            unst |= (lo[k] < 0) & (hi[k] > 0)
        box_i, neu_i = torch.nonzero(unst, as_tuple=True)
        if len(box_i) == 0:
            return lo, hi, dlo, dhi
        n = lo[0].shape[1]
        K = len(self.kernels)
        vals: list[list[torch.Tensor]] = [[] for _ in range(K)]
        drifts: list[torch.Tensor] = []
        for c0 in range(0, len(box_i), self.row_chunk):  # rows are independent
            b_c, n_c = box_i[c0:c0 + self.row_chunk], neu_i[c0:c0 + self.row_chunk]
            C = torch.nn.functional.one_hot(n_c, n).to(F64)[:, None, :]
            C2 = torch.cat([C, -C], 1)  # (pairs, 2, n): upper, then minus lower
            sub = _rows(r, b_c, j, self)
            for k in range(1 if want_d else K):
                slopes = optimise_slopes(self, sub, k, C2, j, self.alpha_iters) \
                    if self.alpha_iters else None
                vals[k].append(backward_value(self, sub, k, C2, j, slopes=slopes))
            if want_d and self.crown_drift:
                drifts.append(backward_drift(self, sub, C2, j))

        def meet(l_: torch.Tensor, h_: torch.Tensor, res: torch.Tensor) -> tuple:
            l_, h_ = l_.clone(), h_.clone()
            l_[box_i, neu_i] = torch.maximum(l_[box_i, neu_i], -res[:, 1])
            h_[box_i, neu_i] = torch.minimum(h_[box_i, neu_i], res[:, 0])
            return l_, h_
        for k in range(1 if want_d else K):
            lo[k], hi[k] = meet(lo[k], hi[k], torch.cat(vals[k]))
        if drifts:
            dlo, dhi = meet(dlo, dhi, torch.cat(drifts))
        if want_d:
            lo[1] = torch.maximum(lo[1], _dn(lo[0] + dlo))
            hi[1] = torch.minimum(hi[1], _up(hi[0] + dhi))
        return lo, hi, dlo, dhi

    def _linear_step(self, box: Box, st: Step, spec: KernelSpec, mats: Any, L: torch.Tensor,
                     U: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> tuple:
        """One kernel's forms through an affine / shift / scale step; returns
        (L, U, lo, hi, err, overflow) with err the magnitude of the kernel's own error (what
        the drift adds)."""
        no = torch.zeros(lo.shape[0], dtype=torch.bool, device=lo.device)
        if st.kind == "affine":
            (Wm, Wr), bias, parts = mats
            n = Wm.shape[0]
            amag = torch.maximum(lo.abs(), hi.abs())
            s = _up((amag @ (parts[2] + Wr)) * (1 + (n + 4) * U64))
            acc = _up(gamma(n, spec.accumulate.u) * s + n * spec.accumulate.eta)
            rad = _up((amag @ Wr) * (1 + (n + 4) * U64)) if bool((Wr > 0).any()) else 0 * s
            Lo = _matmul(L, U, Wm, box, False, parts)
            Up = _matmul(U, L, Wm, box, True, parts)
            ilo, ihi = _imatmul(lo, hi, parts)
            plo = torch.maximum(box.lower(Lo), ilo)
            phi = torch.minimum(box.upper(Up), ihi)
            mag = torch.maximum(plo.abs(), phi.abs()) + acc + rad
            err = _up(acc + rad + self._rounding(spec, "mul", mag, 2))
            ov = (s > spec.accumulate.max_finite).any(-1) | (mag + err > spec.compute.max_finite
                                                             ).any(-1)
            plo, phi = _dn(plo - err), _up(phi + err)
            own = err
            if bias is not None:
                bm, br = bias
                plo, phi = _dn(plo + (bm - br)), _up(phi + (bm + br))
                e2 = self._rounding(spec, "add", torch.maximum(plo.abs(), phi.abs()), 1)
                plo, phi = _dn(plo - e2), _up(phi + e2)
                Lo, Up = _shift(Lo, _dn(bm - br - err - e2), False), _shift(Up, _up(bm + br + err + e2), True)
                own = _up(err + e2 + br)
                ov = ov | (torch.maximum(plo.abs(), phi.abs()) > spec.compute.max_finite).any(-1)
            else:
                Lo, Up = _shift(Lo, -err, False), _shift(Up, err, True)
            return Lo, Up, plo, phi, own, ov
        if st.kind == "shift":
            cm, cr = mats
            if not bool(cm.any()) and not bool(cr.any()):  # x + 0 is exact
                return L, U, lo, hi, torch.zeros_like(lo), no
            mag = torch.maximum((lo + cm - cr).abs(), (hi + cm + cr).abs())
            e = self._rounding(spec, "add", mag, 1)
            Lo, Up = _shift(L, _dn(cm - cr - e), False), _shift(U, _up(cm + cr + e), True)
            nlo, nhi = _dn(lo + cm - cr - e), _up(hi + cm + cr + e)
            return Lo, Up, nlo, nhi, _up(e + cr), (mag + e > spec.compute.max_finite).any(-1)
        # scale: y = x * s (mul) or x / s (div)
        cm, _ = mats
        sc = cm if st.prim == "mul" else 1.0 / cm
        Lo, Up = _scale_pair(L, U, sc.expand_as(lo), box)
        mag = torch.maximum(box.lower(Lo).abs(), box.upper(Up).abs())
        extra = 0.0 if st.prim == "mul" else 2 * U64  # 1/c is not exact
        e = _up(self._rounding(spec, st.prim, mag, 1) + extra * mag)
        Lo, Up = _shift(Lo, -e, False), _shift(Up, e, True)
        return Lo, Up, box.lower(Lo), box.upper(Up), e, (mag + e > spec.compute.max_finite).any(-1)

    def _drift_step(self, box: Box, st: Step, j: int, Lt: torch.Tensor, Ut: torch.Tensor,
                    lot: torch.Tensor, hit: torch.Tensor, Dl: torch.Tensor, Du: torch.Tensor,
                    dlo: torch.Tensor, dhi: torch.Tensor, errs: list) -> tuple:
        """The drift's forms and box through an affine / shift / scale step (module doc):
        Lt, Ut, lot, hit are the training kernel's forms and box of the step's input."""
        e = _up(errs[0] + errs[1])
        if st.kind == "affine":
            (Wi, _), bi, pi = self.kernels[1].mats[j]
            _, bt, _ = self.kernels[0].mats[j]
            dW, pd, dWerr = self.dW[j]
            nDl = _sum(_matmul(Dl, Du, Wi, box, False, pi), _matmul(Lt, Ut, dW, box, False, pd),
                       box, False)
            nDu = _sum(_matmul(Du, Dl, Wi, box, True, pi), _matmul(Ut, Lt, dW, box, True, pd),
                       box, True)
            amag = torch.maximum(lot.abs(), hit.abs())
            e = _up(e + amag @ dWerr) if bool(dWerr.any()) else e
            a1, b1 = _imatmul(dlo, dhi, pi)
            a2, b2 = _imatmul(lot, hit, pd)
            ilo, ihi = _dn(a1 + a2), _up(b1 + b2)
            if bt is not None or bi is not None:  # the radii are in errs
                zero = torch.zeros(Wi.shape[1], dtype=F64, device=self.dev)
                db = (bi[0] if bi is not None else zero) - (bt[0] if bt is not None else zero)
                nDl, nDu = _shift(nDl, _dn(db), False), _shift(nDu, _up(db), True)
                ilo, ihi = _dn(ilo + db), _up(ihi + db)
                e = _up(e + 4 * U64 * db.abs())
            nDl, nDu = _shift(nDl, -e, False), _shift(nDu, e, True)
            return (nDl, nDu, torch.maximum(box.lower(nDl), _dn(ilo - e)),
                    torch.minimum(box.upper(nDu), _up(ihi + e)))
        cmt, _ = self.kernels[0].mats[j]
        cmi, _ = self.kernels[1].mats[j]
        if st.kind == "shift":
            dc = cmi - cmt
            e = _up(e + 4 * U64 * dc.abs())
            nDl, nDu = _shift(Dl, _dn(dc - e), False), _shift(Du, _up(dc + e), True)
            return nDl, nDu, _dn(dlo + dc - e), _up(dhi + dc + e)
        if not torch.equal(cmt, cmi):
            raise NotAChain(f"{st.node}: a scale the two kernels store differently")
        sc = cmt if st.prim == "mul" else 1.0 / cmt
        nDl, nDu = _scale_pair(Dl, Du, sc.expand_as(dlo), box)
        if st.prim == "div":
            e = _up(e + 2 * U64 * torch.maximum(box.lower(nDl).abs(), box.upper(nDu).abs()))
        nDl, nDu = _shift(nDl, -e, False), _shift(nDu, e, True)
        return nDl, nDu, box.lower(nDl), box.upper(nDu)

    @staticmethod
    def _relax_upper(box: Box, U: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor
                     ) -> torch.Tensor:
        """Upper form of relu(v) from U >= v, v in [lo, hi]: U where lo >= 0, 0 where hi <= 0,
        else lam (U - lo) with lam >= hi / (hi - lo) (rounded up: a larger slope stays above)."""
        unstable = (lo < 0) & (hi > 0)
        lam = torch.where(unstable, hi / (hi - lo).clamp(min=TINY), torch.ones_like(hi))
        lam = _up(lam * (1 + 4 * U64)).clamp(0, 1)
        R = _scale(_shift(U, (-lo).clamp(min=0), True), lam, box, True)
        return _sel(hi <= 0, torch.zeros_like(U), _sel(unstable, R, U))

    def _relu(self, box: Box, L: torch.Tensor, U: torch.Tensor, lo: torch.Tensor,
              hi: torch.Tensor) -> tuple:
        Up = self._relax_upper(box, U, lo, hi)
        alpha = ((lo >= 0) | ((hi > 0) & (hi > -lo))).to(F64)  # exact 0 / 1
        return L * alpha[:, None], Up, lo.clamp(min=0), hi.clamp(min=0)

    def _relu_drift(self, box: Box, L: list, U: list, lo: list, hi: list, Dl: torch.Tensor,
                    Du: torch.Tensor, dlo: torch.Tensor, dhi: torch.Tensor) -> tuple:
        """Forms of r = relu(z_i) - relu(z_t), z_i = z_t + d (module doc); the concrete box
        is met with the value-set difference."""
        zero = torch.zeros_like(Du)
        t_on, t_off = lo[0] >= 0, hi[0] <= 0
        i_on, i_off = lo[1] >= 0, hi[1] <= 0
        # universal: min(0, d) <= r <= max(0, d), each relaxed like a ReLU
        up = self._relax_upper(box, Du, dlo, dhi)
        split = (dlo < 0) & (dhi > 0)
        mu = torch.where(split, -dlo / (dhi - dlo).clamp(min=TINY), torch.zeros_like(dlo))
        mu = _up(mu * (1 + 4 * U64)).clamp(0, 1)
        low = _scale(_shift(Dl, -dhi.clamp(min=0), False), mu, box, False)
        low = _sel(split, low, _sel(dhi <= 0, Dl, zero))
        # one kernel stable: train active r >= d; train inactive r >= 0; inf active r <= d;
        # inf inactive r <= 0
        low = _sel(t_off, zero, _sel(t_on, Dl, low))
        up = _sel(i_off, zero, _sel(i_on, Du, up))
        # both stable: exact
        low = _sel(t_on & i_on, Dl, _sel(t_on & i_off, -U[0], _sel(t_off & i_on, L[1], low)))
        up = _sel(t_on & i_on, Du, _sel(t_on & i_off, -L[0], _sel(t_off & i_on, U[1], up)))
        low = _sel(t_off & i_off, zero, low)
        up = _sel(t_off & i_off, zero, up)
        vlo = _dn(lo[1].clamp(min=0) - hi[0].clamp(min=0))
        vhi = _up(hi[1].clamp(min=0) - lo[0].clamp(min=0))
        clo = torch.maximum(torch.minimum(dlo, torch.zeros_like(dlo)), vlo)
        chi = torch.minimum(torch.maximum(dhi, torch.zeros_like(dhi)), vhi)
        return low, up, torch.maximum(box.lower(low), clo), torch.minimum(box.upper(up), chi)


def _meet_prior(p: torch.Tensor, lo: list, hi: list, dlo: Any, dhi: Any, want_d: bool) -> tuple:
    """Meet the boxes with inherited ones p (batch, channels, n) (Bounds.intermediates)."""
    lo, hi = list(lo), list(hi)
    for k in range(len(lo)):
        lo[k] = torch.maximum(lo[k], p[:, 2 * k])
        hi[k] = torch.minimum(hi[k], p[:, 2 * k + 1])
    if want_d and p.shape[1] >= 2 * len(lo) + 2:
        dlo = torch.maximum(dlo, p[:, 2 * len(lo)])
        dhi = torch.minimum(dhi, p[:, 2 * len(lo) + 1])
    return lo, hi, dlo, dhi


def _mags(cb: ChainBounds, tr: dict[str, Any], j: int) -> dict[str, Any]:
    """The magnitudes step j's rounding pads multiply by, per box (cached in the trace entry,
    like the relaxations, so a back-substitution with one row per (box, neuron) gathers them
    instead of recomputing a matrix product per row): ``mag{k}`` = max |v_k| of the step's
    input, ``dmag`` = max |drift|; for an affine step ``wmag{k}`` = mag{k} |W_k|, and with two
    kernels ``wmag_d`` = mag0 |dW| + dmag |W_inf| and ``wmag_e`` = mag0 |err(dW)|."""
    if "mag0" in tr:
        return tr
    K = len(tr["lo"])
    for k in range(K):
        tr[f"mag{k}"] = torch.maximum(tr["lo"][k].abs(), tr["hi"][k].abs())
    if tr.get("dlo") is not None:
        tr["dmag"] = torch.maximum(tr["dlo"].abs(), tr["dhi"].abs())
    st = cb.chain.steps[j]
    if st.kind == "affine":
        for k in range(K):
            tr[f"wmag{k}"] = tr[f"mag{k}"] @ cb.kernels[k].mats[j][2][2]
        if K == 2 and "dmag" in tr and cb.dW:
            _, pd, dWerr = cb.dW[j]
            tr["wmag_d"] = tr["mag0"] @ pd[2] + tr["dmag"] @ cb.kernels[1].mats[j][2][2]
            tr["wmag_e"] = tr["mag0"] @ dWerr if bool(dWerr.any()) else None
    return tr



def _relaxed_trace(cb: Any, r: Any, upto: int) -> list[dict[str, Any]]:
    """The first ``upto`` steps of a run's trace with their magnitudes, each ReLU step with its
    relaxations (per network, and of the drift for a pair) filled in where missing."""
    out = []
    for j in range(upto):
        tr = _mags(cb, r.trace[j], j)
        if cb.chain.steps[j].kind == "relu":
            for k in range(len(tr["lo"])):
                if f"relax{k}" not in tr:
                    tr[f"relax{k}"] = _relu_relax(tr["lo"][k], tr["hi"][k])
            if len(tr["lo"]) == 2 and tr["dlo"] is not None and "relax_d" not in tr:
                tr["relax_d"] = _drift_relax(tr["lo"][0], tr["hi"][0], tr["lo"][1], tr["hi"][1],
                                             tr["dlo"], tr["dhi"])
        out.append(tr)
    return out

def _rows(r: Bounds, idx: torch.Tensor, upto: int, cb: ChainBounds) -> Bounds:
    """The bounds of boxes ``idx`` (with repetition: one row per objective) over steps < upto,
    for back-substitution; the relaxations are computed once on the whole batch and gathered."""
    def take(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v[idx] if v.dim() >= 1 and v.shape[0] == len(r.box.lo) else v
        if isinstance(v, list | tuple):
            return type(v)(take(x) for x in v)
        return v
    trace = [{key: take(v) for key, v in tr.items()} for tr in _relaxed_trace(cb, r, upto)]
    box = Box(r.box.lo[idx, :, 0], r.box.hi[idx, :, 0])
    return Bounds(box, [], [], [], [], None, None, None, None, r.overflow[idx], trace,
                  [take(e) for e in r.input_err])


def _parts(W: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return W.clamp(min=0), W.clamp(max=0), W.abs()


def _imatmul(lo: torch.Tensor, hi: torch.Tensor, parts: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """[lo, hi] W by endpoints (W = Wp + Wn), rounded outward."""
    Wp, Wn, Wa = parts
    a = lo @ Wp + hi @ Wn
    b = hi @ Wp + lo @ Wn
    err = (Wa.shape[0] + 4) * U64 * (torch.maximum(lo.abs(), hi.abs()) @ Wa) + TINY
    return _dn(a - err), _up(b + err)


def _scale_pair(L: torch.Tensor, U: torch.Tensor, s: torch.Tensor, box: Box) -> tuple:
    """Forms of s * v for v in [L, U], s (batch, n) of any sign."""
    sp, sn = s.clamp(min=0), (-s).clamp(min=0)
    Up = _sum(_scale(U, sp, box, True), -_scale(L, sn, box, False), box, True)
    Lo = _sum(_scale(L, sp, box, False), -_scale(U, sn, box, True), box, False)
    return Lo, Up


# --- back-substitution (CROWN) over the forward pass's intermediate boxes -------------------
def _relu_relax(lo: torch.Tensor, hi: torch.Tensor) -> tuple:
    """ReLU relaxations on [lo, hi]: upper su z + iu, lower sl z (sl in {0, 1}, exact)."""
    on, unstable = lo >= 0, (lo < 0) & (hi > 0)
    lam = torch.where(unstable, hi / (hi - lo).clamp(min=TINY), torch.zeros_like(hi))
    lam = _up(lam * (1 + 4 * U64)).clamp(0, 1)  # a larger slope stays above on [lo, hi]
    su = torch.where(on, torch.ones_like(lo), lam)
    iu = torch.where(unstable, _up(lam * (-lo) * (1 + 4 * U64)), torch.zeros_like(lo))
    sl = (on | (unstable & (hi > -lo))).to(F64)
    return su, iu, sl


def _at(v: torch.Tensor) -> torch.Tensor:
    """A per-neuron tensor (batch, n) or (n,) broadcast against (batch, q, n)."""
    return v if v.dim() == 1 else v[:, None, :]


def _value(p: torch.Tensor, q: torch.Tensor, r: torch.Tensor, zl: torch.Tensor, zh: torch.Tensor,
           dl: torch.Tensor, dh: torch.Tensor, upper: bool) -> torch.Tensor:
    """Max (upper) or min of p z + q d + r over the box z in [zl, zh], d in [dl, dh]."""
    f = torch.maximum if upper else torch.minimum
    return f(p * zl, p * zh) + f(q * dl, q * dh) + r


def _pick(cands: list, zl: torch.Tensor, zh: torch.Tensor, dl: torch.Tensor, dh: torch.Tensor,
          upper: bool) -> tuple:
    """Per neuron, the valid candidate relaxation (mask, p, q, r) with the tightest value over
    the intermediate boxes (a heuristic choice; every candidate is sound where valid)."""
    best = None
    for valid, p, q, r in cands:
        v = _value(p, q, r, zl, zh, dl, dh, upper)
        bad = torch.full_like(v, INF if upper else -INF)
        v = torch.where(valid, v, bad)
        if best is None:
            best = [v, p, q, r]
            continue
        take = (v < best[0]) if upper else (v > best[0])
        best = [torch.where(take, a, b) for a, b in zip((v, p, q, r), best)]
    assert best is not None
    return best[1], best[2], best[3]


def _drift_relax(lt, ht, li, hi, dl, dh) -> tuple:  # noqa: ANN001 - tensors (batch, n)
    """Upper and lower relaxations p z_t + q d + r of relu(z_t + d) - relu(z_t) (module doc)."""
    one, zero = torch.ones_like(lt), torch.zeros_like(lt)
    true = torch.ones_like(lt, dtype=torch.bool)
    su_t, iu_t, sl_t = _relu_relax(lt, ht)
    su_i, iu_i, sl_i = _relu_relax(li, hi)
    # universal: max(0, d) <= lam (d - dl); min(0, d) >= mu (d - dh)
    su_d, iu_d, _ = _relu_relax(dl, dh)
    split = (dl < 0) & (dh > 0)
    mu = torch.where(split, -dl / (dh - dl).clamp(min=TINY), zero)
    mu = _up(mu * (1 + 4 * U64)).clamp(0, 1)
    ql = torch.where(split, mu, torch.where(dh <= 0, one, zero))
    rl = torch.where(split, _dn(-mu * dh.clamp(min=0) * (1 + 4 * U64)), zero)
    ups = [(true, zero, su_d, iu_d),
           # relu(z_i) - relu(z_t) <= su_i (z_t + d) + iu_i - a z_t, a in {0, 1} where valid
           (true, su_i, su_i, iu_i),
           (lt >= 0, su_i - one, su_i, iu_i),
           (hi <= 0, zero, zero, zero), (li >= 0, zero, one, zero)]
    lows = [(true, zero, ql, rl),
            # >= sl_i (z_t + d) - su_t z_t - iu_t
            (true, sl_i - su_t, sl_i, -iu_t),
            (ht <= 0, sl_i, sl_i, zero),
            (lt >= 0, zero, one, zero), (ht <= 0, zero, zero, zero)]
    pu, qu, ru = _pick(ups, lt, ht, dl, dh, True)
    pl, qlo, rlo = _pick(lows, lt, ht, dl, dh, False)
    return (pu, qu, ru), (pl, qlo, rlo), (su_t, iu_t, sl_t)


def _slope(a: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, sl: torch.Tensor
           ) -> torch.Tensor:
    """Lower slopes (batch, q, n) in [0, 1] where the neuron is unstable on [lo, hi], else the
    exact 0 / 1 of ``sl``."""
    unstable = ((lo < 0) & (hi > 0))[:, None, :]
    return torch.where(unstable, a.clamp(0, 1), _at(sl).expand_as(a))


SLOPE_DTYPE = torch.float32  # the slope descent's arithmetic (its result is not a bound)
ALPHA_STEP = 0.5  # the largest change of a slope per step
ALPHA_DAMP = 0.1  # a component's step is STEP g / (|g| + DAMP max|g|): continuous in g


def optimise_slopes(cb: ChainBounds, r: Bounds, k: int | None, C: torch.Tensor, upto: int,
                    iters: int) -> dict[int, torch.Tensor]:
    """Lower slopes of the unstable ReLUs before step ``upto`` that make the back-substituted
    upper bounds of C v_k small (alpha-CROWN: one slope per objective row and neuron), by
    ``iters`` projected-gradient steps on ``backward_value(plain=True)`` from CROWN's 0/1
    slopes; ``k`` None: the lower slopes of the training value in ``backward_drift`` for the
    upper bounds of C (v_inf - v_train). Per row the
    best slopes seen are kept (CROWN's among them). Any slope in [0, 1] is sound, so this is a
    heuristic whose result ``backward_value(slopes=...)`` turns into a bound. Deterministic, and
    continuous in its inputs (a normalised step, no sign()): a checker that re-runs it on
    another batch composition finds the same slopes up to rounding."""
    q = C.shape[1]
    alphas: dict[int, torch.Tensor] = {}
    for j in range(upto):
        tr = r.trace[j]
        if cb.chain.steps[j].kind != "relu":
            continue
        lo, hi = tr["lo"][k or 0], tr["hi"][k or 0]
        if "relax0" not in tr:
            tr["relax0"] = _relu_relax(tr["lo"][0], tr["hi"][0])
        if k and f"relax{k}" not in tr:
            tr[f"relax{k}"] = _relu_relax(lo, hi)
        if bool(((lo < 0) & (hi > 0)).any()):
            alphas[j] = tr[f"relax{k or 0}"][2][:, None, :].expand(-1, q, -1).clone()
    if not alphas:
        return {}
    if SLOPE_DTYPE != F64:  # the descent is a heuristic: float32 is 2-4x faster on CPU
        cb, r = _in_dtype(cb, r, upto, SLOPE_DTYPE)
        C = C.to(SLOPE_DTYPE)
        alphas = {j: a.to(SLOPE_DTYPE) for j, a in alphas.items()}
    best = {j: a.clone() for j, a in alphas.items()}
    best_v = None
    tiny = torch.finfo(C.dtype).tiny
    with torch.enable_grad():
        for it in range(iters + 1):
            for a in alphas.values():
                a.requires_grad_(True)
                a.grad = None
            v = backward_value(cb, r, k, C, upto, slopes=alphas, plain=True) if k is not None \
                else backward_drift(cb, r, C, upto, slopes=alphas, plain=True)
            with torch.no_grad():
                vv = torch.where(torch.isfinite(v), v, torch.full_like(v, INF))
                better = torch.ones_like(vv, dtype=torch.bool) if best_v is None else vv < best_v
                best_v = vv if best_v is None else torch.where(better, vv, best_v)
                for j, a in alphas.items():
                    best[j] = torch.where(better[:, :, None], a.detach(), best[j])
            if it == iters:
                break
            v.sum().backward()
            with torch.no_grad():
                grads = {j: torch.nan_to_num(a.grad, nan=0.0, posinf=0.0, neginf=0.0)
                         for j, a in alphas.items()}
                gm = torch.stack([g.abs().amax(-1) for g in grads.values()]).amax(0)
                gm = (ALPHA_DAMP * gm)[:, :, None] + tiny
                for j, a in list(alphas.items()):
                    g = grads[j]
                    alphas[j] = (a.detach() - ALPHA_STEP * g / (g.abs() + gm)).clamp(0, 1)
    return {j: a.to(F64) for j, a in best.items()}


def _in_dtype(cb: ChainBounds, r: Bounds, upto: int, dtype: torch.dtype
              ) -> tuple[ChainBounds, Bounds]:
    """The domain's weights and the bounds' trace over steps < upto in ``dtype``: what the
    plain (rounding-free, not a bound) back-substitutions of ``optimise_slopes`` read."""
    def conv(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.to(dtype) if v.is_floating_point() else v
        if isinstance(v, list | tuple):
            return type(v)(conv(x) for x in v)
        return v
    low = cb.__dict__.get("_low")
    if low is None or low[0] != dtype:
        c2 = copy.copy(cb)
        c2.kernels = [_Kernel(kn.spec, conv(kn.mats)) for kn in cb.kernels]
        c2.dW = conv(cb.dW)
        c2.stacked = {j: conv(v) for j, v in cb.stacked.items()}
        cb._low = low = (dtype, c2)  # type: ignore[attr-defined]
    trace = [{key: conv(v) for key, v in tr.items()} for tr in _relaxed_trace(cb, r, upto)]
    box = Box(r.box.lo[:, :, 0].to(dtype), r.box.hi[:, :, 0].to(dtype))
    return low[1], Bounds(box, [], [], [], [], None, None, None, None, r.overflow, trace,
                          conv(r.input_err))


def _plain_upper(box: Box, Lam: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """max over the box of Lam x + c in plain float64 (no rounding pad: not a bound)."""
    return torch.maximum(Lam * box.lo[:, None, :, 0], Lam * box.hi[:, None, :, 0]).sum(-1) + c


def _concretize_upper(box: Box, Lam: torch.Tensor, c: torch.Tensor, pad: torch.Tensor
                      ) -> torch.Tensor:
    """max over the box of Lam x + c (Lam (batch, q, m)), plus pad, rounded up."""
    lo, hi, mag = box.lo[:, None, :, 0], box.hi[:, None, :, 0], box.mag[:, None, :, 0]
    v = torch.maximum(Lam * lo, Lam * hi).sum(-1) + c
    pad = pad + (box.m + 4) * U64 * ((Lam.abs() * mag).sum(-1) + c.abs() + pad) + TINY
    return _up(v + pad)


def backward_value(cb: ChainBounds, r: Bounds, k: int, C: torch.Tensor,
                   upto: int | None = None, coefficients: list | None = None,
                   slopes: dict[int, torch.Tensor] | None = None, plain: bool = False
                   ) -> torch.Tensor:
    """Upper bounds of C v_k over each box, v_k the output of kernel k (C (batch, q, n_out)):
    the objective back-substituted through the relaxations fixed by the forward pass (CROWN),
    with every kernel error and float64 rounding added. Lower bounds: -backward_value(-C).

    ``slopes``: per ReLU step j, lower slopes (batch, q, n) to use instead of CROWN's 0/1 choice
    (``optimise_slopes``): relu(z) >= a z holds for every z when 0 <= a <= 1, so any such slope
    keeps the bound sound; the slopes of stable neurons are ignored (their relaxation is exact).
    ``plain``: the same in plain float64 without the verifier's rounding pads (differentiable in
    the slopes; not a bound): what ``optimise_slopes`` descends."""
    Lam = C if plain else C.to(F64)  # plain: the slope descent's dtype (optimise_slopes)
    c = torch.zeros(Lam.shape[:2], dtype=Lam.dtype, device=Lam.device)
    pad = torch.zeros_like(c)
    kern = cb.kernels[k]
    for j in reversed(range(len(cb.chain.steps) if upto is None else upto)):
        st, tr = cb.chain.steps[j], _mags(cb, r.trace[j], j)
        lo = tr["lo"][k]
        amag = tr[f"mag{k}"]
        if st.kind == "relu":
            key = f"relax{k}"  # fixed once the step's boxes are: computed once per bound()
            if key not in tr:
                tr[key] = _relu_relax(lo, tr["hi"][k])
            su, iu, sl = tr[key]
            P, N = Lam.clamp(min=0), Lam.clamp(max=0)
            term = P * _at(iu)
            c = c + term.sum(-1)
            if not plain:  # this addition's rounding: partial sums of c may cancel later
                pad = pad + 2 * U64 * c.abs()
            a = _at(sl) if slopes is None or j not in slopes else _slope(slopes[j], lo, tr["hi"][k],
                                                                           sl)
            Lam = P * _at(su) + N * a
            if not plain:  # the new coefficients' rounding (times |z|), the n-term sum in c
                pad = pad + 4 * U64 * (Lam.abs() * _at(amag)).sum(-1) \
                    + (Lam.shape[-1] + 4) * U64 * term.abs().sum(-1)
            continue
        e = tr["err"][k]
        n = Lam.shape[-1]
        term = Lam.abs() * _at(e)
        if st.kind == "affine":
            (Wm, _), bias, parts = kern.mats[j]
            if bias is not None:
                term = term + Lam * _at(bias[0])
            Lnew = Lam @ Wm.T
            if not plain:
                pad = pad + (n + 4) * U64 * (Lam.abs() * _at(tr[f"wmag{k}"])).sum(-1)
        elif st.kind == "shift":
            term = term + Lam * _at(kern.mats[j][0])
            Lnew = Lam
        else:
            cm = kern.mats[j][0]
            sc = cm if st.prim == "mul" else 1.0 / cm
            Lnew = Lam * _at(sc.expand_as(lo))
            if not plain:
                pad = pad + 4 * U64 * (Lnew.abs() * _at(amag)).sum(-1)
        c = c + term.sum(-1)
        if not plain:  # this addition's rounding: partial sums of c may cancel later
            pad = pad + 2 * U64 * c.abs()
        if not plain:
            pad = pad + (n + 4) * U64 * term.abs().sum(-1)
        Lam = Lnew
    c = c + (Lam.abs() * _at(r.input_err[k])).sum(-1)
    if plain:
        return _plain_upper(r.box, Lam, c)
    pad = pad + (Lam.shape[-1] + 8) * U64 * c.abs() + 16 * U64 * (Lam.abs() * _at(
        r.input_err[k])).sum(-1)
    if coefficients is not None:
        coefficients.append(Lam)
    return _concretize_upper(r.box, Lam, c, pad)


def backward_drift(cb: ChainBounds, r: Bounds, C: torch.Tensor, upto: int | None = None,
                   coefficients: list | None = None,
                   slopes: dict[int, torch.Tensor] | None = None, plain: bool = False
                   ) -> torch.Tensor:
    """Upper bounds of C (v_inf - v_train) at the output over each box (C (batch, q, n_out)):
    back-substitution through the joint relaxations of (training value, drift) per layer
    (module doc); the training kernel's own error e_t enters both channels, so it is counted
    once as |Lam_t - Lam_d| e_t. Lower bounds: -backward_drift(-C). ``slopes``, ``plain``: the
    training value's lower slopes and plain mode, as in ``backward_value``."""
    Ld = C if plain else C.to(F64)
    Lt = torch.zeros_like(Ld)
    c = torch.zeros(Ld.shape[:2], dtype=Ld.dtype, device=Ld.device)
    pad = torch.zeros_like(c)
    kt, ki = cb.kernels
    for j in reversed(range(len(cb.chain.steps) if upto is None else upto)):
        st, tr = cb.chain.steps[j], _mags(cb, r.trace[j], j)
        lt, ht, dl, dh = tr["lo"][0], tr["hi"][0], tr["dlo"], tr["dhi"]
        tmag, dmag = tr["mag0"], tr["dmag"]
        if st.kind == "relu":
            if "relax_d" not in tr:
                tr["relax_d"] = _drift_relax(lt, ht, tr["lo"][1], tr["hi"][1], dl, dh)
            (pu, qu, ru), (pl, ql, rl), (su, iu, sl) = tr["relax_d"]
            Pt, Nt = Lt.clamp(min=0), Lt.clamp(max=0)
            Pd, Nd = Ld.clamp(min=0), Ld.clamp(max=0)
            term = Pt * _at(iu) + Pd * _at(ru) + Nd * _at(rl)
            c = c + term.sum(-1)
            if not plain:  # this addition's rounding: partial sums of c may cancel later
                pad = pad + 2 * U64 * c.abs()
            a = _at(sl) if slopes is None or j not in slopes else _slope(slopes[j], lt, ht, sl)
            Lt = Pt * _at(su) + Nt * a + Pd * _at(pu) + Nd * _at(pl)
            Ld = Pd * _at(qu) + Nd * _at(ql)
            if not plain:
                pad = pad + 8 * U64 * ((((Pt.abs() * _at(su) + Nt.abs() * a) + Pd.abs() * _at(
                    pu.abs()) + Nd.abs() * _at(pl.abs())) * _at(tmag)).sum(-1)
                    + (Ld.abs() * _at(dmag)).sum(-1)) \
                    + (Ld.shape[-1] + 8) * U64 * term.abs().sum(-1) + TINY
            continue
        et, ei = tr["err"]
        n = Ld.shape[-1]
        term = (Lt - Ld).abs() * _at(et) + Ld.abs() * _at(ei)
        if st.kind == "affine":
            (Wt, _), bt, ptp = kt.mats[j]
            (Wi, _), bi, pip = ki.mats[j]
            dW, pd, dWerr = cb.dW[j]
            if tr["wmag_e"] is not None:
                term = term + Ld.abs() * _at(tr["wmag_e"])
            zero = torch.zeros(Wt.shape[1], dtype=F64, device=Wt.device)
            bmt = bt[0] if bt is not None else zero
            db = (bi[0] if bi is not None else zero) - bmt
            term = term + Lt * _at(bmt) + Ld * _at(db) + Ld.abs() * _at(4 * U64 * db.abs())
            nt = torch.cat([Lt, Ld], -1) @ cb.stacked[j]
            nd = Ld @ Wi.T
            if not plain:
                pad = pad + (n + 4) * U64 * ((Lt.abs() * _at(tr["wmag0"])).sum(-1)
                                             + (Ld.abs() * _at(tr["wmag_d"])).sum(-1))
            Lt, Ld = nt, nd
        elif st.kind == "shift":
            cmt, cmi = kt.mats[j][0], ki.mats[j][0]
            dc = cmi - cmt
            term = term + Lt * _at(cmt) + Ld * _at(dc) + Ld.abs() * _at(4 * U64 * dc.abs())
        else:
            cm = kt.mats[j][0]
            sc = (cm if st.prim == "mul" else 1.0 / cm).expand_as(lt)
            Lt, Ld = Lt * _at(sc), Ld * _at(sc)
            if not plain:
                pad = pad + 4 * U64 * ((Lt.abs() * _at(tmag)).sum(-1)
                                       + (Ld.abs() * _at(dmag)).sum(-1))
        c = c + term.sum(-1)
        if not plain:  # this addition's rounding: partial sums of c may cancel later
            pad = pad + 2 * U64 * c.abs()
        if not plain:
            pad = pad + (n + 4) * U64 * term.abs().sum(-1)
    et, ei = r.input_err
    if cb.specs[0].compute == cb.specs[1].compute:  # the same stored value: no input drift
        term = Lt.abs() * _at(et)
    else:
        term = (Lt - Ld).abs() * _at(et) + Ld.abs() * _at(ei)
    c = c + term.sum(-1)
    if not plain:  # this addition's rounding: partial sums of c may cancel later
        pad = pad + 2 * U64 * c.abs()
    if plain:
        return _plain_upper(r.box, Lt, c)
    pad = pad + (Lt.shape[-1] + 8) * U64 * (c.abs() + term.abs().sum(-1))
    if coefficients is not None:  # the bound's linear function of x: a split heuristic's input
        coefficients.append(Lt)
    return _concretize_upper(r.box, Lt, c, pad)
