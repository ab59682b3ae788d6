"""rl_runtime=mcjax_da on a real local Ray cluster (one per module): trainer actors in one
jax.distributed group, rollout actors with their own engines, weights through the object store.

The driver runs in the test process (`disaggregated.training_steps` yields each applied step's
record), so a test can kill an actor's process between steps, as a crash would.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import ray

from tests.mp import REPO, TINY, read_jsonl, run_stopping_at
from tests.ray_local import local_ray  # noqa: F401  (the module's cluster)
from tunix_mcjax import launch
from tunix_mcjax.config import ConfigError, load_config
from tunix_mcjax.runtime import disaggregated
from tunix_mcjax.runtime.da_cluster import Cluster
from tunix_mcjax.runtime.disaggregated import training_steps
from tunix_mcjax.runtime.ray_cluster import ActorFailed

SMALL = [*TINY, "batch_size=4", "num_generations=4", "rl_runtime=mcjax_da"]
DEAD_ACTOR_BUDGET_S = 60
OVERFLOWS = "reward_functions=tests.workers.bad_rewards:overflows_after_first_step"


def config(tmp_path, *overrides, recipe=None):
    return load_config(recipe, [*SMALL, f"base_output_directory={tmp_path}", *overrides])


def ends_with_death(steps, actor: str) -> ActorFailed:
    """Drives `steps` to the failure a killed actor causes: ActorFailed naming the actor's
    process, raised within DEAD_ACTOR_BUDGET_S."""
    t0 = time.monotonic()
    with pytest.raises(ActorFailed, match=f"{actor}: its process died") as failed:
        for _ in steps:
            pass
    assert time.monotonic() - t0 < DEAD_ACTOR_BUDGET_S
    return failed.value


def kill_process(actor) -> None:
    os.kill(ray.get(actor.pid.remote(), timeout=60), signal.SIGKILL)


def test_two_trainers_one_group_staleness_one_and_one_put_per_publish(tmp_path):
    """4 hosts at 0.5: two trainer processes in one jax.distributed group, two rollouts; then a
    killed trainer (not the leader, whose peer then waits in a collective) ends the run."""
    cfg = config(tmp_path, "steps=8")
    cluster = Cluster.start(cfg, hosts=4, devices_per_host=1)
    try:
        steps = training_steps(cfg, cluster)
        records = [next(steps).values for _ in range(4)]
        for r in records:
            t = r["step"]
            assert r["trainer_processes"] == 2 and r["trained_on"] == t
            # Batch t was generated with v_{t-1} (batch 0, the pipeline fill, with v0) and
            # applied to v_t: exactly one step stale from step 1 on.
            assert r["batch_versions"] == [max(t - 1, 0)] * 2
            assert r["staleness"] == ([0, 0] if t == 0 else [1, 1])
            # One ray.put per publish: v0 and one per update so far, by the leader only.
            assert r["puts"] == t + 2
            # Both rollout actors fetched the same object for their version.
            assert len(set(r["weights_objects"])) == 1
            assert len(r["prompt_indices"]) == cfg.batch_size
        objects = [r["weights_objects"][0] for r in records]
        assert objects[0] == objects[1] and len(set(objects[1:])) == 3  # v0, v0, v1, v2
        kill_process(cluster.trainers[1])
        ends_with_death(steps, "trainer-1")
    finally:
        cluster.close()


@pytest.mark.bench  # a learning run; test_da_multinode (slow) runs it on four raylets
def test_demo_on_half_the_hosts_learns_in_ten_steps(tmp_path):
    cfg = load_config(REPO / "recipes/cpu/demo.yml", [
        "rl_runtime=mcjax_da", "rl_trainer_hosts_fraction=0.5", "steps=10",
        "rl_async_metrics_export=true", f"base_output_directory={tmp_path}"])
    summary = disaggregated.run(cfg, hosts=2, devices_per_host=2)
    # O1: the driver's export hook writes on its background thread; every step arrives.
    steps = read_jsonl(tmp_path / "demo" / "steps.jsonl")
    assert [r["step"] for r in steps] == list(range(10))
    reward = [r["reward_mean"] for r in steps]
    print("reward by step:", np.round(reward, 3).tolist())
    assert summary["steps"] == 10 and summary["trainer_hosts"] == summary["rollout_hosts"] == 1
    assert np.mean(reward[-3:]) > np.mean(reward[:3])
    assert np.polyfit(np.arange(10), reward, 1)[0] > 0


@pytest.mark.slow  # a DA run; the colocated skip is in the default suite
def test_skipped_nonfinite_update_publishes_nothing_new(tmp_path):
    """From step 1 on the rewards overflow and the loss is NaN: the skipped updates keep v1,
    put no new object, and the next batch is generated with v1's object again."""
    cfg = config(tmp_path, "steps=4", "max_nonfinite_steps=5", OVERFLOWS)
    cluster = Cluster.start(cfg, hosts=2, devices_per_host=1)
    try:
        records = [r.values for r in training_steps(cfg, cluster)]
    finally:
        cluster.close()
    assert [r["finite"] for r in records] == [1.0, 0.0, 0.0, 0.0]
    assert [r["nonfinite_steps"] for r in records] == [0, 1, 2, 3]
    assert [r["version"] for r in records] == [1, 1, 1, 1]
    assert [r["puts"] for r in records] == [2, 2, 2, 2]  # v0 and v1, nothing after
    assert [r["batch_versions"] for r in records] == [[0], [0], [1], [1]]
    objects = [r["weights_objects"][0] for r in records]
    assert objects[0] == objects[1] != objects[2] == objects[3]


# What a step record learned: equal between a resumed and an uninterrupted run (wall times,
# compile flags, Ray objects and nodes are not).
LEARNED = ("reward_mean", "accuracy", "prompt_indices", "completion_len_mean", "tokens_generated",
           "truncated_frac", "loss", "grad_norm", "kl", "trained_on", "version", "batch_versions",
           "staleness", "nonfinite_steps", "gc_frozen")


def da_launch(out, *keys, stop_at: str | None = None) -> tuple[int, str]:
    """The launcher on 2 hosts (its own local Ray cluster); with `stop_at`, SIGTERM to the driver
    once that progress line is out. (exit code, output)."""
    return run_stopping_at(
        [sys.executable, "-m", "tunix_mcjax.launch", "--hosts", "2", "--devices-per-host", "1",
         "recipes/cpu/demo.yml", *SMALL, f"base_output_directory={out}", *keys],
        {**os.environ, "PYTHONPATH": str(REPO)}, 180, stop_at)


def final_params(run_dir) -> dict:
    """The params of the run's newest checkpoint, as numpy, by path."""
    checkpoints = run_dir / "checkpoints"
    last = max(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())
    state = ocp.StandardCheckpointer().restore(checkpoints / str(last) / "default")
    return {jax.tree_util.keystr(path): np.asarray(x)
            for path, x in jax.tree_util.tree_flatten_with_path(state["params"])[0]}


@pytest.mark.slow  # about 3 min: three driver launches
def test_sigterm_after_step_5_then_a_rerun_equals_an_uninterrupted_run(tmp_path):
    """The real signal, through the launcher (which starts its own local Ray cluster): the
    trainers save the step just applied with the batch the rollouts were making for the next
    step, and exit 143. The same command again resumes from that checkpoint; its step records
    and final params equal an uninterrupted run's, staleness 1 throughout."""
    keys = ["enable_checkpointing=true", "checkpoint_period=1000", "steps=10",
            "rl_gc_freeze_after_warmup=true"]
    code, text = da_launch(tmp_path / "stopped", *keys, stop_at="step    5 |")
    assert code == 143, text[-3000:]
    checkpoints = tmp_path / "stopped" / "demo" / "checkpoints"
    saved = [p.name for p in checkpoints.iterdir()]
    assert len(saved) == 1 and f"stopped after step {saved[0]}; the last good checkpoint is " \
        f"step {saved[0]}" in text, text[-3000:]
    last = int(saved[0])
    assert 5 <= last < 9, text[-3000:]
    code, text = da_launch(tmp_path / "stopped", *keys)
    assert code == 0, text[-3000:]
    assert f"step {last}" in text and "resumed from" in text, text[-3000:]
    code, text = da_launch(tmp_path / "whole", *keys)
    assert code == 0, text[-3000:]

    whole = resumed_equals_whole(tmp_path, steps=10)
    assert [r["staleness"] for r in whole[1:]] == [[1]] * 9


def resumed_equals_whole(tmp_path, steps: int) -> list[dict]:
    """The resumed run (under stopped/) and the uninterrupted one (under whole/) recorded the
    same `steps` steps and ended with the same params, to 1e-6; returns the whole run's records."""
    resumed = read_jsonl(tmp_path / "stopped" / "demo" / "steps.jsonl")
    whole = read_jsonl(tmp_path / "whole" / "demo" / "steps.jsonl")
    assert [r["step"] for r in resumed] == [r["step"] for r in whole] == list(range(steps))
    for a, b in zip(resumed, whole, strict=True):
        for key in LEARNED:
            assert np.allclose(a[key], b[key], rtol=0, atol=1e-6), (a["step"], key, a[key], b[key])
    params = final_params(tmp_path / "stopped" / "demo")
    want = final_params(tmp_path / "whole" / "demo")
    assert params.keys() == want.keys() and all(
        np.allclose(params[k], want[k], rtol=0, atol=1e-6) for k in want)
    return whole


@pytest.mark.slow  # a DA run and a colocated run
def test_evaluation_on_the_rollout_actors_equals_the_colocated_evaluation(tmp_path):
    """Same config and weights (step 0's): the colocated mode on 2 hosts x 2 devices and DA's 2
    rollout actors (of 4 hosts x 2 devices) score the same held-out prompts with the same
    seeds; the driver's sum of the actors' results is the colocated eval record. The reward
    reads every sampled character, so an equal mean reward means equal samples."""
    keys = [*SMALL, "steps=1", "num_test_batches=4",
            "reward_functions=tests.workers.text_rewards:char_codes"]
    recipe = str(REPO / "recipes/cpu/demo.yml")
    co = launch.launch(recipe, [*keys, "rl_runtime=mcjax",
                                f"base_output_directory={tmp_path / 'co'}"], 2, 2)
    assert co == 0
    cfg = config(tmp_path / "da", *keys[len(SMALL):], recipe=recipe)
    summary = disaggregated.run(cfg, hosts=4, devices_per_host=2)
    co_eval = read_jsonl(tmp_path / "co" / cfg.run_name / "steps.jsonl")[0]["eval"]
    da_eval = read_jsonl(cfg.run_dir / "steps.jsonl")[0]["eval"]
    assert set(da_eval) == {"pre", "post"} and da_eval["post"]["steps_done"] == 1
    assert [e["when"] for e in summary["eval"]] == ["pre", "post"]
    co_pre, da_pre = co_eval["pre"], da_eval["pre"]
    print("colocated:", co_pre, "\ndisaggregated:", da_pre)
    assert (da_pre["total"], da_pre["steps_done"]) == (co_pre["total"], 0) == (16, 0)
    assert co_pre["mean_reward"] > 0
    assert da_pre["corr"] == co_pre["corr"]
    for key in ("accuracy", "partial_accuracy", "format_accuracy", "mean_reward"):
        assert abs(da_pre[key] - co_pre[key]) < 1e-6, key


def lora_publish_bytes(cfg) -> tuple[int, int]:
    """(bytes of the whole engine tree, of its LoRA adapters) for `cfg`'s model."""
    from flax import nnx
    from tunix.models.qwen3 import model as qwen3

    from tunix_mcjax import models
    from tunix_mcjax.publish import tree_bytes
    from tunix_mcjax.tokenizer import load_tokenizer
    from tunix_mcjax.train import lora

    vocab = len(load_tokenizer(cfg.tokenizer_type, cfg.tokenizer_path))
    mc = models.model_config(cfg, vocab, for_sampling=True)
    model = nnx.eval_shape(lambda: lora.add_adapters(qwen3.Qwen3(mc, rngs=nnx.Rngs(0))))
    return tree_bytes(nnx.state(model, nnx.Param)), tree_bytes(nnx.state(model, nnx.LoRAParam))


@pytest.mark.slow  # a DA run, killed twice
def test_dead_rollout_restarted_once_then_ends_the_run_within_60s(tmp_path):
    """rl_rollout_restarts=1: a killed rollout actor is replaced and its batch regenerated with
    the same version; killed again, restarts are spent and the run ends, naming it. With LoRA
    every publish after the first is the adapters alone, and the new actor fetches the base."""
    cfg = config(tmp_path, "steps=8", "rl_rollout_restarts=1", "lora_rank=4", "lora_alpha=8")
    whole, adapters = lora_publish_bytes(cfg)
    cluster = Cluster.start(cfg, hosts=2, devices_per_host=1)
    try:
        steps = training_steps(cfg, cluster)
        records = [next(steps).values]
        kill_process(cluster.rollouts[0])
        records += [next(steps).values for _ in range(3)]
        assert [r["step"] for r in records] == [0, 1, 2, 3]
        assert records[-1]["rollout_restarts"] == 1
        assert [r["staleness"] for r in records[1:]] == [[1]] * 3
        assert [r["batch_versions"] for r in records] == [[0], [0], [1], [2]]
        assert adapters < whole / 4
        # The new actor generated, so it loaded the base: an engine missing params refuses to.
        assert [r["publish_bytes"] for r in records] == [adapters] * 4
        assert all(np.isfinite(r["reward_mean"]) for r in records)
        kill_process(cluster.rollouts[0])
        assert ends_with_death(steps, "rollout-0").died
    finally:
        cluster.close()


@pytest.mark.parametrize(("overrides", "hosts", "message"), [
    (["rl_trainer_hosts_fraction=1.0"], 2, "must be between 0 and 1"),
    (["rl_trainer_hosts_fraction=0.3"], 3, r"0.9 trainer hosts.*Use 0.3333 \(1 of 3\)"),
    (["rl_trainer_hosts_fraction=0.25"], 2, "0.5 trainer hosts"),
    ([], 1, "needs at least 2 hosts"),
    (["rl_trainer_hosts_fraction=0.125", "batch_size=4"], 8, "without a prompt"),
    (["rl_trainer_hosts_fraction=0.25", "rl_balance_prompts_by_length=true"], 4,
     "does not divide by the 3 rollout"),
    (["profiler=xplane"], 2, "cannot honour profiler"),
    (["num_test_batches=1", "dataset_name=gsm8k"], 2, "dataset_name=gsm8k has none"),
])
def test_bad_splits_and_unsupported_keys_are_refused(tmp_path, overrides, hosts, message):
    with pytest.raises(ConfigError, match=message):
        config(tmp_path, *overrides).validate_topology(hosts, 1)


def test_da_keys_need_the_da_runtime():
    with pytest.raises(ConfigError, match="configure rl_runtime=mcjax_da"):
        load_config(None, ["rl_rollout_restarts=2"])


def test_one_process_of_a_cluster_launch_refuses_mcjax_da():
    proc = subprocess.run([sys.executable, "-m", "tunix_mcjax.run", "recipes/cpu/demo.yml",
                           "rl_runtime=mcjax_da"], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2
    assert "one Ray driver" in proc.stderr and "tunix_mcjax.launch" in proc.stderr


def test_an_unreachable_ray_address_is_refused_fast_naming_the_keys():
    proc = subprocess.run([sys.executable, "-m", "tunix_mcjax.launch", "recipes/cpu/demo.yml",
                           "rl_runtime=mcjax_da", "rl_ray_address=127.0.0.1:1"], cwd=REPO,
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "rl_ray_address / RAY_ADDRESS=127.0.0.1:1: no Ray head answers" in proc.stderr


def test_launcher_refuses_a_split_the_host_count_cannot_make(capsys):
    assert launch.main(["--hosts", "3", str(REPO / "recipes/cpu/demo.yml"),
                        "rl_runtime=mcjax_da"]) == 2
    assert "1.5 trainer hosts" in capsys.readouterr().err


def test_welch_interval_is_scipys_on_log_launch_values():
    from scipy import stats as st

    from tunix_mcjax.bench import stats

    da, co = [1.1, 1.25, 1.15], [1.0, 1.02, 0.97]
    ours = stats.welch_log_ratio(da, co)
    ci = st.ttest_ind(np.log(da), np.log(co), equal_var=False).confidence_interval(0.95)
    assert np.allclose([ours.low, ours.high], np.exp([ci.low, ci.high]))
    assert ours.point == pytest.approx(np.exp(np.log(da).mean() - np.log(co).mean()))
    with pytest.raises(ValueError, match="2 launches"):
        stats.welch_log_ratio([1.0], co)


def _arm(name: str, launches: list[list[float]], reward: float):
    from tunix_mcjax.bench.equal_work import RunLog
    from tunix_mcjax.bench.report import ArmRun

    phase = {p: 0.1 for p in ("admit", "generate", "reward", "pack", "train", "publish")}
    logs = tuple(RunLog(f"{name}-l{i}", tuple(
        {"step": s, "step_s": t, "compiled": False, "reward_mean": reward, "phase_s": phase}
        for s, t in enumerate(steps))) for i, steps in enumerate(launches))
    return ArmRun(name, 2, logs, ({},) * len(logs))


def test_da_verdict_needs_welch_and_the_paired_bootstrap_on_one_side():
    from tunix_mcjax.bench import da_compare

    rng = np.random.default_rng(0)
    co = [list(1.0 + 0.01 * rng.standard_normal(30)) for _ in range(3)]
    faster = _arm("mcjax_da-t25", [[0.8 * t for t in steps] for steps in co], 0.502)
    same = _arm("mcjax_da-t50", [steps[::-1] for steps in co], 0.51)
    out = da_compare.compare([_arm("mcjax", co, 0.5), faster, same], 10, {})["2"]["splits"]
    assert out["mcjax_da-t25"]["verdict"] == "DA faster"
    assert out["mcjax_da-t25"]["paired_step_bootstrap"]["median"] == pytest.approx(0.8)
    assert out["mcjax_da-t25"]["reward_within_band"]
    assert out["mcjax_da-t50"]["verdict"] == "none"
    assert not out["mcjax_da-t50"]["reward_within_band"]


def test_da_arms_name_their_share_staleness_and_in_flight_and_set_those_keys():
    from tunix_mcjax.bench import da_compare, step

    grid = step.DaGrid(shares=(0.5, 0.125), staleness=(1, 4), in_flight=(False, True))
    arms, ruled_out = step.mcjax_da_arms(4, 4, grid)
    assert arms == ["mcjax_da-t50", "mcjax_da-t50-if", "mcjax_da-t50-k4", "mcjax_da-t50-k4-if"]
    assert list(ruled_out) == ["mcjax_da-t12.5"]  # 0.5 of a trainer host at 4 hosts
    assert [da_compare.parse_arm(a) for a in arms] == [
        (0.5, 1, False), (0.5, 1, True), (0.5, 4, False), (0.5, 4, True)]
    assert step.Run("mcjax_da-t50-k4-if", 4, 1).overrides() == {
        "rl_runtime": "mcjax_da", "rl_trainer_hosts_fraction": 0.5, "off_policy_steps": 4,
        "in_flight_weight_updates": True}
    assert step.Run("mcjax_da-t25", 4, 1).overrides() == {
        "rl_runtime": "mcjax_da", "rl_trainer_hosts_fraction": 0.25}
