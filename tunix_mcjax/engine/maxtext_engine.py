"""MaxTextEngine: the per-host rollout engine over MaxText's own model (`rollout_engine=maxtext`).

It decodes any family MaxText trains (dense Qwen3, Qwen3 MoE, gpt-oss, Gemma4) with the trainer's
own param tree, no per-family weight mapping, driven by the same paged decode loop, sampler,
seeds, stop handling, continuous batching and DP replicas as the JAX engine, on meshes over this
host's devices only. The model is `maxtext_model.MaxTextPagedModel`: MaxText's training forward
with our paged attention in place of each layer's `AttentionOp`, so sliding windows apply by
token position and sequences may be longer than a window; a scanned tree is decoded as it is
stacked, one `lax.scan` over its layers, so the program does not grow with depth. Under
`quantization` (dense Qwen3) it holds the layers' projection kernels quantized
(`maxtext_quantize`), under `quantize_kvcache` its pages (`paged_attention.QuantizedPages`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from tunix_mcjax.engine import maxtext_quantize, quantize
from tunix_mcjax.engine.jax_engine import JaxEngine, _LeafSpec
from tunix_mcjax.engine.kv_quant import check_tpu_kv_mode
from tunix_mcjax.engine.maxtext_model import (
    TENSOR_AXIS,
    MaxTextPagedModel,
    decode_config,
    local_mesh,
)
from tunix_mcjax.engine.maxtext_scan import (
    layer_major,
    layer_major_shape,
    scan_axis_major,
    scan_layout,
    stacked_count,
)
from tunix_mcjax.engine.maxtext_tpu import (
    MOE_UP_KERNELS,
    expert_major_leaf,
    expert_minor,
    pad_axis,
    padded_kernels,
    tpu_config,
)
from tunix_mcjax.engine.maxtext_tree import param_specs, scan_plan
from tunix_mcjax.engine.options import EngineOptions, options_of
from tunix_mcjax.engine.paged_attention import layout_for
from tunix_mcjax.engine.trees import LeafPath, flatten_tree


class MaxTextEngine(JaxEngine):
    """`JaxEngine`'s loop over MaxText's model. `model_config` is the trainer's MaxText config;
    `load_weights` takes its param tree (the Tunix adapter's `base`, as a nested dict).
    `weight_dtype` (float32 | bfloat16; None: the config's) is the engine's copy of the weights.
    A scanned tree (a uniform stack, gpt-oss's blocks of two layer kinds, Gemma4's blocks of
    five local and one global layer: `maxtext_tree.scan_plan`) is held as MaxText stacks it,
    each stacked leaf layer-major (`maxtext_scan.layer_major`: a layer is one contiguous slice),
    and decoded by one layer scan; `weights()` gives MaxText's layout back.
    """

    # MaxText's model is built for its batch (`decode_config`), and a MoE's expert capacity
    # follows the tokens of a call: a row's sample must not depend on how many rows run with it.
    pack_decode_rows = False
    # Where the engine pads MoE kernels to whole lanes (`maxtext_tpu.tpu_moe_mlp_dim`).
    PAD_MOE_PLATFORMS = ("tpu",)

    def __init__(self, model_config: Any, devices: Sequence[jax.Device],
                 options: EngineOptions | None = None, *, weight_dtype: str | None = None,
                 record_routing: bool = False, **fields: Any):
        options = options_of(options, fields)
        maxtext_quantize.check_family(model_config, options.quantization)
        if options.lockstep:
            raise ValueError("the maxtext engine runs per host (rl_runtime=mcjax); lockstep "
                             "decoding (rl_runtime=single) is the jax engine's")
        self.weight_dtype = weight_dtype or None
        self.record_routing = record_routing  # Completion.routing (patches/maxtext/0004)
        self.scanned_layers = 0  # how many layers the scan runs, set by _param_specs
        self._stacked: dict[LeafPath, int] = {}  # stacked axes of each stacked leaf
        self._models: dict[int, MaxTextPagedModel] = {}
        self._minor_paths: set[LeafPath] = set()  # MoE up-kernels kept expert-minor on CPU
        self._minor_keys: set[tuple] = set()  # the same, as MaxText's param keys
        self._padded: dict[LeafPath, tuple[int, int]] = {}  # MoE kernels padded on TPU
        self._context = (options.max_prompt_length, options.max_new_tokens)
        super().__init__(model_config, devices, options)

    def _check_tensor_parallelism(self, tp: int) -> None:
        cfg = self.model_config
        if cfg.num_query_heads % tp or cfg.num_kv_heads % tp:
            raise ValueError(f"tensor_parallelism={tp} must divide num_query_heads="
                             f"{cfg.num_query_heads} and num_kv_heads={cfg.num_kv_heads}")

    def _mesh(self, devices: np.ndarray) -> Mesh:
        return local_mesh(self.model_config, devices)

    def _config(self) -> Any:
        prompt_len, max_new = self._context
        config = decode_config(self.model_config, batch=1, prompt_len=prompt_len,
                               max_new=max_new, weight_dtype=self.weight_dtype)
        # No gradients here; remat would also wall the paged attention's pool writes in.
        return config.model_copy(update={"remat_policy": "none"})

    def _model_config(self) -> Any:
        """The decode model's config: `_config`, its MoE kernels padded on TPU
        (`maxtext_tpu.tpu_config`)."""
        config = self._config()
        return tpu_config(config) if self._padded else config

    def _weight_bytes(self, tp: int) -> int:
        """The engine's weights on one device: projections quantized under `quantization`
        (`maxtext_quantize`), and the zeros that pad MoE kernels on TPU."""
        held = sum(quantize.axes_bytes(self._stored_shape(path),
                                       np.dtype(self._leaf_specs[path].dtype).itemsize,
                                       self._contracted(path), self.options.quantization)
                   for path in self._leaf_specs)
        padding = 0
        for path, (axis, width) in self._padded.items():
            shape = self._stored_shape(path)
            padding += (int(np.prod(shape)) // shape[axis] * (width - shape[axis])
                        * np.dtype(self._leaf_specs[path].dtype).itemsize)
        return held // tp + padding // tp

    def _contracted(self, path: LeafPath) -> tuple[int, ...] | None:
        """The contracted axes of a leaf the engine quantizes, as it holds it; else None."""
        return maxtext_quantize.contracted_axes(path, self._stacked.get(path, 0))

    def _stored_shape(self, path: LeafPath) -> tuple[int, ...]:
        """A leaf's shape as the engine holds it: layer-major, expert-minor on CPU, unpadded."""
        count = self._stacked.get(path, 0)
        shape = layer_major_shape(self._leaf_specs[path].shape,
                                  self.model_config.param_scan_axis, count)
        if path in self._minor_paths:
            shape = (*shape[:count], shape[count + 1], shape[count], *shape[count + 2:])
        return shape

    def _param_specs(self, tp: int) -> dict[LeafPath, _LeafSpec]:
        config = self._config()
        plan = scan_plan(config, self.meshes[0])
        if config.scan_layers and plan is None:
            raise ValueError(
                f"the maxtext engine does not know how {self.model_config.model_name}'s scanned "
                "layers stack its unscanned ones (maxtext_tree.scan_plan); set "
                "scan_layers=false")
        layout = scan_layout(plan, config.num_decoder_layers)
        self.scanned_layers = layout.scanned
        specs = param_specs(config, self.meshes[0])
        self._keys = {path: keys for path, (keys, *_) in specs.items()}
        self._stacked = {path: n for path in specs
                         if (n := stacked_count(path, layout.stacked))}
        platform = self.meshes[0].devices.flat[0].platform
        if platform in self.PAD_MOE_PLATFORMS:
            self._padded = padded_kernels(specs, config, self._stacked)
        if platform == "cpu":
            self._minor_paths = {path for path, (_, shape, *_) in specs.items()
                                 if path[-1] in MOE_UP_KERNELS
                                 and len(shape) - self._stacked.get(path, 0) == 3}
            self._minor_keys = {self._keys[path] for path in self._minor_paths}
        return {path: _LeafSpec(shape, dtype, partition)
                for path, (_, shape, dtype, partition) in specs.items()}

    def load_weights(self, params: Any) -> None:
        """The trainer's tree, scanned or not; each leaf is then held as `_held` lays it out."""
        super().load_weights(params)
        loaded = list(flatten_tree(params))
        for mesh, replica_params in zip(self.meshes, self._params, strict=True):
            with jax.set_mesh(mesh):  # not the trainer's mesh a publish may run under
                for path in loaded:
                    replica_params[path] = self._quantized(
                        path, self._held(path, replica_params[path]))

    def _quantized(self, path: LeafPath, leaf: jax.Array) -> Any:
        """A held leaf under `quantization`: a QArray where `maxtext_quantize` covers it."""
        contracted = self._contracted(path)
        if not self.options.quantization or contracted is None:
            return leaf
        return quantize.quantize_axes(leaf, contracted, self.options.quantization)

    def _held(self, path: LeafPath, leaf: jax.Array) -> jax.Array:
        """A leaf in MaxText's layout as the engine holds it: stacked axes in front, MoE
        up-kernels expert-minor on CPU, expert kernels padded on TPU."""
        count = self._stacked.get(path, 0)
        if count:
            leaf = layer_major(leaf, self.model_config.param_scan_axis, count)
        if path in self._minor_paths:
            leaf = expert_minor(leaf, count)
        if path in self._padded:
            leaf = pad_axis(leaf, *self._padded[path])
        return leaf

    def _maxtext_leaf(self, path: LeafPath, leaf: jax.Array) -> jax.Array:
        """`_held` undone."""
        count = self._stacked.get(path, 0)
        if path in self._padded:
            axis = self._padded[path][0]
            leaf = jax.lax.slice_in_dim(leaf, 0, self._stored_shape(path)[axis], axis=axis)
        if path in self._minor_paths:
            leaf = expert_major_leaf(leaf, count)
        if count:
            leaf = scan_axis_major(leaf, self.model_config.param_scan_axis, count)
        return leaf

    def _param_store(self) -> dict[LeafPath, Any]:
        return {}

    def weights(self, replica: int = 0) -> dict[str, Any]:
        """The param tree replica `replica` decodes with, in MaxText's layout."""
        return self._tree({path: jax.tree.map(lambda x, p=path: self._maxtext_leaf(p, x), leaf)
                           for path, leaf in self._params[replica].items()})

    def _decode_model(self, mesh: Mesh) -> MaxTextPagedModel:
        key = id(mesh)
        if key not in self._models:
            platform, kv_mode = mesh.devices.flat[0].platform, self.options.kv_quantization
            if platform == "tpu":
                check_tpu_kv_mode(kv_mode)  # as the jax engine: per-token scales refused there
            layout = layout_for(platform, mesh.devices.size, mesh=mesh,
                                kv_heads=self.model_config.num_kv_heads,
                                heads_axis=TENSOR_AXIS, kv_mode=kv_mode,
                                dtype=jnp.dtype(self.model_config.dtype))
            self._models[key] = MaxTextPagedModel(self._model_config(), mesh, layout,
                                                  expert_minor_keys=self._minor_keys,
                                                  record_routing=self.record_routing)
        return self._models[key]

    def _page_bytes(self, tp: int) -> int:
        return self._decode_model(self.meshes[0]).page_bytes(self.options.page_size, tp)

    def _tree(self, flat: Mapping[LeafPath, Any]) -> dict[Any, Any]:
        """MaxText's pure-dict param tree, with its own keys (integers stay integers)."""
        tree: dict[Any, Any] = {}
        for path, value in flat.items():
            node = tree
            keys = self._keys[path]
            for key in keys[:-1]:
                node = node.setdefault(key, {})
            node[keys[-1]] = value
        return tree
