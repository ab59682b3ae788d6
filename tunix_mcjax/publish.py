"""Publish: gather the trainer's FSDP shards into this host's engine replicas (phase 6).

A global array resharded to fully replicated already holds a full copy on every local device;
the engine reads each device's copy through `addressable_shards`, so nothing is copied twice.
With O4 (`rl_publish_weights_single_call`) the whole tree moves in one gather and one engine
load; without it, one gather and one load per leaf, as the paper's base does. `publish` returns
only when every gather has completed, so the cross-host wait happens inside the publish phase
(under its watchdog guard, and counted in `publish_s`), not in the next rollout.
Params that are already in full on every device (`gathered=True`: the flat train step's own
all-gathered output) are loaded as they are: no gather, and the engine keeps those buffers.
`publish_trainer` sends an engine the whole tree once, then only what trains (with LoRA, the
adapters: the engine keeps the base). `last_bytes` is the size of the last tree published.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tunix_mcjax.engine import Engine

if TYPE_CHECKING:
    from tunix_mcjax.train.trainer import Trainer


def tree_bytes(tree: Any) -> int:
    """Bytes of every leaf of a param tree (arrays or shape/dtype structs)."""
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def nest(path: tuple, leaf: Any) -> dict:
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
        self.last_bytes = 0
        self._has_base: weakref.WeakSet[Engine] = weakref.WeakSet()  # given the whole tree

    def publish_trainer(self, trainer: Trainer, engine: Engine) -> None:
        """The trainer's params into `engine`: the whole tree the first time, then only the
        trained part (LoRA: the adapters, a partial tree the engine lays over its base)."""
        first = engine not in self._has_base
        self.publish(trainer.engine_params(adapters_only=not first), engine,
                     gathered=trainer.engine_params_gathered)
        self._has_base.add(engine)

    def publish(self, engine_params: dict, engine: Engine, gathered: bool = False) -> None:
        """Loads `engine_params` (global arrays) into `engine`; `gathered`: they are already
        replicated over the mesh."""
        self.last_bytes = tree_bytes(engine_params)
        with jax.set_mesh(self.mesh):
            if self.single_call:
                engine.load_weights(self._gather(engine_params, gathered))
                self.load_calls += 1
                return
            for path, leaf in jax.tree_util.tree_flatten_with_path(engine_params)[0]:
                engine.load_weights(nest(path, self._gather(leaf, gathered)))
                self.load_calls += 1

    def _gather(self, tree: Any, gathered: bool) -> Any:
        if gathered:
            return tree
        self.gather_calls += 1
        return jax.block_until_ready(self._replicate(tree))
