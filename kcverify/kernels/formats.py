"""Number formats and their constants (docs/semantics.md §1.1). Pure Python: the DSL imports this.

For a floating format with p significand bits (implicit bit included), round-to-nearest gives
|fl(a) - a| <= u*|a| for a in the normal range with u = 2^-p, and |fl(a) - a| <= eta (half the
smallest subnormal) below it; together |fl(a) - a| <= u*|a| + eta for every finite a.
Integer formats are symmetric with steps in [-qmax, qmax]; |s*round(a/s) - a| <= s/2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kcverify.errors import KernelSpecError


@dataclass(frozen=True)
class Format:
    """A number format: its kind, constants, and the ml_dtypes name that realizes it exactly."""

    name: str
    kind: Literal["float", "int"]
    bits: int
    u: float = 0.0  # unit roundoff (float formats)
    max_finite: float = 0.0  # largest finite magnitude (float) or qmax (int)
    min_normal: float = 0.0
    eta: float = 0.0  # half the smallest subnormal
    mantissa_bits: int = 0  # explicit fraction bits
    exponent_bits: int = 0
    ml_dtype: str | None = None  # ml_dtypes / numpy name of the exact cast

    @property
    def qmax(self) -> int:
        """Largest integer step of an int format."""
        if self.kind != "int":
            raise ValueError(f"{self.name} is not an integer format")
        return int(self.max_finite)

    @property
    def smallest_subnormal(self) -> float:
        return 2.0 * self.eta

    @property
    def has_inf(self) -> bool:
        """Whether the format encodes infinities (fp8 e4m3fn, fp6 and fp4 do not)."""
        return self.kind == "float" and self.name not in NO_INF

    @property
    def has_nan(self) -> bool:
        """Whether the format encodes NaN (the OCP MX fp6 / fp4 element formats do not: every
        conversion to them saturates)."""
        return self.kind == "float" and self.name not in NO_NAN

    @property
    def emax(self) -> int:
        """The exponent of the largest normal number (OCP MX's emax_elem: e2m1 2, e2m3 2,
        e3m2 4, e4m3 8, e5m2 15)."""
        import math

        return math.floor(math.log2(self.max_finite))

    def canonical(self) -> str:
        return self.name


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("fp8_e4m3", "float", 8, u=2.0**-4, max_finite=448.0, min_normal=2.0**-6,
               eta=2.0**-10, mantissa_bits=3, exponent_bits=4, ml_dtype="float8_e4m3fn"),
        Format("fp8_e5m2", "float", 8, u=2.0**-3, max_finite=57344.0, min_normal=2.0**-14,
               eta=2.0**-17, mantissa_bits=2, exponent_bits=5, ml_dtype="float8_e5m2"),
        Format("bf16", "float", 16, u=2.0**-8, max_finite=float.fromhex("0x1.fep+127"),
               min_normal=2.0**-126, eta=2.0**-134, mantissa_bits=7, exponent_bits=8,
               ml_dtype="bfloat16"),
        Format("fp16", "float", 16, u=2.0**-11, max_finite=65504.0, min_normal=2.0**-14,
               eta=2.0**-25, mantissa_bits=10, exponent_bits=5, ml_dtype="float16"),
        Format("fp32", "float", 32, u=2.0**-24, max_finite=float.fromhex("0x1.fffffep+127"),
               min_normal=2.0**-126, eta=2.0**-150, mantissa_bits=23, exponent_bits=8,
               ml_dtype="float32"),
        Format("fp64", "float", 64, u=2.0**-53, max_finite=float.fromhex("0x1.fffffffffffffp+1023"),
               min_normal=2.0**-1022, eta=2.0**-1075, mantissa_bits=52, exponent_bits=11,
               ml_dtype="float64"),
        # OCP Microscaling (MX) v1.0 element formats: no infinities and no NaN (saturating casts)
        Format("fp6_e2m3", "float", 6, u=2.0**-4, max_finite=7.5, min_normal=1.0,
               eta=2.0**-4, mantissa_bits=3, exponent_bits=2, ml_dtype="float6_e2m3fn"),
        Format("fp6_e3m2", "float", 6, u=2.0**-3, max_finite=28.0, min_normal=0.25,
               eta=2.0**-5, mantissa_bits=2, exponent_bits=3, ml_dtype="float6_e3m2fn"),
        Format("fp4_e2m1", "float", 4, u=2.0**-2, max_finite=6.0, min_normal=1.0,
               eta=0.25, mantissa_bits=1, exponent_bits=2, ml_dtype="float4_e2m1fn"),
        Format("int8", "int", 8, max_finite=127.0, ml_dtype="int8"),
        Format("int4", "int", 4, max_finite=7.0, ml_dtype="int4"),
    )
}

NO_INF = frozenset({"fp8_e4m3", "fp6_e2m3", "fp6_e3m2", "fp4_e2m1"})
NO_NAN = frozenset({"fp6_e2m3", "fp6_e3m2", "fp4_e2m1"})
# formats a MatMul operand may be cast to but that no kernel computes or accumulates in
ELEMENT_ONLY = frozenset({"fp6_e2m3", "fp6_e3m2", "fp4_e2m1"})

ALIASES = {
    "e4m3": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3",
    "e5m2": "fp8_e5m2", "float8_e5m2": "fp8_e5m2", "bfloat16": "bf16", "float16": "fp16",
    "half": "fp16", "fp4": "fp4_e2m1", "e2m1": "fp4_e2m1", "float4_e2m1fn": "fp4_e2m1",
    "fp6": "fp6_e2m3", "e2m3": "fp6_e2m3", "float6_e2m3fn": "fp6_e2m3", "e3m2": "fp6_e3m2",
    "float6_e3m2fn": "fp6_e3m2", "float32": "fp32", "float": "fp32", "float64": "fp64", "double": "fp64",
}


def get_format(name: str) -> Format:
    """Look a format up by name or alias; unknown names raise KernelSpecError listing the known."""
    key = ALIASES.get(str(name).lower(), str(name).lower())
    try:
        return FORMATS[key]
    except KeyError:
        raise KernelSpecError(
            f"unknown number format {name!r}; expected one of {', '.join(FORMATS)}") from None


def gamma(n: int, u: float) -> float:
    """Higham's gamma_n = n*u / (1 - n*u): the relative error of an n-term sum in any order.

    Valid only when n*u < 1; callers must check (a kernel with n*u >= 1 has no bound).
    """
    nu = n * u
    if nu >= 1.0:
        return float("inf")
    return nu / (1.0 - nu)


def sum_error(n: int, u: float, exact_terms: bool = True) -> float:
    """k with |fl(sum x_i) - sum x_i| <= k * sum |x_i| for n terms added in *any* order (any
    evaluation tree), every addition rounded to nearest with unit roundoff u.

    ``exact_terms``: the terms are values of the accumulator format, so only the n - 1
    additions round and k = (n - 1) u, for every n (Rump 2012 for recursive summation,
    Jeannerod & Rump 2013 for any order: no 1/(1 - nu) factor; additions are exact below the
    normal range, so no absolute term). Otherwise each term is rounded on entry too and
    k = gamma_n (Higham, Thm 3.1)."""
    if n <= 1:
        return 0.0 if exact_terms else (u if n == 1 else 0.0)
    if exact_terms:
        return (n - 1) * u
    return gamma(n, u)
