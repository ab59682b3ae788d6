"""MaxTextEngine: the per-host rollout engine over MaxText's own model (`rollout_engine=maxtext`).

It decodes any family MaxText trains (dense Qwen3, Qwen3 MoE, gpt-oss, Gemma4) with the trainer's
own param tree, no per-family weight mapping: MaxText's model runs in its prefill and
autoregressive KV-cache modes (`engine.maxtext_model`), driven by the same decode loop, sampler,
seeds, stop handling, continuous batching and DP replicas as the JAX engine, on meshes over this
host's devices only. Everything but the model is `JaxEngine`'s: MaxText's model decodes over
the page pool (`maxtext_model.MaxTextPagedModel`: its training forward, unscanned, with our paged
attention in place of each layer's `AttentionOp`), so sliding windows apply by token position
and sequences may be longer than a window. A scanned tree that is not a uniform layer stack
still decodes over one dense KV row per slot (`engine.dense_loop`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tunix_mcjax.engine import dense_loop
from tunix_mcjax.engine.base import SamplingParams
from tunix_mcjax.engine.decode_loop import Outputs
from tunix_mcjax.engine.jax_engine import (
    JaxEngine,
    LeafPath,
    _LeafSpec,
    _Pending,
    flatten_tree,
    pow2_at_least,
    unflatten_tree,
)
from tunix_mcjax.engine.maxtext_model import (
    MaxTextDecodeModel,
    MaxTextPagedModel,
    decode_config,
    local_mesh,
    param_specs,
    scan_plan,
    unstack_layers,
)
from tunix_mcjax.engine.paged_attention import layout_for
from tunix_mcjax.engine.sampling import SamplerSpec


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
        self.weight_dtype = weight_dtype or None
        self.unstack = False  # set by _param_specs, once the replica meshes exist
        self.plan = None  # scan_plan of the trainer's tree, set by _param_specs
        self._models: dict[int, MaxTextPagedModel] = {}
        self.paged = True  # set by _param_specs: False for a scanned tree of mixed blocks
        self._context = (kwargs.get("max_prompt_length", 1), kwargs.get("max_new_tokens", 1))
        super().__init__(model_config, devices, **kwargs)

    def _check_window(self) -> None:
        """Only the dense decode needs sequences within the window."""
        window = self.model_config.sliding_window_size
        context = sum(self._context)
        if window and context > window:
            raise ValueError(
                f"prompt + completion budget {context} > sliding_window_size={window}: MaxText "
                "0.2.5's autoregressive attention applies the sliding window over KV-cache "
                "slots, not token positions (attention_op.generate_attention_mask), so longer "
                "sequences would decode differently from the model the trainer scores; "
                "scan_layers=false decodes over pages, with no such limit")

    def _check_tensor_parallelism(self, tp: int) -> None:
        cfg = self.model_config
        if cfg.num_query_heads % tp or cfg.num_kv_heads % tp:
            raise ValueError(f"tensor_parallelism={tp} must divide num_query_heads="
                             f"{cfg.num_query_heads} and num_kv_heads={cfg.num_kv_heads}")

    def _mesh(self, devices: np.ndarray) -> Mesh:
        return local_mesh(self.model_config, devices)

    def _config(self, shape: dense_loop.ProgramShape | None = None) -> Any:
        if shape is None:
            prompt_len, max_new = self._context
            config = decode_config(self.model_config, batch=1, prompt_len=prompt_len,
                                   max_new=max_new, weight_dtype=self.weight_dtype)
        else:
            config = decode_config(self.model_config, batch=shape.num_slots,
                                   prompt_len=shape.prompt_len, max_new=shape.max_new,
                                   weight_dtype=self.weight_dtype)
        if self.unstack:
            config = config.model_copy(update={"scan_layers": False})
        # No gradients here; remat would also wall the paged attention's pool writes in.
        return config.model_copy(update={"remat_policy": "none"})

    def _param_specs(self, tp: int) -> dict[LeafPath, _LeafSpec]:
        self.plan = scan_plan(self._config(), self.meshes[0])
        self.unstack = self.plan is not None
        self.paged = self.unstack or not self.model_config.scan_layers
        if not self.paged:
            self._check_window()
        specs = param_specs(self._config(), self.meshes[0])
        self._keys = {path: keys for path, (keys, *_) in specs.items()}
        return {path: _LeafSpec(shape, dtype, partition)
                for path, (_, shape, dtype, partition) in specs.items()}

    def load_weights(self, params: Any) -> None:
        """The trainer's tree; a uniform layer stack is sliced into the engine's layers."""
        if self.unstack:
            cfg = self.model_config
            params = unflatten_tree(unstack_layers(flatten_tree(params), self.plan,
                                                   cfg.param_scan_axis))
        super().load_weights(params)

    # ----- the paged decode of MaxText's model -----

    def _decode_model(self, mesh: Mesh) -> MaxTextPagedModel:
        key = id(mesh)
        if key not in self._models:
            self._models[key] = MaxTextPagedModel(self._config(), mesh,
                                                  layout_for(mesh.devices.flat[0].platform))
        return self._models[key]

    def _page_bytes(self, tp: int) -> int:
        return self._decode_model(self.meshes[0]).page_bytes(self.page_size, tp)

    # ----- the dense decode of a scanned tree of mixed blocks (no page pool) -----

    def _pages_for(self, *args: Any) -> int:
        return super()._pages_for(*args) if self.paged else 0

    def _check_pool(self) -> None:
        if self.paged:
            super()._check_pool()

    def _dispatch(self, replica: int, request_ids: list[int], prompts: list[np.ndarray],
                  sampling: SamplingParams, spec: SamplerSpec, key: jax.Array,
                  prompt_bucket: int, new_bucket: int) -> list[_Pending]:
        """One replica's share through `dense_loop`, one program or waves without CB."""
        if self.paged:
            return super()._dispatch(replica, request_ids, prompts, sampling, spec, key,
                                     prompt_bucket, new_bucket)
        mesh = self.meshes[replica]
        size = len(request_ids) if self.continuous_batching else self.max_batch_size
        pending, first = [], 0
        for start in range(0, len(request_ids), size):
            batch = request_ids[start:start + size]
            host = self._host_inputs([prompts[r] for r in batch], sampling, key, first,
                                     prompt_bucket)
            n, u = len(host["request_prompts"]), len(host["prompt_lens"])
            shape = dense_loop.ProgramShape(n, min(n, pow2_at_least(self.max_batch_size)), u,
                                            prompt_bucket, new_bucket)
            replicated = NamedSharding(mesh, P())
            inputs = dense_loop.Inputs(**{k: jax.device_put(v, replicated)
                                          for k, v in host.items()})
            params = self._tree(self._params[replica])
            cache_key = (replica, shape, spec)
            if cache_key not in self._programs:
                model = MaxTextDecodeModel(self._config(shape), mesh)
                fn = dense_loop.build_program(model, shape, spec, self.masked_id)
                self._programs[cache_key] = jax.jit(fn).lower(params, inputs).compile()
            dense = self._programs[cache_key](params, inputs)
            zero = np.int32(0)
            outputs = Outputs(tokens=dense.tokens, logprobs=dense.logprobs,
                              lengths=dense.lengths, iterations=dense.iterations,
                              prefill_steps=zero, preemptions=zero, shared_pages=zero,
                              peak_pages=zero, stalled=np.bool_(False))
            pending.append(_Pending(batch, [len(batch)], shape, outputs))
            first += len(batch)
        return pending

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
