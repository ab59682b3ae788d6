"""bench.learn on known data: steps to target, the summary, the report (its seed bootstrap:
test_bench_stats)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tunix_mcjax.bench import learn
from tunix_mcjax.bench.learn import SeedResult, steps_to_target


def test_steps_to_target_counts_steps_trained_at_the_first_window_that_clears():
    acc = [0.0] * 20 + [1.0] * 20
    # The mean of steps n-9..n first reaches 0.9 when 9 of the last 10 steps are right: n = 29.
    assert steps_to_target(acc, 0.9, 10) == 29
    assert steps_to_target(acc, 1.0, 10) == 30
    assert steps_to_target(acc, 0.5, 1) == 21
    assert steps_to_target([0.9] * 10, 0.9, 10) == 10  # equality counts despite fp rounding


def test_steps_to_target_is_none_when_never_reached_or_too_short():
    assert steps_to_target([0.8] * 50, 0.9, 10) is None
    assert steps_to_target([1.0] * 9, 0.9, 10) is None
    with pytest.raises(ValueError, match="window"):
        steps_to_target([1.0], 0.9, 0)


def _curve(reach_at: int | None, steps: int = 40) -> list[float]:
    """Accuracy 0 until step `reach_at - 10`, then 1 (so the 10-step mean hits 0.9 at
    reach_at - 1 and 1.0 at reach_at); never rises with None."""
    if reach_at is None:
        return [0.5] * steps
    return [0.0] * (reach_at - 10) + [1.0] * (steps - reach_at + 10)


def _results(tunix: list[int | None], mcjax: list[int | None]) -> list[SeedResult]:
    out = []
    for arm, reach in (("tunix", tunix), ("mcjax", mcjax)):
        for seed, n in enumerate(reach):
            acc = _curve(n)
            out.append(SeedResult(arm, seed, acc, [a * 2 for a in acc]))
    return out


def test_summarize_reports_steps_rewards_and_the_ratio():
    rep = learn.summarize(_results([21, 31], [31, 31]), target=1.0, window=10)
    assert rep["arms"]["tunix"]["steps_to_target"] == [21, 31]
    assert rep["arms"]["mcjax"]["steps_to_target"] == [31, 31]
    assert rep["arms"]["tunix"]["final_reward_mean"] == pytest.approx(2.0)
    assert rep["ratio_mcjax_over_tunix"]["point"] == pytest.approx(62 / 52)
    assert rep["within_bound"] and not rep["censored"]


def test_summarize_charges_an_unreached_seed_the_budget_and_flags_it():
    rep = learn.summarize(_results([21, 21], [21, None]), target=0.9, window=10)
    assert rep["arms"]["mcjax"]["steps_to_target"] == [20, None]
    assert rep["arms"]["mcjax"]["reached"] == 1
    assert rep["ratio_mcjax_over_tunix"]["point"] == pytest.approx((20 + 40) / 40)
    assert rep["censored"] and not rep["within_bound"]


def test_summarize_refuses_a_missing_run():
    results = [r for r in _results([21, 21], [21, 21]) if (r.arm, r.seed) != ("mcjax", 1)]
    with pytest.raises(ValueError, match="mcjax-s1"):
        learn.summarize(results, target=0.9, window=10)


def test_report_markdown_and_plot(tmp_path):
    results = _results([21, 31], [31, None])
    rep = learn.summarize(results, target=0.9, window=10)
    rep["context"] = {"task": "next_digit", "steps": 40, "hosts": 2, "devices_per_host": 2}
    md = learn.markdown(rep)
    assert "| tunix | 20 | 30 | 25.0 | 2/2 |" in md
    assert "| mcjax | 30 | - | 35.0 | 1/2 |" in md
    assert "NOT within" in md and "censored" in md
    png = learn.plot(results, rep, tmp_path / "curves.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_both_arms_get_the_same_checkpoint_seed_and_recipe():
    extra = ["dataset_name=next_digit", "load_parameters_path=/ckpt"]
    tunix = learn.LearnRun("tunix", 3, 2, 2, 1).command(Path("r.yml"), Path("o"), extra)
    mcjax = learn.LearnRun("mcjax", 3, 2, 2, 1).command(Path("r.yml"), Path("o"), extra)
    assert tunix[1:3] == ["-m", "tunix_mcjax.bench.tunix_arm"]
    assert mcjax[1:3] == ["-m", "tunix_mcjax.launch"] and "--hosts" in mcjax
    for cmd in (tunix, mcjax):
        assert "r.yml" in cmd and "seed=3" in cmd and "load_parameters_path=/ckpt" in cmd
