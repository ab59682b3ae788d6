"""MaxText's own model as the paged decode loop's `DecodeModel` (`MaxTextPagedModel`).

The model is MaxText's `Transformer`, built from the trainer's MaxText config on a host-local
mesh, in its training mode (no cache variables): MaxText's own embeddings, projections, norms,
RoPE, MoE and output head, so it is the forward the trainer scores with. Only attention is ours:
each layer's `AttentionOp` is replaced, per call, by `PagedAttentionOp`, which writes the layer's
keys and values into our page pool and attends over it (`engine.paged_attention`) with the
layer's sliding window (by token position), sinks and soft cap; Gemma4's KV-shared layers read
their donor's pages. Each KV slot has its page layout: on TPU the Pallas kernel's, attended by
XLA for layers with sinks or heads the kernel does not take (`slot_layouts`); on TPU the expert
kernels are padded to whole lanes where their layout would otherwise be copied
(`maxtext_tpu`). A scanned tree decodes as MaxText stacks it (`maxtext_tree.scan_plan` finds
how), one `lax.scan` over its layers in place of MaxText's own layer scan, which has no seat for
a pool (`_LayerSeam`). Quantized kernels (`maxtext_quantize`) are dequantized where a layer
runs: inside the scan's body for a scanned tree.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.linen import partitioning as nn_partitioning
from jax.sharding import Mesh, PartitionSpec

from tunix_mcjax.engine import pages
from tunix_mcjax.engine.maxtext_quantize import merge_view
from tunix_mcjax.engine.maxtext_scan import scan_layout, subtree, take
from tunix_mcjax.engine.maxtext_tpu import expert_major
from tunix_mcjax.engine.maxtext_tree import (
    LAYER_PREFIX,
    abstract_model,
    scan_plan,
)
from tunix_mcjax.engine.paged_attention import (
    KERNEL_HEAD_DIM,
    CombinedPages,
    QuantizedPages,
    SplitPages,
)
from tunix_mcjax.engine.quantize import dequantize_tree

TENSOR_AXIS = "tensor"


def local_mesh(config: Any, devices: np.ndarray) -> Mesh:
    """MaxText's mesh axes over one replica's devices [1, tp]: all on "tensor" (heads split)."""
    axes = tuple(config.mesh_axes)
    shape = [devices.size if axis == TENSOR_AXIS else 1 for axis in axes]
    return Mesh(np.asarray(devices).reshape(shape), axes)


def decode_config(config: Any, *, batch: int, prompt_len: int, max_new: int,
                  weight_dtype: str | None = None) -> Any:
    """The trainer's MaxText config for the engine's model: its lengths (`prompt_len` prompt
    tokens, `max_new` new), `batch` rows and the engine's weight dtype."""
    # No iota embedding: as a one-hot matmul it takes [tokens, vocab] (7 GiB for Gemma4's
    # 262144-token vocabulary at a 4096-token prefill) where a gather takes the rows.
    update: dict[str, Any] = {"max_prefill_predict_length": prompt_len,
                              "max_target_length": prompt_len + max_new,
                              "micro_batch_size_to_train_on": batch, "use_iota_embed": False}
    if weight_dtype:
        update["weight_dtype"] = weight_dtype
    return config.model_copy(update=update)


# ----- MaxText's model over our page pool ------------------------------------------------------


def kv_mode_of(layout: Any) -> str:
    """The `kv_quantization` mode of a layout's pages ("" unquantized): a scale per token and
    head (`QuantizedPages`), or one static scale (`kv_quant_axis=tensor`: `kv_scale`)."""
    if isinstance(layout, QuantizedPages):
        return layout.mode
    scale = getattr(layout, "kv_scale", None)
    return "" if scale is None else next(m for m in pages.KV_TENSOR_MODES
                                         if pages.KV_MODES[m] == scale.dtype)


class _PagedCall:
    """What one forward of `MaxTextPagedModel` shares with its layers' attention: the rows, each
    pool stack's page layout, and the pool (a list over stacks), which each writing layer
    replaces; and, with routing recorded, the experts of every MoE layer once they ran."""

    def __init__(self, layouts: list[Any], pool: list[Any], rows: Any):
        self.layouts, self.pool, self.rows = layouts, list(pool), rows
        self.routing: jax.Array | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class PagedAttentionOp:
    """Stands in for one layer's MaxText `AttentionOp` (called as MaxText's training forward
    calls it, on the layer's rotated, normed and scaled q/k/v): writes the layer's new keys and
    values into its pages, unless the layer reads a donor's (Gemma4's KV-shared layers), and
    attends over the pages as `AttentionOp` does in training: causal, its sliding window by
    token position (LOCAL_SLIDING layers), its sinks, no further score scale. Its pages are
    layer `index` (an int, or traced inside the layer scan) of pool stack `stack`. A frozen
    dataclass, so that nnx keeps it in the layer's graph as a static attribute."""

    call: _PagedCall
    stack: int
    index: Any
    writes: bool
    window: int | None
    soft_cap: float | None

    def __call__(self, query, key, value, decoder_segment_ids=None, inputs_positions=None,
                 model_mode=None, cached_values=None, previous_chunk=None,
                 bidirectional_mask=None, sinks=None, **unused: Any):
        call, rows = self.call, self.call.rows
        pool, layout = call.pool[self.stack], call.layouts[self.stack]
        if self.writes:
            pool = layout.write(pool, rows.write_pages, rows.write_offsets, key, value,
                                layer=self.index)
            call.pool[self.stack] = pool
        out = layout.attend(query, pool, rows.tables, rows.kv_lens, rows.q_lens,
                            prefix=rows.prefix, window=self.window, sinks=sinks, scale=1.0,
                            soft_cap=self.soft_cap, layer=self.index)
        return out.astype(query.dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class _AtColumns:
    """MaxText's decoder output head on one column per row of the final hidden states."""

    head: Any
    columns: jax.Array

    def __call__(self, shared_embedding, y, *args, **kwargs):
        y = y[jnp.arange(y.shape[0]), self.columns][:, None]
        return self.head(shared_embedding, y, *args, **kwargs)


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
    sinks: bool  # gpt-oss's per-head sink logits


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
                           int(attn.num_kv_heads), int(attn.head_dim),
                           getattr(attn, "sinks", None) is not None)


class CombinedXlaPages(CombinedPages):
    """CombinedPages' pool `[pages, page_size, 2 * kv_heads, head_dim]`, attended by XLA as
    SplitPages attends its gathered pages: TPU pages for the slots JAX's kernel cannot take.
    Token-major pages are what XLA's TPU scatter writes in place; over SplitPages'
    `[kv_heads, pages, page_size, head_dim]` it kept a relaid-out copy of every layer's pool
    (tokens major) and gathered pages from another copy (`[kv_heads * pages, page * head_dim]`
    rows): 77 of the 86 GiB of temporaries at 6 of Gemma4-26B's layers, over a 65 GiB pool."""

    attend_shared = SplitPages.attend_shared
    attend_own = SplitPages.attend_own

    @staticmethod
    def kv_heads_of(pool) -> int:
        return pool.shape[-2] // 2

    @staticmethod
    def page_size_of(pool) -> int:
        return pool.shape[-3]

    def attend(self, q, pool, tables, kv_lens, q_lens, *, layer=None, **options):
        """SplitPages' attention over layer `layer`'s pages, sliced before its page-count
        switch: XLA's TPU gather relays its operand out head-major, and over the stacked pool
        inside the switch it copied every layer's pages (twice: gpt-oss-20b's 24-layer pool
        added 10.5 GiB of temporaries), over the slice one layer's."""
        if layer is not None:
            pool = jax.lax.dynamic_index_in_dim(pool, layer, 0, keepdims=False)
        return SplitPages.attend(self, q, pool, tables, kv_lens, q_lens, **options)


def slot_layouts(layout: Any, layers: list[_LayerAttention]) -> dict[int, Any]:
    """Each KV slot's page layout: `layout`, except where it is `CombinedPages` (JAX's TPU
    kernel, which has no attention sinks and compiles for KERNEL_HEAD_DIM heads only) for a
    slot that a layer with sinks reads (gpt-oss's) or whose heads are of another width
    (Gemma4's 256 and 512): that slot's pages are `CombinedXlaPages`, the kernel's pages
    attended by XLA; on a tensor-parallel replica, also a slot whose kv heads do not divide
    by its devices (the kernel runs on each device's whole kv heads)."""
    tp = layout.mesh.shape[layout.heads_axis] if isinstance(layout, CombinedPages) and \
        layout.mesh is not None else 1
    unfit = {a.slot for a in layers
             if a.sinks or a.head_dim != KERNEL_HEAD_DIM or a.kv_heads % tp}
    return {a.slot: CombinedXlaPages() if isinstance(layout, CombinedPages) and a.slot in unfit
            else layout for a in layers if a.writes}


def routed_moes(model: nnx.Module) -> list[nnx.Module]:
    """MaxText's routed MoE modules of an unscanned model, in decoder layer order."""
    from maxtext.layers.moe import RoutedMoE

    found = [(_layer_index(path), node) for path, node in nnx.iter_graph(model)
             if isinstance(node, RoutedMoE)]
    return [node for _, node in sorted(found, key=lambda item: item[0])]


def check_replay_patch() -> None:
    """Refuses to record routing on a MaxText without patches/maxtext/0004."""
    from maxtext.layers.moe import RoutedMoE

    if not hasattr(RoutedMoE, "record_routed_experts"):
        raise ValueError("moe_router_replay needs MaxText's MoE layer to report its routing "
                         "(patches/maxtext/0004); fix: python -m tunix_mcjax.patches apply "
                         "maxtext")


def recorded_routing(moes: list[nnx.Module]) -> jax.Array:
    """The experts each MoE module sowed in the call just run (patches/maxtext/0004), int32
    [R, C, layers, k]."""
    return jnp.stack([moe.routed_experts.get_value()[0] for moe in moes], axis=2)


def same_layer(a: Any, b: Any) -> bool:
    """Whether two layers' graphdefs describe the same module: equal but for the init
    functions each layer was built with (closures made per layer, equal in what they do)."""
    if a.nodes != b.nodes or len(a.attributes) != len(b.attributes):
        return False
    for (key_a, value_a), (key_b, value_b) in zip(a.attributes, b.attributes, strict=True):
        if key_a != key_b:
            return False
        if value_a == value_b:
            continue
        fn_a, fn_b = (getattr(v, "value", v) for v in (value_a, value_b))
        fn_a, fn_b = (getattr(f, "func", f) for f in (fn_a, fn_b))  # functools.partial
        if not (callable(fn_a) and callable(fn_b)
                and getattr(fn_a, "__qualname__", 0) == getattr(fn_b, "__qualname__", 1)):
            return False
    return True


def modules_of(layer: nnx.Module, kind: type) -> list[nnx.Module]:
    """The modules of class `kind` in one layer, in graph order."""
    return [node for _, node in nnx.iter_graph(layer) if isinstance(node, kind)]


@dataclasses.dataclass(frozen=True)
class PoolStack:
    """One array of the pool: `count` layers' pages in `layout`, kv heads x head dim each."""

    layout: Any
    kv_heads: int
    head_dim: int
    count: int


def pool_stacks(layers: list[_LayerAttention], layouts: dict[int, Any]
                ) -> tuple[list[PoolStack], list[tuple[int, int]]]:
    """The pool's stacks, one per (kv heads, head dim, layout) in layer order, and each
    layer's pages in them: (stack, index) of its own KV slot or its donor's."""
    kinds: dict[tuple, int] = {}
    counts: list[int] = []
    place_of: dict[int, tuple[int, int]] = {}
    for a in layers:
        if not a.writes:
            continue
        layout = layouts[a.slot]
        kind = (a.kv_heads, a.head_dim, type(layout), tuple(sorted(vars(layout).items())))
        stack = kinds.setdefault(kind, len(kinds))
        if stack == len(counts):
            counts.append(0)
        place_of[a.slot] = (stack, counts[stack])
        counts[stack] += 1
    stacks = [None] * len(kinds)
    for (heads, head_dim, *_), stack in kinds.items():
        layout = next(layouts[s] for s, (k, _) in place_of.items() if k == stack)
        stacks[stack] = PoolStack(layout, heads, head_dim, counts[stack])
    return stacks, [place_of[a.slot] for a in layers]


class MaxTextPagedModel:
    """MaxText's model as the paged loop's `DecodeModel`: its training forward (MODEL_MODE_TRAIN,
    no cache variables, MaxText's own projections, norms, RoPE, MoE and output head), with each
    layer's `AttentionOp` replaced by `PagedAttentionOp` over our page pool.

    A scanned tree (`scan_plan`) is decoded as it is stacked, its leaves held layer-major
    (`maxtext_scan.layer_major`): one `lax.scan` runs a block of layers per iteration (one
    layer of a uniform stack, gpt-oss's two kinds, Gemma4's five local and one global), each
    the unscanned model's layer module over that iteration's slice of the stacks, in place of
    MaxText's own layer scan; Gemma4's remainder layers run unrolled after it. An unscanned
    tree runs MaxText's unscanned forward. Each KV slot (one per layer; KV-shared layers read
    their donor's) has its layout (`slot_layouts` of `layout`; `layouts`, {slot: layout}, sets
    them instead) and that layer's kv heads and head dim (Gemma4's global layers differ); the
    pool stacks the slots of one kind (`pool_stacks`) and is carried through the scan, each
    layer writing its pages in place. Kv heads are split over "tensor" where they divide. With
    `record_routing`, each call also returns the experts every token went to
    (`routing_shape`: MoE layers, top-k)."""

    def __init__(self, config: Any, mesh: Mesh, layout: Any, *,
                 expert_minor_keys: set[tuple] = frozenset(),
                 layouts: dict[int, Any] | None = None, record_routing: bool = False):
        from maxtext.common.common_types import MODEL_MODE_TRAIN

        self.config, self.mesh, self.mode = config, mesh, MODEL_MODE_TRAIN
        self.expert_minor_keys = expert_minor_keys  # params stored [embed, experts, mlp]
        self._pool_makers: dict[tuple[int, int], Any] = {}
        self.rules = config.logical_axis_rules
        plan = scan_plan(config, mesh)
        if config.scan_layers and plan is None:
            raise ValueError(
                f"the maxtext engine does not know how {config.model_name}'s scanned layers "
                "stack its unscanned ones (maxtext_tree.scan_plan); set scan_layers=false")
        self.scan = scan_layout(plan, config.num_decoder_layers)
        unscanned = abstract_model(config.model_copy(update={"scan_layers": False}), mesh,
                                   MODEL_MODE_TRAIN)
        model = abstract_model(config, mesh, MODEL_MODE_TRAIN) if plan else unscanned
        self.graph, _ = nnx.split(model, nnx.Param)
        self.templates = self._templates(unscanned) if plan else []
        layers = attention_layers(unscanned)
        slots = kv_slots(config, layers)
        self.layers = [_layer_attention(attn, slot, slot not in slots[:i])
                       for i, ((_, attn), slot) in enumerate(zip(layers, slots, strict=True))]
        self.slot_shapes = {a.slot: (a.kv_heads, a.head_dim) for a in self.layers if a.writes}
        self.layouts = slot_layouts(layout, self.layers) if layouts is None else dict(layouts)
        if self.layouts.keys() != self.slot_shapes.keys():
            raise ValueError(f"layouts must name every KV slot {sorted(self.slot_shapes)}, "
                             f"not {sorted(self.layouts)}")
        self.stacks, self.places = pool_stacks(self.layers, self.layouts)
        self.scan_table = self._scan_table()
        self.dtype = jnp.dtype(config.dtype)
        self.weight_dtype = jnp.dtype(config.weight_dtype)
        self.routing_shape = None
        if record_routing:
            check_replay_patch()
            self.routing_shape = (len(routed_moes(unscanned)), int(config.num_experts_per_tok))
            if not self.routing_shape[0]:
                raise ValueError(f"{config.model_name} has no routed MoE layers: there is no "
                                 "routing to record (moe_router_replay needs an MoE family)")

    def _templates(self, unscanned: nnx.Module) -> list[Any]:
        """Each unscanned layer's graphdef with its params split off; a scanned layer's must be
        its block position's."""
        graphs = [nnx.split(getattr(unscanned.decoder, f"{LAYER_PREFIX}{i}"), nnx.Param)[0]
                  for i in range(self.config.num_decoder_layers)]
        block = self.scan.block
        for i in range(self.scan.scanned):
            if not same_layer(graphs[i], graphs[i % block]):
                raise ValueError(f"decoder layer {i} is not the same module as layer "
                                 f"{i % block}, which the layer scan runs in its place")
        return graphs

    def _scan_table(self) -> np.ndarray:
        """int32 [blocks, block]: the pool index of each scanned layer's pages (its stack is
        its block position's)."""
        block, blocks = self.scan.block, self.scan.blocks
        table = np.zeros((blocks, block), np.int32)
        for i in range(self.scan.scanned):
            stack, index = self.places[i]
            if stack != self.places[i % block][0]:
                raise ValueError(f"decoder layer {i}'s pages are not in the pool stack of "
                                 f"layer {i % block}, which the layer scan runs in its place: "
                                 "give a block position's layers one layout")
            table[i // block, i % block] = index
        return table

    def page_bytes(self, page_size: int, tp: int) -> int:
        """Bytes of one page over every slot, per device (kv heads split over `tp` where they
        divide); a quantized slot's values take a byte each, plus its scales."""
        return sum(pages.page_bytes(1, k, h, page_size, self.dtype.itemsize,
                                    tp if k % tp == 0 else 1, kv_mode_of(self.layouts[slot]))
                   for slot, (k, h) in self.slot_shapes.items())

    def pool_specs(self) -> list[Any]:
        """Each pool stack's partition on the replica mesh: kv heads over "tensor" where they
        divide."""
        tp = self.mesh.shape[TENSOR_AXIS]
        specs = []
        for stack in self.stacks:
            heads = TENSOR_AXIS if stack.kv_heads % tp == 0 else None
            # [K, L, P, page, H]; else [L, P, page, 2K, H]
            split = isinstance(stack.layout, SplitPages)
            specs.append(PartitionSpec(heads, None, None, None, None) if split
                         else PartitionSpec(None, None, None, heads, None))
        return specs

    def _shard(self, pool: list[Any]) -> list[Any]:
        out = []
        for stack, spec in zip(pool, self.pool_specs(), strict=True):
            sharding = jax.sharding.NamedSharding(self.mesh, spec)
            out.append(jax.tree.map(lambda x, s=sharding: jax.lax.with_sharding_constraint(x, s),
                                    stack))
        return out

    def make_pool(self, num_pages: int, page_size: int) -> list[Any]:
        """The empty pool: a list over stacks, each `[layers, ...]` in its layout."""
        return [s.layout.empty(num_pages, page_size, s.kv_heads, s.head_dim, self.dtype,
                               layers=s.count) for s in self.stacks]

    def empty_pool(self, num_pages: int, page_size: int) -> list[Any]:
        if (num_pages, page_size) not in self._pool_makers:  # compiled once per pool shape
            def make():
                return self.make_pool(num_pages, page_size)

            shardings = [jax.sharding.NamedSharding(self.mesh, spec) for spec in self.pool_specs()]
            shardings = [jax.tree.map(lambda _, s=s: s, stack) for s, stack in
                         zip(shardings, jax.eval_shape(make), strict=True)]
            self._pool_makers[num_pages, page_size] = jax.jit(make, out_shardings=shardings)
        return self._pool_makers[num_pages, page_size]()

    def forward(self, params: Any, pool: list[Any], rows: Any) -> tuple[jax.Array, list[Any]]:
        call = _PagedCall([s.layout for s in self.stacks], pool, rows)
        if self.templates:
            merged = merge_view(params, self.weight_dtype, self.scan.scanned_prefixes)
            model = nnx.merge(self.graph, merged, copy=True)
            _LayerSeam(functools.partial(self._run_layers, params, call)).install(model.decoder)
            moes = []
        else:
            merged = merge_view(params, self.weight_dtype, ())
            model = nnx.merge(self.graph, expert_major(merged, self.expert_minor_keys), copy=True)
            for (_, attn), i in zip(attention_layers(model), range(len(self.layers)), strict=True):
                attn.attention_op = self._paged_op(call, i, self.places[i][1])
            moes = routed_moes(model) if self.routing_shape else []
            for moe in moes:
                moe.record_routed_experts = True
        # Only each row's logit column goes through the output head: [R, V], not [R, C, V].
        decoder = model.decoder
        decoder.apply_output_head = _AtColumns(decoder.apply_output_head, rows.logit_cols)
        with nn_partitioning.axis_rules(self.rules):
            logits = model(rows.tokens, rows.positions, decoder_segment_ids=None,
                           model_mode=self.mode, enable_dropout=False)
        out = logits[:, 0].astype(jnp.float32), self._shard(call.pool)
        if moes:
            call.routing = recorded_routing(moes)
        return out if self.routing_shape is None else (*out, call.routing)

    def _paged_op(self, call: _PagedCall, layer: int, index: Any) -> PagedAttentionOp:
        a = self.layers[layer]
        return PagedAttentionOp(call, self.places[layer][0], index, a.writes, a.window,
                                a.soft_cap)

    def _run_layer(self, call: _PagedCall, layer: int, index: Any, prefix: tuple,
                   params: Any, y: jax.Array, args: tuple, kwargs: dict):
        """Decoder layer `layer`'s module (its template) over `params`, its pages at pool
        index `index`: (its output, the experts it routed to or None)."""
        from maxtext.layers.attention_op import AttentionOp
        from maxtext.layers.moe import RoutedMoE

        params = dequantize_tree(params, self.weight_dtype)  # quantized kernels, if any
        module = nnx.merge(self.templates[layer],
                           expert_major(params, self.expert_minor_keys, prefix))
        [attn] = [node for node in modules_of(module, nnx.Module)
                  if isinstance(getattr(node, "attention_op", None), AttentionOp)]
        attn.attention_op = self._paged_op(call, layer, index)
        moes = modules_of(module, RoutedMoE) if self.routing_shape else []
        for moe in moes:
            moe.record_routed_experts = True
        out = module(y, *args, kv_cache=None, **kwargs)
        routed = [moe.routed_experts.get_value()[0] for moe in moes]
        return (out[0] if isinstance(out, tuple) else out), (routed[0] if routed else None)

    def _run_layers(self, params: Any, call: _PagedCall, y: jax.Array, args: tuple,
                    kwargs: dict) -> jax.Array:
        """Every decoder layer of a scanned tree: the scanned blocks in one `lax.scan` that
        carries the hidden states and the pool, then the rest unrolled."""
        scan, routed = self.scan, []
        if scan.blocks:
            stacks = {prefix: subtree(params, prefix) for prefix in scan.scanned_prefixes}

            def block_step(carry, xs):
                y, call.pool = carry[0], list(carry[1])
                block_params, indices = xs
                experts = []
                for j, source in enumerate(scan.sources[:scan.block]):
                    layer_params = take(block_params[source.prefix], source.indices[1:])
                    y, r = self._run_layer(call, j, indices[j], source.prefix, layer_params, y,
                                           args, kwargs)
                    experts.append(r)
                return (y, tuple(call.pool)), [r for r in experts if r is not None]

            (y, pool), ys = jax.lax.scan(block_step, (y, tuple(call.pool)),
                                         (stacks, jnp.asarray(self.scan_table)))
            call.pool = list(pool)
            if ys:  # [blocks, per block, R, C, k] -> layers in order
                stacked = jnp.stack(ys, axis=1)
                routed.extend(stacked.reshape(-1, *stacked.shape[2:]))
        for i in range(scan.scanned, len(scan.sources)):
            source = scan.sources[i]
            layer_params = take(subtree(params, source.prefix), source.indices)
            y, r = self._run_layer(call, i, self.places[i][1], source.prefix, layer_params, y,
                                   args, kwargs)
            routed.extend([] if r is None else [r])
        if self.routing_shape:
            call.routing = jnp.stack(routed, axis=2)
        return y

    def copy_page(self, pool: list[Any], source: jax.Array, target: jax.Array) -> list[Any]:
        return [stack.layout.copy_page(pages, source, target)
                for stack, pages in zip(self.stacks, pool, strict=True)]


@dataclasses.dataclass(frozen=True, eq=False)
class _LayerSeam:
    """In place of MaxText's scanned decoder's layer appliers (`_apply_layers_sequentially`
    for a uniform stack or gpt-oss's blocks, `_apply_gemma4_scanned_blocks` for Gemma4's),
    `run(y, layer_args, layer_kwargs)`: every layer, over the engine's stacks and pool."""

    run: Any
    runs: list = dataclasses.field(default_factory=list)

    def install(self, decoder: nnx.Module) -> None:
        decoder._apply_layers_sequentially = self.apply_layers
        decoder._apply_gemma4_scanned_blocks = self.apply_blocks

    def apply_layers(self, layers, y, *args, length: int, **kwargs):
        for name in ("kv_caches_stacked", "forced_routed_experts_scanned"):
            if kwargs.pop(name, None) is not None:
                raise ValueError(f"the paged maxtext engine's layer scan takes no {name}")
        for name in ("skip_block_remat", "unroll", "metadata_axis_name"):
            kwargs.pop(name, None)
        return self._run_once(y, args, kwargs), layers, None

    def apply_blocks(self, y, layer_args, layer_kwargs, kv_caches=None):
        if kv_caches is not None:
            raise ValueError("the paged maxtext engine's layer scan takes no kv_caches")
        return self._run_once(y, layer_args, layer_kwargs)

    def _run_once(self, y, args, kwargs):
        """`run` runs every layer: a decoder that applies two scanned stacks is not one the
        engine knows."""
        if self.runs:
            raise ValueError("MaxText's decoder applied more than one scanned layer stack; the "
                             "paged maxtext engine scans one (maxtext_tree.scan_plan)")
        self.runs.append(True)
        return self.run(y, args, kwargs)
