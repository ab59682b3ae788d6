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
