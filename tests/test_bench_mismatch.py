"""bench.mismatch's statistics against plain NumPy references (no launches)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tunix_mcjax.bench import mismatch
from tunix_mcjax.bench.learn import SeedResult


def test_step_median_is_the_median_with_an_interval_around_it():
    rng = np.random.default_rng(3)
    x = rng.normal(0.0, 1.0, size=60)  # signed values are allowed
    iv = mismatch.step_median(x, resamples=2000)
    assert iv.point == pytest.approx(float(np.median(x)))
    assert x.min() <= iv.low <= iv.point <= iv.high <= x.max()
    # A constant run has a zero-width interval; a run shorter than a block still works.
    const = mismatch.step_median([0.25] * 7, resamples=200)
    assert (const.point, const.low, const.high) == (0.25, 0.25, 0.25)
    assert mismatch.step_median([1.0, 3.0], resamples=200).point == 2.0
    with pytest.raises(ValueError, match="finite"):
        mismatch.step_median([1.0, np.nan])


def test_step_median_resamples_blocks_of_consecutive_steps():
    """A drifting step series: blocks keep the drift in each resample, so the interval is
    wider than the one that treats steps as independent."""
    x = np.arange(100.0)
    blocks = mismatch.step_median(x, block=50, resamples=4000)
    singles = mismatch.step_median(x, block=1, resamples=4000)
    assert blocks.point == singles.point == 49.5
    assert singles.high - singles.low < 0.6 * (blocks.high - blocks.low)


def test_mismatch_summary_per_metric():
    records = [{k: float(i * (j + 1)) for j, k in enumerate(mismatch.METRICS)}
               for i in range(5)]
    summary = mismatch.mismatch_summary(records)
    for j, key in enumerate(mismatch.METRICS):
        values = np.arange(5) * (j + 1.0)
        assert summary[key]["median"] == pytest.approx(np.median(values))
        assert summary[key]["max"] == pytest.approx(values.max())


def test_seed_band_is_the_seed_median_and_the_seed_bootstrap_percentiles():
    curves = np.array([[0.0, 0.1, 0.9], [0.2, 0.5, 1.0], [0.4, 0.6, 0.8]])
    med, low, high = mismatch.seed_band(curves, resamples=20000, seed=1)
    np.testing.assert_allclose(med, np.median(curves, axis=0))
    # Reference: every one of the 27 equally likely resamples of 3 seeds, weighted exactly.
    draws = np.array([np.median(curves[list(ix)], axis=0)
                      for ix in itertools.product(range(3), repeat=3)])
    for col in range(3):
        values = np.sort(draws[:, col])
        assert low[col] == pytest.approx(values[0], abs=1e-12)  # 2.5%: P(min) = 7/27
        assert high[col] == pytest.approx(values[-1], abs=1e-12)
    same = mismatch.seed_band(np.tile([[0.3, 0.7]], (4, 1)), resamples=100)
    np.testing.assert_array_equal(np.stack(same), [[0.3, 0.7]] * 3)


def test_moving_mean_is_the_trailing_mean():
    np.testing.assert_allclose(mismatch.moving_mean([1, 2, 3, 4, 5], 2), [1.5, 2.5, 3.5, 4.5])


def _result(arm: str, seed: int, accuracy: list[float]) -> SeedResult:
    return SeedResult(arm, seed, accuracy, [2 * a for a in accuracy])


def test_learning_summary_charges_misses_and_pairs_seeds():
    ramp = [0.0, 0.5, 1.0, 1.0, 1.0, 1.0]  # trailing 2-step mean reaches 0.9 at step 4
    slow = [0.0, 0.0, 0.0, 0.5, 1.0, 1.0]  # ... at step 6
    never = [0.0] * 6
    arms = {"none": [_result("none", 0, ramp), _result("none", 1, slow),
                     _result("none", 2, never)],
            "token": [_result("token", 0, ramp), _result("token", 1, ramp),
                      _result("token", 2, slow)]}
    rep = mismatch.learning_summary(arms, target=0.9, window=2)
    none, token = rep["arms"]["none"], rep["arms"]["token"]
    assert none["steps_to_target"] == [4, 6, None] and none["charged"] == [4.0, 6.0, 6.0]
    assert none["reached"] == 2 and rep["censored"]
    assert none["steps_to_target_median"]["median"] == 6.0
    assert token["steps_to_target_median"]["median"] == 4.0
    assert rep["ratio_token_over_none"]["median"] == pytest.approx(14 / 16)
    assert token["final_accuracy"] == [1.0, 1.0, 1.0]
    assert token["final_reward_median"] == pytest.approx(2.0)
    band = rep["curves"]["none"]
    assert band["first_step"] == 2
    np.testing.assert_allclose(band["median"], np.median(
        [mismatch.moving_mean(a, 2) for a in (ramp, slow, never)], axis=0))


def test_learning_summary_refuses_unpaired_arms():
    with pytest.raises(ValueError, match="same seeds"):
        mismatch.learning_summary({"none": [_result("none", 0, [1.0])],
                                   "token": [_result("token", 1, [1.0])]}, 0.9, 1)
    with pytest.raises(ValueError, match="'none' and 'token'"):
        mismatch.learning_summary({"none": [_result("none", 0, [1.0])]}, 0.9, 1)


def test_plan_names_each_cell_once():
    cells = mismatch.plan(mismatch.PARTS, seeds=3, hosts=2, devices_per_host=2)
    names = [c.name for c in cells]
    assert len(names) == len(set(names)) == 8 + 5 + 4 + 5  # bf16 jax seed 0 cells are shared
    assert "demo-jax-bf16-da-tistoken-s1" in names
    assert "demo-jax-bf16-co-s0" in names and "demo-jax-bf16-co-tistoken-s2" in names
    log = ("[host 0] host 0: config error: no maxtext\n[host 1] host 1: stopping in phase "
           "'build' because another host failed: host 0: config error: no maxtext\n")
    assert mismatch.launch_refusal(log) == "no maxtext"
    assert mismatch.launch_refusal("[host 0] host 0: ValueError: boom") == ""


def test_maxtext_float32_cells_leave_out_the_key_maxtext_lacks():
    keys = mismatch.Cell("maxtext", "maxtext", "float32", "mcjax").overrides()
    assert keys == ["rollout_engine=maxtext", "rl_runtime=mcjax"]
    assert "rollout_weight_dtype=bfloat16" in mismatch.Cell(
        "maxtext", "jax", "bfloat16", "mcjax").overrides()
    assert "rollout_weight_dtype=float32" in mismatch.Cell(
        "demo", "jax", "float32", "mcjax").overrides()
