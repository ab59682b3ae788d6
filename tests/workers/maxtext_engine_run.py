"""Worker: MaxText's RL components (model, data, rewards, optimizer) through the colocated
runtime with the maxtext engine on every host: the MaxText adapter's `run` without its key
check (which is about recipe keys, not the engine), so a shrunk Qwen3 MoE can run."""

from __future__ import annotations

import sys

from tunix_mcjax import topology
from tunix_mcjax.run import guarded


def body(argv: list[str], topo: topology.Topology) -> None:
    from tunix_mcjax.maxtext import (
        build_components,
        config_map,
        data,
        load_maxtext_config,
        write_facts,
    )
    from tunix_mcjax.runtime.colocated import ColocatedRuntime
    from tunix_mcjax.tokenizer import resolve_tokenizer_path

    config, _ = load_maxtext_config(argv, {})
    config_map.check_model(config)
    cfg = config_map.to_config(config, topo.num_hosts,
                               resolve_tokenizer_path(config.tokenizer_path))
    ColocatedRuntime(cfg, topo, components=lambda: build_components(
        config, data.load_tokenizer(config), topo)).run()
    write_facts(cfg, topo, {})


if __name__ == "__main__":
    topo = topology.initialize_from_env()
    sys.exit(guarded(topo, lambda: body(sys.argv, topo)))
