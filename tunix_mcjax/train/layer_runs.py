"""A Tunix param tree's decoder layers stored stacked, as the trainer keeps them.

Tunix's Qwen3 tree holds one subtree per layer (`layers/<i>/attn/q_proj/w`). The trainer holds
`layers/from_<s>/attn/q_proj/w` [n, ...] instead: one stack per run of consecutive layers with
the same tree, starting at layer s, n layers long. A model without LoRA is one run (`from_0`);
LoRA adapters on some layers make one run per stretch with or without them, so no layer computes
adapters it does not have. Its optimizer moments and gradients are stacked the same way, so the
step handles one leaf per stacked weight whatever the depth (as MaxText's `scan_layers`).

The functions here map any tree that holds such `layers` nodes (an `nnx.State`, a dict of arrays
or of shape structs, optax states over them): `stack` and `unstack` convert every node, and the
Tunix layout stays what users see (`unstack` for the engines, old checkpoints through `stack`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

RUN = "from_"
SHARDING_KEY = "out_sharding"  # a Variable's sharding names (nnx.get_partition_spec)


def run_key(start: int) -> str:
    return f"{RUN}{start}"


def run_start(key: str) -> int:
    return int(key[len(RUN):])


def _keys(node: Any) -> list | None:
    return list(node.keys()) if isinstance(node, Mapping) and len(node) else None


def is_runs(node: Any) -> bool:
    """A `layers` node stored stacked: every key `from_<s>`."""
    keys = _keys(node)
    return keys is not None and all(isinstance(k, str) and k.startswith(RUN) for k in keys)


def is_per_layer(node: Any) -> bool:
    """A `layers` node in Tunix's layout: every key a layer index (int, or its digits)."""
    keys = _keys(node)
    return keys is not None and all(isinstance(k, int) or (isinstance(k, str) and k.isdigit())
                                    for k in keys)


def runs(layers: Mapping) -> list[tuple[int, list[Any]]]:
    """(first layer, its layers' subtrees) per run of consecutive same-shaped layer trees."""
    out: list[tuple[int, list[Any]]] = []
    for i in sorted(int(k) for k in layers):
        tree = layers[i] if i in layers else layers[str(i)]
        if out and jax.tree.structure(out[-1][1][0]) == jax.tree.structure(tree):
            out[-1][1].append(tree)
        else:
            out.append((i, [tree]))
    return out


def ordered(stacks: Mapping) -> list[tuple[int, Any]]:
    """(first layer, stack) of a stacked `layers` node, in layer order."""
    return sorted(((run_start(k), v) for k, v in stacks.items()), key=lambda kv: kv[0])


def _is_var(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _renamed(var: nnx.Variable, value: Any, shift: int) -> nnx.Variable:
    """`var` holding `value`; its sharding names gain (shift 1) or lose (-1) the layer axis."""
    names = var.get_metadata().get(SHARDING_KEY)
    if names is None:
        return var.replace(value)
    names = (None, *names) if shift > 0 else tuple(names)[1:]
    return var.replace(value, **{SHARDING_KEY: names})


def _stacked_value(values: list[Any]) -> Any:
    """One stack [n, ...] of same-shaped arrays, laid out as they were with the layer axis in
    front unsplit; shape structs give a shape struct."""
    first = values[0]
    if isinstance(first, jax.core.Tracer):
        return jnp.stack(values)
    shape = (len(values), *first.shape)
    sharding = first.sharding if isinstance(getattr(first, "sharding", None),
                                            NamedSharding) else None
    if sharding is not None:
        sharding = NamedSharding(sharding.mesh, P(None, *sharding.spec))
    if isinstance(first, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(shape, first.dtype, sharding=sharding)
    if isinstance(first, np.ndarray):
        return np.stack(values)
    return jax.jit(lambda *xs: jnp.stack(xs), out_shardings=sharding)(*values)


def _slices(stack: Any) -> list[Any]:
    """A stack's layers, each laid out as the stack without its layer axis."""
    n = stack.shape[0]
    if isinstance(stack, jax.core.Tracer):
        return [stack[i] for i in range(n)]
    sharding = stack.sharding if isinstance(getattr(stack, "sharding", None),
                                            NamedSharding) else None
    if sharding is not None:
        if sharding.spec and sharding.spec[0] is not None:
            raise ValueError(f"a layer stack split over its layer axis ({sharding.spec}) "
                             "cannot be unstacked in place; keep the layer axis unsplit")
        sharding = NamedSharding(sharding.mesh, P(*sharding.spec[1:]))
    if isinstance(stack, jax.ShapeDtypeStruct):
        return [jax.ShapeDtypeStruct(stack.shape[1:], stack.dtype, sharding=sharding)] * n
    if isinstance(stack, np.ndarray):
        return list(stack)
    return list(jax.jit(lambda s: tuple(s[i] for i in range(n)),
                        out_shardings=(sharding,) * n if sharding else None)(stack))


def stack_layers(layers: Mapping) -> dict[str, Any]:
    """Tunix's per-layer node -> the stacked node (module docstring)."""
    out = {}
    for start, trees in runs(layers):
        flat = [jax.tree.flatten(t, is_leaf=_is_var) for t in trees]
        treedef = flat[0][1]
        leaves = []
        for column in zip(*[f[0] for f in flat], strict=True):
            first = column[0]
            if _is_var(first):
                value = _stacked_value([v.get_value() for v in column])
                leaves.append(_renamed(first, value, 1))
            else:
                leaves.append(_stacked_value(list(column)))
        out[run_key(start)] = treedef.unflatten(leaves)
    return out


def unstack_layers(stacks: Mapping) -> dict[int, Any]:
    """The stacked node -> Tunix's per-layer node (int keys, as nnx keys a layer list)."""
    out: dict[int, Any] = {}
    for start, tree in ordered(stacks):
        leaves, treedef = jax.tree.flatten(tree, is_leaf=_is_var)
        columns = [_slices(x.get_value() if _is_var(x) else x) for x in leaves]
        for j in range(len(columns[0])):
            out[start + j] = treedef.unflatten([
                _renamed(x, c[j], -1) if _is_var(x) else c[j]
                for x, c in zip(leaves, columns, strict=True)])
    return out


def _convert(tree: Any, is_node: Callable[[Any], bool], fn: Callable[[Mapping], dict]) -> Any:
    def one(node):
        if not is_node(node):
            return node
        converted = fn(node)
        return nnx.State(converted) if isinstance(node, nnx.State) else converted
    return jax.tree.map(one, tree, is_leaf=is_node)


def stack(tree: Any) -> Any:
    """`tree` with every per-layer `layers` node stacked (others as they are)."""
    return _convert(tree, _is_layers_parent, lambda n: {**n, "layers": stack_layers(n["layers"])})


def unstack(tree: Any) -> Any:
    """`tree` with every stacked `layers` node in Tunix's per-layer layout."""
    return _convert(tree, _is_stacked_parent,
                    lambda n: {**n, "layers": unstack_layers(n["layers"])})


def _is_layers_parent(node: Any) -> bool:
    return isinstance(node, Mapping) and "layers" in node and is_per_layer(node["layers"])


def _is_stacked_parent(node: Any) -> bool:
    return isinstance(node, Mapping) and "layers" in node and is_runs(node["layers"])


def has_runs(tree: Any) -> bool:
    """Whether `tree` holds a stacked `layers` node anywhere."""
    nodes = jax.tree.leaves(tree, is_leaf=_is_stacked_parent)
    return any(_is_stacked_parent(n) for n in nodes)
