"""LayerNorm under the default spec (``moments: any`` since b4ff523: two-pass sums or Welford /
Chan trees of height <= 32 + ceil(log2 n)) against this suite's own Welford / Chan programs
(welford.py: torch-like chunked trees, chains, left-to-right chunk merges, trees as unbalanced
as the height bound allows on either side, random split points; every update form the family's
text admits) on rows built to hurt moments: large mean / tiny spread, few-ulp rows, cancelling
rows, a step between halves, ramps; n up to 4096 (tails: n not a multiple of 16). Each program
in the training and in the inference position, against the two-pass programs; interval, and
best on the shorter rows.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.soundness.adversarial.arith import next_up, rnd
from tests.soundness.adversarial.harness import SESSION, TRAIN, Ledger, attack, node_model, spec
from tests.soundness.adversarial.programs import Program
from tests.soundness.adversarial.welford import Form, build, height, max_height, moments

FORMS = [Form(), Form(mean="fused", c="recip", term="na_first", msum="bt"),
         Form(mean="div", term="c_first", welford=False),
         Form(mean="two", c="recip", term="c_first", msum="bt", welford=False)]
SHAPES = ("torch", "chains8", "caterpillar16", "spine", "spine_a", "random")
BF16_INF = spec(compute="bf16", accumulate="fp32")


def rows(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """Two rows of ``kind`` (fp32 values)."""
    if kind == "large-mean":
        x = 1e4 + 1e-2 * rng.standard_normal((2, n))
    elif kind == "few-ulp":
        base = np.float32(12345.678)
        x = np.stack([np.full(n, base, np.float64)] * 2)
        k = rng.integers(0, 4, size=(2, n))
        for _ in range(3):
            x = np.where(k > 0, next_up(x, "fp32"), x)
            k = k - 1
    elif kind == "cancel":
        x = 3e3 * np.where(np.arange(n) % 2, 1.0, -1.0) + rng.standard_normal((2, n))
        x[1] = rng.permutation(x[1])
    elif kind == "step":
        x = np.where(np.arange(n) < n // 2, 5e3, -5e3 + 1e-1) + 1e-3 * rng.standard_normal((2, n))
    elif kind == "ramp":
        x = np.stack([np.arange(n) * 7.3 + 1e4, -np.arange(n)[::-1] * 0.37])
    else:
        raise ValueError(kind)
    return rnd(x, "fp32").astype(np.float32)


def ln_model(n: int):
    rng = np.random.default_rng(n)
    g = (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    b = (0.1 * rng.standard_normal(n)).astype(np.float32)
    return node_model("LayerNormalization", [("x", (2, n)), ("g", g), ("b", b)],
                      {"axis": -1, "epsilon": 1e-5}, opset=17)


def welford_programs(sp, n: int) -> list[Program]:
    out = []
    for k, shape in enumerate(SHAPES):
        form = FORMS[k % len(FORMS)]
        rounding = ("nearest", "up", "down")[k % 3]
        out.append(Program(sp, ln_form="welford", wf_tree=shape, wf_form=form, seed=k,
                           rounding=rounding,
                           label=f"welford/{shape}/{form.mean}/{form.c}/{form.term}/"
                                 f"{form.msum}/{form.welford}/{rounding}"))
    return out


def _pairs(inf, n: int) -> list[tuple[Program, Program]]:
    orders = ("greedy_up", "greedy_down") if n <= 256 else ("desc", "posneg")  # greedy: O(n^2)
    two = [Program(TRAIN, ln_form="two_pass_acc", order=o, row_order=o, label=f"two-pass/{o}")
           for o in orders]
    wt = welford_programs(TRAIN, n)
    wi = welford_programs(inf, n)
    out = [(two[k % 2], p) for k, p in enumerate(wi)]
    out += [(p, Program(inf, ln_form="two_pass_acc", row_order=orders[1], label="inf"))
            for p in wt]
    out += [(wt[k], wi[-1 - k]) for k in range(len(wt))]
    return out


def _leaves(t) -> list[int]:
    return [t] if isinstance(t, int) else _leaves(t[0]) + _leaves(t[1])


def test_trees_are_in_the_family() -> None:
    """Every shape at every n used here keeps the height bound and covers each element once;
    the spine reaches it (as unbalanced as allowed)."""
    for n in (7, 16, 33, 100, 1000, 4096, 4103):
        for shape in SHAPES:
            assert sorted(_leaves(build(shape, n, 3))) == list(range(n)), shape
        assert height(build("spine", n)) == max_height(n)


def test_moments_are_moments() -> None:
    """In float64 the trees give the row's mean and M2 to float64 accuracy (the merges are
    right); in fp32 they differ from the two-pass sums (the attack has something to find)."""
    from tests.soundness.adversarial.arith import FMT

    rng = np.random.default_rng(1)
    x = rows("large-mean", 200, rng).astype(np.float64)
    f64 = FMT.get("fp64")
    for shape in SHAPES:
        for form in FORMS:
            if f64 is not None:
                mu, M = moments(x, build(shape, 200, 2), form, f64)
                np.testing.assert_allclose(mu, x.mean(-1), rtol=1e-12)
                np.testing.assert_allclose(M, ((x - x.mean(-1, keepdims=True)) ** 2).sum(-1),
                                           rtol=1e-6)
    M_exact = ((x - x.mean(-1, keepdims=True)) ** 2).sum(-1)
    differ = [np.any(moments(x, build(shape, 200, 2), FORMS[0], FMT["fp32"])[1]
                     != rnd(M_exact, "fp32")) for shape in SHAPES]
    assert any(differ)


def _run(kind: str, n: int, domains: tuple[str, ...], inf=TRAIN, seed: int = 0) -> list[str]:
    x = rows(kind, n, np.random.default_rng([seed, n]))
    led = Ledger()
    found = []
    for domain in domains:
        found += attack(led, f"welford/{kind}", ln_model(n), TRAIN, inf, {"x": x}, _pairs(inf, n),
                        domain=domain)
    SESSION.merge(led)
    return found


@pytest.mark.parametrize("kind", ["large-mean", "few-ulp", "cancel", "step", "ramp"])
def test_welford_default_spec(kind: str) -> None:
    """n = 100 (a tail of 4 after six chunks of 16), interval (best: slow)."""
    found = _run(kind, 100, ("interval",))
    assert not found, "\n".join(found[:3])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["large-mean", "few-ulp", "cancel", "step", "ramp"])
def test_welford_default_spec_slow(kind: str) -> None:
    """n = 100 in best; n = 1000 in interval."""
    found = _run(kind, 100, ("best",))
    found += _run(kind, 1000, ("interval",))
    assert not found, "\n".join(found[:3])


def test_welford_bf16_inference() -> None:
    """The inference kernel in bf16 (fp32 moments): step rows, n = 64."""
    found = _run("step", 64, ("interval",), inf=BF16_INF)
    assert not found, "\n".join(found[:3])


@pytest.mark.campaign  # ~100 s each (session 3); CI keeps the shorter rows / boxes
@pytest.mark.parametrize("n", [4096, 4103])
@pytest.mark.parametrize("kind", ["large-mean", "few-ulp", "cancel", "step", "ramp"])
def test_welford_long_rows(kind: str, n: int) -> None:
    found = _run(kind, n, ("interval",), seed=1)
    found += _run(kind, n, ("interval",), inf=BF16_INF, seed=2)
    assert not found, "\n".join(found[:3])
