"""Engine builders: `rollout_engine` -> the engine on this host's devices (`default_engine`)."""

from __future__ import annotations

from tunix_mcjax.config import Config, ConfigError
from tunix_mcjax.engine import Engine, pages
from tunix_mcjax.engine.options import EngineOptions


def engine_options(cfg: Config, pad_id: int, eos_ids: tuple[int, ...]) -> EngineOptions:
    """The settings of an engine over our decode loop (jax, maxtext): its caps are
    `cfg.engine_prompt_length` and `cfg.engine_new_tokens` (an agentic run's turns). Pool keys
    left at 0 keep the engine's defaults."""
    pool = {"page_size": cfg.vllm_block_size, "max_num_batched_tokens": cfg.max_num_batched_tokens}
    return EngineOptions(
        pad_id=pad_id, eos_ids=eos_ids,
        max_prompt_length=cfg.engine_prompt_length, max_new_tokens=cfg.engine_new_tokens,
        tensor_parallelism=cfg.rollout_tensor_parallelism,
        data_parallelism=cfg.rollout_data_parallelism,
        continuous_batching=cfg.rollout_continuous_batching,
        max_batch_size=cfg.rollout_max_batch_size,
        lockstep=cfg.rl_runtime == "single",
        hbm_utilization=cfg.hbm_utilization_vllm,
        prefix_caching=cfg.enable_prefix_caching,
        free_pool_after_generate=cfg.free_kv_cache_during_weight_sync,
        quantization=cfg.quantization,
        kv_quantization=pages.kv_mode_of(cfg),
        **{key: value for key, value in pool.items() if value},
    )


def jax_engine(cfg: Config, model_config, devices, pad_id: int,
               eos_ids: tuple[int, ...]) -> Engine:
    """Our paged decode loop over Tunix Qwen3 (`rollout_engine=jax`)."""
    from tunix_mcjax.engine.jax_engine import JaxEngine

    return JaxEngine(model_config, devices, engine_options(cfg, pad_id, eos_ids))


def maxtext_engine(cfg: Config, model_config, devices, pad_id: int,
                   eos_ids: tuple[int, ...]) -> Engine:
    """Our decode loop over MaxText's own model (`rollout_engine=maxtext`); `model_config` is
    the trainer's MaxText config."""
    from tunix_mcjax.engine.maxtext_engine import MaxTextEngine

    if not hasattr(model_config, "decoder_block"):
        raise ConfigError(
            "rollout_engine=maxtext decodes MaxText's own model, so it runs under the MaxText "
            "adapter (rl_runtime=mcjax on MaxText's train_rl); this run's model is Tunix Qwen3: "
            "use rollout_engine=jax")
    return MaxTextEngine(model_config, devices, engine_options(cfg, pad_id, eos_ids),
                         weight_dtype=cfg.rollout_weight_dtype or None,
                         record_routing=cfg.moe_router_replay)


def vllm_engine(cfg: Config, model_config, devices, pad_id: int,
                eos_ids: tuple[int, ...]) -> Engine:
    """In-process vLLM on this host's devices (`rollout_engine=vllm`)."""
    from tunix_mcjax.config import json_object
    from tunix_mcjax.engine.vllm_engine import VllmEngine, VllmOptions

    options = VllmOptions(
        hbm_utilization=cfg.hbm_utilization_vllm,
        max_num_batched_tokens=cfg.max_num_batched_tokens, block_size=cfg.vllm_block_size,
        enable_prefix_caching=cfg.enable_prefix_caching,
        enable_dp_attention=cfg.enable_dp_attention, async_scheduling=cfg.async_scheduling,
        additional_config=json_object(cfg, "vllm_additional_config"),
        hf_overrides=json_object(cfg, "vllm_hf_overrides"))
    return VllmEngine(
        model_config, devices, pad_id=pad_id, eos_ids=eos_ids,
        max_prompt_length=cfg.max_prefill_predict_length,
        max_new_tokens=cfg.max_completion_length,
        tensor_parallelism=cfg.rollout_tensor_parallelism,
        data_parallelism=cfg.rollout_data_parallelism,
        max_num_seqs=cfg.rollout_max_batch_size, options=options)


# `rollout_engine` -> the builder of that engine on this host's devices.
ENGINES = {"jax": jax_engine, "maxtext": maxtext_engine, "vllm": vllm_engine}


def default_engine(cfg: Config, model_config, devices, pad_id: int,
                   eos_ids: tuple[int, ...]) -> Engine:
    """The engine `rollout_engine` names, on this host's `devices` only."""
    return ENGINES[cfg.rollout_engine](cfg, model_config, devices, pad_id, eos_ids)
