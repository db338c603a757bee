"""Attack material shared by the rule, model and campaign tests: inference specs, program
families, adversarial inputs.

* ``SPECS``: inference kernel specs covering every cast scheme (static / dynamic per tensor,
  per token, per block; per-channel / per-block / int8 weights), ``rounding: any``, bf16 / fp16
  compute and accumulators, and directed k-ulp primitives;
* ``programs(spec, n, seed)``: n conforming programs, the first ones extreme (every choice up,
  every choice down, greedy orders), then seeded mixtures of every choice Program leaves open;
* ``pairs(train, inf, n, seed)``: (training program, inference program) pairs, including the
  crossed extremes (train up / inf down and the reverse), which is where drift peaks;
* inputs: ``fp8_midpoints`` places values at rounding midpoints of an fp8 grid, one fp32 ulp
  either side or exactly, for the scale a dynamic cast will compute; ``saturating`` puts values
  at and just under the fp8 saturation point; ``tiny`` puts values in fp32's subnormal range.
"""

from __future__ import annotations

import itertools

import numpy as np

from kcverify.kernels.spec import KernelSpec
from tests.soundness.adversarial.arith import FMT, next_down, next_up, rnd
from tests.soundness.adversarial.harness import TRAIN, spec
from tests.soundness.adversarial.programs import Program

SPECS: dict[str, KernelSpec] = {
    "fp8_tensor_fp32": spec(weights={"format": "fp8_e4m3", "scale": "per_channel"},
                            activations={"format": "fp8_e4m3", "scale": "dynamic_per_tensor"},
                            accumulate="fp32", compute="fp32"),
    "fp8_token_fp32": spec(weights={"format": "fp8_e4m3", "scale": "per_channel"},
                           activations={"format": "fp8_e4m3", "scale": "dynamic_per_token"},
                           accumulate="fp32", compute="fp32"),
    "fp8_tensor_bf16": spec(weights={"format": "fp8_e4m3", "scale": "per_channel"},
                            activations={"format": "fp8_e4m3", "scale": "dynamic_per_tensor"},
                            accumulate="fp32", compute="bf16"),
    "e5m2_any_fp16": spec(weights={"format": "fp8_e5m2", "scale": "per_tensor"},
                          activations={"format": "fp8_e5m2", "scale": "dynamic_per_tensor"},
                          accumulate="fp32", compute="fp16", rounding="any"),
    "fp8_static_block": spec(weights={"format": "fp8_e4m3", "scale": "per_block", "block_size": 4},
                             activations={"format": "fp8_e4m3", "scale": "static", "value": 0.02},
                             accumulate="fp32", compute="fp32"),
    "fp8_dynblock": spec(weights={"format": "fp8_e4m3", "scale": "per_channel"},
                         activations={"format": "fp8_e4m3", "scale": "dynamic_per_block",
                                      "block_size": 8},
                         accumulate="fp32", compute="bf16"),
    "int8_block": spec(weights={"format": "int8", "scale": "per_block", "block_size": 4},
                       accumulate="fp32", compute="bf16"),
    "bf16_acc_bf16": spec(compute="bf16", accumulate="bf16"),
    "fp16_ulps4": spec(compute="fp16", accumulate="fp32",
                       ulps={"exp": 4, "tanh": 4, "erf": 4, "rsqrt": 4, "log": 4, "sigmoid": 4}),
}

ORDERS = ("seq", "rev", "asc", "desc", "posneg", "alt", "pairwise", "chunk4", "random")
ROUNDINGS = ("nearest", "up", "down", "random")


def programs(sp: KernelSpec, n: int, seed: int = 0, **fixed) -> list[Program]:
    """n conforming programs of ``sp``: extremes first, then seeded mixtures (``fixed``: fields
    every program shares, e.g. per_sample)."""
    out = [Program(sp, order="desc", row_order="greedy_up", rounding="up", cast_rounding="up",
                   quotient="fp32", acc="unscaled", rescale="two", seed=seed, label="all-up",
                   **fixed),
           Program(sp, order="posneg", row_order="greedy_down", rounding="down",
                   cast_rounding="down", quotient="exact", acc="unscaled", rescale="one",
                   sm_form="recip", ln_form="two_pass_acc", gelu_form="fused",
                   seed=seed + 1, label="all-down", **fixed),
           Program(sp, order="asc", rounding="nearest", seed=seed + 2,
                   sm_form="fused", ln_form="fused", label="fused-asc", **fixed)]
    rng = np.random.default_rng(seed)
    choices = {
        "order": ORDERS, "row_order": ORDERS + ("greedy_up", "greedy_down"),
        "rounding": ROUNDINGS, "cast_rounding": ("up", "down", "random"),
        "quotient": ("exact", "fp32"),
        "rescale": ("one", "two"),
        "sm_form": ("two_pass", "recip", "fused"), "ln_form": ("two_pass", "two_pass_acc", "fused"),
        "gelu_form": ("decomposed", "onnx", "fused"),
    }
    for k in itertools.count(3):
        if len(out) >= n:
            break
        kw = {name: vals[int(rng.integers(len(vals)))] for name, vals in choices.items()}
        kw.update(fixed)
        out.append(Program(sp, seed=seed + k, label=f"mix{k}:" + ",".join(
            f"{a}={v}" for a, v in kw.items() if a != "per_sample"), **kw))
    return out[:n]


def pairs(train: KernelSpec, inf: KernelSpec, n: int, seed: int = 0, **fixed
          ) -> list[tuple[Program, Program]]:
    """(training, inference) program pairs; the crossed extremes first."""
    pt = programs(train, n, seed, **fixed)
    pi = programs(inf, n, seed + 1000, **fixed)
    out = [(pt[0], pi[1]), (pt[1], pi[0])]
    out += list(zip(pt[2:], pi[2:]))
    return out[:max(n, 2)]


# --- inputs ----------------------------------------------------------------------------------
def fp8_midpoints(shape: tuple[int, ...], fmt: str, rng: np.random.Generator, amax: float = 1.0,
                  group_axis: int | None = None, block: int | None = None,
                  static: float | None = None) -> np.ndarray:
    """fp32 values at midpoints of the fp8 grid (times the scale the cast will compute), exact
    or one fp32 ulp either side. The first element of every scale group holds the group's amax
    (so the dynamic scale is s = fl32(amax / max_finite)); ``group_axis``: the axis a dynamic
    per-token scale reduces over (None: the whole tensor), ``block``: blocks along the last
    axis; ``static``: the static scale instead."""
    f = FMT[fmt]
    x = np.empty(shape)
    s = static if static is not None else float(rnd(amax / f.max, "fp32"))
    # midpoints of consecutive fp8 values in [tiny, max), normal and subnormal
    grid = np.unique(np.abs(rnd(np.exp(rng.uniform(np.log(f.tiny), np.log(f.max), 4096)), fmt)))
    grid = grid[np.isfinite(grid) & (grid > 0)]
    mids = (grid[:-1] + grid[1:]) / 2
    pick = mids[rng.integers(len(mids), size=shape)] * rng.choice([-1.0, 1.0], size=shape)
    v = rnd(pick * s, "fp32")
    nudge = rng.integers(-1, 2, size=shape)
    v = np.where(nudge > 0, next_up(v, "fp32"), np.where(nudge < 0, next_down(v, "fp32"), v))
    x[...] = v
    if static is None:
        top = rnd(amax, "fp32")
        if block is not None:
            x[..., ::block] = top
        elif group_axis is not None:
            idx = [slice(None)] * len(shape)
            idx[group_axis] = slice(0, 1)
            x[tuple(idx)] = top
        else:
            x.reshape(-1)[0] = top
        # keep every other entry below the amax
        x = np.clip(x, -top, top)
    return x.astype(np.float32)


def saturating(shape: tuple[int, ...], rng: np.random.Generator, amax: float = 3.0
               ) -> np.ndarray:
    """Values at the amax (q = 448 exactly), just under it (the fp32 quotient may round up to
    the saturation point), and at the largest fp8 midpoint below it."""
    x = rng.uniform(-1, 1, size=shape) * amax
    flat = x.reshape(-1)
    k = flat.size
    flat[: max(1, k // 4)] = amax
    flat[k // 4: k // 2] = float(next_down(np.array(amax), "fp32"))
    flat[k // 2: 3 * k // 4] = -amax * (432.0 / 448.0)  # midpoint of 416 and 448
    return rnd(x, "fp32").astype(np.float32)


def tiny(shape: tuple[int, ...], rng: np.random.Generator, mag: float = 1e-40) -> np.ndarray:
    return rnd(rng.uniform(-1, 1, size=shape) * mag, "fp32").astype(np.float32)


def normal(shape: tuple[int, ...], rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    return (rng.normal(size=shape) * scale).astype(np.float32)


def box_points(rng: np.random.Generator, center: np.ndarray, eps: float, n: int
               ) -> list[np.ndarray]:
    """Points of the L-inf ball of radius eps (as the engine pads it): corners, random, the
    centre's fp8-grid-aligned neighbours."""
    pts = []
    c = center.astype(np.float64)
    for k in range(n):
        if k % 3 == 0:
            v = eps * rng.choice([-1.0, 1.0], size=center.shape)
        else:
            v = rng.uniform(-eps, eps, size=center.shape)
        p = rnd(c + v, "fp32")  # a float32 input; pulled back inside the ball if it rounded out
        p = np.where(p - c > eps, next_down(p, "fp32"), p)
        p = np.where(p - c < -eps, next_up(p, "fp32"), p)
        pts.append(p.astype(np.float32))
    return pts


__all__ = ["SPECS", "TRAIN", "box_points", "fp8_midpoints", "normal", "pairs", "programs",
           "saturating", "tiny"]
