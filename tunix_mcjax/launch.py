"""Start H local processes of a run (CPU/dev): `python -m tunix_mcjax.launch --hosts H ...`.

Each process is a real JAX controller: `jax.distributed.initialize` against a coordinator on
127.0.0.1 (a free port), gloo CPU collectives, and D forced host-platform devices. Output is
streamed with a `[host i]` prefix. If any process fails, the others get PEER_EXIT_S to end
themselves, as they do on a cluster (`topology.abort` tells them, and each says why), then are
stopped; the launcher exits non-zero, naming the host and its exit code. Ctrl-C or SIGTERM to
the launcher stops every host too (SIGTERM, then SIGKILL after GRACE_S: JAX treats SIGTERM as a
preemption notice, so hosts that reach a step boundary within GRACE_S save a checkpoint and exit
143).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time

from tunix_mcjax.config import ConfigError, load_config
from tunix_mcjax.hostenv import free_port, host_env

GRACE_S = 10
PEER_EXIT_S = 5  # a failed host's peers learn of it in-band (topology.abort) within seconds


def _stream(host: int, proc: subprocess.Popen) -> None:
    for line in proc.stdout:
        sys.stdout.write(f"[host {host}] {line}")
        sys.stdout.flush()


def supervise(procs: list[subprocess.Popen]) -> int:
    """Waits for all; on the first failure gives the rest PEER_EXIT_S to end themselves, stops
    those still running, and returns that failure's exit code."""
    while True:
        codes = [p.poll() for p in procs]
        failed = [(h, c) for h, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            host, code = failed[0]
            print(f"launch: host {host} exited with code {code}; stopping the other hosts",
                  file=sys.stderr, flush=True)
            _wait_all(procs, PEER_EXIT_S)
            stop(procs)
            return code if code > 0 else 128 - code
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.2)


def _wait_all(procs: list[subprocess.Popen], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.2)


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class Terminated(Exception):
    """The launcher received SIGTERM."""


def _on_sigterm(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the stop short
    raise Terminated


def launch(recipe: str, overrides: list[str], hosts: int, devices: int,
           module: str = "tunix_mcjax.run") -> int:
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    procs: list[subprocess.Popen] = []
    streams: list[threading.Thread] = []
    try:
        port = free_port()
        for h in range(hosts):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", module, recipe, *overrides],
                env=host_env(h, hosts, devices, port), stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True))
            streams.append(threading.Thread(target=_stream, args=(h, procs[-1]), daemon=True))
            streams[-1].start()
        code = supervise(procs)
    except (KeyboardInterrupt, Terminated) as stopped:
        signum = signal.SIGTERM if isinstance(stopped, Terminated) else signal.SIGINT
        print(f"launch: {signum.name}; stopping all hosts", file=sys.stderr, flush=True)
        stop(procs)
        code = 128 + signum
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    for t in streams:
        t.join(timeout=5)
    return code


def host_parser(prog: str, description: str, devices_per_host: int,
                hosts_default: int | None = 2, hosts_help: str = "processes to start (default 2)"
                ) -> argparse.ArgumentParser:
    """A local launcher's parser: `--hosts` and `--devices-per-host` (see `parse_hosts`)."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=hosts_default, help=hosts_help)
    parser.add_argument("--devices-per-host", type=int, default=devices_per_host,
                        help=f"CPU devices per process (default {devices_per_host})")
    return parser


def parse_hosts(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """`parser`'s arguments, with at least one host and one device per host."""
    args = parser.parse_args(argv)
    if (args.hosts is not None and args.hosts < 1) or args.devices_per_host < 1:
        parser.error("--hosts and --devices-per-host must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    parser = host_parser("python -m tunix_mcjax.launch", __doc__, devices_per_host=2,
                         hosts_default=None, hosts_help="processes to start (default 2; "
                         "rl_runtime=mcjax_da on a joined Ray cluster: every host it offers)")
    parser.epilog = ("docs: docs/getting-started.md, docs/configuration.md (keys),\n      "
                     "docs/disaggregated.md (rl_runtime=mcjax_da); `make docs` builds the site")
    parser.add_argument("recipe", help="YAML recipe, e.g. recipes/cpu/demo.yml")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parse_hosts(parser, argv)
    try:
        cfg = load_config(args.recipe, args.overrides)
        joins = cfg.rl_runtime == "mcjax_da" and bool(cfg.rl_ray_address or
                                                       os.environ.get("RAY_ADDRESS"))
        hosts = args.hosts or (None if joins else 2)
        if hosts is not None:
            cfg.validate_topology(hosts, args.devices_per_host)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(f"launch: {hosts or 'all Ray'} hosts x "
          f"{args.devices_per_host} devices, run {cfg.run_dir}", flush=True)
    if cfg.rl_runtime == "mcjax_da":
        return launch_disaggregated(cfg, hosts, args.devices_per_host)
    return launch(args.recipe, args.overrides, args.hosts, args.devices_per_host)


def launch_disaggregated(cfg, hosts: int | None, devices: int) -> int:
    """rl_runtime=mcjax_da: this process is the Ray driver, of the cluster at rl_ray_address or
    RAY_ADDRESS (`hosts` None: every host it offers), else of a local cluster it starts.
    SIGTERM ends it after the step in flight, saved when checkpointing is on: exit 143. Ctrl-C
    leaves through the driver's own cleanup too: every actor killed, its placement group
    removed."""
    from tunix_mcjax.runtime import disaggregated, ray_cluster, recovery

    try:
        disaggregated.run(cfg, hosts, devices)
    except recovery.Preempted as e:
        print(e, file=sys.stderr, flush=True)
        return 128 + signal.SIGTERM
    except ray_cluster.ActorFailed as e:
        print(f"launch: {e}; the run is stopped", file=sys.stderr, flush=True)
        return 1
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
