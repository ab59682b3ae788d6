"""One process of a run: `python -m tunix_mcjax.run RECIPE.yml [key=value ...]`.

Under a cluster launcher (one process per host) `jax.distributed.initialize()` finds its peers
from the environment. `tunix_mcjax.launch` sets TUNIX_MCJAX_COORDINATOR / _NUM_PROCESSES /
_PROCESS_ID for local multi-process runs.
"""

from __future__ import annotations

import argparse
import sys

from tunix_mcjax.config import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tunix_mcjax.run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", help="YAML recipe")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.recipe, args.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2

    from tunix_mcjax import topology
    from tunix_mcjax.runtime import colocated

    topo = topology.initialize_from_env()
    try:
        colocated.run(cfg, topo)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
