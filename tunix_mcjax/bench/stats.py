"""Step-time statistics of the comparison protocol (paper §3.3, Appendix A).

A run's step time is the median over its steady steps. A speedup is a ratio of medians,
S = T_arm / T_ref, with a 95% percentile bootstrap interval (10,000 resamples by default): each
arm is resampled independently and the ratio of medians recomputed. Consecutive steps of one
launch are not independent (machine load drifts, a launch's compile and placement luck persist),
so `launch_bootstrap_ratio` resamples launches, and inside each drawn launch blocks of
`BLOCK_STEPS` consecutive steps (circular blocks); `bootstrap_ratio` is its one-launch,
one-step-block case. `bootstrap_median` gives one arm's median its interval, and
`seed_bootstrap_ratio` a ratio of sums over paired seeds (`bench.learn`). Every benchmark's
bootstrap lives here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

RESAMPLES = 10_000
CONFIDENCE = 0.95
FASTER_MARGIN = 1.111  # "faster" needs the lower bound above this (paper §3.3)
BLOCK_STEPS = 5  # consecutive steps resampled together


@dataclasses.dataclass(frozen=True)
class Interval:
    """A point estimate with its bootstrap interval."""

    point: float
    low: float
    high: float

    def as_dict(self) -> dict[str, float]:
        return {"median": self.point, "ci_low": self.low, "ci_high": self.high}

    def as_tuple(self) -> tuple[float, float, float]:
        """(point, low, high), as `bench.engine`'s result files hold an interval."""
        return (self.point, self.low, self.high)


def _values(name: str, x: Sequence[float]) -> np.ndarray:
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{name}: need a non-empty 1-D sample, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)) or np.any(arr <= 0):
        raise ValueError(f"{name}: step times must be finite and > 0")
    return arr


def resampled_medians(launches: list[np.ndarray], block: int, resamples: int,
                      rng: np.random.Generator) -> np.ndarray:
    """`resamples` bootstrap medians of the pooled launches: launches drawn with replacement,
    then circular blocks of `block` steps in each drawn launch (one launch and blocks of one:
    steps drawn independently). Each resample draws in the same order it always has, so a seed
    gives the committed results' intervals; the medians are taken in one pass after."""
    if len(launches) == 1:
        # Drawing the one launch takes no random bits, and one call of shape (resamples, m)
        # draws what `resamples` calls of m would (tests/test_bench_stats.py checks both); with
        # blocks of one these are the steps themselves.
        x = launches[0]
        starts = rng.integers(0, x.size, size=(resamples, -(-x.size // block)))
        idx = (starts[:, :, None] + np.arange(block)) % x.size
        return np.median(x[idx.reshape(resamples, -1)[:, :x.size]], axis=1)
    pooled = np.concatenate(launches)
    offsets = np.cumsum([0] + [x.size for x in launches[:-1]])
    steps = np.arange(block)
    rows = []
    for _ in range(resamples):
        drawn = []
        for j in rng.integers(0, len(launches), size=len(launches)):
            n = launches[j].size
            starts = rng.integers(0, n, size=-(-n // block))
            drawn.append(offsets[j] + ((starts[:, None] + steps) % n).ravel()[:n])
        rows.append(np.concatenate(drawn))
    return _row_medians(pooled, rows)


def _row_medians(pooled: np.ndarray, rows: list[np.ndarray]) -> np.ndarray:
    """The median of `pooled[row]` for each row, rows of one length in one pass."""
    sizes = np.array([row.size for row in rows])
    out = np.empty(len(rows))
    for size in np.unique(sizes):
        pick = np.flatnonzero(sizes == size)
        out[pick] = np.median(pooled[np.stack([rows[i] for i in pick])], axis=1)
    return out


def launch_bootstrap_ratio(
    numerator: Sequence[Sequence[float]],
    denominator: Sequence[Sequence[float]],
    *,
    block: int = BLOCK_STEPS,
    resamples: int = RESAMPLES,
    confidence: float = CONFIDENCE,
    seed: int = 0,
) -> Interval:
    """median(pooled numerator) / median(pooled denominator); each side is a list of launches
    (1-D step samples). The interval resamples launches, then `block`-step blocks in each.

    Deterministic for a given seed. Samples of one value give a zero-width interval.
    """
    num = [_values(f"numerator launch {i}", x) for i, x in enumerate(numerator)]
    den = [_values(f"denominator launch {i}", x) for i, x in enumerate(denominator)]
    if not num or not den:
        raise ValueError("need at least one launch on each side")
    if resamples < 1 or not 0 < confidence < 1 or block < 1:
        raise ValueError("need resamples >= 1, 0 < confidence < 1 and block >= 1")
    rng = np.random.default_rng(seed)
    ratios = (resampled_medians(num, block, resamples, rng)
              / resampled_medians(den, block, resamples, rng))
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(ratios, [tail, 100 - tail])
    point = np.median(np.concatenate(num)) / np.median(np.concatenate(den))
    return Interval(float(point), float(low), float(high))


def bootstrap_ratio(
    numerator: Sequence[float],
    denominator: Sequence[float],
    *,
    resamples: int = RESAMPLES,
    confidence: float = CONFIDENCE,
    seed: int = 0,
) -> Interval:
    """median(numerator) / median(denominator), steps resampled as if independent (one launch,
    blocks of one step). Deterministic for a given seed."""
    return launch_bootstrap_ratio([_values("numerator", numerator)],
                                  [_values("denominator", denominator)], block=1,
                                  resamples=resamples, confidence=confidence, seed=seed)


def bootstrap_median(values: Sequence[float], *, resamples: int = RESAMPLES,
                     confidence: float = CONFIDENCE, seed: int = 0) -> Interval:
    """median(values), values resampled as if independent. Deterministic for a given seed."""
    x = _values("values", values)
    if resamples < 1 or not 0 < confidence < 1:
        raise ValueError("need resamples >= 1 and 0 < confidence < 1")
    medians = resampled_medians([x], 1, resamples, np.random.default_rng(seed))
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(medians, [tail, 100 - tail])
    return Interval(float(np.median(x)), float(low), float(high))


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


def welch_log_ratio(numerator: Sequence[float], denominator: Sequence[float],
                    confidence: float = CONFIDENCE) -> Interval:
    """exp(mean log numerator - mean log denominator) over launch values (one per launch), with
    the Welch t interval of that difference: the paper's rule for LoCoJAX-DA against -CO
    (Appendix A). Needs two launches a side; identical launches give a zero-width interval."""
    from scipy import stats as st

    x, y = np.log(_values("numerator", numerator)), np.log(_values("denominator", denominator))
    if x.size < 2 or y.size < 2:
        raise ValueError(f"a Welch interval needs >= 2 launches per arm, got {x.size} and "
                         f"{y.size}: run with --launches 3")
    vx, vy = x.var(ddof=1) / x.size, y.var(ddof=1) / y.size
    diff, se = x.mean() - y.mean(), np.sqrt(vx + vy)
    if se == 0:
        return Interval(float(np.exp(diff)), float(np.exp(diff)), float(np.exp(diff)))
    df = (vx + vy) ** 2 / (vx ** 2 / (x.size - 1) + vy ** 2 / (y.size - 1))
    half = st.t.ppf(0.5 + confidence / 2, df) * se
    return Interval(float(np.exp(diff)), float(np.exp(diff - half)), float(np.exp(diff + half)))


def paired_step_bootstrap(numerator: Sequence[float], denominator: Sequence[float], *,
                          resamples: int = RESAMPLES, confidence: float = CONFIDENCE,
                          seed: int = 0) -> Interval:
    """median(numerator) / median(denominator) where element i of both is the same step (same
    batch) of paired launches; each resample draws step indices once for both arms."""
    num, den = _values("numerator", numerator), _values("denominator", denominator)
    if num.size != den.size:
        raise ValueError(f"paired samples differ in length: {num.size} vs {den.size}")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, num.size, size=(resamples, num.size))
    ratios = np.median(num[idx], axis=1) / np.median(den[idx], axis=1)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(ratios, [tail, 100 - tail])
    return Interval(float(np.median(num) / np.median(den)), float(low), float(high))


def seed_bootstrap_ratio(numerator: Sequence[float], denominator: Sequence[float], *,
                         resamples: int = RESAMPLES, confidence: float = CONFIDENCE,
                         seed: int = 0) -> Interval:
    """sum(numerator) / sum(denominator) over paired seeds, with a percentile seed bootstrap.

    Seed i of both samples is resampled together. Deterministic for a given `seed`.
    """
    num = np.asarray(numerator, dtype=np.float64)
    den = np.asarray(denominator, dtype=np.float64)
    if num.ndim != 1 or num.shape != den.shape or num.size == 0:
        raise ValueError(f"need two paired, non-empty 1-D samples; got {num.shape}, {den.shape}")
    if not (np.all(np.isfinite(num)) and np.all(np.isfinite(den)) and np.all(den > 0)):
        raise ValueError("values must be finite, and the denominator's > 0")
    if resamples < 1 or not 0 < confidence < 1:
        raise ValueError("need resamples >= 1 and 0 < confidence < 1")
    idx = np.random.default_rng(seed).integers(0, num.size, size=(resamples, num.size))
    ratios = num[idx].sum(axis=1) / den[idx].sum(axis=1)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(ratios, [tail, 100 - tail])
    return Interval(float(num.sum() / den.sum()), float(low), float(high))
