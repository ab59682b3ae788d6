"""rl_runtime=mcjax_da joining a real multi-node Ray cluster: raylets on this machine, each
offering one host unit, as `ray start --resources='{"mcjax_host": 1}'` nodes would.

The launcher joins it through RAY_ADDRESS and takes every host it offers (no --hosts). On three
nodes: one trainer and two rollout actors. A fourth node joins, then: two trainer nodes (one
jax.distributed group, its coordinator on the first trainer's node address) and two rollout
nodes, one actor per node. Last, as it takes a node away, a killed raylet ends a run, naming the
actor it held. Beside it all, a run given no address starts a cluster of its own.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
import ray
from ray.cluster_utils import Cluster

from tests.mp import REPO, TINY, read_jsonl
from tunix_mcjax.config import load_config
from tunix_mcjax.runtime import da_cluster, disaggregated
from tunix_mcjax.runtime.ray_cluster import HOST_RESOURCE, ActorFailed

NODE_ARGS = {"num_cpus": 1, "resources": {HOST_RESOURCE: 1}, "object_store_memory": 96 << 20}


# A multi-raylet Ray cluster and runs over it, minutes in all: the slow tier. The default suite
# runs DA on the local cluster (tests/test_disaggregated.py, tests/test_da_staleness.py).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_nodes():
    """(cluster, {node id: node}): a head and two worker raylets, one host unit each; the
    `four_nodes` fixture adds a third worker."""
    cluster = Cluster(initialize_head=True, head_node_args={**NODE_ARGS,
                                                           "include_dashboard": False})
    nodes = {n.node_id: n for n in [cluster.head_node] + [cluster.add_node(**NODE_ARGS)
                                                          for _ in range(2)]}
    cluster.wait_for_nodes()
    yield cluster, nodes
    cluster.shutdown()


@pytest.fixture(scope="module")
def four_nodes(ray_nodes):
    """`ray_nodes` with a third worker raylet joined."""
    cluster, nodes = ray_nodes
    node = cluster.add_node(**NODE_ARGS)
    nodes[node.node_id] = node
    cluster.wait_for_nodes()
    return cluster, nodes


def run_demo(address: str, tmp_path, fraction: float) -> tuple[dict, list[dict]]:
    """The launcher on the cluster at `address`, taking every host it offers (no --hosts):
    the demo for 10 steps; (summary, step records)."""
    proc = subprocess.run(
        [sys.executable, "-m", "tunix_mcjax.launch", "--devices-per-host", "1",
         "recipes/cpu/demo.yml", "rl_runtime=mcjax_da", f"rl_trainer_hosts_fraction={fraction}",
         "steps=10", "rl_async_metrics_export=true", f"base_output_directory={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=500,
        env={**os.environ, "PYTHONPATH": str(REPO), "RAY_ADDRESS": address})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return (json.loads((tmp_path / "demo" / "summary.json").read_text()),
            read_jsonl(tmp_path / "demo" / "steps.jsonl"))


def check_demo(summary: dict, records: list[dict], node_ids: set[str], trainers: int) -> None:
    """One actor per node, every node used, staleness exactly 1 from step 1, reward rising;
    every step's record arrives through O1's background export."""
    rollouts = len(node_ids) - trainers
    assert summary["hosts"] == len(node_ids) and summary["steps"] == 10
    assert [r["step"] for r in records] == list(range(10))
    assert (summary["trainer_hosts"], summary["rollout_hosts"]) == (trainers, rollouts)
    assert sorted(summary["actor_nodes"]) == sorted(
        [f"rollout-{r}" for r in range(rollouts)] + [f"trainer-{t}" for t in range(trainers)])
    assert set(summary["actor_nodes"].values()) == node_ids
    for r in records:
        assert len(set(r["trainer_nodes"] + r["rollout_nodes"])) == len(node_ids)
        assert r["trainer_processes"] == trainers
        assert r["staleness"] == ([0] * rollouts if r["step"] == 0 else [1] * rollouts)
    reward = [r["reward_mean"] for r in records]
    print("reward by step:", np.round(reward, 3).tolist())
    assert np.mean(reward[-3:]) > np.mean(reward[:3])
    assert np.polyfit(np.arange(10), reward, 1)[0] > 0


def test_demo_across_three_nodes_one_trainer_two_rollouts(tmp_path, ray_nodes):
    """1 trainer node and 2 rollout nodes: a share that is not one of the paper's splits."""
    cluster, nodes = ray_nodes
    check_demo(*run_demo(cluster.address, tmp_path, 0.33), set(nodes), trainers=1)


def test_without_an_address_a_run_starts_its_own_cluster_beside_a_running_one(ray_nodes):
    """With neither rl_ray_address nor RAY_ADDRESS, `connect` starts a local cluster of the
    run's host units, although one runs here (a bare ray.init would find and join it)."""
    code = ("import json, sys, ray; from tunix_mcjax.config import load_config; "
            "from tunix_mcjax.runtime import ray_cluster; "
            "assert ray_cluster.connect(load_config(None, json.loads(sys.argv[1])), 2); "
            "print(json.dumps(ray.cluster_resources())); ray.shutdown()")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(TINY)], capture_output=True,
                          text=True, timeout=180, env={**env, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])[HOST_RESOURCE] == 2
    assert all(node.remaining_processes_alive() for node in ray_nodes[1].values())


def test_demo_across_four_nodes_one_actor_each_staleness_one_reward_rises(tmp_path, four_nodes):
    """Two trainer nodes: one jax.distributed group, its coordinator on a node address."""
    cluster, nodes = four_nodes
    check_demo(*run_demo(cluster.address, tmp_path, 0.5), set(nodes), trainers=2)


def test_a_killed_rollout_raylet_ends_the_run_named_within_60s(tmp_path, four_nodes):
    cluster, nodes = four_nodes
    ray.init(address=cluster.address, configure_logging=False)
    try:
        cfg = load_config(None, [*TINY, "batch_size=4", "num_generations=4", "steps=8",
                                 "rl_runtime=mcjax_da", f"base_output_directory={tmp_path}"])
        actors = da_cluster.Cluster.start(cfg, hosts=len(nodes), devices_per_host=1)
        try:
            steps = disaggregated.training_steps(cfg, actors)
            # A rollout away from the driver's own raylet, which Ray will not remove.
            driver = ray.get_runtime_context().get_node_id()
            rollout_nodes = next(steps).values["rollout_nodes"]
            victim = max(i for i, node in enumerate(rollout_nodes) if node != driver)
            cluster.remove_node(nodes[rollout_nodes[victim]], allow_graceful=False)
            t0 = time.monotonic()
            with pytest.raises(ActorFailed) as failed:
                for _ in steps:
                    pass
            assert time.monotonic() - t0 < 60
            # The actor and the node it held (said dead when Ray has declared it so by then:
            # the actor's calls often fail first), which is the node removed.
            node = rollout_nodes[victim]
            assert re.fullmatch(f"rollout-{victim}: its process died during .* on node {node}"
                                "(, a dead node \\(its raylet is gone\\))?",
                                str(failed.value), re.DOTALL), str(failed.value)
            assert failed.value.name == f"rollout-{victim}" and failed.value.died
            while any(n["NodeID"] == node and n["Alive"] for n in ray.nodes()):
                assert time.monotonic() - t0 < 60, f"node {node} still alive"
                time.sleep(1)
        finally:
            actors.close()
    finally:
        ray.shutdown()
