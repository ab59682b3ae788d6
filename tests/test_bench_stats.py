"""Bootstrap statistics of the benchmark protocol, on data whose answer is known."""

import numpy as np
import pytest

from tunix_mcjax.bench import stats


def test_ratio_point_is_ratio_of_medians():
    got = stats.bootstrap_ratio([2.0, 4.0, 6.0], [1.0, 2.0, 3.0], resamples=200)
    assert got.point == pytest.approx(2.0)
    assert got.low <= got.point <= got.high


def test_interval_covers_true_ratio_most_of_the_time():
    true_ratio, hits, trials = 2.5, 0, 100
    rng = np.random.default_rng(7)
    for trial in range(trials):
        ours = rng.lognormal(mean=0.0, sigma=0.1, size=20)
        theirs = true_ratio * rng.lognormal(mean=0.0, sigma=0.1, size=20)
        ci = stats.bootstrap_ratio(theirs, ours, resamples=1000, seed=trial)
        hits += ci.low <= true_ratio <= ci.high
    assert hits >= 85  # nominal 95%; percentile bootstrap of medians runs a little short


def test_same_seed_same_interval_other_seed_differs():
    rng = np.random.default_rng(0)
    a, b = rng.uniform(1, 2, 20), rng.uniform(0.5, 1, 20)
    first = stats.bootstrap_ratio(a, b, seed=3)
    assert stats.bootstrap_ratio(a, b, seed=3) == first
    assert stats.bootstrap_ratio(a, b, seed=4) != first


def test_default_uses_10000_resamples_and_95_percent():
    assert stats.RESAMPLES == 10_000 and stats.CONFIDENCE == 0.95
    rng = np.random.default_rng(1)
    wide = stats.bootstrap_ratio(rng.uniform(1, 3, 20), rng.uniform(1, 3, 20))
    narrow = stats.bootstrap_ratio(rng.uniform(1, 3, 20), rng.uniform(1, 3, 20),
                                   confidence=0.5)
    assert wide.high - wide.low > narrow.high - narrow.low


def test_constant_samples_give_a_zero_width_interval():
    got = stats.bootstrap_ratio([3.0] * 20, [1.5] * 20)
    assert (got.point, got.low, got.high) == (2.0, 2.0, 2.0)
    single = stats.bootstrap_ratio([3.0], [2.0])
    assert (single.low, single.high) == (1.5, 1.5)


@pytest.mark.parametrize("bad", [[], [1.0, 0.0], [1.0, float("nan")], [[1.0, 2.0]]])
def test_degenerate_samples_are_rejected(bad):
    with pytest.raises(ValueError):
        stats.bootstrap_ratio(bad, [1.0, 2.0])


def test_per_token_divides_step_by_step():
    np.testing.assert_allclose(stats.per_token([2.0, 3.0], [100, 300]), [0.02, 0.01])
    with pytest.raises(ValueError, match="token counts"):
        stats.per_token([1.0, 2.0], [10])


def test_faster_verdict_needs_lower_bound_above_margin():
    assert stats.is_faster(stats.Interval(2.0, 1.2, 2.5))
    assert not stats.is_faster(stats.Interval(2.0, 1.1, 2.5))


def test_launch_bootstrap_counts_launch_to_launch_drift():
    """Three launches at different machine loads: resampling steps as independent hides the
    launch effect; resampling launches (then blocks) shows it as a wider interval."""
    rng = np.random.default_rng(2)
    arm = [level + 0.01 * rng.standard_normal(20) for level in (1.0, 1.1, 1.2)]
    ref = [1.0 + 0.01 * rng.standard_normal(20) for _ in range(3)]
    by_launch = stats.launch_bootstrap_ratio(arm, ref, resamples=2000)
    by_step = stats.bootstrap_ratio(np.concatenate(arm), np.concatenate(ref), resamples=2000)
    assert by_launch.point == pytest.approx(by_step.point)
    assert by_launch.high - by_launch.low > 3 * (by_step.high - by_step.low)
    assert by_launch.low < 1.02 and by_launch.high > 1.18  # one launch drawn thrice


def test_block_bootstrap_is_deterministic_and_keeps_constant_samples_exact():
    a = [np.linspace(1, 2, 20)]
    first = stats.launch_bootstrap_ratio(a, [np.full(20, 0.5)], resamples=300, seed=5)
    assert first == stats.launch_bootstrap_ratio(a, [np.full(20, 0.5)], resamples=300, seed=5)
    got = stats.launch_bootstrap_ratio([[3.0] * 7, [3.0] * 9], [[1.5] * 8], resamples=50)
    assert (got.point, got.low, got.high) == (2.0, 2.0, 2.0)
    with pytest.raises(ValueError):
        stats.launch_bootstrap_ratio([], [[1.0]])


def _numpy_median_interval(values, resamples, seed, confidence=0.95):
    """The percentile bootstrap of a median, written out in plain NumPy."""
    x = np.asarray(values, dtype=np.float64)
    idx = np.random.default_rng(seed).integers(0, x.size, size=(resamples, x.size))
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(np.median(x[idx], axis=1), [tail, 100 - tail])
    return np.median(x), low, high


@pytest.mark.parametrize("seed", [0, 3])
def test_bootstrap_median_matches_a_numpy_reference(seed):
    values = np.random.default_rng(11).lognormal(size=15)
    got = stats.bootstrap_median(values, resamples=4000, seed=seed)
    np.testing.assert_allclose(got.as_tuple(), _numpy_median_interval(values, 4000, seed))
    assert got.low < got.point < got.high


def test_bootstrap_median_on_two_values_has_the_exact_percentiles():
    # Two values, resampled: both low (median 1, p=1/4), one each (2, p=1/2), both high (3).
    got = stats.bootstrap_median([1.0, 3.0], resamples=20_000)
    assert (got.point, got.low, got.high) == (2.0, 1.0, 3.0)
    assert stats.bootstrap_median([1.0, 3.0], confidence=0.4).as_tuple() == (2.0, 2.0, 2.0)


def test_bootstrap_median_refuses_bad_samples():
    with pytest.raises(ValueError, match="non-empty"):
        stats.bootstrap_median([])
    with pytest.raises(ValueError, match="resamples"):
        stats.bootstrap_median([1.0], resamples=0)


def test_seed_bootstrap_ratio_on_two_seeds_has_the_exact_percentiles():
    # Resampling 2 seeds: both seed 0 (ratio 2, p=1/4), one each (3, p=1/2), both seed 1 (4).
    got = stats.seed_bootstrap_ratio([2.0, 4.0], [1.0, 1.0], resamples=20_000)
    assert got.point == pytest.approx(3.0)
    assert (got.low, got.high) == (2.0, 4.0)


def test_seed_bootstrap_resamples_seeds_paired():
    den = np.array([50.0, 80.0, 120.0, 70.0, 95.0])
    got = stats.seed_bootstrap_ratio(1.5 * den, den)
    # Paired resampling keeps every resample's ratio at 1.5; independent resampling would not.
    assert got.point == pytest.approx(1.5)
    assert got.low == pytest.approx(1.5) and got.high == pytest.approx(1.5)


def test_seed_bootstrap_is_deterministic_and_brackets_the_point():
    rng = np.random.default_rng(3)
    num, den = rng.uniform(60, 120, 7), rng.uniform(60, 120, 7)
    a = stats.seed_bootstrap_ratio(num, den, seed=1)
    b = stats.seed_bootstrap_ratio(num, den, seed=1)
    assert a == b
    assert a.low < a.point < a.high
    assert a.point == pytest.approx(num.sum() / den.sum())


@pytest.mark.parametrize("num,den,match", [
    ([1.0, 2.0], [1.0], "paired"),
    ([], [], "paired"),
    ([1.0], [0.0], "denominator"),
    ([np.nan], [1.0], "finite"),
])
def test_seed_bootstrap_rejects_bad_samples(num, den, match):
    with pytest.raises(ValueError, match=match):
        stats.seed_bootstrap_ratio(num, den)


def test_seed_bootstrap_ratio_matches_a_numpy_reference():
    rng = np.random.default_rng(5)
    num, den = rng.uniform(10, 40, 6), rng.uniform(10, 40, 6)
    idx = np.random.default_rng(2).integers(0, 6, size=(3000, 6))
    ratios = num[idx].sum(axis=1) / den[idx].sum(axis=1)
    want = (num.sum() / den.sum(), *np.percentile(ratios, [2.5, 97.5]))
    got = stats.seed_bootstrap_ratio(num, den, resamples=3000, seed=2)
    np.testing.assert_allclose(got.as_tuple(), want)


def _medians_drawn_one_resample_at_a_time(launches, block, resamples, rng):
    """The bootstrap as written before its medians were batched: the committed results'
    intervals came from these draws."""
    out = np.empty(resamples)
    for r in range(resamples):
        drawn = []
        for j in rng.integers(0, len(launches), size=len(launches)):
            x = launches[j]
            starts = rng.integers(0, x.size, size=-(-x.size // block))
            drawn.append(x[(starts[:, None] + np.arange(block)) % x.size].ravel()[:x.size])
        out[r] = np.median(np.concatenate(drawn))
    return out


@pytest.mark.parametrize("sizes,block", [((60,), 5), ((11,), 3), ((7,), 7),
                                         ((60, 57, 3), 5), ((20, 20), 1)])
def test_block_medians_draw_as_one_resample_at_a_time(sizes, block):
    data = np.random.default_rng(1)
    launches = [data.random(n) for n in sizes]
    want = _medians_drawn_one_resample_at_a_time(launches, block, 500,
                                                 np.random.default_rng(4))
    got = stats.resampled_medians(launches, block, 500, np.random.default_rng(4))
    np.testing.assert_array_equal(got, want)
