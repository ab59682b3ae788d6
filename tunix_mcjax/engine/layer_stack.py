"""The jax engine's weights with the decoder layers stacked, as its scanned forward takes them.

`StackedParams` is a flat param tree keyed by Tunix's paths (`layers/<i>/attn/q_proj/w`, ...),
as the engine loads and reports it, that holds each per-layer leaf as one array over the layers
(`layers/attn/q_proj/w` [L, ...]). A loaded layer leaf is written into its stack in place (a
donated update), so loading costs one leaf of memory at a time and nothing per generate
restacks; `tree()` is the stacked tree the engine's program scans over.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

LeafPath = tuple[str, ...]
LAYERS = "layers"


def layer_of(path: LeafPath) -> tuple[int, LeafPath] | None:
    """(layer index, stacked path) of a per-layer path `layers/<i>/...`; None for others."""
    if len(path) > 2 and path[0] == LAYERS and path[1].isdigit():
        return int(path[1]), (LAYERS, *path[2:])
    return None


@functools.lru_cache
def _zeros(shape: tuple[int, ...], dtype: Any, sharding: NamedSharding):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


@functools.lru_cache
def _setter(sharding: NamedSharding):
    """stack, leaf, i -> the stack with layer i set to the leaf, in the stack's buffer."""
    return jax.jit(lambda stack, leaf, i: jax.lax.dynamic_update_index_in_dim(
        stack, leaf.astype(stack.dtype), i, 0), donate_argnums=0, out_shardings=sharding)


def stacked_sharding(leaf: jax.Array) -> NamedSharding:
    """A layer leaf's sharding with the layer axis in front, unsplit."""
    sharding = leaf.sharding
    if not isinstance(sharding, NamedSharding):
        raise ValueError(f"a layer param must be placed with a NamedSharding, not {sharding}")
    return NamedSharding(sharding.mesh, P(None, *sharding.spec))


class StackedParams(Mapping):
    """Per-layer paths in, stacked arrays inside (module docstring). A layer the tree has no
    leaf for (LoRA adapters on some layers only) holds zeros in that leaf's stack, which add
    exactly nothing to its projection."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self._stacks: dict[LeafPath, jax.Array] = {}  # stacked path -> [L, ...]
        self._others: dict[LeafPath, jax.Array] = {}  # embedder, final norm, ...
        self._loaded: dict[LeafPath, None] = {}  # per-layer paths set at least once, in order

    def __setitem__(self, path: LeafPath, leaf: jax.Array) -> None:
        found = layer_of(path)
        if found is None:
            self._others[path] = leaf
            return
        index, stacked = found
        if not 0 <= index < self.num_layers:
            raise ValueError(f"param {'/'.join(path)}: layer {index} is not one of the "
                             f"model's {self.num_layers}")
        sharding = stacked_sharding(leaf)
        stack = self._stacks.get(stacked)
        with jax.set_mesh(sharding.mesh):  # not the trainer's mesh a publish may run under
            if stack is None:
                stack = _zeros((self.num_layers, *leaf.shape), leaf.dtype, sharding)()
            self._stacks[stacked] = _setter(sharding)(stack, leaf, index)
        self._loaded[path] = None

    def __getitem__(self, path: LeafPath) -> jax.Array:
        """A per-layer path's leaf: a slice of its stack (a copy; the program never asks)."""
        found = layer_of(path)
        if found is None:
            return self._others[path]
        if path not in self._loaded:
            raise KeyError(path)
        return self._stacks[found[1]][found[0]]

    def __iter__(self) -> Iterator[LeafPath]:
        return iter([*self._others, *self._loaded])

    def __len__(self) -> int:
        return len(self._others) + len(self._loaded)

    def __contains__(self, path: object) -> bool:
        return path in self._others or path in self._loaded

    def tree(self) -> dict[str, Any]:
        """The nested tree the scanned forward takes: `layers/...` [L, ...], the rest as is."""
        tree: dict[str, Any] = {}
        for path, leaf in [*self._others.items(), *self._stacks.items()]:
            node = tree
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = leaf
        return tree
