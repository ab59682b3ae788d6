"""Start H local processes of Tunix's GRPO CLI under rl_runtime=mcjax (CPU/dev).

`python -m tunix_mcjax.tunix.launch --hosts 2 --devices-per-host 1 BASE_CONFIG key=value ...`
runs `python -m tunix.cli.grpo_main BASE_CONFIG key=value ... rl_runtime=mcjax` as H real JAX
processes (see `tunix_mcjax.launch`). The same as `TUNIX_MCJAX_HOSTS=H
TUNIX_MCJAX_DEVICES_PER_HOST=D python -m tunix.cli.grpo_main ... rl_runtime=mcjax`, which is what
recipes/tunix/cpu/run_qwen3.sh uses; on a cluster, the cluster's launcher starts grpo_main once
per host instead.
"""

from __future__ import annotations

import sys

from tunix_mcjax.launch import host_parser, launch, parse_hosts
from tunix_mcjax.tunix import GRPO_MAIN


def main(argv: list[str] | None = None) -> int:
    parser = host_parser("python -m tunix_mcjax.tunix.launch", __doc__, devices_per_host=1)
    parser.epilog = "docs: docs/tunix.md (the adapter, its keys); `make docs` builds the site"
    parser.add_argument("base_config", help="Tunix's base config YAML")
    parser.add_argument("overrides", nargs="*", help="grpo_main's key=value arguments")
    args = parse_hosts(parser, argv)
    return launch(args.base_config, [*args.overrides, "rl_runtime=mcjax"], args.hosts,
                  args.devices_per_host, module=GRPO_MAIN)


if __name__ == "__main__":
    sys.exit(main())
