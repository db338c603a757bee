"""Composition rules: hand-computed cases, and the paper's chain against sampled logits."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import numpy as np
import pytest

from kcverify.certs.encoding import fx, unfx
from kcverify.certs.records import StoredBox
from kcverify.certs.rules import RULES, RuleContext, RuleError, get_rule, implies

CTX = RuleContext()


def linf(*deltas: float) -> dict[str, Any]:
    return {"quantity": "linf_drift", "direction": "upper", "tensor": "logits",
            "bounds": [fx(d) for d in deltas]}


def conclude(rule: str, premises: list[dict[str, Any]], ctx: RuleContext = CTX, **params: Any
             ) -> dict[str, Any]:
    enc = {k: fx(v) if isinstance(v, float) else v for k, v in params.items()}
    return get_rule(rule).conclude(premises, enc, ctx)


def vals(c: dict[str, Any], key: str = "bounds") -> list[float]:
    return [unfx(v) for v in c[key]]


def test_every_rule_states_its_maths() -> None:
    for name, rule in RULES.items():
        assert len((type(rule).__doc__ or rule.__doc__ or "").strip()) > 40, name


def test_logprob_hand() -> None:
    assert vals(conclude("logprob-from-linf", [linf(0.1)], temperature=2.0)) == [0.1]
    (b,) = vals(conclude("logprob-from-linf", [linf(0.3)], temperature=3.0))
    exact = Fraction(2) * Fraction(0.3) / 3
    assert Fraction(b) >= exact and math.nextafter(b, 0) < exact


def test_ratio_tv_kl_reward_hand() -> None:
    r = conclude("ratio-from-linf", [linf(0.05)], temperature=1.0)
    (hi,), (lo,), (dev,) = vals(r, "ratio_hi"), vals(r, "ratio_lo"), vals(r)
    assert hi >= math.exp(0.1) and hi - math.exp(0.1) < 1e-15
    assert lo <= math.exp(-0.1) and math.exp(-0.1) - lo < 1e-15
    assert dev >= math.exp(0.1) - 1 and dev == pytest.approx(0.10517091807564771, rel=1e-14)
    (tv,) = vals(conclude("tv-from-linf", [linf(0.05)], temperature=1.0))
    assert tv == pytest.approx(math.tanh(0.025), rel=1e-14) and tv >= math.tanh(0.025)
    assert tv <= (math.exp(0.1) - 1) / 2  # sharper than semantics §1.3's form, which it implies
    (kl,) = vals(conclude("kl-from-linf", [linf(0.05)], temperature=1.0))
    assert kl == pytest.approx(2 * math.log(math.cosh(0.05)), rel=1e-13) and kl <= 0.05**2
    assert kl >= 2 * math.log(math.cosh(0.05))
    tvc = conclude("tv-from-linf", [linf(0.05)], temperature=1.0)
    (rw,) = vals(conclude("reward-from-tv", [tvc], reward_bound=2.0))
    assert rw >= 4 * tv and rw == pytest.approx(4 * tv, rel=1e-15)


def test_infinite_drift_gives_trivial_bounds() -> None:
    assert vals(conclude("tv-from-linf", [linf(math.inf)], temperature=1.0)) == [1.0]
    assert vals(conclude("ratio-from-linf", [linf(math.inf)], temperature=1.0), "ratio_lo") == [0.0]


def test_preconditions() -> None:
    with pytest.raises(RuleError, match="temperature must be positive"):
        conclude("logprob-from-linf", [linf(0.1)], temperature=0.0)
    with pytest.raises(RuleError, match="quantity is 'tv'"):
        conclude("logprob-from-linf", [{**linf(0.1), "quantity": "tv"}], temperature=1.0)
    with pytest.raises(RuleError, match="outside its precondition"):
        conclude("threshold", [linf(0.1, 0.3)], threshold=0.2)
    with pytest.raises(RuleError, match="needs an lower bound"):
        conclude("threshold", [linf(0.1)], threshold=0.2, op=">=")
    assert vals(conclude("threshold", [linf(0.1, 0.2)], threshold=0.2), "bound") == [0.2]


def test_aggregate_hand_and_against_numpy() -> None:
    b = linf(1.0, 5.0, 2.0, 4.0, 3.0)
    got = {s: vals(conclude("aggregate", [b], stat=s))[0] for s in ("max", "min", "mean", "p50", "p99")}
    assert got == {"max": 5.0, "min": 1.0, "mean": 3.0, "p50": 3.0, "p99": 5.0}
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        x = rng.exponential(size=n)
        for stat, q in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99), ("p99.9", 0.999)):
            up_ = vals(conclude("aggregate", [linf(*x)], stat=stat))[0]
            lo_ = vals(conclude("aggregate", [{**linf(*x), "direction": "lower"}], stat=stat))[0]
            for method in ("linear", "higher", "inverted_cdf", "nearest", "lower"):
                assert lo_ <= np.quantile(x, q, method=method) <= up_, (n, stat, method)
        assert vals(conclude("aggregate", [linf(*x)], stat="mean"))[0] >= float(np.mean(x)) - 1e-15


def test_implies_rejects_tighter_and_accepts_looser() -> None:
    derived = conclude("logprob-from-linf", [linf(0.1)], temperature=1.0)
    looser = {**derived, "bounds": [fx(0.3)]}
    tighter = {**derived, "bounds": [fx(0.1)]}
    assert implies(derived, looser, {"bounds": "upper"}) == []
    assert "tighter than justified" in implies(derived, tighter, {"bounds": "upper"})[0]
    assert "differs" in implies(derived, {**derived, "temperature": fx(2.0)}, {"bounds": "upper"})[0]


# ---- the paper's chain against sampled logits ------------------------------------------------

def _log_softmax(z: np.ndarray) -> np.ndarray:
    m = z.max(axis=-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(axis=-1, keepdims=True))


@pytest.mark.parametrize("seed", range(4))
def test_chain_holds_on_sampled_logits(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, v = 400, 50
    temp = float(rng.choice([0.5, 1.0, 2.0]))
    delta = float(rng.choice([1e-3, 0.05, 0.3, 1.0]))
    z = rng.normal(scale=rng.choice([1.0, 5.0]), size=(n, v))
    d = rng.uniform(-delta, delta, size=(n, v))
    d[: n // 2] = delta * rng.choice([-1.0, 1.0], size=(n // 2, v))  # corners of the L∞ ball
    lp, lq = _log_softmax(z / temp), _log_softmax((z + d) / temp)
    p, q = np.exp(lp), np.exp(lq)
    prem = linf(delta)
    slack = 1e-12
    (blp,) = vals(conclude("logprob-from-linf", [prem], temperature=temp))
    assert np.abs(lq - lp).max() <= blp + slack
    rc = conclude("ratio-from-linf", [prem], temperature=temp)
    rho = q / p
    assert rho.min() >= vals(rc, "ratio_lo")[0] * (1 - slack)
    assert rho.max() <= vals(rc, "ratio_hi")[0] * (1 + slack)
    assert np.abs(rho - 1).max() <= vals(rc)[0] + slack
    tvc = conclude("tv-from-linf", [prem], temperature=temp)
    tv = 0.5 * np.abs(q - p).sum(axis=-1)
    assert tv.max() <= vals(tvc)[0] + slack
    (bkl,) = vals(conclude("kl-from-linf", [prem], temperature=temp))
    assert (q * (lq - lp)).sum(-1).max() <= bkl + slack
    assert (p * (lp - lq)).sum(-1).max() <= bkl + slack
    r_bound = 3.0
    r = rng.uniform(-r_bound, r_bound, size=(n, v))
    (brw,) = vals(conclude("reward-from-tv", [tvc], reward_bound=r_bound))
    assert np.abs((q * r).sum(-1) - (p * r).sum(-1)).max() <= brw + slack


def test_chain_bounds_are_nearly_attained() -> None:
    """Worst cases: the ratio, log-prob and TV bounds are attained (up to rounding)."""
    delta, temp = 0.2, 1.0
    z = np.array([[40.0, 0.0]])
    d = np.array([[-delta, delta]])
    lp, lq = _log_softmax(z), _log_softmax(z + d)
    (blp,) = vals(conclude("logprob-from-linf", [linf(delta)], temperature=temp))
    assert (lq - lp).max() >= 0.999 * blp
    (tvb,) = vals(conclude("tv-from-linf", [linf(delta)], temperature=temp))
    b = math.exp(delta / temp)
    big = 1 / (1 + b)  # the worst mass on the tokens pushed up
    z = np.log(np.array([[big, 1 - big]]))
    p, q = np.exp(_log_softmax(z)), np.exp(_log_softmax(z + np.array([[delta, -delta]])))
    assert 0.5 * np.abs(q - p).sum() == pytest.approx(tvb, rel=1e-9)
    (klb,) = vals(conclude("kl-from-linf", [linf(delta)], temperature=temp))
    lp, lq = _log_softmax(z), _log_softmax(z + np.array([[delta, -delta]]))
    assert (np.exp(lq) * (lq - lp)).sum() >= 0.45 * klb  # Jensen costs about a factor 2


def _state_box(train: np.ndarray, width: float, drift: float) -> StoredBox:
    z = np.zeros_like(train)
    return StoredBox(train - width, train + width, train - width - drift, train + width + drift,
                     z - drift, z + drift)


def test_top1_from_margin() -> None:
    from kcverify.certs.records import BlockData

    logits = np.array([[3.0, 1.0, 0.0], [1.0, 0.95, 0.0], [0.0, 2.0, 1.9]])
    blk = BlockData("r", "head", "0" * 64, "m", {}, {"logits": _state_box(logits, 0.01, 0.1)})
    ctx = RuleContext(blocks={"r": blk})
    state = {"kind": "state", "outputs": {"logits": "r"}}
    c = conclude("top1-from-margin", [linf(0.1, 0.1, 0.1), state], ctx)
    assert vals(c) == [1.0, 0.0, 0.0]
    m = vals(c, "margins")
    assert m[0] == pytest.approx(1.98) and m[0] <= 1.98 and m[1] == pytest.approx(0.03)
    # a claimed agreement where the margin is <= 2δ is outside the precondition
    node = {"rule": "top1-from-margin", "params": {},
            "premises": [{"conclusion": linf(0.1, 0.1, 0.1)}, {"conclusion": state}],
            "conclusion": {**c, "bounds": [fx(1.0), fx(1.0), fx(0.0)]}}
    (problem,) = get_rule("top1-from-margin").check(node, ctx)
    assert "outside its precondition: input 1" in problem
    # soundness on samples: every z_train in the box with |z_inf - z_train| <= δ agrees at input 0
    rng = np.random.default_rng(1)
    zt = logits[0] + rng.uniform(-0.01, 0.01, size=(10000, 3))
    zi = zt + rng.uniform(-0.1, 0.1, size=zt.shape)
    assert np.all(zt.argmax(-1) == zi.argmax(-1))


def test_per_input_bounds_bound_per_position_quantiles() -> None:
    """The checker accepts per-input bounds for per-position aggregates: with m positions per
    input each ≤ b_i, the statistics over the n·m pairs are ≤ those the aggregate rule gives."""
    rng = np.random.default_rng(5)
    for _ in range(200):
        n, m = int(rng.integers(1, 9)), int(rng.integers(1, 6))
        b = rng.exponential(size=n)
        v = b[:, None] * rng.uniform(0, 1, size=(n, m))
        worst = rng.uniform(size=(n, m)) < 0.7
        v = np.where(worst, b[:, None], v)  # many pairs at their input's bound: the worst case
        for stat, q in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99), ("max", 1.0)):
            bound = vals(conclude("aggregate", [linf(*b)], stat=stat))[0]
            for method in ("linear", "higher", "inverted_cdf"):
                assert np.quantile(v, q, method=method) <= bound
        assert np.mean(v) <= vals(conclude("aggregate", [linf(*b)], stat="mean"))[0] + 1e-15


def test_keep_positions() -> None:
    from kcverify.certs.records import BlockData

    rng = np.random.default_rng(2)
    z = rng.normal(size=(2, 3, 4))
    d = rng.uniform(0, 0.1, size=z.shape)
    box = StoredBox(z - 0.01, z + 0.01, z - 0.01 - d, z + 0.01 + d, -d, d)
    flat = StoredBox(*(a[:, 0, :] for a in (box.train_lo, box.train_hi, box.inf_lo, box.inf_hi,
                                            box.drift_lo, box.drift_hi)))
    ctx = RuleContext(blocks={"r": BlockData("r", "b", "0" * 64, "m", {}, {"z": box, "f": flat})})
    state = {"kind": "state", "outputs": {"z": "r", "f": "r"}}
    per_pos = conclude("linf-from-state", [state], ctx, tensor="z", keep=2)
    assert vals(per_pos) == d.max(axis=2).ravel().tolist() and per_pos["keep"] == 2
    assert vals(conclude("linf-from-state", [state], ctx, tensor="z")) == d.max(axis=(1, 2)).tolist()
    # a (batch, classes) tensor has one position per input
    assert vals(conclude("linf-from-state", [state], ctx, tensor="f", keep=2)) == \
        d[:, 0, :].max(axis=1).tolist()
    agree = conclude("top1-from-margin", [per_pos, state], ctx)
    assert len(vals(agree)) == 6 and len(vals(agree, "margins")) == 6


@pytest.mark.parametrize("seed", range(3))
def test_tv_kl_on_extremal_perturbations(seed: int) -> None:
    """The extremal Δ for TV and KL push a set A of tokens up by δ and the rest down: try every
    prefix A of random orderings, for random distributions and temperatures."""
    rng = np.random.default_rng(100 + seed)
    v = 12
    for _ in range(30):
        temp = float(rng.choice([0.3, 1.0, 3.0]))
        delta = float(rng.choice([0.01, 0.2, 1.0, 4.0]))
        z = rng.normal(scale=float(rng.choice([0.5, 3.0])), size=v)
        order = rng.permutation(v)
        signs = np.where(np.arange(v)[None, :] < np.arange(1, v)[:, None], 1.0, -1.0)  # prefixes
        d = np.empty((v - 1, v))
        d[:, order] = delta * signs
        lp = _log_softmax(np.broadcast_to(z / temp, d.shape))
        lq = _log_softmax((z + d) / temp)
        p, q = np.exp(lp), np.exp(lq)
        (tvb,) = vals(conclude("tv-from-linf", [linf(delta)], temperature=temp))
        (klb,) = vals(conclude("kl-from-linf", [linf(delta)], temperature=temp))
        assert (0.5 * np.abs(q - p).sum(-1)).max() <= tvb * (1 + 1e-12)
        assert (q * (lq - lp)).sum(-1).max() <= klb * (1 + 1e-12) + 1e-15
        assert (p * (lp - lq)).sum(-1).max() <= klb * (1 + 1e-12) + 1e-15


def test_top1_from_state_is_sound_and_sharper() -> None:
    from kcverify.certs.records import BlockData

    rng = np.random.default_rng(7)
    n, v = 200, 6
    z = rng.normal(scale=2.0, size=(n, v))
    w = rng.uniform(0, 0.05, size=z.shape)
    d_c = rng.normal(scale=0.05, size=z.shape)
    d_r = rng.uniform(0, 0.1, size=z.shape)
    tl, th = z - w, z + w
    dl, dh = d_c - d_r, d_c + d_r
    il, ih = tl + dl, th + dh
    box = StoredBox(tl, th, il, ih, dl, dh)
    ctx = RuleContext(blocks={"r": BlockData("r", "b", "0" * 64, "m", {}, {"z": box})})
    state = {"kind": "state", "outputs": {"z": "r"}}
    by_state = np.array(vals(conclude("top1-from-state", [state], ctx, tensor="z")))
    lin = conclude("linf-from-state", [state], ctx, tensor="z")
    by_margin = np.array(vals(conclude("top1-from-margin", [lin, state], ctx)))
    assert np.all(by_state >= by_margin) and by_state.sum() > by_margin.sum()
    # soundness: sampled training values and drifts in the boxes never disagree where certified
    for _ in range(50):
        zt = rng.uniform(tl, th)
        zi = zt + rng.uniform(dl, dh)
        agree = (zt.argmax(-1) == zi.argmax(-1)) & (zt.argmax(-1) == tl.argmax(-1))
        assert np.all(agree[by_state == 1.0])
