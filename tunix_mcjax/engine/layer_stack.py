"""The jax engine's weights with the decoder layers stacked, as its scanned forward takes them.

`StackedParams` is a flat param tree keyed by Tunix's paths (`layers/<i>/attn/q_proj/w`, ...),
as the engine loads and reports it, that holds each per-layer leaf as one array over the layers
(`layers/attn/q_proj/w` [L, ...]). A loaded layer leaf is written into its stack in place (a
donated update), so loading costs one leaf of memory at a time and nothing per generate
restacks; `tree()` is the stacked tree the engine's program scans over. A quantized leaf
(`engine.quantize`: a `qwix.QArray` of values and scales) is stacked field by field.

It also takes the trainer's stacks as they are (`layers/from_<s>/attn/q_proj/w` [n, ...],
`train.layer_runs`): a stack of every layer becomes the engine's stack with no copy, a shorter
run (LoRA on some layers) is written into its layers' slice; nothing is unstacked.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tunix_mcjax.train.layer_runs import RUN, run_start

LeafPath = tuple[str, ...]
LAYERS = "layers"


def layer_of(path: LeafPath) -> tuple[int, LeafPath] | None:
    """(layer index, stacked path) of a per-layer path `layers/<i>/...`; None for others."""
    if len(path) > 2 and path[0] == LAYERS and path[1].isdigit():
        return int(path[1]), (LAYERS, *path[2:])
    return None


def run_of(path: LeafPath) -> tuple[int, LeafPath] | None:
    """(first layer, stacked path) of a trainer's run path `layers/from_<s>/...`; None else."""
    if len(path) > 2 and path[0] == LAYERS and path[1].startswith(RUN):
        return run_start(path[1]), (LAYERS, *path[2:])
    return None


def first_layer_path(path: LeafPath) -> LeafPath:
    """The per-layer path of a run's first layer (whose spec a run's leaf stacks)."""
    start, stacked = run_of(path)
    return (LAYERS, str(start), *stacked[1:])


@functools.lru_cache
def _zeros(shape: tuple[int, ...], dtype: Any, sharding: NamedSharding):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


@functools.lru_cache
def _run_setter(sharding: NamedSharding):
    """stack, run, s -> the stack with layers s.. set to the run's, in the stack's buffer."""
    return jax.jit(lambda stack, run, s: jax.lax.dynamic_update_slice_in_dim(
        stack, run.astype(stack.dtype), s, 0), donate_argnums=0, out_shardings=sharding)


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


def _mesh_of(leaf: Any) -> jax.sharding.Mesh:
    """The mesh a leaf (or each field of a quantized one) is placed on."""
    return stacked_sharding(jax.tree.leaves(leaf)[0]).mesh


class StackedParams(Mapping):
    """Per-layer paths in, stacked arrays inside (module docstring). A layer the tree has no
    leaf for (LoRA adapters on some layers only) holds zeros in that leaf's stack, which add
    exactly nothing to its projection."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self._stacks: dict[LeafPath, jax.Array] = {}  # stacked path -> [L, ...]
        self._others: dict[LeafPath, jax.Array] = {}  # embedder, final norm, ...
        self._loaded: dict[LeafPath, None] = {}  # per-layer paths set at least once, in order
        self._adopted: set[LeafPath] = set()  # stacks that are a loaded array (not ours to donate)

    def __setitem__(self, path: LeafPath, leaf: Any) -> None:
        if run_of(path) is not None:
            self._set_run(path, leaf)
            return
        found = layer_of(path)
        if found is None:
            self._others[path] = leaf
            return
        index, stacked = found
        if not 0 <= index < self.num_layers:
            raise ValueError(f"param {'/'.join(path)}: layer {index} is not one of the "
                             f"model's {self.num_layers}")
        with jax.set_mesh(_mesh_of(leaf)):  # not the trainer's mesh a publish may run under
            stack = self._own_stack(stacked, leaf, lead=0)
            self._stacks[stacked] = jax.tree.map(
                lambda s, part: _setter(s.sharding)(s, part, index), stack, leaf)
        self._loaded[path] = None

    def _own_stack(self, stacked: LeafPath, leaf: Any, lead: int) -> Any:
        """The stack at `stacked` as a buffer this store may donate: zeros (shaped as `leaf`
        less its `lead` layer axes) when there is none, a copy of an adopted one (the
        trainer's array stays intact). A quantized leaf (`qwix.QArray`) stacks field by field."""
        stack = self._stacks.get(stacked)
        if stack is None:
            return jax.tree.map(lambda part: _zeros(
                (self.num_layers, *part.shape[lead:]), part.dtype,
                stacked_sharding(part) if lead == 0 else part.sharding)(), leaf)
        if stacked in self._adopted:
            self._adopted.discard(stacked)
            return jax.tree.map(lambda s: jax.jit(jnp.copy, out_shardings=s.sharding)(s), stack)
        return stack

    def _set_run(self, path: LeafPath, leaf: Any) -> None:
        """A trainer's stack of layers s..s+n-1 (placed with the layer axis unsplit)."""
        start, stacked = run_of(path)
        n = leaf.shape[0]
        if start < 0 or start + n > self.num_layers:
            raise ValueError(f"param {'/'.join(path)}: layers {start}..{start + n - 1} are not "
                             f"all among the model's {self.num_layers}")
        if n == self.num_layers:
            self._stacks[stacked] = leaf
            self._adopted.add(stacked)
        else:
            with jax.set_mesh(_mesh_of(leaf)):
                stack = self._own_stack(stacked, leaf, lead=1)
                self._stacks[stacked] = jax.tree.map(
                    lambda s, part: _run_setter(s.sharding)(s, part, start), stack, leaf)
        for i in range(start, start + n):
            self._loaded[(LAYERS, str(i), *stacked[1:])] = None

    def __getitem__(self, path: LeafPath) -> Any:
        """A per-layer path's leaf: a slice of its stack (a copy; the program never asks)."""
        found = layer_of(path)
        if found is None:
            return self._others[path]
        if path not in self._loaded:
            raise KeyError(path)
        return jax.tree.map(lambda s: s[found[0]], self._stacks[found[1]])

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
