"""bench.staleness (learning at DA staleness k = 1 and 4, in-flight updates) and the arm table it
shares with bench.quant (bench.learn_arms): the plan, the arms' keys, and the report on
synthetic runs (no launches)."""

from __future__ import annotations

import argparse
import json

import pytest

from tunix_mcjax.bench import learn_arms, mismatch, staleness
from tunix_mcjax.bench.learn import SeedResult
from tunix_mcjax.config import load_config

BENCH = staleness.BENCH


def test_plan_pairs_k1_k4_and_in_flight_seed_by_seed_on_one_trainer_and_one_rollout_host():
    cells = learn_arms.plan(BENCH, 2, hosts=2, devices_per_host=2)
    assert [c.name for c in cells] == [
        f"demo-{arm}-da-tistoken-s{s}" for s in (0, 1)
        for arm in ("k1", "k4", "k4-if", "k1-mis", "k4-if-mis", "k1-halflr")]
    k1, k4, k4if, k1mis, k4ifmis, k1half = cells[:6]
    assert k1.arm == staleness.BASE == BENCH.base
    assert "rl_runtime=mcjax_da" in k1.overrides() and "seed=0" in k1.overrides()
    assert k4.overrides() == [*k1.overrides()[:-1], "off_policy_steps=4"]
    assert k4if.overrides()[-3:] == ["off_policy_steps=4", "in_flight_weight_updates=true",
                                     "in_flight_update_iterations=1"]
    assert k1mis.overrides() == [*k1.overrides(), "rollout_rs=token"]
    assert k4ifmis.overrides() == [*k4if.overrides(), "rollout_rs=token"]
    assert k1half.overrides() == [*k1.overrides(), "learning_rate=0.0015"]
    for cell in cells[:6]:
        assert mismatch.config_refusal(cell, ["steps=150"]) == ""
        cfg = load_config(mismatch.DEMO, cell.overrides())
        assert (cfg.rl_runtime, cfg.sampler_is, cfg.rollout_weight_dtype) == (
            "mcjax_da", "token", "bfloat16")
        assert learn_arms.da_split(cell) == (1, 1)
    assert (load_config(mismatch.DEMO, k4.overrides()).off_policy_steps,
            load_config(mismatch.DEMO, k4if.overrides()).in_flight_weight_updates,
            load_config(mismatch.DEMO, k1half.overrides()).learning_rate) == (4, True, 0.0015)
    assert [c.name for c in learn_arms.plan(BENCH, 1, 2, 2, ["k4"])] == ["demo-k4-da-tistoken-s0"]


def test_staleness_counts_batches_by_their_oldest_version_and_sums_tokens():
    records = [{"staleness": [0]}, {"staleness": [1, 2]}, {"staleness": [2]},
               {"staleness": [2], "token_staleness": [0, 3, 5], "mixed_completions": 1},
               {"staleness": [2], "token_staleness": [1, 4], "mixed_completions": 2}]
    got = learn_arms.staleness(records)
    assert got == {"batches": [1, 0, 4], "tokens": [1, 7, 5], "mixed_completions": 3}
    assert learn_arms.staleness([{"accuracy": 1.0}]) == {}  # CO records none
    assert learn_arms.add_counts(got, {"batches": [2, 1]}) == {
        "batches": [3, 1, 4], "tokens": [1, 7, 5], "mixed_completions": 3}


def _records(accuracy: list[float], k: int, in_flight: bool) -> list[dict]:
    recs = []
    for step, acc in enumerate(accuracy):
        rec = {"step": step, "accuracy": acc, "reward_mean": acc, "sampler_is_weight_mean": 1.0,
               "staleness": [min(step, k)], **{m: 0.01 * (step + 1) for m in mismatch.METRICS}}
        if in_flight:
            rec.update(token_staleness=[0] * (k - 1) + [2, 6], mixed_completions=1)
        recs.append(rec)
    return recs


def test_report_on_synthetic_runs_gives_each_arm_over_k1_the_bar_and_the_staleness(tmp_path):
    fast = [0.0, 0.5, 1.0, 1.0, 1.0, 1.0]  # 2-step trailing mean reaches 0.9 at step 4
    slow = [0.0, 0.0, 0.5, 1.0, 1.0, 0.8]  # ... at step 5, ends at 0.9 (< the bar)
    never = [0.0, 0.0, 0.5, 0.5, 0.5, 0.5]  # never: charged at the budget (censored)
    accuracy = {"k1": (fast, fast), "k4": (slow, fast), "k4+if": (slow, slow),
                "k1+mis": (fast, never), "k4+if+mis": (fast, slow), "k1+halflr": (slow, fast)}
    cells = learn_arms.plan(BENCH, 2, hosts=2, devices_per_host=2)
    for cell in cells:
        run = tmp_path / "runs" / cell.name
        run.mkdir(parents=True)
        recs = _records(accuracy[cell.arm][cell.seed], 1 if cell.arm.startswith("k1") else 4,
                        "+if" in cell.arm)
        (run / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        (run / "bench_meta.json").write_text(json.dumps(
            {"code": "abc1234", "wall_s": 1.0, "loadavg_1m_before": 1.0,
             "loadavg_1m_after": 2.0}))
    args = argparse.Namespace(target=0.9, window=2, bar=0.95, hosts=2, devices_per_host=2,
                              seeds=2)
    rep = learn_arms.build_report(BENCH, cells, tmp_path, args, steps=6)
    learning = rep["learning"]
    assert learning["pairs"] == [["k4", "k1"], ["k4+if", "k1"], ["k1+mis", "k1"],
                                 ["k4+if+mis", "k1"], ["k1+halflr", "k1"]]
    assert learning["ratio_k4_over_k1"]["median"] == pytest.approx(9 / 8)
    assert learning["ratio_k4+if_over_k1"]["median"] == pytest.approx(10 / 8)
    assert learning["ratio_k4+if+mis_over_k1"]["median"] == pytest.approx(9 / 8)
    arms = learning["arms"]
    assert arms["k4"]["steps_to_target"] == [5, 4]
    assert [arms[a]["bar_met_count"] for a in BENCH.arms] == [2, 1, 0, 1, 1, 1]
    assert arms["k1"]["staleness"] == {"batches": [2, 10]}
    assert arms["k4"]["staleness"] == {"batches": [2, 2, 2, 2, 4]}
    assert arms["k4+if"]["staleness"]["tokens"] == [0, 0, 0, 24, 72]
    assert arms["k4"]["loadavg_1m"] == [[1.0, 2.0], [1.0, 2.0]]
    assert (rep["context"]["trainer_hosts"], rep["context"]["rollout_hosts"]) == (1, 1)
    text = learn_arms.markdown(BENCH, rep)
    assert "DA (1 trainer host, 1 rollout host)" in text
    assert "| k4 | 5, 4 | " in text
    assert "k4 / k1, summed steps to target over paired seeds: 1.125" in text
    ratios = [line for line in text.splitlines() if "summed steps to target" in line]
    assert [line.endswith("(censored).") for line in ratios] == [False, False, True, False,
                                                                 False]
    assert ("seeds met: k1 2/2; k4 1/2; k4+if 0/2; k1+mis 1/2; k4+if+mis 1/2; "
            "k1+halflr 1/2.") in text
    assert "- k4: batches by staleness 0: 2 (16.7%), 1: 2 (16.7%)" in text
    assert ("- k4+if: batches by staleness 0: 2 (16.7%), 1: 2 (16.7%), 2: 2 (16.7%), "
            "3: 2 (16.7%), 4: 4 (33.3%); completion tokens by staleness 3: 24 (25.0%), "
            "4: 72 (75.0%); 12 completions span two versions") in text


def test_arms_without_the_base_report_no_ratio_and_unknown_arms_are_refused():
    only = {"k4": [SeedResult("k4", 0, [1.0, 1.0], [1.0, 1.0])]}
    rep = learn_arms.summary(only, staleness.BASE, target=0.9, window=2, bar=0.95)
    assert rep["pairs"] == [] and rep["arms"]["k4"]["steps_to_target"] == [2]
    with pytest.raises(SystemExit):
        learn_arms.parse_args(BENCH, staleness.__doc__, ["--arms", "k2"])
    args = learn_arms.parse_args(BENCH, staleness.__doc__, ["--arms", "k4", "--steps", "10"])
    assert (args.arms, args.steps, str(args.out)) == (["k4"], 10,
                                                      "bench_results/staleness/learn")
