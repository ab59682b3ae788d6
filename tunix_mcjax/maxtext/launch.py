"""Start H local processes of MaxText's RL trainer under rl_runtime=mcjax (CPU/dev).

`python -m tunix_mcjax.maxtext.launch --hosts 2 --devices-per-host 1 [CONFIG.yml] key=value ...`
runs `python -m maxtext.trainers.post_train.rl.train_rl [CONFIG.yml] key=value ... rl_runtime=mcjax`
as H real JAX processes (see `tunix_mcjax.launch`, and recipes/maxtext/cpu/run.sh): the arguments
are train_rl's own, so a recipe script's command line runs as it is. Without a CONFIG.yml,
MaxText picks train_rl's default (post_train/rl.yml). On a cluster, the cluster's launcher
starts that command once per host instead.
"""

from __future__ import annotations

import sys

from tunix_mcjax.launch import host_parser, launch, parse_hosts

TRAIN_RL = "maxtext.trainers.post_train.rl.train_rl"


def main(argv: list[str] | None = None) -> int:
    parser = host_parser("python -m tunix_mcjax.maxtext.launch", __doc__, devices_per_host=1)
    parser.epilog = "docs: docs/maxtext.md (the adapter, its keys); `make docs` builds the site"
    parser.add_argument("args", nargs="+", metavar="[CONFIG.yml] key=value",
                        help="train_rl's arguments: an optional MaxText RL config YAML (e.g. "
                        "src/maxtext/configs/post_train/rl.yml), then key=value overrides")
    args = parse_hosts(parser, argv)
    first, *rest = [*args.args, "rl_runtime=mcjax"]
    return launch(first, rest, args.hosts, args.devices_per_host, module=TRAIN_RL)


if __name__ == "__main__":
    sys.exit(main())
