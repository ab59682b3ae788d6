"""MaxText's param tree for the maxtext engine: the model built as shapes only (`abstract_model`),
each param's keys, shape, dtype and sharding (`param_specs`), and how a scanned tree stacks the
unscanned one's layers (`scan_plan`; `unstack_layers` slices a scanned tree into them, which the
tests compare the two by).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.linen import partitioning as nn_partitioning
from jax.sharding import Mesh, PartitionSpec

DECODER, STACKED_LAYERS, LAYER_PREFIX = "decoder", "layers", "layers_"


def drop_rngs(model: nnx.Module) -> None:
    """Removes the `nnx.Rngs` MaxText layers keep from construction: with dropout off they are
    dead in the forward pass (MaxText itself drops its Dropout rngs at rate 0 for this reason)."""
    for _, node in list(nnx.iter_graph(model)):
        if isinstance(node, nnx.Module) and not isinstance(node, nnx.Rngs):
            for name, value in list(vars(node).items()):
                if isinstance(value, nnx.Rngs):
                    setattr(node, name, None)


def abstract_model(config: Any, mesh: Mesh, mode: str) -> nnx.Module:
    """MaxText's model for `mode` as shapes only, without its rngs."""
    from maxtext.utils import model_creation_utils

    create = model_creation_utils.get_nnx_create_model_fn(config, mesh=mesh, model_mode=mode)
    with nn_partitioning.axis_rules(config.logical_axis_rules):
        model = nnx.eval_shape(create)
    drop_rngs(model)
    return model


def param_specs(config: Any, mesh: Mesh) -> dict[tuple[str, ...], tuple[tuple, Any, Any, Any]]:
    """{param path as strings: (its keys, shape, dtype, PartitionSpec on `mesh`)} of MaxText's
    model for `config`."""
    from maxtext.common.common_types import MODEL_MODE_AUTOREGRESSIVE
    from maxtext.utils import sharding

    model = abstract_model(config, mesh, MODEL_MODE_AUTOREGRESSIVE)
    params = nnx.state(model, nnx.Param)
    with nn_partitioning.axis_rules(config.logical_axis_rules):
        shardings = sharding.nnx_construct_named_sharding(params, mesh)
    flat_shardings = dict(nnx.to_flat_state(shardings))
    specs = {}
    for path, var in nnx.to_flat_state(params):
        named = flat_shardings[path]
        spec = getattr(named, "spec", getattr(getattr(named, "value", None), "spec", None))
        if spec is None or all(axis is None for axis in spec):
            spec = PartitionSpec()
        specs[tuple(str(k) for k in path)] = (tuple(path), tuple(var.shape), var.dtype, spec)
    return specs


# Where each unscanned layer `decoder/layers_<i>` sits in a scanned tree: the scanned prefix
# that replaces `decoder/layers_<i>`, and its indices along the stacked axes (from
# `param_scan_axis` on, outermost first).
ScanPlan = dict[int, tuple[tuple[str, ...], tuple[int, ...]]]
GEMMA4_BLOCK = ("scanned_blocks", "local_layers", "global_layer", "layers_remainder")


def _candidate_plans(config: Any) -> list[ScanPlan]:
    """The scanned layouts MaxText 0.2.5 uses: a uniform stack (Qwen3, Qwen3 MoE), blocks of b
    layer kinds (`layers/layers_<j>`: gpt-oss), and Gemma4's blocks of five local layers and a
    global one, with local remainder layers."""
    n = config.num_decoder_layers
    plans = [{i: ((DECODER, STACKED_LAYERS), (i,)) for i in range(n)}]
    for b in (2, 3, 4, 6, 8):
        if n % b == 0:
            plans.append({i: ((DECODER, STACKED_LAYERS, f"{LAYER_PREFIX}{i % b}"), (i // b,))
                          for i in range(n)})
    blocks, local, (scanned, locals_, global_, rest) = n // 6, 5, GEMMA4_BLOCK
    gemma4: ScanPlan = {}
    for i in range(n):
        if i >= 6 * blocks:
            gemma4[i] = ((DECODER, rest, locals_), (i - 6 * blocks,))
        elif i % 6 < local:
            gemma4[i] = ((DECODER, scanned, locals_), (i // 6, i % 6))
        else:
            gemma4[i] = ((DECODER, scanned, global_), (i // 6,))
    plans.append(gemma4)
    return plans


def _scanned_shapes(unscanned: dict, plan: ScanPlan, axis: int) -> dict:
    """The scanned tree's {path: (shape, dtype)} that `plan` predicts from the unscanned one."""
    counts: dict[tuple[str, ...], list[int]] = {}
    for prefix, indices in plan.values():
        top = counts.setdefault(prefix, [0] * len(indices))
        for d, index in enumerate(indices):
            top[d] = max(top[d], index + 1)
    expected = {}
    for path, (_, shape, dtype, _) in unscanned.items():
        if len(path) > 2 and path[0] == DECODER and path[1].startswith(LAYER_PREFIX):
            i = int(path[1][len(LAYER_PREFIX):])
            prefix = plan[i][0]
            shape = list(shape)
            shape[axis:axis] = counts[prefix]
            path = (*prefix, *path[2:])
        expected[path] = (tuple(shape), dtype)
    return expected


def scan_plan(config: Any, mesh: Mesh) -> ScanPlan | None:
    """How the model's scanned param tree stacks its unscanned one (`ScanPlan`), checked leaf
    by leaf against both trees' shapes; None for an unscanned config or an unknown layout."""
    if not config.scan_layers:
        return None
    scanned = {path: (shape, dtype) for path, (_, shape, dtype, _) in
               param_specs(config, mesh).items()}
    unscanned = param_specs(config.model_copy(update={"scan_layers": False}), mesh)
    for plan in _candidate_plans(config):
        if _scanned_shapes(unscanned, plan, config.param_scan_axis) == scanned:
            return plan
    return None


def _layer_slice(leaf: Any, index: int, axis: int) -> Any:
    """Layer `index` of a stacked leaf, per device: a replicated jax Array stays a full copy
    on each of its local devices (no gather)."""
    if not isinstance(leaf, jax.Array):
        return np.take(np.asarray(leaf), index, axis=axis)
    copies = [s for s in leaf.addressable_shards if s.data.shape == leaf.shape]
    if not copies:
        if not leaf.is_fully_addressable:
            raise ValueError("a jax Array param must be replicated over this host's devices "
                             "(or fully addressable); reshard it to replicated first")
        return jnp.take(leaf, index, axis=axis)
    slices = []
    for shard in copies:  # on its own device, whatever global mesh the caller has set
        with jax.set_mesh(Mesh(np.array([shard.device]), ("local",))):
            slices.append(jnp.take(shard.data, index, axis=axis))
    devices = np.array([s.device for s in copies])
    sharding = jax.sharding.NamedSharding(Mesh(devices, ("local",)), PartitionSpec())
    shape = leaf.shape[:axis] + leaf.shape[axis + 1:]
    return jax.make_array_from_single_device_arrays(shape, sharding, slices)


def unstack_layers(flat: dict[tuple[str, ...], Any], plan: ScanPlan,
                   axis: int) -> dict[tuple[str, ...], Any]:
    """A flat scanned param tree as the unscanned one (`decoder/layers_<i>/...`), by `plan`."""
    by_prefix: dict[tuple[str, ...], list[tuple[int, tuple[int, ...]]]] = {}
    for i, (prefix, indices) in plan.items():
        by_prefix.setdefault(prefix, []).append((i, indices))
    out = {}
    for path, leaf in flat.items():
        prefix = next((p for p in by_prefix if path[:len(p)] == p), None)
        if prefix is None:
            out[path] = leaf
            continue
        for i, indices in by_prefix[prefix]:
            layer = leaf
            for index in indices:
                layer = _layer_slice(layer, index, axis)
            out[(DECODER, f"{LAYER_PREFIX}{i}", *path[len(prefix):])] = layer
    return out
