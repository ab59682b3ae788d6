"""Tunix's CLI config (`grpo_main`'s `GrpoPipeline`) -> our `Config`, key by key.

Every key of the run's Tunix config (base YAML, override file, key=value, `T_*` env, flattened to
dotted names) falls in one group:
- HONOURED: mapped onto our Config, or used by the same Tunix code under both runtimes (Tunix's
  dataset loader, reward-function loader, optimizer and schedule); HONOURED_VALUES: honoured at
  the listed values only (e.g. `rollout_engine=vanilla`);
- NOT_APPLICABLE: settings of what rl_runtime=mcjax replaces (device layout, Tunix's rollout
  engines and perf tooling) or that Tunix's own GRPO CLI never reads; listed in the run's log and
  in `tunix_adapter_host<h>.json`, each with its reason;
- anything else is refused by name, before any model is built.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
from collections.abc import Mapping
from typing import Any

from tunix_mcjax.config import Config, ConfigError, load_config

ROLES = ("actor_model_config", "reference_model_config", "rollout_model_config")
MODEL_KEYS = ("model_name", "model_id", "model_source", "model_path", "model_download_path",
              "rng_seed", "remat_config", "model_display")

HONOURED: dict[str, str] = {
    "rl_runtime": "selects this runtime",
    # The model: a Tunix Qwen3, loaded from its Hugging Face checkpoint (tunix/model.py).
    "model_config.model_name": "Tunix's model naming (the Qwen3 config)",
    "model_config.model_id": "Tunix's model naming; the Hugging Face repo to download",
    "model_config.model_source": "huggingface: safetensors through Tunix's Qwen3 loader",
    "model_config.model_download_path": "the checkpoint directory (downloaded there if empty)",
    "model_config.rng_seed": "seed (LoRA init, sampling seeds)",
    "model_config.remat_config": "remat_policy (1 NONE: none, 3 DECODER: full)",
    "actor_model_config.mesh.shape": "the run's device count (the product must match)",
    "actor_model_config.mesh.axis_names": "('fsdp', 'tp'), Tunix Qwen3's axis names",
    # Tokenizer: Tunix's own (tunix.generate.tokenizer_adapter.Tokenizer).
    "tokenizer_config.tokenizer_path": "Tunix's tokenizer",
    "tokenizer_config.tokenizer_type": "Tunix's tokenizer (huggingface)",
    "tokenizer_config.add_bos": "Tunix's tokenizer: prompts encoded as its sampler encodes them",
    "tokenizer_config.add_eos": "Tunix's tokenizer: prompts encoded as its sampler encodes them",
    # Data: Tunix's loader (GrpoPipeline._get_dataset), split and batches as post_init_dataset.
    **dict.fromkeys(("data_source", "data_directory", "data_module", "dataset_name",
                     "tfds_download", "apply_chat_template_to_dataset", "prompt_key",
                     "train_split", "split"), "Tunix's dataset loader"),
    "batch_size": "batch_size (prompts per step)",
    "num_batches": "steps and rows kept (Tunix's compute_params)",
    "num_train_epochs": "steps and rows (Tunix's compute_params; the epochs' batches in order)",
    "train_fraction": "the train rows; the rest are the evaluation rows",
    "warmup_ratio": "Tunix's compute_params: the schedule's warmup_steps when unset",
    "warmup_steps": "Tunix's compute_params: the schedule's warmup_steps when unset",
    "num_test_batches": "num_test_batches (evaluation batches of the held-out rows)",
    "reward_functions": "Tunix's reward functions, loaded by Tunix's obtain_reward_fn",
    "verl_compatible": "Tunix's obtain_reward_fn",
    # Training.
    "rl_training_config.eval_every_n_steps": "eval_interval (eval_schedule=tunix)",
    "rl_training_config.max_steps": "steps (Tunix's compute_params)",
    "rl_training_config.checkpoint_root_directory": "checkpoint_directory (empty/null: off)",
    "rl_training_config.checkpointing_options.save_interval_steps": "checkpoint_period",
    "rl_training_config.checkpointing_options.max_to_keep": "max_num_checkpoints_to_keep",
    "rl_training_config.metrics_logging_options.log_dir":
        "run directory: TensorBoard scalars under <log_dir>/tensorboard, steps.jsonl beside",
    "rl_training_config.metrics_logging_options.flush_every_n_steps": "log_period",
    "rl_training_config.train_micro_batch_size": "train_micro_batch_size (accumulation)",
    "rl_training_config.profiler_options.skip_first_n_steps": "skip_first_n_steps_for_profiler",
    "rl_training_config.profiler_options.profiler_steps": "profiler_steps (profiler=xplane)",
    # GRPO.
    "grpo_config.num_generations": "num_generations",
    "grpo_config.beta": "grpo_beta",
    "grpo_config.epsilon": "grpo_epsilon",
    "grpo_config.loss_algo": "loss_algo",
    "grpo_config.loss_agg_mode": "loss_agg_mode",
    "grpo_config.num_iterations": "num_iterations (updates per batch; max_steps counts updates)",
    # Tunix main's TIS (GRPOConfig after 0.1.7): null or "token" (docs/mismatch.md).
    "grpo_config.sampler_is": "sampler_is (null: none)",
    "grpo_config.sampler_is_threshold": "sampler_is_threshold",
    # Rollout (sampling on each host's engine).
    "rollout_config.total_generation_steps": "max_target_length - max_prefill_predict_length",
    "rollout_config.max_prompt_length": "max_prefill_predict_length (longer prompts dropped)",
    "rollout_config.temperature": "decode_sampling_temperature",
    "rollout_config.top_p": "decode_sampling_nucleus_p",
    "rollout_config.top_k": "decode_sampling_top_k",
}

# Keys honoured at these values only: what this runtime does.
HONOURED_VALUES: dict[str, tuple[Any, ...]] = {
    "model_config.model_display": (False,),
    "model_config.model_path": ("", None),  # Kaggle, GCS and internal sources' path
    "rollout_engine": ("vanilla",),
    "offload_to_cpu": (False,),
    "training_mode": ("grpo",),
    "rl_training_config.data_sharding_axis": (["fsdp"], ("fsdp",)),
    "rl_training_config.critic_optimizer_config": (None,),
    "rl_training_config.perf_metrics_options": ({}, None),
    "rl_training_config.profiler_options": ({}, None),
    "rl_training_config.max_seq_token_per_tpu": (None,),
    "grpo_config.advantage_estimator": ("grpo",),
    "grpo_config.algo_variant": ("grpo",),
    "grpo_config.policy_loss_fn": ("grpo",),
    "grpo_config.reward_manager": ("sequence-level",),
    "grpo_config.kl_clamp_value": (None,),
    "grpo_config.kl_loss_mode": ("kl",),
}

NOT_APPLICABLE: dict[str, str] = {
    "model_config.intermediate_ckpt_dir": "Tunix converts Kaggle Gemma checkpoints there; "
                                          "not read for Hugging Face Qwen3",
    "model_config.use_flash_attention": "a TPU attention kernel; the trainer's attention is "
                                        "blockwise over packed segments, the same math",
    "model_config.flash_attention_block_size": "the flash attention kernel's block",
    "actor_model_config.mesh.allocation_policy": "carves role meshes from one device pool; "
                                                 "here every role uses every device",
    "max_target_length": "SFT's (peft_main); grpo_main does not read it",
    "rl_training_config.metrics_logging_options.project_name": "Weights & Biases' project",
    "rl_training_config.metrics_logging_options.run_name": "Weights & Biases' run name",
    "rl_training_config.max_inflight_computations": "Tunix's asynchronous dispatch depth",
    "rl_training_config.metrics_prefix": "Tunix's metric names",
    "rl_training_config.pbar_description": "Tunix's progress bar",
    "rl_training_config.rollout_micro_batch_size": "each host's engine takes all its requests "
                                                   "in one call",
    "rl_training_config.compute_logps_micro_batch_size": "the behaviour logprobs come from the "
                                                         "engine",
    "rl_training_config.profiler_options.log_dir": "traces go to <log_dir>/tensorboard/host_<h>",
}
# Sections Tunix's GRPO CLI itself never reads (SFT's), or reads only for other engines.
NOT_APPLICABLE_SECTIONS: dict[str, str] = {
    "optimizer_config": "SFT's (peft_main); GRPO's is rl_training_config.actor_optimizer_config",
    "training_config": "SFT's (peft_main); GRPO's is rl_training_config",
    "vllm_config": "rollout_engine=vllm's; this run's engine is vanilla's",
    "sglang_jax_config": "rollout_engine=sglang_jax's; this run's engine is vanilla's",
    "data_config": "Tunix's data_module arguments (Tunix's dataset loader)",
}
# MaxText's (and our) names of the rollout's quantization keys.
ROLLOUT_QUANTIZATION_KEYS = ("quantization", "quantize_kvcache", "kv_quant_dtype", "kv_quant_axis")
# Why other keys users are likely to set are refused, and what to do.
REFUSED: dict[str, str] = {
    "rollout_engine": "each host decodes with this runtime's engine over Tunix Qwen3 (the "
                      "vanilla sampler's math); use rollout_engine=vanilla",
    "offload_to_cpu": "params stay on the devices; use false",
    "training_mode": "agentic_grpo is not mapped onto this runtime's agentic rollouts yet "
                     "(tunix_mcjax.launch runs them: use_agentic_rollout=true); use grpo",
    "rl_training_config.mini_batch_size": "one update per step: use batch_size or null",
    "rl_training_config.gradient_accumulation_steps": "set by train_micro_batch_size here",
    "model_config.remat_config": "use 1 (NONE) or 3 (DECODER); BLOCK is not implemented",
    "tokenizer_config.tokenizer_type": "this runtime decodes with Hugging Face tokenizers",
    "model_config.model_source": "checkpoints load from Hugging Face safetensors: use "
                                 "model_source=huggingface",
    # Tunix's RL config has no rollout quantization key (RolloutConfig has none); MaxText's.
    **dict.fromkeys(ROLLOUT_QUANTIZATION_KEYS, "Tunix's RL config has no rollout quantization "
                    "key (its runtime would not quantize); the quantized rollout runs under "
                    "MaxText's adapter (train_rl ... quantization=int8) or tunix_mcjax.launch"),
    "rollout_config.rollout_vllm_kwargs": "vLLM's engine arguments (its quantization and "
                                          "kv_cache_dtype among them) are rollout_engine=vllm's; "
                                          "this runtime's engine takes none",
}
REMAT = {1: "none", 3: "full"}  # Tunix's RematConfig NONE and DECODER


def plain(value: Any) -> Any:
    """OmegaConf containers (as Tunix's config holds them) as plain dicts and lists."""
    import omegaconf

    if isinstance(value, omegaconf.DictConfig | omegaconf.ListConfig):
        return omegaconf.OmegaConf.to_container(value, resolve=True)
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted keys of every leaf; an empty mapping is a leaf ({})."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def _optimizer_keys(optimizer: Mapping[str, Any]) -> set[str]:
    """The actor optimizer keys Tunix's `create_optimizer` reads: the optax function's and the
    schedule's own arguments."""
    import optax

    read = {"opt_type", "schedule_type", "learning_rate"}
    fn = getattr(optax, str(optimizer.get("opt_type", "")).lower(), None)
    schedule = getattr(optax.schedules, str(optimizer.get("schedule_type") or ""), None)
    for f in (fn, schedule):
        if callable(f):
            read |= set(inspect.signature(f).parameters)
    return read


def _dataclass_defaults(cls: type) -> dict[str, Any]:
    return {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(cls)
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}


def sampler_is_values(grpo: Mapping[str, Any]) -> dict[str, Any]:
    """Tunix main's TIS keys, where the config sets them (Tunix's null is our none)."""
    out = {}
    if "sampler_is" in grpo:
        out["sampler_is"] = grpo["sampler_is"] or "none"
    if grpo.get("sampler_is_threshold") is not None:
        out["sampler_is_threshold"] = float(grpo["sampler_is_threshold"])
    return out


def classify(config: Mapping[str, Any]) -> tuple[list[str], dict[str, str]]:
    """(refused lines, {key: why it does not apply}) over every key of Tunix's config."""
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    config = plain(config)
    refused, not_applied = [], {}
    optimizer = (config.get("rl_training_config") or {}).get("actor_optimizer_config") or {}
    optimizer_read = _optimizer_keys(optimizer)
    rollout_defaults = _dataclass_defaults(base_rollout.RolloutConfig)
    grpo_defaults = _dataclass_defaults(grpo_learner.GrpoConfig)

    def refuse(key: str, value: Any, why: str | None = None) -> None:
        refused.append(f"  {key}={value!r}: "
                       f"{why or REFUSED.get(key, 'not supported under rl_runtime=mcjax yet')}")

    for key, value in flatten(config).items():
        section, _, rest = key.partition(".")
        if section in ("model_config", *ROLES):
            key = _model_key(section, rest, not_applied)
            if key is None:
                continue
        if key in HONOURED_VALUES:
            if value not in HONOURED_VALUES[key]:
                refuse(key, value)
        elif key in HONOURED:
            continue
        elif key in NOT_APPLICABLE:
            not_applied[key] = NOT_APPLICABLE[key]
        elif section in NOT_APPLICABLE_SECTIONS:
            not_applied[section] = NOT_APPLICABLE_SECTIONS[section]
        elif key.startswith("rl_training_config.actor_optimizer_config."):
            if rest.partition(".")[2] not in optimizer_read:
                not_applied[key] = ("Tunix's create_optimizer passes only the optax "
                                    "optimizer's and schedule's own arguments")
        elif section == "rollout_config":
            field = rest.partition(".")[0]  # a dict field's keys come flattened
            if field not in rollout_defaults and rest != "total_generation_steps":
                not_applied[key] = "not a RolloutConfig field: Tunix's CLI does not read it"
            elif value != rollout_defaults.get(rest):
                refuse(key, value, REFUSED.get(f"{section}.{field}", "only "
                                   "total_generation_steps, max_prompt_length, temperature, "
                                   "top_p and top_k apply to this runtime's engine"))
        elif section == "grpo_config" and rest in grpo_defaults and value == grpo_defaults[rest]:
            continue
        elif key == "rl_training_config.mini_batch_size" and value in (None, config["batch_size"]):
            continue
        elif key == "rl_training_config.gradient_accumulation_steps" and value is None:
            continue
        else:
            refuse(key, value)
    refused += _check_roles(config)
    return refused, not_applied


def _model_key(section: str, rest: str, not_applied: dict[str, str]) -> str | None:
    """The table key of a model section's key (roles inherit model_config's, so they are read
    as model_config's), or None when it is settled here: the mesh and LoRA belong to the actor,
    and the model's identity keys are compared across roles (`_check_roles`)."""
    name = f"{section}.{rest}"
    head = rest.partition(".")[0]
    if head == "lora_config":
        if section in ("reference_model_config", "rollout_model_config"):
            not_applied[name] = ("Tunix drops the reference's LoRA; the rollout decodes the "
                                 "actor (with its adapters)")
        return None
    if head in MODEL_KEYS[:-1]:
        return name if section == "model_config" else None
    if head in ("mesh", "same_mesh_as"):
        if section == "actor_model_config":
            return name
        if section != "model_config":
            not_applied[name] = ("each host decodes on its own devices; the reference shares "
                                 "the trainer's mesh")
        return None
    return f"model_config.{rest}"


def _check_roles(config: Mapping[str, Any]) -> list[str]:
    """One model for every role: the reference is the actor's initial weights, the rollout the
    actor's current weights, so their model keys must equal model_config's."""
    refused = []
    base = config.get("model_config") or {}
    for role in ROLES:
        section = config.get(role) or {}
        for key in MODEL_KEYS:
            if section.get(key, base.get(key)) != base.get(key):
                refused.append(
                    f"  {role}.{key}={section.get(key)!r}: differs from model_config.{key}="
                    f"{base.get(key)!r}; this runtime trains one model (the reference is its "
                    "initial weights, the rollout its current weights)")
    for key in ("critic_model_config", "reward_model_config"):
        if config.get(key):
            refused.append(f"  {key}: GRPO here has no critic or reward model; remove it")
    lora = (config.get("actor_model_config") or {}).get("lora_config") or {}
    for key in sorted(set(lora) - {"rank", "alpha", "module_path"}):
        refused.append(f"  actor_model_config.lora_config.{key}={lora[key]!r}: QLoRA "
                       "(weight_qtype, tile_size) is not implemented; use rank, alpha, "
                       "module_path")
    return refused


def check(config: Mapping[str, Any]) -> dict[str, str]:
    """Raises ConfigError naming every key this runtime cannot honour; returns the keys that do
    not apply to it, with why."""
    refused, not_applied = classify(config)
    if refused:
        raise ConfigError("rl_runtime=mcjax cannot honour these Tunix settings:\n"
                          + "\n".join(refused)
                          + "\nChange or remove them (or use rl_runtime=default) and run again.")
    return dict(sorted(not_applied.items()))


def mesh_devices(config: Mapping[str, Any]) -> int:
    """The actor mesh's device count (Tunix's `parse_mesh_config` format), axis names checked."""
    mesh = plain(config)["actor_model_config"].get("mesh") or {}
    try:
        shape, names = ast.literal_eval(mesh["shape"]), ast.literal_eval(mesh["axis_names"])
    except (KeyError, ValueError, SyntaxError) as e:
        raise ConfigError(f"actor_model_config.mesh={mesh!r} needs shape and axis_names as "
                          "Tunix writes them, e.g. shape=\"(2,4)\" axis_names=\"('fsdp','tp')\""
                          ) from e
    if tuple(names) != ("fsdp", "tp") or len(shape) != 2:
        raise ConfigError(f"actor_model_config.mesh.axis_names={names!r}: Tunix Qwen3 shards "
                          "over ('fsdp', 'tp'); use those two axes")
    return int(shape[0]) * int(shape[1])


def check_devices(config: Mapping[str, Any], num_devices: int) -> None:
    """The actor mesh must cover every device of the run: this runtime trains FSDP over all of
    them and each host decodes on its own."""
    wanted = mesh_devices(config)
    if wanted != num_devices:
        raise ConfigError(
            f"actor_model_config.mesh.shape asks for {wanted} devices but the run has "
            f"{num_devices}: rl_runtime=mcjax trains over every device of every host. Use a "
            f"shape whose product is {num_devices}, e.g. \"({num_devices},1)\".")


def lora_values(config: Mapping[str, Any]) -> dict[str, Any]:
    """Our LoRA keys from the actor's lora_config ({} when LoRA is off)."""
    lora = plain(config)["actor_model_config"].get("lora_config") or {}
    return {} if not lora else {"lora_rank": lora["rank"], "lora_alpha": float(lora["alpha"]),
                                "lora_module_path": lora["module_path"]}


def run_location(log_dir: str) -> tuple[str, str]:
    """(base_output_directory, run_name) whose run directory is `log_dir`."""
    log_dir = str(log_dir).rstrip("/")
    if not log_dir:
        raise ConfigError("rl_training_config.metrics_logging_options.log_dir must be set: it "
                          "is the run directory (TensorBoard scalars, steps.jsonl)")
    return os.path.dirname(log_dir) or ".", os.path.basename(log_dir)


def to_config(config: Mapping[str, Any], model: dict[str, Any], steps: int) -> Config:
    """Our Config from Tunix's (already `check`ed), the model's shape keys (`tunix.model`) and
    the step count Tunix's compute_params gives."""
    config = plain(config)
    training = config["rl_training_config"]
    grpo, rollout = config["grpo_config"], config["rollout_config"]
    optimizer = training.get("actor_optimizer_config") or {}
    actor = config["actor_model_config"]
    logging_options = training.get("metrics_logging_options") or {}
    checkpointing = training.get("checkpointing_options") or {}
    profiler = training.get("profiler_options") or {}
    base, run_name = run_location(logging_options.get("log_dir", ""))
    if actor.get("remat_config", 1) not in REMAT:
        raise ConfigError(f"model_config.remat_config={actor['remat_config']}: "
                          f"{REFUSED['model_config.remat_config']}")
    max_prompt = int(rollout["max_prompt_length"])
    # Tunix's max_steps and eval_every_n_steps count actor updates: num_iterations per batch.
    iterations = int(grpo.get("num_iterations", 1))
    eval_every = int(training["eval_every_n_steps"])
    if iterations > 1 and config.get("num_test_batches") and eval_every % iterations:
        raise ConfigError(
            f"rl_training_config.eval_every_n_steps={eval_every} counts actor updates, "
            f"{iterations} per batch (grpo_config.num_iterations): make it a multiple of "
            f"{iterations}, so evaluations fall between batches")
    values = {
        "rl_runtime": "mcjax",
        "run_name": run_name,
        "base_output_directory": base,
        "seed": int(actor.get("rng_seed", 0)),
        "init_weights_seed": int(actor.get("rng_seed", 0)),
        "steps": -(-steps // iterations),  # Tunix stops at the first batch reaching max_steps
        "num_iterations": iterations,
        "log_period": int(logging_options.get("flush_every_n_steps") or 1),
        "enable_checkpointing": bool(training.get("checkpoint_root_directory")),
        "checkpoint_directory": str(training.get("checkpoint_root_directory") or ""),
        "checkpoint_period": int(checkpointing.get("save_interval_steps", 50)),
        "max_num_checkpoints_to_keep": int(checkpointing.get("max_to_keep", 2)),
        **model,
        "tokenizer_type": "huggingface",
        "tokenizer_path": config["tokenizer_config"]["tokenizer_path"],
        "dataset_name": str(config.get("dataset_name") or config.get("data_source")),
        "batch_size": int(config["batch_size"]),
        "num_generations": int(grpo["num_generations"]),
        "max_prefill_predict_length": max_prompt,
        "max_target_length": max_prompt + int(rollout["total_generation_steps"]),
        "decode_sampling_temperature": float(rollout["temperature"]),
        "decode_sampling_top_k": int(rollout.get("top_k") or 0),
        "decode_sampling_nucleus_p": float(rollout.get("top_p") or 1.0),
        "rollout_engine": "jax",
        # The update uses Tunix's own optimizer (create_optimizer); these record its settings.
        "learning_rate": float(optimizer.get("peak_value") or optimizer.get("learning_rate")
                               or optimizer.get("value") or 0.0),
        "adam_b1": float(optimizer.get("b1", 0.9)),
        "adam_b2": float(optimizer.get("b2", 0.999)),
        "adam_weight_decay": float(optimizer.get("weight_decay", 0.0)),
        "gradient_clipping_threshold": 0.0,  # Tunix's CLI clips nothing (max_grad_norm unread)
        "train_micro_batch_size": int(training.get("train_micro_batch_size") or -1),
        "remat_policy": REMAT[actor.get("remat_config", 1)],
        "grpo_beta": float(grpo.get("beta", 0.04)),
        "grpo_epsilon": float(grpo.get("epsilon", 0.2)),
        "loss_algo": grpo.get("loss_algo", "grpo"),
        "loss_agg_mode": grpo.get("loss_agg_mode", "sequence-mean-token-mean"),
        **sampler_is_values(grpo),
        "num_test_batches": int(config.get("num_test_batches") or 0),
        "eval_interval": eval_every // iterations,
        "eval_schedule": "tunix",
        "enable_tensorboard": True,
        "profiler": "xplane" if profiler else "",
        "skip_first_n_steps_for_profiler": int(profiler.get("skip_first_n_steps", 1)),
        "profiler_steps": int(profiler.get("profiler_steps", 5)),
        **lora_values(config),
    }
    return load_config(None, values)
