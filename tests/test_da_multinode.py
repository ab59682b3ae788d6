"""rl_runtime=mcjax_da joining a real multi-node Ray cluster: four raylets on this machine, each
offering one host unit, as `ray start --resources='{"mcjax_host": 1}'` nodes would.

The launcher joins it through RAY_ADDRESS and takes every host it offers (no --hosts): two
trainer nodes (one jax.distributed group, its coordinator on the first trainer's node address)
and two rollout nodes, one actor per node. Then (last, as it takes a node away) a killed
raylet ends a run, naming the actor it held.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import ray
from ray.cluster_utils import Cluster

from tests.mp import REPO, TINY, read_jsonl
from tunix_mcjax.config import load_config
from tunix_mcjax.runtime import disaggregated
from tunix_mcjax.runtime.ray_cluster import HOST_RESOURCE, ActorFailed

NODES = 4


@pytest.fixture(scope="module")
def ray_nodes():
    """(cluster address, node ids): a head and three worker raylets, one host unit each."""
    node_args = {"num_cpus": 1, "resources": {HOST_RESOURCE: 1},
                 "object_store_memory": 96 << 20}
    cluster = Cluster(initialize_head=True, head_node_args={**node_args,
                                                           "include_dashboard": False})
    nodes = [cluster.head_node] + [cluster.add_node(**node_args) for _ in range(NODES - 1)]
    cluster.wait_for_nodes()
    yield cluster, {n.node_id: n for n in nodes}
    cluster.shutdown()


def test_demo_across_four_nodes_one_actor_each_staleness_one_reward_rises(tmp_path, ray_nodes):
    address, node_ids = ray_nodes[0].address, set(ray_nodes[1])
    proc = subprocess.run(
        [sys.executable, "-m", "tunix_mcjax.launch", "--devices-per-host", "1",
         "recipes/cpu/demo.yml", "rl_runtime=mcjax_da", "rl_trainer_hosts_fraction=0.5",
         "steps=10", f"base_output_directory={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=500,
        env={**os.environ, "PYTHONPATH": str(REPO), "RAY_ADDRESS": address})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    records = read_jsonl(tmp_path / "demo" / "steps.jsonl")
    assert summary["hosts"] == NODES and summary["steps"] == 10
    assert summary["trainer_hosts"] == summary["rollout_hosts"] == 2
    # One actor per node, every node of the cluster used.
    assert sorted(summary["actor_nodes"]) == ["rollout-0", "rollout-1", "trainer-0", "trainer-1"]
    assert set(summary["actor_nodes"].values()) == node_ids
    for r in records:
        assert len(set(r["trainer_nodes"] + r["rollout_nodes"])) == NODES
        assert r["trainer_processes"] == 2
        assert r["staleness"] == ([0, 0] if r["step"] == 0 else [1, 1])
    reward = [r["reward_mean"] for r in records]
    print("reward by step:", np.round(reward, 3).tolist())
    assert np.mean(reward[-3:]) > np.mean(reward[:3])
    assert np.polyfit(np.arange(10), reward, 1)[0] > 0


@pytest.mark.slow  # about 65 s; the 4-node demo above stays in the default suite
def test_a_killed_rollout_raylet_ends_the_run_named_within_60s(tmp_path, ray_nodes):
    cluster, nodes = ray_nodes
    ray.init(address=cluster.address, configure_logging=False)
    try:
        cfg = load_config(None, [*TINY, "batch_size=4", "num_generations=4", "steps=8",
                                 "rl_runtime=mcjax_da", f"base_output_directory={tmp_path}"])
        actors = disaggregated.Cluster.start(cfg, hosts=NODES, devices_per_host=1)
        try:
            steps = disaggregated.training_steps(cfg, actors)
            victim = next(steps)["rollout_nodes"][1]
            cluster.remove_node(nodes[victim], allow_graceful=False)
            t0 = time.monotonic()
            with pytest.raises(ActorFailed, match="rollout-1: its process died"):
                for _ in steps:
                    pass
            assert time.monotonic() - t0 < 60
        finally:
            actors.close()
    finally:
        ray.shutdown()
