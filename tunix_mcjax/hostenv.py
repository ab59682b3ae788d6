"""The environment of one JAX process of a run: the contract between whoever starts the
process (`tunix_mcjax.launch`'s local processes, the disaggregated mode's Ray actors) and
`topology.initialize_from_env`, which reads it. No JAX here, so launchers stay light.
"""

from __future__ import annotations

import os
import socket

COORDINATOR = "TUNIX_MCJAX_COORDINATOR"  # host:port of the jax.distributed coordinator
NUM_PROCESSES = "TUNIX_MCJAX_NUM_PROCESSES"
PROCESS_ID = "TUNIX_MCJAX_PROCESS_ID"
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def free_port(bind: str = "127.0.0.1") -> int:
    """A TCP port free on this machine's `bind` address now."""
    with socket.socket() as s:
        s.bind((bind, 0))
        return s.getsockname()[1]


def with_cpu_devices(xla_flags: str, devices: int) -> str:
    """`xla_flags` (an XLA_FLAGS value) with the CPU backend's device count set to `devices`."""
    kept = [f for f in xla_flags.split() if not f.startswith(DEVICE_COUNT_FLAG)]
    return " ".join([*kept, f"{DEVICE_COUNT_FLAG}={devices}"])


def host_env(host: int, hosts: int, devices: int, port: int, coordinator_host: str = "127.0.0.1"
             ) -> dict[str, str]:
    """This process's environment for process `host` of `hosts`, whose coordinator listens on
    coordinator_host:port. JAX_PLATFORMS defaults to cpu, whose backend gets `devices` forced
    host-platform devices (the flag touches the CPU backend only: on accelerators, with
    JAX_PLATFORMS set, the process keeps its own devices)."""
    env = dict(os.environ)
    env.update({"XLA_FLAGS": with_cpu_devices(env.get("XLA_FLAGS", ""), devices),
                "JAX_PLATFORMS": env.get("JAX_PLATFORMS", "cpu"),
                "PYTHONUNBUFFERED": "1", COORDINATOR: f"{coordinator_host}:{port}",
                NUM_PROCESSES: str(hosts), PROCESS_ID: str(host)})
    return env
