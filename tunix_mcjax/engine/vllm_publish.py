"""Publishing a whole Tunix Qwen3 tree into an in-process `vllm.LLM`, by vLLM backend.

- torch vLLM (CPU, GPU): one `reload_weights` RPC carrying every tensor under its Hugging Face
  name and layout (q/k/v and gate/up separate; vLLM fuses them), then a prefix-cache reset, since
  cached KV blocks were computed with the old weights.
- tpu-inference (TPU): Tunix's `VllmSampler.update_params` sequence: reset the prefix cache, free
  the KV cache, write the weights into the runner's JAX state with Tunix's
  `transfer_state_with_mappings` and `qwen3.mapping_vllm_jax`, reinitialise the KV cache.

Both check the mapping as a bijection before anything moves: every source leaf has a target,
every target parameter is written. vLLM itself accepts a partial reload silently.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from tunix.models.qwen3.model import ModelConfig

from tunix_mcjax.engine import hf_qwen3
from tunix_mcjax.engine.trees import flatten_tree

LeafPath = tuple[str, ...]


def _param_names(worker: Any) -> tuple[list[str], dict[str, list[str]]]:
    """Runs inside a vLLM worker: its model's parameter names and fused-module map."""
    model = worker.model_runner.get_model()
    packed = getattr(type(model), "packed_modules_mapping", {})
    return [n for n, _ in model.named_parameters()], {k: list(v) for k, v in packed.items()}


def _refresh_cpu_head(worker: Any) -> None:
    """Runs inside a CPU vLLM worker after a reload: rebuilds the logits GEMM of a tied head.

    On CPU the lm_head's logits GEMM is a oneDNN handle packed from its weight when the model
    loads. A tied lm_head shares the embedding's weight but is no layer a reload processes (no
    checkpoint tensor names it), so its handle keeps the old weights. Re-dispatching it on the
    reloaded weight fixes that; an untied lm_head is reloaded and repacked like the rest.
    """
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    dispatch_cpu_unquantized_gemm(worker.model_runner.get_model().lm_head, remove_weight=False)


def _torch_tensor(value: np.ndarray) -> Any:
    import torch

    value = np.require(value, requirements=["C", "W"])  # torch wants writable memory
    if value.dtype.name == "bfloat16":  # numpy has no bf16 torch.from_numpy understands
        return torch.from_numpy(value.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(value)


class TorchPublisher:
    """torch vLLM: the whole tree in one `reload_weights` call."""

    def __init__(self, llm: Any, mc: ModelConfig, platform: str):
        self.llm, self.mc = llm, mc
        self.refresh_head = platform == "cpu" and mc.use_tied_embedding
        hf_names = [name for name, _ in hf_qwen3.name_map(mc).values()]
        for params, packed in llm.collective_rpc(_param_names):
            hf_qwen3.check_covers(hf_names, params, packed)

    def publish(self, flat: Mapping[LeafPath, np.ndarray]) -> None:
        hf = hf_qwen3.to_hf(flat, self.mc)
        weights = [(name, _torch_tensor(value)) for name, value in hf.items()]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if self.refresh_head:
            self.llm.collective_rpc(_refresh_cpu_head)
        self.llm.reset_prefix_cache()


def _tunix_transfer(**kwargs: Any) -> Any:
    from tunix.generate import utils
    from tunix.rl import reshard

    return utils.transfer_state_with_mappings(reshard_fn=reshard.reshard_pytree, **kwargs)


def tpu_targets(src_paths: list[LeafPath], to_hf: Mapping[str, tuple[str, Any]]) -> dict[str, str]:
    """Source leaf ('layers.0.attn.q_proj.w') -> target name, through Tunix's `*` patterns.
    Raises ValueError for a source leaf no pattern maps."""
    out, unmapped = {}, []
    for path in src_paths:
        key = ".".join(path)
        hit = next((p for p in to_hf if fnmatch.fnmatchcase(key, p)), None)
        if hit is None:
            unmapped.append(key)
            continue
        layer = next((part for part in path if part.isdigit()), None)
        out[key] = to_hf[hit][0].replace("*", layer) if layer is not None else to_hf[hit][0]
    if unmapped:
        raise ValueError(f"Tunix's vLLM mapping has no target for {unmapped[:3]}")
    return out


class TpuInferencePublisher:
    """tpu-inference: the weights go into the model runner's JAX state (Tunix's sequence)."""

    def __init__(self, llm: Any, mc: ModelConfig, tensor_parallelism: int,
                 transfer: Callable[..., Any] | None = None):
        from tunix.models.qwen3 import mapping_vllm_jax

        self.llm, self.mc, self.tp = llm, mc, tensor_parallelism
        self.mapping = mapping_vllm_jax.VLLM_JAX_MAPPING
        self.transfer = transfer or _tunix_transfer
        targets = tpu_targets(list(hf_qwen3.name_map(mc)), self.mapping["to_hf_mappings"])
        state_keys = {".".join(map(str, k)) for k, _ in self._runner.state.flat_state()}
        # A tied embedding may also be materialised as lm_head; Tunix syncs that one itself.
        untouched = sorted(state_keys - set(targets.values()) - {"lm_head.weight"})
        nowhere = sorted(set(targets.values()) - state_keys)
        if untouched or nowhere:
            raise ValueError(f"tpu-inference's model state does not match Tunix's mapping: "
                             f"not written {untouched[:3]}, no such target {nowhere[:3]}")

    @property
    def _runner(self) -> Any:
        return self.llm.llm_engine.model_executor.driver_worker.model_runner

    def publish(self, tree: Mapping[str, Any]) -> None:
        import jax

        hf_qwen3.check_complete(flatten_tree(tree), self.mc)
        runner = self._runner
        self.llm.reset_prefix_cache()
        self.llm.collective_rpc("delete_kv_cache")
        jax.effects_barrier()
        runner.state = self.transfer(
            src_state=tree, dst_state=runner.state,
            key_mappings=self.mapping["to_hf_mappings"],
            key_mapping_hook_fns=self.mapping["to_hf_hook_fns"],
            transpose_keys=self.mapping["to_hf_transpose_keys"],
            num_kv_heads=self.mc.num_kv_heads, head_dim=self.mc.head_dim, tp_size=self.tp)
        if hasattr(runner, "state_leaves"):
            runner.state_leaves = tuple(jax.tree_util.tree_leaves(runner.state))
        self.llm.collective_rpc("reinitialize_kv_cache")
