"""A traced benchmark launch: `tunix_mcjax.launch` whose hosts run `tunix_mcjax.run` with the
steps of the window in `bench.trace.TRACE_ENV` under the JAX profiler (see `bench.trace`).

    TUNIX_MCJAX_BENCH_TRACE=<first>:<steps>:<dir> python -m tunix_mcjax.bench.traced_run \\
        --hosts 2 --devices-per-host 1 RECIPE.yml key=value ...

A process the launcher started (it has TUNIX_MCJAX_PROCESS_ID) is one host of the launch.
"""

from __future__ import annotations

import argparse
import os
import sys

from tunix_mcjax.bench import trace

MODULE = "tunix_mcjax.bench.traced_run"


def host_main(window: trace.Window, argv: list[str] | None) -> int:
    host = int(os.environ["TUNIX_MCJAX_PROCESS_ID"])
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {window.xla_flags(host)}"

    from tunix_mcjax import run
    from tunix_mcjax.runtime.colocated import ColocatedRuntime

    step = ColocatedRuntime.step

    def traced_step(self: ColocatedRuntime, index: int) -> None:
        with trace.StepTracer(window, self.topo.host).step(index):
            step(self, index)

    ColocatedRuntime.step = traced_step
    return run.main(argv)


def main(argv: list[str] | None = None) -> int:
    window = trace.Window.from_env()
    if window is None:
        sys.exit(f"bench.traced_run: set {trace.TRACE_ENV}=<first>:<steps>:<dir>")
    if "TUNIX_MCJAX_PROCESS_ID" in os.environ:
        return host_main(window, argv)
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__)
    parser.add_argument("--hosts", type=int, required=True)
    parser.add_argument("--devices-per-host", type=int, required=True)
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)

    from tunix_mcjax.launch import launch

    return launch(args.recipe, args.overrides, args.hosts, args.devices_per_host, module=MODULE)


if __name__ == "__main__":
    sys.exit(main())
