"""MaxTextEngine: the per-host rollout engine over MaxText's own model (`rollout_engine=maxtext`).

It decodes any family MaxText trains (dense Qwen3, Qwen3 MoE, gpt-oss, Gemma4) with the trainer's
own param tree, no per-family weight mapping: MaxText's model runs in its prefill and
autoregressive KV-cache modes (`engine.maxtext_model`), driven by the same decode loop, sampler,
seeds, stop handling, continuous batching and DP replicas as the JAX engine, on meshes over this
host's devices only. Everything but the model is `JaxEngine`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from tunix_mcjax.engine.decode_loop import DecodeModel, ProgramShape
from tunix_mcjax.engine.jax_engine import (
    JaxEngine,
    LeafPath,
    _LeafSpec,
    flatten_tree,
    unflatten_tree,
)
from tunix_mcjax.engine.maxtext_model import (
    MaxTextDecodeModel,
    decode_config,
    local_mesh,
    param_specs,
    stacked_layers,
    unstack_layers,
)


class MaxTextEngine(JaxEngine):
    """`JaxEngine`'s loop over MaxText's model. `model_config` is the trainer's MaxText config;
    `load_weights` takes its param tree (the Tunix adapter's `base`, as a nested dict).
    `weight_dtype` (float32 | bfloat16; None: the config's) is the engine's copy of the weights.
    A uniform layer stack (`scan_layers`) decodes unscanned, each layer its own slice of the
    stack: on CPU that decodes about twice as fast as MaxText's scan (README).
    """

    def __init__(self, model_config: Any, devices: Sequence[jax.Device], *,
                 weight_dtype: str | None = None, **kwargs: Any):
        if kwargs.get("lockstep"):
            raise ValueError("the maxtext engine runs per host (rl_runtime=mcjax); lockstep "
                             "decoding (rl_runtime=single) is the jax engine's")
        window = model_config.sliding_window_size
        context = kwargs.get("max_prompt_length", 0) + kwargs.get("max_new_tokens", 0)
        if window and context > window:
            raise ValueError(
                f"prompt + completion budget {context} > sliding_window_size={window}: MaxText "
                "0.2.5's autoregressive attention applies the sliding window over KV-cache "
                "slots, not token positions (attention_op.generate_attention_mask), so longer "
                "sequences would decode differently from the model the trainer scores")
        self.weight_dtype = weight_dtype or None
        self.unstack = False  # set by _param_specs, once the replica meshes exist
        super().__init__(model_config, devices, **kwargs)

    def _check_tensor_parallelism(self, tp: int) -> None:
        cfg = self.model_config
        if cfg.num_query_heads % tp or cfg.num_kv_heads % tp:
            raise ValueError(f"tensor_parallelism={tp} must divide num_query_heads="
                             f"{cfg.num_query_heads} and num_kv_heads={cfg.num_kv_heads}")

    def _mesh(self, devices: np.ndarray) -> Mesh:
        return local_mesh(self.model_config, devices)

    def _config(self, shape: ProgramShape | None = None) -> Any:
        if shape is None:
            config = decode_config(self.model_config, batch=1, prompt_len=1, max_new=1,
                                   weight_dtype=self.weight_dtype)
        else:
            config = decode_config(self.model_config, batch=shape.num_slots,
                                   prompt_len=shape.prompt_len, max_new=shape.max_new,
                                   weight_dtype=self.weight_dtype)
        return config.model_copy(update={"scan_layers": False}) if self.unstack else config

    def _param_specs(self, tp: int) -> dict[LeafPath, _LeafSpec]:
        self.unstack = stacked_layers(self._config(), self.meshes[0])
        specs = param_specs(self._config(), self.meshes[0])
        self._keys = {path: keys for path, (keys, *_) in specs.items()}
        return {path: _LeafSpec(shape, dtype, partition)
                for path, (_, shape, dtype, partition) in specs.items()}

    def load_weights(self, params: Any) -> None:
        """The trainer's tree; a uniform layer stack is sliced into the engine's layers."""
        if self.unstack:
            cfg = self.model_config
            params = unflatten_tree(unstack_layers(flatten_tree(params), cfg.num_decoder_layers,
                                                   cfg.param_scan_axis))
        super().load_weights(params)

    def _decode_model(self, mesh: Mesh, shape: ProgramShape) -> DecodeModel:
        return MaxTextDecodeModel(self._config(shape), mesh)

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
