"""Step-time statistics of the comparison protocol (paper §3.3, Appendix A).

A run's step time is the median over its steady steps. A speedup is a ratio of medians,
S = T_arm / T_ref, with a 95% percentile bootstrap interval: each arm's steady steps are
resampled independently (10,000 resamples by default) and the ratio of medians recomputed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

RESAMPLES = 10_000
CONFIDENCE = 0.95
FASTER_MARGIN = 1.111  # "faster" needs the lower bound above this (paper §3.3)


@dataclasses.dataclass(frozen=True)
class Interval:
    """A point estimate with its bootstrap interval."""

    point: float
    low: float
    high: float

    def as_dict(self) -> dict[str, float]:
        return {"median": self.point, "ci_low": self.low, "ci_high": self.high}


def _values(name: str, x: Sequence[float]) -> np.ndarray:
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{name}: need a non-empty 1-D sample, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)) or np.any(arr <= 0):
        raise ValueError(f"{name}: step times must be finite and > 0")
    return arr


def _resampled_medians(x: np.ndarray, resamples: int, rng: np.random.Generator) -> np.ndarray:
    idx = rng.integers(0, x.size, size=(resamples, x.size))
    return np.median(x[idx], axis=1)


def bootstrap_ratio(
    numerator: Sequence[float],
    denominator: Sequence[float],
    *,
    resamples: int = RESAMPLES,
    confidence: float = CONFIDENCE,
    seed: int = 0,
) -> Interval:
    """median(numerator) / median(denominator) with a percentile bootstrap interval.

    Deterministic for a given seed. Samples of one value give a zero-width interval.
    """
    num = _values("numerator", numerator)
    den = _values("denominator", denominator)
    if resamples < 1 or not 0 < confidence < 1:
        raise ValueError("need resamples >= 1 and 0 < confidence < 1")
    rng = np.random.default_rng(seed)
    ratios = _resampled_medians(num, resamples, rng) / _resampled_medians(den, resamples, rng)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(ratios, [tail, 100 - tail])
    return Interval(float(np.median(num) / np.median(den)), float(low), float(high))


def per_token(step_s: Sequence[float], tokens: Sequence[float]) -> np.ndarray:
    """Seconds per generated token, step by step."""
    t = _values("step_s", step_s)
    n = _values("tokens", tokens)
    if t.size != n.size:
        raise ValueError(f"{t.size} step times but {n.size} token counts")
    return t / n


def is_faster(interval: Interval, margin: float = FASTER_MARGIN) -> bool:
    """The paper's verdict rule for one ratio: its lower bound exceeds the margin."""
    return interval.low > margin
