"""One process of a run: `python -m tunix_mcjax.run RECIPE.yml [key=value ...]`.

Under a cluster launcher (one process per host) `jax.distributed.initialize()` finds its peers
from the environment. `tunix_mcjax.launch` sets TUNIX_MCJAX_COORDINATOR / _NUM_PROCESSES /
_PROCESS_ID for local multi-process runs.

Exit status: 0 done; 2 bad config (found up front or at start-up); 1 any other failure, which
also ends every other host within seconds (`topology.abort`); 3 a watchdog deadline;
143 preempted (SIGTERM on any host: every host saved at the same step, rerun to resume).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from tunix_mcjax.config import ConfigError, load_config

CONFIG_EXIT_CODE = 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tunix_mcjax.run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="docs: docs/getting-started.md (clusters), "
                                     "docs/configuration.md (keys),\n      docs/reliability.md "
                                     "(exit codes); `make docs` builds the site")
    parser.add_argument("recipe", help="YAML recipe")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.recipe, args.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return CONFIG_EXIT_CODE
    if cfg.rl_runtime == "mcjax_da":
        print("config error: rl_runtime=mcjax_da has one Ray driver that starts every actor, "
              "not one process per host: run python -m tunix_mcjax.launch --hosts H "
              f"{args.recipe} rl_runtime=mcjax_da ...", file=sys.stderr)
        return CONFIG_EXIT_CODE

    from tunix_mcjax import topology
    from tunix_mcjax.runtime import colocated

    topo = topology.initialize_from_env()
    return guarded(topo, lambda: colocated.run(cfg, topo))


def guarded(topo, body: Callable[[], object]) -> int:
    """Runs one host's `body`; returns its exit status. Any failure ends every host, fast."""
    from tunix_mcjax import topology
    from tunix_mcjax.runtime.recovery import Preempted

    topology.install_single_process_sigterm()
    try:
        body()
    except Preempted as e:
        print(e, file=sys.stderr, flush=True)
        return topology.PREEMPTED_EXIT_CODE
    except ConfigError as e:
        topology.abort(f"host {topo.host}: config error: {e}", CONFIG_EXIT_CODE)
    except BaseException as e:  # noqa: BLE001 - every failure must end every host, fast
        import traceback

        traceback.print_exc()
        topology.abort(f"host {topo.host}: {type(e).__name__}: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
