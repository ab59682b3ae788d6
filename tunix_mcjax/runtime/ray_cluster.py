"""The Ray side of the disaggregated mode: the cluster (joined, or a local one for
development), one host per actor placed by a placement group, one JAX process per actor, and
waits that name the actor that failed.

Hosts are the nodes that offer the custom resource `mcjax_host` (`ray start ...
--resources='{"mcjax_host": 1}'`). The placement group has one bundle per host, STRICT_SPREAD
over those nodes, so no two actors share a host; a local development cluster is one node that
offers H of them, and its bundles are packed on it. Bundles 0..T-1 are the trainers (bundle 0's
node runs their jax.distributed coordinator), the rest the rollouts.

Every wait has a deadline. When an actor's process dies, Ray fails its pending calls at once, so
a dead actor ends a wait within seconds with its name; a stuck one ends it at the deadline.
Actors are created with `max_restarts=0`: restarts are the driver's decision (it must re-issue
the lost batch), not Ray's.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

import tunix_mcjax
from tunix_mcjax.config import Config, ConfigError
from tunix_mcjax.hostenv import free_port, host_env

PACKAGE_ROOT = str(Path(tunix_mcjax.__file__).resolve().parents[1])
DEATH_GRACE_S = 5.0  # how long a failed call waits to see whether a peer's death caused it
HOST_RESOURCE = "mcjax_host"  # one unit per host node; `ray start --resources`
CONNECT_TIMEOUT_S = 10.0  # how long the head's address may take to answer
ACCELERATORS = ("TPU", "GPU")  # a host's chips go to its actor: Ray hides unrequested ones


class ActorFailed(RuntimeError):
    """An actor died, raised, or did not answer in time; `name` says which."""

    def __init__(self, name: str, what: str, died: bool):
        super().__init__(f"{name}: {what}")
        self.name, self.died = name, died


def connect(cfg: Config, hosts: int) -> bool:
    """Joins the cluster at rl_ray_address (else RAY_ADDRESS), or starts a local one of one node
    offering `hosts` host units, even beside a Ray cluster already running on this machine
    (which a bare `ray.init` would join); nothing when this process is already connected. True
    when it connected (the caller disconnects; a joined cluster keeps running)."""
    if ray.is_initialized():
        return False
    address = cfg.rl_ray_address or os.environ.get("RAY_ADDRESS", "")
    if address:
        _check_reachable(address)
        ray.init(address=address, configure_logging=False, log_to_driver=True)
    else:
        ray.init(address="local", num_cpus=hosts, resources={HOST_RESOURCE: hosts},
                 object_store_memory=cfg.rl_ray_object_store_mb << 20,
                 include_dashboard=False, configure_logging=False, log_to_driver=True)
    return True


def _check_reachable(address: str) -> None:
    """Fails fast, naming the keys, when nothing listens at `address` (ray.init would retry
    for minutes); "auto" is Ray's own local lookup."""
    if address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"rl_ray_address / RAY_ADDRESS={address}: no Ray head answers there within "
            f"{CONNECT_TIMEOUT_S:.0f}s ({e}). Start it (ray start --head --port=6379 on the "
            "head node), fix the address (HEAD_IP:6379 or ray://HEAD_IP:10001), or unset both "
            "to start a local cluster") from e


def host_nodes() -> list[dict]:
    """The alive nodes that offer host units."""
    return [n for n in ray.nodes() if n["Alive"] and n["Resources"].get(HOST_RESOURCE, 0) >= 1]


def cluster_hosts() -> int:
    """How many hosts the connected cluster offers (nodes with host units; a local development
    node counts its units)."""
    nodes = host_nodes()
    if len(nodes) == 1:
        return int(nodes[0]["Resources"][HOST_RESOURCE])
    return len(nodes)


@dataclasses.dataclass
class Placement:
    """One bundle per host: where each actor goes, and what it asks for there."""

    group: PlacementGroup
    bundle: dict[str, float]  # what every actor reserves: a CPU, a host unit, its accelerators
    spread: bool  # one node per bundle (a real cluster) or all on one node (development)
    # {actor id (hex): the node id of its bundle when it was spawned}, for naming dead nodes.
    actor_nodes: dict[str, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def create(cls, hosts: int, timeout_s: float) -> Placement:
        nodes = host_nodes()
        spread = len(nodes) > 1
        offered = len(nodes) if spread else sum(int(n["Resources"][HOST_RESOURCE]) for n in nodes)
        if offered < hosts:
            raise ConfigError(
                f"the Ray cluster offers {offered} hosts (nodes with the '{HOST_RESOURCE}' "
                f"resource) but the run needs {hosts}: start every host's raylet with ray start "
                f"... --resources='{{\"{HOST_RESOURCE}\": 1}}', or run with --hosts {offered}")
        bundle: dict[str, float] = {"CPU": 1, HOST_RESOURCE: 1}
        for kind in ACCELERATORS:
            chips = min(n["Resources"].get(kind, 0) for n in nodes)
            if spread and chips >= 1:
                bundle[kind] = int(chips)
        group = placement_group([dict(bundle)] * hosts,
                                strategy="STRICT_SPREAD" if spread else "PACK")
        try:
            ray.get(group.ready(), timeout=timeout_s)
        except GetTimeoutError as e:
            remove_placement_group(group)
            raise ActorFailed("placement", f"{hosts} bundles of {bundle} were not placed within "
                              f"{timeout_s:.0f}s: the cluster's free resources do not hold them "
                              "(ray status shows them)", died=False) from e
        return cls(group, bundle, spread)

    def strategy(self, index: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=index)

    def coordinator(self, timeout_s: float) -> tuple[str, int]:
        """(address, port) for the trainers' jax.distributed coordinator: bundle 0's node as
        the other nodes reach it (Ray's node address), a port free there now."""
        @ray.remote(num_cpus=1)
        def here() -> tuple[str, int]:
            return ray.util.get_node_ip_address(), free_port("0.0.0.0")

        return tuple(ray.get(here.options(scheduling_strategy=self.strategy(0)).remote(),
                             timeout=timeout_s))

    def remove(self) -> None:
        remove_placement_group(self.group)

    def bundle_node(self, index: int) -> str:
        """The node id bundle `index` is placed on now ("" while Ray reschedules it)."""
        return placement_group_table(self.group).get("bundles_to_node_id", {}).get(index, "")


def actor_env(devices: int, group_rank: int = 0, group_size: int = 1,
              coordinator: tuple[str, int] = ("127.0.0.1", 0)) -> dict[str, str]:
    """The environment of one actor process: on CPU `devices` forced host-platform devices,
    and its place in its jax.distributed group (hostenv's keys; a group of one, a rollout
    actor or a lone trainer, initializes nothing)."""
    address, port = coordinator
    env = host_env(group_rank, group_size, devices, port, address)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    return {k: v for k, v in env.items() if os.environ.get(k) != v}


def spawn(cls: type, placement: Placement, index: int, env: dict[str, str], *args: Any
          ) -> ray.actor.ActorHandle:
    """One actor of `cls` in its own worker process with `env`, on bundle `index`'s host."""
    bundle = placement.bundle
    remote = ray.remote(max_restarts=0, max_task_retries=0)(cls)
    actor = remote.options(
        num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
        resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
        scheduling_strategy=placement.strategy(index),
        runtime_env={"env_vars": env}).remote(*args)
    placement.actor_nodes[actor._actor_id.hex()] = placement.bundle_node(index)
    return actor


def kill(actors: list[ray.actor.ActorHandle]) -> None:
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except ValueError:  # already gone
            pass


def wait_all(calls: dict[str, ray.ObjectRef], timeout_s: float, what: str,
             actor_nodes: dict[str, str] | None = None) -> dict[str, Any]:
    """{actor name: value} of every call. The first call that fails (the actor died or raised)
    raises `ActorFailed` naming its actor, without waiting for the rest; so does the deadline.
    A dead actor's error also names its node (`Placement.actor_nodes`) and whether Ray has
    declared that node dead."""
    actor_nodes = actor_nodes or {}
    pending = {ref: name for name, ref in calls.items()}
    out: dict[str, Any] = {}
    deadline = time.monotonic() + timeout_s
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ActorFailed(", ".join(sorted(pending.values())),
                              f"no answer to {what} within {timeout_s:.0f}s (stuck); raise "
                              "collective_timeout_s or compile_timeout_s if it is just slow",
                              died=False)
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=min(left, 1.0))
        for ref in ready:
            name = pending.pop(ref)
            try:
                out[name] = ray.get(ref, timeout=max(left, 1.0))
            except RayActorError as e:
                raise ActorFailed(name, f"its process died during {what} ({type(e).__name__})"
                                  f"{_where(e, actor_nodes)}", died=True) from e
            except RayTaskError as e:
                # A peer's death often surfaces first as this one's failed collective: name the
                # dead one when there is one.
                raise _dead_among(pending, what, actor_nodes) or ActorFailed(
                    name, f"{what} raised {e.cause!r}", died=False) from e
            except GetTimeoutError as e:
                raise ActorFailed(name, f"{what} did not return", died=False) from e
    return out


def _where(error: RayActorError, actor_nodes: dict[str, str]) -> str:
    """" on node ID" for a dead actor whose node is known, with ", a dead node" once Ray has
    declared that node dead (its raylet gone); "" when the node is unknown."""
    node = actor_nodes.get(error.actor_id or "", "")
    if not node:
        return ""
    dead = any(n["NodeID"] == node and not n["Alive"] for n in ray.nodes())
    return f" on node {node}{', a dead node (its raylet is gone)' if dead else ''}"


def _dead_among(pending: dict[ray.ObjectRef, str], what: str, actor_nodes: dict[str, str],
                grace_s: float = DEATH_GRACE_S) -> ActorFailed | None:
    """The first of the `pending` calls whose actor died, waiting up to `grace_s` for Ray to
    notice; None when none did."""
    ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=grace_s)
    for ref in ready:
        try:
            ray.get(ref, timeout=1.0)
        except RayActorError as e:
            return ActorFailed(pending[ref], f"its process died during {what}"
                               f"{_where(e, actor_nodes)}", died=True)
        except Exception:  # noqa: BLE001 - only a death is looked for here
            continue
    return None
