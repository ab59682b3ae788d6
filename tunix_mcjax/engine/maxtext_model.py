"""MaxText's own model in its KV-cache decode modes, as the decode loop's `DecodeModel`.

The model is MaxText's `Transformer`, built from the trainer's MaxText config on a host-local
mesh, once in prefill mode and once in autoregressive mode, as `maxtext.inference.maxengine`
builds it; its `nnx.Cache` variables are passed in and out as a pure dict, so the loop owns the
cache as it owns the Qwen3 one. Per attention layer MaxText keeps a prefill cache (the prompt,
`max_prefill_predict_length` slots) and an autoregressive ring (`max_target_length -
max_prefill_predict_length` slots, one write index shared by all rows); segment ids mark the
valid slots of each row, positions come from the caller, so rows decode at their own positions.
Admitting a request into a row copies the prompt's prefill cache into the row and clears the
row's ring segment ids, as maxengine's `insert` does. The ring has one slot per new token of the
program, and a request feeds at most max_new - 1 tokens back, so wherever the shared index stands
when it is admitted, it never overwrites its own entries. Prefill runs MaxText's batch-1 prefill
vectorised over the distinct prompts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.linen import partitioning as nn_partitioning
from jax.sharding import Mesh, PartitionSpec

from tunix_mcjax.engine.paged_attention import SplitPages

# MaxText 0.2.5's names of its KVCache variables (maxtext/inference/kvcache.py) by what a new
# request does to them.
PROMPT_VARS = frozenset({"cached_prefill_key", "cached_prefill_value", "cache_prefill_segment_id",
                         "cached_prefill_key_scale", "cached_prefill_value_scale"})
CLEARED_VARS = frozenset({"cache_ar_segment_id", "cached_ar_lengths"})
RING_VARS = frozenset({"cached_ar_key", "cached_ar_value", "cached_ar_key_scale",
                       "cached_ar_value_scale", "cache_ar_index"})
CACHE_BATCH = "cache_batch"
DECODER, STACKED_LAYERS, LAYER_PREFIX = "decoder", "layers", "layers_"
TENSOR_AXIS = "tensor"


def local_mesh(config: Any, devices: np.ndarray) -> Mesh:
    """MaxText's mesh axes over one replica's devices [1, tp]: all on "tensor" (heads split)."""
    axes = tuple(config.mesh_axes)
    shape = [devices.size if axis == TENSOR_AXIS else 1 for axis in axes]
    return Mesh(np.asarray(devices).reshape(shape), axes)


def decode_config(config: Any, *, batch: int, prompt_len: int, max_new: int,
                  weight_dtype: str | None = None) -> Any:
    """The trainer's MaxText config with the decode cache's shape: `batch` rows, a prefill cache
    of `prompt_len` slots and a ring of `max_new` (and the engine's weight dtype)."""
    update: dict[str, Any] = {"max_prefill_predict_length": prompt_len,
                              "max_target_length": prompt_len + max_new,
                              "micro_batch_size_to_train_on": batch}
    if weight_dtype:
        update["weight_dtype"] = weight_dtype
    return config.model_copy(update=update)


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


def _logical_axes(var: nnx.Variable) -> tuple[str, ...]:
    meta = var.get_metadata()
    axes = meta.get("out_sharding") or meta.get("sharding") or meta.get("sharding_names") or ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


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


def stacked_layers(config: Any, mesh: Mesh) -> bool:
    """Whether the scanned tree is a uniform stack of the unscanned one."""
    plan = scan_plan(config, mesh)
    return plan is not None and plan[0][0] == (DECODER, STACKED_LAYERS)


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


class MaxTextDecodeModel:
    """`DecodeModel` over MaxText's prefill and autoregressive modes, for the cache shape of
    `config` (a `decode_config`)."""

    def __init__(self, config: Any, mesh: Mesh):
        from maxtext.common.common_types import MODEL_MODE_AUTOREGRESSIVE, MODEL_MODE_PREFILL

        self.modes = (MODEL_MODE_PREFILL, MODEL_MODE_AUTOREGRESSIVE)
        self.rules = config.logical_axis_rules
        prefill = abstract_model(config, mesh, MODEL_MODE_PREFILL)
        decode = abstract_model(config, mesh, MODEL_MODE_AUTOREGRESSIVE)
        self.prefill_graph, _, prefill_cache = nnx.split(prefill, nnx.Param, nnx.Cache)
        self.decode_graph, _, decode_cache = nnx.split(decode, nnx.Param, nnx.Cache)
        self.prefill_cache = nnx.to_pure_dict(prefill_cache)
        self.decode_cache = nnx.to_pure_dict(decode_cache)
        axes = jax.tree.map(_logical_axes, decode_cache,
                            is_leaf=lambda v: isinstance(v, nnx.Variable))
        self.batch_axes = jax.tree.map(
            lambda a: a.index(CACHE_BATCH) if CACHE_BATCH in a else -1,
            nnx.to_pure_dict(axes), is_leaf=lambda a: isinstance(a, tuple))
        unknown = {_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(self.decode_cache)[0]}
        unknown -= PROMPT_VARS | CLEARED_VARS | RING_VARS
        if unknown:
            raise ValueError(f"MaxText's decode cache has variables the maxtext engine does not "
                             f"know how to fill for a new request: {sorted(unknown)}")

    def _run(self, graph: Any, params: Any, cache: Any, tokens: jax.Array, positions: jax.Array,
             mode: str, segment_ids: jax.Array | None = None) -> tuple[jax.Array, Any]:
        model = nnx.merge(graph, params, cache, copy=True)
        with nn_partitioning.axis_rules(self.rules):
            logits = model(tokens, positions, decoder_segment_ids=segment_ids, model_mode=mode,
                           enable_dropout=False)
        return logits.astype(jnp.float32), nnx.to_pure_dict(nnx.state(model, nnx.Cache))

    def prefill(self, params, prompts, lengths):
        """One prompt at a time as MaxText's prefill runs (batch 1: its scanned blocks carry a
        batch-1 cache), vectorised over prompts: store leaves are [U, *batch-1 cache leaf]."""
        t = prompts.shape[1]
        positions = jnp.arange(t, dtype=jnp.int32)[None]
        empty = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), self.prefill_cache)

        def one(tokens, length):
            segment_ids = (positions < length).astype(jnp.int32)
            logits, cache = self._run(self.prefill_graph, params, empty, tokens[None], positions,
                                      self.modes[0], segment_ids)
            return logits[0, length - 1], cache

        return jax.vmap(one)(prompts, lengths)

    def rows(self, store, prompt_ids):
        def row_leaf(path, template, stored, axis):
            if _name(path) in PROMPT_VARS:
                picked = jnp.take(stored, prompt_ids, axis=0)
                return jnp.squeeze(jnp.moveaxis(picked, 0, axis + 1), axis)
            return jnp.zeros(template.shape, template.dtype)

        return jax.tree_util.tree_map_with_path(row_leaf, self.decode_cache, store,
                                                self.batch_axes)

    def admit(self, cache, store, slot, prompt):
        def admit_leaf(path, current, stored, axis):
            name = _name(path)
            if name in PROMPT_VARS:
                row = jax.lax.dynamic_index_in_dim(stored, prompt, 0, keepdims=False)
            elif name in CLEARED_VARS:
                row = jnp.zeros_like(jax.lax.dynamic_index_in_dim(current, 0, axis, keepdims=True))
            else:
                return current
            return jax.lax.dynamic_update_index_in_dim(current, row.astype(current.dtype), slot,
                                                       axis)

        return jax.tree_util.tree_map_with_path(admit_leaf, cache, store, self.batch_axes)

    def decode_step(self, params, cache, tokens, positions):
        logits, cache = self._run(self.decode_graph, params, cache, tokens[:, None],
                                  positions[:, None], self.modes[1])
        return logits[:, 0], cache


def _name(path: tuple) -> str:
    last = path[-1]
    return str(getattr(last, "key", last))


# ----- MaxText's model over our page pool ------------------------------------------------------


class _PagedCall:
    """What one forward of `MaxTextPagedModel` shares with its layers' attention: the rows, the
    page layout, and the pool (a list over KV slots), which each writing layer replaces."""

    def __init__(self, layout: Any, pool: list[Any], rows: Any):
        self.layout, self.pool, self.rows = layout, list(pool), rows


@dataclasses.dataclass(frozen=True)
class PagedAttentionOp:
    """Stands in for one layer's MaxText `AttentionOp` (called as MaxText's training forward
    calls it, on the layer's rotated, normed and scaled q/k/v): writes the layer's new keys and
    values into its pages, unless the layer reads a donor's (Gemma4's KV-shared layers), and
    attends over the pages as `AttentionOp` does in training: causal, its sliding window by
    token position (LOCAL_SLIDING layers), its sinks, no further score scale. A frozen
    dataclass, so that nnx keeps it in the layer's graph as a static attribute."""

    call: _PagedCall
    slot: int
    writes: bool
    window: int | None
    soft_cap: float | None

    def __call__(self, query, key, value, decoder_segment_ids=None, inputs_positions=None,
                 model_mode=None, cached_values=None, previous_chunk=None,
                 bidirectional_mask=None, sinks=None, **unused: Any):
        call, rows = self.call, self.call.rows
        layer = call.pool[self.slot]
        if self.writes:
            layer = call.layout.write(layer, rows.write_pages, rows.write_offsets, key, value)
            call.pool[self.slot] = layer
        out = call.layout.attend(query, layer, rows.tables, rows.kv_lens, rows.q_lens,
                                 window=self.window, sinks=sinks, scale=1.0,
                                 soft_cap=self.soft_cap)
        return out.astype(query.dtype)


def _layer_index(path: tuple) -> int | None:
    for key in path:
        name = str(key)
        if name.startswith(LAYER_PREFIX) and name[len(LAYER_PREFIX):].isdigit():
            return int(name[len(LAYER_PREFIX):])
    return None


def attention_layers(model: nnx.Module) -> list[tuple[int, nnx.Module]]:
    """(decoder layer index, its MaxText `Attention` module), in layer order, of an unscanned
    model."""
    from maxtext.layers.attention_op import AttentionOp

    found = []
    for path, node in nnx.iter_graph(model):
        if isinstance(getattr(node, "attention_op", None), AttentionOp):
            index = _layer_index(path)
            if index is None:
                raise ValueError(f"MaxText attention at {'/'.join(map(str, path))} is not in an "
                                 "unscanned decoder layer (layers_<i>): the paged maxtext "
                                 "engine decodes unscanned layers")
            found.append((index, node))
    found.sort(key=lambda item: item[0])
    if [i for i, _ in found] != list(range(len(found))):
        raise ValueError("expected one MaxText attention per decoder layer")
    return found


def kv_slots(config: Any, layers: list[tuple[int, nnx.Module]]) -> list[int]:
    """The pool slot of each layer's keys and values: its own, or for a KV-shared layer
    (Gemma4 E2B/E4B) its donor's, as MaxText's serving path maps them."""
    if not any(getattr(attn, "share_kv_layer", False) for _, attn in layers):
        return list(range(len(layers)))
    from maxtext.models import gemma4_small

    types = gemma4_small.build_layer_types(config.num_decoder_layers, config.model_name)
    slot_of = gemma4_small.kv_cache_slot_map(types, config.num_kv_shared_layers)
    return [slot_of[i] for i in range(len(layers))]


@dataclasses.dataclass(frozen=True)
class _LayerAttention:
    slot: int
    writes: bool
    window: int | None
    soft_cap: float | None
    kv_heads: int
    head_dim: int


def _layer_attention(attn: nnx.Module, slot: int, own_slot: bool) -> _LayerAttention:
    from maxtext.common.common_types import AttentionType

    op = attn.attention_op
    kind = getattr(op, "attention_type", AttentionType.GLOBAL)
    if kind not in (AttentionType.GLOBAL, AttentionType.LOCAL_SLIDING):
        raise ValueError(f"MaxText attention type {kind} has no paged decode (global and "
                         "local sliding layers do)")
    if getattr(op, "chunk_attn_window_size", None) and kind != AttentionType.LOCAL_SLIDING:
        raise ValueError("chunked attention has no paged decode")
    window = op.sliding_window_size if kind == AttentionType.LOCAL_SLIDING else None
    return _LayerAttention(slot, own_slot, window or None, op.attn_logits_soft_cap or None,
                           int(attn.num_kv_heads), int(attn.head_dim))


class MaxTextPagedModel:
    """MaxText's model as the paged loop's `DecodeModel`: its training forward (MODEL_MODE_TRAIN,
    no cache variables, MaxText's own projections, norms, RoPE, MoE and output head), unscanned,
    with each layer's `AttentionOp` replaced by `PagedAttentionOp` over our page pool. The
    pool is a list over KV slots (one per layer, KV-shared layers read their donor's), each in
    `layout`, with that layer's kv heads and head dim (Gemma4's global layers differ); kv heads
    split over "tensor" where they divide."""

    def __init__(self, config: Any, mesh: Mesh, layout: Any):
        from maxtext.common.common_types import MODEL_MODE_TRAIN

        if config.scan_layers:
            raise ValueError("the paged maxtext engine decodes an unscanned model "
                             "(scan_layers=false; a uniform stack is unstacked for it)")
        self.config, self.mesh, self.layout, self.mode = config, mesh, layout, MODEL_MODE_TRAIN
        self.rules = config.logical_axis_rules
        model = abstract_model(config, mesh, MODEL_MODE_TRAIN)
        self.graph, _ = nnx.split(model, nnx.Param)
        layers = attention_layers(model)
        slots = kv_slots(config, layers)
        self.layers = [_layer_attention(attn, slot, slot not in slots[:i])
                       for i, ((_, attn), slot) in enumerate(zip(layers, slots, strict=True))]
        self.slot_shapes = {a.slot: (a.kv_heads, a.head_dim) for a in self.layers if a.writes}
        self.dtype = jnp.dtype(config.dtype)

    def page_bytes(self, page_size: int, tp: int) -> int:
        """Bytes of one page over every slot, per device (kv heads split over `tp` where they
        divide)."""
        return sum(page_size * 2 * k * h * self.dtype.itemsize // (tp if k % tp == 0 else 1)
                   for k, h in self.slot_shapes.values())

    def _specs(self) -> list[Any]:
        tp = self.mesh.shape[TENSOR_AXIS]
        specs = []
        for slot in sorted(self.slot_shapes):
            heads = TENSOR_AXIS if self.slot_shapes[slot][0] % tp == 0 else None
            split = isinstance(self.layout, SplitPages)  # [K, P, page, H]; else [P, page, 2K, H]
            specs.append(PartitionSpec(heads, None, None, None) if split
                         else PartitionSpec(None, None, heads, None))
        return specs

    def _shard(self, pool: list[Any]) -> list[Any]:
        out = []
        for layer, spec in zip(pool, self._specs(), strict=True):
            sharding = jax.sharding.NamedSharding(self.mesh, spec)
            out.append(jax.tree.map(lambda x, s=sharding: jax.lax.with_sharding_constraint(x, s),
                                    layer))
        return out

    def empty_pool(self, num_pages: int, page_size: int) -> list[Any]:
        def make():
            return [self.layout.empty(num_pages, page_size, *self.slot_shapes[slot], self.dtype)
                    for slot in sorted(self.slot_shapes)]

        shardings = [jax.sharding.NamedSharding(self.mesh, spec) for spec in self._specs()]
        shardings = [jax.tree.map(lambda _, s=s: s, layer) for s, layer in
                     zip(shardings, jax.eval_shape(make), strict=True)]
        return jax.jit(make, out_shardings=shardings)()

    def forward(self, params: Any, pool: list[Any], rows: Any) -> tuple[jax.Array, list[Any]]:
        call = _PagedCall(self.layout, pool, rows)
        model = nnx.merge(self.graph, params, copy=True)
        for (_, attn), layer in zip(attention_layers(model), self.layers, strict=True):
            attn.attention_op = PagedAttentionOp(call, layer.slot, layer.writes, layer.window,
                                                 layer.soft_cap)
        with nn_partitioning.axis_rules(self.rules):
            logits = model(rows.tokens, rows.positions, decoder_segment_ids=None,
                           model_mode=self.mode, enable_dropout=False)
        logits = logits[jnp.arange(rows.tokens.shape[0]), rows.logit_cols]
        return logits.astype(jnp.float32), self._shard(call.pool)

    def copy_page(self, pool: list[Any], source: jax.Array, target: jax.Array) -> list[Any]:
        return [self.layout.copy_page(layer, source, target) for layer in pool]
