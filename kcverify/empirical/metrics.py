"""The metric registry: named empirical quantities of a contract's statistical and runtime clauses.

A metric is registered with ``@register_metric(name, family=..., unit=..., direction=...,
reduce=...)`` on a function of :class:`MetricInputs`. Most metrics return *per-position values*, a
float64 array ``[n, m]`` (n inputs = the slice's examples, m positions per input; m = 1 for a
classifier); ``reduce`` then says how values become a number:

* ``"mean"``: the mean; a float ``q`` in (0, 1): the q-quantile (numpy's default linear
  interpolation, Hyndman-Fan type 7); ``"max"``: the maximum.
* The **aggregate** (the clause's observed value) reduces all n*m values together; the **per-unit
  values** reduce each input's m values on their own (one number per input). The statistics
  (kcverify.empirical.stats) count *inputs* whose per-unit value violates the threshold: inputs are
  the independent draws of a slice, positions of one input are not.

``reduce="statistic"`` marks a metric that is a whole-sample statistic (the function returns a
float, e.g. a calibration error): it has no per-unit values and is decided by a bootstrap bound.

Conventions (logits z [n, ..., V], float64; the vocabulary axis is last; T = temperature):
p = softmax(z_train / T) is the training kernel's distribution, q = softmax(z_inf / T) the inference
kernel's; rho = q / p is the importance ratio of semantics §1.3.

Adding a metric is one function and one decorator in this file (or any imported module).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kcverify.errors import KcverifyError

FAMILIES = ("statistical", "runtime")
DIRECTIONS = ("<=", ">=")


class MetricError(KcverifyError):
    """An unknown metric, or a metric asked of inputs that lack what it needs."""


@dataclass(frozen=True)
class MetricInputs:
    """What metrics are computed from: both kernels' outputs on a slice, labels, runtime samples.

    logits_train / logits_inf: float64 [n, ..., V]; labels: int [n, ...] matching the positions
    (negative labels are ignored); latencies_ms: float64 [r] (one per timed repetition);
    peak_memory_mb: the peak measured while timing.
    """

    logits_train: np.ndarray | None = None
    logits_inf: np.ndarray | None = None
    labels: np.ndarray | None = None
    temperature: float = 1.0
    latencies_ms: np.ndarray | None = None
    peak_memory_mb: float | None = None

    def __post_init__(self) -> None:
        for name in ("logits_train", "logits_inf"):
            v = getattr(self, name)
            if v is not None:
                object.__setattr__(self, name, np.asarray(v, dtype=np.float64))
        if (self.logits_train is None) != (self.logits_inf is None):
            raise MetricError("metrics need both kernels' logits (logits_train and logits_inf)")
        if self.logits_train is not None and self.logits_train.shape != self.logits_inf.shape:
            raise MetricError(f"logits of the two kernels differ in shape: "
                              f"{self.logits_train.shape} vs {self.logits_inf.shape}")
        if not self.temperature > 0:
            raise MetricError(f"temperature must be > 0, not {self.temperature}")

    @property
    def n(self) -> int:
        """The number of units: inputs for logit metrics, repetitions for runtime metrics."""
        if self.logits_train is not None:
            return int(self.logits_train.shape[0])
        if self.latencies_ms is not None:
            return int(np.asarray(self.latencies_ms).shape[0])
        return 1 if self.peak_memory_mb is not None else 0

    def take(self, idx: np.ndarray) -> MetricInputs:
        """The inputs restricted to units ``idx`` (inputs when logits are given, else timed calls)."""
        return replace(
            self,
            logits_train=None if self.logits_train is None else self.logits_train[idx],
            logits_inf=None if self.logits_inf is None else self.logits_inf[idx],
            labels=None if self.labels is None else np.asarray(self.labels)[idx],
            latencies_ms=(np.asarray(self.latencies_ms)[idx]
                          if self.latencies_ms is not None and self.logits_train is None
                          else self.latencies_ms),
        )

    # -- shared intermediate quantities, each [n, m, V] or [n, m] -------------------------------
    def flat_logits(self) -> tuple[np.ndarray, np.ndarray]:
        """Both logits reshaped to [n, m, V] (m = product of the position axes, 1 if none)."""
        if self.logits_train is None:
            raise MetricError("this metric needs both kernels' logits; none were given")
        zt, zi = self.logits_train, self.logits_inf
        if zt.ndim < 2:
            raise MetricError(f"logits need a batch and a vocabulary axis, got shape {zt.shape}")
        n, v = zt.shape[0], zt.shape[-1]
        return zt.reshape(n, -1, v), zi.reshape(n, -1, v)

    def log_probs(self) -> tuple[np.ndarray, np.ndarray]:
        """(log p, log q) = log_softmax(z / T) of the training and inference logits, [n, m, V]."""
        zt, zi = self.flat_logits()
        return _log_softmax(zt / self.temperature), _log_softmax(zi / self.temperature)


def _log_softmax(z: np.ndarray) -> np.ndarray:
    m = np.max(z, axis=-1, keepdims=True)
    s = z - m
    return s - np.log(np.sum(np.exp(s), axis=-1, keepdims=True))


Reduce = str | float


@dataclass(frozen=True)
class Metric:
    """A registered metric. ``direction`` "<=" means values at most the threshold are good."""

    name: str
    family: str
    unit: str
    direction: str
    reduce: Reduce
    fn: Callable[[MetricInputs], Any]
    needs: tuple[str, ...] = ()
    doc: str = ""
    prepare: Callable[[MetricInputs], Callable[[np.ndarray], float]] | None = None

    def resampler(self, x: MetricInputs) -> Callable[[np.ndarray], float]:
        """idx -> the aggregate on the units idx (drawn with replacement), for the bootstrap.

        A metric may register ``prepare`` to compute per-unit summaries once (ece_gap does).
        """
        self._check_needs(x)
        if self.prepare is not None:
            return self.prepare(x)
        return lambda idx: self.aggregate(x.take(idx))

    @property
    def is_statistic(self) -> bool:
        return self.reduce == "statistic"

    @property
    def quantile(self) -> float | None:
        """q when the metric is a q-quantile (e.g. 0.95 for p95_latency_ms), else None."""
        return float(self.reduce) if isinstance(self.reduce, float) else None

    def values(self, x: MetricInputs) -> np.ndarray:
        """Per-position values [n, m] (float64); not defined for whole-sample statistics."""
        if self.is_statistic:
            raise MetricError(f"metric {self.name!r} is a whole-sample statistic; it has no "
                              f"per-position values")
        self._check_needs(x)
        v = np.asarray(self.fn(x), dtype=np.float64)
        return v.reshape(v.shape[0], -1) if v.ndim != 2 else v

    def aggregate(self, x: MetricInputs) -> float:
        """The metric over the whole sample: every input and position together."""
        if self.is_statistic:
            self._check_needs(x)
            return float(self.fn(x))
        return float(_reduce(self.values(x).ravel(), self.reduce))

    def per_unit(self, x: MetricInputs) -> np.ndarray | None:
        """One value per unit (input or repetition), reducing its positions; None for statistics."""
        if self.is_statistic:
            return None
        v = self.values(x)
        return _reduce(v, self.reduce, axis=1)

    def violates(self, value: np.ndarray | float, threshold: float) -> np.ndarray:
        """Elementwise: does ``value`` break ``value <direction> threshold``? (NaN violates.)"""
        v = np.asarray(value, dtype=np.float64)
        ok = v <= threshold if self.direction == "<=" else v >= threshold
        return ~ok

    def _check_needs(self, x: MetricInputs) -> None:
        missing = [need for need in self.needs if _missing(x, need)]
        if missing:
            raise MetricError(f"metric {self.name!r} needs {', '.join(missing)}, which the "
                              f"evaluation did not provide")


def _missing(x: MetricInputs, need: str) -> bool:
    return {
        "logits": x.logits_train is None,
        "labels": x.labels is None,
        "latency": x.latencies_ms is None,
        "memory": x.peak_memory_mb is None,
    }[need]


def _reduce(v: np.ndarray, how: Reduce, axis: int | None = None) -> np.ndarray:
    if how == "mean":
        return np.mean(v, axis=axis)
    if how == "max":
        return np.max(v, axis=axis)
    if isinstance(how, float):
        return np.quantile(v, how, axis=axis)
    raise MetricError(f"unknown reduction {how!r}; expected 'mean', 'max' or a quantile in (0, 1)")


METRICS: dict[str, Metric] = {}


def register_metric(name: str, *, family: str = "statistical", unit: str = "",
                    direction: str = "<=", reduce: Reduce = "mean",
                    needs: Sequence[str] = ("logits",),
                    prepare: Callable[[MetricInputs], Callable[[np.ndarray], float]] | None = None,
                    ) -> Callable[[Callable], Callable]:
    """Register ``fn`` as metric ``name``. Decorators stack: one function may back several names.

    family: "statistical" | "runtime"; direction: "<=" (smaller is better) or ">=";
    reduce: "mean" | "max" | a quantile q in (0, 1) | "statistic" (fn returns a float).
    """
    if family not in FAMILIES:
        raise ValueError(f"metric {name!r}: family must be one of {FAMILIES}, not {family!r}")
    if direction not in DIRECTIONS:
        raise ValueError(f"metric {name!r}: direction must be one of {DIRECTIONS}, not {direction!r}")
    if isinstance(reduce, float) and not 0.0 < reduce < 1.0:
        raise ValueError(f"metric {name!r}: a quantile is in (0, 1), not {reduce}")
    if not isinstance(reduce, float) and reduce not in ("mean", "max", "statistic"):
        raise ValueError(f"metric {name!r}: unknown reduce {reduce!r}")
    for need in needs:
        if need not in ("logits", "labels", "latency", "memory"):
            raise ValueError(f"metric {name!r}: unknown need {need!r}")

    def deco(fn: Callable) -> Callable:
        if name in METRICS:
            raise ValueError(f"metric {name!r} is already registered")
        METRICS[name] = Metric(name=name, family=family, unit=unit, direction=direction,
                               reduce=reduce, fn=fn, needs=tuple(needs), prepare=prepare,
                               doc=(fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else "")
        return fn

    return deco


def get_metric(name: str) -> Metric:
    """The registered metric ``name``; MetricError listing every registered name otherwise."""
    try:
        return METRICS[name]
    except KeyError:
        raise MetricError(f"unknown metric {name!r}; registered: {', '.join(sorted(METRICS))}") from None


def compute_metric(name: str, x: MetricInputs) -> float:
    """The aggregate value of metric ``name`` on ``x``."""
    return get_metric(name).aggregate(x)


# --------------------------------------------------------------------------------------------
# Logit drift
# --------------------------------------------------------------------------------------------


@register_metric("p50_logit_l2", unit="logit", reduce=0.50)
@register_metric("p95_logit_l2", unit="logit", reduce=0.95)
@register_metric("p99_logit_l2", unit="logit", reduce=0.99)
def logit_l2(x: MetricInputs) -> np.ndarray:
    """||z_inf - z_train||_2 over the vocabulary axis, per position (quantile over positions)."""
    zt, zi = x.flat_logits()
    return np.sqrt(np.sum((zi - zt) ** 2, axis=-1))


# --------------------------------------------------------------------------------------------
# Distribution drift
# --------------------------------------------------------------------------------------------


@register_metric("mean_kl", unit="nat", reduce="mean")
@register_metric("p99_kl", unit="nat", reduce=0.99)
def kl_train_inf(x: MetricInputs) -> np.ndarray:
    """KL(p || q) = sum_i p_i (log p_i - log q_i) per position, at temperature T."""
    lp, lq = x.log_probs()
    kl = np.sum(np.exp(lp) * (lp - lq), axis=-1)
    return np.maximum(kl, 0.0)  # KL >= 0; clears -1e-17 rounding noise


@register_metric("mean_abs_log_ratio", unit="nat", reduce="mean")
def abs_log_ratio(x: MetricInputs) -> np.ndarray:
    """E_{t~p} |log rho_t| = sum_i p_i |log q_i - log p_i| per position (rho = q/p).

    The training distribution weights each token, so the metric is the expected absolute
    log importance ratio of a token sampled by the training kernel (the RL clause's |log rho|).
    """
    lp, lq = x.log_probs()
    return np.sum(np.exp(lp) * np.abs(lq - lp), axis=-1)


@register_metric("mean_w_log_w", unit="nat", reduce="mean")
def w_log_w(x: MetricInputs) -> np.ndarray:
    """E_{t~p}[w log w] with w = q/p, per position; it equals KL(q || p) = sum_i q_i log(q_i/p_i)."""
    lp, lq = x.log_probs()
    w = np.exp(lq - lp)
    return np.maximum(np.sum(np.exp(lp) * w * (lq - lp), axis=-1), 0.0)


# --------------------------------------------------------------------------------------------
# Top-k agreement
# --------------------------------------------------------------------------------------------


def _topk(z: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest logits per position, ties broken towards the lower index."""
    return np.argsort(-z, axis=-1, kind="stable")[..., :k]


def _overlap(x: MetricInputs, k: int) -> np.ndarray:
    """|topk(z_train) ∩ topk(z_inf)| / k per position (k capped at the vocabulary size)."""
    zt, zi = x.flat_logits()
    k = min(k, zt.shape[-1])
    a, b = _topk(zt, k), _topk(zi, k)
    hits = (a[..., :, None] == b[..., None, :]).any(axis=-1).sum(axis=-1)
    return hits / k


@register_metric("top1_overlap", unit="fraction", direction=">=", reduce="mean")
def top1_overlap(x: MetricInputs) -> np.ndarray:
    """1 where both kernels' top-1 token agree, else 0, per position (mean: the agreement rate)."""
    return _overlap(x, 1)


@register_metric("top5_overlap", unit="fraction", direction=">=", reduce="mean")
def top5_overlap(x: MetricInputs) -> np.ndarray:
    """|top5(z_train) ∩ top5(z_inf)| / 5 per position."""
    return _overlap(x, 5)


@register_metric("top10_overlap", unit="fraction", direction=">=", reduce="mean")
def top10_overlap(x: MetricInputs) -> np.ndarray:
    """|top10(z_train) ∩ top10(z_inf)| / 10 per position."""
    return _overlap(x, 10)


# --------------------------------------------------------------------------------------------
# Calibration (needs labels)
# --------------------------------------------------------------------------------------------

ECE_BINS = 15


def _confidence_correct(log_probs: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per position: confidence max_i p_i, correctness of argmax, and whether it counts (label >= 0).

    Arrays are [n, m] (n inputs, m positions): log_probs [n, ..., V], labels [n, ...].
    """
    n = log_probs.shape[0]
    lp = log_probs.reshape(n, -1, log_probs.shape[-1])
    y = np.asarray(labels).reshape(n, -1)
    if y.shape[1] != lp.shape[1]:
        raise MetricError(f"labels have {y.shape[1]} positions per input but the logits have "
                          f"{lp.shape[1]}")
    conf = np.exp(np.max(lp, axis=-1))
    correct = (np.argmax(lp, axis=-1) == y).astype(np.float64)
    return conf, correct, y >= 0


def _ece(conf: np.ndarray, correct: np.ndarray, keep: np.ndarray, bins: int = ECE_BINS) -> float:
    conf, correct = conf[keep], correct[keep]
    if conf.size == 0:
        return 0.0
    idx = np.clip(np.ceil(conf * bins).astype(np.int64) - 1, 0, bins - 1)
    count = np.bincount(idx, minlength=bins).astype(np.float64)
    gap = np.bincount(idx, weights=correct - conf, minlength=bins)
    # sum_b |B_b|/N * |acc_b - conf_b| = sum_b |sum_{i in B_b} (correct_i - conf_i)| / N
    return float(np.sum(np.abs(gap[count > 0])) / conf.size)


def expected_calibration_error(log_probs: np.ndarray, labels: np.ndarray, bins: int = ECE_BINS) -> float:
    """ECE = sum_b (|B_b| / N) |acc(B_b) - conf(B_b)| over equal-width confidence bins.

    confidence = max_i p_i, prediction = argmax_i p_i; bin b holds confidences in (b/B, (b+1)/B]
    (the first bin also holds 0). Positions with a negative label are ignored.
    """
    lp = np.asarray(log_probs)
    y = np.asarray(labels)
    if lp.ndim == 2 and y.ndim == 1:
        lp = lp[:, None, :]
    return _ece(*_confidence_correct(lp, y), bins=bins)


def _ece_gap_resampler(x: MetricInputs) -> Callable[[np.ndarray], float]:
    """Summaries per input computed once; each bootstrap draw only re-bins them."""
    lp, lq = x.log_probs()
    p_stats = _confidence_correct(lp, x.labels)
    q_stats = _confidence_correct(lq, x.labels)

    def stat(idx: np.ndarray) -> float:
        return abs(_ece(*(a[idx] for a in q_stats)) - _ece(*(a[idx] for a in p_stats)))

    return stat


@register_metric("ece_gap", unit="fraction", reduce="statistic", needs=("logits", "labels"),
                 prepare=_ece_gap_resampler)
def ece_gap(x: MetricInputs) -> float:
    """|ECE(q) - ECE(p)|: the change in expected calibration error (15 bins) between kernels."""
    return _ece_gap_resampler(x)(np.arange(x.n))


# --------------------------------------------------------------------------------------------
# Runtime
# --------------------------------------------------------------------------------------------


@register_metric("p50_latency_ms", family="runtime", unit="ms", reduce=0.50, needs=("latency",))
@register_metric("p95_latency_ms", family="runtime", unit="ms", reduce=0.95, needs=("latency",))
@register_metric("p99_latency_ms", family="runtime", unit="ms", reduce=0.99, needs=("latency",))
def latency_ms(x: MetricInputs) -> np.ndarray:
    """Wall-clock latency of one call of the inference kernel, per timed repetition [r, 1]."""
    return np.asarray(x.latencies_ms, dtype=np.float64).reshape(-1, 1)


@register_metric("peak_memory_mb", family="runtime", unit="MiB", reduce="max", needs=("memory",))
def peak_memory_mb(x: MetricInputs) -> np.ndarray:
    """Peak memory while the inference kernel ran (MiB; see kcverify.empirical.runtime)."""
    return np.asarray([[float(x.peak_memory_mb)]])
