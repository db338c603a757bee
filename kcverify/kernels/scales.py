"""Scale kinds as objects: one class per ``scale:`` value of a cast (semantics §1.1).

Each kind knows, for a cast spec ``cs`` of its kind:

    roles           which tensor roles may use it (weights, activations)
    realize(...)    the exact scales a conforming program computes (float64, broadcastable)
    interval(...)   an enclosure [s_lo, s_hi] of the scale of every element of an interval
                    operand (the bound engine; bounds.casts)
    relative(...)   the relative error model |Q(a) - a| <= k_u |a| + k_eta s_top, or None when
                    the kind admits no such model (a scale that does not keep |a / s| within
                    max_finite: a power-of-two MX scale, an E4M3-rounded NVFP4 scale, saturate)
    qdq(role)       the QDQ form (``"per_tensor"``, ``"per_axis"``, ``"static"``), or Unsupported
    smt_scheme()    the SMT encoding's scheme (``none``, ``static``, ``dynamic``) or Unsupported

and says "unsupported" by raising ``Unsupported`` (a KernelSpecError), never by a silent
fallback. ``kind_of(cs)`` / ``KINDS[name]`` look a kind up. Importing this module stays light (no
torch at import time): the DSL validates specs through ``KINDS``.

The kinds (groups for a MatMul operand with reduction axis r; ``amax`` over the group):

    none                s = 1
    static              s = fl32(value)
    per_tensor          weights: s = fl32(max(amax, floor) / max_finite) over the tensor
    per_channel         weights: one such scale per output feature
    per_block           weights: per output feature and block of ``block_size`` along r, or, with
                        ``block_size: [bk, bn]``, per tile of bk along r x bn output features
                        (DeepSeek-V3's 128x128 weight tiles)
    dynamic_per_tensor  activations: per sample; dynamic_per_token: per row; dynamic_per_block:
                        per row and block of ``block_size`` along r (DeepSeek-V3's 1x128)
    mx                  OCP MX v1.0: per row and block of ``block_size`` (32) along r, an E8M0
                        power of two X = 2^(floor(log2 amax) - emax_elem), clamped to
                        [2^-127, 2^127] (amax = 0: 2^-127); elements cast(V / X) saturating.
                        amax / X lies in [2^emax, 2^(emax+1)), so an element may exceed
                        max_finite (e2m1: up to 8 > 6) and saturates.
    nv                  NVFP4: a float32 tensor scale S = fl32(max(amax_t, floor) / (448 * 6))
                        (amax_t over the tensor; activations: per sample), and per row and block
                        of ``block_size`` (16) along r an E4M3 scale d = RNE_e4m3(amax_b / (6 S))
                        (exact quotient, one rounding); s = d * S; elements cast(V / s)
                        saturating (d may round down: amax_b / s may exceed 6); s = 0 (d
                        underflows) gives Q = 0.
"""

from __future__ import annotations

from typing import Any

from kcverify.errors import KernelSpecError


class Unsupported(KernelSpecError):
    """A scale kind that does not support the asked-for operation (QDQ form, SMT encoding, a
    role, a Conv input)."""


# the floor a real kernel clamps amax to (torchao's float8 EPS): kernels/spec.py documents it
E8M0_MIN, E8M0_MAX = -127, 127
NV_TENSOR_DIVISOR = 448.0 * 6.0


class ScaleKind:
    """The default behaviour; subclasses override what differs (see the module doc)."""

    name = "?"
    roles: frozenset[str] = frozenset({"weights", "activations"})
    amax_based = False  # s = fl32(max(amax, floor) / max_finite): the floor applies
    blocked = False  # varies along the reduction axis in blocks
    default_block: int | tuple[int, int] | None = None
    dynamic = False  # computed from the value at run time (activations) or from the weight
    saturating = False  # |a / s| may exceed max_finite: casts saturate, no relative model
    conv_input = False  # a Conv input may use it

    def __repr__(self) -> str:
        return f"<scale kind {self.name}>"

    # --- validation (pure Python) ------------------------------------------------------------
    def check(self, cs: Any, role: str) -> None:
        """Raise Unsupported when ``cs`` cannot use this kind in ``role``."""
        if role not in self.roles:
            raise Unsupported(f"{role} scaling {self.name!r} is not defined; use one of "
                              f"{', '.join(k for k, v in KINDS.items() if role in v.roles)}")

    def k_block(self, cs: Any) -> int | None:
        """The block length along the reduction axis, or None when constant along it."""
        return None

    # --- realization (torch) ---------------------------------------------------------------
    def realize(self, x: Any, cs: Any, *, out_axis: int = -1, reduce_axis: int = -1,
                sample_axis: Any = 0, role: str = "weights") -> Any:
        raise Unsupported(f"scale {self.name!r}: no realization")

    # --- bounds ------------------------------------------------------------------------------
    def interval(self, lo: Any, hi: Any, cs: Any, side: str, sample_axis: Any = 0,
                 batch: int | None = None) -> tuple[Any, Any]:
        raise Unsupported(f"scale {self.name!r}: no per-element scale bounds")

    def relative(self, cs: Any, rounding: str) -> tuple[float, float] | None:
        """(k_u, k_eta): |Q(a) - a| <= k_u |a| + k_eta s for every a the cast receives, or None
        (no such model: the cast may saturate)."""
        if self.saturating or cs.format.kind != "float":
            return None
        k = 1.0 if rounding == "nearest" else 2.0
        return k * cs.format.u, k * cs.format.eta

    # --- other forms ---------------------------------------------------------------------------
    def qdq(self, role: str) -> str:
        raise Unsupported(f"QDQ export: {role} scaling {self.name!r} is not exported; expected "
                          "per_tensor, per_channel or static")

    def smt_scheme(self) -> str:
        raise Unsupported(f"{self.name} scales are not encoded")


def _torch():
    import torch

    return torch


def _ones(x):
    torch = _torch()
    return torch.ones([1] * x.dim(), dtype=torch.float64, device=x.device)


def _axis(x, axis: int, what: str) -> int:
    if not -x.dim() <= axis < max(x.dim(), 1):
        raise KernelSpecError(f"{what}: axis {axis} is out of range for a tensor of rank {x.dim()}")
    return axis % max(x.dim(), 1)


def _amax_except(x, keep: tuple[int, ...]):
    axes = [d for d in range(x.dim()) if d not in keep]
    a = x.to(_torch().float64).abs()
    return a.amax(dim=axes, keepdim=True) if axes else a


def block_amax(x, axis: int, block: int):
    """amax over blocks of ``block`` entries along ``axis``, expanded back to x's shape."""
    torch = _torch()
    a = x.to(torch.float64).abs().movedim(axis, -1)
    k = a.shape[-1]
    nb = -(-k // block)
    pad = nb * block - k
    if pad:
        a = torch.nn.functional.pad(a, (0, pad))
    m = a.reshape(*a.shape[:-1], nb, block).amax(dim=-1)
    m = m.repeat_interleave(block, dim=-1)[..., :k]
    return m.movedim(-1, axis)


def scale_from_amax(amax, cs):
    """s = fl32(max(amax, floor) / max_finite): one float32 division of the float32 amax."""
    torch = _torch()
    a = torch.clamp(amax.to(torch.float64), min=cs.floor).to(torch.float32)
    m = torch.tensor(float(cs.format.max_finite), dtype=torch.float32, device=a.device)
    return (a / m).to(torch.float64)


class NoScale(ScaleKind):
    name = "none"
    conv_input = True

    def realize(self, x, cs, **_):
        return _ones(x)

    def interval(self, lo, hi, cs, side, sample_axis=0, batch=None):
        one = _ones(lo)
        return one, one

    def relative(self, cs, rounding):
        return None if cs.format.kind != "float" else super().relative(cs, rounding)

    def qdq(self, role):
        raise Unsupported(f"QDQ export: {role} without a scale has no QuantizeLinear form")

    def smt_scheme(self):
        return "none"


class Static(ScaleKind):
    name = "static"
    conv_input = True

    def realize(self, x, cs, **_):
        torch = _torch()
        v = float(torch.tensor(cs.value, dtype=torch.float32))
        return torch.full([1] * x.dim(), v, dtype=torch.float64, device=x.device)

    def interval(self, lo, hi, cs, side, sample_axis=0, batch=None):
        v = float(cs.value or 1.0)
        one = _ones(lo)
        return one * v, one * v

    def qdq(self, role):
        return "static"

    def smt_scheme(self):
        return "static"


class PerTensor(ScaleKind):
    name = "per_tensor"
    roles = frozenset({"weights"})
    amax_based = dynamic = conv_input = True

    def realize(self, x, cs, **_):
        return scale_from_amax(_amax_except(x, ()), cs)

    def qdq(self, role):
        return "per_tensor"


class PerChannel(ScaleKind):
    name = "per_channel"
    roles = frozenset({"weights"})
    amax_based = dynamic = True

    def realize(self, x, cs, *, out_axis=-1, **_):
        if x.dim() == 0:
            return scale_from_amax(x.abs().reshape(()), cs)
        return scale_from_amax(_amax_except(x, (_axis(x, out_axis, "per-channel weight scale"),)), cs)

    def qdq(self, role):
        return "per_axis"


class PerBlock(ScaleKind):
    """Weights: blocks along r per output feature, or 2-D tiles [bk, bn] (module doc)."""

    name = "per_block"
    roles = frozenset({"weights"})
    amax_based = dynamic = blocked = True
    default_block = 32

    def k_block(self, cs):
        b = cs.block_size or self.default_block
        return int(b[0] if isinstance(b, tuple) else b)

    def realize(self, x, cs, *, out_axis=-1, reduce_axis=None, **_):
        if x.dim() == 0:
            return scale_from_amax(x.abs().reshape(()), cs)
        out = _axis(x, out_axis, "per-block weight scale")
        if reduce_axis is None:
            if x.dim() != 2:
                raise KernelSpecError(f"per_block weight scale of a rank-{x.dim()} tensor needs its reduction axis")
            reduce_axis = 1 - out
        r = _axis(x, reduce_axis, "per-block weight scale")
        b = cs.block_size or self.default_block
        if isinstance(b, tuple):  # 2-D tiles: bk along r, bn along the output axis
            a = block_amax(block_amax(x, r, int(b[0])), out, int(b[1]))
            return scale_from_amax(a, cs)
        return scale_from_amax(block_amax(x, r, int(b)), cs)


class DynamicPerTensor(ScaleKind):
    name = "dynamic_per_tensor"
    roles = frozenset({"activations"})
    amax_based = dynamic = conv_input = True

    def realize(self, x, cs, *, sample_axis=0, **_):
        if x.dim() > 1 and isinstance(sample_axis, int) and not isinstance(sample_axis, bool):
            return scale_from_amax(_amax_except(x, (_axis(x, sample_axis, "sample axis"),)), cs)
        return scale_from_amax(_amax_except(x, ()), cs)

    def interval(self, lo, hi, cs, side, sample_axis=0, batch=None):
        from kcverify.bounds.casts import sample_amax, scale_of

        return scale_of(*sample_amax(lo, hi, sample_axis, batch), cs)

    def smt_scheme(self):
        return "dynamic"


class DynamicPerToken(ScaleKind):
    name = "dynamic_per_token"
    roles = frozenset({"activations"})
    amax_based = dynamic = True

    def realize(self, x, cs, *, reduce_axis=-1, **_):
        r = _axis(x, reduce_axis, "dynamic_per_token activation scale")
        return scale_from_amax(x.to(_torch().float64).abs().amax(dim=r, keepdim=True), cs)

    def interval(self, lo, hi, cs, side, sample_axis=0, batch=None):
        from kcverify.bounds.casts import _group_amax, scale_of

        kdim = lo.dim() - 1 if side == "left" else lo.dim() - 2
        return scale_of(*_group_amax(lo, hi, (kdim,)), cs)

    def smt_scheme(self):
        return "dynamic"


class DynamicPerBlock(ScaleKind):
    name = "dynamic_per_block"
    roles = frozenset({"activations"})
    amax_based = dynamic = blocked = True
    default_block = 32

    def k_block(self, cs):
        return int(cs.block_size or self.default_block)

    def realize(self, x, cs, *, reduce_axis=-1, **_):
        r = _axis(x, reduce_axis, "dynamic_per_block activation scale")
        return scale_from_amax(block_amax(x, r, self.k_block(cs)), cs)

    def interval(self, lo, hi, cs, side, sample_axis=0, batch=None):
        from kcverify.bounds.casts import block_scale_bounds

        return block_scale_bounds(lo, hi, cs, side)


def mx_exponent(amax, emax: int):
    """floor(log2 amax) - emax clamped to E8M0's range; amax = 0 gives the least (-127)."""
    torch = _torch()
    _, e = torch.frexp(amax.to(torch.float64))  # amax = m 2^e, m in [0.5, 1)
    ex = e.to(torch.float64) - 1 - emax
    ex = torch.where(amax > 0, ex, torch.full_like(ex, E8M0_MIN))
    return ex.clamp(E8M0_MIN, E8M0_MAX)


class MX(ScaleKind):
    """OCP MX v1.0 (module doc): a power-of-two E8M0 scale per block of 32 along r."""

    name = "mx"
    dynamic = blocked = saturating = True
    default_block = 32

    def check(self, cs, role):
        super().check(cs, role)
        if cs.format.kind != "float" or cs.format.bits > 8:
            raise Unsupported(f"mx scaling needs an fp8, fp6 or fp4 element format, not {cs.format.name!r}")

    def k_block(self, cs):
        return int(cs.block_size or self.default_block)

    def realize(self, x, cs, *, reduce_axis=-1, **_):
        r = _axis(x, reduce_axis, "mx scale")
        return _torch().exp2(mx_exponent(block_amax(x, r, self.k_block(cs)), cs.format.emax))

    def interval(self, lo, hi, cs, side, sample_axis=0, batch=None):
        torch = _torch()
        a_lo, a_hi = _block_amax_range(lo, hi, side, self.k_block(cs))
        return (torch.exp2(mx_exponent(a_lo, cs.format.emax)),
                torch.exp2(mx_exponent(a_hi, cs.format.emax)))


def _block_amax_range(lo, hi, side: str, block: int):
    """[amax_lo, amax_hi] of the block along K holding each element (full shape)."""
    from kcverify.bounds.box import mag, mig

    kdim = lo.dim() - 1 if side == "left" else lo.dim() - 2
    return block_amax(mig(lo, hi), kdim, block), block_amax(mag(lo, hi), kdim, block)


class NV(ScaleKind):
    """NVFP4 (module doc): an E4M3 scale per block of 16 along r times a float32 tensor scale."""

    name = "nv"
    amax_based = dynamic = blocked = saturating = True
    default_block = 16

    def check(self, cs, role):
        super().check(cs, role)
        if cs.format.name != "fp4_e2m1":
            raise Unsupported(f"nv scaling (NVFP4) is for fp4_e2m1 elements, not {cs.format.name!r}")

    def k_block(self, cs):
        return int(cs.block_size or self.default_block)

    def tensor_scale(self, amax, cs):
        """S = fl32(max(amax, floor) / (448 * 6)), float64."""
        torch = _torch()
        a = torch.clamp(amax.to(torch.float64), min=cs.floor).to(torch.float32)
        return (a / torch.tensor(NV_TENSOR_DIVISOR, dtype=torch.float32)).to(torch.float64)

    def realize(self, x, cs, *, reduce_axis=-1, sample_axis=None, role="weights", **_):
        from kcverify.kernels.cast import round_to_format
        from kcverify.kernels.formats import get_format

        r = _axis(x, reduce_axis, "nv scale")
        if role == "activations" and x.dim() > 1 and isinstance(sample_axis, int) \
                and not isinstance(sample_axis, bool):
            t_amax = _amax_except(x, (_axis(x, sample_axis, "sample axis"),))
        else:
            t_amax = _amax_except(x, ())
        S = self.tensor_scale(t_amax, cs)
        b = block_amax(x, r, self.k_block(cs))
        d = round_to_format(b / (cs.format.max_finite * S), get_format("fp8_e4m3"), saturate=True)
        return d * S  # exact: 4 x 24 significant bits

    def interval(self, lo, hi, cs, side, sample_axis=0, batch=None):
        from kcverify.bounds.box import pad_hi, pad_lo
        from kcverify.bounds.casts import SCALE_SLACK, rne, sample_amax
        from kcverify.kernels.formats import get_format

        e4 = get_format("fp8_e4m3")
        # the tensor scale: over the operand (weights) or its sample (activations)
        t_lo, t_hi = sample_amax(lo, hi, sample_axis, batch)
        S_lo = pad_lo(t_lo.clamp_min(cs.floor) / NV_TENSOR_DIVISOR, SCALE_SLACK)
        S_hi = pad_hi(t_hi.clamp_min(cs.floor) / NV_TENSOR_DIVISOR, SCALE_SLACK)
        a_lo, a_hi = _block_amax_range(lo, hi, side, self.k_block(cs))
        # d = RNE_e4m3(amax_b / (6 S)) is monotone in amax_b / S
        d_lo = rne(pad_lo(a_lo / (6.0 * S_hi), 2.0**-50), e4).clamp(0, e4.max_finite)
        d_hi = rne(pad_hi(a_hi / (6.0 * S_lo), 2.0**-50), e4).clamp(0, e4.max_finite)
        return pad_lo(d_lo * S_lo, 2.0**-52), pad_hi(d_hi * S_hi, 2.0**-52)


KINDS: dict[str, ScaleKind] = {k.name: k for k in (
    NoScale(), Static(), PerTensor(), PerChannel(), PerBlock(), DynamicPerTensor(),
    DynamicPerToken(), DynamicPerBlock(), MX(), NV())}


def kind_of(cs: Any) -> ScaleKind:
    """The scale kind of a cast spec (or a name)."""
    name = cs if isinstance(cs, str) else cs.scale
    try:
        return KINDS[name]
    except KeyError:
        raise Unsupported(f"unknown scaling {name!r}; expected one of {', '.join(KINDS)}") from None


def names_for(role: str) -> tuple[str, ...]:
    return tuple(k for k, v in KINDS.items() if role in v.roles)

