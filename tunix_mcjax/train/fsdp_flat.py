"""Flat FSDP collectives: a whole param tree in one all-gather, its gradients in one reduce-scatter.

XLA's partitioner emits one collective per leaf (one all-gather per sharded param, a combined
all-reduce of the gradients); on small models their fixed cost is most of the train step. Here,
inside `shard_map` over the mesh, every device packs its local shards of all sharded leaves into
one buffer per dtype, so the params arrive in one all-gather and the gradients leave in one
reduce-scatter whose chunk i is exactly device i's shard of every leaf. Leaves that are
replicated (norm scales) ride along in every chunk, so each device also gets their full sum; so do
a few fp32 scalars (the step's loss sums). The arithmetic is the partitioner's: the same shards,
the same sums over devices.

A tree qualifies when the mesh's only axis of size > 1 is `axis` and each leaf is replicated or
sharded over `axis` along one dimension in contiguous blocks (a plain `NamedSharding`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """Where each leaf of a param tree sits in the flat buffers."""

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]  # global shapes
    dtypes: tuple[np.dtype, ...]
    dims: tuple[int | None, ...]  # the dimension sharded over `axis`; None: replicated
    axis: str
    size: int  # devices along `axis`

    def local_shape(self, i: int) -> tuple[int, ...]:
        shape, d = list(self.shapes[i]), self.dims[i]
        if d is not None:
            shape[d] //= self.size
        return tuple(shape)

    def groups(self, sharded_only: bool) -> dict[np.dtype, list[int]]:
        """Leaf indices per dtype, in tree order (one buffer per dtype)."""
        out: dict[np.dtype, list[int]] = {}
        for i, (dtype, d) in enumerate(zip(self.dtypes, self.dims, strict=True)):
            if d is not None or not sharded_only:
                out.setdefault(dtype, []).append(i)
        return out


def _sharded_dim(spec: PartitionSpec, axis: str) -> int | None | bool:
    """The one dimension `spec` shards over `axis`; None if none; False if not a flat layout."""
    dims = [d for d, entry in enumerate(spec)
            if entry == axis or (isinstance(entry, tuple) and axis in entry)]
    return False if len(dims) > 1 else (dims[0] if dims else None)


def layout(tree: Any, mesh: Mesh, axis: str = "fsdp") -> FlatLayout | None:
    """The flat layout of `tree` (global arrays) on `mesh`, or None where it does not qualify."""
    if any(n > 1 for name, n in mesh.shape.items() if name != axis):
        return None
    leaves, treedef = jax.tree.flatten(tree)
    dims = []
    for leaf in leaves:
        sharding = getattr(leaf, "sharding", None)
        if not isinstance(sharding, NamedSharding) or sharding.mesh != mesh:
            return None
        d = _sharded_dim(sharding.spec, axis)
        if d is False or (d is not None and leaf.shape[d] % mesh.shape[axis]):
            return None
        dims.append(d)
    return FlatLayout(treedef, tuple(tuple(x.shape) for x in leaves),
                      tuple(np.dtype(x.dtype) for x in leaves), tuple(dims), axis,
                      mesh.shape[axis])


def specs(lay: FlatLayout) -> Any:
    """Each leaf's PartitionSpec (the shard_map in/out spec of the sharded tree)."""
    def spec(i: int) -> PartitionSpec:
        d = lay.dims[i]
        return PartitionSpec() if d is None else PartitionSpec(*([None] * d), lay.axis)
    return lay.treedef.unflatten([spec(i) for i in range(len(lay.shapes))])


def all_gather(lay: FlatLayout, local: Any) -> Any:
    """Inside shard_map: this device's shards -> every leaf in full, one all-gather per dtype."""
    leaves = lay.treedef.flatten_up_to(local)
    out = list(leaves)
    for idx in lay.groups(sharded_only=True).values():
        every = jax.lax.all_gather(jnp.concatenate([leaves[i].ravel() for i in idx]), lay.axis)
        offset = 0
        for i in idx:
            n = leaves[i].size
            pieces = every[:, offset:offset + n].reshape(lay.size, *lay.local_shape(i))
            out[i] = jnp.moveaxis(pieces, 0, lay.dims[i]).reshape(lay.shapes[i])
            offset += n
    return lay.treedef.unflatten(out)


def reduce_scatter(lay: FlatLayout, full: Any, scalars: jax.Array) -> tuple[Any, jax.Array]:
    """Inside shard_map: this device's full-size gradients -> (its shard of their sum over the
    axis, replicated leaves summed in full) and `scalars` (fp32 [n]) summed; one reduce-scatter
    per dtype."""
    leaves = lay.treedef.flatten_up_to(full)
    groups = lay.groups(sharded_only=False)
    groups.setdefault(np.dtype(np.float32), [])
    out = list(leaves)
    summed = scalars
    for dtype, idx in groups.items():
        columns = []
        for i in idx:
            g, d = leaves[i], lay.dims[i]
            if d is None:
                columns.append(jnp.broadcast_to(g.ravel(), (lay.size, g.size)))
            else:
                split = g.reshape(*g.shape[:d], lay.size, g.shape[d] // lay.size, *g.shape[d + 1:])
                columns.append(jnp.moveaxis(split, d, 0).reshape(lay.size, -1))
        with_scalars = dtype == np.dtype(np.float32)
        if with_scalars:
            columns.append(jnp.broadcast_to(scalars.astype(jnp.float32), (lay.size,
                                                                           scalars.size)))
        mine = jax.lax.psum_scatter(jnp.concatenate(columns, axis=1), lay.axis)
        offset = 0
        for i in idx:
            shape = lay.local_shape(i)
            n = int(np.prod(shape))
            out[i] = mine[offset:offset + n].reshape(shape)
            offset += n
        if with_scalars:
            summed = mine[offset:]
    return lay.treedef.unflatten(out), summed
