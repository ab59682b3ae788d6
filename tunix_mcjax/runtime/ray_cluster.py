"""The Ray side of the disaggregated mode: a local cluster, one JAX process per actor, and
waits that name the actor that failed.

Every wait has a deadline. When an actor's process dies, Ray fails its pending calls at once, so
a dead actor ends a wait within seconds with its name; a stuck one ends it at the deadline.
Actors are created with `max_restarts=0`: restarts are the driver's decision (it must re-issue
the lost batch), not Ray's.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

import tunix_mcjax
from tunix_mcjax.launch import host_env

PACKAGE_ROOT = str(Path(tunix_mcjax.__file__).resolve().parents[1])
DEATH_GRACE_S = 5.0  # how long a failed call waits to see whether a peer's death caused it


class ActorFailed(RuntimeError):
    """An actor died, raised, or did not answer in time; `name` says which."""

    def __init__(self, name: str, what: str, died: bool):
        super().__init__(f"{name}: {what}")
        self.name, self.died = name, died


def start_local(num_cpus: int, object_store_mb: int) -> bool:
    """Starts a local Ray cluster (head node in this process's machine) unless this process is
    already connected to one; True when it started one (the caller shuts it down)."""
    if ray.is_initialized():
        return False
    ray.init(num_cpus=num_cpus, object_store_memory=object_store_mb << 20,
             include_dashboard=False, configure_logging=False, log_to_driver=True)
    return True


def actor_env(devices: int, group_rank: int = 0, group_size: int = 1,
              coordinator_port: int = 0) -> dict[str, str]:
    """The environment of one actor process: `devices` forced host-platform devices and its
    place in its jax.distributed group (launch.host_env's keys; a group of one, a rollout
    actor or a lone trainer, initializes nothing)."""
    env = host_env(group_rank, group_size, devices, coordinator_port)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    return {k: v for k, v in env.items() if os.environ.get(k) != v}


def spawn(cls: type, env: dict[str, str], *args: Any) -> ray.actor.ActorHandle:
    """One actor of `cls` in its own worker process with `env`."""
    remote = ray.remote(num_cpus=1, max_restarts=0, max_task_retries=0)(cls)
    return remote.options(runtime_env={"env_vars": env}).remote(*args)


def kill(actors: list[ray.actor.ActorHandle]) -> None:
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except ValueError:  # already gone
            pass


def wait_all(calls: dict[str, ray.ObjectRef], timeout_s: float, what: str) -> dict[str, Any]:
    """{actor name: value} of every call. The first call that fails (the actor died or raised)
    raises `ActorFailed` naming its actor, without waiting for the rest; so does the deadline."""
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
                raise ActorFailed(name, f"its process died during {what} ({type(e).__name__})",
                                  died=True) from e
            except RayTaskError as e:
                # A peer's death often surfaces first as this one's failed collective: name the
                # dead one when there is one.
                raise _dead_among(pending, what) or ActorFailed(
                    name, f"{what} raised {e.cause!r}", died=False) from e
            except GetTimeoutError as e:
                raise ActorFailed(name, f"{what} did not return", died=False) from e
    return out


def _dead_among(pending: dict[ray.ObjectRef, str], what: str,
                grace_s: float = DEATH_GRACE_S) -> ActorFailed | None:
    """The first of the `pending` calls whose actor died, waiting up to `grace_s` for Ray to
    notice; None when none did."""
    ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=grace_s)
    for ref in ready:
        try:
            ray.get(ref, timeout=1.0)
        except RayActorError:
            return ActorFailed(pending[ref], f"its process died during {what}", died=True)
        except Exception:  # noqa: BLE001 - only a death is looked for here
            continue
    return None
