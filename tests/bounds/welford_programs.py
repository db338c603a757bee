"""Independent fp32 programs of the Welford / Chan moments family (docs/bounds.md, "LayerNorm
moments"), written in numpy float32 (every operation one IEEE round-to-nearest), not with the
engine's code: a tree of merges with a chosen shape, orientation and update form, and an
emulation of torch's CPU RowwiseMoments (Welford chains of 16 per SIMD lane, a binary cascade
of chunks, the stack merged into its first slot, a scalar Welford tail, the lanes merged into
it one by one, Chan's AddMoments order ((delta * delta) * c) * n_a).

A tree is a leaf index (int) or ``(a, b)`` (``a`` is the accumulator: mu = mu_a + c delta with
delta = mu_b - mu_a, c = n_b / n). ``moments(x, tree, form)`` gives (mean, M2) per row.
"""

from __future__ import annotations

import math

import numpy as np

F32 = np.float32


def _f(x) -> np.ndarray:
    return np.asarray(x, dtype=F32)


def fma(a, b, c) -> np.ndarray:
    """fl32(a * b + c), one rounding: the fp32 product is exact in float64, the sum's float64
    rounding error is recovered (TwoSum) and breaks the one case it can decide, an fp32 tie."""
    p = np.asarray(a, np.float64) * np.asarray(b, np.float64)
    c = np.asarray(c, np.float64)
    s = p + c
    bb = s - p
    e = (p - (s - bb)) + (c - bb)
    r = _f(s)
    r64 = r.astype(np.float64)
    other = np.nextafter(r, np.where(s > r64, F32(np.inf), F32(-np.inf))).astype(np.float64)
    tie = (s == (r64 + other) / 2) & (e != 0)
    away = tie & (np.sign(e) == np.sign(other - r64))
    return _f(np.where(away, other, r64))


def merge(na: int, ma, sa, nb: int, mb, sb, form: str = "mul"):
    """One Chan node in fp32. ``form``: "mul" (mu_a + fl(fl(n_b / n) * delta)), "fma" (the
    same fused, as torch's AddMoments), "div" (for a single new element: mu_a + fl(delta / n),
    M_a + fl(delta * fl(x - mu))), "recip" (c as fl(1 / n) for a single new element)."""
    n = na + nb
    if na == 0:  # merging into an empty accumulator: an exact copy
        return nb, _f(mb), _f(sb)
    delta = _f(mb - ma)
    if form in ("div", "recip") and nb == 1:
        step = _f(delta / F32(n)) if form == "div" else _f(delta * _f(F32(1) / F32(n)))
        mu = _f(ma + step)
        m2 = _f(sa + _f(delta * _f(mb - mu)))
        return n, mu, m2
    c = _f(F32(nb) / F32(n))
    if form == "fma":  # torch's AddMoments as compiled: both updates fused
        return n, fma(c, delta, ma), _f(sa + fma(_f(_f(delta * delta) * c), F32(na), sb))
    mu = _f(ma + _f(c * delta))
    t = _f(_f(_f(delta * delta) * c) * F32(na))
    m2 = _f(sa + _f(sb + t))
    return n, mu, m2


def moments(x: np.ndarray, tree, form: str = "mul"):
    """(n, mean, M2) of the rows of ``x`` (rows, n) over ``tree``, every operation in fp32."""
    x = _f(x)
    if isinstance(tree, int):
        return 1, x[:, tree], np.zeros(x.shape[0], F32)
    a = moments(x, tree[0], form)
    b = moments(x, tree[1], form)
    return merge(*a, *b, form=form)


def height(tree) -> int:
    return 0 if isinstance(tree, int) else 1 + max(height(tree[0]), height(tree[1]))


def chain(idx: list[int]):
    """Sequential Welford: ((x0, x1), x2), ... (a new element on the b side)."""
    t = idx[0]
    for j in idx[1:]:
        t = (t, j)
    return t


def reverse_chain(idx: list[int]):
    """The accumulator is the single new element, the running part is b (c close to 1)."""
    t = idx[0]
    for j in idx[1:]:
        t = (j, t)
    return t


def pairwise(idx: list[int]):
    if len(idx) == 1:
        return idx[0]
    h = len(idx) // 2
    return (pairwise(idx[:h]), pairwise(idx[h:]))


def chunked(idx: list[int], k: int, inner, outer):
    """Trees of ``inner`` over chunks of ``k`` elements, combined by ``outer``."""
    parts = [inner(idx[i:i + k]) for i in range(0, len(idx), k)]
    if outer is chain or outer is reverse_chain:
        t = parts[0]
        for p in parts[1:]:
            t = (t, p) if outer is chain else (p, t)
        return t
    while len(parts) > 1:
        parts = [(parts[i], parts[i + 1]) if i + 1 < len(parts) else parts[i]
                 for i in range(0, len(parts), 2)]
    return parts[0]


def random_tree(idx: list[int], rng: np.random.Generator, max_height: int):
    """A random binary tree over ``idx`` (a random split, random orientation) of height at most
    ``max_height`` (splits forced towards balance where needed)."""
    n = len(idx)
    if n == 1:
        return idx[0]
    need = math.ceil(math.log2(n))
    lo = max(1, n - 2 ** (max_height - 1)) if max_height - 1 >= need - 1 else n // 2
    hi = min(n - 1, 2 ** (max_height - 1))
    k = int(rng.integers(lo, hi + 1)) if hi >= lo else n // 2
    a = random_tree(idx[:k], rng, max_height - 1)
    b = random_tree(idx[k:], rng, max_height - 1)
    return (a, b) if rng.random() < 0.5 else (b, a)


def torch_rowwise(x: np.ndarray, lanes: int = 8):
    """(mean, M2) as torch's CPU RowwiseMoments computes them with ``lanes`` fp32 SIMD lanes
    (8: its AVX2 build, whose chunk loop fuses m1 + delta c; bit for bit on x86, tested)."""
    x = _f(x)
    rows, n_all = x.shape
    nv = n_all // lanes
    m = -(-nv // 16)
    depth = max(math.ceil(math.log2(m)), 1) if m > 0 else 1
    z = np.zeros((rows, lanes), F32)
    stk = [[0, z.copy(), z.copy()] for _ in range(depth)]
    cs = [_f(F32(1) / F32(j + 1)) for j in range(16)]
    for i in range(m):
        m0 = min(16, nv - i * 16)
        m1, m2 = z.copy(), z.copy()
        for j in range(m0):
            xv = x[:, (i * 16 + j) * lanes:(i * 16 + j + 1) * lanes]
            d = _f(xv - m1)
            m1 = fma(d, cs[j], m1)
            m2 = _f(m2 + _f(d * _f(xv - m1)))
        stk[0] = list(merge_vec(m0, m1, m2, *stk[0]))
        mask = i + 1
        j = 1
        while j < depth and (mask & 1) == 0:
            stk[j] = list(merge_vec(*stk[j - 1], *stk[j]))
            stk[j - 1] = [0, z.copy(), z.copy()]
            mask >>= 1
            j += 1
    for i in range(1, depth):
        stk[0] = list(merge_vec(*stk[i], *stk[0]))
    cnt, mu, s = 0, np.zeros(rows, F32), np.zeros(rows, F32)
    for i in range(nv * lanes, n_all):
        d = _f(x[:, i] - mu)
        cnt += 1
        mu = _f(mu + _f(d / F32(cnt)))
        s = _f(s + _f(d * _f(x[:, i] - mu)))
    for ln in range(lanes):
        cnt, mu, s = merge_vec(nv, stk[0][1][:, ln], stk[0][2][:, ln], cnt, mu, s)
    return mu, s


def merge_vec(n_add: int, m1_add, m2_add, n0: int, m1, m2):
    """torch's AddMoments: the (n_add, m1_add, m2_add) part added into (n0, m1, m2), with the
    fused multiply-adds its x86 build has (m1 + c d, m2_add + (d d c) n0)."""
    n = n0 + n_add
    c = F32(0) if n == 0 else _f(F32(n_add) / F32(n))
    d = _f(m1_add - m1)
    return n, fma(c, d, m1), _f(m2 + fma(_f(_f(d * d) * c), F32(n0), m2_add))


def layer_norm(x: np.ndarray, mu: np.ndarray, m2: np.ndarray, eps: float) -> np.ndarray:
    """torch's second pass in fp32: var = M2 / n, r = 1 / sqrt(var + eps), (x + (-mu)) * r."""
    x = _f(x)
    var = _f(m2 / F32(x.shape[1]))
    r = _f(F32(1) / _f(np.sqrt(_f(var + F32(eps)))))
    return _f(_f(x + _f(-mu)[:, None]) * r[:, None])


def trees(n: int, max_height: int, rng: np.random.Generator) -> dict[str, tuple[object, str]]:
    """Named (tree, form) programs of the family over n elements (height <= max_height)."""
    idx = list(range(n))
    short = n - 1 <= max_height
    out = {
        "pairwise": (pairwise(idx), "mul"),
        "chain16-pairwise": (chunked(idx, 16, chain, pairwise), "recip"),
        "pairwise-fma": (pairwise(idx), "fma"),
        "reverse16-pairwise": (chunked(idx, 16, reverse_chain, pairwise), "mul"),
        "random": (random_tree(idx, rng, max_height), "mul"),
    }
    if short:
        out["chain-div"] = (chain(idx), "div")
        out["chain-mul"] = (chain(idx), "mul")
        out["reverse-chain"] = (reverse_chain(idx), "mul")
    for name, (t, _) in out.items():
        assert height(t) <= max_height, (name, height(t), max_height)
    return out
