"""How the maxtext engine holds MaxText's scanned param tree and which of its layers one
`lax.scan` runs.

MaxText stacks a scanned model's layers along `param_scan_axis` (1 by default: `[embed, layers,
...]`): a uniform stack (Qwen3, Qwen3 MoE), blocks of layer kinds (gpt-oss's two), or Gemma4's
blocks of five local layers and a global one, with the local layers left over after whole blocks
in a remainder stack (`maxtext_tree.scan_plan` finds which). The engine keeps that tree, each
stacked leaf with its stacked axes moved in front (`layer_major`), so that a layer is a
contiguous slice; `ScanLayout` says which layers one scan iteration runs (a block) and which
are left to run unrolled after it (Gemma4's remainder, or every layer of an unscanned tree).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

DECODER, LAYER_PREFIX = "decoder", "layers_"
Prefix = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class LayerSource:
    """Where decoder layer i's params are: the subtree at `prefix`, at `indices` along its
    stacked axes (outermost first; none for an unscanned layer)."""

    prefix: Prefix
    indices: tuple[int, ...]

    @property
    def key(self) -> tuple[Prefix, tuple[int, ...]]:
        """What a layer shares with the same position of every other block."""
        return self.prefix, self.indices[1:]


@dataclasses.dataclass(frozen=True)
class ScanLayout:
    """Layers 0 .. blocks * block - 1 run as `blocks` iterations of one scan over blocks of
    `block` layers (layer b * block + j is position j of block b); the rest run unrolled."""

    sources: tuple[LayerSource, ...]
    block: int
    blocks: int

    @property
    def scanned(self) -> int:
        return self.block * self.blocks

    @property
    def stacked(self) -> dict[Prefix, int]:
        """{prefix: how many stacked axes its leaves have}."""
        return {s.prefix: len(s.indices) for s in self.sources if s.indices}

    @property
    def scanned_prefixes(self) -> tuple[Prefix, ...]:
        return tuple(dict.fromkeys(s.prefix for s in self.sources[:self.scanned]))


def scan_layout(plan: dict[int, tuple[Prefix, tuple[int, ...]]] | None,
                num_layers: int) -> ScanLayout:
    """The layout of a tree stacked by `plan` (`maxtext_tree.scan_plan`; None: unscanned,
    every layer `decoder/layers_<i>`, unrolled). The block is the period of the layers' keys;
    the blocks are the layers whose first stacked index counts them."""
    if plan is None:
        sources = tuple(LayerSource((DECODER, f"{LAYER_PREFIX}{i}"), ())
                        for i in range(num_layers))
        return ScanLayout(sources, 1, 0)
    sources = tuple(LayerSource(*plan[i]) for i in range(num_layers))
    first = sources[0].key
    block = next((i for i in range(1, num_layers) if sources[i].key == first), num_layers)
    blocks = sum(1 for s in sources if s.key == first)
    for i, source in enumerate(sources[:block * blocks]):
        if source.key != sources[i % block].key or source.indices[0] != i // block:
            raise ValueError(f"decoder layer {i} at {'/'.join(source.prefix)}{source.indices} "
                             f"is not position {i % block} of block {i // block}: the scanned "
                             "tree does not repeat a block of layers")
    return ScanLayout(sources, block, blocks)


def stacked_count(path: tuple, stacked: dict[Prefix, int]) -> int:
    """How many stacked axes the leaf at `path` (strings) has."""
    return next((n for prefix, n in stacked.items() if path[:len(prefix)] == prefix), 0)


@functools.partial(jax.jit, static_argnums=(1, 2))
def layer_major(leaf: jax.Array, axis: int, count: int) -> jax.Array:
    """A stacked leaf's `count` stacked axes (from `axis` on) moved in front."""
    return jnp.moveaxis(leaf, tuple(range(axis, axis + count)), tuple(range(count)))


@functools.partial(jax.jit, static_argnums=(1, 2))
def scan_axis_major(leaf: jax.Array, axis: int, count: int) -> jax.Array:
    """`layer_major` undone: MaxText's layout of the leaf."""
    return jnp.moveaxis(leaf, tuple(range(count)), tuple(range(axis, axis + count)))


def layer_major_shape(shape: tuple[int, ...], axis: int, count: int) -> tuple[int, ...]:
    """The shape `layer_major` gives a leaf of `shape`."""
    stacked = shape[axis:axis + count]
    return (*stacked, *shape[:axis], *shape[axis + count:])


def subtree(tree: dict, prefix: Prefix) -> Any:
    """The node of a nested dict at `prefix`, its keys as strings or as stored."""
    node = tree
    for name in prefix:
        node = next(value for key, value in node.items() if str(key) == name)
    return node


def take(tree: Any, indices: tuple[int, ...]) -> Any:
    """Each leaf at `indices` along its leading axes."""
    return jax.tree.map(lambda x: x[indices] if indices else x, tree)
