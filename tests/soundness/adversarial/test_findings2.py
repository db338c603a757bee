"""Violations found by the session-2 adversary (the new enclosures of issues 11-13), each a
minimal reproducer marked ``xfail(strict=True)`` until its fix lands (then the mark goes and it
stays as a regression test). Numbering continues test_findings.py's.

14. ``unstable_casts`` is 0 under ``dynamic_per_block`` activation scales: the count is taken
    only on the MatMul grid path (rules/linear._grid_operand), which per-block scales never
    take, so an input whose block casts conforming programs round apart (a value one fp32 ulp
    off an fp8 midpoint: the fp32 quotient ties to even, the exact one does not) is reported
    as having every cast stable.
15. ``unstable_casts`` is 0 for the activation of MatMul(W, x) when the left operand W is off
    the grid path (int8 weights, per-block weights, weights without a cast): ``_grid_pair``
    returns before it looks at the right operand, so its casts are never counted.
16. ``unstable_casts`` is 0 under ``rounding: any``: every cast whose quotient is not a format
    value may go to either neighbour, but ``_grid_operand`` returns None before counting.
17. ``accumulate: {format: fp32, mma: sm90_fp8, promote: N}`` parsed on 48f8641 and was
    certified as an fp32 accumulator in any order (the engine did not read
    ``spec.accumulation``): a Hopper FP8 tensor core truncates every product below 2^(E-13) of
    its group (E its largest exponent), 448^2 + 31 products of 15 gives 448^2, 465 below the
    exact sum, against a certified +-0.94. Fixed by 4f955d0 (the sm90 enclosure) before it was
    reported; a regression test (and test_families.py's sm90 / DeepSeek-V3 attacks).
18. ``order: pairwise`` was defined twice: kernels/spec.py's docstring said "a balanced tree:
    halves of ceil(n/2) and floor(n/2)", docs/kernels.md "pairs (t0+t1), (t2+t3), ..., an odd
    last term carried up". The engine evaluates a pinned schedule exactly at a point (4f955d0),
    so a program following spec.py's definition lay outside the certified point: 629.09466 vs
    [629.094788, 629.094788] on a 50-term fp32 row. Fixed in 2b6b584 by the definition (spec.py
    now says levels); the halves form is no longer conforming, the levels form is tested.
19. ``split_k`` with a pinned order (sequential / pairwise): the spec said "the S partial sums
    added in the accumulator", no order; the engine certified left to right only, so adding the
    S = 3 partials right to left was outside the certified point. Fixed in 2b6b584 by the
    definition (left to right in a pinned kernel); the left-to-right control stays.
20. A pinned order (``order: sequential``) with scales that are not powers of two (fp8-deploy's
    dynamic per-tensor activations, per-channel weights, fp32 compute): the spec lets the
    program rescale the sum with two roundings ("then rescales and rounds the result to
    compute format (two roundings)"), but the engine certifies one point, the realizer's own
    rescaling, one rounding of acc s_a s_b: fl32(acc * fl32(s_a s_b)) (cuBLASLt's alpha =
    scale_a scale_b, the usual FP8 GEMM epilogue) and fl32(fl32(acc * s_a) * s_b) both lie one
    fp32 ulp outside it (-16.0414886 vs [-16.04148674, -16.04148674]); every dynamic activation
    scale (per tensor, per token) with per-channel or per-tensor weights. Fixed in 2b6b584 (the
    point widened by a compute-format spacing each side where scales apply): regression test.
21. ``split_k`` part sizes: the spec says "K in S contiguous parts", not which; with a pinned
    order the engine certifies parts of ceil(K / S) (the last shorter) only, and a program that
    splits as evenly as possible (K = 50, S = 4: 13, 13, 12, 12; numpy.array_split,
    torch.tensor_split) lies outside the certified point (251.22819519 vs [251.2282104,
    251.2282104]).
    Closed by definition in 6e5b5e1: the family's parts are ceil(K / S) (an mma's rounded up
    to 32), as docs/kernels.md said and kernels/spec.py now says too; an even split is another
    kernel. The control (ceil-sized parts inside the point) stays.

14-16 are fixed since the count moved to the cast itself (rules/linear._operand: every
activation cast of the interval MatMul rule, any scale kind, either rounding; an over-count
where a kind gives no per-element scale interval): regression tests now.

Each test builds the smallest MatMul that shows it and checks the claim against conforming
programs (test_stable_casts.stable_claims: an input the engine calls stable on which two
programs cast an element apart).
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from tests.soundness.adversarial.arith import next_up, rnd
from tests.soundness.adversarial.harness import SESSION, Ledger, chain_model, node_model, spec
from tests.soundness.adversarial.programs import Program
from tests.soundness.adversarial.test_stable_casts import E4M3_PC, cast_programs, stable_claims


def _block_row(K: int) -> np.ndarray:
    """Blocks of 4 whose amax is 3 (every dynamic scale, per block, per token or per tensor, is
    s = fl32(3 / 448), not a power of two), the other entries fl32(M s) for e4m3 midpoints M,
    one fp32 ulp up in odd blocks: x / s exact and x / s rounded to fp32 (a tie, to even) fall
    on different sides of a midpoint for some of them (test_constructions_split)."""
    s = float(rnd(3.0 / 448.0, "fp32"))
    m = rnd(np.array([1.0625, 1.1875, 1.3125]) * s, "fp32")
    x = np.zeros((1, K))
    for j in range(K):
        b, r = divmod(j, 4)
        x[0, j] = 3.0 if r == 0 else float(next_up(m[r - 1], "fp32") if b % 2 else m[r - 1])
    return x.astype(np.float32)


def _check(model, sp, feeds) -> list[str]:
    led = Ledger()
    found = stable_claims(led, "findings2", model, sp, feeds, cast_programs(sp))
    SESSION.merge(led)
    return found


def test_14_per_block_activation_casts_are_counted() -> None:
    sp = spec(weights=E4M3_PC, activations={"format": "fp8_e4m3", "scale": "dynamic_per_block",
                                            "block_size": 4},
              accumulate="fp32", compute="fp32")
    x = _block_row(8)
    w = np.ones((8, 1), np.float32)
    model = node_model("MatMul", [("x", (1, 8)), ("w", w)])
    found = _check(model, sp, {"x": x})
    assert not found, found[0]


def _left_weight_model(w: np.ndarray, K: int):
    nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0]),
             helper.make_node("MatMul", ["w", "xt"], ["yt"]),
             helper.make_node("Transpose", ["yt"], ["y"], perm=[1, 0])]
    return chain_model(nodes, [("x", (1, K)), ("w", w)], ["y"])


@pytest.mark.parametrize("weights", [{"format": "int8", "scale": "per_channel"},
                                     {"format": "fp8_e4m3", "scale": "per_block",
                                      "block_size": 4},
                                     None])
def test_15_right_activation_casts_are_counted(weights) -> None:
    sp = spec(activations={"format": "fp8_e4m3", "scale": "dynamic_per_token"},
              accumulate="fp32", compute="fp32",
              **({} if weights is None else {"weights": weights}))
    x = _block_row(8)
    model = _left_weight_model(np.ones((1, 8), np.float32), 8)
    found = _check(model, sp, {"x": x})
    assert not found, found[0]


def test_16_rounding_any_casts_are_counted() -> None:
    sp = spec(weights=E4M3_PC, activations={"format": "fp8_e4m3", "scale": "static",
                                            "value": 1.0},
              accumulate="fp32", compute="fp32", rounding="any")
    x = np.array([[1.0625, 1.5, 3.1]], np.float32)  # 1.5 is e4m3: exact; the others are not
    w = np.ones((3, 1), np.float32)
    model = node_model("MatMul", [("x", (1, 3)), ("w", w)])
    found = _check(model, sp, {"x": x})
    assert not found, found[0]


def test_constructions_split() -> None:
    """The reproducers' inputs do split conforming programs' casts (so the xfails above fail
    for the claim, not for a construction that never straddles): the same rows as the *left*
    operand of MatMul(x, W) with fp8 weights are counted (the control), and programs differ."""
    from tests.soundness.adversarial.test_stable_casts import _differing, traces

    x = _block_row(8)
    for acts in ({"format": "fp8_e4m3", "scale": "dynamic_per_block", "block_size": 4},
                 {"format": "fp8_e4m3", "scale": "dynamic_per_token"}):
        sp = spec(weights=E4M3_PC, activations=acts, accumulate="fp32", compute="fp32")
        model = node_model("MatMul", [("x", (1, 8)), ("w", np.ones((8, 1), np.float32))])
        tr = traces(model, cast_programs(sp), {"x": x}, 0)
        assert max(_differing(tr[0], t) for t in tr[1:]) >= 1, acts
    sp = spec(weights=E4M3_PC, activations={"format": "fp8_e4m3", "scale": "dynamic_per_token"},
              accumulate="fp32", compute="fp32")
    model = node_model("MatMul", [("x", (1, 8)), ("w", np.ones((8, 1), np.float32))])
    assert not _check(model, sp, {"x": x})  # counted on the grid path
    sp = spec(weights=E4M3_PC, activations={"format": "fp8_e4m3", "scale": "static",
                                            "value": 1.0},
              accumulate="fp32", compute="fp32", rounding="any")
    model = node_model("MatMul", [("x", (1, 3)), ("w", np.ones((3, 1), np.float32))])
    tr = traces(model, cast_programs(sp), {"x": np.array([[1.0625, 1.5, 3.1]], np.float32)}, 0)
    assert max(_differing(tr[0], t) for t in tr[1:]) >= 1


def test_17_sm90_truncation_is_bounded() -> None:
    from kcverify.kernels.spec import parse_kernel_spec
    from tests.soundness.adversarial.harness import TRAIN, attack

    sp = parse_kernel_spec("inf", {"weights": E4M3_PC,
                                   "activations": {"format": "fp8_e4m3",
                                                   "scale": "dynamic_per_token"},
                                   "accumulate": {"format": "fp32", "mma": "sm90_fp8",
                                                  "promote": 128},
                                   "compute": "fp32"})
    x = np.zeros((1, 32), np.float32)
    w = np.zeros((32, 1), np.float32)
    x[0, :32], w[:32, 0] = 15.0, 1.0
    x[0, 0] = w[0, 0] = 448.0  # 448^2: the group's grid is 2^(17 - 13) = 16 > 15
    model = node_model("MatMul", [("x", (1, 32)), ("w", w)])
    led = Ledger()
    found = attack(led, "findings2/17", model, TRAIN, sp, {"x": x},
                   [(Program(TRAIN), Program(sp))], domain="interval")
    SESSION.merge(led)
    assert not found, found[0]


def _pinned_row_case(order: str, split_k: list[int]):
    """A 50-term fp32 row (one 448 activation among mixed e4m3 magnitudes, scales pinned to 1)
    under a pinned accumulation family: (model, spec, feeds)."""
    from tests.soundness.adversarial.test_families import TOKEN, fam_spec, order_rows

    sp = fam_spec({"format": "fp32", "order": order, "split_k": split_k}, E4M3_PC, TOKEN)
    x, w = order_rows(np.random.default_rng([8, 4]), 6, 48, "fp32")
    return node_model("MatMul", [("x", x.shape), ("w", w)]), sp, {"x": x}


def _pinned_attack(model, sp, feeds, prog: Program) -> list[str]:
    from tests.soundness.adversarial.harness import TRAIN, attack

    led = Ledger()
    found = attack(led, "findings2/pinned", model, TRAIN, sp, feeds, [(Program(TRAIN), prog)],
                   domain="interval")
    SESSION.merge(led)
    return found


def test_18_pairwise_by_levels() -> None:
    """The spec's pairwise (by levels since 2b6b584) at a pinned point: inside."""
    model, sp, feeds = _pinned_row_case("pairwise", [1])
    assert not _pinned_attack(model, sp, feeds, Program(sp, pairwise_form="levels",
                                                        per_sample="axis0"))


def test_18_19_controls() -> None:
    """The same rows with pairwise by levels and split-K partials left to right (the spec's
    definitions since 2b6b584) are inside, for every split."""
    model, sp, feeds = _pinned_row_case("pairwise", [1, 3])
    for S in (1, 3):
        assert not _pinned_attack(model, sp, feeds, Program(sp, pairwise_form="levels", split=S,
                                                            per_sample="axis0"))


def _rescale_case():
    from tests.soundness.adversarial.test_families import fam_spec

    sp = fam_spec({"format": "fp32", "order": "sequential"}, E4M3_PC,
                  {"format": "fp8_e4m3", "scale": "dynamic_per_tensor"})
    rng = np.random.default_rng(3)
    x = (rng.normal(size=(4, 48)) * 3).astype(np.float32)
    w = (rng.normal(size=(48, 5)) * 0.3).astype(np.float32)
    return node_model("MatMul", [("x", x.shape), ("w", w)]), sp, {"x": x}


def test_20_control_the_certified_rescaling() -> None:
    """The one rescaling the pinned point holds: a single rounding of acc s_a s_b."""
    model, sp, feeds = _rescale_case()
    assert not _pinned_attack(model, sp, feeds, Program(sp, rescale="exact", per_sample="axis0"))


@pytest.mark.parametrize("rescale", ["one", "two"])
def test_20_pinned_order_any_two_rounding_rescale(rescale: str) -> None:
    model, sp, feeds = _rescale_case()
    found = _pinned_attack(model, sp, feeds, Program(sp, rescale=rescale, per_sample="axis0"))
    assert not found, found[0]


def test_20_control_any_order_covers_both() -> None:
    """The same rows under ``accumulate: fp32`` (any order) are inside for both rescalings."""
    model, _, feeds = _rescale_case()
    sp = spec(weights=E4M3_PC, activations={"format": "fp8_e4m3", "scale": "dynamic_per_tensor"},
              accumulate="fp32", compute="fp32")
    for rescale in ("one", "two", "exact"):
        assert not _pinned_attack(model, sp, feeds, Program(sp, order="seq", rescale=rescale,
                                                            per_sample="axis0"))


def test_21_control_ceil_parts() -> None:
    from tests.soundness.adversarial.test_families import TOKEN, fam_spec, order_rows

    sp = fam_spec({"format": "fp32", "order": "sequential", "split_k": [1, 4]}, E4M3_PC, TOKEN)
    x, w = order_rows(np.random.default_rng(7), 24, 48, "fp32")
    model = node_model("MatMul", [("x", x.shape), ("w", w)])
    assert not _pinned_attack(model, sp, {"x": x}, Program(sp, split=4, split_sizes="ceil",
                                                           per_sample="axis0"))
