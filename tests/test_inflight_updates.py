"""In-flight weight updates (`in_flight_weight_updates`) under rl_runtime=mcjax_da at
staleness k = 2, on a real three-raylet Ray cluster (one trainer node, two rollout nodes,
shared by the module's runs): each batch decodes its first slice with the version it was
issued with, then the next one, sequences in progress going on with it. Every token's version
reaches the trainer, which checks each is at most k updates old. Plus the token bookkeeping
and the refused configurations, without a cluster."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
from ray.cluster_utils import Cluster

from tests.mp import REPO, TINY, read_jsonl, run_stopping_at
from tests.test_disaggregated import LEARNED, final_params
from tunix_mcjax.config import ConfigError, load_config
from tunix_mcjax.runtime import in_flight
from tunix_mcjax.runtime.ray_cluster import HOST_RESOURCE

NODE_ARGS = {"num_cpus": 1, "resources": {HOST_RESOURCE: 1}, "object_store_memory": 96 << 20}
# The demo with 4 new tokens (its reward reads the first), so a sequence is in progress after
# the first iteration (prefill and one decode step) and the swap lands inside completions.
IN_FLIGHT = ["rl_runtime=mcjax_da", "rl_trainer_hosts_fraction=0.33", "off_policy_steps=2",
             "in_flight_weight_updates=true", "in_flight_update_iterations=1",
             "max_target_length=8", "learning_rate=0.01"]


@pytest.fixture(scope="module")
def three_nodes():
    """The address of a head and two worker raylets, one host unit each."""
    cluster = Cluster(initialize_head=True, head_node_args={**NODE_ARGS,
                                                           "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(**NODE_ARGS)
    cluster.wait_for_nodes()
    yield cluster.address
    cluster.shutdown()


def launch(address: str, out, *keys, stop_at: str | None = None) -> tuple[int, str]:
    """The launcher on the cluster at `address` (every host it offers) running the demo with
    `IN_FLIGHT`; with `stop_at`, SIGTERM to the driver once that progress line is out.
    (exit code, output)."""
    return run_stopping_at(
        [sys.executable, "-m", "tunix_mcjax.launch", "--devices-per-host", "1",
         "recipes/cpu/demo.yml", *IN_FLIGHT, f"base_output_directory={out}", *keys],
        {**os.environ, "PYTHONPATH": str(REPO), "RAY_ADDRESS": address}, 400, stop_at)


def check_tokens(records: list[dict]) -> None:
    """Every token is counted at its staleness, none past 2: batches 0 and 1 (the pipeline
    fill, no update running when issued) are whole at staleness 0 and 1; from batch 2 on,
    tokens before the swap are 2 stale and after it 1, and some completions hold both."""
    for r in records:
        counts = r["token_staleness"]
        assert len(counts) == 3 and sum(counts) == r["tokens_generated"], r
        if r["step"] < 2:
            assert counts[r["step"]] == r["tokens_generated"] and r["mixed_completions"] == 0
        else:
            assert counts[0] == 0 and counts[1] > 0 and counts[2] > 0, r
            assert r["mixed_completions"] > 0, r
    assert [r["staleness"] for r in records] == [[0, 0], [1, 1]] + [[2, 2]] * (len(records) - 2)


def test_k2_with_in_flight_updates_ten_steps_on_three_nodes_reward_rises(tmp_path,
                                                                          three_nodes):
    code, text = launch(three_nodes, tmp_path, "steps=10")
    assert code == 0, text[-4000:]
    records = read_jsonl(tmp_path / "demo" / "steps.jsonl")
    assert [r["step"] for r in records] == list(range(10))
    assert all(len(set(r["rollout_nodes"] + r["trainer_nodes"])) == 3 for r in records)
    check_tokens(records)
    reward = [r["reward_mean"] for r in records]
    print("reward by step:", np.round(reward, 3).tolist(),
          "tokens by staleness:", [r["token_staleness"] for r in records])
    assert np.mean(reward[-3:]) > np.mean(reward[:3])
    assert np.polyfit(np.arange(10), reward, 1)[0] > 0


@pytest.mark.slow  # three 8-step launches
def test_k2_in_flight_sigterm_then_a_rerun_equals_an_uninterrupted_run(tmp_path, three_nodes):
    """The checkpoint after step 3 keeps batches 4 and 5 (each with its tokens' versions, the
    save waits for them); the rerun issues batch 6 on, each taking the version of the update
    running at its issue, as the uninterrupted run does: records and final params within
    1e-6."""
    keys = [*TINY, "batch_size=4", "num_generations=4", "steps=8",
            "enable_checkpointing=true", "checkpoint_period=1000"]
    code, text = launch(three_nodes, tmp_path / "stopped", *keys, stop_at="step    3 |")
    assert code == 143, text[-3000:]
    code, text = launch(three_nodes, tmp_path / "stopped", *keys)
    assert code == 0 and "resumed from" in text, text[-3000:]
    code, text = launch(three_nodes, tmp_path / "whole", *keys)
    assert code == 0, text[-3000:]
    resumed = read_jsonl(tmp_path / "stopped" / "demo" / "steps.jsonl")
    whole = read_jsonl(tmp_path / "whole" / "demo" / "steps.jsonl")
    assert [r["step"] for r in resumed] == [r["step"] for r in whole] == list(range(8))
    for a, b in zip(resumed, whole, strict=True):
        for key in (*LEARNED, "token_staleness", "mixed_completions"):
            assert np.allclose(a[key], b[key], rtol=0, atol=1e-6), (a["step"], key, a[key], b[key])
    params = final_params(tmp_path / "stopped" / "demo")
    want = final_params(tmp_path / "whole" / "demo")
    assert params.keys() == want.keys() and all(
        np.allclose(params[k], want[k], rtol=0, atol=1e-6) for k in want)
    check_tokens(whole)


def test_token_versions_split_at_the_swap_and_staleness_past_k_is_refused():
    assert in_flight.token_versions(4, 2, 3, 4).tolist() == [3, 3, 4, 4]
    assert in_flight.token_versions(3, None, 3, 4).tolist() == [3, 3, 3]  # done before it
    assert in_flight.token_versions(2, 0, 3, 4).tolist() == [4, 4]  # not started before it

    class Batch:
        def __init__(self, *versions):
            self.token_versions = tuple(np.array(v) for v in versions)

    got = in_flight.token_staleness([Batch([3, 3, 4], [4, 4]), Batch([3])], 5, 2)
    assert got == {"token_staleness": [0, 3, 3], "mixed_completions": 1}
    with pytest.raises(RuntimeError, match="update 6 got tokens 3 versions stale.*"
                                           "off_policy_steps=2"):
        in_flight.token_staleness([Batch([3, 4])], 6, 2)
    assert in_flight.token_staleness([Batch()], 6, 2) == {}


def test_in_flight_keys_are_refused_outside_da_without_a_session_and_at_k0(tmp_path):
    demo, base = REPO / "recipes/cpu/demo.yml", [f"base_output_directory={tmp_path}"]
    cfg = load_config(demo, [*base, *IN_FLIGHT])
    assert cfg.in_flight_weight_updates and cfg.in_flight_update_iterations == 1
    with pytest.raises(ConfigError, match="in_flight_weight_updates.*configure "
                                          "rl_runtime=mcjax_da"):
        load_config(demo, [*base, "in_flight_weight_updates=true"])
    with pytest.raises(ConfigError, match="rollout_engine=vllm cannot here"):
        load_config(demo, [*base, *IN_FLIGHT, "rollout_engine=vllm",
                                 "rl_publish_weights_single_call=true"])
    with pytest.raises(ConfigError, match="set off_policy_steps >= 1"):
        load_config(demo, [*base, *IN_FLIGHT, "off_policy_steps=0"])
    with pytest.raises(ConfigError, match="in_flight_update_iterations sets when"):
        load_config(demo, [*base, "rl_runtime=mcjax_da", "in_flight_update_iterations=4"])
