"""Publish: gather the trainer's FSDP shards into this host's engine replicas (phase 6).

A global array resharded to fully replicated already holds a full copy on every local device;
the engine reads each device's copy through `addressable_shards`, so nothing is copied twice.
With O4 (`rl_publish_weights_single_call`) the whole tree moves in one gather and one engine
load; without it, one gather and one load per leaf, as the paper's base does. `publish` returns
only when every gather has completed, so the cross-host wait happens inside the publish phase
(under its watchdog guard, and counted in `publish_s`), not in the next rollout.
Params that are already in full on every device (`gathered=True`: the flat train step's own
all-gathered output) are loaded as they are: no gather, and the engine keeps those buffers.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tunix_mcjax.engine import Engine


def _nest(path: tuple, leaf: Any) -> dict:
    """A one-leaf partial tree: ('layers', 0, 'attn', ...) -> {'layers': {0: {...: leaf}}}."""
    tree = leaf
    for key in reversed(path):
        tree = {key.key if hasattr(key, "key") else key.idx: tree}
    return tree


class Publisher:
    def __init__(self, mesh: Mesh, single_call: bool):
        self.single_call = single_call
        self._replicate = jax.jit(lambda t: t, out_shardings=NamedSharding(mesh, PartitionSpec()))
        self.mesh = mesh
        self.gather_calls = 0
        self.load_calls = 0

    def publish(self, engine_params: dict, engine: Engine, gathered: bool = False) -> None:
        """Loads `engine_params` (global arrays) into `engine`; `gathered`: they are already
        replicated over the mesh."""
        with jax.set_mesh(self.mesh):
            if self.single_call:
                engine.load_weights(self._gather(engine_params, gathered))
                self.load_calls += 1
                return
            for path, leaf in jax.tree_util.tree_flatten_with_path(engine_params)[0]:
                engine.load_weights(_nest(path, self._gather(leaf, gathered)))
                self.load_calls += 1

    def _gather(self, tree: Any, gathered: bool) -> Any:
        if gathered:
            return tree
        self.gather_calls += 1
        return jax.block_until_ready(self._replicate(tree))
