"""Benchmark report: rollout imbalance per arm and across an ablation, output-length
predictability, and the tables that show them."""

import numpy as np
import pytest

from tunix_mcjax.bench import report
from tunix_mcjax.bench.equal_work import RunLog

STEPS, FIRST_SCORED = 40, 20


def _log(name: str, generate_max: float, step_s: float, seed: int) -> RunLog:
    """Two hosts whose mean generate time is 1 s; the slowest takes `generate_max` (jittered)."""
    rng = np.random.default_rng(seed)
    records = []
    for step in range(STEPS):
        jitter = float(rng.uniform(0.0, 0.02))
        records.append({
            "step": step, "step_s": step_s + jitter, "compiled": step == 0,
            "phase_s": {"generate": generate_max + jitter, "train": 0.5},
            "generate_max_s": generate_max + jitter, "generate_mean_s": 1.0,
            "prompt_indices": [step % 20], "prompt_tokens_mean": 20.0,
            "completion_len_mean": 50.0, "completion_len_max": 64, "truncated_frac": 0.0,
            "tokens_generated": 6400, "reward_mean": 0.0,
        })
    return RunLog(name, tuple(records))


def test_imbalance_is_slowest_over_mean_host_on_scored_steps():
    log = _log("mcjax", generate_max=1.5, step_s=2.0, seed=0)
    imbalance = report.rollout_imbalance(log, FIRST_SCORED)
    assert len(imbalance) == STEPS - FIRST_SCORED
    expected = [r["generate_max_s"] / r["generate_mean_s"] for r in log.records[FIRST_SCORED:]]
    np.testing.assert_allclose(imbalance, expected)


def test_imbalance_is_absent_without_per_host_generate_times():
    records = tuple({k: v for k, v in r.items() if not k.startswith("generate_")}
                    for r in _log("tunix", 1.0, 2.0, 0).records)
    assert report.rollout_imbalance(RunLog("tunix", records), FIRST_SCORED) is None


def test_ablation_reports_the_imbalance_ratio_and_its_table_column():
    base = report.ArmRun("mcjax", 2, (_log("mcjax", 1.5, 2.0, 0),), ({},))
    balanced = report.ArmRun("mcjax+O3x", 2, (_log("mcjax+O3x", 1.1, 1.6, 1),), ({},))
    rep = report.build_report([base, balanced], "mcjax", FIRST_SCORED, ablation=True,
                              context={"profile": "p", "devices_per_host": 1})
    assert rep["arms"]["mcjax"]["rollout_imbalance"] == pytest.approx(1.51, abs=0.011)
    assert rep["arms"]["mcjax+O3x"]["rollout_imbalance"] == pytest.approx(1.11, abs=0.011)
    imbalance = rep["ratios"]["mcjax_over_mcjax+O3x"]["imbalance"]
    assert imbalance["median"] == pytest.approx(1.51 / 1.11, rel=0.02)
    assert 1 < imbalance["ci_low"] <= imbalance["median"] <= imbalance["ci_high"]
    text = report.markdown(rep)
    assert "rollout max/mean" in text
    assert f"| {report._fmt_ci(imbalance)} |" in text


def _host_records(first: dict[int, float], second: dict[int, float]) -> list[dict]:
    """Host records of two passes over the same prompts, one prompt per record."""
    return [{"step": step, "local_prompt_indices": [i], "completion_len_by_prompt": [length]}
            for step, lengths in ((0, first), (FIRST_SCORED, second))
            for i, length in lengths.items()]


def test_output_length_correlation_tells_repeating_lengths_from_unrelated_ones():
    rng = np.random.default_rng(0)
    first = {i: float(rng.uniform(10, 200)) for i in range(50)}
    repeat = {i: length + float(rng.normal(0, 5)) for i, length in first.items()}
    unrelated = {i: float(rng.uniform(10, 200)) for i in range(50)}
    assert report.output_length_correlation(_host_records(first, repeat), FIRST_SCORED) > 0.95
    assert abs(report.output_length_correlation(_host_records(first, unrelated),
                                                FIRST_SCORED)) < 0.4


def test_output_length_correlation_needs_prompts_seen_twice():
    with pytest.raises(ValueError, match="both passes"):
        report.output_length_correlation(_host_records({0: 5.0, 1: 6.0}, {2: 7.0}),
                                         FIRST_SCORED)


def test_decode_token_imbalance_is_busiest_host_over_mean_on_second_pass():
    records = [
        {"step": 0, "completion_tokens": 900.0}, {"step": 0, "completion_tokens": 100.0},
        {"step": FIRST_SCORED, "completion_tokens": 300.0},
        {"step": FIRST_SCORED, "completion_tokens": 100.0},
        {"step": FIRST_SCORED + 1, "completion_tokens": 200.0},
        {"step": FIRST_SCORED + 1, "completion_tokens": 200.0},
        {"step": FIRST_SCORED + 2, "completion_tokens": 250.0},
        {"step": FIRST_SCORED + 2, "completion_tokens": 150.0},
    ]
    # Second-pass steps give 1.5, 1.0 and 1.25; the first pass (1.8) does not count.
    assert report.decode_token_imbalance(records, FIRST_SCORED) == pytest.approx(1.25)
