"""rl_runtime=mcjax_da at staleness k = off_policy_steps other than the paper's 1, on a real
local Ray cluster (one per module, as tests/test_disaggregated.py's): k batches in flight, each
generated with the version published at its start and weighted by the engine's logprobs; the
checkpoint keeps the queue; a restarted rollout actor regenerates its share of every batch in
flight. k = 1 is tests/test_disaggregated.py, unchanged."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tests.mp import REPO
from tests.ray_local import local_ray  # noqa: F401  (the module's cluster)
from tests.test_disaggregated import (
    config,
    da_launch,
    ends_with_death,
    kill_process,
    resumed_equals_whole,
)
from tunix_mcjax import hostenv
from tunix_mcjax.config import ConfigError, load_config
from tunix_mcjax.runtime.da_cluster import Cluster
from tunix_mcjax.runtime.disaggregated import training_steps
from tunix_mcjax.runtime.ray_actors import TrainerWorker

# Rewards that differ within every group (each completion's mean character code), so the
# advantages, and with them the ratio's effect on the loss, are not zero.
VARIED = "reward_functions=tests.workers.text_rewards:char_codes"


def restored_trainer(cfg, monkeypatch) -> TrainerWorker:
    """The trainer of `cfg`'s run in this process, a group of one, restored from the newest
    checkpoint in its run directory."""
    monkeypatch.setenv(hostenv.COORDINATOR, "127.0.0.1:0")
    monkeypatch.setenv(hostenv.NUM_PROCESSES, "1")
    monkeypatch.setenv(hostenv.PROCESS_ID, "0")
    return TrainerWorker(cfg, 0)


@pytest.mark.slow  # a 10-step DA run with a restart; k0 stays in the default suite
def test_k2_two_batches_in_flight_a_restart_regenerates_both_and_the_loss_is_off_policy(
        tmp_path, monkeypatch, capsys):
    """off_policy_steps=2: batch t is generated with v_max(t-2, 0), so staleness is 0, 1, then
    2 on every batch. A killed rollout actor is replaced, and its share of the batch being
    collected and of the later one in flight is regenerated, each with its own version; killed
    again, restarts are spent and the run ends, naming it. The checkpoint after step 2 keeps
    batches 3 and 4 (v1, v2); the trainer restored from it, trained on batch 3, gives the run's
    step-3 loss: the ratio against the engine's logprobs of v1, two updates old."""
    cfg = config(tmp_path, "steps=10", "off_policy_steps=2", "rl_rollout_restarts=1",
                 "grpo_beta=0.0", VARIED, "enable_checkpointing=true", "checkpoint_period=3")
    cluster = Cluster.start(cfg, hosts=2, devices_per_host=1)
    try:
        steps = training_steps(cfg, cluster)
        records = [next(steps).values]
        assert [b.step for b in cluster.queue] == [1, 2]  # batch 2, with v0, queued behind 1
        kill_process(cluster.rollouts[0])
        records += [next(steps).values for _ in range(4)]
        kill_process(cluster.rollouts[0])
        ends_with_death(steps, "rollout-0")
    finally:
        cluster.close()
    assert re.search(r"restarting it \(1 of rl_rollout_restarts=1\) to regenerate step [1-4] "
                     r"and the 1 later batches in flight", capsys.readouterr().out)
    assert [r["step"] for r in records] == list(range(5))
    assert [r["batch_versions"] for r in records] == [[0], [0], [0], [1], [2]]
    assert [r["staleness"] for r in records] == [[0], [1], [2], [2], [2]]
    assert [r["trained_on"] for r in records] == list(range(5))
    assert records[-1]["rollout_restarts"] == 1
    rewards = [r["reward_mean"] for r in records]
    assert all(np.isfinite(rewards)) and min(rewards) > 0, rewards

    trainer = restored_trainer(cfg, monkeypatch)  # from the save after step 2, the newest
    resumed = trainer.resumed()
    assert resumed["start_step"] == 3 and trainer.version == 3
    kept = resumed["in_flight"]
    assert [[r.policy_version for r in rollouts] for rollouts, _ in kept] == [[1], [2]]
    got = trainer.train(3, *kept[0][0])
    print("loss by step:", [r["loss"] for r in records], "restored step 3:", got["loss"])
    assert got["trained_on"] == 3 and got["batch_versions"] == [1]
    assert got["loss"] == pytest.approx(records[3]["loss"], rel=1e-5, abs=1e-7)
    # With grpo_beta=0 a ratio of 1 makes the loss -mean(advantages), 0 in every group: so it
    # is at step 0, on-policy up to the engine's and the trainer's rounding.
    assert abs(records[0]["loss"]) < 1e-5 < 1e-4 < abs(got["loss"])


def test_k0_is_on_policy_without_overlap(tmp_path):
    """off_policy_steps=0: batch t is generated with v_t, after update t-1 is published. The
    run's jax_cache_dir holds the programs of both kinds of actor: the trainers' update and the
    rollouts' decode loop."""
    cache = tmp_path / "jax-cache"
    cfg = config(tmp_path, "steps=3", "off_policy_steps=0", f"jax_cache_dir={cache}")
    cluster = Cluster.start(cfg, hosts=2, devices_per_host=1)
    try:
        records = [r.values for r in training_steps(cfg, cluster)]
    finally:
        cluster.close()
    assert [r["batch_versions"] for r in records] == [[0], [1], [2]]
    assert [r["staleness"] for r in records] == [[0]] * 3
    assert all(np.isfinite(r["reward_mean"]) for r in records)
    programs = {p.name.split("-", 1)[0] for p in cache.iterdir()}  # jit_<name>-<hash>-cache
    assert {"jit__update", "jit_program"} <= programs, sorted(programs)


def test_off_policy_steps_is_the_da_bound_and_agentic_only_in_the_colocated_runtime(tmp_path):
    assert config(tmp_path, "off_policy_steps=4").off_policy_steps == 4
    assert config(tmp_path).off_policy_steps == 1  # the paper's schedule
    with pytest.raises(ConfigError, match="off_policy_steps must be"):
        config(tmp_path, "off_policy_steps=-1")
    with pytest.raises(ConfigError, match=r"agentic rollouts only in the colocated runtime "
                       r".*as the staleness bound k, to rl_runtime=mcjax_da"):
        load_config(REPO / "recipes/cpu/demo.yml", ["off_policy_steps=2"])


@pytest.mark.bench  # about 3 min: three driver launches; k=1 resume is in the slow tier
def test_k2_sigterm_then_a_rerun_equals_an_uninterrupted_run(tmp_path):
    """At k = 2 the checkpoint keeps both batches in flight; the rerun trains on them, so its
    records and final params equal an uninterrupted run's, staleness 2 from step 2 on."""
    keys = ["enable_checkpointing=true", "checkpoint_period=1000", "steps=8",
            "off_policy_steps=2"]
    code, text = da_launch(tmp_path / "stopped", *keys, stop_at="step    3 |")
    assert code == 143, text[-3000:]
    code, text = da_launch(tmp_path / "stopped", *keys)
    assert code == 0 and "resumed from" in text, text[-3000:]
    code, text = da_launch(tmp_path / "whole", *keys)
    assert code == 0, text[-3000:]
    whole = resumed_equals_whole(tmp_path, steps=8)
    assert [r["staleness"] for r in whole] == [[0], [1]] + [[2]] * 6
