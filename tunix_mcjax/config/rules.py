"""Cross-key rules: each names the keys involved and the fix, and runs after every key alone
has passed its own type and constraint (tunix_mcjax/config/fields.py)."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import TYPE_CHECKING, Any

from tunix_mcjax.config import agentic_rules
from tunix_mcjax.config.fields import ConfigError, keys_of
from tunix_mcjax.config.sections import Disaggregated, Vllm

if TYPE_CHECKING:
    from tunix_mcjax.config.keys import Keys

VLLM_KEYS = keys_of(Vllm)
# The engines with a KV page pool, and the keys that size it.
PAGED_ENGINES = ("jax", "maxtext", "vllm")
KV_POOL_KEYS = ("hbm_utilization_vllm", "max_num_batched_tokens", "vllm_block_size",
                "enable_prefix_caching")
DA_KEYS = keys_of(Disaggregated)
DA_SPLITS = (0.5, 0.25, 0.125)  # the paper's; any share that makes whole hosts runs
SPLIT_TOLERANCE = 0.05  # hosts: 0.33 of 3 hosts is 1 trainer host
# What rl_runtime=mcjax_da does not do (yet), with the fix.
DA_REFUSED = {
    "profiler": "the JAX profiler is wired into the colocated step only",
    "rl_balance_by_expected_output": "the output-length history lives in the colocated runtime",
}


def changed(cfg: Keys, keys: tuple[str, ...] | dict[str, str]) -> list[str]:
    """Those of `keys` whose value is not the default."""
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    return [k for k in keys if getattr(cfg, k) != defaults[k]]


def json_object(cfg: Keys, key: str) -> dict[str, Any]:
    """The JSON object a string key holds ({} when empty)."""
    raw = getattr(cfg, key)
    try:
        value = json.loads(raw) if raw else {}
    except json.JSONDecodeError as e:
        raise ConfigError(f"{key} must be a JSON object, e.g. {key}='{{\"k\": 1}}': {e}") from e
    if not isinstance(value, dict):
        raise ConfigError(f"{key} must be a JSON object, got {raw!r}")
    return value


def check_rules(cfg: Keys) -> None:
    """Every cross-key rule that needs no cluster shape. Raises ConfigError."""
    for rule in (_vllm, _kv_pool, _disaggregated, _runtime, _lengths_and_sampling,
                 _model_and_data, _train_memory, _lora, _quantization, _kv_quant_axis,
                 _evaluation_and_profiler, _rollout_correction, agentic_rules.check):
        rule(cfg)


def _vllm(cfg: Keys) -> None:
    if cfg.rollout_engine != "vllm":
        if keys := changed(cfg, VLLM_KEYS):
            raise ConfigError(f"{', '.join(keys)} configure the vLLM engine, but "
                              f"rollout_engine={cfg.rollout_engine}: set rollout_engine=vllm "
                              "or drop them")
        return
    if not cfg.rl_publish_weights_single_call:
        raise ConfigError("rollout_engine=vllm publishes the whole param tree in one call (a "
                          "partial publish is an error): set rl_publish_weights_single_call=true")
    if cfg.rl_runtime == "single":
        raise ConfigError("rl_runtime=single is the lockstep JAX baseline: use "
                          "rollout_engine=jax with it")
    for key in ("vllm_additional_config", "vllm_hf_overrides"):
        json_object(cfg, key)


def _kv_pool(cfg: Keys) -> None:
    if cfg.rollout_engine not in PAGED_ENGINES and (keys := changed(cfg, KV_POOL_KEYS)):
        raise ConfigError(f"{', '.join(keys)} size a KV page pool, but "
                          f"rollout_engine={cfg.rollout_engine} has none: drop them, or use "
                          f"rollout_engine={' or '.join(PAGED_ENGINES)}")
    if not cfg.free_kv_cache_during_weight_sync and cfg.rollout_engine == "vllm":
        raise ConfigError("free_kv_cache_during_weight_sync=false keeps our decode loop's page "
                          "pool across steps (rollout_engine=jax or maxtext); vLLM keeps its "
                          "pool here anyway: drop it")


def _disaggregated(cfg: Keys) -> None:
    if cfg.rl_runtime != "mcjax_da":
        if keys := changed(cfg, DA_KEYS):
            raise ConfigError(f"{', '.join(keys)} configure rl_runtime=mcjax_da, but "
                              f"rl_runtime={cfg.rl_runtime}: set rl_runtime=mcjax_da or drop them")
        return
    if not 0 < cfg.rl_trainer_hosts_fraction < 1:
        raise ConfigError(f"rl_trainer_hosts_fraction={cfg.rl_trainer_hosts_fraction} must be "
                          f"between 0 and 1 (the paper's splits: "
                          f"{', '.join(map(str, DA_SPLITS))})")
    if refused := changed(cfg, DA_REFUSED):
        raise ConfigError("rl_runtime=mcjax_da cannot honour "
                          + "; ".join(f"{k} ({DA_REFUSED[k]})" for k in refused)
                          + ". Drop them, or use rl_runtime=mcjax.")
    if cfg.num_test_batches > 0 and cfg.dataset_name != "next_digit":
        raise ConfigError(f"num_test_batches={cfg.num_test_batches}: rl_runtime=mcjax_da "
                          f"evaluates the built-in task's held-out prompts (dataset_name="
                          f"next_digit), and dataset_name={cfg.dataset_name} has none: set "
                          "num_test_batches=0, or use rl_runtime=mcjax")
    _in_flight(cfg)
    if cfg.rollout_engine != "jax":
        raise ConfigError(f"rl_runtime=mcjax_da runs rollout_engine=jax in its rollout actors; "
                          f"rollout_engine={cfg.rollout_engine} is colocated-only for now")


def _in_flight(cfg: Keys) -> None:
    """in_flight_weight_updates: the jax engine's decode session, a next version to take."""
    if not cfg.in_flight_weight_updates:
        if changed(cfg, ("in_flight_update_iterations",)):
            raise ConfigError("in_flight_update_iterations sets when in-flight weight updates "
                              "happen, which are off: set in_flight_weight_updates=true or "
                              "drop it")
        return
    if cfg.rollout_engine != "jax":
        why = (" (its session counts no tokens so far and refuses a publish with requests "
               "in vLLM)" if cfg.rollout_engine == "vllm" else "")
        raise ConfigError(f"in_flight_weight_updates=true decodes each batch on the jax "
                          f"engine's decode session in slices, loading the next version "
                          f"between them; rollout_engine={cfg.rollout_engine} cannot here{why}: "
                          "use rollout_engine=jax or drop in_flight_weight_updates")
    if cfg.off_policy_steps == 0:
        raise ConfigError("in_flight_weight_updates=true loads the version the trainers are "
                          "making while a batch decodes; at off_policy_steps=0 that update "
                          "waits for the batch itself: set off_policy_steps >= 1")


def _runtime(cfg: Keys) -> None:
    if cfg.rl_balance_by_expected_output and not cfg.rl_balance_prompts_by_length:
        raise ConfigError("rl_balance_by_expected_output=true refines O3's length balance, which "
                          "is off: also set rl_balance_prompts_by_length=true (or drop it)")
    if cfg.rollout_engine == "maxtext" and cfg.rl_runtime == "single":
        raise ConfigError("rollout_engine=maxtext runs one engine per host (rl_runtime=mcjax); "
                          "rl_runtime=single's lockstep baseline is rollout_engine=jax's")


def _lengths_and_sampling(cfg: Keys) -> None:
    if cfg.max_completion_length <= 0:
        raise ConfigError(
            f"completion budget max_target_length - max_prefill_predict_length = "
            f"{cfg.max_target_length} - {cfg.max_prefill_predict_length} = "
            f"{cfg.max_completion_length} must be > 0. Raise max_target_length.")
    if cfg.decode_sampling_temperature <= 0 and cfg.decode_sampling_strategy != "greedy":
        raise ConfigError("decode_sampling_temperature must be > 0 (or use "
                          "decode_sampling_strategy=greedy)")


def _rollout_correction(cfg: Keys) -> None:
    on = [f"{k}={getattr(cfg, k)}" for k in ("sampler_is", "rollout_rs")
          if getattr(cfg, k) != "none"]
    if on and cfg.num_iterations > 1:
        raise ConfigError(
            f"{', '.join(on)} with num_iterations={cfg.num_iterations}: the corrections take "
            "the ratio against the trainer's logprobs before the first update, which later "
            "updates of the batch do not keep; set num_iterations=1 or turn them off")
    if cfg.moe_router_replay and cfg.rollout_engine != "maxtext":
        raise ConfigError(f"moe_router_replay=true replays the maxtext engine's MoE routing; "
                          f"rollout_engine={cfg.rollout_engine} records none: use "
                          "rollout_engine=maxtext (a MaxText MoE family), or drop it")
    if cfg.moe_router_replay and cfg.use_agentic_rollout:
        raise ConfigError("moe_router_replay=true with use_agentic_rollout=true: tool and "
                          "environment tokens never run through the engine, so they have no "
                          "routing to replay; drop one of them")
    for switch, bounds in (("sampler_is", ("sampler_is_threshold",)),
                           ("rollout_rs", ("rollout_rs_threshold", "rollout_rs_threshold_lower"))):
        if getattr(cfg, switch) == "none" and (keys := changed(cfg, bounds)):
            raise ConfigError(f"{', '.join(keys)} bound {switch}, which is none (off): set "
                              f"{switch}=token or {switch}=sequence, or drop them")


def _model_and_data(cfg: Keys) -> None:
    if cfg.base_num_query_heads % cfg.base_num_kv_heads:
        raise ConfigError("base_num_query_heads must be a multiple of base_num_kv_heads")
    if cfg.tokenizer_type == "huggingface" and not cfg.tokenizer_path:
        raise ConfigError("tokenizer_type=huggingface needs tokenizer_path=<dir with tokenizer>")


def _train_memory(cfg: Keys) -> None:
    mb = cfg.train_micro_batch_size
    if mb > 0 and (mb > cfg.batch_size or cfg.batch_size % mb):
        raise ConfigError(
            f"train_micro_batch_size={mb} prompts per micro-batch must divide batch_size="
            f"{cfg.batch_size} (as in MaxText/Tunix). Use a divisor of {cfg.batch_size}, or -1 "
            "for no gradient accumulation.")


def _lora(cfg: Keys) -> None:
    """LoRA keys (lora.py): set only with a rank, a regex that compiles, an engine that decodes
    the adapters."""
    if not cfg.lora_rank:
        if keys := changed(cfg, ("lora_alpha", "lora_module_path")):
            raise ConfigError(f"{', '.join(keys)} configure LoRA, but lora_rank=0 (full "
                              "fine-tuning): set lora_rank > 0, or drop them")
        return
    try:
        re.compile(cfg.lora_module_path)
    except re.error as e:
        raise ConfigError(f"lora_module_path={cfg.lora_module_path!r} is not a regex: {e}") from e
    if cfg.rollout_engine != "jax":
        raise ConfigError(f"lora_rank={cfg.lora_rank}: rollout_engine={cfg.rollout_engine} does "
                          "not decode LoRA adapters; use rollout_engine=jax")


# The engines that hold quantized weights (`engine.quantize`; the maxtext engine dense Qwen3's,
# `engine.maxtext_quantize`) and KV pages (`engine.paged_attention.QuantizedPages`).
QUANT_ENGINES = ("jax", "maxtext")


def _quantization(cfg: Keys) -> None:
    """Quantized rollout weights and KV pages: the engines of our decode loop (jax, maxtext);
    the trainer never quantizes."""
    if cfg.quantization and cfg.rollout_engine not in QUANT_ENGINES:
        raise ConfigError(f"quantization={cfg.quantization}: rollout_engine={cfg.rollout_engine} "
                          "does not quantize its weights (the jax and maxtext engines do); use "
                          "one of them, or drop quantization")
    if cfg.quantize_kvcache and cfg.rollout_engine not in QUANT_ENGINES:
        raise ConfigError(f"quantize_kvcache=true: rollout_engine={cfg.rollout_engine} does not "
                          "quantize its KV pages (the jax and maxtext engines do); use one of "
                          "them, or drop quantize_kvcache")


def _kv_quant_axis(cfg: Keys) -> None:
    """A static per-tensor KV scale is 1.0, which only fp8's range takes."""
    if cfg.quantize_kvcache and cfg.kv_quant_axis == "tensor" and cfg.kv_quant_dtype != "fp8":
        raise ConfigError(f"kv_quant_axis=tensor kv_quant_dtype={cfg.kv_quant_dtype}: a static "
                          "per-tensor scale of 1.0 fits fp8's range, and int8 would need a "
                          "calibrated scale the engine does not have; use kv_quant_dtype=fp8, "
                          "or kv_quant_axis=dkv")


def _evaluation_and_profiler(cfg: Keys) -> None:
    """Evaluation and profiler keys (MaxText's checks, with the fix named)."""
    if cfg.eval_schedule == "tunix" and cfg.num_test_batches > 0 and cfg.eval_interval <= 0:
        raise ConfigError(f"eval_schedule=tunix evaluates every eval_interval steps (Tunix's "
                          f"eval_every_n_steps), which must be >= 1; got {cfg.eval_interval}")
    if not cfg.profiler:
        return
    if cfg.skip_first_n_steps_for_profiler < 0 or cfg.profiler_steps < 1:
        raise ConfigError(
            f"profiler={cfg.profiler} needs skip_first_n_steps_for_profiler >= 0 and "
            f"profiler_steps >= 1, got {cfg.skip_first_n_steps_for_profiler} and "
            f"{cfg.profiler_steps}")
    if cfg.skip_first_n_steps_for_profiler >= cfg.steps:
        raise ConfigError(
            f"profiler={cfg.profiler}: skip_first_n_steps_for_profiler="
            f"{cfg.skip_first_n_steps_for_profiler} starts the trace past the last of "
            f"steps={cfg.steps} (MaxText refuses this too). Lower it below {cfg.steps}.")


def disaggregated_split(cfg: Keys, num_hosts: int) -> tuple[int, int]:
    """(trainer hosts, rollout hosts) of `num_hosts` under rl_runtime=mcjax_da."""
    if num_hosts < 2:
        raise ConfigError("rl_runtime=mcjax_da needs at least 2 hosts (a trainer and a rollout "
                          "host); use rl_runtime=mcjax on one host")
    share = cfg.rl_trainer_hosts_fraction * num_hosts
    trainers = round(share)
    if abs(share - trainers) > SPLIT_TOLERANCE or not 1 <= trainers < num_hosts:
        near = sorted({min(max(k, 1), num_hosts - 1) for k in (int(share), int(share) + 1)})
        options = " or ".join(f"{k / num_hosts:.4g} ({k} of {num_hosts})" for k in near)
        raise ConfigError(
            f"rl_trainer_hosts_fraction={cfg.rl_trainer_hosts_fraction} of {num_hosts} hosts "
            f"is {share:g} trainer hosts: it must be a whole number >= 1 that leaves a "
            f"rollout host. Use {options}, or a host count it makes whole.")
    rollouts = num_hosts - trainers
    if cfg.batch_size < rollouts:
        raise ConfigError(
            f"batch_size={cfg.batch_size} prompts per step leaves some of the {rollouts} "
            f"rollout hosts without a prompt ({num_hosts} hosts, rl_trainer_hosts_fraction="
            f"{cfg.rl_trainer_hosts_fraction}). Raise batch_size, or use fewer hosts.")
    if cfg.rl_balance_prompts_by_length and cfg.batch_size % rollouts:
        raise ConfigError(
            f"rl_balance_prompts_by_length=true gives every host the same number of prompts, "
            f"but batch_size={cfg.batch_size} does not divide by the {rollouts} rollout "
            f"hosts. Use a multiple of {rollouts}, or turn O3 off (shares then differ by "
            "at most one prompt).")
    return int(trainers), rollouts


def check_topology(cfg: Keys, num_hosts: int, local_devices: int) -> None:
    """Divisibility rules that need the cluster shape. Raises ConfigError."""
    if cfg.rl_runtime == "single" and num_hosts > 1:
        raise ConfigError("rl_runtime=single runs in one process: use --hosts 1")
    if cfg.rl_runtime == "mcjax_da":
        disaggregated_split(cfg, num_hosts)
        num_hosts = 1  # the global batch is split over rollout hosts, checked above
    if cfg.batch_size % num_hosts:
        raise ConfigError(
            f"batch_size={cfg.batch_size} prompts per step does not divide by {num_hosts} "
            f"hosts: every host needs whole GRPO groups. Use a multiple of {num_hosts}.")
    tp = cfg.rollout_tensor_parallelism
    if local_devices % tp:
        raise ConfigError(
            f"rollout_tensor_parallelism={tp} does not divide the {local_devices} local "
            f"devices of a host. Use a divisor of {local_devices}.")
    dp = cfg.rollout_data_parallelism
    if dp != -1 and dp * tp > local_devices:
        raise ConfigError(
            f"rollout_data_parallelism={dp} x rollout_tensor_parallelism={tp} needs "
            f"{dp * tp} devices but a host has {local_devices}.")
