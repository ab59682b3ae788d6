"""MaxText's RL config (`types.RLConfig`) -> our `Config`, key by key, with explicit refusals.

Every MaxText key whose value differs from MaxText's own default for the model (`rl.yml` plus the
model's YAML) falls in one of four groups:
- HONOURED: mapped onto our Config, or used as MaxText uses it (MaxText builds the model, the
  optimizer, the data pipeline and the rewards from the same config under both runtimes);
  HONOURED_VALUES: honoured at the listed values only (e.g. `num_test_batches=0`);
- DERIVED: computed by MaxText from honoured keys;
- NOT_APPLICABLE: settings of the machinery rl_runtime=mcjax replaces (Pathways, vLLM, Tunix's
  RL cluster); they are listed in the run's log and in `maxtext_adapter.json`;
- MaxText's agentic keys (AGENTIC_KEYS) are honoured with rl.use_agentic_rollout=true only, as
  MaxText reads them (`check_agentic`);
- our own keys that MaxText has none for (the agentic environment's, the rollout-trainer
  corrections': AGENTIC_ADAPTER_KEYS, CORRECTION_ADAPTER_KEYS, in `adapter_keys`) are read from
  train_rl's command line under our names;
- anything else is REFUSED by name, before any model is built. `REFUSED` gives the reason and
  the fix for the keys users are likely to set; other keys get a generic message.
"""

from __future__ import annotations

import json
import math
from typing import Any

from tunix_mcjax.config import PAGED_ENGINES, Config, ConfigError, load_config
from tunix_mcjax.maxtext.adapter_keys import (  # noqa: F401 (the adapter's keys, named here too)
    AGENTIC_ADAPTER_KEYS,
    CORRECTION_ADAPTER_KEYS,
    DEFAULT_ENVIRONMENT,
    ROLLOUT_ADAPTER_KEYS,
    check_router_replay,
    pop_agentic_keys,
    pop_correction_keys,
    pop_keys,
    pop_rollout_engine,
    refuse_lora,
)

# MaxText's agentic keys (read by its learner only with rl.use_agentic_rollout=true) -> ours.
AGENTIC_KEYS: dict[str, str] = {
    "rl.use_agentic_rollout": "use_agentic_rollout (multi-turn rollouts, tunix_mcjax.agentic)",
    "rl.epsilon_high": "epsilon_high (clip-higher; null: grpo_epsilon)",
    "rl.off_policy_steps": "off_policy_steps: a staleness bound; colocated rollouts are 0 "
                           "updates stale, so every value holds",
    "rl.max_concurrency": "max_concurrency (conversations of a host per engine call)",
    "rl.system_prompt": "system_prompt (the agent's)",
    "rl.use_rollout_logps": "use_rollout_logps (the ratio's old logps: the engine's)",
    "rl.force_on_policy_ratio": "force_on_policy_ratio (ratio pinned to 1)",
    "rl.log_sampler_trainer_agreement": "the sampler-trainer mismatch is measured every step "
                                        "without an extra forward (mismatch_* metrics)",
}

# MaxText key -> where it lands. `rl.<key>` is read from the nested `config.rl`.
HONOURED: dict[str, str] = {
    # Runtime and the paper's optimizations O1-O4.
    "base_config": "MaxText's config inheritance",
    "rl_runtime": "selects this runtime",
    "rl_async_metrics_export": "rl_async_metrics_export (O1)",
    "rl_gc_freeze_after_warmup": "rl_gc_freeze_after_warmup (O2)",
    "rl_balance_prompts_by_length": "rl_balance_prompts_by_length (O3)",
    "rl_balance_by_expected_output": "rl_balance_by_expected_output (O3 by output length too)",
    "rl_publish_weights_single_call": "rl_publish_weights_single_call (O4)",
    "jax_cache_dir": "jax_cache_dir (JAX's compilation cache in every process of the run)",
    # GRPO batch, lengths, steps.
    "batch_size": "batch_size (prompts per step)",
    "rl.num_generations": "num_generations",
    "max_prefill_predict_length": "max_prefill_predict_length",
    "max_target_length": "max_target_length",
    "train_micro_batch_size": "train_micro_batch_size (prompts per micro-batch; accumulation)",
    "num_batches": "steps = num_batches * train_fraction * num_epoch",
    "num_epoch": "steps",
    "train_fraction": "steps, and the dataset rows kept",
    # Sampling and the rollout engine (per host).
    "decode_sampling_temperature": "decode_sampling_temperature",
    "decode_sampling_top_k": "decode_sampling_top_k",
    "decode_sampling_nucleus_p": "decode_sampling_nucleus_p",
    "rollout_tensor_parallelism": "rollout_tensor_parallelism (TP inside an engine replica)",
    "rollout_data_parallelism": "rollout_data_parallelism / hosts (replicas per host)",
    # Optimizer: MaxText's own (utils_rl.get_optimizer), warm-up then cosine decay.
    "learning_rate": "MaxText's RL optimizer",
    "adam_b1": "MaxText's RL optimizer",
    "adam_b2": "MaxText's RL optimizer",
    "adam_weight_decay": "MaxText's RL optimizer",
    "gradient_clipping_threshold": "MaxText's RL optimizer",
    "warmup_steps_fraction": "MaxText's RL optimizer",
    "learning_rate_schedule_steps": "MaxText's RL optimizer",
    # GRPO loss.
    "rl.grpo_beta": "grpo_beta",
    "rl.grpo_epsilon": "grpo_epsilon",
    "rl.loss_algo": "loss_algo (grpo, gspo-token)",
    "rl.loss_agg_mode": "loss_agg_mode",
    "rl.num_iterations": "num_iterations (updates per batch; train_steps counts updates)",
    # Agentic rollouts (MaxText hands them to Tunix's agentic learner; here: tunix_mcjax.agentic
    # on each host's engine, the conversations built by `maxtext.agentic`).
    **AGENTIC_KEYS,
    # Data: MaxText's pipeline (train_rl.prepare_datasets) and prompt template.
    "dataset_name": "MaxText's data pipeline",
    "hf_train_files": "MaxText's data pipeline",
    "train_split": "MaxText's data pipeline",
    "hf_subset": "MaxText's data pipeline",
    "eval_dataset_name": "MaxText's data pipeline (equal to dataset_name: 5% of the train split)",
    "hf_access_token": "MaxText's data pipeline and tokenizer",
    "data_shuffle_seed": "MaxText's data pipeline; seed (batch order)",
    "data_template_path": "MaxText's prompt template",
    "dataset_processor_path": "MaxText's data pipeline",
    "chat_template": "the tokenizer's chat template",
    "chat_template_path": "the tokenizer's chat template",
    "tokenizer_path": "tokenizer_path",
    "reasoning_start_token": "MaxText's template and rewards",
    "reasoning_end_token": "MaxText's template and rewards",
    "reasoning_start_token_in_prompt": "MaxText's template and rewards",
    "solution_start_token": "MaxText's template and rewards",
    "solution_end_token": "MaxText's template and rewards",
    # Rewards: MaxText's functions (train_rl.build_reward_fns) and their knobs.
    "reward_functions_path": "MaxText's reward functions",
    "reward_functions": "MaxText's reward functions",
    "reward_exact_answer": "MaxText's reward functions",
    "reward_white_space_format_match": "MaxText's reward functions",
    "reward_exact_format_match": "MaxText's reward functions",
    "reward_partial_format_match": "MaxText's reward functions",
    "reward_ratio_guess_to_answer_high": "MaxText's reward functions",
    "reward_ratio_guess_to_answer_low": "MaxText's reward functions",
    "penalty_incorrect_format": "MaxText's reward functions",
    "penalty_incorrect_answer": "MaxText's reward functions",
    "math_verify_timeout": "MaxText's reward functions",
    "math_verify_num_procs": "MaxText's reward functions",
    "reward_num_workers": "reward_num_workers (threads scoring whole groups; MaxText's 0: "
                          "the batch after generation)",
    "reward_worker_timeout_seconds": "reward_worker_timeout_seconds (one group's budget; "
                                     "past it the step ends, naming the group)",
    # Run directory, checkpoints, logging.
    "run_name": "run_name",
    "base_output_directory": "base_output_directory (run dir: base_output_directory/run_name)",
    "enable_checkpointing": "enable_checkpointing",
    "checkpoint_period": "checkpoint_period",
    "max_num_checkpoints_to_keep": "max_num_checkpoints_to_keep",
    "log_period": "log_period",
    "log_config": "MaxText's config logging",
    "debug": "MaxText's debug logging: every library's INFO logs, evaluation's per-question logs",
    "enable_tensorboard": "enable_tensorboard (host 0's scalars under <run dir>/tensorboard)",
    "profiler": "profiler (xplane: a JAX profiler trace per host)",
    "skip_first_n_steps_for_profiler": "skip_first_n_steps_for_profiler",
    "profiler_steps": "profiler_steps",
    # Evaluation: MaxText's test rows, scored by MaxText's evaluate_rl on each host's engine.
    "num_test_batches": "num_test_batches (evaluation before, during and after training)",
    "eval_interval": "eval_interval",
    "eval_mode": "MaxText's evaluate_rl.score_responses (pass, maj, pass_at_1)",
    "num_eval_passes": "MaxText's evaluate_rl.generate_responses",
    "eval_sampling_strategy": "MaxText's evaluate_rl.generate_responses (generation_configs)",
    "eval_split": "MaxText's data pipeline (test rows)",
    "hf_eval_files": "MaxText's data pipeline (test rows)",
    "eval_batch_size": "MaxText's data pipeline (test rows per batch)",
    "test_batch_start_index": "MaxText's data pipeline (first test row)",
    # The model: built by MaxText's model_creation_utils, mapped onto Tunix Qwen3 for the engine.
    "model_name": "MaxText's model creation (dense Qwen3, Qwen3 MoE, gpt-oss, Gemma4)",
    "override_model_config": "MaxText's model creation",
    "base_emb_dim": "MaxText's model creation",
    "base_num_query_heads": "MaxText's model creation",
    "base_num_kv_heads": "MaxText's model creation",
    "base_mlp_dim": "MaxText's model creation",
    "base_num_decoder_layers": "MaxText's model creation",
    "head_dim": "MaxText's model creation",
    "vocab_size": "MaxText's model creation",
    "normalization_layer_epsilon": "MaxText's model creation; the engine's norm_eps",
    "logits_via_embedding": "MaxText's model creation; the engine's use_tied_embedding",
    "dtype": "MaxText's model creation; the engine's dtype",
    "weight_dtype": "MaxText's model creation; the engine's param dtype",
    "scan_layers": "MaxText's model creation",
    "param_scan_axis": "MaxText's model creation",
    "remat_policy": "MaxText's model creation",
    "hardware": "MaxText's model creation",
    "init_weights_seed": "MaxText's model creation",
    "load_parameters_path": "MaxText's model creation (initial weights)",
    "convert_checkpoint_if_possible": "MaxText's model creation",
    "allow_split_physical_axes": "MaxText's mesh creation",
    # Kernels, layouts and MoE shapes: MaxText builds and runs the model under both runtimes.
    **dict.fromkeys((
        "attention", "megablox", "sparse_matmul", "use_custom_sort_vjp", "use_tokamax_splash",
        "sa_use_fused_bwd_kernel", "sa_block_q", "sa_block_kv", "sa_block_kv_compute",
        "sa_block_q_dkv", "sa_block_kv_dkv", "sa_block_kv_dkv_compute", "use_iota_embed",
        "decoder_layer_input", "num_experts", "num_experts_per_tok", "base_moe_mlp_dim",
        "shared_experts", "capacity_factor", "sliding_window_size", "num_vocab_tiling",
        "global_head_dim", "global_num_kv_heads", "hidden_size_per_layer_input",
        "vocab_size_per_layer_input", "num_kv_shared_layers", "ici_tensor_parallelism",
    ), "MaxText's model creation"),
    "skip_jax_distributed_system": "always skipped: this runtime initialises jax.distributed",
}

# Keys honoured only at these values (what this runtime does); other values are refused.
HONOURED_VALUES: dict[str, tuple[Any, ...]] = {"profiler": ("", "xplane")}

# Computed by MaxText from the keys above.
DERIVED = frozenset({
    "emb_dim", "mlp_dim", "num_decoder_layers", "num_query_heads", "num_kv_heads", "steps",
    "checkpoint_dir", "tensorboard_dir", "metrics_dir", "tokenizer_type",
    "micro_batch_size_to_train_on", "micro_batch_size_to_eval_on", "global_batch_size_to_train_on",
    "global_batch_size_to_eval_on", "global_batch_size_to_load", "global_batch_size_to_load_eval",
    "tensors_on_device", "tensors_to_offload", "moe_mlp_dim",
    # The mesh shape, from the ici_*/dcn_*_parallelism keys (e.g. Gemma4-E4B's
    # ici_tensor_parallelism=2).
    "ici_parallelism", "dcn_parallelism",
})

# MaxText's vLLM sampler keys -> the Config key they set for this runtime's engines, or None:
# no equivalent here, so the key is reported as not applied. One table, so an engine that has
# more of them (rollout_engine=vllm) maps them here.
VLLM_KEYS: dict[str, str | None] = {
    "max_num_seqs": "rollout_max_batch_size",  # sequences one engine replica decodes at once
    "kv_cache_buffer": None,  # KV pages are taken as sequences grow: no buffer to size
    "swap_space_vllm_gb": None,
    "enable_dp_attention": None,
    "enable_expert_parallel": None,
    "async_scheduling": None,
    "vllm_additional_config": None,
    "vllm_hf_overrides": None,
    "vllm_hf_config_path": None,
    "vllm_load_format": None,
    "rollout_micro_batch_size": None,  # a host's engine takes all its requests in one call
    "rollout_expert_parallelism": None,
}
HONOURED.update({k: v for k, v in VLLM_KEYS.items() if v is not None})

# Keys MaxText's RL trainer itself does not read (its pretraining trainer does): not applied
# under either runtime.
NOT_READ_BY_TRAIN_RL = frozenset({"mu_dtype", "grad_dtype", "hf_name",
                                  "checkpoint_storage_use_ocdbt", "checkpoint_storage_use_zarr3"})

# Settings of what rl_runtime=mcjax replaces: the Pathways controller, vLLM rollouts, Tunix's
# RL cluster (device split between trainer and sampler, reward worker pool, perf metrics).
NOT_APPLICABLE = frozenset({
    "use_pathways", "use_pathways_reshard", "trainer_devices_fraction", "sampler_devices_fraction",
    "num_trainer_slices", "num_samplers_slices", "chips_per_vm", "gc_collect_after_weight_sync",
    "inference_replicas", "inference_devices_per_replica", "inference_rollouts",
    "use_standalone_converter", "use_weight_converter",
    "use_raiden_ffi", "rollout_backend", "weight_sync_debug", "log_weight_sync_time", "kv_tp_size",
    "moe_mlp_tp_size", "debug_converter", "gcs_debug_path",
    "enable_tunix_perf_metrics",
    "rl.reshard_chunk_size",
}) | {k for k, v in VLLM_KEYS.items() if v is None} | NOT_READ_BY_TRAIN_RL

# MaxText's keys that size a KV page pool -> ours. Under the engines with a pool
# (config.PAGED_ENGINES: jax, maxtext and vllm) they are taken as they are, MaxText's defaults
# included (its enable_prefix_caching is false).
KV_POOL_KEYS: dict[str, str] = {
    "hbm_utilization_vllm": "hbm_utilization_vllm",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "vllm_block_size": "vllm_block_size",
    "enable_prefix_caching": "enable_prefix_caching",
    "free_kv_cache_during_weight_sync": "free_kv_cache_during_weight_sync",
}
NOT_APPLICABLE |= set(KV_POOL_KEYS)


def pool_values(config: Any) -> dict[str, Any]:
    """Our Config values of MaxText's pool keys (None: the engine's default, 0)."""
    out = {ours: getattr(config, key) for key, ours in KV_POOL_KEYS.items()}
    out["enable_prefix_caching"] = bool(out["enable_prefix_caching"])
    out["free_kv_cache_during_weight_sync"] = bool(out["free_kv_cache_during_weight_sync"])
    return {k: (0 if v is None else v) for k, v in out.items()}


# --- vLLM engine (rollout_engine=vllm) ---
# MaxText's vLLM keys the vLLM engine takes as they are -> our Config key. Honoured under
# rollout_engine=vllm (given on train_rl's command line, read by this adapter: MaxText has no
# such key); under the other engines they stay in VLLM_KEYS's "not applied" rows.
VLLM_ENGINE_KEYS: dict[str, str] = {
    "enable_dp_attention": "enable_dp_attention",
    "async_scheduling": "async_scheduling",
    "vllm_additional_config": "vllm_additional_config",
    "vllm_hf_overrides": "vllm_hf_overrides",
}


def check_agentic(changed: dict[str, Any], adapter_keys: dict[str, Any]) -> None:
    """Raises ConfigError for agentic keys set without rl.use_agentic_rollout=true: MaxText's
    standard learner never reads them, so a run here would not honour them either."""
    if changed.get("rl.use_agentic_rollout"):
        return
    keys = [k for k in AGENTIC_KEYS if k in changed] + list(adapter_keys)
    if keys:
        raise ConfigError(
            f"{', '.join(keys)}: MaxText reads these only with rl.use_agentic_rollout=true (its "
            "agentic learner); set rl.use_agentic_rollout=true, or drop them")


def vllm_values(config: Any) -> dict[str, Any]:
    """Our Config values of MaxText's vLLM keys; None or {} keep our default (vLLM's)."""
    out: dict[str, Any] = {}
    for key, ours in VLLM_ENGINE_KEYS.items():
        value = getattr(config, key)
        if value is not None and value != {}:
            out[ours] = json.dumps(value) if isinstance(value, dict) else value
    return out
# --- end vLLM engine ---

# Keys users are likely to set that this runtime cannot honour yet: why, and what to do.
REFUSED: dict[str, str] = {
    "stop_strings": "the engine stops on the EOS token only",
    "adam_eps": "MaxText's RL optimizer (utils_rl.get_optimizer) does not pass adam_eps to "
                "AdamW, so neither runtime would use it",
    "profiler": "only profiler=xplane (a JAX trace) is supported; nsys is not",
    "max_seq_token_per_tpu": "no token-budget micro-batching yet",
    "dropout_rate": "the policy trains without dropout",
    "async_checkpointing": "checkpoints are saved synchronously",
    "quantization": "set in a config file it would quantize MaxText's trainer too, which "
                    "trains in full precision here; pass quantization=int8 or fp8 on train_rl's "
                    "command line: the rollout engine's weights only (jax engine; maxtext "
                    "engine for dense Qwen3)",
    "quantize_kvcache": "set in a config file it is MaxText's own KV cache's (its decode, not "
                        "this runtime's); pass quantize_kvcache=true (and kv_quant_dtype) on "
                        "train_rl's command line: the rollout engine's KV pages",
    "kv_quant_dtype": "set in a config file it is MaxText's own KV cache's; pass it on "
                      "train_rl's command line with quantize_kvcache=true",
    "kv_quant_axis": "set in a config file it is MaxText's own KV cache's; the rollout engine's "
                     "pages take kv_quant_axis on train_rl's command line",
    "rope_max_timescale": "the engine's Qwen3 forward rotates with theta 1e6 (Tunix's)",
}

# MaxText nested sections that mirror flat keys; compared through the flat keys (and `rl.*`).
_MIRRORS = frozenset({"cluster", "dataset", "evaluation", "reward", "vllm", "special_tokens",
                      "rl", "generation_configs"})
_RL_FLAT = ("num_generations", "num_iterations", "grpo_beta", "grpo_epsilon", "loss_algo",
            "loss_agg_mode", "use_agentic_rollout", "max_concurrency", "off_policy_steps",
            "system_prompt", "epsilon_high", "reshard_chunk_size", "use_rollout_logps",
            "force_on_policy_ratio", "log_sampler_trainer_agreement")
SUPPORTED_DECODER_BLOCK = "qwen3"
# MaxText decoder blocks the maxtext engine decodes (tests/test_maxtext_engine.py per family).
MAXTEXT_ENGINE_BLOCKS = frozenset({"qwen3", "qwen3_moe", "gpt_oss", "gemma4", "gemma4_small"})


def changed_keys(config: Any, default: Any) -> dict[str, Any]:
    """{key: value} for every key whose value differs from `default` (same model's defaults)."""
    now, base = config.model_dump(), default.model_dump()
    out = {k: v for k, v in now.items()
           if k not in _MIRRORS and k not in _RL_FLAT and v != base.get(k)}
    out.update({f"rl.{k}": v for k, v in now["rl"].items() if v != base["rl"].get(k)})
    return out


def check_keys(changed: dict[str, Any], rollout_engine: str = "jax") -> dict[str, Any]:
    """Raises ConfigError naming every changed key this runtime cannot honour; returns the
    changed keys that do not apply to it, with their values."""
    honoured_vllm = set(VLLM_ENGINE_KEYS) if rollout_engine == "vllm" else set()
    if rollout_engine in PAGED_ENGINES:
        honoured_vllm |= set(KV_POOL_KEYS)

    def accepted(key: str) -> bool:
        if key in HONOURED_VALUES:
            return _value(changed[key]) in HONOURED_VALUES[key]
        return key in HONOURED or key in DERIVED or key in NOT_APPLICABLE

    refused = [k for k in sorted(changed) if not accepted(k)]
    if refused:
        lines = [f"  {k}={_value(changed[k])!r}: "
                 f"{REFUSED.get(k, 'not supported under rl_runtime=mcjax yet')}" for k in refused]
        raise ConfigError(
            "rl_runtime=mcjax cannot honour these MaxText settings:\n" + "\n".join(lines)
            + "\nRemove them (or use rl_runtime=pathways) and run again.")
    return {k: changed[k] for k in sorted(changed)
            if k in NOT_APPLICABLE and k not in honoured_vllm}


def _tunix_qwen3_mismatch(config: Any) -> str:
    """Why the jax engine's Tunix Qwen3 cannot decode this model ("" when it can)."""
    block = getattr(config.decoder_block, "value", config.decoder_block)
    if block != SUPPORTED_DECODER_BLOCK or config.num_experts > 1:
        return (f"decoder_block={block}, num_experts={config.num_experts}: the jax engine "
                "decodes dense Qwen3 only (decoder_block=qwen3)")
    if tuple(config.mlp_activations) != ("silu", "linear") or not config.use_qk_norm:
        return "the jax engine's Qwen3 needs mlp_activations=[silu, linear] and use_qk_norm=true"
    if not math.isclose(config.rope_max_timescale, 1e6):
        return f"rope_max_timescale={config.rope_max_timescale}: {REFUSED['rope_max_timescale']}"
    return ""


def rollout_engine_for(config: Any) -> str:
    """The adapter's engine: jax where Tunix Qwen3 decodes the model (dense Qwen3, the faster
    engine there, see README), maxtext for every other family."""
    return "maxtext" if _tunix_qwen3_mismatch(config) else "jax"


def check_model(config: Any, rollout_engine: str | None = None) -> None:
    """Raises ConfigError when `rollout_engine` (None: `rollout_engine_for(config)`) cannot
    decode MaxText's model as MaxText trains it."""
    engine = rollout_engine or rollout_engine_for(config)
    block = getattr(config.decoder_block, "value", config.decoder_block)
    if engine in ("jax", "vllm"):  # both decode the Tunix Qwen3 tree (vllm: mapped to HF names)
        why = _tunix_qwen3_mismatch(config)
        if why:
            raise ConfigError(f"model_name={config.model_name} cannot run with "
                              f"rollout_engine={engine}: {why}. Use rollout_engine=maxtext.")
        return
    if block not in MAXTEXT_ENGINE_BLOCKS:
        raise ConfigError(
            f"model_name={config.model_name} (decoder_block={block}) is not supported by "
            "rl_runtime=mcjax yet: its maxtext engine is tested on the families of MaxText's RL "
            f"recipes (decoder_block {', '.join(sorted(MAXTEXT_ENGINE_BLOCKS))}: dense Qwen3, "
            "Qwen3 MoE, gpt-oss, Gemma4). Use rl_runtime=pathways for this model.")
    if config.use_multimodal:
        raise ConfigError("use_multimodal=true: the maxtext engine decodes text prompts only; "
                          "set use_multimodal=false")


def per_host_data_parallelism(global_dp: int, num_hosts: int) -> int:
    """MaxText's rollout_data_parallelism counts replicas over all sampler devices; ours is per
    host, since each host runs its own engine."""
    if global_dp == -1:
        return -1
    if global_dp % num_hosts:
        raise ConfigError(
            f"rollout_data_parallelism={global_dp} does not divide by {num_hosts} hosts: "
            "under rl_runtime=mcjax every host runs the same number of engine replicas. "
            f"Use a multiple of {num_hosts}, or -1 (all local devices).")
    return global_dp // num_hosts


def agentic_values(rl: Any, adapter_keys: dict[str, Any]) -> dict[str, Any]:
    """Our agentic keys from MaxText's `rl.*` (and the adapter's own keys, as given)."""
    return {
        "use_agentic_rollout": True,
        "epsilon_high": -1.0 if rl.epsilon_high is None else rl.epsilon_high,
        "off_policy_steps": rl.off_policy_steps,
        "max_concurrency": rl.max_concurrency,
        "system_prompt": rl.system_prompt,
        "use_rollout_logps": rl.use_rollout_logps,
        "force_on_policy_ratio": rl.force_on_policy_ratio,
        "agentic_environment": DEFAULT_ENVIRONMENT,
        **adapter_keys,
    }


def _value(value: Any) -> Any:
    """An enum member's value (MaxText's DType, ProfilerType, ...), other values as they are."""
    return getattr(value, "value", value)


def _dtype(value: Any) -> str:
    return str(_value(value))


def to_config(config: Any, num_hosts: int, tokenizer_path: str,
              changed: dict[str, Any] | None = None, rollout_engine: str | None = None,
              agentic: dict[str, Any] | None = None,
              corrections: dict[str, Any] | None = None,
              rollout: dict[str, Any] | None = None) -> Config:
    """Our Config from MaxText's (already checked with `check_keys` and `check_model`).
    `changed`: the keys set away from MaxText's defaults; a vLLM key with an equivalent here
    (`VLLM_KEYS`) sets it only when changed. Under rollout_engine=vllm the engine takes
    MaxText's vLLM settings as they are (`VLLM_ENGINE_KEYS`). `rollout_engine` None: the
    model's engine (`rollout_engine_for`). `agentic`: the `AGENTIC_ADAPTER_KEYS` given;
    `corrections`: the `CORRECTION_ADAPTER_KEYS` given; `rollout`: the `ROLLOUT_ADAPTER_KEYS`."""
    rl = config.rl
    values = {
        "rl_runtime": "mcjax",
        "rl_async_metrics_export": config.rl_async_metrics_export,
        "rl_gc_freeze_after_warmup": config.rl_gc_freeze_after_warmup,
        "rl_balance_prompts_by_length": config.rl_balance_prompts_by_length,
        "rl_balance_by_expected_output": config.rl_balance_by_expected_output,
        "rl_publish_weights_single_call": config.rl_publish_weights_single_call,
        "run_name": config.run_name,
        "base_output_directory": config.base_output_directory,
        "seed": config.data_shuffle_seed,
        "jax_cache_dir": config.jax_cache_dir or "",
        # MaxText's train_steps counts updates: num_iterations per batch.
        "steps": int(config.train_steps) // rl.num_iterations,
        "num_iterations": rl.num_iterations,
        "log_period": config.log_period,
        "enable_checkpointing": config.enable_checkpointing,
        "checkpoint_period": config.checkpoint_period,
        "max_num_checkpoints_to_keep": config.max_num_checkpoints_to_keep,
        "model_name": config.model_name,
        "base_num_decoder_layers": config.num_decoder_layers,
        "base_emb_dim": config.emb_dim,
        "base_mlp_dim": config.mlp_dim,
        "base_num_query_heads": config.num_query_heads,
        "base_num_kv_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "rope_max_timescale": int(config.rope_max_timescale),
        "dtype": _dtype(config.dtype),
        "weight_dtype": _dtype(config.weight_dtype),
        "init_weights_seed": config.init_weights_seed,
        "tokenizer_type": "huggingface",
        "tokenizer_path": tokenizer_path,
        "dataset_name": config.dataset_name,
        "hf_train_files": config.hf_train_files or "",
        "batch_size": config.batch_size,
        "num_generations": rl.num_generations,
        "max_prefill_predict_length": config.max_prefill_predict_length,
        "max_target_length": config.max_target_length,
        "train_micro_batch_size": config.train_micro_batch_size,
        # MaxText's model returns whole logits (its vocab tiling is off under train_rl) and
        # applies MaxText's own remat_policy.
        "train_logits_chunk_tokens": 0,
        "decode_sampling_temperature": config.decode_sampling_temperature,
        "decode_sampling_top_k": max(config.decode_sampling_top_k, 0),
        "decode_sampling_nucleus_p": config.decode_sampling_nucleus_p,
        "rollout_tensor_parallelism": config.rollout_tensor_parallelism,
        "rollout_data_parallelism": per_host_data_parallelism(config.rollout_data_parallelism,
                                                              num_hosts),
        "learning_rate": config.learning_rate,
        "warmup_steps_fraction": config.warmup_steps_fraction,
        "adam_b1": config.adam_b1,
        "adam_b2": config.adam_b2,
        "adam_weight_decay": config.adam_weight_decay,
        "gradient_clipping_threshold": config.gradient_clipping_threshold,
        "grpo_beta": rl.grpo_beta,
        "grpo_epsilon": rl.grpo_epsilon,
        "loss_algo": rl.loss_algo,
        "loss_agg_mode": rl.loss_agg_mode,
        "num_test_batches": config.num_test_batches,
        "eval_interval": config.eval_interval,
        "profiler": _dtype(config.profiler),
        "skip_first_n_steps_for_profiler": config.skip_first_n_steps_for_profiler,
        "profiler_steps": config.profiler_steps,
        "enable_tensorboard": config.enable_tensorboard,
    }
    if rl.use_agentic_rollout:
        values.update(agentic_values(rl, agentic or {}))
    values.update(corrections or {})
    values.update(rollout or {})
    values["reward_num_workers"] = config.reward_num_workers
    values["reward_worker_timeout_seconds"] = config.reward_worker_timeout_seconds
    values.update({target: changed[key] for key, target in VLLM_KEYS.items()
                   if target is not None and key in (changed or {})})
    values["rollout_engine"] = rollout_engine = rollout_engine or rollout_engine_for(config)
    if rollout_engine in PAGED_ENGINES:
        values.update(pool_values(config))
    if rollout_engine == "vllm":
        values.update(vllm_values(config))
    return load_config(None, values)
