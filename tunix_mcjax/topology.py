"""The one place that knows about processes: discovery, meshes, small cross-host exchanges.

Every cross-host wait runs under a `Watchdog` deadline, so a dead or stuck peer ends this
process with a message naming the phase instead of hanging forever.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from contextlib import contextmanager

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh

WATCHDOG_EXIT_CODE = 3


@dataclasses.dataclass(frozen=True)
class Topology:
    host: int  # this process's index
    num_hosts: int
    local_devices: tuple[jax.Device, ...]
    global_devices: tuple[jax.Device, ...]

    @property
    def is_leader(self) -> bool:
        return self.host == 0


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, timeout_s: int = 120) -> Topology:
    """`jax.distributed.initialize` (gloo collectives on CPU), then this process's view."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if num_processes == 1:
        return current()
    try:
        jax.distributed.initialize(coordinator_address, num_processes, process_id,
                                   initialization_timeout=timeout_s)
    except ValueError as e:
        if coordinator_address is not None:
            raise
        print(f"no cluster found ({e}); running as a single process", file=sys.stderr)
    return current()


def initialize_from_env() -> Topology:
    """`initialize` from `tunix_mcjax.launch`'s TUNIX_MCJAX_* variables when set, else from the
    cluster's own discovery (TPU/GPU launchers), else as a single process."""
    env = os.environ
    if "TUNIX_MCJAX_COORDINATOR" not in env:
        return initialize()
    return initialize(env["TUNIX_MCJAX_COORDINATOR"], int(env["TUNIX_MCJAX_NUM_PROCESSES"]),
                      int(env["TUNIX_MCJAX_PROCESS_ID"]))


def current() -> Topology:
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return Topology(jax.process_index(), jax.process_count(),
                    tuple(jax.local_devices()), tuple(devices))


def trainer_mesh(topo: Topology) -> Mesh:
    """All devices of all hosts on one FSDP axis; each host's devices are contiguous."""
    devices = np.array(topo.global_devices).reshape(len(topo.global_devices), 1)
    return Mesh(devices, ("fsdp", "tp"), axis_types=(AxisType.Auto, AxisType.Auto))


def allgather(values: np.ndarray) -> np.ndarray:
    """[num_hosts, *values.shape]: every host's `values`, in host order."""
    if jax.process_count() == 1:
        return values[None]
    return np.asarray(multihost_utils.process_allgather(values))


class Watchdog:
    """Ends the process if a guarded cross-host phase outlives its deadline."""

    def __init__(self, host: int, timeout_s: float):
        self.host, self.timeout_s = host, timeout_s
        self._deadline: float | None = None
        self._phase = ""
        self._lock = threading.Lock()
        threading.Thread(target=self._watch, daemon=True, name="watchdog").start()

    @contextmanager
    def guard(self, phase: str):
        with self._lock:
            self._phase, self._deadline = phase, time.monotonic() + self.timeout_s
        try:
            yield
        finally:
            with self._lock:
                self._deadline = None

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout_s / 4))
            with self._lock:
                late = self._deadline is not None and time.monotonic() > self._deadline
                phase = self._phase
            if late:
                print(f"host {self.host}: phase {phase!r} waited more than {self.timeout_s:.0f}s "
                      "on other hosts (one is dead or stuck); aborting. Raise "
                      "collective_timeout_s if this phase is just slow.", file=sys.stderr,
                      flush=True)
                os._exit(WATCHDOG_EXIT_CODE)
