"""Kernel specs: typed, canonical descriptions of a family of conforming programs (semantics §1.1).

Pure Python (the DSL imports this). The semantics a spec fixes, for every program conforming to it:

* every tensor an op produces is stored in ``compute`` format: an elementwise or normalising
  primitive returns its exact result with relative error <= ulps[primitive] * u_compute (plus the
  format's eta below the normal range); +, -, *, / are correctly rounded (1 ulp = u);
* a MatMul / Gemm / Conv casts its constant inputs by ``weights`` and its non-constant inputs by
  ``activations`` (when given; otherwise they stay in ``compute`` format), multiplies exactly and
  accumulates in ``accumulate`` format in any order (error <= gamma_n * sum |a_i b_i| plus
  n eta_acc s_a s_b), then rescales and rounds the result to ``compute`` format (two roundings);
* a scale computed from amax is s = fl32(max(amax, floor) / max_finite) (qmax for integer
  formats), floor = ``amax_floor`` (default DEFAULT_AMAX_FLOOR = 1e-12, torchao's clamp): a normal
  float32 number, never 0 or subnormal (a subnormal amax / 448 would make 0/0 = NaN or a scale
  off by 1e-2 relative);
* a MatMul accumulates the *unscaled* products q_a q_b of the cast values (format values,
  integer steps for int formats; operands without a cast: their compute-format values, s = 1)
  in the accumulator format, in any order; with per-block scales each block's partial sum is
  multiplied by its scales (one rounding in the accumulator) and the blocks summed there. So an
  accumulator that can overflow (fp16: 448^2 > 65504) makes the bound infinite, and the
  underflow of every rounding is an absolute eta_acc (times the scales) per term;
* ``rounding`` governs the casts a program performs at run time: the activation casts (every
  non-constant MatMul / Gemm / Conv operand) and a graph's ``Cast``. They round to nearest-even
  unless ``rounding: any`` (then any neighbour of the exact value: an error below one spacing,
  |Q(a) - a| <= 2u|a| + 2 eta s, against u|a| + eta s to nearest; a quotient just above
  max_finite - a dynamic scale fl32(amax / max_finite) rounded down - may then become +-inf or
  NaN). Weights are cast once, ahead of time, to nearest-even whatever ``rounding`` says (Q(W)
  is one point, computed exactly); arithmetic (+, -, *, /, the accumulation, the primitives)
  keeps its own error model above and below (``ulps``), which ``rounding`` does not change;
* a graph's ``Cast`` to a float type rounds into that type as a cast does (onnxruntime's fp32
  Cast(fp16) -> Cast(fp32) does), +-inf beyond its range, and stores the result in the compute
  format; it is the identity only where the target holds every compute-format value;
* overflow is IEEE's: any rounding, partial sum (of a row sum or a LayerNorm moment, in the
  accumulator or stored in the compute format) or stored value that may exceed max_finite may be
  +-inf, and inf - inf, 0 * inf, 0 / 0 or a fully -inf softmax row NaN: the bound there is
  infinite, never a finite set that excludes them. Underflow likewise: an eps or a divisor may
  be 0 in the compute format (BERT's eps = 1e-12 in fp16);
* every sum over a tensor's elements - a standalone ReduceSum / ReduceMean, and the row sums
  inside normalising ops (Softmax's sum of exps, LayerNormalization's mean and variance) - is a
  reduction like a dot product's: its n terms are added in any order (any evaluation tree) in
  the ``accumulate`` format, then stored in the compute format with ulps["reduce"]. Error:
  (n - 1) u_acc * sum |x| (Jeannerod & Rump 2013), or gamma_n when the compute format is finer
  than the accumulator. Never one ulp: torch's own fp32 softmax at n = 4096 is outside that;
* Softmax: subtract the row max (add), exp (ulps["exp"]), the row sum above, then one division
  or the reciprocal of the sum times each term (div, then mul: torch's and onnxruntime's CPU
  kernels);
* LayerNormalization: the row's mean and variance in the accumulator format by sums in any
  order (two-pass: mean = sum/n, var = sum((x - mean)^2)/n; onnxruntime, ONNX's function body,
  the realizer) or by Welford / Chan updates combined in a binary tree of height
  <= 32 + ceil(log2 n) (torch's CPU RowwiseMoments). ``moments`` names the family: ``any``
  (the default: either), ``sums`` (two-pass only) or ``welford`` (the older name of ``any``,
  kept so that certificates that state it keep their digest) - then
  r = rsqrt(var + eps) (ulps["rsqrt"], or sqrt then div) and y = ((x - mean) * r) * g + b, each
  operation correctly rounded in the compute format (torch: (x + (-mean)) * r * g + b).
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kcverify.errors import KernelSpecError
from kcverify.kernels.formats import Format, get_format

WEIGHT_SCALES = ("none", "per_tensor", "per_channel", "per_block", "static", "mx", "nv")
ACTIVATION_SCALES = ("none", "static", "dynamic_per_tensor", "dynamic_per_token", "dynamic_per_block",
                     "mx", "nv")
ORDERS = ("any", "sequential", "pairwise", "tile_k")
MMAS = ("sm90_fp8",)
MMA_GROUP = {"sm90_fp8": 32}  # the K of one tensor-core instruction (wgmma k32 for fp8)
ROUNDINGS = ("nearest", "any")
MOMENTS = ("any", "sums", "welford")
# Default error, in ulps of the compute format, of each primitive a conforming program may use.
DEFAULT_ULPS: dict[str, float] = {
    "add": 1, "mul": 1, "div": 1, "sqrt": 1, "exp": 2, "log": 2, "tanh": 2, "erf": 2,
    "sigmoid": 2, "pow": 2, "rsqrt": 2, "reduce": 1,
}

# An absolute error, in units u of the compute format, that a primitive may add to its relative
# one (ulps): the runtimes' own fp32 kernels measured (session 9, finding F8; onnxruntime 1.32
# CPU / MLAS and torch 2.13 CPU on a 600,001-point grid over [-30, 30]): onnxruntime's Sigmoid
# is off by up to 1.66e-7 absolutely (2.8 u of fp32: 1.19e-7 at x = -17.96 where the exact value
# is 1.6e-8, 0 at x = -20), its Tanh by 4.5 u relatively near +-1 (-1.0000002); torch's sigmoid
# by 2.48 u relatively at 6e-8. 4 u absolute covers all three (with the 2 ulps relative).
# torch's fused fp32 Gelu (erf form) on a tensor of two or more elements evaluates its own
# vectorised erf, off by up to 11.6 u absolutely (f off by 1.16e-6, 19.4 u; a one-element tensor
# takes the accurate scalar path; finding F9): "gelu_erf", the erf inside a fused Gelu, 16 u.
# Not a field of the spec (it is the error model's, like the rules): certificate digests keep.
DEFAULT_ABS_ULPS: dict[str, float] = {"sigmoid": 4, "tanh": 4, "gelu_erf": 16}

Locate = Callable[[tuple[str, ...]], tuple[str | None, int | None, int | None]]


def _nowhere(_path: tuple[str, ...]) -> tuple[str | None, int | None, int | None]:
    return (None, None, None)


# The floor a real kernel clamps amax to before it divides (torchao's float8 EPS): a scale is
# s = fl32(max(amax, floor) / max_finite), a normal float32 number for every amax, so a conforming
# program never divides by a zero or subnormal scale (0/0 = NaN) and the scale's own rounding is
# relative. A spec may state another floor (``amax_floor``).
DEFAULT_AMAX_FLOOR = 1e-12
_MIN_NORMAL_FP32 = 2.0**-126
AMAX_SCALES = ("per_tensor", "per_channel", "per_block", "dynamic_per_tensor", "dynamic_per_token",
               "dynamic_per_block", "nv")


@dataclass(frozen=True)
class CastSpec:
    """How one tensor role (weights or activations) is cast before a MatMul/Gemm/Conv.

    ``block_size``: the block length along K of a blocked scale (per_block, dynamic_per_block,
    mx, nv), or a pair (bk, bn) for 2-D per_block weight tiles. ``saturate``: None (the
    format's default: fp8 saturates, fp6 / fp4 always do), False (e4m3 overflows to NaN, e5m2
    to inf). ``ftz``: subnormal results of the cast are flushed to zero."""

    format: Format
    scale: str = "none"
    block_size: int | tuple[int, int] | None = None
    value: float | None = None  # the scale itself, for ``static`` (a float32 value)
    amax_floor: float | None = None  # None: DEFAULT_AMAX_FLOOR (a float32 value when given)
    saturate: bool | None = None
    ftz: bool = False

    @property
    def floor(self) -> float:
        """The amax floor as the float32 number kernels use."""
        return _fl32(DEFAULT_AMAX_FLOOR if self.amax_floor is None else self.amax_floor)

    @property
    def kind(self):  # noqa: ANN201 - kcverify.kernels.scales.ScaleKind (import cycle)
        """The scale kind object (kcverify.kernels.scales)."""
        from kcverify.kernels.scales import kind_of

        return kind_of(self)

    def canonical(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": self.format.name, "scale": self.scale}
        if self.block_size is not None:
            out["block_size"] = (list(self.block_size) if isinstance(self.block_size, tuple)
                                 else self.block_size)
        if self.value is not None:
            out["value"] = float(self.value).hex()
        if self.amax_floor is not None or self.scale in AMAX_SCALES:
            # explicit even when defaulted: a certificate's spec digest names the floor its
            # scales were bounded with
            out["amax_floor"] = float(self.floor).hex()
        if self.saturate is not None:
            out["saturate"] = self.saturate
        if self.ftz:
            out["ftz"] = True
        return out


@dataclass(frozen=True)
class Accumulation:
    """The accumulation family of a kernel's dot products (docs/kernels.md).

    ``order``: ``any`` (every evaluation tree: the widest family), ``sequential`` (left to
    right), ``pairwise`` (by levels: adjacent pairs (t0 + t1), (t2 + t3), ..., an odd last
    term carried to the next level; kernels/realize.py ``_pairwise``), ``tile_k`` (blocks of ``tile_k`` terms summed left to right, the
    blocks' sums combined in any order). ``mma``: a tensor-core accumulator (``sm90_fp8``:
    Hopper FP8 wgmma, groups of 32 products aligned to the group's largest exponent, truncated
    to 13 fractional bits, summed and rounded toward zero to 13 fraction bits), promoted every
    ``promote`` products (None: never) into the fp32 accumulator, the promoted partial sums
    combined in any order. ``split_k``: the finite set of split-K factors a kernel may use (K in
    S contiguous parts of ceil(K / S) products, for an mma rounded up to a multiple of 32, the
    last part shorter - CUTLASS's and cuBLAS's split; an even split such as numpy.array_split's
    is another kernel - each accumulated alone, the S partial sums added in the accumulator:
    left to right in a pinned kernel, in any order otherwise); a certificate covers each. A
    pinned kernel's + - * / are correctly rounded to nearest; its MatMul rescale s_a s_b acc
    may take one or two roundings."""

    order: str = "any"
    tile_k: int | None = None
    mma: str | None = None
    promote: int | None = None
    split_k: tuple[int, ...] = (1,)

    @property
    def is_default(self) -> bool:
        """``accumulate: FORMAT``: any order, nothing else said (today's digest)."""
        return self == Accumulation()

    @property
    def pinned(self) -> bool:
        """One schedule per split-K configuration: a point input gives one value per config."""
        return self.mma is None and self.order in ("sequential", "pairwise")

    def canonical(self) -> dict[str, Any]:
        out: dict[str, Any] = {"order": self.order}
        if self.tile_k is not None:
            out["tile_k"] = self.tile_k
        if self.mma is not None:
            out["mma"] = self.mma
            out["promote"] = self.promote
        out["split_k"] = list(self.split_k)
        return out


@dataclass(frozen=True)
class KernelSpec:
    """One kernel: the error model of every program that conforms to it."""

    name: str
    compute: Format
    accumulate: Format
    weights: CastSpec | None = None
    activations: CastSpec | None = None
    rounding: str = "nearest"
    ulps: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_ULPS))
    onnx: str | None = None  # a second ONNX graph (e.g. QDQ) that *is* this kernel
    moments: str = "any"  # LayerNorm's mean and variance: "any" (sums or Welford trees), "sums"
    accumulation: Accumulation = field(default_factory=Accumulation)  # the family (order, mma)

    def ulp(self, primitive: str) -> float:
        return float(self.ulps.get(primitive, DEFAULT_ULPS.get(primitive, 2)))

    def abs_err(self, primitive: str) -> float:
        """The absolute error a primitive may add to its relative one (DEFAULT_ABS_ULPS)."""
        return float(DEFAULT_ABS_ULPS.get(primitive, 0.0)) * self.compute.u

    def canonical(self) -> dict[str, Any]:
        """A JSON-able, order-independent form: what certificates digest. Every semantic default
        is written out (``moments``, each amax-derived scale's ``amax_floor``), so the digest
        says which semantics a proof was made under."""
        out: dict[str, Any] = {
            "compute": self.compute.name,
            "accumulate": self.accumulate.name,
            "rounding": self.rounding,
            "ulps": {k: float(v) for k, v in sorted(self.ulps.items())},
        }
        if self.weights is not None:
            out["weights"] = self.weights.canonical()
        if self.activations is not None:
            out["activations"] = self.activations.canonical()
        if self.onnx is not None:
            out["onnx"] = self.onnx
        out["moments"] = self.moments  # explicit: the LayerNorm family the proof covers
        if not self.accumulation.is_default:  # absent: any order, today's digest
            out["accumulation"] = self.accumulation.canonical()
        return out


def _fail(locate: Locate, path: tuple[str, ...], message: str) -> KernelSpecError:
    file, line, col = locate(path)
    return KernelSpecError(message, file, line, col)


def _format(value: Any, locate: Locate, path: tuple[str, ...]) -> Format:
    try:
        return get_format(str(value))
    except KernelSpecError as e:
        raise _fail(locate, path, e.message) from None


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _cast(raw: Any, role: str, locate: Locate, path: tuple[str, ...]) -> CastSpec:
    from kcverify.kernels.scales import KINDS, Unsupported

    if isinstance(raw, str):
        raw = {"format": raw}
    if not isinstance(raw, Mapping):
        raise _fail(locate, path, f"kernel {role} must be a mapping with 'format' and 'scale'")
    allowed = {"format", "scale", "block_size", "value", "amax_floor", "saturate", "ftz"}
    for key in raw:
        if key not in allowed:
            raise _fail(locate, (*path, str(key)),
                        f"unknown key {key!r} in {role}; expected one of {', '.join(sorted(allowed))}")
    if "format" not in raw:
        raise _fail(locate, path, f"{role} needs a 'format'")
    fmt = _format(raw["format"], locate, (*path, "format"))
    scales = WEIGHT_SCALES if role == "weights" else ACTIVATION_SCALES
    scale = str(raw.get("scale", "none"))
    if scale not in scales:
        raise _fail(locate, (*path, "scale"),
                    f"unknown {role} scaling {scale!r}; expected one of {', '.join(scales)}")
    kind = KINDS[scale]
    block = raw.get("block_size")
    if kind.blocked:
        block = kind.default_block if block is None else block
        if isinstance(block, list | tuple) and scale == "per_block" and len(block) == 2 \
                and all(_positive_int(b) for b in block):
            block = (int(block[0]), int(block[1]))
        elif not _positive_int(block):
            what = ("a positive integer or a pair [k, n] of them (2-D weight tiles)"
                    if scale == "per_block" else "a positive integer")
            raise _fail(locate, (*path, "block_size"), f"block_size must be {what}")
    elif block is not None:
        raise _fail(locate, (*path, "block_size"),
                    f"block_size needs a blocked scale (per_block, dynamic_per_block, mx, nv), "
                    f"not {scale!r}")
    value = raw.get("value")
    if scale == "static":
        if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
            raise _fail(locate, (*path, "value"), "a static scale needs a positive number 'value'")
        # kernels store scales in float32: the spec means the float32 nearest to what is written,
        # so realizations, QDQ graphs and the bound engine all use one and the same scale
        value = _fl32(float(value))
        if not 0 < value < float("inf"):
            raise _fail(locate, (*path, "value"), "a static scale must be a positive float32")
    elif value is not None:
        raise _fail(locate, (*path, "value"), f"'value' is only for a static scale, not {scale!r}")
    floor = raw.get("amax_floor")
    if floor is not None:
        if scale not in AMAX_SCALES:
            raise _fail(locate, (*path, "amax_floor"),
                        f"'amax_floor' is for scales computed from amax, not {scale!r}")
        if not isinstance(floor, int | float) or isinstance(floor, bool) or not floor > 0:
            raise _fail(locate, (*path, "amax_floor"), "amax_floor must be a positive number")
        floor = _fl32(float(floor))
        qmax = fmt.max_finite * (448.0 if scale == "nv" else 1.0)
        if not floor / qmax >= _MIN_NORMAL_FP32 or floor == float("inf"):
            raise _fail(locate, (*path, "amax_floor"),
                        f"amax_floor / {qmax:g} must be a normal float32 number "
                        f"(amax_floor >= {qmax * _MIN_NORMAL_FP32:.3g})")
    saturate = raw.get("saturate")
    if saturate is not None:
        if not isinstance(saturate, bool):
            raise _fail(locate, (*path, "saturate"), "saturate must be true or false")
        if fmt.kind != "float" or fmt.bits > 8:
            raise _fail(locate, (*path, "saturate"),
                        f"saturate is for fp8, fp6 and fp4 casts, not {fmt.name!r}")
        if not saturate and not (fmt.has_inf or fmt.has_nan):
            raise _fail(locate, (*path, "saturate"),
                        f"{fmt.name} has no infinity and no NaN: its casts always saturate")
        if not saturate and kind.saturating:
            raise _fail(locate, (*path, "saturate"),
                        f"{scale} scales let elements exceed max_finite: their casts saturate")
    ftz = raw.get("ftz", False)
    if not isinstance(ftz, bool):
        raise _fail(locate, (*path, "ftz"), "ftz must be true or false")
    if fmt.kind == "int" and role == "activations":
        raise _fail(locate, (*path, "format"),
                    f"integer format {fmt.name!r} is supported for weights only (weight-only quantization)")
    if fmt.kind == "int" and scale == "none":
        raise _fail(locate, (*path, "scale"), f"integer format {fmt.name!r} needs a scale")
    if fmt.kind == "int" and ftz:
        raise _fail(locate, (*path, "ftz"), "ftz is for float formats")
    cs = CastSpec(fmt, scale, block, value, floor, saturate, ftz)
    try:
        kind.check(cs, role)
    except Unsupported as e:
        raise _fail(locate, (*path, "scale"), e.message) from None
    return cs


_ACC_KEYS = {"format", "order", "tile_k", "mma", "promote", "split_k"}


def _split_k(raw: Any, locate: Locate, path: tuple[str, ...]) -> tuple[int, ...]:
    vals = [raw] if _positive_int(raw) else raw
    if not isinstance(vals, list | tuple) or not vals or not all(_positive_int(v) for v in vals):
        raise _fail(locate, path, "split_k must be a positive integer or a list of them")
    return tuple(sorted({int(v) for v in vals}))


def _accumulate(raw: Any, compute: Format, locate: Locate, path: tuple[str, ...]
                ) -> tuple[Format, Accumulation]:
    """``accumulate: FORMAT`` or ``{format, order, tile_k, mma, promote, split_k}``."""
    if raw is None:
        return compute, Accumulation()
    if not isinstance(raw, Mapping):
        return _format(raw, locate, path), Accumulation()
    for key in raw:
        if key not in _ACC_KEYS:
            raise _fail(locate, (*path, str(key)),
                        f"unknown key {key!r} in accumulate; expected one of {', '.join(sorted(_ACC_KEYS))}")
    mma = raw.get("mma")
    if mma is not None and str(mma) not in MMAS:
        raise _fail(locate, (*path, "mma"), f"unknown mma {mma!r}; expected one of {', '.join(MMAS)}")
    default = "fp32" if mma is not None else compute.name
    fmt = _format(raw.get("format", default), locate, (*path, "format"))
    order = raw.get("order", "any")
    tile_k = raw.get("tile_k")
    if isinstance(order, Mapping):  # order: {tile_k: N}
        if set(order) != {"tile_k"}:
            raise _fail(locate, (*path, "order"), "order must be any, sequential, pairwise, "
                        "tile_k or {tile_k: N}")
        if tile_k is not None:
            raise _fail(locate, (*path, "tile_k"), "tile_k is given twice")
        tile_k, order = order["tile_k"], "tile_k"
    order = str(order)
    if tile_k is not None and order == "any":
        order = "tile_k"
    if order not in ORDERS:
        raise _fail(locate, (*path, "order"),
                    f"unknown order {order!r}; expected one of {', '.join(ORDERS)} or {{tile_k: N}}")
    if order == "tile_k" and not _positive_int(tile_k):
        raise _fail(locate, (*path, "tile_k"), "order tile_k needs tile_k: a positive integer")
    if order != "tile_k" and tile_k is not None:
        raise _fail(locate, (*path, "tile_k"), f"tile_k is for order tile_k, not {order!r}")
    promote = raw.get("promote")
    if mma is not None:
        mma = str(mma)
        group = MMA_GROUP[mma]
        if fmt.name != "fp32":
            raise _fail(locate, (*path, "format"), f"mma {mma} promotes into fp32, not {fmt.name}")
        if order != "any":
            raise _fail(locate, (*path, "order"),
                        f"mma {mma}: the promoted partial sums are combined in any order; "
                        "order is not a choice here")
        if promote is not None and (not _positive_int(promote) or promote % group):
            raise _fail(locate, (*path, "promote"),
                        f"promote must be a positive multiple of {group} (the instruction's K)")
    elif promote is not None:
        raise _fail(locate, (*path, "promote"), "promote is for an mma accumulator")
    split = _split_k(raw["split_k"], locate, (*path, "split_k")) if "split_k" in raw else (1,)
    return fmt, Accumulation(order, None if tile_k is None else int(tile_k), mma,
                             None if promote is None else int(promote), split)


def _fl32(x: float) -> float:
    """x rounded to the nearest float32 (round half to even), as a Python float."""
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:
        return float("inf")


def parse_kernel_spec(name: str, raw: Any, locate: Locate | None = None) -> KernelSpec:
    """Build a KernelSpec from its YAML mapping; ``locate(path)`` gives (file, line, col) of a key."""
    locate = locate or _nowhere
    path = ("kernels", name)
    if not isinstance(raw, Mapping):
        raise _fail(locate, path, f"kernel {name!r} must be a mapping")
    allowed = {"compute", "accumulate", "weights", "activations", "rounding", "ulps", "onnx",
               "moments", "split_k"}
    for key in raw:
        if key not in allowed:
            raise _fail(locate, (*path, str(key)),
                        f"unknown key {key!r} in kernel {name!r}; expected one of {', '.join(sorted(allowed))}")
    compute = _format(raw.get("compute", "fp32"), locate, (*path, "compute"))
    accumulate, accumulation = _accumulate(raw.get("accumulate"), compute, locate,
                                           (*path, "accumulate"))
    if "split_k" in raw:  # split_k beside accumulate
        if isinstance(raw.get("accumulate"), Mapping) and "split_k" in raw["accumulate"]:
            raise _fail(locate, (*path, "split_k"), "split_k is given twice (here and in accumulate)")
        accumulation = dataclasses.replace(
            accumulation, split_k=_split_k(raw["split_k"], locate, (*path, "split_k")))
    for role_name, fmt in (("compute", compute), ("accumulate", accumulate)):
        if fmt.kind != "float" or fmt.bits < 16:
            raise _fail(locate, (*path, role_name),
                        f"{role_name} format must be bf16, fp16, fp32 or fp64, not {fmt.name!r}")
    weights = _cast(raw["weights"], "weights", locate, (*path, "weights")) if "weights" in raw else None
    acts = (_cast(raw["activations"], "activations", locate, (*path, "activations"))
            if "activations" in raw else None)
    rounding = str(raw.get("rounding", "nearest"))
    if rounding not in ROUNDINGS:
        raise _fail(locate, (*path, "rounding"),
                    f"unknown rounding {rounding!r}; expected one of {', '.join(ROUNDINGS)}")
    ulps = dict(DEFAULT_ULPS)
    raw_ulps = raw.get("ulps", {})
    if not isinstance(raw_ulps, Mapping):
        raise _fail(locate, (*path, "ulps"), "ulps must map primitive names to numbers")
    for prim, v in raw_ulps.items():
        if prim not in DEFAULT_ULPS:
            raise _fail(locate, (*path, "ulps", str(prim)),
                        f"unknown primitive {prim!r}; expected one of {', '.join(DEFAULT_ULPS)}")
        if not isinstance(v, int | float) or isinstance(v, bool) or v < 0:
            raise _fail(locate, (*path, "ulps", str(prim)), "ulps must be a non-negative number")
        ulps[str(prim)] = float(v)
    onnx_path = raw.get("onnx")
    if onnx_path is not None and not isinstance(onnx_path, str):
        raise _fail(locate, (*path, "onnx"), "onnx must be a path to a second ONNX graph")
    moments = str(raw.get("moments", "any"))
    if moments not in MOMENTS:
        raise _fail(locate, (*path, "moments"),
                    f"unknown moments {moments!r}; expected one of {', '.join(MOMENTS)}")
    if accumulation.mma is not None:
        for role, cs in (("weights", weights), ("activations", acts)):
            if cs is None or not cs.format.name.startswith("fp8"):
                raise _fail(locate, (*path, "accumulate", "mma"),
                            f"mma {accumulation.mma} multiplies fp8 operands: {role} need an fp8 "
                            "format (fp8_e4m3 or fp8_e5m2)")
        if rounding != "nearest":
            raise _fail(locate, (*path, "rounding"),
                        f"mma {accumulation.mma} is modelled with round-to-nearest casts")
    return KernelSpec(name, compute, accumulate, weights, acts, rounding, ulps, onnx_path, moments,
                      accumulation)
