"""The one place that knows about processes: discovery, meshes, small cross-host exchanges.

Every cross-host wait runs under a `Watchdog` deadline, so a dead or stuck peer ends this
process with a message naming the phase instead of hanging forever. A host that fails posts its
error to the coordination service (`abort`); every other host's watchdog reads it within a second
and exits too, so one host's exception never leaves the others waiting.
"""

from __future__ import annotations

import atexit
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

from tunix_mcjax import hostenv

WATCHDOG_EXIT_CODE = 3
ABORT_EXIT_CODE = 1
PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM, as a process killed by the notice would report
_ABORT_KEY = "tunix_mcjax/abort"
CLOSE_TIMEOUT_S = 10.0  # a watchdog's poll is one non-blocking key-value read
_ABORT_LINGER_S = 2.0  # a failing host keeps the coordination service up this long for peers
# A barrier's own bound; the phase's watchdog (collective_timeout_s, compile_timeout_s) ends a
# guarded wait long before it.
BARRIER_TIMEOUT_S = 24 * 3600.0
_barriers: dict[str, int] = {}
_ARRIVE_POLL_S = 0.005


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


def use_compilation_cache(directory: str) -> None:
    """JAX's persistent compilation cache in `directory` (~ expanded) for this process; call
    before its first compile (JAX reads the setting once). "": JAX's own setting stays."""
    if directory:
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(directory))


def initialize_from_env() -> Topology:
    """`initialize` from `tunix_mcjax.launch`'s TUNIX_MCJAX_* variables when set, else from the
    cluster's own discovery (TPU/GPU launchers), else as a single process."""
    env = os.environ
    if hostenv.COORDINATOR not in env:
        return initialize()
    return initialize(env[hostenv.COORDINATOR], int(env[hostenv.NUM_PROCESSES]),
                      int(env[hostenv.PROCESS_ID]))


def current() -> Topology:
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return Topology(jax.process_index(), jax.process_count(),
                    tuple(jax.local_devices()), tuple(devices))


def trainer_mesh(topo: Topology) -> Mesh:
    """All devices of all hosts on one FSDP axis; each host's devices are contiguous."""
    devices = np.array(topo.global_devices).reshape(len(topo.global_devices), 1)
    return Mesh(devices, ("fsdp", "tp"), axis_types=(AxisType.Auto, AxisType.Auto))


def arrive_together(name: str, timeout_s: float = BARRIER_TIMEOUT_S) -> None:
    """Waits on the coordination service until every host is here, before a CPU collective.

    Gloo gives a collective's first run over a set of devices 30 s for every process to
    arrive, then fails. Hosts can be further apart than that after host-local compiles: JAX
    writes its persistent compilation cache from process 0 only, so with a warm cache host 0
    loads its engine's programs while every other host compiles its own (seen at 2 x 2 under
    load: the second launch on one cache failed at step 0's exchange). TPU and GPU collectives
    have no such limit, so there is no barrier there. The wait polls the key-value store from
    Python, so the watchdog thread keeps running: a host that fails meanwhile ends this one."""
    client = _client()
    if client is None or jax.process_count() == 1 or jax.devices()[0].platform != "cpu":
        return
    count = _barriers[name] = _barriers.get(name, -1) + 1
    here = f"tunix_mcjax/arrive/{name}/{count}/"
    client.key_value_set(here + str(jax.process_index()), "1")
    deadline = time.monotonic() + timeout_s
    while len(client.key_value_dir_get(here)) < jax.process_count():
        if time.monotonic() > deadline:
            raise TimeoutError(f"hosts did not all reach {name!r} within {timeout_s:.0f}s")
        time.sleep(_ARRIVE_POLL_S)
    if count:  # every host has left the previous one: its key can go
        client.key_value_delete(f"tunix_mcjax/arrive/{name}/{count - 1}/{jax.process_index()}")


def allgather(values: np.ndarray) -> np.ndarray:
    """[num_hosts, *values.shape]: every host's `values`, in host order, bit-exact, once every
    host has arrived (`arrive_together`).

    With x64 off JAX would narrow 8-byte numbers to 4 (a float64 count above 2**24 would lose
    exactness), so 8-byte dtypes travel as pairs of int32 words and are reassembled here.
    """
    values = np.ascontiguousarray(values)
    if jax.process_count() == 1:
        return values[None]
    arrive_together("allgather")
    if values.dtype.itemsize != 8:
        return np.asarray(multihost_utils.process_allgather(values))
    words = values.reshape(-1).view(np.int32)
    gathered = np.asarray(multihost_utils.process_allgather(words)).astype(np.int32)
    return gathered.view(values.dtype).reshape(-1, *values.shape)


def _client():
    from jax._src import distributed

    return distributed.global_state.client


def abort(message: str, exit_code: int = ABORT_EXIT_CODE) -> None:
    """Ends this process now with `message`, and tells every other host to end too.

    When another host failed first (this failure is then usually its consequence: a collective
    cut short), its message is repeated instead. Skips the interpreter's exit path on purpose:
    JAX's atexit shutdown waits (minutes) at a barrier for every host, which the others, blocked
    in a collective, never reach.
    """
    first = peer_abort()
    if first is not None:
        print(f"{message}\n(stopping because another host failed first: {first})",
              file=sys.stderr, flush=True)
        os._exit(exit_code)
    print(message, file=sys.stderr, flush=True)
    _posted_abort.set()  # this host's own message is not another host's failure
    client = _client()
    if client is not None:
        try:
            client.key_value_set(_ABORT_KEY, message)
            time.sleep(_ABORT_LINGER_S)  # this host may run the coordination service
        except Exception as e:  # the service is already gone: peers learn from JAX itself
            print(f"(could not notify the other hosts: {e})", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(exit_code)


_posted_abort = threading.Event()


def peer_abort(lost_contact_fails: bool = True) -> str | None:
    """Another host's `abort` message, if one was posted; with `lost_contact_fails`, also an
    unreachable coordination service (between phases it may just have ended with the run)."""
    client = _client()
    if client is None:
        return None
    try:
        return client.key_value_try_get(_ABORT_KEY)
    except Exception as e:
        if "NOT_FOUND" in str(e) or not lost_contact_fails:
            return None
        return f"lost contact with the coordination service: {e}"


def preemption_noticed(step: int) -> bool:
    """True on every host at the same step once any host got SIGTERM (JAX's preemption notice,
    agreed through JAX's preemption sync). Call it on every host at every step."""
    if _client() is None:
        return _local_sigterm.is_set()
    return multihost_utils.reached_preemption_sync_point(step)


_local_sigterm = threading.Event()


def install_single_process_sigterm() -> None:
    """Without jax.distributed there is no preemption service: a SIGTERM handler stands in."""
    import signal

    if _client() is None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: _local_sigterm.set())


class Watchdog:
    """Ends the process if a guarded cross-host phase outlives its deadline, or as soon as
    another host has posted an `abort` (checked about every second, in a phase or not)."""

    def __init__(self, host: int, timeout_s: float, compile_timeout_s: float | None = None):
        if timeout_s <= 0:
            raise ValueError(f"watchdog timeout must be > 0, got {timeout_s}")
        self.host, self.timeout_s = host, timeout_s
        self.compile_timeout_s = compile_timeout_s or timeout_s
        self._deadline: float | None = None
        self._phase, self._budget, self._key = "", timeout_s, "collective_timeout_s"
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="watchdog")
        self._thread.start()
        # Stopped before the interpreter finalizes (and before JAX's own atexit shutdown): a
        # daemon thread still polling the coordination client then dies inside its C++ call,
        # and the process aborts ("FATAL: exception not rethrown") after a clean run.
        atexit.register(self.close)

    def close(self) -> None:
        """Stops the watch; returns once its thread has ended (within a poll interval)."""
        self._closed.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=CLOSE_TIMEOUT_S)

    @contextmanager
    def guard(self, phase: str, compiles: bool = False):
        """`compiles`: the phase may compile (step 0, a new K), so it gets compile_timeout_s."""
        budget = self.compile_timeout_s if compiles else self.timeout_s
        key = "compile_timeout_s" if compiles else "collective_timeout_s"
        with self._lock:
            self._phase, self._budget, self._key = phase, budget, key
            self._deadline = time.monotonic() + budget
        try:
            yield
        finally:
            with self._lock:
                self._deadline = None

    def _watch(self) -> None:
        while not self._closed.wait(min(1.0, self.timeout_s / 4)):
            with self._lock:
                waiting = self._deadline is not None
                late = waiting and time.monotonic() > self._deadline
                phase, budget, key = self._phase, self._budget, self._key
            # Between phases too (setup, compiles): a host that failed there may be gone, and
            # its launcher stopping this one, before this host reaches a cross-host wait.
            peer = None if _posted_abort.is_set() else peer_abort(lost_contact_fails=waiting)
            if peer is not None:
                where = f"in phase {phase!r}" if waiting else "between phases"
                print(f"host {self.host}: stopping {where} because another host failed: {peer}",
                      file=sys.stderr, flush=True)
                time.sleep(2 * _ABORT_LINGER_S)  # let the failing host exit first, cleanly
                os._exit(ABORT_EXIT_CODE)
            if late:
                print(f"host {self.host}: phase {phase!r} waited more than {budget:.0f}s "
                      "on other hosts (one is dead or stuck); aborting. Raise "
                      f"{key} if this phase is just slow.", file=sys.stderr, flush=True)
                os._exit(WATCHDOG_EXIT_CODE)
